"""benchmarks/bench_generate.py's FP4 model (`--fp4-experts`) on the CPU: every routed expert becomes an FP4
QArray the grouped GEMMs read as stored, of the bf16 stack's shape and about its RMS, and `dense_on_use` turns
it into the same weights in a form the kernels do not read (float scales), so part decode_dequant times the
path that makes them dense."""

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import djax
from djax.params import flatten_names, init_params_host
from djax.quant import QArray, dense, is_ue8m0_fp4

EXPERTS = re.compile(r"(^|\.)experts\.w[123]$")


@pytest.mark.parametrize("fp8_first", [False, True], ids=["bf16", "fp8_projections_too"])
def test_fp4_experts_replace_the_routed_stacks_and_dense_on_use_keeps_their_values(fp8_first):
    """With --fp8 as well the stacks are FP8 QArrays when they are replaced (V4.1 holds FP8 projections and
    FP4 experts)."""
    # imported here: the script sets XLA's GPU memory options when imported, which a GPU test run collecting
    # this module should not get
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_generate as bg

    cfg = bg.make_config(tiny=True)
    params = init_params_host(cfg, 0)
    if fp8_first:
        params = djax.quantize_projections(params, cfg)
    fp4 = bg.fp4_experts(params, jax.random.key(1))
    before, after = flatten_names(params), flatten_names(fp4)
    routed = [n for n in before if EXPERTS.search(n)]
    assert routed and len(routed) == 3 * sum(1 for lp in params["layers"] if "experts" in lp["ffn"])
    for name in before:
        if name not in routed:
            assert after[name] is before[name]  # nothing else changes
            continue
        w, q = before[name], after[name]
        assert is_ue8m0_fp4(q) and q.shape == w.shape
        rms = lambda x: float(jnp.sqrt(jnp.mean(jnp.square(dense(x, jnp.float32)))))  # noqa: E731
        assert 0.5 < rms(q) / rms(w) < 2.0  # the scale is the power of two nearest in log
    made_dense = flatten_names(bg.dense_on_use(fp4))
    for name in routed:
        q, d = after[name], made_dense[name]
        assert isinstance(d, QArray) and not is_ue8m0_fp4(d) and d.scale.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(dense(d, jnp.float32)), np.asarray(dense(q, jnp.float32)))


def test_fp4_experts_can_free_the_stacks_they_replace():
    """--fp4-experts builds the FP4 stacks with delete_originals (an 80 GB card cannot hold both forms):
    exactly the replaced stacks' arrays are deleted, and the FP4 stacks are those built without it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_generate as bg

    cfg = bg.make_config(tiny=True)
    fp8 = djax.quantize_projections(init_params_host(cfg, 0), cfg)  # the stacks are QArrays: both leaves go
    want = flatten_names(bg.fp4_experts(jax.device_put(fp8), jax.random.key(1)))
    params = jax.device_put(fp8)
    before = flatten_names(params)
    after = flatten_names(bg.fp4_experts(params, jax.random.key(1), delete_originals=True))
    for name, w in before.items():
        deleted = [a.is_deleted() for a in jax.tree.leaves(w)]
        if EXPERTS.search(name):
            assert all(deleted), name
            np.testing.assert_array_equal(np.asarray(after[name].values), np.asarray(want[name].values))
            np.testing.assert_array_equal(
                np.asarray(after[name].scale.astype(jnp.float32)),
                np.asarray(want[name].scale.astype(jnp.float32)),
            )
        else:
            assert not any(deleted) and after[name] is w, name
