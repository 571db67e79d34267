"""Triton block-scaled FP8 GEMM that quantizes its activations itself: c = fp8_gemm(quantize_act(a), b), for the
few rows of a decode step.

Why. An FP8 projection at decode ran as four kernels: the activations' 1 x 128 maxima, their quantization, the
GEMM, and the sum of its K splits. At one row on the H200 (`kernels_h200_fp8_linear.json`) the three small
ones took 3.4 us next to a 3.8 us GEMM at 2048 x 4096, so the projection lost to the same product on a bf16
weight that reads twice the bytes. Here each program loads its [BLOCK_M, 128] tile of a (bf16) per K block,
takes each row's absolute maximum and scale exactly as `fp8_gemm_ref.quantize_act` does (amax / 448, or
DeepSeek's UE8M0 power of two), rounds a / scale to e4m3, and runs an fp8 dot per K block with
`fp8_gemm_triton`'s promotion. Every program of a row tile quantizes the same a again: at decode a is a few
rows of K values, a small fraction of the weight bytes each program reads.

The dot's form. Taken as a b^T with 16- and 32-row tiles, Triton runs it as mma.sync on f16 operands (the e4m3
values converted in registers, exactly); with 64-row tiles as an fp8 wgmma. Swapped (`QuantConfig.swap_ab`:
b a^T, the result tile transposed back) the weight's rows are the wgmma's 64-row side and a's rows its n8,
n16 or n32 side, so a few rows run as fp8 wgmma straight from shared memory: the default up to 32 rows.

b: the weight, e4m3 [N, K]; bs: float32 [N / 128, K / 128]; N and K multiples of 128, BLOCK_N dividing 128 (one
weight scale per program and K block). a [M, K] bf16. In Triton's CPU interpreter a, b and the result are float32
stand-ins (the same values). Rounding: "cast" (Triton's fp8 conversion, what a GPU runs) or "bits" (a / scale
rounded to e4m3 in float32 arithmetic, as the interpreter runs it: it does not round to e4m3 as a GPU does;
the first's slow twin).

Scales: with UE8M0 (powers of two) a / scale is a multiplication by the scale's exact inverse; with plain
scales the IEEE quotient, by default (`MARKSTEIN`) from one correctly rounded reciprocal a row and two fmas an
element (`_markstein_div`) instead of a division an element, the reciprocal by a Newton step from the hardware's
approximation (`NEWTON`, `_reciprocal`): no division in the kernel. Masked activations (rows past M, blocks past K)
load as ones rather than zeros: a zero divided by the floor scale takes the division's slow path, and at one
row 15 of a 16-row tile's rows are masked; on an H100 that made the plain-scale kernel 1.2-1.9x slower than
quantizing before the GEMM, and with ones it is faster at every V4-Flash projection shape at 1, 8 and 16 rows
(at 1 and 8 rows timed on unswapped 16-row tiles; djax/kernels/NOTES.md).

Split-K as in `fp8_gemm_triton`: program (tile, s) sums the s-th run of K blocks into the float32 partial
c[s]; the caller sums c over its first axis.

`fp8_quant_gemm_pair_kernel` runs two projections of the same activations in one launch (a decode step's wq_a
and wkv, a compressor's wkv and wgate, a SwiGLU's w1 and w3): the first weight's column tiles, then the
second's, each program the same as the single kernel's (`_quant_gemm_program`; the single kernel compiles to
the same SASS as before that function was split out, checked for sm_90 at four shapes and both scale
kinds). At one row each such GEMM took 4.4-6.3 us on an H100 for 0.7-2.8 us of weight bytes at copy speed
(the 512-2048 x 4096 projections, NOTES.md). The pair's K splits follow from both weights' tiles, so they may
be fewer than each weight's alone (8 against 16 for two 2048 x 4096 weights at one row). On an H100 the pair
ran 1.26-1.79x faster than the two calls at 1, 8 and 32 rows (`fp8_quant_gemm_pair_h100_ab.json`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import triton
import triton.language as tl

from djax.kernels.fp8_gemm_triton import Fp8Config, fewest_splits, grid, program_tile, split_k

ROUNDINGS = ("cast", "bits")


@dataclass(frozen=True)
class QuantConfig(Fp8Config):
    """Fp8Config plus swap_ab: the dot taken as b a^T, the weight tile its first operand, so that at a few rows
    Hopper runs it as an fp8 wgmma whose 64-row side is the weight's rows (n8, n16, n32 for 8, 16, 32 rows of a)
    instead of mma.sync on f16 operands converted from e4m3 in registers; the result tile is transposed back."""

    swap_ab: bool = False


# Unswapped tiles of 128 weight rows, six stages; K split until about two programs a SM. The default above 32 rows
# (64-row fp8 wgmma tiles); its 16-row (mma.sync) form was the default up to 16 rows before the swapped dot. H100,
# 2026-12-06 (`fp8_quant_gemm_h100_ab.json`, one row, UE8M0 scales, device time, V4-Flash's six projection
# shapes): 128 weight rows a program were the fastest of 32, 64 and 128 or within 4% of it (14.8 against 17.4 us
# for 64 at 32768 x 1024); the best 64-row (wgmma) tiles were 1.14-1.49x slower than the best 16-row ones (they
# quantize 64 rows); splits up to 16 paid where the output has few tiles (5.3 against 6.2 us at 1024 x 4096).
QUANT_CFG = QuantConfig(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=6)
# Up to 8 rows the dot swapped on 8-row tiles. H100, 2026-12-06 (two rounds, the same six shapes,
# `fp8_quant_gemm_h100_swap_ab.json`): at one row 3-6% faster than QUANT_CFG's 16-row tiles at every shape (13.98
# against 14.82 us at 32768 x 1024, 4.44 against 4.72 at 512 x 4096), at 8 rows 1.5-9%. Swapped 16-row tiles need
# 120 KB of shared memory at six stages, one program a SM where the splits count on two: 8.09 against 6.52 us at
# 2048 x 4096, one row.
SWAPPED_CFG = replace(QUANT_CFG, block_m=8, swap_ab=True)
# From 9 to 32 rows the dot swapped too, on 16- or 32-row tiles at four stages (94 KB at 32 rows as compiled for
# sm_90: two programs a SM). H100, 2026-12-06 (`fp8_quant_gemm_h100_swap_rows_ab.json`, two rounds, UE8M0): at 16
# rows 1-7% faster than QUANT_CFG's 16-row tiles (16.80 against 18.01 us at 4096 x 8192); at 32 rows 1.12-1.61x
# faster than the two steps (15.89 against 19.19 us at 32768 x 1024), where QUANT_CFG's 32-row tiles lost at three
# shapes (22.53 against 19.19). Six stages there: 8.94 against 7.11 us at 2048 x 4096, 16 rows. The defaults again
# in the next call (`_swap_defaults_ab.json`): 1.18-1.76x faster than the two steps at 16 rows, 1.14-1.62x at 32.
# Rows between those counts (partial tiles) were not timed.
SWAPPED_WIDE_CFG = replace(QUANT_CFG, num_stages=4, swap_ab=True)
SWAPPED_MAX_ROWS = 32  # the dot swapped up to here: 8-row tiles up to 8 rows, then 16- and 32-row ones
SPLITS = (1, 2, 4, 8, 16)
# Plain scales: a / scale by `_markstein_div` (one reciprocal a row, the IEEE division's bits) rather than
# `div.rn` on every element, and (NEWTON) that reciprocal by `_reciprocal`'s Newton step, no division at all
# (compiled kernels only); read when a call is traced (`constexprs`). H100, 2026-12-07, device time, V4-Flash's
# six projection shapes at their default tiles, two alternating rounds (`fp8_quant_gemm_h100_newton_ab.json`):
# at 32 rows the IEEE division took 7.44-24.17 us, Markstein's quotient 6.01-18.55, with the Newton reciprocal
# 5.69-18.52 (4096 x 8192: 23.79 / 24.17 against 18.52 / 18.39; 512 x 4096: 7.44 / 7.46 against 5.69 / 5.69),
# UE8M0 scales (a product, no quotient) 5.47-18.25; at one row 4.83-16.58, 4.53-16.03 and 4.41-15.85.
MARKSTEIN = True
NEWTON = True


def quant_config(m: int, n: int, k: int) -> QuantConfig:
    """The kernel's tiles when none are given: SWAPPED_CFG up to 8 rows, SWAPPED_WIDE_CFG on 16- or 32-row tiles
    up to SWAPPED_MAX_ROWS, else QUANT_CFG's on 64-row tiles; K split the fewest ways of SPLITS that make
    about two programs per SM (`fp8_gemm_triton.fewest_splits`), else the most."""
    if m <= SWAPPED_CFG.block_m:
        base = SWAPPED_CFG
    elif m <= SWAPPED_MAX_ROWS:
        base = replace(SWAPPED_WIDE_CFG, block_m=16 if m <= 16 else 32)
    else:
        base = replace(QUANT_CFG, block_m=64)
    tiles = -(-m // base.block_m) * -(-n // base.block_n)
    return replace(base, split_k=fewest_splits(tiles, k // 128, SPLITS))


@triton.jit
def _round_e4m3(v):
    """float32 v (|v| <= 448) rounded to the nearest e4m3fn value, ties to even, in float32 arithmetic: the
    interpreter's twin of the fp8 conversion. e4m3 values near v are 2^(e - 3) apart for v's binary exponent
    e, and 2^-9 apart among the subnormals (e floored at -6). The sign is v's, zeros included, as the
    conversion keeps it (-1e-5 gives -0)."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 255) - 127, -6)
    step = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    y = tl.abs(v) / step  # exact: a power of two
    r = ((y + 12582912.0) - 12582912.0) * step  # 1.5 * 2^23: y < 16 rounds to an integer, ties to even
    return (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _pow2_ceil(s):
    """2^ceil(log2(s)) for positive normal float32 s, from its bits as `djax.quant.pow2_ceil`."""
    bits = s.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def _pow2_inverse(s):
    """1 / s for a power of two s (2^-126 .. 2^126), exactly, from its bits. The kernel's UE8M0 scales are 2^-22
    or more (the 1e-4 floor)."""
    return ((254 << 23) - s.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)


@triton.jit
def quantize_block(a, UE8M0: tl.constexpr, MARKSTEIN: tl.constexpr = False, NEWTON: tl.constexpr = False):
    """`fp8_gemm_ref.quantize_act` of a float32 [rows, 128] block: each row's scale and a / scale, not yet
    rounded to e4m3 (the caller casts, or `_round_e4m3`s in the interpreter). amax times float32(1 / 448), and an
    IEEE division; UE8M0: a power of two (amax floored at 1e-4), so dividing is multiplying by its exact inverse.
    MARKSTEIN: the same quotient from one correctly rounded reciprocal a row (`_markstein_div`); NEWTON: that
    reciprocal without a division (`_reciprocal`)."""
    amax = tl.max(tl.abs(a), axis=1)
    if UE8M0:
        s = _pow2_ceil(tl.maximum(amax, 1e-4) * (1.0 / 448.0))
        q = a * _pow2_inverse(s)[:, None]
    else:
        s = tl.maximum(amax, 1e-12) * (1.0 / 448.0)
        if MARKSTEIN:
            q = _markstein_div(a, s, NEWTON)
        else:
            q = tl.math.div_rn(a, s[:, None])
    return q, s


@triton.jit
def _reciprocal(s, NEWTON: tl.constexpr):
    """RN(1 / s) for float32 s in [2^-126, 2^126] (1 / s normal too) or infinite (0); the kernel's plain scales
    lie in [2^-49, 2^120). NEWTON: the hardware's approximate reciprocal (`rcp.approx.ftz.f32`, whose flush to
    zero never applies there) and one Newton step in fmas, e = RN(1 - s * y0) (exact), y = RN(y0 + e * y0): no
    division and no slow path. It gave the correctly rounded reciprocal on every float32 significand, in seven
    binades from 2^-49 to 2^119, on an H100 (2026-12-07, `test_gpu_newton_reciprocal_is_correctly_rounded`);
    with input and output normal, the approximation and the step depend on the significand alone, the exponent
    only scaling them by a power of two. Compiled kernels only: the interpreter has no PTX. Else the IEEE
    division."""
    one = tl.full(s.shape, 1.0, tl.float32)
    if NEWTON:
        y0 = tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [s], dtype=tl.float32, is_pure=True, pack=1
        )
        return tl.where(y0 == 0.0, y0, tl.fma(tl.fma(-s, y0, one), y0, y0))  # s infinite: 0, as 1 / s
    else:
        return tl.math.div_rn(one, s)


