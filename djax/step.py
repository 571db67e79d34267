"""The model's step functions, jitted: teacher-forced forward, prefill, and decode with the state donated."""

from __future__ import annotations

from functools import partial

import jax

from djax.config import ModelConfig
from djax.models import model_module
from djax.models.moe import ExpertParallel


def forward(params, tokens: jax.Array, config: ModelConfig, moe_impl="grouped", mesh=None) -> jax.Array:
    """Teacher-forced logits f32[b, t, vocab] for tokens int[b, t] from position 0, no cache.

    With a `mesh` whose "ep" axis is larger than 1 the routed experts run expert-parallel.
    """
    if mesh is not None and mesh.shape.get("ep", 1) > 1:
        moe_impl = ExpertParallel(mesh, moe_impl)
    return _forward(params, tokens, config, moe_impl)


@partial(jax.jit, static_argnames=("config", "moe_impl"))
def _forward(params, tokens, config, moe_impl):
    return model_module(config).forward(params, tokens, config, moe_impl=moe_impl)


@partial(jax.jit, static_argnames=("config", "max_len", "moe_impl"))
def prefill(
    params,
    tokens: jax.Array,
    lengths: jax.Array,
    config: ModelConfig,
    max_len: int,
    moe_impl: str = "grouped",
):
    """Right-padded prompts tokens int[b, t] with lengths int[b] -> (logits f32[b, vocab] at each row's last token, state)."""
    return model_module(config).prefill(params, tokens, lengths, config, max_len, moe_impl=moe_impl)


@partial(jax.jit, static_argnames=("config", "moe_impl"), donate_argnames=("state",))
def decode(params, tokens: jax.Array, state, config: ModelConfig, moe_impl: str = "grouped"):
    """One token per row (int[b]) at positions state['lengths'] -> (logits f32[b, vocab], new state). The state is donated."""
    return model_module(config).decode_step(params, tokens, state, config, moe_impl=moe_impl)


def init_state(config: ModelConfig, batch: int, max_len: int):
    """An empty decoder state for `batch` rows of up to `max_len` tokens."""
    return model_module(config).init_state(config, batch, max_len)
