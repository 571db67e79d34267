"""Triton radix select: the k-th largest key by four 8-bit histogram passes, one collecting pass in index
order (so ties go to the lower index), then a sort of the k picks; one program per row, or per chunk of a
row (the first stage of a chunked top-k, see kernels/topk.py)."""

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
def _chunk_keys(x_ptr, n_valid, row, col0, j, S: tl.constexpr, N: tl.constexpr):
    x = tl.load(x_ptr + row * S + col0 + j, mask=j < n_valid, other=float("-inf"))
    return _keys(x.to(tl.float32)), j < N


@triton.jit
def topk_kernel(
    x_ptr,  # f32[b, S]
    len_ptr,  # int32[b] (read only when HAS_LEN)
    val_ptr,  # f32[b, NC * K]: each chunk's top K, chunk after chunk
    idx_ptr,  # int32[b, NC * K]: their column in the row
    scratch_ptr,  # uint64[b * NC, KP]: the picks before sorting
    S: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,  # next power of two >= K
    CHUNK: tl.constexpr,  # columns per program; S for a plain top-k
    HAS_LEN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    NC: tl.constexpr = (S + CHUNK - 1) // CHUNK
    row = pid // NC
    col0 = (pid % NC) * CHUNK
    n_valid = S
    if HAS_LEN:
        n_valid = tl.minimum(tl.load(len_ptr + row), S)
    n_valid = tl.minimum(n_valid - col0, CHUNK)  # this chunk's valid entries (<= 0: none)
    N: tl.constexpr = CHUNK if CHUNK > K else K  # positions past the chunk read as -inf: K picks always exist
    digits = tl.arange(0, 256)
    prefix = tl.zeros([], tl.uint32)
    known = tl.zeros([], tl.uint32)  # bits of the k-th key fixed so far
    need = tl.full([], K, tl.int32)  # picks still to place among keys matching the prefix
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([256], tl.int32)
        for start in range(0, N, BLOCK):
            j = start + tl.arange(0, BLOCK)
            key, inside = _chunk_keys(x_ptr, n_valid, row, col0, j, S, N)
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
    tl.store(scratch_ptr + pid * KP + slots, tl.zeros([KP], tl.uint64), mask=slots >= K)
    taken = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    for start in range(0, N, BLOCK):
        j = start + tl.arange(0, BLOCK)
        key, inside = _chunk_keys(x_ptr, n_valid, row, col0, j, S, N)
        eq = (inside & (key == prefix)).to(tl.int32)
        tie_rank = ties + tl.cumsum(eq, 0) - eq
        take = inside & ((key > prefix) | ((eq != 0) & (tie_rank < need)))
        t = take.to(tl.int32)
        slot = taken + tl.cumsum(t, 0) - t
        packed = (key.to(tl.uint64) << 32) | (j.to(tl.uint32) ^ 0xFFFFFFFF).to(tl.uint64)
        tl.store(scratch_ptr + pid * KP + slot, packed, mask=take)
        taken += tl.sum(t, 0)
        ties += tl.sum(eq, 0)
    tl.debug_barrier()
    packed = tl.sort(tl.load(scratch_ptr + pid * KP + slots), descending=True)
    val = _floats((packed >> 32).to(tl.uint32))
    idx = ((packed & 0xFFFFFFFF).to(tl.uint32) ^ 0xFFFFFFFF).to(tl.int32)
    # Positions past the chunk's valid entries read as -inf, so an -inf value is the only invalid pick.
    idx = tl.where(val == float("-inf"), -1, idx + col0.to(tl.int32))
    tl.store(val_ptr + pid * K + slots, val, mask=slots < K)
    tl.store(idx_ptr + pid * K + slots, idx, mask=slots < K)


def constexprs(s: int, k: int, has_len: bool, block: int = 1024, chunk: int | None = None) -> dict:
    """chunk: columns per program (default s: one program per row); a chunk's picks number k even when it
    is shorter (padded with -inf). The block shrinks to the chunk so that a short chunk wastes no lanes."""
    chunk = s if chunk is None else chunk
    block = min(block, triton.next_power_of_2(max(chunk, k)))
    return dict(S=s, K=k, KP=triton.next_power_of_2(k), CHUNK=chunk, HAS_LEN=has_len, BLOCK=block)


def num_programs(s: int, chunk: int) -> int:
    """Chunks per row, so programs per row, for `chunk` columns each."""
    return -(-s // chunk)


def launch_torch(scores, k: int, lengths=None, block: int = 1024, chunk: int | None = None):
    """Runs the kernel on torch tensors (GPU, or CPU under TRITON_INTERPRET=1). Returns (values, indices),
    f32 and int32 [b, n * k] for n chunks of `chunk` columns (default one chunk per row)."""
    import torch

    b, s = scores.shape
    cx = constexprs(s, k, lengths is not None, block, chunk)
    n = num_programs(s, cx["CHUNK"])
    vals = torch.empty((b, n * k), dtype=torch.float32, device=scores.device)
    idx = torch.empty((b, n * k), dtype=torch.int32, device=scores.device)
    scratch = torch.empty((b * n, cx["KP"]), dtype=torch.uint64, device=scores.device)
    lens = lengths.to(torch.int32) if lengths is not None else idx
    topk_kernel[(b * n,)](scores.float().contiguous(), lens, vals, idx, scratch, **cx)
    return vals, idx
