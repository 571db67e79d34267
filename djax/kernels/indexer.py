"""Public lightning-indexer ops: `index_scores` and fused-in-one-jit `indexer_topk`, impl "auto"|"ref"|"triton"."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from djax.kernels import shapes
from djax.kernels.dispatch import resolve
from djax.kernels.indexer_ref import index_scores_ref
from djax.kernels.topk import topk


def index_scores(q, keys, weights, lengths, impl: str = "auto", block_s: int = 64, num_warps: int = 4):
    """scores[b, s] = sum_h weights[b, h] relu(q[b, h] . keys[b, s]); -inf at s >= lengths[b].

    q [b, H, c]; keys [b, s, c] (same dtype); weights f32[b, H]; lengths int32[b]. Returns f32[b, s].
    The Triton kernel needs H and c powers of two, H >= 16.
    """
    shapes.index_scores(q, keys, weights, lengths)
    impl = resolve(impl, ("ref", "triton"))
    if impl == "ref":
        return index_scores_ref(q, keys, weights, lengths)
    from djax.ffi import cubin
    from djax.kernels.indexer_triton import constexprs, index_scores_kernel

    b, h, c = q.shape
    s = keys.shape[1]
    args = [q, keys.astype(q.dtype), weights.astype(jnp.float32), lengths.astype(jnp.int32)]
    names = ["q_ptr", "keys_ptr", "w_ptr", "len_ptr", "out_ptr"]
    kern = cubin.compile_triton(
        index_scores_kernel,
        names,
        [q.dtype, q.dtype, jnp.float32, jnp.int32, jnp.float32],
        constexprs(h, c, s, block_s),
        num_warps,
        2,
    )
    return cubin.launch(kern, (b, -(-s // block_s)), args, jax.ShapeDtypeStruct((b, s), jnp.float32))


def indexer_topk(q, keys, weights, lengths, k: int, impl: str = "auto"):
    """Scores then top-k: values f32[b, k] (descending) and indices int32[b, k], -1 where invalid."""
    scores = index_scores(q, keys, weights, lengths, impl=impl)
    return topk(scores, k, None, impl=impl)
