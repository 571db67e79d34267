"""Triton: rows gathered by index and quantized 1 x 128 to e4m3 in one pass (`row_quant.quantize_rows`).

Why. An MoE layer's FP8 experts at prefill moved their activations through XLA several times: the tokens
quantized, then their fp8 rows gathered into the 128-row groups of the expert-contiguous layout (V4-Flash at
4,096 tokens: 57,088 padded rows of 4,096 bytes, which XLA gathered in 278 us on an H100); the SwiGLU of gate and
up written in float32, its picks' rows gathered, quantized, and scattered into a buffer of zero rows. Here each
program reads its rows once through the index (a zero row where the index is out of range: the layout's
padding; with ZERO_ROWS off a program none of whose rows is in range writes nothing, for the static layout's
tail of empty groups, which no GEMM tile reads), optionally takes the clamped SwiGLU of two inputs (gate and
up), and writes the fp8 values and the float32 scales of one 128-column block; nothing in between reaches
memory.

The scale and quotient are `fp8_gemm_ref.quantize_act`'s (`fp8_quant_triton.quantize_block`, which the
quantizing GEMM's prologue takes too). Rounding to e4m3: the GPU's conversion ("cast") or, in Triton's
CPU interpreter, the same rounding in float32 arithmetic ("bits", `fp8_quant_triton._round_e4m3`), the output
then being a float32 stand-in holding e4m3 values."""

from __future__ import annotations

import triton
import triton.language as tl

from djax.kernels.fp8_quant_triton import ROUNDINGS, _round_e4m3, quantize_block

BLOCK_ROWS = 64  # rows a program quantizes (one 128-column block of each): 16 KB of bf16 read
NUM_WARPS = 4


@triton.jit
def quantize_rows_kernel(
    x_ptr,  # [R, N]: the rows (bf16 or f32), or with SWIGLU the gate
    up_ptr,  # [R, N]: with SWIGLU the up projection; else x again, never read
    src_ptr,  # int32[M]: the row of x each output row takes; outside [0, R): a zero row
    q_ptr,  # e4m3 [M, N] (float32 stand-ins with BITS)
    s_ptr,  # f32 [M, N / 128]
    M: tl.constexpr,
    N: tl.constexpr,
    R: tl.constexpr,
    SWIGLU: tl.constexpr,
    LIMIT: tl.constexpr,  # <= 0: no clamp
    UE8M0: tl.constexpr,
    BITS: tl.constexpr,
    ZERO_ROWS: tl.constexpr,  # False: a program with no row in range writes nothing
    MARKSTEIN: tl.constexpr,  # plain scales: one division a row (`fp8_quant_triton._markstein_div`)
    BLOCK_R: tl.constexpr,
):
    BK: tl.constexpr = 128
    rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rc = tl.program_id(1) * BK + tl.arange(0, BK)
    out_ok = rr < M
    src = tl.load(src_ptr + rr, mask=out_ok, other=-1)
    live = (src >= 0) & (src < R)  # padding and dropped rows load nothing and quantize as zeros
    # Without ZERO_ROWS a program with no live row does nothing at all: the layout's tail of empty groups is most
    # of its rows at a few picks an expert, and a program costs its rows' divisions whether they are live or not
    # (an H100, V4-Flash's experts at 1,024 tokens: 548-552 us for the two TileLang-path calls when every
    # program computed, at least 65% of them over no live row)
    if (tl.max(live.to(tl.int32), axis=0) > 0) | ZERO_ROWS:
        offs = src.to(tl.int64)[:, None] * N + rc[None, :]
        x = tl.load(x_ptr + offs, mask=live[:, None], other=0.0).to(tl.float32)
        if SWIGLU:
            up = tl.load(up_ptr + offs, mask=live[:, None], other=0.0).to(tl.float32)
            if LIMIT > 0:
                x = tl.minimum(x, LIMIT)
                up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
            x = x * tl.sigmoid(x) * up  # zero rows stay zero
        q, s = quantize_block(x, UE8M0, MARKSTEIN)
        if BITS:
            q = _round_e4m3(q)
        q_ptrs = q_ptr + rr.to(tl.int64)[:, None] * N + rc[None, :]
        tl.store(q_ptrs, q.to(q_ptr.dtype.element_ty), mask=out_ok[:, None])
        tl.store(s_ptr + rr.to(tl.int64) * (N // BK) + tl.program_id(1), s, mask=out_ok)


def constexprs(
    m: int,
    n: int,
    r: int,
    swiglu: bool,
    limit: float,
    ue8m0: bool,
    rounding: str,
    zero_rows: bool,
    markstein: bool,
) -> dict:
    """The kernel's compile-time constants for m output rows of n columns from r source rows; checks them."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if n % 128:
        raise ValueError(
            f"quantize_rows' kernel takes whole 128-column blocks: n {n} is not a multiple of 128"
        )
    return dict(
        M=m,
        N=n,
        R=r,
        SWIGLU=bool(swiglu),
        LIMIT=float(limit),
        UE8M0=bool(ue8m0),
        BITS=rounding == "bits",
        ZERO_ROWS=bool(zero_rows),
        MARKSTEIN=bool(markstein),
        BLOCK_R=BLOCK_ROWS,
    )


def grid(m: int, n: int) -> tuple[int, int]:
    return triton.cdiv(m, BLOCK_ROWS), n // 128


def launch_torch(x, src, cx: dict, up=None):
    """Runs the kernel with the constants `cx` (`constexprs`, which x [R, N], src int32 [M] and up, like x or
    None, must match) on torch tensors: a GPU, or the CPU under TRITON_INTERPRET=1, where q comes back as
    float32 stand-ins (BITS). Returns (q [M, N], s float32 [M, N / 128]); rows left unwritten (ZERO_ROWS off)
    come back as nan."""
    import torch

    m, n = cx["M"], cx["N"]
    if tuple(x.shape) != (cx["R"], n) or tuple(src.shape) != (m,) or (up is not None) != cx["SWIGLU"]:
        raise ValueError(
            f"quantize_rows' kernel: x {tuple(x.shape)}, src {tuple(src.shape)} do not match {cx}"
        )
    q_dtype = torch.float32 if cx["BITS"] else torch.float8_e4m3fn
    q = torch.full((m, n), float("nan"), dtype=q_dtype, device=x.device)
    s = torch.full((m, n // 128), float("nan"), dtype=torch.float32, device=x.device)
    x = x.contiguous()
    up = x if up is None else up.contiguous()
    quantize_rows_kernel[grid(m, n)](x, up, src.contiguous(), q, s, **cx, num_warps=NUM_WARPS)
    return q, s
