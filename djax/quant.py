"""Quantized weights kept as they are on disk: FP8 e4m3 with block scales, FP4 e2m1 with per-32 scales."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from djax import fp4

FP8 = jnp.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
FP4 = jnp.dtype(ml_dtypes.float4_e2m1fn)  # the element type a packed FP4 QArray reports
E8M0 = jnp.dtype(ml_dtypes.float8_e8m0fnu)
FP4_BLOCK = (1, fp4.GROUP)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QArray:
    """A quantized weight [..., o, i] in one of two formats, told apart by the values' dtype.

    FP8: values e4m3 (or e5m2) [..., o, i]; scale f32 [..., ceil(o / block[0]), ceil(i / block[1])];
    the dense weight is values * scale broadcast over each block (the last block of a dim may be
    partial).
    FP4 (V4.1's routed experts): values uint8 [..., o, i / 2], two e2m1 codes a byte (low nibble =
    even input); scale [..., o, i / 32], UE8M0 powers of two as float8_e8m0fnu (f32 / bf16 scales
    also work); block is (1, 32). `shape` is the logical [..., o, i] and `dtype` float4_e2m1fn.

    Leading dims (stacked experts) index both arrays alike: `q[e]` is expert e, `q[idx]` gathers.
    The model dequantizes on use (`dense`), so only the narrow bytes live in memory between steps.
    """

    values: jax.Array
    scale: jax.Array
    block: tuple[int, int] = field(metadata=dict(static=True), default=(128, 128))

    @property
    def is_fp4(self) -> bool:
        return self.values.dtype == jnp.uint8

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, o, i = self.values.shape
        return (*lead, o, 2 * i) if self.is_fp4 else (*lead, o, i)

    @property
    def dtype(self):
        return FP4 if self.is_fp4 else self.values.dtype

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held: the narrow values plus the scales."""
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in (self.values, self.scale))

    def __getitem__(self, idx) -> QArray:
        """Index the leading (non-block) dims, e.g. one expert of a stacked [e, o, i] weight."""
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(idx) > self.ndim - 2:
            raise IndexError(f"QArray of shape {self.shape} can only be indexed on its leading dims")
        return QArray(self.values[idx], self.scale[idx], self.block)

    def dense(self, dtype=jnp.bfloat16) -> jax.Array:
        """values * scale (computed in float32), cast to dtype."""
        if self.is_fp4:
            return fp4.dequantize_fp4(self.values, self.scale, dtype)
        bo, bi = self.block
        *_, o, i = self.values.shape
        s = jnp.repeat(jnp.repeat(jnp.asarray(self.scale, jnp.float32), bo, axis=-2), bi, axis=-1)[
            ..., :o, :i
        ]
        return (jnp.asarray(self.values).astype(jnp.float32) * s).astype(dtype)


def is_ue8m0_fp4(w) -> bool:
    """Whether w is an FP4 QArray with UE8M0 scales (float8_e8m0fnu or uint8 bytes): the form V4.1's routed
    experts load in, which the grouped GEMM kernels read as stored. FP4 with float scales is made dense."""
    return isinstance(w, QArray) and w.is_fp4 and jnp.dtype(w.scale.dtype) in (E8M0, jnp.dtype(jnp.uint8))


