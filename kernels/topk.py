"""Public top-k op (indexer picks, vocab top-k for sampling): `topk(scores, k, lengths, impl=...)`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from djax.kernels.dispatch import resolve
from djax.kernels.topk_ref import topk_ref

# One program per row: on the H200 it beat lax.top_k at 64 rows and lost at 1-4 rows (NOTES.md).
MIN_ROWS_FOR_TRITON = 16


def topk(scores, k: int, lengths=None, impl: str = "auto", block: int = 1024, num_warps: int = 8):
    """The k largest entries per row. scores f32[b, s]; lengths int32[b] or None.

    Returns values f32[b, k] sorted descending (ties: lower index first) and indices int32[b, k],
    -1 where the value is -inf (an entry past the length, or fewer than k valid ones).
    """
    if impl == "auto" and scores.shape[0] < MIN_ROWS_FOR_TRITON:
        impl = "ref"
    impl = resolve(impl, ("ref", "triton"))
    if impl == "ref":
        return topk_ref(scores, k, lengths)
    return _triton(scores, k, lengths, block, num_warps)


def _triton(scores, k, lengths, block, num_warps):
    from djax.ffi import cubin
    from djax.kernels.topk_triton import constexprs, topk_kernel

    b, s = scores.shape
    cx = constexprs(s, k, lengths is not None, block)
    lens = lengths.astype(jnp.int32) if lengths is not None else jnp.zeros((b,), jnp.int32)
    args = [scores.astype(jnp.float32), lens]
    outs = [
        jax.ShapeDtypeStruct((b, k), jnp.float32),
        jax.ShapeDtypeStruct((b, k), jnp.int32),
        jax.ShapeDtypeStruct((b, cx["KP"]), jnp.uint64),
    ]
    names = ["x_ptr", "len_ptr", "val_ptr", "idx_ptr", "scratch_ptr"]
    kern = cubin.compile_triton(
        topk_kernel, names, [jnp.float32, jnp.int32, jnp.float32, jnp.int32, jnp.uint64], cx, num_warps, 1
    )
    vals, idx, _ = cubin.launch(kern, (b,), args, outs)
    return vals, idx
