"""Public FP8 block-scaled GEMM ops (dense, grouped contiguous, grouped masked); only "ref" exists so far."""

from __future__ import annotations

import jax.numpy as jnp

from djax.kernels.dispatch import resolve
from djax.kernels.fp8_gemm_ref import fp8_gemm_ref, grouped_contiguous_ref, grouped_masked_ref


def fp8_gemm(a, a_scale, b, b_scale, out_dtype=jnp.bfloat16, impl: str = "auto"):
    """See `fp8_gemm_ref.fp8_gemm_ref` for shapes and scale layout."""
    resolve(impl, ("ref",), fast=None)
    return fp8_gemm_ref(a, a_scale, b, b_scale, out_dtype)


def grouped_contiguous(a, a_scale, b, b_scale, m_indices, out_dtype=jnp.bfloat16, impl: str = "auto"):
    """See `fp8_gemm_ref.grouped_contiguous_ref`."""
    resolve(impl, ("ref",), fast=None)
    return grouped_contiguous_ref(a, a_scale, b, b_scale, m_indices, out_dtype)


def grouped_masked(a, a_scale, b, b_scale, masked_m, out_dtype=jnp.bfloat16, impl: str = "auto"):
    """See `fp8_gemm_ref.grouped_masked_ref`."""
    resolve(impl, ("ref",), fast=None)
    return grouped_masked_ref(a, a_scale, b, b_scale, masked_m, out_dtype)
