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