def from_fp4(packed, scale) -> QArray:
    """An FP4 QArray from packed codes (int8 / uint8 [..., o, i / 2]) and scales [..., o, i / 32].

    uint8 scales are UE8M0 exponent bytes and are reinterpreted (not converted) as float8_e8m0fnu;
    float scales are kept in their dtype. numpy inputs stay numpy (host side), jax stay jax.
    """
    xp = np if isinstance(packed, np.ndarray) and isinstance(scale, np.ndarray) else jnp
    packed = xp.asarray(packed)
    scale = xp.asarray(scale)
    if packed.dtype == xp.int8:
        packed = packed.view(xp.uint8)
    if scale.dtype == xp.uint8:
        scale = scale.view(E8M0)
    *lead, o, half = packed.shape
    if tuple(scale.shape) != (*lead, o, 2 * half // fp4.GROUP) or (2 * half) % fp4.GROUP:
        raise ValueError(
            f"FP4 scale shape {tuple(scale.shape)} does not match packed codes {tuple(packed.shape)} "
            f"(one scale per {fp4.GROUP} inputs)"
        )
    return QArray(packed, scale, FP4_BLOCK)


def dense(w, dtype) -> jax.Array:
    """A weight as a dense array of `dtype`, whether it is stored plain or quantized (FP8 or FP4)."""
    if isinstance(w, QArray):
        return w.dense(dtype)
    return w.astype(dtype)


SCALE_FMTS = (None, "ue8m0")


def pow2_ceil(s):
    """2^ceil(log2(s)) for positive normal float32 s, from its bits as DeepSeek's `fast_round_scale`: the
    exponent, plus one where any mantissa bit is set (a power of two stays itself). numpy or jnp alike."""
    xp = np if isinstance(s, np.ndarray) else jnp
    bits = xp.asarray(s, xp.float32).view(xp.uint32)
    exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).astype(xp.uint32)
    return (exponent << 23).view(xp.float32)


def has_ue8m0_scales(w) -> bool:
    """Whether w is an FP8 QArray whose block scales are UE8M0 (float8_e8m0fnu: powers of two), the form of
    checkpoints whose `quantization_config` says `"scale_fmt": "ue8m0"` (DeepSeek V3.1 on, V4). DeepSeek's
    inference quantizes the activations of such weights with power-of-two scales too (`quantize_act`)."""
    return isinstance(w, QArray) and not w.is_fp4 and jnp.dtype(w.scale.dtype) == E8M0


def quantize(w, block: tuple[int, int] = (128, 128), scale_fmt: str | None = None) -> QArray:
    """Block-wise FP8 e4m3 quantization of w [..., o, i]: each block's max |w| maps to 448.

    Returns a QArray with values e4m3[..., o, i] and scale f32[..., ceil(o / bo), ceil(i / bi)],
    scale = amax / 448 (a tiny floor for all-zero blocks); with scale_fmt "ue8m0" that scale rounded up to
    a power of two, held as float8_e8m0fnu (the block's max then maps to 224-448). A numpy w is quantized
    on the host with numpy (what checkpoint writing wants); a jax w with jnp (jittable with `block` static).
    """
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt must be one of {SCALE_FMTS}, got {scale_fmt!r}")
    xp = np if isinstance(w, np.ndarray) else jnp
    bo, bi = block
    w = xp.asarray(w, xp.float32)
    *lead, o, i = w.shape
    no, ni = -(-o // bo), -(-i // bi)
    padded = xp.pad(w, [(0, 0)] * len(lead) + [(0, no * bo - o), (0, ni * bi - i)])
    blocks = padded.reshape(*lead, no, bo, ni, bi)
    amax = xp.max(xp.abs(blocks), axis=(-3, -1))  # f32[..., no, ni]
    scale = (xp.maximum(amax, xp.float32(1e-12)) * xp.float32(1 / FP8_MAX)).astype(xp.float32)
    if scale_fmt == "ue8m0":
        scale = pow2_ceil(scale)
    q = (blocks / scale[..., :, None, :, None]).reshape(*lead, no * bo, ni * bi)[..., :o, :i]
    scale = scale.astype(E8M0) if scale_fmt == "ue8m0" else scale
    return QArray(xp.clip(q, -FP8_MAX, FP8_MAX).astype(FP8), scale, (bo, bi))


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The block-scale shape of a weight of `shape`: the last two dims divided by block, rounded up."""
    return (*shape[:-2], *(-(-n // b) for n, b in zip(shape[-2:], block)))


def scale_sharding(sharding: Sharding, shape: tuple[int, ...]) -> Sharding:
    """How a block scale of `shape` shards when its weight shards as `sharding`.

    A NamedSharding keeps the weight's mesh axes on every dim the (smaller) scale dim still
    divides, and replicates the others; any other sharding is used as it is.
    """
    if not isinstance(sharding, NamedSharding):
        return sharding
    sizes = dict(sharding.mesh.shape)
    spec = []
    for dim, entry in zip(shape, (*sharding.spec, *(None,) * len(shape))):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        spec.append(entry if dim % int(np.prod([sizes[a] for a in axes])) == 0 else None)
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))
