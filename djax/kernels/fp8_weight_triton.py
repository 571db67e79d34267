"""Triton GEMM on FP8 weights read as stored, activations in their own dtype ("weight-only" FP8):
c[m, n] = sum_k a[m, k] dense(b)[n, k], dense(b) = e4m3 code x its block's scale, rounded to a's dtype.

For FP8 weights whose scale blocks the block-scaled FP8 GEMM (`fp8_gemm_triton`, 128 x 128 weight blocks
against 1 x 128 activation blocks) cannot take: V4.1's projections carry one scale per 32 x 32 block, four
along each 128-wide K block, which would need a promotion after every 32-deep MMA. Here the weight tile is
made in registers as `QArray.dense` makes it (code -> float32, times the scale, rounded to a's dtype) and
goes into one tensor-core dot in a's dtype with a float32 accumulator: the dense path's result up to the
order of the float32 sums, with the weights crossing memory at one byte a value instead of two.

b: the e4m3 codes as their bytes, uint8 [G, N, K]; bs: float32 [G, ceil(N / BO), ceil(K / BI)], one scale per
BO x BI block (a partial last block has its own); a [G, M, K]: G independent products (one for a plain
projection, the output LoRA's groups for V4's grouped wo_a), the grid's third axis. BI divides BLOCK_K, so a K step reads BLOCK_K / BI whole
scale blocks per weight row. Decoding: "cast" (Triton's fp8 conversion, what a GPU runs) or "bits" (from the
bit fields in float32, as Triton's CPU interpreter runs it; the first's slow twin).

Split-K as in `fp8_gemm_triton`: program (tile, s) sums the s-th run of K steps into the float32 partial
c[s]; the caller sums c over its first axis. At decode the output has too few tiles for 132 SMs.
"""

from __future__ import annotations

from dataclasses import replace

import triton
import triton.language as tl

from djax.kernels.dispatch import sm_count
from djax.kernels.fp8_gemm_triton import Fp8Config, fewest_splits, program_tile, split_k

DECODES = ("cast", "bits")
# Prefill-sized: 128 x 128 tiles, as the bf16 and FP8 GEMMs' defaults (a stage: 32 KB of bf16 a, 16 KB of codes).
PREFILL_CFG = Fp8Config(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3)
# Decode-sized: the FP8 GEMM's 64 x 64 tiles with K split for the SM count, so that about two programs run on
# each SM. A stage holds 16 KB of a (bf16, twice the FP8 GEMM's), 8 KB of codes and 1 KB of scales: 4 stages,
# 107 KB, two programs an SM.
DECODE_CFG = Fp8Config(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)
# Up to FEW_ROWS rows: 16-row tiles (mma.sync, a quarter of a's shared memory) at 6 stages. H200, 2026-12-05
# (`kernels_h200_fp8_weight.json`, device time, one row, 32 x 32 blocks): 16.2 against DECODE_CFG's 25.2 us at
# 32768 x 1280 and 17.3 against 38.4 at 5120 x 8192; at 32 rows mixed (28.9 against 25.8, 28.8 against
# 39.3), so 32 rows keep DECODE_CFG. (The grouped form, wo_a, takes the same rule; not timed with it.)
FEW_ROWS = 16
FEW_ROWS_CFG = replace(DECODE_CFG, block_m=16, num_stages=6)


