"""Triton radix select: the k-th largest key by four 8-bit histogram passes, one collecting pass in index
order (so ties go to the lower index), then a sort of the k picks.

Two forms: `topk_kernel` does all of it in one program per row, or per chunk of a row (the first stage of a
chunked top-k, see djax/kernels/topk.py); the grid form spreads one row's select over many programs, one kernel
per step (`grid_hist_kernel` four times, `grid_collect_kernel`, `sort_picks_kernel`), for few rows with a
large k, where chunking leaves too many candidates to merge."""

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
def _chunk_keys(x_ptr, n_valid, row, col0, j, S: tl.constexpr, n):
    """Keys of columns col0 + j of a row (-inf from n_valid on) and whether each of j is among the n
    positions taken part."""
    x = tl.load(x_ptr + row * S + col0 + j, mask=j < n_valid, other=float("-inf"))
    return _keys(x.to(tl.float32)), j < n


@triton.jit
def _digit_hist(
    x_ptr,
    n_valid,
    row,
    col0,
    S: tl.constexpr,
    LEN: tl.constexpr,
    n,
    prefix,
    known,
    shift,
    BLOCK: tl.constexpr,
):
    """Counts of the 8-bit digit at `shift` among the chunk's keys whose bits under `known` equal
    `prefix` (the digits fixed by earlier passes): one radix pass over LEN positions, n of them taken part."""
    hist = tl.zeros([256], tl.int32)
    for start in range(0, LEN, BLOCK):
        j = start + tl.arange(0, BLOCK)
        key, inside = _chunk_keys(x_ptr, n_valid, row, col0, j, S, n)
        hit = inside & ((key & known) == prefix)
        hist += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=hit)
    return hist


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
    row, col0, _, n_valid = _row_chunk(len_ptr, pid, S, CHUNK, NC, HAS_LEN)  # n_valid <= 0: none valid
    N: tl.constexpr = CHUNK if CHUNK > K else K  # positions past the chunk read as -inf: K picks always exist
    digits = tl.arange(0, 256)
    prefix = tl.zeros([], tl.uint32)
    known = tl.zeros([], tl.uint32)  # bits of the k-th key fixed so far
    need = tl.full([], K, tl.int32)  # picks still to place among keys matching the prefix
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = _digit_hist(x_ptr, n_valid, row, col0, S, N, N, prefix, known, shift, BLOCK)
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


# The collecting step holds every chunk's tie count of its row in registers.
MAX_GRID_CHUNKS = 1024
# Per row: the four passes' digit totals, then the slot counter of the larger keys.
WORK_WIDTH = tl.constexpr(5 * 256)

# The grid form. A row of S columns is cut into NC chunks of CHUNK, one program each; a kernel boundary is
# the only barrier between them. Each of four histogram passes adds its chunk's counts of the pass's 8-bit
# digit, among keys matching the digits fixed so far, into the row's totals (atomics into a zeroed work
# buffer). Every program of a later step derives the fixed digits itself from those totals (a cumulative
# sum of 256 counts per pass: cheaper than a kernel of its own), so the k-th key is known to the collecting
# step, which writes the larger keys at slots taken from a counter and the first ties in column order
# (the last pass's per-chunk counts give each chunk's first tie rank). Then one program per row sorts.


@triton.jit
def _fixed_digits(work_ptr, row, K: tl.constexpr, PASSES: tl.constexpr):
    """The k-th key's top 8 * PASSES bits (prefix, and the mask of them) and the picks still to place among
    keys matching them, from the totals of the first PASSES passes."""
    digits = tl.arange(0, 256)
    prefix = tl.zeros([], tl.uint32)
    need = tl.full([], K, tl.int32)
    for p in tl.static_range(PASSES):
        totals = tl.load(work_ptr + row * WORK_WIDTH + p * 256 + digits)
        at_or_above = tl.cumsum(totals, 0, reverse=True)
        d = tl.max(tl.where(at_or_above >= need, digits, -1), 0)  # >= 0: matching keys number >= need
        need -= tl.sum(tl.where(digits > d, totals, 0), 0)
        prefix = prefix | (d.to(tl.uint32) << (24 - 8 * p))
    known = tl.zeros([], tl.uint32)
    if PASSES > 0:
        known = tl.full([], 0xFFFFFFFF, tl.uint32) << (32 - 8 * PASSES)
    return prefix, known, need


