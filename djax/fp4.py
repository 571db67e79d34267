"""FP4 (e2m1) weights with one power-of-two (UE8M0) scale per 32 inputs: V4.1's routed-expert format."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

GROUP = 32
# e2m1 magnitudes by the 3 low bits of a code; bit 3 is the sign.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E2M1_TABLE = np.concatenate([E2M1, -E2M1])


def unpack_e2m1(packed) -> jnp.ndarray:
    """int8/uint8[..., k / 2], two codes a byte (low nibble = even index) -> f32[..., k]."""
    b = jnp.asarray(packed).astype(jnp.uint8)
    codes = jnp.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)
    return jnp.asarray(E2M1_TABLE)[codes.astype(jnp.int32)]


def ue8m0_to_float(scale) -> jnp.ndarray:
    """UE8M0 exponents (uint8 bytes, or a float8_e8m0fnu array) -> f32 powers of two 2^(e - 127)."""
    s = jnp.asarray(scale)
    if s.dtype == jnp.uint8:
        return jnp.exp2(s.astype(jnp.float32) - 127.0)
    return s.astype(jnp.float32)


def dequantize_fp4(packed, scale, dtype=jnp.bfloat16) -> jnp.ndarray:
    """packed int8[..., out, in / 2] with scale [..., out, in / 32] -> dtype[..., out, in]."""
    w = unpack_e2m1(packed)
    s = ue8m0_to_float(scale)
    w = w.reshape(*w.shape[:-1], -1, GROUP) * s[..., None]
    return w.reshape(*w.shape[:-2], -1).astype(dtype)


def quantize_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reference encoder for tests: f32[..., out, in] -> (packed uint8[..., in / 2], UE8M0 uint8[..., in / 32]).

    Each group's scale is the smallest power of two with max|w| / scale <= 6; codes round to nearest.
    """
    g = w.reshape(*w.shape[:-1], -1, GROUP).astype(np.float32)
    amax = np.maximum(np.abs(g).max(-1, keepdims=True), 2.0**-126)
    e = np.clip(np.ceil(np.log2(amax / 6.0)), -127, 127)
    q = g / 2.0**e
    idx = np.abs(np.abs(q)[..., None] - E2M1).argmin(-1) + 8 * (q < 0)
    codes = idx.reshape(*w.shape).astype(np.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (e[..., 0] + 127).astype(np.uint8)