def weight_config(m: int, n: int, k: int, groups: int = 1) -> Fp8Config:
    """The kernel's tiles when none are given, by `fp8_gemm_triton.dense_config`'s rule over all `groups`
    products: PREFILL_CFG where m > 64 and its tiles cover the SMs (`dispatch.sm_count`), else DECODE_CFG
    (FEW_ROWS_CFG up to FEW_ROWS rows) with K split until about two programs a SM."""
    if m > 64 and groups * -(-m // 128) * -(-n // 128) >= sm_count():
        return PREFILL_CFG
    base = FEW_ROWS_CFG if m <= FEW_ROWS else DECODE_CFG
    tiles = groups * -(-m // base.block_m) * -(-n // base.block_n)
    return replace(base, split_k=fewest_splits(tiles, -(-k // base.block_k)))


@triton.jit
def _e4m3_to_f32(c):
    """e4m3fn codes (int32, 0..255; bit 7 the sign) -> their float32 values from the bit fields: exponent
    e = bits 3-6 (bias 7), mantissa m = bits 0-2; e > 0 is 2^(e - 7) (1 + m / 8), e = 0 is m 2^-9; 0x7f
    and 0xff are nan (e4m3fn has no infinities)."""
    e = (c >> 3) & 15
    m = c & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e > 0, normal, m.to(tl.float32) * 0.001953125)
    v = tl.where((c & 0x7F) == 0x7F, float("nan"), v)
    return tl.where(c >= 128, -v, v)


@triton.jit
def fp8_weight_gemm_kernel(
    a_ptr,  # [G, M, K] activations (bf16; float32 in the interpreter)
    b_ptr,  # uint8 [G, N, K]: e4m3 codes
    bs_ptr,  # f32 [G, NB, KB]: one scale per BO x BI block
    c_ptr,  # [G, M, N] in a's dtype; SPLIT_K > 1: f32 [SPLIT_K, G, M, N]
    G: tl.constexpr,
    M: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    BO: tl.constexpr,
    BI: tl.constexpr,
    BITS: tl.constexpr,  # decode from the bit fields (interpreter) instead of Triton's fp8 conversion
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    NB: tl.constexpr = (N + BO - 1) // BO
    KB: tl.constexpr = (K + BI - 1) // BI
    SB: tl.constexpr = BLOCK_K // BI  # scale blocks a K step spans
    STEPS: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    # split s takes K steps [s * PER, (s + 1) * PER): a constant trip count keeps the loop pipelined; the
    # last split's steps past K load nothing (it may have none)
    PER: tl.constexpr = (STEPS + SPLIT_K - 1) // SPLIT_K
    pid_m, pid_n = program_tile(N, BLOCK_N)
    pid_k = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    step0 = pid_k * PER
    a_ptr += g * M * K
    b_ptr += g * N * K
    bs_ptr += g * NB * KB
    c_ptr += (pid_k.to(tl.int64) * G + g) * M * N
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rs = tl.arange(0, SB)
    m_ok = rm < M
    n_ok = rn < N
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * K + step0 * BLOCK_K + rk[None, :]
    b_ptrs = b_ptr + rn[:, None].to(tl.int64) * K + step0 * BLOCK_K + rk[None, :]
    s_ptrs = bs_ptr + (rn // BO)[:, None].to(tl.int64) * KB + step0 * SB + rs[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for i in range(0, PER):
        k0 = (step0 + i) * BLOCK_K
        k_ok = k0 + rk < K  # false for the whole step past K
        s_ok = k0 // BI + rs < KB
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        codes = tl.load(b_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0)
        s = tl.load(s_ptrs, mask=n_ok[:, None] & s_ok[None, :], other=0.0)
        if BITS:
            w = _e4m3_to_f32(codes.to(tl.int32))
        else:
            w = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        w = tl.reshape(tl.reshape(w, [BLOCK_N, SB, BI]) * s[:, :, None], [BLOCK_N, BLOCK_K])
        acc = tl.dot(a, tl.trans(w.to(a_ptr.dtype.element_ty)), acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
        s_ptrs += SB
    tl.store(
        c_ptr + rm[:, None].to(tl.int64) * N + rn[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def constexprs(
    m: int, n: int, k: int, block: tuple[int, int], decode: str, cfg: Fp8Config, groups: int = 1
) -> dict:
    """Compile-time constants of one shape; checks the config and the scale block against each other."""
    bo, bi = block
    if decode not in DECODES:
        raise ValueError(f"decode must be one of {DECODES}, got {decode!r}")
    if bo < 1 or bi < 1 or cfg.block_k % bi:
        raise ValueError(
            f"the weight's scale block {block} must have its K side dividing BLOCK_K {cfg.block_k}"
        )
    return dict(
        G=groups,
        M=m,
        N=n,
        K=k,
        BO=bo,
        BI=bi,
        BITS=decode == "bits",
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=split_k(cfg),
    )


def grid(m: int, n: int, cfg: Fp8Config, groups: int = 1) -> tuple[int, int, int]:
    """(output tiles, K splits, groups)."""
    return triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split_k(cfg), groups


def launch_torch(a, codes, scale, block: tuple[int, int], cfg: Fp8Config, decode: str = "bits"):
    """Runs the kernel on torch tensors (GPU, or CPU under TRITON_INTERPRET=1): a [G, m, K], codes uint8
    [G, N, K], scale float32 [G, ceil(N / BO), ceil(K / BI)]. Returns [G, m, N] in a's dtype, or with
    split_k(cfg) > 1 the f32 partials [split_k, G, m, N] to be summed over the first axis."""
    import torch

    groups, m, k = a.shape
    n = codes.shape[1]
    cx = constexprs(m, n, k, block, decode, cfg, groups)
    shape, dtype = (groups, m, n), a.dtype
    if split_k(cfg) > 1:
        shape, dtype = (split_k(cfg), groups, m, n), torch.float32
    c = torch.full(shape, float("nan"), dtype=dtype, device=a.device)
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    fp8_weight_gemm_kernel[grid(m, n, cfg, groups)](
        a.contiguous(), codes.contiguous(), scale.contiguous(), c, **cx, **opts
    )
    return c
