"""Sharding as data: logical axis names -> mesh axes (`ShardingRules`), per-weight shardings, mesh helpers.

Every weight names its dimensions logically in its `Param` declaration ("experts", "embed", ...).
A `ShardingRules` maps each logical name to a mesh axis (`"dp"`, `"ep"`, `"tp"`), a tuple of mesh
axes, or None (replicated). From those two, `param_shardings` derives a `NamedSharding` for every
weight without touching any array, so the full 284B / 671B configs plan on a laptop.

Resolution of one tensor's dims against a concrete mesh:
- two dims of one tensor may never map to the same mesh axis (a `ValueError`, whatever the mesh);
- mesh axes absent from the mesh or of size 1 are dropped (so the default rules fit any mesh);
- a dim whose size is not divisible by its mesh axes' size is an error by default (it would
  otherwise be silently replicated: for 256 experts on ep=3 that means every device holding
  every expert); pass `indivisible="replicate"` to replicate such dims instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from djax.config import ModelConfig
from djax.params import Param, declare, is_param
from djax.quant import QArray

MESH_AXES = ("dp", "ep", "tp")
MeshAxes = str | tuple[str, ...] | None
_INDIVISIBLE = ("error", "replicate")


@dataclass(frozen=True)
class ShardingRules:
    """Logical axis name -> mesh axis name, tuple of names, or None (replicated). Frozen and hashable.

    Weights use vocab, embed, q_lora, o_lora, heads, mlp, experts, experts_r (the router's expert
    rows: replicated, every token scores every expert), expert_mlp; activations use batch and seq.
    Defaults: experts on "ep", batch on "dp", everything else replicated (attention data-parallel,
    MoE expert-parallel). `ShardingRules.tensor_parallel()` adds "tp" on heads and the MLP widths.
    """

    batch: MeshAxes = "dp"
    seq: MeshAxes = None
    vocab: MeshAxes = None
    embed: MeshAxes = None
    q_lora: MeshAxes = None
    o_lora: MeshAxes = None
    heads: MeshAxes = None
    mlp: MeshAxes = None
    experts: MeshAxes = "ep"
    experts_r: MeshAxes = None
    expert_mlp: MeshAxes = None

    @classmethod
    def tensor_parallel(cls, **overrides: MeshAxes) -> ShardingRules:
        """The defaults plus "tp" on attention heads, the dense/shared MLP width and each expert's width."""
        return cls(**{"heads": "tp", "mlp": "tp", "expert_mlp": "tp", **overrides})

    def replace(self, **overrides: MeshAxes) -> ShardingRules:
        return dataclasses.replace(self, **overrides)

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        """The mesh axes a logical name maps to, as a tuple (empty: replicated)."""
        if logical is None:
            return ()
        if logical not in _FIELDS:
            raise ValueError(f"unknown logical axis {logical!r}; ShardingRules knows {sorted(_FIELDS)}")
        value = getattr(self, logical)
        if value is None:
            return ()
        return (value,) if isinstance(value, str) else tuple(value)


_FIELDS = frozenset(f.name for f in dataclasses.fields(ShardingRules))
DEFAULT_RULES = ShardingRules()


def logical_to_spec(axes: Sequence[str | None], rules: ShardingRules = DEFAULT_RULES) -> PartitionSpec:
    """The PartitionSpec for a tensor whose dims are named `axes`, independent of any mesh.

    Raises ValueError when two dims land on one mesh axis (e.g. rules mapping both "heads" and
    "o_lora" to "tp" for wo_a), or when a name is unknown.
    """
    per_dim = [rules.mesh_axes(a) for a in axes]
    seen: dict[str, str | None] = {}
    for logical, mesh_axes in zip(axes, per_dim, strict=True):
        for m in mesh_axes:
            if m in seen:
                raise ValueError(
                    f"logical axes {seen[m]!r} and {logical!r} of one tensor (axes {tuple(axes)}) both map to "
                    f"mesh axis {m!r}; a mesh axis can shard at most one dimension"
                )
            seen[m] = logical
    return PartitionSpec(*(_spec_entry(m) for m in per_dim))


def _spec_entry(mesh_axes: tuple[str, ...]) -> MeshAxes:
    if not mesh_axes:
        return None
    return mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes


