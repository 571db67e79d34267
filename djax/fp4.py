"""FP4 (e2m1) weights with one power-of-two (UE8M0) scale per 32 inputs: V4.1's routed-expert format."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

GROUP = 32
# e2m1 magnitudes by the 3 low bits of a code; bit 3 is the sign.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E2M1_TABLE = np.concatenate([E2M1, -E2M1])
_ROUTED_EXPERTS = re.compile(r"(^|\.)experts\.w[123]$")  # a layer's stacked routed experts


def packed_nbytes(shape: tuple[int, ...]) -> int:
    """Bytes of an FP4 weight of logical `shape` [..., o, i]: half a byte a value + one UE8M0 byte per 32."""
    n = int(np.prod(shape))
    return n // 2 + n // GROUP


def stored_nbytes(name: str, shape: tuple[int, ...], itemsize: int, expert_dtype: str | None) -> int:
    """Bytes weight `name` occupies when loaded kept-quantized: routed experts (`...experts.w1`) of a
    config whose `expert_dtype` is "fp4" at their packed size, every other weight shape x itemsize."""
    if expert_dtype == "fp4" and _ROUTED_EXPERTS.search(name):
        return packed_nbytes(shape)
    return int(np.prod(shape)) * itemsize


def unpack_e2m1(packed) -> jnp.ndarray:
    """int8/uint8[..., k / 2], two codes a byte (low nibble = even index) -> f32[..., k]."""
    b = jnp.asarray(packed).astype(jnp.uint8)
    codes = jnp.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)
    return jnp.asarray(E2M1_TABLE)[codes.astype(jnp.int32)]


def ue8m0_to_float(scale) -> jnp.ndarray:
    """UE8M0 exponents (uint8 bytes, or a float8_e8m0fnu array) -> f32 powers of two 2^(e - 127)."""
    s = jnp.asarray(scale)
    if s.dtype == jnp.uint8:
        # Same bits as e8m0; converting from it is exact (exp2 on CPU can be an ulp off).
        s = jax.lax.bitcast_convert_type(s, jnp.float8_e8m0fnu)
    return s.astype(jnp.float32)


def exponent_bytes(scale) -> jnp.ndarray:
    """UE8M0 scales (float8_e8m0fnu or uint8) as their exponent bytes, uint8: what the FP4 kernels read."""
    s = jnp.asarray(scale)
    return s if s.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(s, jnp.uint8)


def dequantize_fp4(packed, scale, dtype=jnp.bfloat16) -> jnp.ndarray:
    """packed int8[..., out, in / 2] with scale [..., out, in / 32] -> dtype[..., out, in]."""
    w = unpack_e2m1(packed)
    s = ue8m0_to_float(scale)
    w = w.reshape(*w.shape[:-1], -1, GROUP) * s[..., None]
    return w.reshape(*w.shape[:-2], -1).astype(dtype)


def random_fp4(key, shape: tuple[int, ...], lo: int, hi: int):
    """Random FP4 weights of logical shape [..., o, i] for tests and benchmarks, made where jax runs: every
    e2m1 code equally likely, UE8M0 scale bytes drawn from [lo, hi) (2^(lo - 127) .. 2^(hi - 128)). Returns a
    `QArray` with float8_e8m0fnu scales, as a V4.1 checkpoint loads."""
    from djax.quant import E8M0, from_fp4  # djax.quant imports this module

    *lead, o, i = shape
    k_codes, k_scale = jax.random.split(key)
    packed = jax.random.bits(k_codes, (*lead, o, i // 2), jnp.uint8)
    scale = jax.random.randint(k_scale, (*lead, o, i // GROUP), lo, hi).astype(jnp.uint8)
    return from_fp4(packed, jax.lax.bitcast_convert_type(scale, E8M0))


def quantize_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reference encoder for tests: f32[..., out, in] -> (packed uint8[..., in / 2], UE8M0 uint8[..., in / 32]).

    Each group's scale is the smallest power of two with max|w| / scale <= 6; codes round to nearest.
    """
    g = w.reshape(*w.shape[:-1], -1, GROUP).astype(np.float32)
    amax = np.maximum(np.abs(g).max(-1, keepdims=True), 2.0**-126)
    e = np.clip(np.ceil(np.log2(amax / 6.0)), -127, 127)
    q = g / 2.0**e
    idx = np.abs(np.abs(q)[..., None] - E2M1).argmin(-1) + 8 * np.signbit(q)  # -0.0 keeps its sign
    return pack_e2m1(idx.reshape(*w.shape)), (e[..., 0] + 127).astype(np.uint8)


def pack_e2m1(codes: np.ndarray) -> np.ndarray:
    """e2m1 codes (0..15) [..., k] -> uint8[..., k / 2], the inverse of `unpack_e2m1`'s byte layout."""
    codes = np.asarray(codes).astype(np.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)
