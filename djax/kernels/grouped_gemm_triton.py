"""Triton grouped GEMMs for MoE experts (bf16): c[m, :] = a[row m] @ b[group of m]^T, weights in torch layout.

One program per (BLOCK_M rows, BLOCK_N columns) tile; every M-tile belongs to one group. Contiguous layout:
rows sorted by group, each group padded to a multiple of BLOCK_M, `m_indices` the group of each row (-1 for
padding); a tile whose first row is padding is skipped. Masked layout: a[g, MG, K] with the first counts[g]
rows of group g live; tiles past the count are skipped. Skipped tiles and dead rows are left unwritten.

FP4 weights (FP4=True, V4.1's routed experts): b is uint8 [G, N, K / 2], two e2m1 codes a byte (low nibble =
even k), with one UE8M0 exponent byte per 32 inputs in bs [G, N, K / 32]. Each K step loads the packed tile
and its scales and decodes it in registers to a's dtype (exactly: an e2m1 value times a power of two has at
most two significant bits), so the weights cross memory at 0.53 bytes a value instead of bf16's 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from djax.kernels import fp4_decode

FP4_PTX = tl.constexpr(fp4_decode.ptx())
FP4_CONSTRAINTS = tl.constexpr(fp4_decode.CONSTRAINTS)


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and launch resources of one compiled variant."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 4


@dataclass(frozen=True)
class Fp4Config(GemmConfig):
    """GemmConfig plus how FP4 weights are decoded on CUDA: "asm" (`fp4_decode`'s PTX, what a plain
    GemmConfig gets) or "bits" (code by code, as Triton's interpreter runs it: the first's slow twin)."""

    fp4_decode: str = "asm"


def fp4_asm(cfg: GemmConfig, on_gpu: bool, dtype_name: str) -> bool:
    """Whether FP4 weights go through the PTX decode: asked for (the default), on a GPU (the interpreter cannot
    run PTX) and for bf16 activations (the PTX writes bf16)."""
    decode = getattr(cfg, "fp4_decode", "asm")
    if decode not in ("asm", "bits"):
        raise ValueError(f"fp4_decode must be 'asm' or 'bits', got {decode!r}")
    return decode == "asm" and on_gpu and dtype_name == "bfloat16"


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
def _e2m1_to_f32(codes):
    """e2m1 codes (int32, 0..15; bit 3 the sign) -> their float32 values, built from the bits: exponent
    field e = bits 1-2, mantissa bit 0; e > 0 is 2^(e - 1) (1 + m / 2), e = 0 is m / 2 (0.5 or 0)."""
    e = (codes >> 1) & 3
    m = codes & 1
    bits = tl.where(e > 0, ((e + 126) << 23) | (m << 22), m * (126 << 23))
    bits = bits | ((codes & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _ue8m0_to_f32(s):
    """UE8M0 exponent bytes (int32, 0..255) -> 2^(s - 127) in float32, as float8_e8m0fnu reads them: 0 is
    the subnormal 2^-127, 255 is nan."""
    bits = tl.where(s == 0, 1 << 22, s << 23)
    bits = tl.where(s == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _ue8m0_to_bf16(s):
    """UE8M0 exponent bytes (int32) -> 2^(s - 127) as bf16 (same exponent field; 0 the subnormal 2^-127, 255
    nan)."""
    bits = tl.where(s == 0, 0x40, s << 7)
    bits = tl.where(s == 255, 0x7FC0, bits)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _fp4_tile(
    p_ptrs, s_ptrs, n_ok, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, dtype, ASM: tl.constexpr
):
    """The [BLOCK_N, BLOCK_K] weight tile at inputs k0.. in `dtype`, from its packed codes [BLOCK_N,
    BLOCK_K / 2] and scale bytes [BLOCK_N, BLOCK_K / 32] (inputs past K read as code 0, scale 2^0).

    ASM (bf16 only, CUDA): `fp4_decode`'s PTX, four packed bytes a call; otherwise code by code from the bits
    in float32 (what Triton's CPU interpreter runs)."""
    if K % BLOCK_K == 0:
        p = tl.load(p_ptrs, mask=n_ok[:, None], other=0)
        s = tl.load(s_ptrs, mask=n_ok[:, None], other=127)
    else:
        kp_ok = k0 // 2 + tl.arange(0, BLOCK_K // 2) < K // 2
        ks_ok = k0 // 32 + tl.arange(0, BLOCK_K // 32) < K // 32
        p = tl.load(p_ptrs, mask=n_ok[:, None] & kp_ok[None, :], other=0)
        s = tl.load(s_ptrs, mask=n_ok[:, None] & ks_ok[None, :], other=127)
    s = s.to(tl.int32)
    if ASM:
        sb = tl.broadcast_to(_ue8m0_to_bf16(s)[:, :, None], [BLOCK_N, BLOCK_K // 32, 16])
        lo, hi = tl.inline_asm_elementwise(
            FP4_PTX,
            FP4_CONSTRAINTS,
            [p, tl.reshape(sb, [BLOCK_N, BLOCK_K // 2])],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=4,
        )
        return tl.reshape(tl.join(lo, hi), [BLOCK_N, BLOCK_K])  # low nibble first
    p = p.to(tl.int32)
    codes = tl.reshape(tl.join(p & 0xF, (p >> 4) & 0xF), [BLOCK_N, BLOCK_K])  # low nibble first
    w = tl.reshape(_e2m1_to_f32(codes), [BLOCK_N, BLOCK_K // 32, 32]) * _ue8m0_to_f32(s)[:, :, None]
    return tl.reshape(w, [BLOCK_N, BLOCK_K]).to(dtype)


@triton.jit
def _fp4_ptrs(w_ptr, s_ptr, g, rn, N, K, BLOCK_K: tl.constexpr):
    """Pointers to the first K step's packed codes and scale bytes of weight rows rn of group g."""
    row = g.to(tl.int64) * N + rn[:, None]
    p_ptrs = w_ptr + row * (K // 2) + tl.arange(0, BLOCK_K // 2)[None, :]
    s_ptrs = s_ptr + row * (K // 32) + tl.arange(0, BLOCK_K // 32)[None, :]
    return p_ptrs, s_ptrs


@triton.jit
def _mainloop(
    a_ptr,
    b_ptr,
    bs_ptr,
    g,
    src,
    live,
    rn,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP4: tl.constexpr,
    FP4_ASM: tl.constexpr,
):
    """acc[BLOCK_M, BLOCK_N] = a[src, :] @ b[g, rn, :]^T in float32 (dead rows read as 0)."""
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + src[:, None] * K + rk[None, :]
    n_ok = rn < N
    if FP4:
        p_ptrs, s_ptrs = _fp4_ptrs(b_ptr, bs_ptr, g, rn, N, K, BLOCK_K)
    else:
        b_ptrs = b_ptr + (g.to(tl.int64) * N + rn[:, None]) * K + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + rk < K
        a = tl.load(a_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0)
        if FP4:
            b = _fp4_tile(p_ptrs, s_ptrs, n_ok, k0, K, BLOCK_N, BLOCK_K, a_ptr.dtype.element_ty, FP4_ASM)
            p_ptrs += BLOCK_K // 2
            s_ptrs += BLOCK_K // 32
        else:
            b = tl.load(b_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            b_ptrs += BLOCK_K
        acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BLOCK_K
    return acc


@triton.jit
def grouped_gemm_kernel(
    a_ptr,  # [M or G*MG, K] (contiguous without rows / masked) or [n, K] gathered by rows_ptr
    rows_ptr,  # int32[M]: the row of a feeding each output row, -1 = zero row (read only when HAS_ROWS)
    b_ptr,  # [G, N, K]; FP4: uint8 [G, N, K / 2]
    bs_ptr,  # FP4: uint8 [G, N, K / 32] scale exponents; else unused (any pointer)
    grp_ptr,  # contiguous: int32[M] group of each row; masked: int32[G] live rows per group
    c_ptr,  # [M or G*MG, N]
    M: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    MG: tl.constexpr,  # masked: rows per group
    MASKED: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    FP4: tl.constexpr,
    FP4_ASM: tl.constexpr,  # FP4 decoded by fp4_decode's PTX (bf16, CUDA), else code by code
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
    acc = _mainloop(a_ptr, b_ptr, bs_ptr, g, src, live, rn, N, K, BLOCK_M, BLOCK_N, BLOCK_K, FP4, FP4_ASM)
    tl.store(
        c_ptr + dst[:, None] * N + rn[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=live[:, None] & (rn < N)[None, :],
    )


@triton.jit
def grouped_swiglu_kernel(
    a_ptr,  # as in grouped_gemm_kernel
    rows_ptr,
    w1_ptr,  # [G, N, K] gate; FP4: uint8 [G, N, K / 2]
    w3_ptr,  # [G, N, K] up; FP4: as w1
    s1_ptr,  # FP4: uint8 [G, N, K / 32] w1's scale exponents; else unused (any pointer)
    s3_ptr,  # FP4: w3's, as s1
    grp_ptr,
    h_ptr,  # [M or G*MG, N]: silu(min(a w1^T, L)) * clip(a w3^T, -L, L)
    M: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    MG: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    FP4: tl.constexpr,
    FP4_ASM: tl.constexpr,
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
    if FP4:
        p1_ptrs, s1_ptrs = _fp4_ptrs(w1_ptr, s1_ptr, g, rn, N, K, BLOCK_K)
        p3_ptrs, s3_ptrs = _fp4_ptrs(w3_ptr, s3_ptr, g, rn, N, K, BLOCK_K)
    else:
        w_off = (g.to(tl.int64) * N + rn[:, None]) * K + rk[None, :]
        w1_ptrs = w1_ptr + w_off
        w3_ptrs = w3_ptr + w_off
    n_ok = rn < N
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + rk < K
        a = tl.load(a_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0)
        if FP4:
            dt = a_ptr.dtype.element_ty
            w1 = _fp4_tile(p1_ptrs, s1_ptrs, n_ok, k0, K, BLOCK_N, BLOCK_K, dt, FP4_ASM)
            w3 = _fp4_tile(p3_ptrs, s3_ptrs, n_ok, k0, K, BLOCK_N, BLOCK_K, dt, FP4_ASM)
            p1_ptrs += BLOCK_K // 2
            p3_ptrs += BLOCK_K // 2
            s1_ptrs += BLOCK_K // 32
            s3_ptrs += BLOCK_K // 32
        else:
            w1 = tl.load(w1_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            w3 = tl.load(w3_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            w1_ptrs += BLOCK_K
            w3_ptrs += BLOCK_K
        gate = tl.dot(a, tl.trans(w1), gate)
        up = tl.dot(a, tl.trans(w3), up)
        a_ptrs += BLOCK_K
    if LIMIT > 0:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    h = gate * tl.sigmoid(gate) * up
    tl.store(
        h_ptr + dst[:, None] * N + rn[None, :],
        h.to(h_ptr.dtype.element_ty),
        mask=live[:, None] & n_ok[None, :],
    )


def constexprs(
    m: int,
    n: int,
    k: int,
    mg: int,
    masked: bool,
    has_rows: bool,
    cfg: GemmConfig,
    fp4: bool = False,
    asm: bool = False,
) -> dict:
    """Compile-time constants of one shape. m: rows of the output (contiguous) or groups * mg (masked); k the
    logical inputs (FP4: twice the packed bytes a row)."""
    if masked and mg % cfg.block_m:
        raise ValueError(f"masked rows per group {mg} must be a multiple of BLOCK_M {cfg.block_m}")
    if not masked and m % cfg.block_m:
        raise ValueError(f"contiguous rows {m} must be a multiple of BLOCK_M {cfg.block_m}")
    if fp4 and (cfg.block_k % 32 or k % 32):
        raise ValueError(
            f"FP4 weights need BLOCK_K {cfg.block_k} and K {k} multiples of their 32-input scale"
        )
    return dict(
        M=m,
        N=n,
        K=k,
        MG=mg,
        MASKED=masked,
        HAS_ROWS=has_rows,
        FP4=fp4,
        FP4_ASM=fp4 and asm,
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
    a, b, groups, rows=None, masked: bool = False, b3=None, limit: float = 0.0, cfg=GemmConfig(), scales=None
):
    """Runs a kernel on torch tensors (GPU, or CPU under TRITON_INTERPRET=1); unwritten rows come back as nan.

    Contiguous: a [M, K] (or [n, K] with rows int32[M]), groups int32[M]. Masked: a [G, MG, K], groups
    int32[G]. b [G, N, K]; with b3 (same shape) the fused SwiGLU kernel runs with b as the gate. FP4 weights:
    b (and b3) uint8 [G, N, K / 2] and `scales` their uint8 [G, N, K / 32] scale exponents, one tensor a
    weight (b's, then b3's).
    """
    import torch

    fp4 = scales is not None
    nb, n, k = b.shape
    k = 2 * k if fp4 else k
    mg = a.shape[1] if masked else 0
    m = nb * mg if masked else groups.shape[0]
    asm = fp4_asm(cfg, a.is_cuda, str(a.dtype).removeprefix("torch."))
    cx = constexprs(m, n, k, mg, masked, rows is not None, cfg, fp4, asm)
    out_shape = (nb, mg, n) if masked else (m, n)
    c = torch.full(out_shape, float("nan"), dtype=a.dtype, device=a.device)
    g = groups.to(torch.int32)
    r = rows.to(torch.int32) if rows is not None else g
    s = [x.contiguous() for x in scales] if fp4 else [g, g]  # unread without FP4
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if b3 is None:
        grouped_gemm_kernel[grid(m, n, cfg)](a.contiguous(), r, b.contiguous(), s[0], g, c, **cx, **opts)
    else:
        grouped_swiglu_kernel[grid(m, n, cfg)](
            a.contiguous(), r, b.contiguous(), b3.contiguous(), *s, g, c, **cx, LIMIT=float(limit), **opts
        )
    return c
