"""Triton lightning-indexer scoring: per block of keys, relu(keys . q^T) weighted over heads, -inf past length."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def index_scores_kernel(
    q_ptr,  # [b, H, D]
    keys_ptr,  # [b, S, D]
    w_ptr,  # f32[b, H]
    len_ptr,  # int32[b]
    out_ptr,  # f32[b, S]
    H: tl.constexpr,
    D: tl.constexpr,
    S: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    js = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    hs = tl.arange(0, H)
    ds = tl.arange(0, D)
    n = tl.load(len_ptr + b)
    live = js < n
    out = tl.full([BLOCK_S], float("-inf"), tl.float32)
    if tl.program_id(1) * BLOCK_S < n:  # blocks wholly past the length read no keys
        q = tl.load(q_ptr + (b * H + hs[:, None]) * D + ds[None, :])  # [H, D]
        k = tl.load(keys_ptr + (b * S + js[:, None]) * D + ds[None, :], mask=live[:, None], other=0.0)
        dots = tl.maximum(tl.dot(k, tl.trans(q)), 0.0)  # f32[BLOCK_S, H]
        w = tl.load(w_ptr + b * H + hs).to(tl.float32)
        out = tl.where(live, tl.sum(dots * w[None, :], axis=1), float("-inf"))
    tl.store(out_ptr + b * S + js, out, mask=js < S)


def constexprs(h: int, d: int, s: int, block_s: int = 64) -> dict:
    return dict(H=h, D=d, S=s, BLOCK_S=block_s)


def launch_torch(q, keys, weights, lengths, block_s: int = 64):
    """Runs the kernel on torch tensors (GPU, or CPU under TRITON_INTERPRET=1). Returns f32[b, s]."""
    import torch

    b, h, d = q.shape
    s = keys.shape[1]
    out = torch.empty((b, s), dtype=torch.float32, device=q.device)
    grid = (b, triton.cdiv(s, block_s))
    index_scores_kernel[grid](
        q, keys, weights.float(), lengths.to(torch.int32), out, **constexprs(h, d, s, block_s)
    )
    return out
