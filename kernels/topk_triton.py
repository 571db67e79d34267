"""Triton radix select: the k-th largest key by four 8-bit histogram passes, one collecting pass in index
order (so ties go to the lower index), then a sort of the k picks.

Two forms: `topk_kernel` does all of it in one program per row, or per chunk of a row (the first stage of a
chunked top-k, see kernels/topk.py); the grid form spreads one row's select over many programs, one kernel
per step (`grid_hist_kernel`, `grid_digit_kernel` four times, then `grid_collect_kernel`,
`sort_picks_kernel`), for few rows with a large k, where chunking leaves too many candidates to merge."""

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
        tl.store(scratch_ptr + pid * KP + slot, _pack(key, j), mask=take)
        taken += tl.sum(t, 0)
        ties += tl.sum(eq, 0)
    tl.debug_barrier()
    packed = tl.load(scratch_ptr + pid * KP + slots)
    _store_sorted(packed, val_ptr + pid * K, idx_ptr + pid * K, col0.to(tl.int32), slots, K)


@triton.jit
def _pack(key, col):
    """Key in the high word, the column's complement in the low one: a descending sort of the packed words
    orders by value, then by lower column."""
    return (key.to(tl.uint64) << 32) | (col.to(tl.uint32) ^ 0xFFFFFFFF).to(tl.uint64)


@triton.jit
def _store_sorted(packed, val_ptr, idx_ptr, col0, slots, K: tl.constexpr):
    """Sorts packed picks (`_pack`) descending and stores the first K as values and columns + col0."""
    packed = tl.sort(packed, descending=True)
    val = _floats((packed >> 32).to(tl.uint32))
    idx = ((packed & 0xFFFFFFFF).to(tl.uint32) ^ 0xFFFFFFFF).to(tl.int32)
    # Positions past the valid entries read as -inf, so an -inf value is the only invalid pick.
    idx = tl.where(val == float("-inf"), -1, idx + col0)
    tl.store(val_ptr + slots, val, mask=slots < K)
    tl.store(idx_ptr + slots, idx, mask=slots < K)


# The digit step holds all of a row's chunk histograms in registers at once (one load, not a loop of
# dependent ones), 256 x 128 int32 over 16 warps: 64 registers a thread.
MAX_GRID_CHUNKS = 128
DIGIT_WARPS = 16

# The grid form. A row of S columns is cut into NC chunks of CHUNK; each step is one kernel over the whole
# grid, so every program of a step sees the previous step's results. A pass's histogram step writes each
# chunk's histogram of the pass's digit among keys matching the bits fixed so far; its digit step (one
# program per row) sums them and fixes the digit. The state of a row, int32[W] with W = 2 + 2 * NC: the bits
# of the k-th key fixed so far (bit-cast), the picks still to place among keys matching them, then (after
# the fourth pass) per chunk its count of keys larger than the k-th and its count equal to it.


@triton.jit
def _row_chunk(len_ptr, pid, S: tl.constexpr, CHUNK: tl.constexpr, NC: tl.constexpr, HAS_LEN: tl.constexpr):
    """(row, first column, columns of the chunk that exist, columns of it below the row's length)."""
    row = pid // NC
    col0 = (pid % NC) * CHUNK
    n_valid = S
    if HAS_LEN:
        n_valid = tl.minimum(tl.load(len_ptr + row), S)
    return row, col0, tl.minimum(S - col0, CHUNK), tl.minimum(n_valid - col0, CHUNK)


