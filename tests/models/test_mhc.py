"""mHC's Sinkhorn projection: rolled and unrolled loops agree with a plain numpy loop."""

import jax
import numpy as np
import pytest

from djax.models.mhc import sinkhorn


def sinkhorn_numpy(logits: np.ndarray, iters: int, eps: float) -> np.ndarray:
    comb = np.exp(logits - logits.max(-1, keepdims=True))
    comb = comb / comb.sum(-1, keepdims=True) + eps
    comb = comb / (comb.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdims=True) + eps)
        comb = comb / (comb.sum(-2, keepdims=True) + eps)
    return comb


@pytest.mark.parametrize("unroll", [True, False])
def test_sinkhorn_matches_numpy(unroll):
    logits = 3.0 * np.asarray(jax.random.normal(jax.random.key(0), (5, 7, 4, 4)), np.float64)
    got = np.asarray(jax.jit(lambda x: sinkhorn(x, 20, 1e-6, unroll))(logits.astype(np.float32)))
    want = sinkhorn_numpy(logits, 20, 1e-6)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    # Columns sum to one after the last step; rows only roughly after 20 iterations on logits this peaked.
    np.testing.assert_allclose(got.sum(-2), 1.0, atol=1e-5)
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=5e-2)


def test_rolled_and_unrolled_gradients_agree():
    logits = jax.random.normal(jax.random.key(1), (3, 4, 4))
    w = jax.random.normal(jax.random.key(2), (3, 4, 4))

    def loss(x, unroll):
        return (sinkhorn(x, 20, 1e-6, unroll) * w).sum()

    g_rolled = jax.grad(loss)(logits, False)
    g_unrolled = jax.grad(loss)(logits, True)
    np.testing.assert_allclose(np.asarray(g_rolled), np.asarray(g_unrolled), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("unroll", [True, False])
def test_unrolled_sinkhorn_is_computed_once_behind_a_barrier(unroll):
    """Unrolled (the GPU default), the result passes an optimization barrier, so that XLA computes the chain in
    one kernel rather than copying it into each consumer's (four kernels a call at batch 1 on a GPU);
    rolled, the loop's result is in memory anyway and no barrier is added."""
    jaxpr = jax.make_jaxpr(lambda x: sinkhorn(x, 20, 1e-6, unroll))(np.ones((2, 4, 4), np.float32))
    names = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    assert names.count("optimization_barrier") == (1 if unroll else 0)
