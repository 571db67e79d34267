"""CPU FFI custom calls for MoE routing (row gather, weighted scatter-add): the plumbing test in CI."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from djax.ffi.build import library


@functools.cache
def register() -> None:
    """Builds the CPU library and registers its handlers with XLA (idempotent)."""
    lib = library("cpu_ops")
    jax.ffi.register_ffi_target("djax_gather_rows", jax.ffi.pycapsule(lib.DjaxGatherRows), platform="cpu")
    jax.ffi.register_ffi_target(
        "djax_scatter_add_rows", jax.ffi.pycapsule(lib.DjaxScatterAddRows), platform="cpu"
    )


def gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """out[i] = x[idx[i]], zeros where idx[i] is outside [0, n). x: [n, d]; idx: int32[m] -> [m, d]."""
    register()
    out = jax.ShapeDtypeStruct((idx.shape[0], x.shape[1]), x.dtype)
    return jax.ffi.ffi_call("djax_gather_rows", out)(x, idx.astype(jnp.int32))


def scatter_add_rows(ys: jax.Array, w: jax.Array, idx: jax.Array, n: int) -> jax.Array:
    """out[idx[i]] += w[i] * ys[i], skipping idx outside [0, n). ys: [m, d]; w: f32[m] -> f32[n, d]."""
    register()
    out = jax.ShapeDtypeStruct((n, ys.shape[1]), jnp.float32)
    call = jax.ffi.ffi_call("djax_scatter_add_rows", out)
    return call(ys.astype(jnp.float32), w.astype(jnp.float32), idx.astype(jnp.int32))
