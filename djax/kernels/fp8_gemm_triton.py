"""Triton FP8 e4m3 block-scaled GEMMs (dense, grouped contiguous, grouped masked) for Hopper.

Scales as in fp8_gemm_ref: a_scale f32[rows, ceil(K/128)], b_scale f32[G, ceil(N/128), ceil(K/128)]. Each
128-wide K block is one fp8 dot started from zero, then scaled and added to a float32 accumulator in
registers (DeepGEMM's promotion: the tensor cores' fp8 accumulator never sums more than 128 products).
BLOCK_N divides 128 so a tile sees one weight scale per K block. Tiles and skipped rows as in
grouped_gemm_triton (DENSE: one group, every row live).

Split-K: program (tile, s) of a 2-D grid sums the s-th run of ceil(KB / SPLIT_K) K blocks and writes its f32
partial to c[s]; the caller sums c over its first axis. At decode the output has too few tiles to fill 132
SMs, so the K axis supplies the parallelism (`dense_config`; for the grouped layouts the MoE experts' caller
picks it). Rows a program skips stay unwritten in every partial, as without a split.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import triton
import triton.language as tl

from djax.kernels.dispatch import per_gpu, sm_count
from djax.kernels.grouped_gemm_triton import GemmConfig, _tile

SCALE_BLOCK = 128


@dataclass(frozen=True)
class Fp8Config(GemmConfig):
    """GemmConfig plus split_k: the number of programs sharing each output tile's K blocks (dense only)."""

    split_k: int = 1


DEFAULT_CFG = Fp8Config(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4)
# m = 64, n = 4096, k = 7168 on the H200 (bench_kernels' fp8 section): 128 x 128 tiles give 32 programs
# on 132 SMs, 31.7 us; 64 x 64 tiles with K split four ways (256 programs, 14 of the 56 K blocks each)
# 12.9 us (11.0 kernel + 1.9 sum) = 58% of copy bandwidth, against 14.0 us split two ways, 18.5 us unsplit
# and XLA's per-tensor FP8 dot at 13.9 us (results/kernels_h200_fp8_scales.json). BLOCK_M 64 is the
# smallest wgmma tile (M < 64 falls back to mma.sync).
DECODE_CFG = Fp8Config(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=6, split_k=4)


