"""Triton: an MoE expert's FP8 gate and up projections from one pass over its rows, then the clamped SwiGLU.

Contract: `fp8_gemm_ref.grouped_swiglu_contiguous_ref` on the picks' rows; padding rows are left unwritten.
Contiguous layout as in `fp8_gemm_triton` (groups padded to multiples of BLOCK_M, `m_indices` per row, a tile
whose first row is padding skipped), with each row's activations read from the token rows through `rows`, so
no gathered copy of the quantized tokens is made. Every 128-wide K block of both weights is promoted as in
`fp8_gemm_kernel` (DeepGEMM's per-block scaling); gate and up are rounded to the model's dtype (ROUND) before the SwiGLU, as
the separate GEMMs' bf16 outputs are, and h is written in float32 for the 1x128 quantization that follows.

Why one kernel: the separate path reads the activations twice, writes gate and up and reads them back, and
at a token or two adds a K split's partial sums and their XLA reductions. There is no K split here (a
split's partials would have to meet before the nonlinearity): at decode the column tiles are narrowed
instead (`moe_experts.swiglu_config`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from djax.kernels.fp8_gemm_triton import (
    SCALE_BLOCK,
    act_scales,
    k_step,
    program_tile,
    step_scale,
    weight_scales,
)
from djax.kernels.grouped_gemm_triton import GemmConfig, _tile

# Whether a live tile's padding rows are written (as zeros) too; the op leaves them unwritten, and the
# benchmarks set this to time the kernel as it was.
PAD_ROWS = False
ROUNDINGS = {"float32": 0, "bfloat16": 1, "float16": 2}  # ROUND: the dtype gate and up pass through


def rounding(gate_dtype: str) -> int:
    """The kernel's ROUND for a gate dtype's name; ValueError for one it cannot round to."""
    if gate_dtype not in ROUNDINGS:
        raise ValueError(f"gate_dtype must be one of {tuple(ROUNDINGS)}, got {gate_dtype}")
    return ROUNDINGS[gate_dtype]


@triton.jit
def _round_bf16(x):
    """float32 rounded to the nearest bfloat16 (ties to even), kept in float32. By its bits, so that Triton's
    CPU interpreter, whose bf16 cast truncates, computes what the GPU's does. x is finite."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def fp8_swiglu_kernel(
    a_ptr,  # fp8[n, K]: token rows
    as_ptr,  # f32[n, KB]
    rows_ptr,  # int32[M]: the token row of each padded row, -1 for padding
    w1_ptr,  # fp8[G, N, K]: gate
    s1_ptr,  # f32[G, NB, KB]
    w3_ptr,  # fp8[G, N, K]: up
    s3_ptr,  # f32[G, NB, KB]
    grp_ptr,  # int32[M]: the group of each row, -1 for padding
    h_ptr,  # f32[M, N]
    M: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    LIMIT: tl.constexpr,  # <= 0: no clamp
    ROUND: tl.constexpr,  # ROUNDINGS
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KSTEP: tl.constexpr,  # 128-wide K blocks a loop step loads (`fp8_gemm_triton.k_step`)
    PAD_ROWS: tl.constexpr,  # also write the padding rows of a live tile (zeros)
):
    BK: tl.constexpr = 128
    KB: tl.constexpr = (K + BK - 1) // BK
    NB: tl.constexpr = (N + BK - 1) // BK
    pid_m, pid_n = program_tile(N, BLOCK_N)
    g, src, dst, live = _tile(grp_ptr, rows_ptr, pid_m, M, 0, BLOCK_M, False, True)
    if g < 0:
        return
    src = tl.maximum(src, 0)  # padding rows (not live) read nothing
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + src[:, None] * K + rk[None, :]
    w_off = (g.to(tl.int64) * N + rn[:, None]) * K + rk[None, :]
    w1_ptrs = w1_ptr + w_off
    w3_ptrs = w3_ptr + w_off
    as_ptrs = as_ptr + src * KB
    s_off = (g.to(tl.int64) * NB + (pid_n * BLOCK_N) // BK) * KB
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # scales one loop step ahead, as in fp8_gemm_kernel (Triton pipelines only the loads feeding the dots)
    sa = act_scales(as_ptrs, 0, live, KB, KSTEP)
    s1 = weight_scales(s1_ptr + s_off, 0, KB, KSTEP)
    s3 = weight_scales(s3_ptr + s_off, 0, KB, KSTEP)
    for kb0 in range(0, KB, KSTEP):
        sa_next = act_scales(as_ptrs, kb0 + KSTEP, live, KB, KSTEP)
        s1_next = weight_scales(s1_ptr + s_off, kb0 + KSTEP, KB, KSTEP)
        s3_next = weight_scales(s3_ptr + s_off, kb0 + KSTEP, KB, KSTEP)
        for j in tl.static_range(KSTEP):
            k_ok = (kb0 + j) * BK + rk < K  # false for the whole block past the last
            a = tl.load(a_ptrs + j * BK, mask=live[:, None] & k_ok[None, :], other=0.0)
            w1 = tl.load(w1_ptrs + j * BK, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            w3 = tl.load(w3_ptrs + j * BK, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            gate += tl.dot(a, tl.trans(w1)) * step_scale(sa, s1, j, KSTEP)[:, None]
            up += tl.dot(a, tl.trans(w3)) * step_scale(sa, s3, j, KSTEP)[:, None]
        sa, s1, s3 = sa_next, s1_next, s3_next
        a_ptrs += KSTEP * BK
        w1_ptrs += KSTEP * BK
        w3_ptrs += KSTEP * BK
    if ROUND == 1:
        gate = _round_bf16(gate)
        up = _round_bf16(up)
    if ROUND == 2:
        gate = gate.to(tl.float16).to(tl.float32)
        up = up.to(tl.float16).to(tl.float32)
    if LIMIT > 0:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    h = gate * tl.sigmoid(gate) * up  # padding rows: 0 (their gate and up are)
    # Only the picks' rows by default: the down projection's quantization takes padding rows as zeros without
    # reading them, and at decode a live 16-row tile holds one or two picks (PAD_ROWS: every row of the tile)
    rows_out = (dst < M) if PAD_ROWS else live
    tl.store(h_ptr + dst[:, None] * N + rn[None, :], h, mask=rows_out[:, None] & n_ok[None, :])


def constexprs(m: int, n: int, k: int, limit: float, gate_dtype: str, cfg: GemmConfig) -> dict:
    """Compile-time constants of one shape; m the padded rows."""
    if SCALE_BLOCK % cfg.block_n:
        raise ValueError(f"BLOCK_N {cfg.block_n} must divide the 128-wide weight scale block")
    if m % cfg.block_m:
        raise ValueError(f"contiguous rows {m} must be a multiple of BLOCK_M {cfg.block_m}")
    return dict(
        M=m,
        N=n,
        K=k,
        LIMIT=float(limit),
        ROUND=rounding(gate_dtype),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        KSTEP=k_step(cfg),
        PAD_ROWS=PAD_ROWS,
    )


def grid(m: int, n: int, cfg: GemmConfig) -> tuple[int]:
    return (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)


def launch_torch(a, a_scale, rows, w1, s1, w3, s3, groups, limit: float, gate_dtype: str, cfg: GemmConfig):
    """Runs the kernel on torch tensors (GPU, or CPU under TRITON_INTERPRET=1 with float32 stand-ins for
    fp8). Padding rows come back as nan (PAD_ROWS: only those of skipped tiles)."""
    import torch

    m, (_, n, k) = groups.shape[0], w1.shape
    cx = constexprs(m, n, k, limit, gate_dtype, cfg)
    h = torch.full((m, n), float("nan"), dtype=torch.float32, device=a.device)
    f32 = lambda x: x.float().contiguous()  # noqa: E731
    fp8_swiglu_kernel[grid(m, n, cfg)](
        a.contiguous(),
        f32(a_scale),
        rows.to(torch.int32),
        w1.contiguous(),
        f32(s1),
        w3.contiguous(),
        f32(s3),
        groups.to(torch.int32),
        h,
        **cx,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return h
