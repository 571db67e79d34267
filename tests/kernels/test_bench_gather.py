"""benchmarks/bench_gather.py: the layout its check expects is the one the kernel writes by address (16-byte unit
j of row r, chunk c at byte c * 8192 + r * 128 + (j ^ (r & 7)) * 16), and its CUDA compiles for sm_90a."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_gather as G  # noqa: E402


def test_swizzled_matches_the_kernels_addressing():
    block = np.random.default_rng(3).integers(0, 65535, (64, G.ROW_ELEMS), dtype=np.uint16)
    want = np.zeros(64 * G.ROW_ELEMS, np.uint16)
    for r in range(64):
        for c in range(8):
            for j in range(8):
                at = (c * 8192 + r * 128 + (j ^ (r & 7)) * 16) // 2
                want[at : at + 8] = block[r, c * 64 + j * 8 : c * 64 + j * 8 + 8]
    got = G.swizzled(block)
    assert (got == want).all()
    assert not (got == block.reshape(-1)).all()  # not the linear rows a bulk copy leaves


def test_gather_kernels_compile_for_sm90():
    from djax.kernels.dispatch import nvcc_path

    if nvcc_path() is None:
        pytest.skip("nvcc not found")
    binary = G.compile_cubin()
    for name in G.VARIANTS:
        assert name.encode() in binary
