"""Public top-k op (indexer picks, vocab top-k for sampling): `topk(scores, k, lengths, impl=...)`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from djax.kernels import shapes
from djax.kernels.dispatch import resolve
from djax.kernels.topk_ref import topk_ref

# impl="auto" takes the kernel from this many rows on, and for one row only when k is at most
# MAX_K_ONE_ROW. H200 (bench_kernels' top-k cases): one row of 262,144 with k 512 took 66-73 us chunked
# against lax.top_k's 55; one row of 129,280 with k 50 took 30 us (1,024-column chunks) against 52; 4 rows
# of 262,144 82 against 243 us, and 64 rows won at every length measured (2,048 and 129,280). 2 and 3
# rows, and one row with k between 50 and 512, were not measured.
MIN_ROWS_FOR_TRITON = 2
MAX_K_ONE_ROW = 64
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


def topk(
    scores,
    k: int,
    lengths=None,
    impl: str = "auto",
    block: int = 1024,
    num_warps: int = 8,
    chunk: int | None = None,
    merge: str = "triton",
):
    """The k largest entries per row. scores f32[b, s]; lengths int32[b] or None.

    Returns values f32[b, k] sorted descending (ties: lower index first) and indices int32[b, k],
    -1 where the value is -inf (an entry past the length, or fewer than k valid ones).

    Triton only: chunk is the columns per program of the first stage (None: `chunk_size`'s choice; s or
    more: one program per row); merge picks the top k of the chunks' candidates with "triton" (chunked
    again where still long) or "ref" (lax.top_k).
    """
    shapes.topk(scores, k, lengths)
    if impl == "auto" and not auto_takes_kernel(scores.shape[0], k):
        impl = "ref"
    impl = resolve(impl, ("ref", "triton"))
    if impl == "ref":
        return topk_ref(scores, k, lengths)
    launch = functools.partial(_launch, block=block, num_warps=num_warps)
    return chunked_topk(launch, scores, k, lengths, chunk, merge)


def auto_takes_kernel(rows: int, k: int) -> bool:
    """Whether impl="auto" runs the kernel (on CUDA) for `rows` rows: see MIN_ROWS_FOR_TRITON."""
    return rows >= MIN_ROWS_FOR_TRITON or k <= MAX_K_ONE_ROW


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
    outs = [
        jax.ShapeDtypeStruct((b, n * k), jnp.float32),
        jax.ShapeDtypeStruct((b, n * k), jnp.int32),
        jax.ShapeDtypeStruct((b * n, cx["KP"]), jnp.uint64),
    ]
    names = ["x_ptr", "len_ptr", "val_ptr", "idx_ptr", "scratch_ptr"]
    kern = cubin.compile_triton(
        topk_kernel, names, [jnp.float32, jnp.int32, jnp.float32, jnp.int32, jnp.uint64], cx, num_warps, 1
    )
    vals, idx, _ = cubin.launch(kern, (b * n,), args, outs)
    return vals, idx
