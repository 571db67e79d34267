"""Triton grouped GEMMs for MoE experts (bf16): c[m, :] = a[row m] @ b[group of m]^T, weights in torch layout.

One program per (BLOCK_M rows, BLOCK_N columns) tile; every M-tile belongs to one group. Contiguous layout:
rows sorted by group, each group padded to a multiple of BLOCK_M, `m_indices` the group of each row (-1 for
padding); a tile whose first row is padding is skipped. Masked layout: a[g, MG, K] with the first counts[g]
rows of group g live; tiles past the count are skipped. Skipped tiles and dead rows are left unwritten.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and launch resources of one compiled variant."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 4


@triton.jit
def _tile(
    grp_ptr, rows_ptr, pid_m, M, MG, BLOCK_M: tl.constexpr, MASKED: tl.constexpr, HAS_ROWS: tl.constexpr
):
    """(group, row of a feeding each tile row, output row, live rows); group -1 means skip the tile."""
    r = tl.arange(0, BLOCK_M)
    if MASKED:
        tiles_per_group = (MG + BLOCK_M - 1) // BLOCK_M
        g = pid_m // tiles_per_group
        start = (pid_m % tiles_per_group) * BLOCK_M
        count = tl.minimum(tl.load(grp_ptr + g), MG)
        g = tl.where(start < count, g, -1)
        live = start + r < count
        src = g.to(tl.int64) * MG + start + r
        dst = src
    else:
        rm = pid_m * BLOCK_M + r
        g = tl.load(grp_ptr + pid_m * BLOCK_M)
        live = rm < M
        src = rm.to(tl.int64)
        dst = src
        if HAS_ROWS:
            src = tl.load(rows_ptr + rm, mask=live, other=-1).to(tl.int64)
            live = live & (src >= 0)
    return g, src, dst, live


@triton.jit
def _mainloop(
    a_ptr, b_ptr, g, src, live, rn, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """acc[BLOCK_M, BLOCK_N] = a[src, :] @ b[g, rn, :]^T in float32 (dead rows read as 0)."""
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + src[:, None] * K + rk[None, :]
    b_ptrs = b_ptr + (g.to(tl.int64) * N + rn[:, None]) * K + rk[None, :]
    n_ok = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + rk < K
        a = tl.load(a_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


@triton.jit
def grouped_gemm_kernel(
    a_ptr,  # [M or G*MG, K] (contiguous without rows / masked) or [n, K] gathered by rows_ptr
    rows_ptr,  # int32[M]: the row of a feeding each output row, -1 = zero row (read only when HAS_ROWS)
    b_ptr,  # [G, N, K]
    grp_ptr,  # contiguous: int32[M] group of each row; masked: int32[G] live rows per group
    c_ptr,  # [M or G*MG, N]
    M: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    MG: tl.constexpr,  # masked: rows per group
    MASKED: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # n fastest: the programs of one M-tile run together and share its rows of a through L2
    pid = tl.program_id(0)
    n_tiles: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    pid_m = pid // n_tiles
    g, src, dst, live = _tile(grp_ptr, rows_ptr, pid_m, M, MG, BLOCK_M, MASKED, HAS_ROWS)
    if g < 0:
        return
    rn = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _mainloop(a_ptr, b_ptr, g, src, live, rn, N, K, BLOCK_M, BLOCK_N, BLOCK_K)
    tl.store(
        c_ptr + dst[:, None] * N + rn[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=live[:, None] & (rn < N)[None, :],
    )


@triton.jit
def grouped_swiglu_kernel(
    a_ptr,  # as in grouped_gemm_kernel
    rows_ptr,
    w1_ptr,  # [G, N, K] gate
    w3_ptr,  # [G, N, K] up
    grp_ptr,
    h_ptr,  # [M or G*MG, N]: silu(min(a w1^T, L)) * clip(a w3^T, -L, L)
    M: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    MG: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    LIMIT: tl.constexpr,  # <= 0: no clamp
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Gate and up projections of one tile from one read of its rows of a, then the clamped SwiGLU."""
    pid = tl.program_id(0)
    n_tiles: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    pid_m = pid // n_tiles
    g, src, dst, live = _tile(grp_ptr, rows_ptr, pid_m, M, MG, BLOCK_M, MASKED, HAS_ROWS)
    if g < 0:
        return
    rn = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + src[:, None] * K + rk[None, :]
    w_off = (g.to(tl.int64) * N + rn[:, None]) * K + rk[None, :]
    w1_ptrs = w1_ptr + w_off
    w3_ptrs = w3_ptr + w_off
    n_ok = rn < N
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + rk < K
        a = tl.load(a_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0)
        w1 = tl.load(w1_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        w3 = tl.load(w3_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        gate = tl.dot(a, tl.trans(w1), gate)
        up = tl.dot(a, tl.trans(w3), up)
        a_ptrs += BLOCK_K
        w1_ptrs += BLOCK_K
        w3_ptrs += BLOCK_K
    if LIMIT > 0:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    h = gate * tl.sigmoid(gate) * up
    tl.store(
        h_ptr + dst[:, None] * N + rn[None, :],
        h.to(h_ptr.dtype.element_ty),
        mask=live[:, None] & n_ok[None, :],
    )


def constexprs(m: int, n: int, k: int, mg: int, masked: bool, has_rows: bool, cfg: GemmConfig) -> dict:
    """Compile-time constants of one shape. m: rows of the output (contiguous) or groups * mg (masked)."""
    if masked and mg % cfg.block_m:
        raise ValueError(f"masked rows per group {mg} must be a multiple of BLOCK_M {cfg.block_m}")
    if not masked and m % cfg.block_m:
        raise ValueError(f"contiguous rows {m} must be a multiple of BLOCK_M {cfg.block_m}")
    return dict(
        M=m,
        N=n,
        K=k,
        MG=mg,
        MASKED=masked,
        HAS_ROWS=has_rows,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
    )


def masked_config(mg: int, candidates: tuple[GemmConfig, ...]) -> GemmConfig:
    """The first of `candidates` (widest tiles first) whose block_m divides mg, the masked rows per group: what
    the masked GEMMs run when no config is given."""
    for cfg in candidates:
        if mg % cfg.block_m == 0:
            return cfg
    raise ValueError(f"masked rows per group {mg} must be a multiple of {min(c.block_m for c in candidates)}")


def grid(m: int, n: int, cfg: GemmConfig) -> tuple[int]:
    return (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)


def launch_torch(
    a, b, groups, rows=None, masked: bool = False, b3=None, limit: float = 0.0, cfg=GemmConfig()
):
    """Runs a kernel on torch tensors (GPU, or CPU under TRITON_INTERPRET=1); unwritten rows come back as nan.

    Contiguous: a [M, K] (or [n, K] with rows int32[M]), groups int32[M]. Masked: a [G, MG, K], groups
    int32[G]. b [G, N, K]; with b3 (same shape) the fused SwiGLU kernel runs with b as the gate.
    """
    import torch

    nb, n, k = b.shape
    mg = a.shape[1] if masked else 0
    m = nb * mg if masked else groups.shape[0]
    cx = constexprs(m, n, k, mg, masked, rows is not None, cfg)
    out_shape = (nb, mg, n) if masked else (m, n)
    c = torch.full(out_shape, float("nan"), dtype=a.dtype, device=a.device)
    g = groups.to(torch.int32)
    r = rows.to(torch.int32) if rows is not None else g
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if b3 is None:
        grouped_gemm_kernel[grid(m, n, cfg)](a.contiguous(), r, b.contiguous(), g, c, **cx, **opts)
    else:
        grouped_swiglu_kernel[grid(m, n, cfg)](
            a.contiguous(), r, b.contiguous(), b3.contiguous(), g, c, **cx, LIMIT=float(limit), **opts
        )
    return c
