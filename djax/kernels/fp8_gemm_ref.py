"""FP8 e4m3 block-scaled GEMMs in jnp (DeepGEMM's SM90 scale layout): dense, grouped contiguous, grouped masked;
and the weight-only form (FP8 weights with any block scales, activations unquantized).

Scales: activations 1x128 (per row, per 128 columns of k), weights 128x128; a trailing partial block
(k or n not a multiple of 128) has its own scale. Every product accumulates in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from djax.kernels.grouped_gemm_ref import swiglu_f32

F32 = jnp.float32
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128


def scale_blocks(n: int) -> int:
    """Scale blocks along an axis of n entries: ceil(n / 128), a partial last block included."""
    return -(-n // BLOCK)


def _expand(scale, axis: int, size: int):
    return jnp.repeat(scale, BLOCK, axis=axis, total_repeat_length=scale_blocks(size) * BLOCK).take(
        jnp.arange(size), axis
    )


def quantize_act(x, ue8m0: bool = False):
    """x [..., m, k] -> (fp8[..., m, k], f32[..., m, ceil(k/128)]): one scale per row and 128 columns,
    amax / 448 (taken as amax times float32(1 / 448)). ue8m0: as DeepSeek's inference quantizes activations
    for weights with UE8M0 scales (`scale_fmt` "ue8m0", V3.1 on and V4): amax floored at 1e-4, times
    float32(1 / 448), rounded up to a power of two, so x / scale is exact and the block's max lands in
    [224, 448]."""
    from djax.quant import pow2_ceil  # here: djax.quant is the model's; the kernels' references need none

    *lead, m, k = x.shape
    pad = scale_blocks(k) * BLOCK - k
    xb = jnp.pad(x.astype(F32), [(0, 0)] * (len(lead) + 1) + [(0, pad)]).reshape(
        *lead, m, scale_blocks(k), BLOCK
    )
    amax = jnp.abs(xb).max(-1)
    if ue8m0:
        s = pow2_ceil(jnp.maximum(amax, F32(1e-4)) * F32(1 / FP8_MAX))
    else:  # times the float32 reciprocal, not a division: XLA's CPU backend makes the one into the other, and
        # a GPU kernel that quantizes in its prologue (fp8_quant_triton) must get the same scale on any backend
        s = jnp.maximum(amax, 1e-12) * F32(1 / FP8_MAX)
    q = (xb / s[..., None]).reshape(*lead, m, -1)[..., :k].astype(FP8)
    return q, s


def quantize_weight(w):
    """w [..., n, k] -> (fp8[..., n, k], f32[..., ceil(n/128), ceil(k/128)]): one scale per 128x128 block."""
    *lead, n, k = w.shape
    nb, kb = scale_blocks(n), scale_blocks(k)
    wp = jnp.pad(w.astype(F32), [(0, 0)] * len(lead) + [(0, nb * BLOCK - n), (0, kb * BLOCK - k)])
    wb = wp.reshape(*lead, nb, BLOCK, kb, BLOCK)
    s = jnp.maximum(jnp.abs(wb).max((-3, -1)), 1e-12) / FP8_MAX
    q = (wb / s[..., :, None, :, None]).reshape(*lead, nb * BLOCK, kb * BLOCK)[..., :n, :k].astype(FP8)
    return q, s


def dequant_act(a, a_scale):
    return a.astype(F32) * _expand(a_scale, -1, a.shape[-1])


def dequant_weight(b, b_scale):
    s = _expand(_expand(b_scale, -1, b.shape[-1]), -2, b.shape[-2])
    return b.astype(F32) * s


def fp8_gemm_ref(a, a_scale, b, b_scale, out_dtype=jnp.bfloat16):
    """out[m, n] = sum_k a[m, k] b[n, k] with scales. a fp8[m, k]; a_scale f32[m, kb]; b fp8[n, k];
    b_scale f32[nb, kb]. Returns out_dtype[m, n]."""
    out = jnp.einsum("mk,nk->mn", dequant_act(a, a_scale), dequant_weight(b, b_scale), precision="highest")
    return out.astype(out_dtype)


def fp8_weight_gemm_ref(a, b, b_scale, block: tuple[int, int]):
    """out[..., m, n] = sum_k a[..., m, k] w[..., n, k] with the weight made dense as the model makes it
    (`QArray.dense`): b's e4m3 codes [..., n, k] in float32 times the scale of their block[0] x block[1] block
    (b_scale f32 [..., ceil(n / block[0]), ceil(k / block[1])]), rounded to a's dtype. The leading dim, if
    any, indexes independent products (a [g, m, k] against b [g, n, k]). The activations stay as they are (no
    quantization); products accumulate in float32. Returns a's dtype."""
    from djax.quant import QArray  # here: djax.quant is the model's; the kernels' other references need none

    w = QArray(b, b_scale.astype(F32), tuple(block)).dense(a.dtype)
    return jnp.einsum("...mk,...nk->...mn", a, w, preferred_element_type=F32).astype(a.dtype)


def grouped_contiguous_ref(a, a_scale, b, b_scale, m_indices, out_dtype=jnp.bfloat16):
    """MoE prefill layout: rows of a sorted by expert. a fp8[m, k]; a_scale f32[m, kb]; b fp8[g, n, k];
    b_scale f32[g, nb, kb]; m_indices int32[m] the expert of each row, -1 for padding rows (output 0)."""
    af = dequant_act(a, a_scale)

    def one(acc, g):
        y = jnp.einsum("mk,nk->mn", af, dequant_weight(b[g], b_scale[g]), precision="highest")
        return jnp.where((m_indices == g)[:, None], y, acc), None

    out, _ = jax.lax.scan(one, jnp.zeros((a.shape[0], b.shape[1]), F32), jnp.arange(b.shape[0]))
    return out.astype(out_dtype)


def grouped_swiglu_contiguous_ref(
    a, a_scale, rows, w1, s1, w3, s3, m_indices, limit: float, gate_dtype=jnp.bfloat16
):
    """The experts' gate and up in the contiguous layout, then the clamped SwiGLU (`swiglu_f32`). a fp8[n, k]
    token rows, a_scale f32[n, kb]; rows int32[m] the token of each padded row (-1 for padding); w1, w3
    fp8[g, f, k] with s1, s3 f32[g, fb, kb]; m_indices int32[m]. Gate and up are rounded to gate_dtype (the
    model's dtype, as GEMMs with that output would) before the SwiGLU. Returns f32[m, f], padding rows 0."""
    src = jnp.maximum(rows, 0)
    a, a_scale = a[src], a_scale[src]
    gate = grouped_contiguous_ref(a, a_scale, w1, s1, m_indices, gate_dtype)
    up = grouped_contiguous_ref(a, a_scale, w3, s3, m_indices, gate_dtype)
    return jnp.where(((m_indices >= 0) & (rows >= 0))[:, None], swiglu_f32(gate, up, limit), 0.0)


def grouped_masked_ref(a, a_scale, b, b_scale, masked_m, out_dtype=jnp.bfloat16):
    """MoE decode layout: a fp8[g, M, k] with only the first masked_m[g] rows of group g live;
    a_scale f32[g, M, kb]; b fp8[g, n, k]; b_scale f32[g, nb, kb]. Dead rows of the output are 0."""
    out = jnp.einsum("gmk,gnk->gmn", dequant_act(a, a_scale), dequant_weight(b, b_scale), precision="highest")
    live = jnp.arange(a.shape[1])[None, :] < masked_m[:, None]
    return jnp.where(live[..., None], out, 0.0).astype(out_dtype)
