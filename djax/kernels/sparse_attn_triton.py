"""Triton kernel for V4 sparse decode attention: one program per (row, head block), online softmax over
the SWA ring then the top-k pool picks, the sink seeding the running max and denominator."""

from __future__ import annotations

import math

import triton
import triton.language as tl


@triton.jit
def _attend_range(
    q,
    b,
    lo,
    m,
    l,
    acc,
    win_ptr,
    valid_ptr,
    pool_ptr,
    topk_ptr,
    ks,
    SPAN: tl.constexpr,
    K: tl.constexpr,
    W: tl.constexpr,
    C: tl.constexpr,
    T: tl.constexpr,
    QK_SCALE: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Online-softmax update of (m, l, acc) over key positions [lo, lo + SPAN) of ring-then-picks order."""
    for off in range(0, SPAN, BLOCK_S):
        j = lo + off + tl.arange(0, BLOCK_S)
        live = (j < lo + SPAN) & (j < W + T)
        in_win = j < W
        in_top = (j >= W) & live
        ok_win = tl.load(valid_ptr + b * W + j, mask=in_win & live, other=0) != 0
        idx = tl.load(topk_ptr + b * T + (j - W), mask=in_top, other=-1)
        ok_top = in_top & (idx >= 0) & (idx < C)
        ok = ok_win | ok_top
        row_win = win_ptr + (b * W + j) * K
        row_top = pool_ptr + (b * C + tl.where(ok_top, idx, 0).to(tl.int64)) * K
        rows = tl.where(in_win, row_win, row_top)
        kv = tl.load(rows[:, None] + ks[None, :], mask=ok[:, None], other=0.0)  # [BLOCK_S, K]
        s = tl.dot(q, tl.trans(kv)) * QK_SCALE  # [BLOCK_H, BLOCK_S]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp2(m - m_new))
        p = tl.exp2(s - tl.where(m_new == float("-inf"), 0.0, m_new)[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
        m = m_new
    return m, l, acc


@triton.jit
def sparse_decode_kernel(
    q_ptr,  # [b, h, K]
    win_ptr,  # [b, W, K]
    valid_ptr,  # int32[b, W]
    pool_ptr,  # [b, C, K]
    topk_ptr,  # int32[b, T]
    sink_ptr,  # f32[h]
    out_ptr,  # [b, h, K]
    H: tl.constexpr,
    K: tl.constexpr,
    W: tl.constexpr,
    C: tl.constexpr,
    T: tl.constexpr,
    QK_SCALE: tl.constexpr,  # scale * log2(e): the softmax runs in base 2
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ks = tl.arange(0, K)
    q = tl.load(q_ptr + (b * H + hs[:, None]) * K + ks[None, :])  # [BLOCK_H, K]
    m = tl.load(sink_ptr + hs).to(tl.float32) * 1.4426950408889634  # the sink, in base 2
    l = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, K], tl.float32)
    m, l, acc = _attend_range(
        q, b, 0, m, l, acc, win_ptr, valid_ptr, pool_ptr, topk_ptr, ks, W + T, K, W, C, T, QK_SCALE, BLOCK_S
    )
    out = acc / l[:, None]
    tl.store(out_ptr + (b * H + hs[:, None]) * K + ks[None, :], out.to(out_ptr.dtype.element_ty))


@triton.jit
def sparse_decode_split_kernel(
    q_ptr,  # [b, h, K]
    win_ptr,  # [b, W, K]
    valid_ptr,  # int32[b, W]
    pool_ptr,  # [b, C, K]
    topk_ptr,  # int32[b, T]
    sink_ptr,  # f32[h]
    part_ptr,  # f32[b, NSPLIT, h, K]: each split's normalised output
    lse_ptr,  # f32[b, NSPLIT, h]: each split's log2-sum-exp2 (-inf when it saw nothing)
    H: tl.constexpr,
    K: tl.constexpr,
    W: tl.constexpr,
    C: tl.constexpr,
    T: tl.constexpr,
    QK_SCALE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    NSPLIT: tl.constexpr,
    SPLIT_LEN: tl.constexpr,  # keys per split, a multiple of BLOCK_S
):
    """Flash-decoding split: program (b, head block, split) covers a BLOCK_S-aligned slice of the keys;
    split 0 also carries the sink. `sparse_attn_ref.combine_splits` merges the slices."""
    b = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    sp = tl.program_id(2)
    lo = sp * SPLIT_LEN
    ks = tl.arange(0, K)
    q = tl.load(q_ptr + (b * H + hs[:, None]) * K + ks[None, :])
    sink = tl.load(sink_ptr + hs).to(tl.float32) * 1.4426950408889634
    m = tl.where(sp == 0, sink, float("-inf"))
    l = tl.where(sp == 0, 1.0, 0.0) + tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, K], tl.float32)
    m, l, acc = _attend_range(
        q,
        b,
        lo,
        m,
        l,
        acc,
        win_ptr,
        valid_ptr,
        pool_ptr,
        topk_ptr,
        ks,
        SPLIT_LEN,
        K,
        W,
        C,
        T,
        QK_SCALE,
        BLOCK_S,
    )
    seen = l > 0
    out = acc / tl.where(seen, l, 1.0)[:, None]
    lse = tl.where(seen, m + tl.log2(tl.where(seen, l, 1.0)), float("-inf"))
    row = (b * NSPLIT + sp) * H + hs
    tl.store(part_ptr + row[:, None] * K + ks[None, :], out)
    tl.store(lse_ptr + row, lse)


def constexprs(
    h: int, k: int, w: int, c: int, t: int, scale: float, block_h: int, block_s: int, nsplit: int = 1
) -> dict:
    """The compile-time constants for one shape (every shape is static under jit)."""
    if block_h < 16 or block_h & (block_h - 1) or block_s < 1 or block_s & (block_s - 1):
        raise ValueError(
            f"BLOCK_H {block_h} must be a power of two of at least 16 (the dot's smallest M) and BLOCK_S "
            f"{block_s} a power of two"
        )
    if h % block_h:
        raise ValueError(f"heads {h} must be a multiple of BLOCK_H {block_h}")
    cx = dict(H=h, K=k, W=w, C=c, T=t, QK_SCALE=scale * math.log2(math.e), BLOCK_H=block_h, BLOCK_S=block_s)
    if nsplit == 1:
        return cx
    per_split = math.ceil(math.ceil((w + t) / nsplit) / block_s) * block_s
    return {**cx, "NSPLIT": nsplit, "SPLIT_LEN": per_split}


def launch_torch(
    q, window, valid, pool, topk, sinks, scale: float, block_h: int = 16, block_s: int = 16, nsplit: int = 1
):
    """Runs the kernel on torch tensors (GPU, or CPU under TRITON_INTERPRET=1). Returns out like q."""
    import torch

    b, h, k = q.shape
    cx = constexprs(h, k, window.shape[1], pool.shape[1], topk.shape[1], scale, block_h, block_s, nsplit)
    args = (q, window, valid.to(torch.int32), pool, topk.to(torch.int32), sinks.float())
    if nsplit == 1:
        out = torch.empty_like(q)
        sparse_decode_kernel[(b, h // block_h)](*args, out, **cx)
        return out
    part = torch.full((b, nsplit, h, k), float("nan"), dtype=torch.float32, device=q.device)
    lse = torch.full((b, nsplit, h), float("nan"), dtype=torch.float32, device=q.device)
    sparse_decode_split_kernel[(b, h // block_h, nsplit)](*args, part, lse, **cx)
    from djax.kernels.sparse_attn_ref import combine_splits

    return combine_splits(part, lse, torch).to(q.dtype)
