"""Expert-parallel load balancing (EPLB): placements planned on the host in numpy, applied to the weights in JAX.

From measured per-expert load (tokens routed to each logical expert), place logical experts on
physical expert slots, giving hot experts several replicas, so that every device gets about the
same load. The algorithm is DeepSeek's EPLB:

- `replicate(load, num_physical)`: every logical expert gets one slot; each further slot goes to
  the expert with the highest load per replica (this minimises the maximal load per replica).
- `pack(weights, num_bins)`: balanced packing with the same number of items in every bin; items
  largest first, each into the lightest bin that still has room.
- `rebalance_hierarchical`: groups of experts to nodes (packing group loads, so that group-limited
  routing keeps its traffic inside a node), then replicas within each node, then the node's
  physical experts packed onto its GPUs.
- `rebalance_global`: replicas over all experts at once, then packing onto all GPUs (the
  hierarchical policy with one group and one node); `rebalance` picks between them as DeepSeek does.

A placement is `(phy2log, log2phy, logcnt)`: phy2log int[num_physical] (physical slot -> logical
expert; slot s lives on GPU s // (num_physical // num_gpus)), log2phy int[num_logical, max_replicas]
(-1 padded) and logcnt int[num_logical] (replica count of every logical expert). A 2-D load
[num_layers, num_logical] gives a placement per layer, stacked (log2phy padded to the widest layer).

`ExpertLoad` accumulates the counts from router choices while running (`add_counts` takes the
in-model counts of `djax.generate(..., count_experts=True)`); `expert_counts` turns one batch of
router indices into counts. `apply_placement` relays a model's experts by a placement at run time.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from djax.config import ModelConfig
from djax.quant import QArray
from djax.sharding import DEFAULT_RULES, ShardingRules, spec_for


class Placement(NamedTuple):
    phy2log: np.ndarray  # int[num_physical] or int[layers, num_physical]
    log2phy: np.ndarray  # int[num_logical, max_replicas], -1 padded (or with a leading layers dim)
    logcnt: np.ndarray  # int[num_logical] replicas per logical expert (or with a leading layers dim)


def _as_load(load) -> np.ndarray:
    a = np.asarray(load, dtype=np.float64)
    if a.ndim != 1:
        raise ValueError(f"expected a 1-D load, got shape {a.shape}")
    if np.any(a < 0) or not np.all(np.isfinite(a)):
        raise ValueError("loads must be finite and non-negative")
    return a


def replicate(load, num_physical: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Give every logical expert one slot, then each extra slot to the expert with the highest load per replica.

    Returns (phy2log int[num_physical], rank int[num_physical] (replica index of each slot within
    its expert), logcnt int[num_logical]). Slots 0..num_logical-1 are the experts themselves in
    order; ties go to the lowest expert id.
    """
    w = _as_load(load)
    n = w.shape[0]
    if num_physical < n:
        raise ValueError(f"num_physical={num_physical} is smaller than the {n} logical experts")
    phy2log = np.concatenate([np.arange(n), np.zeros(num_physical - n, np.int64)]).astype(np.int64)
    rank = np.zeros(num_physical, np.int64)
    logcnt = np.ones(n, np.int64)
    for s in range(n, num_physical):
        e = int(np.argmax(w / logcnt))
        phy2log[s] = e
        rank[s] = logcnt[e]
        logcnt[e] += 1
    return phy2log, rank, logcnt


