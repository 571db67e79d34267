"""Shared comparison helpers for kernel tests: inf/nan positions first, then relative error, then the worst element."""

import importlib.util
import os

import numpy as np
import pytest

needs_triton_interp = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs triton with TRITON_INTERPRET=1 (CPU)",
)


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
