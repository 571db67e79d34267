"""`generate`: prefill, then a `lax.while_loop` of decode steps over the decoder state; one jittable function."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from djax.config import ModelConfig, SamplingParams
from djax.models import model_module
from djax.models.moe import ExpertParallel
from djax.sampling import sample

PAD = -1  # written after a row has finished
GREEDY = SamplingParams()


def _seeds(seeds, n: int) -> np.ndarray:
    """Per-row seeds as uint32[n] from None (all 0), one int (shared) or n ints, each in [0, 2**32)."""
    arr = np.asarray(0 if seeds is None else seeds)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"seeds must be integers, got {arr.dtype}")
    if arr.ndim > 1 or (arr.ndim == 1 and arr.shape[0] != n):
        raise ValueError(f"seeds must be one integer or one per prompt ({n}); got shape {arr.shape}")
    bad = arr[(arr < 0) | (arr > np.iinfo(np.uint32).max)]
    if bad.size:
        raise ValueError(f"seed {int(bad.reshape(-1)[0])} is outside [0, 2**32)")
    return np.broadcast_to(arr.astype(np.uint32), (n,)).copy()


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
        arrays = []
        for i, p in enumerate(prompts):
            arr = np.asarray(p)
            if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
                raise ValueError(f"prompt {i} must be a flat list of integer token ids")
            if arr.size == 0:
                raise ValueError(f"prompt {i} is empty")
            # Ids that do not fit int32 would wrap silently when stored; no vocabulary is that large.
            bad = arr[(arr < 0) | (arr > np.iinfo(np.int32).max)]
            if bad.size:
                raise ValueError(f"prompt {i}: token id {int(bad[0])} is outside the vocabulary")
            arrays.append(arr)
        longest = max(a.size for a in arrays)
        if pad_to is None and bucket < 1:
            raise ValueError(f"bucket must be >= 1, got {bucket}")
        width = pad_to if pad_to is not None else -(-longest // bucket) * bucket
        if width < longest:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest prompt ({longest} tokens)")
        tokens = np.zeros((len(arrays), width), np.int32)
        for i, arr in enumerate(arrays):
            tokens[i, : arr.size] = arr
        seeds = _seeds(seeds, len(arrays))
        lengths = np.array([a.size for a in arrays], np.int32)
        return cls(jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(seeds))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Generated:
    """tokens int32[b, max_new_tokens] (PAD after a row finished); num_tokens int32[b], the EOS included.

    expert_counts: int32[layers, experts] router choices per logical expert (`count_experts=True`), else None.
    """

    tokens: jax.Array
    num_tokens: jax.Array
    finished_by_eos: jax.Array = field(default=None)
    expert_counts: jax.Array = field(default=None)

    def to_lists(self) -> list[list[int]]:
        toks, n = np.asarray(self.tokens), np.asarray(self.num_tokens)
        return [toks[i, : n[i]].tolist() for i in range(toks.shape[0])]


def _concrete(x) -> np.ndarray | None:
    """x as a numpy array, or None while it is being traced (inside jit / vmap)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def validate(batch: Batch, config: ModelConfig, max_new_tokens: int, max_len: int | None = None) -> None:
    """Raise ValueError naming the first problem of a concrete batch (the batch checks are skipped under tracing)."""
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, (int, np.integer))
        or max_new_tokens < 1
    ):
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if max_len is not None and max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if batch.tokens.ndim != 2 or batch.lengths.shape != (batch.tokens.shape[0],):
        raise ValueError(
            f"batch tokens must be [b, t] with lengths [b]; got {batch.tokens.shape} and {batch.lengths.shape}"
        )
    if batch.seeds.shape != batch.lengths.shape:
        raise ValueError(f"batch seeds must be [b] = {batch.lengths.shape}; got {batch.seeds.shape}")
    for name, x in (("tokens", batch.tokens), ("lengths", batch.lengths), ("seeds", batch.seeds)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"batch {name} must be integers, got {x.dtype}")
    tokens, lengths = _concrete(batch.tokens), _concrete(batch.lengths)
    if tokens is None or lengths is None:
        return
    limit = min(config.max_position_embeddings, max_len or config.max_position_embeddings)
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"prompt {i} is empty")
        if n > tokens.shape[1]:
            raise ValueError(f"prompt {i}: length {n} exceeds the batch width {tokens.shape[1]}")
        bad = tokens[i, :n][(tokens[i, :n] < 0) | (tokens[i, :n] >= config.vocab_size)]
        if bad.size:
            raise ValueError(
                f"prompt {i}: token id {int(bad[0])} is outside the vocabulary [0, {config.vocab_size})"
            )
        if n + max_new_tokens > limit:
            raise ValueError(
                f"prompt {i}: {n} prompt tokens + {max_new_tokens} new tokens exceed the context of {limit} tokens"
            )


