"""Token choice from logits: greedy, or temperature / top-k / top-p sampling with one key per row."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from djax.config import SamplingParams
from djax.kernels import partition as kpartition


def row_keys(seeds: jax.Array, step: jax.Array) -> jax.Array:
    """One PRNG key per row from its own seed and the step: a row's samples do not depend on its batch."""
    return jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), step))(seeds)


def filter_logits(logits: jax.Array, sampling: SamplingParams, impl: str = "auto") -> jax.Array:
    """Scale by temperature and set everything outside top-k / the top-p nucleus to -inf. f32[b, v].

    Top-p applies after top-k, to the renormalised survivors; the most likely token always survives.
    Temperature 0 (greedy) leaves the scale alone. impl: `djax.kernels.topk.topk`'s, for the k-th largest
    logit of each row (on CUDA the radix-select kernels, exact like the `lax.top_k` of "ref").
    """
    x = logits.astype(jnp.float32)
    if sampling.temperature > 0:
        x = x / sampling.temperature
    if sampling.top_k and sampling.top_k < x.shape[-1]:
        kth = kpartition.topk(impl)(x, sampling.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if sampling.top_p < 1.0:
        order = jnp.argsort(-x, axis=-1)
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
        probs = jax.nn.softmax(sorted_x, axis=-1)
        # keep a token while the mass before it is below top_p (the first token is always kept)
        before = jnp.cumsum(probs, axis=-1) - probs
        keep_sorted = before < sampling.top_p
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(x.shape[0])[:, None], order].set(keep_sorted)
        x = jnp.where(keep, x, -jnp.inf)
    return x


def sample(
    logits: jax.Array, seeds: jax.Array, step: jax.Array, sampling: SamplingParams, impl: str = "auto"
) -> jax.Array:
    """Next token int32[b] from logits f32[b, v]; seeds uint32[b] (ignored when greedy); impl: see
    `filter_logits`."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    x = filter_logits(logits, sampling, impl)
    keys = row_keys(seeds, step)
    return jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)
