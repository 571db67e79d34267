"""Sharded evaluation: per-sequence log-likelihood and perplexity of a list of token sequences.

`evaluate(params, config, dataset, mesh=...)` right-pads the sequences to one length and the batches
to `batch_size` rows (masked: padding rows and positions count nothing), runs the teacher-forced
forward and sums log p(token_i | tokens_<i) for i = 1..n-1 of every sequence. Under a mesh the batch
is sharded on "dp" and the weights placed by `shard_params` (experts on "ep"). The model is causal,
so right padding changes no real position's logits.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

from djax.config import ModelConfig
from djax.models import model_module
from djax.sharding import DEFAULT_RULES, ShardingRules, shard_params


@partial(jax.jit, static_argnames=("config",))
def sequence_loglik(params, tokens: jax.Array, lengths: jax.Array, config: ModelConfig) -> jax.Array:
    """Sum over i in 1..length-1 of log p(tokens[:, i] | tokens[:, :i]): f32[b] for right-padded tokens int[b, t]."""
    logits = model_module(config).forward(params, tokens, config).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    target = tokens[:, 1:]
    picked = jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
    pos = jnp.arange(1, tokens.shape[1])[None, :]
    mask = pos < lengths[:, None]
    return jnp.sum(jnp.where(mask, picked, 0.0), axis=1)


def evaluate(
    params,
    config: ModelConfig,
    dataset: Sequence[Sequence[int]],
    mesh: Mesh | None = None,
    batch_size: int = 8,
    seq_len: int | None = None,
    rules: ShardingRules = DEFAULT_RULES,
    progress: bool = True,
) -> dict:
    """Log-likelihood of every sequence in `dataset` (lists of token ids) and the overall perplexity.

    seq_len: the padded length of every batch (default: the longest sequence); a longer sequence is
    an error. Under `mesh`, batch_size must divide by the mesh's "dp" size.

    Returns {"loglik": [float per sequence], "tokens": [int per sequence: predicted tokens, n - 1],
    "total_loglik", "total_tokens", "perplexity": exp(-total_loglik / total_tokens)} (perplexity is
    nan when no sequence has 2 tokens).
    """
    seqs = [list(map(int, s)) for s in dataset]
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    longest = max((len(s) for s in seqs), default=1)
    seq_len = max(longest, 1) if seq_len is None else seq_len
    if longest > seq_len:
        raise ValueError(f"a sequence of {longest} tokens is longer than seq_len={seq_len}")
    for s in seqs:
        if s and (min(s) < 0 or max(s) >= config.vocab_size):
            raise ValueError(f"token ids must lie in [0, {config.vocab_size})")

    tok_sharding = len_sharding = None
    if mesh is not None:
        dp = dict(mesh.shape).get("dp", 1)
        if batch_size % dp:
            raise ValueError(f"batch_size={batch_size} is not divisible by the mesh's dp={dp}")
        params = shard_params(params, config, mesh, rules)
        tok_sharding = NamedSharding(mesh, PartitionSpec("dp", None))
        len_sharding = NamedSharding(mesh, PartitionSpec("dp"))

    loglik: list[float] = []
    bar = tqdm(total=len(seqs), desc="evaluating", unit="seq", file=sys.stderr, disable=not progress)
    for start in range(0, len(seqs), batch_size):
        chunk = seqs[start : start + batch_size]
        tokens = np.zeros((batch_size, seq_len), np.int32)
        lengths = np.zeros((batch_size,), np.int32)
        for r, s in enumerate(chunk):
            tokens[r, : len(s)] = s
            lengths[r] = len(s)
        if mesh is not None:
            tok, ln = jax.device_put(tokens, tok_sharding), jax.device_put(lengths, len_sharding)
        else:
            tok, ln = jnp.asarray(tokens), jnp.asarray(lengths)
        ll = np.asarray(jax.device_get(sequence_loglik(params, tok, ln, config)), np.float64)
        loglik.extend(float(x) for x in ll[: len(chunk)])
        bar.update(len(chunk))
    bar.close()

    counts = [max(len(s) - 1, 0) for s in seqs]
    total_ll = float(sum(loglik))
    total_tok = int(sum(counts))
    ppl = math.exp(-total_ll / total_tok) if total_tok else float("nan")
    return {
        "loglik": loglik,
        "tokens": counts,
        "total_loglik": total_ll,
        "total_tokens": total_tok,
        "perplexity": ppl,
    }


def chunk_tokens(ids: Sequence[int], seq_len: int) -> list[list[int]]:
    """Non-overlapping windows of `seq_len` tokens (the last may be shorter; one of fewer than 2 tokens is dropped)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    out = [list(ids[i : i + seq_len]) for i in range(0, len(ids), seq_len)]
    return [w for w in out if len(w) >= 2]


__all__ = ["chunk_tokens", "evaluate", "sequence_loglik"]
