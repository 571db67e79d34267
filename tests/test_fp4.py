"""FP4 (e2m1, per-32 UE8M0 scales) dequantization against an explicit per-element decode."""

import numpy as np

from djax import fp4


def _decode_one(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))


def test_e2m1_table_is_the_format():
    assert [_decode_one(c) for c in range(16)] == fp4.E2M1_TABLE.tolist()


def test_dequantize_matches_explicit_decode():
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (3, 5, 48), dtype=np.uint8)  # [experts, out, in / 2]
    scale = rng.integers(120, 135, (3, 5, 3), dtype=np.uint8)
    got = np.asarray(fp4.dequantize_fp4(packed.view(np.int8), scale, np.float32))
    want = np.zeros((3, 5, 96), np.float32)
    for idx in np.ndindex(3, 5, 48):
        lo, hi = packed[idx] & 15, packed[idx] >> 4
        s = 2.0 ** (int(scale[idx[0], idx[1], idx[2] // 16]) - 127)
        want[idx[0], idx[1], 2 * idx[2]] = _decode_one(lo) * s
        want[idx[0], idx[1], 2 * idx[2] + 1] = _decode_one(hi) * s
    np.testing.assert_array_equal(got, want)


def test_quantize_round_trip_within_half_a_step():
    w = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    packed, scale = fp4.quantize_fp4(w)
    back = np.asarray(fp4.dequantize_fp4(packed, scale, np.float32))
    step = 2.0 ** (scale.astype(np.float32) - 127)  # one unit at the largest e2m1 spacing is 2 * scale
    err = np.abs(back - w).reshape(4, 2, 32).max(-1)
    assert (err <= step + 1e-7).all()
