"""Lightning-indexer scoring in jnp: scores[b, s] = sum_h w[b, h] relu(q[b, h] . keys[b, s]), then top-k."""

from __future__ import annotations

import jax.numpy as jnp

from djax.kernels.topk_ref import topk_ref

F32 = jnp.float32


def index_scores_ref(q, keys, weights, lengths):
    """q [b, H, c]; keys [b, s, c]; weights f32[b, H] (scales folded in); lengths int32[b].

    Returns f32[b, s]; entries at s >= length are -inf. The relu commutes with a positive scale, so
    the model's `index_head_dim**-0.5 * index_n_heads**-0.5` belongs in `weights`.
    """
    dots = jnp.einsum("bhc,bsc->bhs", q.astype(F32), keys.astype(F32), precision="highest")
    scores = jnp.einsum("bhs,bh->bs", jnp.maximum(dots, 0.0), weights.astype(F32), precision="highest")
    valid = jnp.arange(keys.shape[1])[None, :] < lengths[:, None]
    return jnp.where(valid, scores, -jnp.inf)


def indexer_topk_ref(q, keys, weights, lengths, k: int):
    """Scores then top-k: values f32[b, k], indices int32[b, k] (-1 where fewer than k are valid)."""
    return topk_ref(index_scores_ref(q, keys, weights, lengths), k)
