"""Public top-k op (indexer picks, vocab top-k for sampling): `topk(scores, k, lengths, impl=...)`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from djax.kernels import shapes
from djax.kernels.dispatch import resolve
from djax.kernels.topk_ref import topk_ref

# impl="auto" takes a kernel from this many rows on; for one row, where k is at most MAX_K_ONE_ROW or the
# grid form takes it (`takes_grid`). H200 (bench_kernels' top-k cases, `kernels_h200_topk_grid2.json`):
# one row of 262,144 with k 512, grid form 24.2 us at 4 warps (23.7 at 8) against lax.top_k's 55.3 (the
# chunked form 66-69); one row of 129,280 with k 50, grid 19.4 (18.7) against 51.3 (chunked 23.3-28).
MIN_ROWS_FOR_TRITON = 2
MAX_K_ONE_ROW = 64
# Both kernels end in a sort of the next power of two >= k picks in one program: compiling it ahead took
# 3.9 s at k 2,048 on a 2-core machine, 18.7 s at 8,192 and 157 s at 16,384 (and registers spill), so
# "auto" leaves larger k to lax.top_k. Timed on the H200 only up to k 512 (2,048 checked for exactness).
MAX_K_KERNEL = 2048
# Stage 1 programs. H200, b64 x 129,280 k 50: 512 programs (8 chunks a row) 250 us, 128 programs 313 us,
# one per row 521 us; b4 x 262,144: 256 and 128 programs both 82 us, 64 programs 105 us. A program's passes
# over its columns are latency bound, so more programs than SMs still helps.
TARGET_PROGRAMS = 512
# A chunk below this many columns spends more on its fixed work (the final sort of its k picks) than on
# selecting, and leaves more candidates to merge (one row of 129,280, k 50: 1,024 columns 30 us, 2,048
# and 4,096 both 35 us).
MIN_CHUNK = 1024
# Chunks are whole multiples of the kernel's default block, so that no pass ends in a mostly idle block.
CHUNK_ALIGN = 1024
# The grid form (method "grid"): each row cut into chunks of GRID_MIN_CHUNK columns or more, about
# GRID_PROGRAMS programs in all, six launches (see djax/kernels/topk_triton.py). H200, rows of 262,144 with k 512
# (`kernels_h200_topk_grid2.json`; chunked: its best variant; lax.top_k in brackets): 1 row 24.2 us
# against 66.0 (55.3), 2 rows 29.8 against 66.4 (140.1), 4 rows 42.7 against 81.6 (240.4), 8 rows (2,048
# columns a chunk) 74.6 against 104.8 (438.5), all at 4 warps; at 8 warps 4 and 8 rows took 51.5 and 83.9.
# (The JSON's "auto" rows ran the grid form at 8 warps, before GRID_WARPS, or the chunked form at 8 rows.)
# Above 8 rows it was not measured, so "auto" keeps the chunked form there. The first version, with a
# digit kernel of one program per row after each pass (10 launches), took 41.7 us for one row:
# `kernels_h200_topk_grid.json`.
GRID_PROGRAMS = 1024
GRID_MAX_CHUNKS = 1024  # = topk_triton.MAX_GRID_CHUNKS, which this module does not import
GRID_MIN_CHUNK = 1024
GRID_WARPS = 4
MAX_ROWS_GRID = 8


def topk(
    scores,
    k: int,
    lengths=None,
    impl: str = "auto",
    block: int = 1024,
    num_warps: int | None = None,
    chunk: int | None = None,
    merge: str = "triton",
    method: str = "auto",
):
    """The k largest entries per row. scores f32[b, s]; lengths int32[b] or None.

    Returns values f32[b, k] sorted descending (ties: lower index first) and indices int32[b, k],
    -1 where the value is -inf (an entry past the length, or fewer than k valid ones).

    Triton only: method "chunked" runs each chunk's select in one program and merges the chunks'
    candidates; "grid" spreads each row's select over a grid of programs, one kernel per step (see
    djax/kernels/topk_triton.py); "auto" picks by `takes_grid`. chunk is the columns per program (None: the
    method's rule; for "chunked", s or more means one program per row); merge ("chunked" only) picks the
    top k of the chunks' candidates with "triton" (chunked again where still long) or "ref" (lax.top_k).
    num_warps: per program (None: 8 for "chunked", GRID_WARPS for "grid").
    """
    shapes.topk(scores, k, lengths)
    if method not in ("auto", "chunked", "grid"):
        raise ValueError(f"method must be 'auto', 'chunked' or 'grid', got {method!r}")
    if k == 0:  # nothing to select; the kernels need at least one pick
        b = scores.shape[0]
        return jnp.zeros((b, 0), jnp.float32), jnp.zeros((b, 0), jnp.int32)
    if impl == "auto" and not auto_takes_kernel(*scores.shape, k):
        impl = "ref"
    impl = resolve(impl, ("ref", "triton"))
    if impl == "ref":
        return topk_ref(scores, k, lengths)
    if method == "grid" or (method == "auto" and takes_grid(*scores.shape, k)):
        return grid_topk(scores, k, lengths, chunk, block, num_warps or GRID_WARPS)
    launch = functools.partial(_launch, block=block, num_warps=num_warps or 8)
    return chunked_topk(launch, scores, k, lengths, chunk, merge)


def auto_takes_kernel(rows: int, length: int, k: int) -> bool:
    """Whether impl="auto" runs a kernel (on CUDA) for `rows` x `length`: see MIN_ROWS_FOR_TRITON."""
    if k > MAX_K_KERNEL:
        return False
    return rows >= MIN_ROWS_FOR_TRITON or k <= MAX_K_ONE_ROW or takes_grid(rows, length, k)


def takes_grid(rows: int, length: int, k: int) -> bool:
    """Whether method="auto" takes the grid form: at most MAX_ROWS_GRID rows of two chunks or more. Measured
    at lengths 129,280 and 262,144 with k 50 and 512 (its cost hardly depends on k); shorter rows not."""
    return rows <= MAX_ROWS_GRID and length >= 2 * GRID_MIN_CHUNK


def grid_chunk(rows: int, length: int) -> int:
    """Columns per program of the grid form: about GRID_PROGRAMS programs in all, chunks of at least
    GRID_MIN_CHUNK columns (a multiple of it), at most GRID_MAX_CHUNKS chunks a row."""
    per_row = max(1, GRID_PROGRAMS // rows)
    chunk = max(GRID_MIN_CHUNK, -(-length // min(per_row, GRID_MAX_CHUNKS)))
    return -(-chunk // GRID_MIN_CHUNK) * GRID_MIN_CHUNK


def grid_topk(
    scores, k: int, lengths=None, chunk: int | None = None, block: int = 1024, num_warps: int = GRID_WARPS
):
    """`topk` by the grid form of the radix select (djax/kernels/topk_triton.py's `grid_select`) on CUDA."""
    from djax.ffi import cubin
    from djax.kernels.topk_triton import WORK_WIDTH, grid_select

    b, s = scores.shape
    x = scores.astype(jnp.float32)
    if k > s:  # the form needs k <= s; the padding reads as -inf, which is what the columns past s are
        x = jnp.pad(x, ((0, 0), (0, k - s)), constant_values=-jnp.inf)
    chunk = grid_chunk(b, x.shape[1]) if chunk is None else min(chunk, x.shape[1])
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")

    def run(kernel, grid, args, outs, cx):
        kern, types, aliases = compile_step(kernel, args, outs, cx, num_warps)
        return cubin.launch(kern, grid, args, types, aliases)

    lens = lengths.astype(jnp.int32) if lengths is not None else jnp.zeros((b,), jnp.int32)
    work = jnp.zeros((b, int(WORK_WIDTH)), jnp.int32)
    return tuple(grid_select(run, x, lens, work, k, chunk, lengths is not None, block))


def compile_step(kernel, args, outs, cx: dict, num_warps: int):
    """One top-k kernel compiled for sm_90: (cubin, result types, {operand: result} aliases) for operands
    `args` (anything with a shape and dtype) and results `outs`, each a (shape, dtype name) pair or the
    position of an operand updated in place; the kernel's leading parameters are the pointers."""
    from djax.ffi import cubin

    types = [
        jax.ShapeDtypeStruct(args[o].shape, args[o].dtype)
        if isinstance(o, int)
        else jax.ShapeDtypeStruct(o[0], jnp.dtype(o[1]))
        for o in outs
    ]
    aliases = {o: i for i, o in enumerate(outs) if isinstance(o, int)}
    names = kernel.arg_names[: len(args) + len(types)]
    dtypes = [a.dtype for a in args] + [t.dtype for t in types]
    return cubin.compile_triton(kernel, names, dtypes, cx, num_warps, 1), types, aliases


def chunk_size(rows: int, length: int, k: int) -> int:
    """Columns per first-stage program for a top-k of `rows` x `length`; `length` means one stage.

    Few rows leave SMs idle with one program per row, so each row is cut into about
    TARGET_PROGRAMS / rows chunks, none shorter than MIN_CHUNK or 4k: the chunks' candidates (k each)
    are then at most about a quarter of the row, which keeps the merge short. Rows shorter than two such
    chunks, or enough rows to fill the GPU, stay whole.
    """
    smallest = max(MIN_CHUNK, 4 * k)
    per_row = -(-TARGET_PROGRAMS // rows)
    if per_row < 2 or length < 2 * smallest:
        return length
    chunk = max(smallest, -(-length // per_row))
    return min(length, -(-chunk // CHUNK_ALIGN) * CHUNK_ALIGN)


def chunked_topk(launch, scores, k: int, lengths=None, chunk: int | None = None, merge: str = "triton"):
    """`topk` built from `launch(x, k, lengths, chunk)`, the radix-select kernel run on each `chunk` columns
    of x f32[b, s], giving each chunk's top k as f32[b, n * k] values and int32[b, n * k] columns in the row.

    With several chunks the k largest of a row are among its chunks' k largest (a chunk shorter than k
    keeps all of its entries), so a second top-k over those n * k candidates is exact. Ties stay with the
    lower index: candidates are laid out chunk after chunk and, within a chunk, equal values by index.
    """
    if merge not in ("triton", "ref"):
        raise ValueError(f"merge must be 'triton' or 'ref', got {merge!r}")
    b, s = scores.shape
    chunk = chunk_size(b, s, k) if chunk is None else min(chunk, s)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if chunk == s:
        return launch(scores, k, lengths, s)
    vals, cols = launch(scores, k, lengths, chunk)
    if merge == "ref":
        top, pos = topk_ref(vals, k)
    else:
        top, pos = chunked_topk(launch, vals, k, None, None, merge)
    picked = jnp.take_along_axis(cols, jnp.maximum(pos, 0), axis=1)
    return top, jnp.where(pos < 0, -1, picked)


def _launch(scores, k, lengths, chunk, block, num_warps):
    from djax.ffi import cubin
    from djax.kernels.topk_triton import constexprs, num_programs, topk_kernel

    b, s = scores.shape
    cx = constexprs(s, k, lengths is not None, block, chunk)
    n = num_programs(s, chunk)
    lens = lengths.astype(jnp.int32) if lengths is not None else jnp.zeros((b,), jnp.int32)
    args = [scores.astype(jnp.float32), lens]
    outs = [((b, n * k), "float32"), ((b, n * k), "int32"), ((b * n, cx["KP"]), "uint64")]
    kern, types, _ = compile_step(topk_kernel, args, outs, cx, num_warps)
    vals, idx, _ = cubin.launch(kern, (b * n,), args, types)
    return vals, idx
