"""A partitioning rule for the decode kernels: row-independent ops run on each batch shard.

An FFI custom call has no sharding rule, so under a mesh that splits the batch (data-parallel attention) the
SPMD partitioner would all-gather every operand to run the kernel whole on each device. Every decode kernel
here treats batch rows independently (the FP8 GEMM its activation rows), so `batch_sharded` wraps one in
`custom_partitioning`: the operands keep their batch sharding, everything else is replicated (a weight
sharded otherwise is gathered), and each device runs the kernel on its rows.
"""

from __future__ import annotations

import functools

from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from djax.kernels import indexer as _indexer
from djax.kernels import sparse_attn as _sparse_attn
from djax.kernels import topk as _topk


def batch_sharded(fn, rule: str, batched: tuple[bool, ...], static_argnums: tuple[int, ...] = ()):
    """`fn(*arrays, *statics)` partitioned over the leading (batch) dimension of its batched operands.

    rule: the Shardy sharding rule, e.g. "b h k, b s k, h -> b h k" (one factor name per dimension; the
    batch factor first in every batched operand and result). batched[i]: whether array operand i has the
    batch dimension first (per-head tables such as sinks do not, and are replicated). Static arguments
    (Python scalars) come after the arrays and are named by `static_argnums`.
    """
    wrapped = custom_partitioning(fn, static_argnums=static_argnums)
    n_static = len(static_argnums)

    def batch_axes(mesh, arg_shapes):
        """The mesh axes the first batched operand's rows are split over (None: replicated)."""
        first = arg_shapes[batched.index(True)]
        spec = first.sharding.spec if isinstance(first.sharding, NamedSharding) else P()
        return spec[0] if len(spec) else None

    def shardings(mesh, axes, shapes):
        return tuple(NamedSharding(mesh, P(axes) if b else P()) for b in shapes)

    def result_shardings(mesh, axes, result_shape):
        results = result_shape if isinstance(result_shape, (tuple, list)) else (result_shape,)
        outs = [NamedSharding(mesh, P(axes)) for _ in results]
        return tuple(outs) if isinstance(result_shape, (tuple, list)) else outs[0]

    def infer(*args):
        *_, mesh, arg_shapes, result_shape = _split(args, n_static)
        return result_shardings(mesh, batch_axes(mesh, arg_shapes), result_shape)

    def partition(*args):
        statics, mesh, arg_shapes, result_shape = _split(args, n_static)
        axes = batch_axes(mesh, arg_shapes)

        def lower(*arrays):
            return fn(*arrays, *statics)

        return mesh, lower, result_shardings(mesh, axes, result_shape), shardings(mesh, axes, batched)

    wrapped.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule)
    return wrapped


def _split(args, n_static):
    """custom_partitioning passes (*statics, mesh, arg_shapes, result_shape) to its callbacks."""
    statics, (mesh, arg_shapes, result_shape) = args[:n_static], args[n_static:]
    return statics, mesh, arg_shapes, result_shape


# The decode kernels the model calls, each at one impl, partitioned over the batch. The ops are looked up
# when called (not when the cached wrapper is made), so a replaced op is the one that runs.
@functools.cache
def sparse_decode(impl: str):
    """djax.kernels.sparse_attn.sparse_decode(q, window, window_valid, pool, topk, sinks, scale)."""

    def fn(q, window, window_valid, pool, topk, sinks, scale):
        return _sparse_attn.sparse_decode(q, window, window_valid, pool, topk, sinks, scale, impl=impl)

    rule = "b h k, b w k, b w, b c k, b t, h -> b h k"
    return batch_sharded(fn, rule, (True,) * 5 + (False,), static_argnums=(6,))


@functools.cache
def index_scores(impl: str):
    """djax.kernels.indexer.index_scores(q, keys, weights, lengths)."""

    def fn(q, keys, weights, lengths):
        return _indexer.index_scores(q, keys, weights, lengths, impl=impl)

    return batch_sharded(fn, "b h c, b s c, b h, b -> b s", (True,) * 4)


@functools.cache
def topk(impl: str):
    """djax.kernels.topk.topk(scores, k) -> (values, indices)."""

    def fn(scores, k):
        return _topk.topk(scores, k, impl=impl)

    return batch_sharded(fn, "b s -> b k, b k", (True,), static_argnums=(1,))


@functools.cache
def fp8_gemm(impl: str):
    """djax.kernels.fp8_gemm.fp8_gemm(a, a_scale, b, b_scale, out_dtype): rows of a (and their scales) split."""

    def fn(a, a_scale, b, b_scale, out_dtype):
        from djax.kernels import fp8_gemm as _fp8  # here: the module imports Triton, which djax does not need

        return _fp8.fp8_gemm(a, a_scale, b, b_scale, out_dtype=out_dtype, impl=impl)

    return batch_sharded(fn, "m k, m j, n k, i j -> m n", (True, True, False, False), static_argnums=(4,))


@functools.cache
def fp8_quant_gemm(impl: str):
    """djax.kernels.fp8_gemm.fp8_quant_gemm(a, b, b_scale, ue8m0): rows of a split."""

    def fn(a, b, b_scale, ue8m0):
        from djax.kernels import fp8_gemm as _fp8

        return _fp8.fp8_quant_gemm(a, b, b_scale, ue8m0, impl=impl)

    return batch_sharded(fn, "m k, n k, i j -> m n", (True, False, False), static_argnums=(3,))


@functools.cache
def fp8_quant_gemm_pair(impl: str):
    """djax.kernels.fp8_gemm.fp8_quant_gemm_pair(a, b, b_scale, b2, b2_scale, ue8m0): rows of a split."""

    def fn(a, b, b_scale, b2, b2_scale, ue8m0):
        from djax.kernels import fp8_gemm as _fp8

        return _fp8.fp8_quant_gemm_pair(a, b, b_scale, b2, b2_scale, ue8m0, impl=impl)

    rule = "m k, n k, i j, p k, q j -> m n, m p"
    return batch_sharded(fn, rule, (True, False, False, False, False), static_argnums=(5,))


@functools.cache
def fp8_weight_gemm(impl: str):
    """djax.kernels.fp8_gemm.fp8_weight_gemm(a, b, b_scale, block): rows of a split."""

    def fn(a, b, b_scale, block):
        from djax.kernels import fp8_gemm as _fp8

        return _fp8.fp8_weight_gemm(a, b, b_scale, block, impl=impl)

    return batch_sharded(fn, "m k, n k, i j -> m n", (True, False, False), static_argnums=(3,))


@functools.cache
def fp8_weight_gemm_grouped(impl: str):
    """fp8_weight_gemm over groups, batch first: a [m, g, k] (rows split), b [g, n, k], b_scale [g, nb, kb]
    -> [m, g, n]; the transposes to the op's group-first layout happen on each device's rows."""

    def fn(a, b, b_scale, block):
        from djax.kernels import fp8_gemm as _fp8

        out = _fp8.fp8_weight_gemm(a.transpose(1, 0, 2), b, b_scale, block, impl=impl)
        return out.transpose(1, 0, 2)

    return batch_sharded(fn, "m g k, g n k, g i j -> m g n", (True, False, False), static_argnums=(3,))
