"""The engine's sampler: every setting a per-row array, so one jitted program serves any mix of requests.

Rows: temperature (0 = greedy), top_k (0 = off), top_p, min_p, repetition / presence / frequency
penalties (over counts of the row's generated tokens and a mask of its prompt tokens), banned ids
(EOS and stop ids while min_tokens is not reached), and a seed. A row's key is
fold_in(key(seed), index of the token in its output), so its samples never depend on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RowSampling:
    """Per-row sampling settings, each [b]; banned int32[b, e] (-1 = none)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    seed: jax.Array
    index: jax.Array
    banned: jax.Array

    @classmethod
    def empty(cls, b: int, e: int = 8) -> dict[str, np.ndarray]:
        """Host arrays of neutral settings to fill row by row (then `cls(**{k: jnp.asarray(v)})`)."""
        return {
            "temperature": np.zeros(b, np.float32),
            "top_k": np.zeros(b, np.int32),
            "top_p": np.ones(b, np.float32),
            "min_p": np.zeros(b, np.float32),
            "repetition_penalty": np.ones(b, np.float32),
            "presence_penalty": np.zeros(b, np.float32),
            "frequency_penalty": np.zeros(b, np.float32),
            "seed": np.zeros(b, np.uint32),
            "index": np.zeros(b, np.int32),
            "banned": np.full((b, e), -1, np.int32),
        }


def penalize(logits: jax.Array, counts: jax.Array, prompt_mask: jax.Array, s: RowSampling) -> jax.Array:
    """Repetition (divide positive / multiply negative logits of seen tokens), then presence and frequency."""
    seen = (counts > 0) | prompt_mask
    rep = s.repetition_penalty[:, None]
    x = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    x = x - s.frequency_penalty[:, None] * counts - s.presence_penalty[:, None] * (counts > 0)
    rows = jnp.arange(x.shape[0])[:, None]
    return x.at[rows, s.banned].set(-jnp.inf, mode="drop")  # banned ids >= v are no-ops


def _filter(x: jax.Array, s: RowSampling) -> jax.Array:
    """Temperature, then top-k, top-p (of the renormalised survivors) and min-p; the best token always survives."""
    v = x.shape[-1]
    x = x / jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    sorted_x = -jnp.sort(-x, axis=-1)  # descending
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, v), v)
    kth = jnp.take_along_axis(sorted_x, (k - 1)[:, None], axis=-1)
    sorted_x = jnp.where(jnp.arange(v)[None] < k[:, None], sorted_x, -jnp.inf)
    probs = jax.nn.softmax(sorted_x, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = (before < s.top_p[:, None]) & (probs >= s.min_p[:, None] * probs[:, :1])
    keep = keep.at[:, 0].set(True)
    # the smallest kept logit is the cut; ties at the cut are all kept
    cut = jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((x >= jnp.maximum(cut, kth)), x, -jnp.inf)


def sample_rows(
    logits: jax.Array,
    counts: jax.Array,
    prompt_mask: jax.Array,
    s: RowSampling,
    num_logprobs: int = 0,
):
    """logits f32[b, v] -> (tokens int32[b], logprob of each token f32[b], top ids int32[b, n], top logprobs f32[b, n]).

    Logprobs are of the model's raw distribution (before penalties and temperature), as vLLM reports them.
    """
    logits = logits.astype(F32)
    banned = jnp.where(s.banned < 0, logits.shape[-1], s.banned)
    s = RowSampling(**{**vars(s), "banned": banned})
    x = penalize(logits, counts, prompt_mask, s)
    greedy = jnp.argmax(x, axis=-1).astype(jnp.int32)
    keys = jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.key(seed), i))(s.seed, s.index)
    drawn = jax.vmap(jax.random.categorical)(keys, _filter(x, s)).astype(jnp.int32)
    tok = jnp.where(s.temperature > 0, drawn, greedy)
    logp = jax.nn.log_softmax(logits, axis=-1)
    tok_logp = jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
    if num_logprobs:
        top_lp, top_ids = jax.lax.top_k(logp, num_logprobs)
    else:
        top_lp = jnp.zeros((logits.shape[0], 0), F32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return tok, tok_logp, top_ids.astype(jnp.int32), top_lp


def update_counts(counts: jax.Array, tokens: jax.Array, sampled: jax.Array) -> jax.Array:
    """counts int32[b, v] + 1 at each row's new token where sampled[b]."""
    rows = jnp.arange(counts.shape[0])
    return counts.at[rows, tokens].add(sampled.astype(counts.dtype))
