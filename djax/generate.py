"""`generate`: prefill, then a `lax.while_loop` of decode steps over the decoder state; one jittable function."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from djax.config import ModelConfig, SamplingParams
from djax.models import model_module
from djax.sampling import sample

PAD = -1  # written after a row has finished


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Batch:
    """Right-padded prompts. tokens int32[b, t]; lengths int32[b] (>= 1); seeds uint32[b] (sampling)."""

    tokens: jax.Array
    lengths: jax.Array
    seeds: jax.Array

    @classmethod
    def from_lists(
        cls,
        prompts: Sequence[Sequence[int]],
        seeds: Sequence[int] | int | None = None,
        pad_to: int | None = None,
        bucket: int = 16,
    ) -> Batch:
        """Build from ragged token-id lists; the width is padded up to a multiple of `bucket` (or `pad_to`)."""
        if not len(prompts):
            raise ValueError("the batch has no prompts")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
        longest = max(len(p) for p in prompts)
        width = pad_to if pad_to is not None else -(-longest // bucket) * bucket
        if width < longest:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest prompt ({longest} tokens)")
        tokens = np.zeros((len(prompts), width), np.int32)
        for i, p in enumerate(prompts):
            arr = np.asarray(p)
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"prompt {i} must be a flat list of integer token ids")
            tokens[i, : len(p)] = arr
        if seeds is None:
            seeds = 0
        seeds = np.broadcast_to(np.asarray(seeds, np.uint32), (len(prompts),)).copy()
        lengths = np.array([len(p) for p in prompts], np.int32)
        return cls(jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(seeds))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Generated:
    """tokens int32[b, max_new_tokens] (PAD after a row finished); num_tokens int32[b], the EOS included."""

    tokens: jax.Array
    num_tokens: jax.Array
    finished_by_eos: jax.Array = field(default=None)

    def to_lists(self) -> list[list[int]]:
        toks, n = np.asarray(self.tokens), np.asarray(self.num_tokens)
        return [toks[i, : n[i]].tolist() for i in range(toks.shape[0])]


def validate(batch: Batch, config: ModelConfig, max_new_tokens: int, max_len: int | None = None) -> None:
    """Raise ValueError naming the first problem of a concrete batch (skipped under tracing)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if isinstance(batch.tokens, jax.core.Tracer) or isinstance(batch.lengths, jax.core.Tracer):
        return
    tokens, lengths = np.asarray(batch.tokens), np.asarray(batch.lengths)
    if tokens.ndim != 2 or lengths.shape != (tokens.shape[0],):
        raise ValueError(f"batch tokens must be [b, t] with lengths [b]; got {tokens.shape} and {lengths.shape}")
    limit = min(config.max_position_embeddings, max_len or config.max_position_embeddings)
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"prompt {i} is empty")
        if n > tokens.shape[1]:
            raise ValueError(f"prompt {i}: length {n} exceeds the batch width {tokens.shape[1]}")
        bad = tokens[i, :n][(tokens[i, :n] < 0) | (tokens[i, :n] >= config.vocab_size)]
        if bad.size:
            raise ValueError(f"prompt {i}: token id {int(bad[0])} is outside the vocabulary [0, {config.vocab_size})")
        if n + max_new_tokens > limit:
            raise ValueError(
                f"prompt {i}: {n} prompt tokens + {max_new_tokens} new tokens exceed the context of {limit} tokens"
            )


@partial(jax.jit, static_argnames=("config", "sampling", "max_new_tokens", "max_len", "moe_impl"))
def _generate(params, batch: Batch, config, sampling, max_new_tokens, max_len, moe_impl):
    model = model_module(config)
    b = batch.tokens.shape[0]
    logits, state = model.prefill(params, batch.tokens, batch.lengths, config, max_len, moe_impl=moe_impl)
    eos = jnp.asarray(config.eos_ids if not sampling.ignore_eos else (), jnp.int32)

    def is_eos(tok):
        return jnp.isin(tok, eos) if eos.size else jnp.zeros_like(tok, bool)

    tok = sample(logits, batch.seeds, jnp.int32(0), sampling)
    out = jnp.full((b, max_new_tokens), PAD, jnp.int32).at[:, 0].set(tok)
    done = is_eos(tok)
    count = jnp.ones((b,), jnp.int32)

    def cond(carry):
        step, _, _, _, done, _ = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        step, tok, state, out, done, count = carry
        logits, state = model.decode_step(params, tok, state, config, moe_impl=moe_impl)
        nxt = sample(logits, batch.seeds, step, sampling)
        nxt = jnp.where(done, PAD, nxt)
        out = out.at[:, step].set(nxt)
        count = count + (~done).astype(jnp.int32)
        done = done | is_eos(nxt)
        return step + 1, nxt, state, out, done, count

    carry = (jnp.int32(1), tok, state, out, done, count)
    _, _, _, out, done, count = jax.lax.while_loop(cond, body, carry)
    return Generated(out, count, done)


def generate(
    params,
    batch: Batch,
    config: ModelConfig,
    sampling: SamplingParams = SamplingParams(),
    max_new_tokens: int = 32,
    *,
    max_len: int | None = None,
    moe_impl: str = "grouped",
) -> Generated:
    """Generate up to max_new_tokens per row; a row stops at EOS (unless sampling.ignore_eos).

    One jitted function: prefill over the right-padded prompts, then a `lax.while_loop` of decode
    steps carrying the decoder state. max_len (default: batch width + max_new_tokens) sizes the
    compressed pools. Works under `jax.jit` (validation then is the caller's business) and shards
    with the params and batch it is given.
    """
    if not isinstance(batch, Batch):
        batch = Batch.from_lists(batch)
    validate(batch, config, max_new_tokens, max_len)
    max_len = max_len or batch.tokens.shape[1] + max_new_tokens
    return _generate(params, batch, config, sampling, max_new_tokens, max_len, moe_impl)