@triton.jit
def grid_hist_kernel(
    x_ptr,  # f32[b, S]
    len_ptr,  # int32[b] (read only when HAS_LEN)
    state_ptr,  # int32[b, W]: the previous digit step's state (read only when PASS > 0)
    hist_ptr,  # int32[b * NC, 256]: this chunk's histogram of the pass's digit among matching keys
    above_ptr,  # int32[b * NC]: this chunk's keys whose fixed bits exceed the fixed prefix
    S: tl.constexpr,
    CHUNK: tl.constexpr,
    NC: tl.constexpr,
    PASS: tl.constexpr,
    HAS_LEN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row, col0, n_here, n_valid = _row_chunk(len_ptr, pid, S, CHUNK, NC, HAS_LEN)
    shift: tl.constexpr = 24 - 8 * PASS
    prefix = tl.zeros([], tl.uint32)
    known = tl.zeros([], tl.uint32)
    if PASS > 0:
        prefix = tl.load(state_ptr + row * (2 + 2 * NC)).to(tl.uint32, bitcast=True)
        known = tl.full([], 0xFFFFFFFF, tl.uint32) << (32 - 8 * PASS)
    hist = tl.zeros([256], tl.int32)
    above = tl.zeros([], tl.int32)
    for start in range(0, CHUNK, BLOCK):
        j = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * S + col0 + j, mask=j < n_valid, other=float("-inf"))
        key = _keys(x.to(tl.float32))
        inside = j < n_here
        hit = inside & ((key & known) == prefix)
        hist += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=hit)
        above += tl.sum((inside & ((key & known) > prefix)).to(tl.int32), 0)
    tl.store(hist_ptr + pid * 256 + tl.arange(0, 256), hist)
    tl.store(above_ptr + pid, above)


