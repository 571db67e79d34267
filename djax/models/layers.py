"""Shared blocks of the DeepSeek family: RMS norm, linear, rotary embeddings (plain and YaRN), SwiGLU MLP."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from djax.config import ModelConfig
from djax.kernels import dispatch
from djax.quant import QArray, dense, has_ue8m0_scales


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """RMS norm computed in float32; the (float32) weight multiplies before the cast back, as DeepSeek does."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = weight.astype(jnp.float32) * y
    return y.astype(x.dtype)


def unit_rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """Weightless RMS norm whose scale is computed in float32 but applied in x's dtype."""
    scale = jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True) + eps)
    return x * scale.astype(x.dtype)


# `kernels`, an argument of the models' step functions: how decode steps (chunks of one token) run attention
# and the indexer (V4), and how every chunk, prefill included, runs FP8 weights (`takes_fp8_gemm` projections:
# activations quantized 1x128, then `fp8_gemm`; other FP8 projections and the output LoRA's groups, up to
# FP8_WEIGHT_MAX_ROWS rows: `fp8_weight_gemm`; `takes_fp8_grouped` routed experts: the FP8 grouped GEMMs;
# other weights are made dense first). "auto": the kernels of djax.kernels
# where they apply (CUDA with Triton, bf16, kernel-friendly shapes), the jnp path everywhere else; "ref":
# through the kernels' jnp references on any backend (tests the plumbing); "off": the jnp path, FP8 weights
# made dense on use. The routed experts are the MoE impl's business (`moe.experts_grouped` takes the Triton
# kernels on CUDA, FP8 ones included, whatever `kernels` says); `kernels` only adds the FP8 experts' path
# under "ref" and "auto".
KERNEL_CHOICES = ("auto", "ref", "off")


