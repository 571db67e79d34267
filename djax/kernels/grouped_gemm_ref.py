"""Grouped GEMMs for MoE experts in jnp (the spec of grouped_gemm_triton): contiguous and masked layouts.

Weights are in torch layout b[g, n, k] (out, in), as djax/models/moe.py stores w1/w3 [e, f, d] and w2 [e, d, f].
Products accumulate in float32; results are cast to a's dtype. Padding and dead rows come out as 0 here
(the Triton kernels leave them unwritten).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from djax.models.layers import swiglu_act

F32 = jnp.float32


def _gather_rows(a, rows):
    if rows is None:
        return a
    return jnp.where((rows >= 0)[:, None], a[jnp.maximum(rows, 0)], 0).astype(a.dtype)


def _contiguous_f32(a, b, m_indices, rows):
    a = _gather_rows(a, rows)

    def one(acc, g):
        y = jnp.einsum("mk,nk->mn", a, b[g], preferred_element_type=F32, precision="highest")
        return jnp.where((m_indices == g)[:, None], y, acc), None

    out, _ = jax.lax.scan(one, jnp.zeros((a.shape[0], b.shape[1]), F32), jnp.arange(b.shape[0]))
    return out


def _masked_f32(a, b, masked_m):
    out = jnp.einsum("gmk,gnk->gmn", a, b, preferred_element_type=F32, precision="highest")
    live = jnp.arange(a.shape[1])[None, :] < masked_m[:, None]
    return jnp.where(live[..., None], out, 0.0)


def swiglu_f32(gate, up, limit: float):
    """The model's clamped SwiGLU (`layers.swiglu_act`) on float32 gate and up."""
    return swiglu_act(gate.astype(F32), up.astype(F32), limit)


def contiguous_ref(a, b, m_indices, rows=None):
    """out[i] = a[rows[i]] @ b[m_indices[i]]^T. a [m, k] (or [n, k] gathered by rows int32[m], -1 = zero row);
    b [g, n, k]; m_indices int32[m] (-1 = padding row, output 0). Returns [m, n] in a's dtype."""
    return _contiguous_f32(a, b, m_indices, rows).astype(a.dtype)


def masked_ref(a, b, masked_m):
    """a [g, M, k] with the first masked_m[g] rows of group g live; b [g, n, k]. Returns [g, M, n], dead rows 0."""
    return _masked_f32(a, b, masked_m).astype(a.dtype)


def swiglu_contiguous_ref(a, w1, w3, m_indices, limit: float, rows=None):
    """Fused gate/up: swiglu(a w1[g]^T, a w3[g]^T) per row, same layout as `contiguous_ref`. Returns [m, f]."""
    gate = _contiguous_f32(a, w1, m_indices, rows)
    up = _contiguous_f32(a, w3, m_indices, rows)
    return swiglu_f32(gate, up, limit).astype(a.dtype)


def swiglu_masked_ref(a, w1, w3, masked_m, limit: float):
    """Fused gate/up in the masked layout. Returns [g, M, f], dead rows 0."""
    return swiglu_f32(_masked_f32(a, w1, masked_m), _masked_f32(a, w3, masked_m), limit).astype(a.dtype)
