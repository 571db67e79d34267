"""On a CUDA GPU: the model with its fast paths ("grouped" MoE = the Triton grouped GEMMs there) against the
slow twin ("dense" MoE), in bf16, measured against a float32 run of the slow twin."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import djax

pytestmark = pytest.mark.gpu


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_forward_and_decode_fast_paths_within_bf16_error(name):
    # Kernel-friendly sizes (multiples of the GEMM tiles), more experts than picks so routing is uneven.
    cfg = djax.preset(name).replace(hidden_size=256, moe_intermediate_size=256, n_routed_experts=16)
    bf = cfg.replace(dtype="bfloat16")
    pbf = djax.init_params(bf, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (4, 96), 0, cfg.vocab_size)
    # The truth: the same (bf16-rounded) weights computed in float32 by the slow twin.
    p32 = jax.tree.map(lambda w: w.astype(jnp.float32) if w.dtype == jnp.bfloat16 else w, pbf)
    truth = djax.forward(p32, tokens, cfg, moe_impl="dense")
    slow = djax.forward(pbf, tokens, bf, moe_impl="dense")
    fast = djax.forward(pbf, tokens, bf, moe_impl="grouped")
    err_slow, err_fast = _rel(slow, truth), _rel(fast, truth)
    # The fast path may round differently, but no worse than the bf16 slow twin does (plus slack for order).
    assert err_fast <= 2 * err_slow + 1e-3, (err_fast, err_slow)

    # Teacher-forced decode steps through the state: the last step's logits, judged the same way.
    lens = jnp.full((4,), 64, jnp.int32)

    def decode(p, c, impl):
        logits, state = djax.prefill(p, tokens[:, :64], lens, c, max_len=96, moe_impl=impl)
        for t in range(64, 72):
            logits, state = djax.decode(p, tokens[:, t], state, c, moe_impl=impl)
        return logits

    truth = decode(p32, cfg, "dense")
    err_slow, err_fast = _rel(decode(pbf, bf, "dense"), truth), _rel(decode(pbf, bf, "grouped"), truth)
    assert err_fast <= 2 * err_slow + 1e-3, (err_fast, err_slow)
