"""Every routed-expert implementation against the slow twin (a scan over experts), on fresh random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from djax.models import moe
from djax.quant import quantize

E, F, D, K = 8, 24, 32, 2


def _inputs(n, seed):
    ks = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(ks[0], (n, D))
    w1 = jax.random.normal(ks[1], (E, F, D)) * D**-0.5
    w3 = jax.random.normal(ks[2], (E, F, D)) * D**-0.5
    w2 = jax.random.normal(ks[3], (E, D, F)) * F**-0.5
    idx = jax.vmap(lambda k: jax.random.choice(k, E, (K,), replace=False))(jax.random.split(ks[4], n)).astype(
        jnp.int32
    )
    weights = jax.random.uniform(ks[5], (n, K), minval=0.1, maxval=1.0)
    return x, weights, idx, w1, w2, w3


@pytest.mark.parametrize("impl", ["gather", "batched", "ragged", "grouped"])
@pytest.mark.parametrize("n", [3, 40])
def test_impl_matches_dense(impl, n):
    x, weights, idx, w1, w2, w3 = _inputs(n, seed=n)
    want = moe.experts_dense(x, weights, idx, w1, w2, w3, limit=1.5)
    got = getattr(moe, f"experts_{impl}")(x, weights, idx, w1, w2, w3, limit=1.5)
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max())
    )


def test_gather_reads_quantized_experts():
    x, weights, idx, w1, w2, w3 = _inputs(3, seed=7)
    q1, q2, q3 = (quantize(w, (8, 8)) for w in (w1, w2, w3))
    want = moe.experts_dense(
        x, weights, idx, q1.dense(jnp.float32), q2.dense(jnp.float32), q3.dense(jnp.float32), 0.0
    )
    got = moe.experts_gather(x, weights, idx, q1, q2, q3, 0.0)
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max())
    )


def test_grouped_takes_the_triton_kernels_on_cuda_only_for_bf16(monkeypatch):
    """On CUDA the bf16 experts run the Triton grouped GEMMs; float32 ones (whose tiles would overflow an
    H200 block's shared memory) take the XLA path and still equal the dense twin."""
    from djax.kernels import dispatch
    from djax.models import moe as moe_mod

    monkeypatch.setattr(dispatch, "on_cuda", lambda: True)
    monkeypatch.setattr(dispatch, "has_triton", lambda: True)
    calls = []
    monkeypatch.setattr(moe_mod, "experts_triton", lambda x, *a: calls.append(x.dtype) or jnp.zeros_like(x))
    ks = jax.random.split(jax.random.key(3), 6)
    n, d, f, e, k = 5, 128, 128, 4, 2
    x = jax.random.normal(ks[0], (n, d))
    w1, w3 = (jax.random.normal(kk, (e, f, d)) * d**-0.5 for kk in ks[1:3])
    w2 = jax.random.normal(ks[3], (e, d, f)) * f**-0.5
    idx = jax.random.randint(ks[4], (n, k), 0, e)
    wts = jax.nn.softmax(jax.random.normal(ks[5], (n, k)), -1)
    moe_mod.experts_grouped(x.astype(jnp.bfloat16), wts, idx, w1, w2, w3, 10.0)
    assert calls == [jnp.bfloat16]
    got = moe_mod.experts_grouped(x, wts, idx, w1, w2, w3, 10.0)
    want = moe_mod.experts_dense(x, wts, idx, w1, w2, w3, 10.0)
    assert calls == [jnp.bfloat16]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)

    # FP8 experts in DeepGEMM's layout go to the FP8 grouped GEMMs as stored; any other QArray is made dense
    fp8 = []
    monkeypatch.setattr(moe_mod, "experts_fp8", lambda x, *a: fp8.append(x.dtype) or jnp.zeros_like(x))
    q = [quantize(w) for w in (w1, w2, w3)]
    moe_mod.experts_grouped(x.astype(jnp.bfloat16), wts, idx, *q, 10.0)
    assert fp8 == [jnp.bfloat16] and calls == [jnp.bfloat16]
    moe_mod.experts_grouped(
        x.astype(jnp.bfloat16), wts, idx, *(quantize(w, (64, 64)) for w in (w1, w2, w3)), 10.0
    )
    assert fp8 == [jnp.bfloat16] and calls == [jnp.bfloat16] * 2