def dense_config(m: int, n: int, k: int) -> Fp8Config:
    """The dense kernel's config when none is given. DEFAULT_CFG (prefill, tensor-core bound) where m > 64
    and its 128 x 128 tiles cover the SMs (`dispatch.sm_count`); otherwise the weights' bytes set the time
    and the tiles are too few, so DECODE_CFG's 64 x 64 tiles with K split until about two programs (96 KB of
    shared memory each) can run per SM: the fewest splits of 1, 2, 4 or 8 (dividing the K blocks, two or
    more each) that make 256 programs on 132 SMs (`dispatch.per_gpu`), else the most of them.

    On the H200 (bench_kernels' fp8 and fp8_linear sections): at m 64, n 4096, k 7168 split 4 (256
    programs) took 12.9 us against 14.0 split 2 and 18.5 unsplit; at m 1 and 32, n 32768, k 1024 the
    former fixed split of 4 (2,048 programs of two K blocks, then their f32 sum) took 18.8-21.3 us for
    32 MB; at m 128, n 4096, k 8192 128 x 128 tiles (32 programs) took 36.9 us, cuBLAS on a bf16 weight
    22.4."""
    if m > 64 and -(-m // 128) * -(-n // 128) >= sm_count():
        return DEFAULT_CFG
    tiles = -(-m // DECODE_CFG.block_m) * -(-n // DECODE_CFG.block_n)
    return replace(DECODE_CFG, split_k=fewest_splits(tiles, -(-k // SCALE_BLOCK)))


def fewest_splits(tiles: int, k_blocks: int, choices: tuple[int, ...] = (1, 2, 4, 8)) -> int:
    """The K split of a decode GEMM of `tiles` output tiles: the fewest of `choices` splits (dividing the K
    blocks, two or more each) that make 256 programs on 132 SMs, about two a SM (`dispatch.per_gpu`), else
    the most of them."""
    splits = [s for s in choices if k_blocks % s == 0 and k_blocks // s >= 2] or [1]
    programs = per_gpu(256)
    return next((s for s in splits if tiles * s >= programs), splits[-1])


@triton.jit
def program_tile(N: tl.constexpr, BLOCK_N: tl.constexpr):
    """(row tile, column tile) of this program, column tiles fastest: the programs of one row tile run
    together and share its rows of a through L2."""
    n_tiles: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    return pid // n_tiles, pid % n_tiles


@triton.jit
def act_scales(as_ptrs, kb, live, KB: tl.constexpr, KSTEP: tl.constexpr):
    """The activation scales [rows] of K block kb, or with KSTEP > 1 those of blocks kb .. kb + KSTEP - 1 as
    [rows, KSTEP]. Blocks past the last read the last one's: their a and b tiles load as zeros, so any finite
    scale will do, and the reads stay in bounds without a mask."""
    if KSTEP == 1:
        s = tl.load(as_ptrs + tl.minimum(kb, KB - 1), mask=live, other=0.0)
    else:
        kbs = tl.minimum(kb + tl.arange(0, KSTEP), KB - 1)
        s = tl.load(as_ptrs[:, None] + kbs[None, :], mask=live[:, None], other=0.0)
    return s


@triton.jit
def weight_scales(bs_ptrs, kb, KB: tl.constexpr, KSTEP: tl.constexpr):
    """The weight scale (a scalar) of K block kb, or [KSTEP] of blocks kb .. kb + KSTEP - 1, as `act_scales`."""
    if KSTEP == 1:
        s = tl.load(bs_ptrs + tl.minimum(kb, KB - 1))
    else:
        s = tl.load(bs_ptrs + tl.minimum(kb + tl.arange(0, KSTEP), KB - 1))
    return s


@triton.jit
def step_scale(sa, sb, j: tl.constexpr, KSTEP: tl.constexpr):
    """The [rows] products of activation and weight scales of block j of a loop step (`act_scales`,
    `weight_scales`)."""
    if KSTEP == 1:
        s = sa * sb
    else:
        pick = tl.arange(0, KSTEP) == j
        s = tl.sum(tl.where(pick[None, :], sa, 0.0), axis=1) * tl.sum(tl.where(pick, sb, 0.0), axis=0)
    return s


@triton.jit
def fp8_gemm_kernel(
    a_ptr,  # fp8[rows, K]
    as_ptr,  # f32[rows, KB]
    b_ptr,  # fp8[G, N, K]
    bs_ptr,  # f32[G, NB, KB]
    grp_ptr,  # contiguous: int32[M] group per row; masked: int32[G] live rows; dense: unused (any int32)
    c_ptr,  # [rows, N]; SPLIT_K > 1: f32[SPLIT_K, rows, N]
    M: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    MG: tl.constexpr,
    DENSE: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    KSTEP: tl.constexpr,  # 128-wide K blocks a loop step loads (`k_step`)
):
    BK: tl.constexpr = 128
    KB: tl.constexpr = (K + BK - 1) // BK
    NB: tl.constexpr = (N + BK - 1) // BK
    pid_m, pid_n = program_tile(N, BLOCK_N)
    if DENSE:
        g = tl.full([], 0, tl.int32)
        src = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        dst = src
        live = src < M
    else:
        g, src, dst, live = _tile(grp_ptr, grp_ptr, pid_m, M, MG, BLOCK_M, MASKED, False)
        if g < 0:
            return
    # split s takes K blocks [s * KBS, (s + 1) * KBS): a constant trip count keeps the loop pipelined (and
    # runs in Triton's interpreter); the last split's blocks past KB load nothing (it may have none)
    KBS: tl.constexpr = (KB + SPLIT_K - 1) // SPLIT_K
    pid_k = tl.program_id(1)
    kb0 = pid_k * KBS
    c_ptr += pid_k.to(tl.int64) * M * N
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + src[:, None] * K + kb0 * BK + rk[None, :]
    b_ptrs = b_ptr + (g.to(tl.int64) * N + rn[:, None]) * K + kb0 * BK + rk[None, :]
    as_ptrs = as_ptr + src * KB
    bs_ptrs = bs_ptr + (g.to(tl.int64) * NB + (pid_n * BLOCK_N) // BK) * KB
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # The scales are read one loop step ahead, by hand: Triton pipelines only the loads that feed the dot, and
    # a scale read in its own iteration stalled every step on a memory round trip (a quarter of the m = 64
    # kernel's stall samples on the H200).
    sa, sb = act_scales(as_ptrs, kb0, live, KB, KSTEP), weight_scales(bs_ptrs, kb0, KB, KSTEP)
    for i in range(0, KBS, KSTEP):
        sa_next = act_scales(as_ptrs, kb0 + i + KSTEP, live, KB, KSTEP)
        sb_next = weight_scales(bs_ptrs, kb0 + i + KSTEP, KB, KSTEP)
        for j in tl.static_range(KSTEP):
            kb = kb0 + i + j
            k_ok = kb * BK + rk < K  # false for the whole block when kb >= KB
            if KBS % KSTEP != 0:
                k_ok = k_ok & (i + j < KBS)  # the split's last step may reach into the next split's blocks
            a = tl.load(a_ptrs + j * BK, mask=live[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs + j * BK, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            part = tl.dot(a, tl.trans(b))
            acc += part * step_scale(sa, sb, j, KSTEP)[:, None]
        sa, sb = sa_next, sb_next
        a_ptrs += KSTEP * BK
        b_ptrs += KSTEP * BK
    tl.store(
        c_ptr + dst[:, None] * N + rn[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=live[:, None] & n_ok[None, :],
    )


def split_k(cfg: GemmConfig) -> int:
    """cfg.split_k for an Fp8Config, 1 for a plain GemmConfig; refuses a count under 1 (every kernel that splits
    K reads it here)."""
    s = getattr(cfg, "split_k", 1)
    if s < 1:
        raise ValueError(f"split_k {s} must be >= 1")
    return s


def k_step(cfg: GemmConfig) -> int:
    """128-wide K blocks (one scale each) a loop step of the FP8 kernels loads: block_k / 128 for a block_k of
    256 or 512, else 1 (the FP8 configs name 128, the scale block; a GemmConfig's default 64 reads as 128).
    Longer steps load more bytes of each weight row at once, with one loop step's overhead."""
    if cfg.block_k <= SCALE_BLOCK:
        return 1
    if cfg.block_k not in (2 * SCALE_BLOCK, 4 * SCALE_BLOCK):
        raise ValueError(f"an FP8 kernel's block_k must be 128, 256 or 512, got {cfg.block_k}")
    return cfg.block_k // SCALE_BLOCK


def grid(m: int, n: int, cfg: GemmConfig) -> tuple[int, int]:
    """(output tiles, K splits)."""
    return triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split_k(cfg)


def constexprs(m: int, n: int, k: int, mg: int, mode: str, cfg: GemmConfig) -> dict:
    """mode: "dense" | "contiguous" | "masked". m: output rows (masked: groups * mg)."""
    if SCALE_BLOCK % cfg.block_n:
        raise ValueError(f"BLOCK_N {cfg.block_n} must divide the 128-wide weight scale block")
    if mode == "masked" and mg % cfg.block_m:
        raise ValueError(f"masked rows per group {mg} must be a multiple of BLOCK_M {cfg.block_m}")
    if mode == "contiguous" and m % cfg.block_m:
        raise ValueError(f"contiguous rows {m} must be a multiple of BLOCK_M {cfg.block_m}")
    return dict(
        M=m,
        N=n,
        K=k,
        MG=mg,
        DENSE=mode == "dense",
        MASKED=mode == "masked",
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        SPLIT_K=split_k(cfg),
        KSTEP=k_step(cfg),
    )


def launch_torch(a, a_scale, b, b_scale, groups=None, mode: str = "dense", cfg=DEFAULT_CFG):
    """Runs the kernel on torch tensors (GPU, or CPU under TRITON_INTERPRET=1 with float32 stand-ins for
    fp8). dense: a [m, K], b [N, K]; contiguous: a [m, K], b [G, N, K], groups int32[m]; masked:
    a [G, MG, K], groups int32[G]. Unwritten rows come back as nan. split_k(cfg) > 1: returns the f32
    partials [split_k, m, N], to be summed over the first axis."""
    import torch

    if mode == "dense":
        b, b_scale = b[None], b_scale[None]
    nb, n, k = b.shape
    mg = a.shape[1] if mode == "masked" else 0
    m = nb * mg if mode == "masked" else a.shape[0]
    cx = constexprs(m, n, k, mg, mode, cfg)
    out_dtype = torch.bfloat16 if a.dtype != torch.float32 else torch.float32
    shape = (*a.shape[:-1], n)
    if split_k(cfg) > 1:
        out_dtype, shape = torch.float32, (split_k(cfg), *shape)
    c = torch.full(shape, float("nan"), dtype=out_dtype, device=a.device)
    g = groups.to(torch.int32) if groups is not None else torch.zeros(1, dtype=torch.int32, device=a.device)
    fp8_gemm_kernel[grid(m, n, cfg)](
        a.contiguous(),
        a_scale.float().contiguous(),
        b.contiguous(),
        b_scale.float().contiguous(),
        g,
        c,
        **cx,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return c