@triton.jit
def grid_hist_kernel(
    x_ptr,  # f32[b, S]
    len_ptr,  # int32[b] (read only when HAS_LEN)
    work_ptr,  # int32[b, WORK_WIDTH], zeroed before the first pass; this pass adds its totals
    work_out_ptr,  # the same buffer (an aliased result)
    tail_ptr,  # int32[b * NC, 256] after the last pass: each chunk's own counts of its last digit
    S: tl.constexpr,
    K: tl.constexpr,
    CHUNK: tl.constexpr,
    NC: tl.constexpr,
    PASS: tl.constexpr,
    HAS_LEN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row, col0, n_here, n_valid = _row_chunk(len_ptr, pid, S, CHUNK, NC, HAS_LEN)
    prefix, known, _ = _fixed_digits(work_ptr, row, K, PASS)
    shift: tl.constexpr = 24 - 8 * PASS
    hist = _digit_hist(x_ptr, n_valid, row, col0, S, CHUNK, n_here, prefix, known, shift, BLOCK)
    digits = tl.arange(0, 256)
    # Updates go through the result pointer (the same buffer as work_ptr, aliased), so that a launch that
    # lost the alias would change its fresh result, not its operand.
    tl.atomic_add(work_out_ptr + row * WORK_WIDTH + PASS * 256 + digits, hist, mask=hist != 0, sem="relaxed")
    if PASS == 3:
        tl.store(tail_ptr + pid * 256 + digits, hist)


@triton.jit
def grid_collect_kernel(
    x_ptr,  # f32[b, S]
    len_ptr,  # int32[b] (read only when HAS_LEN)
    work_ptr,  # int32[b, WORK_WIDTH] after the four passes (its slot counter still zero)
    tail_ptr,  # int32[b * NC, 256]
    work_out_ptr,  # the same buffer as work_ptr (an aliased result): the counter is taken
    picks_ptr,  # uint64[b, KP]: the row's K picks packed (`_pack`), unsorted; slots >= K untouched
    S: tl.constexpr,
    K: tl.constexpr,
    CHUNK: tl.constexpr,
    NC: tl.constexpr,
    NCP: tl.constexpr,  # next power of two >= NC
    KP: tl.constexpr,
    HAS_LEN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row, col0, n_here, n_valid = _row_chunk(len_ptr, pid, S, CHUNK, NC, HAS_LEN)
    kth, _, need = _fixed_digits(work_ptr, row, K, 4)
    # Larger keys take slots [0, K - need) in any order (the sort orders them); the first `need` ties in
    # column order take [K - need, K): this chunk's first tie rank counts the ties of the chunks before it.
    c = tl.arange(0, NCP)
    ties_before = tl.load(
        tail_ptr + (row * NC + c) * 256 + (kth & 0xFF).to(tl.int32), mask=c < (pid % NC), other=0
    )
    tie_rank0 = tl.sum(ties_before, 0)
    for start in range(0, CHUNK, BLOCK):
        j = start + tl.arange(0, BLOCK)
        key, inside = _chunk_keys(x_ptr, n_valid, row, col0, j, S, n_here)
        g = (inside & (key > kth)).to(tl.int32)
        e = (inside & (key == kth)).to(tl.int32)
        n_larger = tl.sum(g, 0)
        first = tl.atomic_add(work_out_ptr + row * WORK_WIDTH + 1024, n_larger, sem="relaxed")
        tie_rank = tie_rank0 + tl.cumsum(e, 0) - e
        take = (g != 0) | ((e != 0) & (tie_rank < need))
        slot = tl.where(g != 0, first + tl.cumsum(g, 0) - g, K - need + tie_rank)
        tl.store(picks_ptr + row * KP + slot, _pack(key, col0 + j), mask=take)
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


def grid_select(run, x, lens, work, k: int, chunk: int, has_len: bool, block: int = 1024):
    """The grid form's launches in order. run(kernel, grid, args, outs, constexprs) launches `kernel` over
    `grid` on the operands `args` and results `outs`, each a (shape, dtype name) pair for a fresh result or
    the position in `args` of an operand the kernel updates in place, and returns the results; x f32[b, s]
    with k <= s, lens int32[b], work int32[b, WORK_WIDTH] of zeros. Returns values f32[b, k] and indices
    int32[b, k]."""
    b, s = x.shape
    if k > s:  # fewer keys than picks: no k-th key to find (`grid_topk` pads the row first)
        raise ValueError(f"the grid form needs k <= the row length, got k {k} for rows of {s}")
    nc = -(-s // chunk)
    if nc > MAX_GRID_CHUNKS:
        raise ValueError(f"chunk {chunk} cuts a row of {s} into {nc} chunks; at most {MAX_GRID_CHUNKS} fit")
    kp = triton.next_power_of_2(k)
    cols = dict(
        S=s, K=k, CHUNK=chunk, NC=nc, HAS_LEN=has_len, BLOCK=min(block, triton.next_power_of_2(chunk))
    )
    for p in range(4):
        tail_shape = (b * nc, 256) if p == 3 else (1,)
        work, tail = run(
            grid_hist_kernel, (b * nc,), [x, lens, work], [2, (tail_shape, "int32")], {**cols, "PASS": p}
        )
    cx = {**cols, "NCP": triton.next_power_of_2(nc), "KP": kp}
    _, picks = run(grid_collect_kernel, (b * nc,), [x, lens, work, tail], [2, ((b, kp), "uint64")], cx)
    outs = [((b, k), "float32"), ((b, k), "int32")]
    return run(sort_picks_kernel, (b,), [picks], outs, dict(K=k, KP=kp))


def launch_grid_torch(scores, k: int, lengths=None, chunk: int = 1024, block: int = 1024):
    """The grid form on torch tensors (GPU, or CPU under TRITON_INTERPRET=1); k <= s."""
    import torch

    def run(kernel, grid, args, outs, cx):
        new = lambda o: torch.empty(o[0], dtype=getattr(torch, o[1]), device=scores.device)  # noqa: E731
        res = [args[o] if isinstance(o, int) else new(o) for o in outs]
        kernel[grid](*args, *res, **cx)
        return res

    b = scores.shape[0]
    dev = scores.device
    lens = (
        lengths.to(dev, torch.int32) if lengths is not None else torch.zeros(b, dtype=torch.int32, device=dev)
    )
    work = torch.zeros((b, WORK_WIDTH), dtype=torch.int32, device=scores.device)
    return grid_select(run, scores.float().contiguous(), lens, work, k, chunk, lengths is not None, block)


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
