"""Top-k selection in jnp (indexer picks and vocab top-k): values sorted descending, ties to the lower index."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def topk_ref(scores, k: int, lengths=None):
    """The k largest of each row. scores f32[b, s]; lengths int32[b] or None (entries >= length invalid).

    Returns values f32[b, k] (descending) and indices int32[b, k]; an index is -1 where its value is
    -inf (an invalid entry, or fewer than k valid ones; k may exceed s).
    """
    b, s = scores.shape
    x = scores.astype(jnp.float32)
    if lengths is not None:
        x = jnp.where(jnp.arange(s)[None, :] < lengths[:, None], x, -jnp.inf)
    if k > s:
        x = jnp.concatenate([x, jnp.full((b, k - s), -jnp.inf, x.dtype)], axis=1)
    vals, idx = jax.lax.top_k(x, k)
    return vals, jnp.where(vals == -jnp.inf, -1, idx).astype(jnp.int32)
