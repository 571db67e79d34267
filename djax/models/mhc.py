"""Manifold-constrained hyper-connections: n residual streams mixed by Sinkhorn-normalised matrices."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _flat_norm(h: jax.Array, eps: float) -> jax.Array:
    flat = h.reshape(*h.shape[:-2], -1).astype(jnp.float32)
    return flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + eps)


def sinkhorn(logits: jax.Array, iters: int, eps: float, unroll: bool | None = None) -> jax.Array:
    """Row softmax, then alternate column / row normalisation: a (nearly) doubly-stochastic matrix.

    unroll: None unrolls the iterations on GPUs only (below); False keeps the loop rolled everywhere,
    as training does: a training step holds the loop dozens of times, forward and backward, and
    unrolled it has twice the kernels, which doubles the GPU compile time for a few ms per step.
    """
    comb = jax.nn.softmax(logits, axis=-1) + eps
    comb = comb / (comb.sum(-2, keepdims=True) + eps)

    def step(_, c):
        c = c / (c.sum(-1, keepdims=True) + eps)
        return c / (c.sum(-2, keepdims=True) + eps)

    # Unrolled on GPUs: there a rolled loop becomes a while loop whose trip test the runtime reads back on
    # the host every iteration (about 0.25 ms each, 150 per decode step on a 4-layer model); unrolled, XLA
    # fuses the iterations' tiny elementwise ops into a few kernels. Elsewhere the loop stays rolled: it is
    # cheap on the CPU and unrolling doubles compile times there.
    if unroll is None:
        unroll = jax.default_backend() == "gpu"
    comb = jax.lax.fori_loop(0, iters - 1, step, comb, unroll=unroll)
    # Unrolled, the iterations are one expression that XLA copied into each of its consumers' kernels: three
    # of about 3 us and a softmax of about 1 us a call at batch 1, each recomputing the chain. The barrier has
    # it computed once.
    return jax.lax.optimization_barrier(comb) if unroll else comb


def hc_pre(
    h: jax.Array,
    fn: jax.Array,
    base: jax.Array,
    scale: jax.Array,
    iters: int,
    eps: float,
    norm_eps: float,
    unroll: bool | None = None,
):
    """Collapse n streams into one block input and compute the mixing for after the block.

    h: [..., n, d]. fn: f32[(2 + n) n, n d]; base: f32[(2 + n) n]; scale: f32[3].
    Returns (block input [..., d] in h.dtype, post f32[..., n], comb f32[..., n, n]).
    """
    n = h.shape[-2]
    mix = _flat_norm(h, norm_eps) @ fn.astype(jnp.float32).T  # f32[..., (2+n)n]
    pre = jax.nn.sigmoid(mix[..., :n] * scale[0] + base[:n]) + eps
    post = 2.0 * jax.nn.sigmoid(mix[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    comb_logits = (mix[..., 2 * n :] * scale[2] + base[2 * n :]).reshape(*mix.shape[:-1], n, n)
    comb = sinkhorn(comb_logits, iters, eps, unroll)
    x = jnp.sum(pre[..., None] * h, axis=-2).astype(h.dtype)
    return x, post, comb


def hc_post(out: jax.Array, h: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """New streams: stream k = post_k * block output + sum_j comb[j, k] * old stream j. out: [..., d]."""
    dt = h.dtype
    mixed = jnp.einsum("...jk,...jd->...kd", comb.astype(dt), h)
    return post.astype(dt)[..., None] * out[..., None, :] + mixed


def hc_head(h: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, eps: float, norm_eps: float):
    """Final collapse of the n streams into one. fn: f32[n, n d]; base: f32[n]; scale: f32[1]."""
    mix = _flat_norm(h, norm_eps) @ fn.astype(jnp.float32).T
    pre = jax.nn.sigmoid(mix * scale[0] + base) + eps
    return jnp.sum(pre[..., None] * h, axis=-2).astype(h.dtype)
