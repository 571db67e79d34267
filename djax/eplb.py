"""Expert-parallel load balancing (EPLB), host side, in numpy.

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

`ExpertLoad` accumulates the counts from router choices while running; `expert_counts` turns one
batch of router indices into counts.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


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

    def reset(self) -> None:
        self.counts[:] = 0

    def rebalance(self, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> Placement:
        return rebalance(self.counts, num_replicas, num_groups, num_nodes, num_gpus)


__all__ = [
    "ExpertLoad",
    "Placement",
    "expert_counts",
    "gpu_loads",
    "pack",
    "rebalance",
    "rebalance_global",
    "rebalance_hierarchical",
    "replicate",
]
