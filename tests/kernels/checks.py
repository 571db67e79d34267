"""Shared helpers for kernel tests: comparisons (inf/nan positions first, then relative error, then the worst
element) and the sparse decode inputs."""

import importlib.util
import os

import jax.numpy as jnp
import numpy as np
import pytest

needs_triton_interp = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton with TRITON_INTERPRET=1 (CPU)",
)
needs_tilelang = pytest.mark.skipif(
    importlib.util.find_spec("tilelang") is None, reason="needs tilelang (pip install tilelang==0.1.15)"
)


def ascend_backend_missing() -> str | None:
    """Why TileLang cannot lower to AscendC here, or None. Mainline wheels (0.1.15) ship the Ascend target;
    a build without it says so."""
    import tilelang
    from tilelang import tvm

    if not hasattr(tilelang, "ascend"):
        return f"tilelang {tilelang.__version__} has no tilelang.ascend package"
    if tvm.get_global_func("target.build.tilelang_ascend_without_compile", allow_missing=True) is None:
        return "tilelang was built without its Ascend codegen (USE_ASCEND=OFF)"
    return None


def assert_close(out, ref, rtol: float):
    """Same inf/nan pattern, then ||out - ref|| / ||ref|| <= rtol over the finite entries."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert not np.isnan(out).any(), "nan in output"
    np.testing.assert_array_equal(np.isinf(out), np.isinf(ref))
    np.testing.assert_array_equal(np.where(np.isinf(ref), ref, 0), np.where(np.isinf(out), out, 0))
    fin = np.isfinite(ref)
    diff = np.abs(np.where(fin, out, 0) - np.where(fin, ref, 0))
    err = np.linalg.norm(diff) / max(np.linalg.norm(ref[fin]), 1e-30)
    worst = np.unravel_index(np.argmax(diff), ref.shape)
    assert err <= rtol, f"rel err {err:.3e} > {rtol:.1e}; worst at {worst}: {out[worst]} vs {ref[worst]}"


def sparse_decode_inputs(seed, b, h, k, w, c, t):
    """Sparse decode operands, random and never zero: ~20% masked ring slots, invalid picks (-1 and >= C),
    the last row with nothing to attend."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, h, k)), jnp.bfloat16)
    win = jnp.asarray(rng.standard_normal((b, w, k)), jnp.bfloat16)
    valid = rng.random((b, w)) < 0.8
    valid[-1] = False
    pool = jnp.asarray(rng.standard_normal((b, c, k)), jnp.bfloat16)
    top = rng.integers(-1, c + 3, (b, t)).astype(np.int32)  # -1 and c .. c+2 are invalid
    top[0, :5] = [-1, c, c + 7, -100, 0]
    top[-1] = -1
    sinks = rng.standard_normal(h).astype(np.float32)
    return q, win, jnp.asarray(valid), pool, jnp.asarray(top), jnp.asarray(sinks)


def random_fp4(rng, shape, scales=(118, 126)):
    """`fp4.random_fp4` of logical shape [..., o, i] keyed from the numpy generator `rng` (so a test's draws
    stay one sequence), UE8M0 scale bytes in [lo, hi)."""
    import jax

    from djax import fp4

    return fp4.random_fp4(jax.random.key(int(rng.integers(2**31))), shape, *scales)
