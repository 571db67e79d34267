"""Expert-parallel routed experts: dispatch token copies to the devices that hold their experts with
`all_to_all`, run the local experts there as one grouped computation, and combine the results back.

Layout (inside one `jax.shard_map` over the whole mesh):
- tokens (x [n, d], the routing weights and expert ids [n, k]) are sharded on their leading axis over
  ("dp", "ep") together: every device owns n / (dp * ep) tokens and no token is held twice. Each dp
  slice is an independent EP group; "tp" (if present) replicates the computation.
- experts (w1, w3 [e, f, d], w2 [e, d, f], plain arrays or `QArray`s) are sharded on their leading
  axis over "ep" (the default `ShardingRules.experts`) and replicated over "dp": the ep-th device of
  a dp slice holds experts [ep_i * e_loc, (ep_i + 1) * e_loc), e_loc = e / ep.

Per device: its n_loc * k token copies are sorted (stably, token-major) by destination device
`idx // e_loc` and written into fixed-size per-destination buffers [ep, C, d] (plus the local expert
id and routing weight of each slot). `all_to_all` over "ep" (dispatch) swaps the buffers, so device j
receives [ep, C] slots, every one for one of its own experts. The local experts run on them with
`experts_grouped` (or another routed-expert implementation from `moe.py`) using local expert ids and
the routing weights (empty slots have weight 0); a second `all_to_all` (combine) sends the weighted
results back to the slots they came from, and each device sums its tokens' copies.

Capacity C (slots per source-destination pair): by default n_loc * k, i.e. every copy fits and
nothing is ever dropped (buffers are ep times larger than the mean need). With `capacity_factor`
cf, C = min(n_loc * k, max(1, ceil(cf * n_loc * k / ep))): cf = 1 is exactly the uniform-load share.
Copies beyond C for one destination are dropped in token order (the later tokens of that device
lose that expert's contribution); the number of dropped copies, summed over the whole mesh, is
returned alongside the output — drops are never silent.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from djax.models import moe as _moe

_IMPLS: dict[str, Callable] = {
    "grouped": _moe.experts_grouped,
    "gather": _moe.experts_gather,
    "batched": _moe.experts_batched,
    "ragged": _moe.experts_ragged,
    "dense": _moe.experts_dense,
}


def capacity(n_local: int, k: int, ep: int, capacity_factor: float | None) -> int:
    """Slots per (source device, destination device) buffer; see the module docstring."""
    full = n_local * k
    if capacity_factor is None:
        return full
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
    return min(full, max(1, math.ceil(capacity_factor * full / ep)))


def _token_axes(mesh: Mesh) -> tuple[str, ...]:
    return tuple(a for a in ("dp", "ep") if a in mesh.axis_names)


def moe_ep(
    x: jax.Array,
    weights: jax.Array,
    idx: jax.Array,
    w1,
    w2,
    w3,
    limit: float,
    mesh: Mesh,
    capacity_factor: float | None = None,
    impl: str = "grouped",
) -> tuple[jax.Array, jax.Array]:
    """Routed experts, expert-parallel over mesh axis "ep". Same math as `moe.experts_grouped`.

    x: [n, d]; weights f32[n, k]; idx int32[n, k] (global expert ids: physical slots when the experts
    are placed by `djax.apply_placement`); w1, w3: [e, f, d]; w2: [e, d, f].
    mesh: a mesh with an "ep" axis (and optionally "dp", "tp"); e must divide by ep. n need not divide
    by dp * ep (padded; padding rows are never sent and never counted as drops).
    capacity_factor: None (default) drops nothing; else see `capacity`.
    impl: the local routed-expert computation ("grouped", "ragged", "batched", "gather", "dense").

    Returns (out [n, d] in x's dtype, sharded on ("dp", "ep"); dropped: int32 scalar, the number of
    (token, choice) copies dropped over the whole mesh). Jittable with mesh, limit, capacity_factor
    and impl static.
    """
    if "ep" not in mesh.axis_names:
        raise ValueError(f"moe_ep needs a mesh with an 'ep' axis, got axes {mesh.axis_names}")
    if impl not in _IMPLS:
        raise ValueError(f"unknown moe impl {impl!r}; choose one of {sorted(_IMPLS)}")
    run_local = _IMPLS[impl]
    ep = mesh.shape["ep"]
    e = w1.shape[0]
    if e % ep:
        raise ValueError(f"{e} experts do not divide over ep={ep} devices")
    e_loc = e // ep
    tok_axes = _token_axes(mesh)
    shards = math.prod(mesh.shape[a] for a in tok_axes)
    n, d = x.shape
    k = idx.shape[1]
    n_pad = -(-n // shards) * shards
    valid = jnp.arange(n_pad) < n
    if n_pad != n:
        x = jnp.pad(x, ((0, n_pad - n), (0, 0)))
        weights = jnp.pad(weights, ((0, n_pad - n), (0, 0)))
        idx = jnp.pad(idx, ((0, n_pad - n), (0, 0)))
    n_loc = n_pad // shards
    m = n_loc * k  # token copies per device
    cap = capacity(n_loc, k, ep, capacity_factor)

    def local(x, weights, idx, valid, w1, w2, w3):
        # --- dispatch: sort copies by destination device, fill fixed per-destination buffers ---
        flat = idx.reshape(-1)  # [m], token-major
        dest = jnp.where(jnp.repeat(valid, k), flat // e_loc, ep)  # padding -> sentinel ep (never sent)
        order = jnp.argsort(dest, stable=True)
        dest_s = dest[order]
        counts = jnp.bincount(dest, length=ep + 1)
        starts = jnp.cumsum(counts) - counts
        pos = jnp.arange(m) - starts[dest_s]  # rank within its destination
        sent = dest_s < ep
        keep = sent & (pos < cap)
        dropped = jnp.sum(sent & ~keep).astype(jnp.int32)
        # Slot of each sorted copy in the flattened [ep, cap] buffer; out of range (dropped) for the rest.
        slot = jnp.where(keep, dest_s * cap + pos, ep * cap)
        tok = order // k
        buf_x = jnp.zeros((ep * cap, d), x.dtype).at[slot].set(x[tok], mode="drop")
        buf_e = jnp.zeros((ep * cap,), jnp.int32).at[slot].set(flat[order] % e_loc, mode="drop")
        buf_w = (
            jnp.zeros((ep * cap,), jnp.float32)
            .at[slot]
            .set(weights.reshape(-1)[order].astype(jnp.float32), mode="drop")
        )

        def a2a(a):
            return jax.lax.all_to_all(a, "ep", 0, 0, tiled=True)

        rx, re_, rw = a2a(buf_x), a2a(buf_e), a2a(buf_w)  # [ep * cap, ...]: slots from every source
        # --- local experts: one grouped computation over every received slot (empty slots weigh 0) ---
        y = run_local(rx, rw[:, None], re_[:, None], w1, w2, w3, limit)  # [ep * cap, d], weighted
        # --- combine: send results back to their source slots, sum each token's copies ---
        back = a2a(y)
        got = jnp.where(keep[:, None], back[jnp.minimum(slot, ep * cap - 1)], 0)
        out = jnp.zeros((n_loc, d), y.dtype).at[tok].add(got)
        return out.astype(x.dtype), jax.lax.psum(dropped, tok_axes)

    tok = P(tok_axes)
    expert = jax.tree.map(lambda _: P("ep"), (w1, w2, w3))
    out, dropped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(tok, tok, tok, tok, *expert),
        out_specs=(tok, P()),
    )(x, weights, idx, valid, w1, w2, w3)
    return out[:n], dropped


def dropped_copies(idx, e: int, mesh_shape: dict, capacity_factor: float | None):
    """Brute-force reference (numpy, host): per-copy keep mask [n, k] and the total drop count.

    Mirrors `moe_ep`'s policy: tokens in contiguous blocks over dp * ep devices, each device keeps
    the first C copies (token-major) per destination device. For tests and diagnostics.
    """
    import numpy as np

    idx = np.asarray(idx)
    n, k = idx.shape
    ep = mesh_shape.get("ep", 1)
    shards = mesh_shape.get("dp", 1) * ep
    n_loc = -(-n // shards)
    cap = capacity(n_loc, k, ep, capacity_factor)
    e_loc = e // ep
    keep = np.ones((n, k), bool)
    for s in range(shards):
        used = [0] * ep
        for t in range(s * n_loc, min(n, (s + 1) * n_loc)):
            for c in range(k):
                dst = int(idx[t, c]) // e_loc
                if used[dst] >= cap:
                    keep[t, c] = False
                else:
                    used[dst] += 1
    return keep, int((~keep).sum())


__all__ = ["capacity", "dropped_copies", "moe_ep"]