@triton.jit
def reciprocal_kernel(s_ptr, y_ptr, NEWTON: tl.constexpr):
    """y = `_reciprocal(s, NEWTON)` over 1,024 values a program: what the tests hold the Newton step to."""
    i = tl.program_id(0) * 1024 + tl.arange(0, 1024)
    tl.store(y_ptr + i, _reciprocal(tl.load(s_ptr + i), NEWTON))


@triton.jit
def _markstein_div(a, s, NEWTON: tl.constexpr = False):
    """a / s[:, None] correctly rounded, as the IEEE division, with one reciprocal a row instead of a division an
    element: y = RN(1 / s) (`_reciprocal`); q0 = RN(a * y); the residual a - q0 * s is exact in one fma, and
    RN(q0 + residual * y) is the rounded quotient (Markstein's theorem, for a correctly rounded reciprocal and no
    underflow: s is a positive normal >= 1e-12 / 448 and |a / s| <= 448; where |a| is below about 2^-102 the
    residual may underflow and the float32 quotient be an ulp off, but it is then under 2^-52 and rounds to an
    e4m3 zero either way).
    Where q0 is zero (a is zero or tiny, or s infinite and the residual NaN) q0 is the answer, with the
    quotient's sign."""
    y = _reciprocal(s, NEWTON)[:, None]
    q0 = a * y
    q = tl.fma(tl.fma(-q0, s[:, None], a), y, q0)
    return tl.where(q0 == 0.0, q0, q)