def pack(weights, num_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Balanced packing of items into `num_bins` bins of exactly len(weights) // num_bins items each.

    Greedy: items by decreasing weight (stable: ties by index), each into the lightest bin that is
    not full (ties: the lowest bin). Returns (bin int[n], rank_in_bin int[n]).
    """
    w = _as_load(weights)
    n = w.shape[0]
    if num_bins < 1 or n % num_bins:
        raise ValueError(f"{n} items cannot be split evenly over {num_bins} bins")
    per_bin = n // num_bins
    bin_of = np.full(n, -1, np.int64)
    rank = np.full(n, -1, np.int64)
    bin_w = np.zeros(num_bins)
    bin_n = np.zeros(num_bins, np.int64)
    for i in np.argsort(-w, kind="stable"):
        open_bins = np.flatnonzero(bin_n < per_bin)
        b = int(open_bins[np.argmin(bin_w[open_bins])])
        bin_of[i], rank[i] = b, bin_n[b]
        bin_w[b] += w[i]
        bin_n[b] += 1
    return bin_of, rank


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.shape[0])
    return inv


def _log2phy(phy2log: np.ndarray, logcnt: np.ndarray, width: int | None = None) -> np.ndarray:
    width = int(logcnt.max()) if width is None else width
    out = np.full((logcnt.shape[0], width), -1, np.int64)
    fill = np.zeros(logcnt.shape[0], np.int64)
    for s, e in enumerate(phy2log):
        out[e, fill[e]] = s
        fill[e] += 1
    return out


def _hierarchical_1d(w: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int):
    n = w.shape[0]
    if n % num_groups:
        raise ValueError(f"{n} experts do not split into {num_groups} groups")
    if num_groups % num_nodes:
        raise ValueError(f"{num_groups} groups do not split over {num_nodes} nodes")
    if num_gpus % num_nodes:
        raise ValueError(f"{num_gpus} GPUs do not split over {num_nodes} nodes")
    if num_physical % num_gpus:
        raise ValueError(f"{num_physical} physical slots do not split over {num_gpus} GPUs")
    if num_physical < n:
        raise ValueError(f"num_physical={num_physical} is smaller than the {n} logical experts")
    group_size = n // num_groups
    groups_per_node = num_groups // num_nodes
    log_per_node = n // num_nodes
    phy_per_node = num_physical // num_nodes
    phy_per_gpu = num_physical // num_gpus
    gpus_per_node = num_gpus // num_nodes
    if phy_per_node < log_per_node:
        raise ValueError("fewer physical slots per node than logical experts per node")

    # 1. groups to nodes: "mlog" numbers logical experts node-major.
    group_load = w.reshape(num_groups, group_size).sum(-1)
    g_node, g_rank = pack(group_load, num_nodes)
    log2mlog = ((g_node * groups_per_node + g_rank)[:, None] * group_size + np.arange(group_size)).reshape(-1)
    mlog2log = _inverse(log2mlog)

    phy2log = np.empty(num_physical, np.int64)
    logcnt = np.zeros(n, np.int64)
    for node in range(num_nodes):
        mlogs = mlog2log[node * log_per_node : (node + 1) * log_per_node]  # logical ids of this node
        wl = w[mlogs]
        # 2. replicas within the node.
        p2l, _, cnt = replicate(wl, phy_per_node)
        logcnt[mlogs] = cnt
        # 3. the node's physical experts onto its GPUs.
        gpu, r = pack(wl[p2l] / cnt[p2l], gpus_per_node)
        slot = node * phy_per_node + gpu * phy_per_gpu + r
        phy2log[slot] = mlogs[p2l]
    return phy2log, logcnt


def _stack(load, fn) -> Placement:
    a = np.asarray(load, dtype=np.float64)
    if a.ndim == 1:
        p2l, cnt = fn(_as_load(a))
        return Placement(p2l, _log2phy(p2l, cnt), cnt)
    if a.ndim != 2:
        raise ValueError(f"load must be [num_logical] or [num_layers, num_logical], got shape {a.shape}")
    per = [fn(_as_load(row)) for row in a]
    width = max(int(c.max()) for _, c in per)
    return Placement(
        np.stack([p for p, _ in per]),
        np.stack([_log2phy(p, c, width) for p, c in per]),
        np.stack([c for _, c in per]),
    )


def rebalance_hierarchical(
    load, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> Placement:
    """DeepSeek's hierarchical policy: expert groups packed onto nodes, replicas within nodes, then packed onto GPUs.

    load: [num_logical] or [num_layers, num_logical]; num_replicas: physical slots in all.
    """
    return _stack(load, lambda w: _hierarchical_1d(w, num_replicas, num_groups, num_nodes, num_gpus))


def rebalance_global(load, num_replicas: int, num_gpus: int) -> Placement:
    """Global policy: replicas chosen over all experts, then all physical experts packed onto all GPUs."""
    return _stack(load, lambda w: _hierarchical_1d(w, num_replicas, 1, 1, num_gpus))


def rebalance(load, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> Placement:
    """Hierarchical when the groups split evenly over the nodes (as in DeepSeek's EPLB), global otherwise."""
    if num_groups % num_nodes == 0:
        return rebalance_hierarchical(load, num_replicas, num_groups, num_nodes, num_gpus)
    return rebalance_global(load, num_replicas, num_gpus)


def gpu_loads(load, placement: Placement, num_gpus: int) -> np.ndarray:
    """Load per GPU under a placement (each expert's load split evenly over its replicas): float[num_gpus] (per layer if 2-D)."""
    w = np.asarray(load, dtype=np.float64)
    p2l = np.asarray(placement.phy2log)
    cnt = np.asarray(placement.logcnt)
    per_slot = np.take_along_axis(w / cnt, p2l, axis=-1)
    return per_slot.reshape(*per_slot.shape[:-1], num_gpus, -1).sum(-1)


def expert_counts(indices, num_experts: int, mask=None) -> np.ndarray:
    """Tokens routed to each expert in one batch of router choices.

    indices: int[..., top_k] expert ids; mask: optional bool over the leading dims (False: padding,
    not counted). Returns int64[num_experts].
    """
    idx = np.asarray(indices)
    if mask is not None:
        m = np.broadcast_to(np.asarray(mask, bool)[..., None], idx.shape)
        idx = idx[m]
    idx = idx.reshape(-1).astype(np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= num_experts):
        raise ValueError(f"expert ids must lie in [0, {num_experts})")
    return np.bincount(idx, minlength=num_experts).astype(np.int64)


class ExpertLoad:
    """Accumulates per-layer expert load while running: `add(layer, indices[, mask])`, then `counts`.

    counts: int64[num_layers, num_experts]. `reset()` starts a new window (e.g. after a rebalance).
    """

    def __init__(self, num_experts: int, num_layers: int = 1):
        self.num_experts = num_experts
        self.num_layers = num_layers
        self.counts = np.zeros((num_layers, num_experts), np.int64)

    def add(self, layer: int, indices, mask=None) -> None:
        self.counts[layer] += expert_counts(indices, self.num_experts, mask)

    def add_all(self, indices, mask=None) -> None:
        """indices: int[num_layers, ..., top_k], one slice per layer."""
        idx = np.asarray(indices)
        if idx.shape[0] != self.num_layers:
            raise ValueError(f"expected {self.num_layers} layers, got {idx.shape[0]}")
        for layer in range(self.num_layers):
            self.add(layer, idx[layer], mask)

    def add_counts(self, counts) -> None:
        """counts: int[num_layers, num_experts] router choices, e.g. `Generated.expert_counts`."""
        c = np.asarray(counts, np.int64)
        if c.shape != self.counts.shape:
            raise ValueError(f"expected counts of shape {self.counts.shape}, got {c.shape}")
        self.counts += c

    def reset(self) -> None:
        self.counts[:] = 0

    def rebalance(self, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> Placement:
        return rebalance(self.counts, num_replicas, num_groups, num_nodes, num_gpus)


def _placed_layers(params: dict) -> list[dict]:
    """The "experts" dicts of the MoE layers of the main stack (the drafter's `mtp` layers stay logical)."""
    return [lp["ffn"]["experts"] for lp in params["layers"] if "experts" in lp.get("ffn", {})]


def _layer_rows(placement: Placement, layers: int) -> list[tuple[np.ndarray, np.ndarray]]:
    p2l, cnt = np.asarray(placement.phy2log), np.asarray(placement.logcnt)
    if p2l.ndim == 1:
        return [(p2l, cnt)] * layers
    if p2l.shape[0] != layers:
        raise ValueError(f"placement has {p2l.shape[0]} layers, the model {layers} MoE layers")
    return list(zip(p2l, cnt, strict=True))


@jax.jit
def _take_experts(w, src: jax.Array):
    """Rows src of a stacked expert weight (plain or `QArray`): the physical slots' copies."""
    return jax.tree.map(lambda a: jnp.take(a, src, axis=0), w)


def apply_placement(
    params: dict,
    config: ModelConfig,
    placement: Placement | None,
    mesh: Mesh | None = None,
    rules: ShardingRules | None = None,
) -> dict:
    """Relay the routed experts of every MoE layer by an EPLB placement; the model's outputs do not change.

    params: the model's weights, logical ([e, ...] experts) or already placed by an earlier call;
    placement: 1-D (one for every layer) or per layer (`rebalance*` on a [layers, e] load), or None
    to return to the logical layout. mesh / rules (default `DEFAULT_RULES`): where the physical
    experts go (on "ep"; slot s on ep device s // (num_physical / ep), as `rebalance` assumes).

    Each placed layer's "experts" holds w1, w2, w3 as [num_physical, ...] (slot s = logical expert
    phy2log[s]; quantized weights included), "log2phy" int32[e, num_physical - e + 1] (-1 padded) and
    "logcnt" int32[e]; `moe.to_physical` sends token t's choice of x to replica t % logcnt[x]. The
    map's width depends only on the slot count, so a new placement with as many slots swaps in
    between steps without recompiling. Returns new params (the other weights are shared, not copied).
    """
    rules = DEFAULT_RULES if rules is None else rules
    layers = _placed_layers(params)
    e = config.n_routed_experts
    rows = [None] * len(layers) if placement is None else _layer_rows(placement, len(layers))
    w13 = ("experts", "expert_mlp", "embed")
    axes = {"w1": w13, "w2": ("experts", "embed", "expert_mlp"), "w3": w13}

    def put(x, spec_axes, name, indivisible="error"):
        if mesh is None:
            return x
        spec = spec_for(x.shape, spec_axes, mesh, rules, indivisible, name)
        return jax.device_put(x, NamedSharding(mesh, spec))

    def put_weight(w, name, label):
        if not isinstance(w, QArray):
            return put(w, axes[name], label)
        # Block scales follow where their smaller dims divide, as in `shard_params`.
        scale = put(w.scale, axes[name], label + ".scale", "replicate")
        return dataclasses.replace(w, values=put(w.values, axes[name], label), scale=scale)

    out_layers = []
    for i, (ex, row) in enumerate(zip(layers, rows, strict=True)):
        # Slot holding each logical expert now (the first replica if already placed).
        now = np.asarray(ex["log2phy"])[:, 0] if "log2phy" in ex else np.arange(e)
        if row is None:
            src, new = now, {}
        else:
            p2l, cnt = row
            ok = p2l.min() >= 0 and p2l.max() < e and cnt.shape == (e,) and cnt.min() >= 1
            if not ok or np.any(np.bincount(p2l, minlength=e) != cnt):
                raise ValueError(
                    f"layer {i}: the placement does not give every one of the {e} experts a slot"
                )
            width = p2l.shape[0] - e + 1
            new = {
                "log2phy": put(jnp.asarray(_log2phy(p2l, cnt, width), jnp.int32), (None, None), "log2phy"),
                "logcnt": put(jnp.asarray(cnt, jnp.int32), (None,), "logcnt"),
            }
            src = now[p2l]
        src = jnp.asarray(src, jnp.int32)
        placed = {}
        for name in ("w1", "w2", "w3"):
            w = _take_experts(ex[name], src)
            placed[name] = put_weight(w, name, f"layer {i} {name}")
        out_layers.append(
            {**{k: v for k, v in ex.items() if k not in ("log2phy", "logcnt")}, **placed, **new}
        )

    it = iter(out_layers)
    new_params = dict(params)
    new_params["layers"] = [
        {**lp, "ffn": {**lp["ffn"], "experts": next(it)}} if "experts" in lp.get("ffn", {}) else lp
        for lp in params["layers"]
    ]
    return new_params


__all__ = [
    "ExpertLoad",
    "Placement",
    "apply_placement",
    "expert_counts",
    "gpu_loads",
    "pack",
    "rebalance",
    "rebalance_global",
    "rebalance_hierarchical",
    "replicate",
]
