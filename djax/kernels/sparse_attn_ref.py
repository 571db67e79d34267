"""Sparse decode attention for DeepSeek-V4 (shared K=V latent, SWA ring + top-k compressed pool, sinks) in jnp."""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def gather_keys(window, window_valid, pool, topk):
    """The keys one decode query sees, in kernel order: the ring, then the top-k pool picks.

    window [b, W, k]; window_valid bool[b, W]; pool [b, C, k]; topk int32[b, T], -1 (any
    negative, or >= C) marks an invalid pick. Returns keys [b, W + T, k] and mask bool[b, W + T].
    """
    c = pool.shape[1]
    ok = (topk >= 0) & (topk < c)
    picked = jnp.take_along_axis(pool, jnp.where(ok, topk, 0)[..., None], axis=1)  # [b, T, k]
    keys = jnp.concatenate([window, picked.astype(window.dtype)], axis=1)
    return keys, jnp.concatenate([window_valid, ok], axis=1)


def sparse_decode_ref(q, window, window_valid, pool, topk, sinks, scale: float):
    """softmax(q.k * scale) over valid ring slots and valid picks, the per-head sink in the denominator.

    q [b, h, k]; window [b, W, k]; window_valid bool[b, W]; pool [b, C, k]; topk int32[b, T];
    sinks f32[h]. K = V (one shared latent). Returns [b, h, k] in q's dtype; a row with nothing
    valid returns zeros (all its mass sits on the sink). Masked slots contribute nothing whatever they
    hold: a ring slot not yet written, or the pool row an invalid pick stands in for, may be NaN.
    """
    keys, mask = gather_keys(window, window_valid, pool, topk)
    kf = jnp.where(mask[..., None], keys.astype(F32), 0.0)  # else 0 * NaN would reach P @ K
    logits = jnp.einsum("bhk,bsk->bhs", q.astype(F32), kf, precision="highest") * scale
    logits = jnp.where(mask[:, None, :], logits, -jnp.inf)
    sink = sinks.astype(F32)[None, :]  # [1, h]
    m = jnp.maximum(jnp.max(logits, axis=-1), sink)  # [b, h], finite thanks to the sink
    p = jnp.exp(logits - m[..., None])
    denom = p.sum(-1) + jnp.exp(sink - m)
    out = jnp.einsum("bhs,bsk->bhk", p, kf, precision="highest") / denom[..., None]
    return out.astype(q.dtype)


sparse_decode_ref_jit = jax.jit(sparse_decode_ref, static_argnames="scale")


def combine_splits(part, lse, xp=jnp):
    """Merges the split (flash-decoding) outputs of the kernels: part f32[b, n, h, k], each split normalised
    by its own denominator; lse f32[b, n, h], its base-2 log-sum-exp (-inf for a split with no mass; split 0
    holds the sink, so the max is finite) -> f32[b, h, k]. xp: jnp, or torch for the kernels' torch runs."""
    top = xp.amax(lse, axis=1, keepdims=True)
    w = xp.exp2(lse - top)
    return (w[..., None] * part).sum(axis=1) / w.sum(axis=1)[..., None]