@triton.jit
def _quant_gemm_program(
    a_ptr,
    b_ptr,  # the weight this program reads
    bs_ptr,  # its scales
    c_ptr,  # the result (or this split's partial), [M, N]
    pid_m,
    row0,  # the first of the weight's rows this program reads
    n0,  # its first output column
    M: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    UE8M0: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    MARKSTEIN: tl.constexpr,
    NEWTON: tl.constexpr,
):
    """One program's [BLOCK_M, BLOCK_N] tile over its split of K: a's rows quantized per 128 columns, the fp8
    dot, the promotion by both scales, the store."""
    BK: tl.constexpr = 128
    KB: tl.constexpr = K // BK
    # split s takes K blocks [s * KBS, (s + 1) * KBS): a constant trip count keeps the loop pipelined; the
    # last split's blocks past K load nothing (it may have none)
    KBS: tl.constexpr = (KB + SPLIT_K - 1) // SPLIT_K
    pid_k = tl.program_id(1)
    kb0 = pid_k * KBS
    c_ptr += pid_k.to(tl.int64) * M * N
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rw = row0 + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * K + kb0 * BK + rk[None, :]
    b_ptrs = b_ptr + rw[:, None].to(tl.int64) * K + kb0 * BK + rk[None, :]
    bs_ptrs = bs_ptr + (row0 // BK) * KB
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # the weight scale is read one K block ahead (as in fp8_gemm_triton: Triton pipelines only the loads that
    # feed the dot); past the last block the tiles load as zeros and any finite scale will do
    sb = tl.load(bs_ptrs + tl.minimum(kb0, KB - 1))
    for i in range(0, KBS):
        k_ok = (kb0 + i) * BK + rk < K  # false for the whole block past K
        # rows past M and blocks past K load as ones, not zeros (the module's docstring says why): their
        # products are never stored (rows) or meet zero weights (blocks)
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=1.0).to(tl.float32)
        b = tl.load(b_ptrs, mask=k_ok[None, :], other=0.0)
        sb_next = tl.load(bs_ptrs + tl.minimum(kb0 + i + 1, KB - 1))
        q, sa = quantize_block(a, UE8M0, MARKSTEIN, NEWTON)  # quantize_act: one scale per row and 128 columns
        if BITS:  # float32 operands (b's e4m3 values are exact in float32)
            q, b = _round_e4m3(q), b.to(tl.float32)
        else:
            q = q.to(tl.float8e4nv)
        if SWAP_AB:
            part = tl.trans(tl.dot(b, tl.trans(q), input_precision="ieee"))
        else:
            part = tl.dot(q, tl.trans(b), input_precision="ieee")
        acc += part * (sa * sb)[:, None]
        sb = sb_next
        a_ptrs += BK
        b_ptrs += BK
    rn = n0 + tl.arange(0, BLOCK_N)
    tl.store(
        c_ptr + rm[:, None].to(tl.int64) * N + rn[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=m_ok[:, None],
    )


@triton.jit
def fp8_quant_gemm_kernel(
    a_ptr,  # [M, K] activations (bf16; float32 in the interpreter)
    b_ptr,  # [N, K] e4m3 weights (float32 stand-ins, the same values, in the interpreter)
    bs_ptr,  # f32 [N / 128, K / 128]
    c_ptr,  # [M, N] in a's dtype; SPLIT_K > 1: f32 [SPLIT_K, M, N]
    M: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    UE8M0: tl.constexpr,  # power-of-two activation scales (`quantize_act(ue8m0=True)`)
    BITS: tl.constexpr,  # round to e4m3 in float32 arithmetic (interpreter) instead of Triton's conversion
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr,  # the dot as b a^T (weight rows the wgmma's 64-row side), the result transposed
    MARKSTEIN: tl.constexpr,  # plain scales: one reciprocal a row (`_markstein_div`)
    NEWTON: tl.constexpr,  # and that division by `_reciprocal`'s Newton step
):
    pid_m, pid_n = program_tile(N, BLOCK_N)
    n0 = pid_n * BLOCK_N
    _quant_gemm_program(
        a_ptr,
        b_ptr,
        bs_ptr,
        c_ptr,
        pid_m,
        n0,
        n0,
        M,
        N,
        K,
        UE8M0,
        BITS,
        BLOCK_M,
        BLOCK_N,
        SPLIT_K,
        SWAP_AB,
        MARKSTEIN,
        NEWTON,
    )


@triton.jit
def fp8_quant_gemm_pair_kernel(
    a_ptr,  # [M, K] activations
    b_ptr,  # [N1, K] e4m3: the first weight
    bs_ptr,  # f32 [N1 / 128, K / 128]
    b2_ptr,  # [N - N1, K] e4m3: the second weight
    bs2_ptr,  # f32 [(N - N1) / 128, K / 128]
    c_ptr,  # [M, N]: both products side by side (SPLIT_K > 1: f32 [SPLIT_K, M, N])
    M: tl.constexpr,
    N: tl.constexpr,
    N1: tl.constexpr,  # the first weight's rows, a multiple of 128
    K: tl.constexpr,
    UE8M0: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    MARKSTEIN: tl.constexpr,
    NEWTON: tl.constexpr,
):
    """Two projections of the same activations in one launch: the column tiles of the first weight, then those
    of the second (a tile never straddles them, N1 being a multiple of 128 and BLOCK_N dividing 128)."""
    pid_m, pid_n = program_tile(N, BLOCK_N)
    n0 = pid_n * BLOCK_N
    if n0 < N1:
        w, ws, row = b_ptr, bs_ptr, n0
    else:
        w, ws, row = b2_ptr, bs2_ptr, n0 - N1
    _quant_gemm_program(
        a_ptr,
        w,
        ws,
        c_ptr,
        pid_m,
        row,
        n0,
        M,
        N,
        K,
        UE8M0,
        BITS,
        BLOCK_M,
        BLOCK_N,
        SPLIT_K,
        SWAP_AB,
        MARKSTEIN,
        NEWTON,
    )


def constexprs(
    m: int,
    n: int,
    k: int,
    ue8m0: bool,
    rounding: str,
    cfg: Fp8Config,
    n1: int | None = None,
    newton: bool | None = None,
) -> dict:
    """Compile-time constants of one shape; checks the shape and the config against the kernel's contract. n1:
    the pair kernel's first weight's rows (of n in all). The plain scales' quotient is `_markstein_div`'s where
    `MARKSTEIN` is on (UE8M0 scales never divide); newton: its reciprocal by `_reciprocal`'s Newton step (None:
    `NEWTON`), whose PTX only a compiled kernel runs: an interpreted call passes False."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if n % 128 or k % 128:
        raise ValueError(f"fp8_quant_gemm: n {n} and k {k} must be multiples of 128")
    if n1 is not None and (n1 % 128 or not 0 < n1 < n):
        raise ValueError(
            f"fp8_quant_gemm_pair: the first weight's {n1} rows must be a multiple of 128 under {n}"
        )
    if 128 % cfg.block_n or cfg.block_k != 128:
        raise ValueError(f"BLOCK_N {cfg.block_n} must divide 128 and BLOCK_K {cfg.block_k} must be 128")
    cx = dict(
        M=m,
        N=n,
        K=k,
        UE8M0=bool(ue8m0),
        BITS=rounding == "bits",
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        SPLIT_K=split_k(cfg),
        SWAP_AB=bool(getattr(cfg, "swap_ab", False)),
        MARKSTEIN=not ue8m0 and MARKSTEIN,
    )
    cx["NEWTON"] = cx["MARKSTEIN"] and bool(NEWTON if newton is None else newton)
    return cx if n1 is None else {**cx, "N1": n1}


def launch_torch(a, b, scale, cx: dict, cfg: Fp8Config, second=None):
    """Runs the kernel with the constants `cx` (`constexprs`, which the operands must match; an interpreted
    call's have NEWTON off) on torch tensors (GPU, or CPU under TRITON_INTERPRET=1 with float32 stand-ins): a
    [M, K], b [N1, K] (N1 = N without `second`), scale float32 [N1 / 128, K / 128]; `second` (b2, scale2): the
    pair kernel, both products side by side. cfg gives the launch's warps and stages. Returns [M, N] in a's
    dtype, or with split_k(cfg) > 1 the f32 partials [split_k, M, N] to be summed over the first axis."""
    import torch

    m, n = cx["M"], cx["N"]
    n2 = 0 if second is None else second[0].shape[0]
    if tuple(a.shape) != (m, cx["K"]) or b.shape[0] + n2 != n or (second is None) != ("N1" not in cx):
        raise ValueError(f"fp8_quant_gemm's kernel: a {tuple(a.shape)}, b {tuple(b.shape)} do not match {cx}")
    shape, dtype = (m, n), a.dtype
    if split_k(cfg) > 1:
        shape, dtype = (split_k(cfg), m, n), torch.float32
    c = torch.full(shape, float("nan"), dtype=dtype, device=a.device)
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    operands = [a.contiguous(), b.contiguous(), scale.contiguous()]
    kernel = fp8_quant_gemm_kernel
    if second is not None:
        operands += [second[0].contiguous(), second[1].contiguous()]
        kernel = fp8_quant_gemm_pair_kernel
    kernel[grid(m, n, cfg)](*operands, c, **cx, **opts)
    return c
