"""MoE routing on one device in jnp: tokens into expert-contiguous order with their gate weights, and back."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routing(NamedTuple):
    """Where each expert-ordered row came from. token/weight: [n*topk]; sizes: int32[e] rows per expert.

    Rows of invalid picks (expert id < 0 or >= e) sit after every expert's rows, with token -1.
    """

    token: jax.Array  # int32[n*topk]
    weight: jax.Array  # f32[n*topk]
    sizes: jax.Array  # int32[e]


def routing_ref(idx, weights, num_experts: int) -> Routing:
    """idx int32[n, topk] expert per pick; weights f32[n, topk]. Stable: equal experts keep token order."""
    n, k = idx.shape
    flat = idx.reshape(-1)
    ok = (flat >= 0) & (flat < num_experts)
    order = jnp.argsort(jnp.where(ok, flat, num_experts), stable=True)
    token = jnp.where(ok[order], order // k, -1).astype(jnp.int32)
    weight = jnp.where(ok[order], weights.reshape(-1)[order], 0.0).astype(jnp.float32)
    sizes = jnp.bincount(jnp.where(ok, flat, num_experts), length=num_experts + 1)[:num_experts].astype(
        jnp.int32
    )
    return Routing(token, weight, sizes)


def permute_ref(x, routing: Routing):
    """x [n, d] -> xs [n*topk, d]: row i is x[token[i]] (zeros for invalid picks)."""
    ok = routing.token >= 0
    return jnp.where(ok[:, None], x[jnp.maximum(routing.token, 0)], 0).astype(x.dtype)


def unpermute_ref(ys, routing: Routing, n: int):
    """ys [n*topk, d] expert outputs -> [n, d]: out[t] = sum of weight[i] ys[i] over rows i of token t (f32 sum)."""
    contrib = ys.astype(jnp.float32) * routing.weight[:, None]
    tok = jnp.where(routing.token >= 0, routing.token, n)  # invalid rows land in a dropped extra row
    return jnp.zeros((n + 1, ys.shape[1]), jnp.float32).at[tok].add(contrib)[:n].astype(ys.dtype)