@triton.jit
def grid_digit_kernel(
    hist_ptr,  # int32[b * NC, 256]
    above_ptr,  # int32[b * NC] (read by the last pass only)
    prev_ptr,  # int32[b, W]: the state before this pass (read only when PASS > 0)
    state_ptr,  # int32[b, W]: the state after it
    K: tl.constexpr,
    NC: tl.constexpr,
    NCP: tl.constexpr,  # next power of two >= NC
    PASS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    W: tl.constexpr = 2 + 2 * NC
    shift: tl.constexpr = 24 - 8 * PASS
    digits = tl.arange(0, 256)
    prefix = tl.zeros([], tl.uint32)
    need = tl.full([], K, tl.int32)
    if PASS > 0:
        prefix = tl.load(prev_ptr + row * W).to(tl.uint32, bitcast=True)
        need = tl.load(prev_ptr + row * W + 1)
    c = tl.arange(0, NCP)
    h = tl.load(hist_ptr + (row * NC + c)[:, None] * 256 + digits[None, :], mask=(c < NC)[:, None], other=0)
    totals = tl.sum(h, 0)
    at_or_above = tl.cumsum(totals, 0, reverse=True)
    d = tl.max(tl.where(at_or_above >= need, digits, -1), 0)  # >= 0: all matching keys number >= need
    above = tl.sum(tl.where(digits > d, totals, 0), 0)
    if PASS == 3:  # the k-th key is known: each chunk's larger keys and ties, for the collecting step
        larger = tl.load(above_ptr + row * NC + c, mask=c < NC, other=0)
        larger += tl.sum(tl.where(digits[None, :] > d, h, 0), 1)
        tl.store(state_ptr + row * W + 2 + c, larger, mask=c < NC)
        tied = tl.sum(tl.where(digits[None, :] == d, h, 0), 1)
        tl.store(state_ptr + row * W + 2 + NC + c, tied, mask=c < NC)
    prefix = prefix | (d.to(tl.uint32) << shift)
    tl.store(state_ptr + row * W, prefix.to(tl.int32, bitcast=True))
    tl.store(state_ptr + row * W + 1, need - above)


@triton.jit
def grid_collect_kernel(
    x_ptr,  # f32[b, S]
    len_ptr,  # int32[b] (read only when HAS_LEN)
    state_ptr,  # int32[b, W]: the state after the fourth pass (the k-th key is known)
    picks_ptr,  # uint64[b, KP]: the row's K picks packed (`_pack`), unsorted; slots >= K untouched
    S: tl.constexpr,
    CHUNK: tl.constexpr,
    NC: tl.constexpr,
    NCP: tl.constexpr,
    KP: tl.constexpr,
    HAS_LEN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row, col0, n_here, n_valid = _row_chunk(len_ptr, pid, S, CHUNK, NC, HAS_LEN)
    base = state_ptr + row * (2 + 2 * NC)
    kth = tl.load(base).to(tl.uint32, bitcast=True)
    need = tl.load(base + 1)
    c = tl.arange(0, NCP)
    larger = tl.load(base + 2 + c, mask=c < NC, other=0)
    ties = tl.load(base + 2 + NC + c, mask=c < NC, other=0)
    before = c < (pid % NC)
    # Slots: the larger keys first, chunk after chunk, then the first `need` ties in column order.
    larger_slot = tl.sum(tl.where(before, larger, 0), 0)
    tie_rank0 = tl.sum(tl.where(before, ties, 0), 0)
    all_larger = tl.sum(larger, 0)
    for start in range(0, CHUNK, BLOCK):
        j = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * S + col0 + j, mask=j < n_valid, other=float("-inf"))
        key = _keys(x.to(tl.float32))
        inside = j < n_here
        g = (inside & (key > kth)).to(tl.int32)
        e = (inside & (key == kth)).to(tl.int32)
        tie_rank = tie_rank0 + tl.cumsum(e, 0) - e
        take = (g != 0) | ((e != 0) & (tie_rank < need))
        slot = tl.where(g != 0, larger_slot + tl.cumsum(g, 0) - g, all_larger + tie_rank)
        tl.store(picks_ptr + row * KP + slot, _pack(key, col0 + j), mask=take)
        larger_slot += tl.sum(g, 0)
        tie_rank0 += tl.sum(e, 0)


@triton.jit
def sort_picks_kernel(
    picks_ptr,  # uint64[b, KP]
    val_ptr,  # f32[b, K]
    idx_ptr,  # int32[b, K]
    K: tl.constexpr,
    KP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, KP)
    packed = tl.load(picks_ptr + row * KP + slots, mask=slots < K, other=0)  # 0 sorts below every key
    _store_sorted(packed, val_ptr + row * K, idx_ptr + row * K, 0, slots, K)


def grid_select(run, x, lens, k: int, chunk: int, has_len: bool, block: int = 1024):
    """The grid form's launches in order. run(kernel, grid, args, outs, constexprs, num_warps) launches
    `kernel` over `grid` on the operands `args` and fresh results `outs` ((shape, dtype name) pairs) and
    returns the results (num_warps None: the caller's choice); x f32[b, s] with k <= s, lens int32[b].
    Returns values f32[b, k] and indices int32[b, k]."""
    b, s = x.shape
    nc = -(-s // chunk)
    if nc > MAX_GRID_CHUNKS:
        raise ValueError(f"chunk {chunk} cuts a row of {s} into {nc} chunks; at most {MAX_GRID_CHUNKS} fit")
    width = 2 + 2 * nc
    ncp = triton.next_power_of_2(nc)
    kp = triton.next_power_of_2(k)
    cols = dict(S=s, CHUNK=chunk, NC=nc, HAS_LEN=has_len, BLOCK=min(block, triton.next_power_of_2(chunk)))
    state = lens  # not read by the first pass
    for p in range(4):
        hist, above = run(
            grid_hist_kernel,
            (b * nc,),
            [x, lens, state],
            [((b * nc, 256), "int32"), ((b * nc,), "int32")],
            {**cols, "PASS": p},
            None,
        )
        cx = dict(K=k, NC=nc, NCP=ncp, PASS=p)
        (state,) = run(
            grid_digit_kernel, (b,), [hist, above, state], [((b, width), "int32")], cx, DIGIT_WARPS
        )
    cx = {**cols, "NCP": ncp, "KP": kp}
    (picks,) = run(grid_collect_kernel, (b * nc,), [x, lens, state], [((b, kp), "uint64")], cx, None)
    outs = [((b, k), "float32"), ((b, k), "int32")]
    return run(sort_picks_kernel, (b,), [picks], outs, dict(K=k, KP=kp), None)


def launch_grid_torch(scores, k: int, lengths=None, chunk: int = 1024, block: int = 1024):
    """The grid form on torch tensors (GPU, or CPU under TRITON_INTERPRET=1); k <= s."""
    import torch

    def run(kernel, grid, args, outs, cx, num_warps):
        res = [torch.empty(shape, dtype=getattr(torch, dt), device=scores.device) for shape, dt in outs]
        kernel[grid](*args, *res, **cx, **({} if num_warps is None else {"num_warps": num_warps}))
        return res

    lens = lengths.to(torch.int32) if lengths is not None else torch.zeros(scores.shape[0], dtype=torch.int32)
    return grid_select(run, scores.float().contiguous(), lens, k, chunk, lengths is not None, block)


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
