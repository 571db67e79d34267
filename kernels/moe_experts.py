"""Routed MoE experts from grouped GEMMs: sort picks by expert into BLOCK_M-aligned groups, fused gate/up
SwiGLU, down projection, weighted gather-combine. Same contract as `experts_ragged` in models/moe.py."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from djax.kernels.grouped_gemm import GemmConfig, grouped_gemm, grouped_swiglu
from djax.quant import dense

# Picks per expert decide the tile height: small tiles waste less padding at decode sizes.
DECODE_CFG = GemmConfig(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=4)
PREFILL_CFG = GemmConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)


class Layout(NamedTuple):
    """Picks placed in expert-contiguous rows, each expert's group padded to a multiple of block_m.

    rows int32[m_pad]: the token of each padded row (-1 for padding); m_indices int32[m_pad]: its expert
    (-1 for padding); pos int32[n*k]: the padded row of pick (token t, choice j) at t*k + j.
    """

    rows: jax.Array
    m_indices: jax.Array
    pos: jax.Array


def padded_rows(n_picks: int, num_experts: int, block_m: int) -> int:
    """Static bound on the padded rows: every non-empty group wastes at most block_m - 1 rows."""
    tiles = -(-(n_picks + min(num_experts, n_picks) * (block_m - 1)) // block_m)
    return max(tiles, 1) * block_m


def layout(idx, num_experts: int, block_m: int) -> Layout:
    """idx int32[n, k] expert per pick (ids outside [0, e) are dropped: pos -1). All in jnp."""
    n, k = idx.shape
    flat = idx.reshape(-1).astype(jnp.int32)
    ok = (flat >= 0) & (flat < num_experts)
    key = jnp.where(ok, flat, num_experts)
    sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    padded = -(-sizes // block_m) * block_m
    starts = jnp.cumsum(padded) - padded  # padded start of each group
    first = jnp.cumsum(sizes) - sizes  # unpadded start of each group
    order = jnp.argsort(key, stable=True)  # sorted position -> pick
    sk = key[order]
    ske = jnp.minimum(sk, num_experts - 1)
    dest = jnp.where(sk < num_experts, starts[ske] + jnp.arange(n * k) - first[ske], -1)
    m_pad = padded_rows(n * k, num_experts, block_m)
    drop = jnp.where(dest >= 0, dest, m_pad)  # out of bounds: dropped by the scatter
    rows = jnp.full((m_pad,), -1, jnp.int32).at[drop].set((order // k).astype(jnp.int32), mode="drop")
    m_indices = jnp.full((m_pad,), -1, jnp.int32).at[drop].set(sk, mode="drop")
    pos = jnp.zeros((n * k,), jnp.int32).at[order].set(dest)
    return Layout(rows, m_indices, pos)


def default_config(n_picks: int, num_experts: int) -> GemmConfig:
    return DECODE_CFG if n_picks <= 4 * num_experts else PREFILL_CFG


def moe_experts(
    x, weights, idx, w1, w2, w3, limit: float, impl: str = "auto", cfg: GemmConfig | None = None
) -> jax.Array:
    """Routed experts via grouped GEMMs. x: [n, d]; weights f32[n, k]; idx int32[n, k]; w1, w3: [e, f, d];
    w2: [e, d, f] (plain or QArray, made dense in x's dtype). Returns [n, d] in x's dtype.

    impl as in `grouped_gemm` ("interpret" runs the Triton kernels in the CPU interpreter). Picks with an
    expert id outside [0, e) contribute nothing.
    """
    n, d = x.shape
    e, k = w1.shape[0], idx.shape[1]
    cfg = cfg or default_config(n * k, e)
    lay = layout(idx, e, cfg.block_m)
    dt = x.dtype
    h = grouped_swiglu(x, dense(w1, dt), dense(w3, dt), lay.m_indices, limit, lay.rows, impl, cfg)
    y = grouped_gemm(h, dense(w2, dt), lay.m_indices, None, impl, cfg)  # [m_pad, d]
    picked = y[jnp.maximum(lay.pos, 0)].reshape(n, k, d).astype(jnp.float32)
    w = jnp.where(lay.pos >= 0, weights.reshape(-1), 0.0).reshape(n, k, 1)
    # where, not a product: skipped rows of y hold undefined values (possibly nan)
    out = jnp.where(w != 0, picked * w, 0.0).sum(1)
    return out.astype(dt)


def moe_experts_triton(x, weights, idx, w1, w2, w3, limit: float) -> jax.Array:
    """`moe_experts` with the Triton kernels: the drop-in CUDA twin of models/moe.py's `experts_ragged`."""
    return moe_experts(x, weights, idx, w1, w2, w3, limit, impl="triton")