def spec_for(
    shape: Sequence[int],
    axes: Sequence[str | None],
    mesh: Mesh | AbstractMesh,
    rules: ShardingRules = DEFAULT_RULES,
    indivisible: str = "error",
    name: str = "tensor",
) -> PartitionSpec:
    """`logical_to_spec` fitted to a mesh and a shape: absent or size-1 mesh axes dropped, divisibility checked.

    indivisible: "error" (default) raises naming the tensor; "replicate" leaves such a dim unsharded.
    """
    if indivisible not in _INDIVISIBLE:
        raise ValueError(f"indivisible must be one of {_INDIVISIBLE}, got {indivisible!r}")
    if len(shape) != len(axes):
        raise ValueError(f"{name}: shape {tuple(shape)} and logical axes {tuple(axes)} differ in rank")
    spec = logical_to_spec(axes, rules)
    sizes = dict(mesh.shape)
    out = []
    for dim, logical, entry in zip(shape, axes, spec, strict=True):
        mesh_axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        kept = tuple(m for m in mesh_axes if sizes.get(m, 1) > 1)
        n = math.prod(sizes[m] for m in kept)
        if kept and dim % n:
            if indivisible == "error":
                raise ValueError(
                    f"{name}: dim {logical!r} of size {dim} (shape {tuple(shape)}) is not divisible by mesh "
                    f"axes {kept} of total size {n}; change the mesh or the rules, or pass indivisible='replicate'"
                )
            kept = ()
        out.append(_spec_entry(kept))
    return PartitionSpec(*out)


def _path_name(path) -> str:
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        else:
            parts.append(str(k))
    return ".".join(parts)


def param_shardings(
    config: ModelConfig,
    mesh: Mesh | AbstractMesh,
    rules: ShardingRules = DEFAULT_RULES,
    indivisible: str = "error",
) -> dict:
    """A `NamedSharding` for every declared weight (same tree as `abstract_params(config)`); allocates nothing.

    Works with an `AbstractMesh` to plan sizes for machines that are not here.
    """

    def one(path, p: Param) -> NamedSharding:
        return NamedSharding(mesh, spec_for(p.shape, p.axes, mesh, rules, indivisible, _path_name(path)))

    return jax.tree_util.tree_map_with_path(one, declare(config), is_leaf=is_param)


def shard_params(
    params: Any,
    config: ModelConfig,
    mesh: Mesh,
    rules: ShardingRules = DEFAULT_RULES,
    indivisible: str = "error",
) -> Any:
    """Place existing params on `mesh` by the rules (`jax.device_put`; quantized `QArray` weights included).

    A QArray's values shard like the weight; its block scales follow where their (smaller) dims divide.
    """

    def one(path, p: Param, w):
        name = _path_name(path)
        if not isinstance(w, QArray):
            return jax.device_put(
                w, NamedSharding(mesh, spec_for(p.shape, p.axes, mesh, rules, indivisible, name))
            )
        values = NamedSharding(mesh, spec_for(w.values.shape, p.axes, mesh, rules, indivisible, name))
        scale = NamedSharding(
            mesh, spec_for(w.scale.shape, p.axes, mesh, rules, "replicate", name + ".scale")
        )
        return dataclasses.replace(
            w, values=jax.device_put(w.values, values), scale=jax.device_put(w.scale, scale)
        )

    return jax.tree_util.tree_map_with_path(one, declare(config), params, is_leaf=is_param)


def _check_sizes(dp: int, ep: int, tp: int) -> tuple[int, int, int]:
    sizes = (dp, ep, tp)
    if any(not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"mesh sizes must be positive ints, got dp={dp}, ep={ep}, tp={tp}")
    return sizes


def make_mesh(dp: int = 1, ep: int = 1, tp: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A Mesh with axes ("dp", "ep", "tp") over the first dp * ep * tp of `devices` (default: jax.devices()).

    Axis types are Auto: shardings propagate through the model's plain jnp code (no sharding-in-types).
    """
    sizes = _check_sizes(dp, ep, tp)
    devices = list(jax.devices() if devices is None else devices)
    n = math.prod(sizes)
    if n > len(devices):
        raise ValueError(f"mesh dp={dp} x ep={ep} x tp={tp} needs {n} devices, only {len(devices)} available")
    return jax.make_mesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices[:n])


def abstract_mesh(dp: int = 1, ep: int = 1, tp: int = 1) -> AbstractMesh:
    """A device-free mesh of the same axes, for planning shardings and per-device bytes of absent machines."""
    return AbstractMesh(_check_sizes(dp, ep, tp), MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def constrain(
    x: jax.Array,
    mesh: Mesh | AbstractMesh | None,
    rules: ShardingRules,
    *logical_axes: str | None,
) -> jax.Array:
    """`with_sharding_constraint` of x to its logical axes (one per dim); identity when mesh is None.

    Dims not divisible by their mesh axes are an error, as for weights.
    """
    if mesh is None:
        return x
    spec = spec_for(x.shape, logical_axes, mesh, rules, name=f"activation {logical_axes}")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


__all__ = [
    "DEFAULT_RULES",
    "MESH_AXES",
    "ShardingRules",
    "abstract_mesh",
    "constrain",
    "logical_to_spec",
    "make_mesh",
    "param_shardings",
    "shard_params",
    "spec_for",
]
