"""Public MoE routing ops: `permute` / `unpermute` with impl "auto"|"ref"|"ffi" (the C++ CPU handlers)."""

from __future__ import annotations

from djax.kernels.dispatch import resolve
from djax.kernels.moe_routing_ref import Routing, permute_ref, routing_ref, unpermute_ref

__all__ = ["Routing", "routing", "permute", "unpermute"]


def routing(idx, weights, num_experts: int) -> Routing:
    """Expert-contiguous order of the picks; see `moe_routing_ref.routing_ref`."""
    return routing_ref(idx, weights, num_experts)


def permute(x, r: Routing, impl: str = "auto"):
    """x [n, d] -> [n*topk, d] in expert order. "ffi" runs the gather as a CPU FFI custom call."""
    impl = resolve(impl, ("ref", "ffi"), fast=None)
    if impl == "ref":
        return permute_ref(x, r)
    from djax.ffi.cpu_ops import gather_rows

    return gather_rows(x, r.token)


def unpermute(ys, r: Routing, n: int, impl: str = "auto"):
    """[n*topk, d] expert outputs -> [n, d], weighted by the gate. "ffi": CPU FFI scatter-add."""
    impl = resolve(impl, ("ref", "ffi"), fast=None)
    if impl == "ref":
        return unpermute_ref(ys, r, n)
    from djax.ffi.cpu_ops import scatter_add_rows

    return scatter_add_rows(ys, r.weight, r.token, n).astype(ys.dtype)