NO_EOS = -2  # fills the EOS table where there is none: matches neither a sampled id nor PAD


def _eos_table(ids: Sequence[int]) -> np.ndarray:
    """EOS ids as int32[8k], padded with NO_EOS so that configs with up to 8k ids share one compiled program."""
    ids = [int(i) for i in ids]
    table = np.full((max(8, -(-len(ids) // 8) * 8),), NO_EOS, np.int32)
    table[: len(ids)] = ids
    return table


@partial(
    jax.jit, static_argnames=("config", "sampling", "max_new_tokens", "max_len", "moe_impl", "count_experts")
)
def _generate(
    params, batch: Batch, eos, config, sampling, max_new_tokens, max_len, moe_impl, count_experts=False
):
    """eos: int32[e] (NO_EOS-padded) is an argument, not part of the static config, so EOS settings reuse the program."""
    model = model_module(config)
    b = batch.tokens.shape[0]
    counting = {"count_experts": True} if count_experts else {}
    logits, state = model.prefill(
        params, batch.tokens, batch.lengths, config, max_len, moe_impl=moe_impl, **counting
    )

    def is_eos(tok):
        return jnp.any(tok[:, None] == eos[None, :], axis=-1)

    tok = sample(logits, batch.seeds, jnp.int32(0), sampling)
    out = jnp.full((b, max_new_tokens), PAD, jnp.int32).at[:, 0].set(tok)
    done = is_eos(tok)
    count = jnp.ones((b,), jnp.int32)

    def cond(carry):
        step, _, _, _, done, _ = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        step, tok, state, out, done, count = carry
        # A finished row keeps decoding (its output is masked) on a valid id, never on PAD.
        logits, state = model.decode_step(params, jnp.where(done, 0, tok), state, config, moe_impl=moe_impl)
        nxt = sample(logits, batch.seeds, step, sampling)
        nxt = jnp.where(done, PAD, nxt)
        out = out.at[:, step].set(nxt)
        count = count + (~done).astype(jnp.int32)
        done = done | is_eos(nxt)
        return step + 1, nxt, state, out, done, count

    carry = (jnp.int32(1), tok, state, out, done, count)
    _, _, state, out, done, count = jax.lax.while_loop(cond, body, carry)
    return Generated(out, count, done, state.get("expert_counts"))


def generate(
    params,
    batch: Batch,
    config: ModelConfig,
    sampling: SamplingParams = GREEDY,
    max_new_tokens: int = 32,
    *,
    max_len: int | None = None,
    moe_impl: str = "grouped",
    mesh: jax.sharding.Mesh | None = None,
    count_experts: bool = False,
) -> Generated:
    """Generate up to max_new_tokens per row; a row stops at EOS (unless sampling.ignore_eos).

    One jitted function: prefill over the right-padded prompts, then a `lax.while_loop` of decode
    steps carrying the decoder state. max_len (default: batch width + max_new_tokens) sizes the
    compressed pools. Works under `jax.jit` (validation then is the caller's business) and shards
    with the params and batch it is given. With a `mesh` whose "ep" axis is larger than 1 the routed
    experts run expert-parallel (`all_to_all` dispatch and combine); place the params with
    `djax.shard_params` and the batch on "dp".

    count_experts (V4 models): also return the router's choices per layer and logical expert in
    `Generated.expert_counts`, every prompt token and every decode step's row (finished rows keep
    running, so they count), ready for `djax.ExpertLoad.add_counts`.
    """
    if not isinstance(batch, Batch):
        batch = Batch.from_lists(batch)
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a djax.SamplingParams, got {type(sampling).__name__}")
    validate(batch, config, max_new_tokens, max_len)
    if count_experts and not config.is_v4:
        raise ValueError(f"count_experts is implemented for the V4 family, not {config.model_type!r}")
    if mesh is not None and mesh.shape.get("ep", 1) > 1:
        moe_impl = ExpertParallel(mesh, moe_impl)
    max_len = max_len or batch.tokens.shape[1] + max_new_tokens
    eos = _eos_table(() if sampling.ignore_eos else config.eos_ids)
    # EOS handling is data (`eos`), so the static config and sampling drop it: one compiled program serves
    # every EOS setting and ignore_eos alike.
    config = config.replace(eos_token_id=())
    sampling = dataclasses.replace(sampling, ignore_eos=False)
    return _generate(
        params,
        batch,
        jnp.asarray(eos),
        config,
        sampling,
        int(max_new_tokens),
        max_len,
        moe_impl,
        count_experts,
    )