def fp8_impl(dtype, kernels: str) -> str | None:
    """The `fp8_gemm` impl for FP8 weights in DeepGEMM's layout under `kernels`, in a chunk of any length
    with activations of `dtype`, or None: the weights made dense on use. The GEMM takes any number of rows
    (its "auto" picks the tiles for them), so unlike attention this is not a decode-step-only choice: a
    prefill chunk reads the narrow weights as stored too, as DeepSeek's inference does."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
    if kernels == "off":
        return None
    if kernels == "ref":
        return "ref"
    fast = dispatch.on_cuda() and dispatch.has_triton() and jnp.dtype(dtype) == jnp.bfloat16
    return "auto" if fast else None


def decode_impl(c: int, dtype, kernel_shapes: bool, kernels: str) -> str | None:
    """The djax.kernels impl of a decode-step kernel (attention, the indexer) for a chunk of c tokens under
    `kernels`, or None for the jnp path: `fp8_impl`'s choice at c = 1, where "auto" also needs
    `kernel_shapes`. On the fast path it is "auto": each op picks its kernel for the shapes it gets
    (TileLang or Triton attention, `lax.top_k` for a few rows)."""
    impl = fp8_impl(dtype, kernels)
    if c != 1 or (impl == "auto" and not kernel_shapes):
        return None
    return impl


def takes_fp8_gemm(w) -> bool:
    """Whether w is an FP8 weight in DeepGEMM's layout, which `fp8_gemm` reads as it is: an e4m3 QArray
    [out, in] with 128x128 scale blocks, out and in multiples of 128 (V3 and V4-Flash checkpoints; V4.1's
    32x32 blocks and FP4 experts are not)."""
    return _deepgemm_fp8(w, 2)


def takes_fp8_grouped(w) -> bool:
    """Whether a stacked expert weight is FP8 in DeepGEMM's layout, which the block-scaled grouped GEMM
    (`kernels.moe_experts.moe_experts_fp8`) reads as stored: as for `takes_fp8_gemm`, [e, out, in]."""
    return _deepgemm_fp8(w, 3)


# Rows up to which an FP8 weight in another block layout (`takes_fp8_weight_gemm`) is read as stored by
# `fp8_weight_gemm` instead of made dense on use. H200, 2026-12-05 (`kernels_h200_fp8_weight.json`, device
# time, 32 x 32 blocks, V4.1's shapes and wo_a): at 128 rows the kernel was 1.13-2.20x faster than dense on
# use on all six shapes (e.g. 36.1 against 79.3 us at 32768 x 1280); at 256 rows it lost on five (e.g. 134.8
# against 88.1 us at 5120 x 8192): its dot runs at a fraction of cuBLAS's rate, and XLA fuses the
# dequantisation into its own GEMM cheaply.
FP8_WEIGHT_MAX_ROWS = 128
# Rows up to which a `takes_fp8_gemm` weight runs as `fp8_quant_gemm`, the activations quantized inside the
# GEMM, instead of `quantize_act` then `fp8_gemm`, with UE8M0 scales (V4's) and plain ones alike. H100,
# 2026-12-06, device time, V4-Flash's six projection shapes (`fp8_quant_gemm_h100_swap_ab.json`,
# `_swap_defaults_ab.json`): UE8M0, the kernel's default tiles at 1, 8, 16 and 32 rows 1.14-1.76x faster than the
# two steps (15.92 against 18.98 us at 32768 x 1024, 32 rows); plain, 1.12-1.48x at 16 rows (default tiles) and
# 1.09-1.40x at 1 and 8 (unswapped 16-row tiles), but at 32 rows 7% and 10% slower at 32768 x 1024 and 4096 x
# 8192 (each row's IEEE divisions). Since its quotient takes no division (`fp8_quant_triton.MARKSTEIN`,
# `NEWTON`; H100, 2026-12-07, `fp8_quant_gemm_h100_newton_ab.json`, two rounds), plain at 32 rows 1.006-1.58x
# faster than the two steps at the six shapes, even within noise at 4096 x 8192 (18.52 / 18.39 against 18.62 /
# 18.52 us), faster at the rest (8.85 /
# 8.81 against 9.04 / 9.09 at 4096 x 2048, 5.69 against 8.98 / 8.97 at 512 x 4096).
# The decode step at batch 1: with UE8M0 scales 1.49-1.54 ms against 1.66, 26 fewer kernels, the GPU's busy
# time unchanged (`launches_h100_quant_gemm_ab.json`); with plain ones the GPU's busy time the same to 0.3%,
# 26 fewer kernels (`launches_h100_quant_gemm_plain_ab.json`).
FP8_QUANT_GEMM_MAX_ROWS = 32


def fp8_weight_readable(w) -> bool:
    """Whether `fp8_weight_gemm` can read w as stored: an e4m3 QArray [out, in] whose scale blocks' input side
    divides 128 (DeepGEMM's 128 x 128 blocks and V4.1's 32 x 32 alike)."""
    if not isinstance(w, QArray) or w.is_fp4 or w.values.ndim != 2:
        return False
    return w.values.dtype == jnp.float8_e4m3fn and 128 % w.block[1] == 0


def takes_fp8_weight_gemm(w) -> bool:
    """Whether `linear` reads w with `fp8_weight_gemm`: readable by it (`fp8_weight_readable`) and not in
    DeepGEMM's layout, which `fp8_gemm` takes (V4.1's 32 x 32 blocks, a dim not a multiple of 128)."""
    return fp8_weight_readable(w) and not takes_fp8_gemm(w)


def _deepgemm_fp8(w, ndim: int) -> bool:
    if not isinstance(w, QArray) or w.is_fp4 or w.values.ndim != ndim or tuple(w.block) != (128, 128):
        return False
    o, i = w.values.shape[-2:]
    return w.values.dtype == jnp.float8_e4m3fn and o % 128 == 0 and i % 128 == 0


def linear(x: jax.Array, w: jax.Array, fp8: str | None = None) -> jax.Array:
    """x @ w.T with w in torch layout [out, in].

    With `fp8` (an impl of `djax.kernels.fp8_gemm`) and a weight `takes_fp8_gemm` accepts, the product runs
    as DeepSeek's inference runs it: x quantized to e4m3 per row and 128 columns (dynamic 1x128 scales,
    powers of two where the weight's scales are UE8M0, `has_ue8m0_scales`), then the block-scaled FP8
    GEMM, which reads the narrow weight as stored; up to FP8_QUANT_GEMM_MAX_ROWS rows both in one kernel
    (`fp8_quant_gemm`). A weight `takes_fp8_weight_gemm` accepts (V4.1's 32 x 32 blocks) is read as stored
    by `fp8_weight_gemm` for up to FP8_WEIGHT_MAX_ROWS rows, x as it is: the dense path's product without
    the dense copy. Otherwise, and for fp8 None, the weight is made dense in x's dtype first."""
    if fp8 is None or not isinstance(w, QArray):
        return jnp.einsum("...i,oi->...o", x, dense(w, x.dtype))
    from djax.kernels import partition  # here: the kernel modules import Triton

    rows = x.reshape(-1, x.shape[-1])
    # partitioned by rows: under a batch-split mesh each device runs the GEMM on its own rows
    if takes_fp8_gemm(w):
        ue8m0, scale = has_ue8m0_scales(w), w.scale.astype(jnp.float32)
        if _quantized_inside(rows):
            y = partition.fp8_quant_gemm(fp8)(rows, w.values, scale, ue8m0)
        else:
            from djax.kernels.fp8_gemm_ref import quantize_act

            a, a_scale = quantize_act(rows, ue8m0=ue8m0)
            y = partition.fp8_gemm(fp8)(a, a_scale, w.values, scale, x.dtype)
    elif takes_fp8_weight_gemm(w) and rows.shape[0] <= FP8_WEIGHT_MAX_ROWS:
        y = partition.fp8_weight_gemm(fp8)(rows, w.values, w.scale, w.block)
    else:
        return jnp.einsum("...i,oi->...o", x, dense(w, x.dtype))
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _quantized_inside(rows: jax.Array) -> bool:
    """Whether `linear` runs a `takes_fp8_gemm` weight through `fp8_quant_gemm` for these rows: up to
    FP8_QUANT_GEMM_MAX_ROWS, with either kind of scale."""
    return rows.shape[0] <= FP8_QUANT_GEMM_MAX_ROWS


def linear_pair(x: jax.Array, w, w2, fp8: str | None = None) -> tuple[jax.Array, jax.Array]:
    """(linear(x, w, fp8), linear(x, w2, fp8)): two projections of the same x. Where `linear` would run both
    through `fp8_quant_gemm` with the same kind of scales, they run in one launch (`fp8_quant_gemm_pair`):
    at one row each of these small GEMMs took more time than its weight bytes need (`fp8_quant_triton`)."""
    pair = fp8 is not None and all(isinstance(v, QArray) and takes_fp8_gemm(v) for v in (w, w2))
    rows = x.reshape(-1, x.shape[-1])
    if pair and has_ue8m0_scales(w) == has_ue8m0_scales(w2) and _quantized_inside(rows):
        from djax.kernels import partition  # here: the kernel modules import Triton

        f32 = jnp.float32
        ys = partition.fp8_quant_gemm_pair(fp8)(
            rows, w.values, w.scale.astype(f32), w2.values, w2.scale.astype(f32), has_ue8m0_scales(w)
        )
        return tuple(y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys)
    return linear(x, w, fp8), linear(x, w2, fp8)


def grouped_linear(x: jax.Array, w, fp8: str | None = None) -> jax.Array:
    """Each group's own projection: x [..., g, i] and w [g * o, i] (torch layout, group j's rows j * o ..)
    give y [..., g, o] with y[..., j, :] = x[..., j, :] @ w[j * o:(j + 1) * o].T (V4's output LoRA, wo_a).

    With `fp8` and an FP8 weight `fp8_weight_readable` accepts whose scale blocks do not straddle groups, up
    to FP8_WEIGHT_MAX_ROWS rows of x are multiplied by `fp8_weight_gemm`, all groups in one launch, reading
    the weight as stored and x as it is (the dense path's numbers). Otherwise the weight is made dense."""
    g = x.shape[-2]
    o = w.shape[0] // g
    rows = x.reshape(-1, g, x.shape[-1])
    fits = fp8 is not None and fp8_weight_readable(w) and o % w.block[0] == 0
    if not fits or rows.shape[0] > FP8_WEIGHT_MAX_ROWS:
        return jnp.einsum("...gi,goi->...go", x, dense(w, x.dtype).reshape(g, o, -1))
    from djax.kernels import partition  # here: the kernel modules import Triton

    values, scale = w.values.reshape(g, o, -1), w.scale.reshape(g, o // w.block[0], -1)
    y = partition.fp8_weight_gemm_grouped(fp8)(rows, values, scale, w.block)  # [m, g, o]
    return y.reshape(*x.shape[:-1], o)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` of x (float32 or 16-bit floats) along its last axis, computed by a stable sort.

    Same results: the k largest in descending order, ties to the lower index, in IEEE total order
    (-0.0 below 0.0). Why not lax.top_k itself: it lowers to a TopK op the sharding partitioner has no
    rule for, so with the leading (batch) dims split over devices it all-gathers x and every device runs
    the whole batch; a sort keeps them split. XLA on GPUs lowers top_k through a sort at these k anyway.
    """
    if not 0 <= k <= x.shape[-1]:
        raise ValueError(f"top_k: k={k} outside [0, {x.shape[-1]}]")
    ity = {2: jnp.int16, 4: jnp.int32}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, ity)
    key = jnp.where(bits < 0, bits ^ jnp.iinfo(ity).max, bits)  # the floats' total order, as integers
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    # ~key sorts descending; the stable sort keeps equal keys in index order.
    _, vals, idx = jax.lax.sort((~key, x, iota), dimension=x.ndim - 1, num_keys=1, is_stable=True)
    return vals[..., :k], idx[..., :k]


# ---- rotary embeddings ---------------------------------------------------------------------------
def rope_inv_freq(dim: int, theta: float, cfg: ModelConfig | None = None, yarn: bool = False) -> np.ndarray:
    """Inverse frequencies [dim // 2] (float32). With `yarn`, YaRN's ramp between interpolation and extrapolation."""
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    inv = (1.0 / pos_freqs).astype(np.float32)
    if not yarn or cfg is None or cfg.rope_factor <= 1.0:
        return inv
    factor, orig = cfg.rope_factor, cfg.original_max_position_embeddings

    def correction_dim(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(cfg.beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolate = 1.0 - ramp
    interp = (1.0 / (factor * pos_freqs)).astype(np.float32)
    return (interp * (1 - extrapolate) + inv * extrapolate).astype(np.float32)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_cos_sin(
    positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape positions.shape + [dim // 2], float32."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(freqs) * scale, jnp.sin(freqs) * scale


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the trailing 2 * cos.shape[-1] channels of x, pairing neighbours (x0, x1), (x2, x3), ...

    x: [..., t, (h,) k]; cos/sin: [..., t, r/2] broadcast over any head axis between t and k
    (pass them already expanded). Rotation is done in float32 and cast back to x.dtype.
    """
    r = 2 * cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:]
    rf = rope.astype(jnp.float32).reshape(*rope.shape[:-1], r // 2, 2)
    x0, x1 = rf[..., 0], rf[..., 1]
    y = jnp.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1).reshape(rope.shape)
    return jnp.concatenate([nope, y.astype(x.dtype)], axis=-1)


def apply_rope_halves(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the trailing 2 * cos.shape[-1] channels of x, pairing channel i with i + r/2 (GPT-NeoX style)."""
    r = 2 * cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:]
    rf = rope.astype(jnp.float32)
    x0, x1 = rf[..., : r // 2], rf[..., r // 2 :]
    y = jnp.concatenate([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1)
    return jnp.concatenate([nope, y.astype(x.dtype)], axis=-1)


# ---- MLP -------------------------------------------------------------------------------------------
def swiglu(
    x: jax.Array, w1: jax.Array, w2: jax.Array, w3: jax.Array, limit: float = 0.0, fp8: str | None = None
) -> jax.Array:
    """w2(silu(w1 x) * w3 x); with limit > 0 the gate is clamped above and the up branch on both sides.
    `fp8`: as for `linear` (w1 and w3 as a `linear_pair`)."""
    return linear(swiglu_act(*linear_pair(x, w1, w3, fp8), limit), w2, fp8)


def swiglu_act(gate: jax.Array, up: jax.Array, limit: float = 0.0) -> jax.Array:
    """silu(gate) * up; with limit > 0 (V4) the gate is clamped above and the up branch on both sides."""
    if limit > 0:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up
