"""benchmarks/bench_gather.py: the layout its check expects is the one the kernel writes by address (16-byte unit
j of row r, chunk c at byte c * 8192 + r * 128 + (j ^ (r & 7)) * 16), and its CUDA compiles for sm_90a."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_gather as G  # noqa: E402


@pytest.mark.parametrize("cols", [G.ROW_ELEMS, 256], ids=["whole_rows", "half_rows"])
def test_swizzled_matches_the_kernels_addressing(cols):
    block = np.random.default_rng(3).integers(0, 65535, (64, cols), dtype=np.uint16)
    want = np.zeros(64 * cols, np.uint16)
    for r in range(64):
        for c in range(cols // 64):
            for j in range(8):
                at = (c * 8192 + r * 128 + (j ^ (r & 7)) * 16) // 2
                want[at : at + 8] = block[r, c * 64 + j * 8 : c * 64 + j * 8 + 8]
    got = G.swizzled(block)
    assert (got == want).all()
    assert not (got == block.reshape(-1)).all()  # not the linear rows a bulk copy leaves


def test_in_place_rearrangement_lands_as_the_expected_half_block():
    """`half_bulk_relaid`: the bulk copies put row 8 G + e of the block at byte (e / 2) * 8192 + G * 1024 +
    (e % 2) * 512; each producer warp then takes groups warp, warp + 4, its lanes reading unit `lane` of the
    group's 8 rows before writing each at (lane / 8) * 8192 + G * 1024 + e * 128 + ((lane % 8) ^ e) * 16
    (masked rows as zeros). A numpy run of that arithmetic leaves what `expected_dump` says CTA 0's last block
    must hold, as does the cp.async variant; bulk copies alone leave linear rows."""
    rng = np.random.default_rng(5)
    pool = rng.integers(0, 65535, (4 * G.REGION, G.ROW_ELEMS), dtype=np.uint16)
    idx = rng.integers(0, 4 * G.REGION, (4, G.BLOCKS * 64)).astype(np.int32)
    gg = G.HALF_BLOCKS - 1
    n = np.arange(gg * 64, gg * 64 + 64)
    rows = pool[idx[:2].reshape(-1)[n], :256].reshape(64, 32, 8)  # row, 16-byte unit, values
    stage = np.zeros((2048, 8), np.uint16)  # 16-byte units
    for p in range(64):
        grp, e = divmod(p, 8)
        if G.half_row_valid(gg * 64 + p):
            at = ((e // 2) * 8192 + grp * 1024 + (e % 2) * 512) // 16
            stage[at : at + 32] = rows[p]
    for warp in range(4):
        for grp in range(warp, 8, 4):
            base = grp * 1024
            read = {(m, lane): stage[(base + (m // 2) * 8192 + (m % 2) * 512 + lane * 16) // 16].copy()
                    for m in range(8) for lane in range(32)}  # fmt: skip
            for m in range(8):
                for lane in range(32):
                    ok = G.half_row_valid(gg * 64 + grp * 8 + m)
                    at = (base + (lane // 8) * 8192 + m * 128 + (((lane % 8) ^ m) * 16)) // 16
                    stage[at] = read[m, lane] if ok else 0
    want = G.expected_dump(7, pool, idx)
    assert (stage.reshape(-1) == want).all()
    assert (~G.half_row_valid(n)).any() and (G.expected_dump(5, pool, idx) == want).all()
    assert (G.expected_dump(6, pool, idx) == rows.reshape(-1)).all()  # bulk alone: linear rows


def test_gather_kernels_compile_for_sm90():
    from djax.kernels.dispatch import nvcc_path

    if nvcc_path() is None:
        pytest.skip("nvcc not found")
    binary = G.compile_cubin()
    for name in G.VARIANTS:
        assert name.encode() in binary
