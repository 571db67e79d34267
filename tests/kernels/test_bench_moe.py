"""benchmarks/bench_moe.py's contiguous layouts for the FP8 grouped GEMM at expert-parallel shapes: every group
starts at a multiple of the tile height, holds its rows and then padding (-1), and the sizes are reproducible."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_moe as M  # noqa: E402


def test_contiguous_indices_pads_each_group_to_the_tile():
    sizes = np.array([1, 128, 129, 300, 77])
    mi = M.contiguous_indices(sizes, block_m=128)
    padded = -(-sizes // 128) * 128
    assert mi.dtype == np.int32 and mi.size == padded.sum()
    starts = np.r_[0, np.cumsum(padded)[:-1]]
    for g, (start, rows, span) in enumerate(zip(starts, sizes, padded, strict=True)):
        assert start % 128 == 0
        assert (mi[start : start + rows] == g).all()
        assert (mi[start + rows : start + span] == -1).all()


def test_group_sizes_are_uneven_within_bounds_and_fixed_by_the_seed():
    a = M.group_sizes(32, 768, seed=7)
    assert a.shape == (32,) and len(set(a.tolist())) > 1
    assert (a >= int(0.7 * 768)).all() and (a <= int(1.3 * 768)).all()
    assert (a == M.group_sizes(32, 768, seed=7)).all()
    assert not (a == M.group_sizes(32, 768, seed=8)).all()
