"""Triton radix select: the k-th largest key by four 8-bit histogram passes, one collecting pass in index
order (so ties go to the lower index), then a sort of the k picks; one program per row."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _keys(x):
    """f32 -> uint32 whose unsigned order is the float order."""
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _floats(key):
    bits = tl.where((key >> 31) != 0, key ^ 0x80000000, key ^ 0xFFFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _row_keys(x_ptr, len_ptr, row, j, S: tl.constexpr, N: tl.constexpr, HAS_LEN: tl.constexpr):
    n_valid = S
    if HAS_LEN:
        n_valid = tl.minimum(tl.load(len_ptr + row), S)
    x = tl.load(x_ptr + row * S + j, mask=j < n_valid, other=float("-inf"))
    return _keys(x.to(tl.float32)), j < N


@triton.jit
def topk_kernel(
    x_ptr,  # f32[b, S]
    len_ptr,  # int32[b] (read only when HAS_LEN)
    val_ptr,  # f32[b, K]
    idx_ptr,  # int32[b, K]
    scratch_ptr,  # uint64[b, KP]: the picks before sorting
    S: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,  # next power of two >= K
    HAS_LEN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    N: tl.constexpr = S if S > K else K  # positions past S read as -inf so that K picks always exist
    digits = tl.arange(0, 256)
    prefix = tl.zeros([], tl.uint32)
    known = tl.zeros([], tl.uint32)  # bits of the k-th key fixed so far
    need = tl.full([], K, tl.int32)  # picks still to place among keys matching the prefix
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([256], tl.int32)
        for start in range(0, N, BLOCK):
            j = start + tl.arange(0, BLOCK)
            key, inside = _row_keys(x_ptr, len_ptr, row, j, S, N, HAS_LEN)
            hit = inside & ((key & known) == prefix)
            hist += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=hit)
        at_or_above = tl.cumsum(hist, 0, reverse=True)
        d = tl.max(tl.where(at_or_above >= need, digits, -1), 0)
        above = tl.sum(tl.where(digits > d, hist, 0), 0)
        need = need - above
        prefix = prefix | (d.to(tl.uint32) << shift)
        known = known | (tl.full([], 0xFF, tl.uint32) << shift)
    # prefix is now the k-th largest key: take every larger key, and the first `need` equal ones.
    slots = tl.arange(0, KP)
    tl.store(scratch_ptr + row * KP + slots, tl.zeros([KP], tl.uint64), mask=slots >= K)
    taken = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    for start in range(0, N, BLOCK):
        j = start + tl.arange(0, BLOCK)
        key, inside = _row_keys(x_ptr, len_ptr, row, j, S, N, HAS_LEN)
        eq = (inside & (key == prefix)).to(tl.int32)
        tie_rank = ties + tl.cumsum(eq, 0) - eq
        take = inside & ((key > prefix) | ((eq != 0) & (tie_rank < need)))
        t = take.to(tl.int32)
        slot = taken + tl.cumsum(t, 0) - t
        packed = (key.to(tl.uint64) << 32) | (j.to(tl.uint32) ^ 0xFFFFFFFF).to(tl.uint64)
        tl.store(scratch_ptr + row * KP + slot, packed, mask=take)
        taken += tl.sum(t, 0)
        ties += tl.sum(eq, 0)
    tl.debug_barrier()
    packed = tl.sort(tl.load(scratch_ptr + row * KP + slots), descending=True)
    val = _floats((packed >> 32).to(tl.uint32))
    idx = ((packed & 0xFFFFFFFF).to(tl.uint32) ^ 0xFFFFFFFF).to(tl.int32)
    idx = tl.where((val == float("-inf")) | (idx >= S), -1, idx)
    tl.store(val_ptr + row * K + slots, val, mask=slots < K)
    tl.store(idx_ptr + row * K + slots, idx, mask=slots < K)


def constexprs(s: int, k: int, has_len: bool, block: int = 1024) -> dict:
    return dict(S=s, K=k, KP=triton.next_power_of_2(k), HAS_LEN=has_len, BLOCK=block)


def launch_torch(scores, k: int, lengths=None, block: int = 1024):
    """Runs the kernel on torch tensors (GPU, or CPU under TRITON_INTERPRET=1). Returns (values, indices)."""
    import torch

    b, s = scores.shape
    cx = constexprs(s, k, lengths is not None, block)
    vals = torch.empty((b, k), dtype=torch.float32, device=scores.device)
    idx = torch.empty((b, k), dtype=torch.int32, device=scores.device)
    scratch = torch.empty((b, cx["KP"]), dtype=torch.uint64, device=scores.device)
    lens = lengths.to(torch.int32) if lengths is not None else idx
    topk_kernel[(b,)](scores.float().contiguous(), lens, vals, idx, scratch, **cx)
    return vals, idx
