"""numpy brute force of the FP8 activation quantization (1x128 groups), for the tests that check the jnp path
and the model against it: written from the rules, not from djax's code."""

from __future__ import annotations

import ml_dtypes
import numpy as np


def pow2_ceil(s) -> np.ndarray:
    """The smallest power of two >= s (s > 0), float64: frexp gives s = m 2^e with m in [0.5, 1)."""
    m, e = np.frexp(np.asarray(s, np.float64))
    return np.ldexp(1.0, np.where(m == 0.5, e - 1, e))


def act_scales(groups: np.ndarray, ue8m0: bool = False) -> np.ndarray:
    """One scale per 128-column group (the last axis): amax / 448 (amax floored at 1e-12); ue8m0 (DeepSeek's
    rule for weights with power-of-two scales): amax floored at 1e-4, times float32(1 / 448), rounded up to a
    power of two."""
    amax = np.abs(groups).max(-1)
    if ue8m0:
        return pow2_ceil(np.maximum(amax, 1e-4).astype(np.float32) * np.float32(1 / 448))
    return np.maximum(amax.astype(np.float64), 1e-12) / 448.0


def quantize_rows(x, ue8m0: bool = False) -> np.ndarray:
    """x [m, k] (k a multiple of 128) with each row's 128-column groups scaled by `act_scales`, rounded to
    e4m3 and scaled back, in float64."""
    x = np.asarray(x, np.float64)
    m, k = x.shape
    g = x.reshape(m, k // 128, 128)
    s = act_scales(g, ue8m0)[..., None]
    return ((g / s).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * s).reshape(m, k)


def quantize_f32(rows, ue8m0: bool = False):
    """The 1 x 128 rule in float32 arithmetic, as the kernels state it: scale = amax times float32(1 / 448)
    (amax floored at 1e-12), or with UE8M0 max(amax, 1e-4) times it rounded up to a power of two; values
    rows / scale by numpy's IEEE division, rounded to e4m3. Returns (e4m3 [m, n], float32 [m, n / 128])."""
    m, n = rows.shape
    g = rows.astype(np.float32).reshape(m, n // 128, 128)
    amax = np.abs(g).max(-1)
    if ue8m0:
        s = pow2_ceil(np.maximum(amax, np.float32(1e-4)) * np.float32(1 / 448)).astype(np.float32)
    else:
        s = np.maximum(amax, np.float32(1e-12)) * np.float32(1 / 448)
    q = (g / s[..., None]).astype(ml_dtypes.float8_e4m3fn).reshape(m, n)
    return q, s


def hard_rows(seed, r, n=256):
    """float32 rows [r, n] whose quotients by their scale sit within a few ulps of e4m3 rounding midpoints
    (ties included), over scales from 1e-14 to 1e30 (and one row on the amax floor); with zeros (row 0),
    negative zeros (row 1), subnormals beside a normal amax (row 2), a row under the amax floor (3), a row of
    one value (4), and a row with an infinity (5: its scale infinite, the finite values give 0, the infinity
    NaN)."""
    rng = np.random.default_rng(seed)
    e4m3 = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)))
    e4m3 = e4m3[np.isfinite(e4m3)]
    mids = (e4m3[1:] + e4m3[:-1]) / 2
    scale = 10.0 ** rng.uniform(-14, 30, (r, 1))
    q = rng.choice(np.concatenate([mids, e4m3]), (r, n)) * rng.choice([-1, 1], (r, n))
    x = (q * scale).astype(np.float32)
    ulps = rng.integers(-3, 4, (r, n)).astype(np.int32)
    x = (x.view(np.int32) + np.where(x != 0, ulps, 0)).view(np.float32)  # a few ulps either side
    x[:, 0] = 448 * scale[:, 0]  # amax near 448 scales
    x[0, :] = 0.0
    x[1, 1::2] = -0.0
    x[2, 5:] = np.float32(1e-42) * rng.choice([-1, 1], n - 5)  # subnormals beside a normal amax
    x[3, :] = np.float32(1e-15)  # below the amax floor
    x[4, :] = -3.0
    x[5, 7] = np.inf
    return x
