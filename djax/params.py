"""One declaration per weight (shape, dtype, logical axes, init); abstract shapes, init and shardings derive from it."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from djax.config import ModelConfig


@dataclass(frozen=True)
class Param:
    """A weight's declaration. `axes` names each dimension logically (None = never sharded).

    init: "normal" (std 0.02 / fan-in scaled), "ones", "zeros", "hash" (random expert ids in
    [0, high) for hash-routing tables), "uniform" (small random, for biases that must not be 0
    in tests).
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    dtype: Any = None  # None: the config's dtype
    init: str = "normal"
    high: int = 0

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"shape {self.shape} and axes {self.axes} differ in rank")


def linear_weight(o: int, i: int, ax_o: str | None, ax_i: str | None) -> dict:
    """A torch-layout [out, in] matrix under the key "weight", as DeepSeek's checkpoints store it."""
    return {"weight": Param((o, i), (ax_o, ax_i))}


def mlp_weights(d: int, f: int) -> dict:
    """A SwiGLU MLP of width f on d: w1 (gate) and w3 (up) [f, d], w2 (down) [d, f]."""
    return {
        "w1": linear_weight(f, d, "mlp", "embed"),
        "w2": linear_weight(d, f, "embed", "mlp"),
        "w3": linear_weight(f, d, "mlp", "embed"),
    }


def expert_weights(e: int, d: int, f: int) -> dict:
    """e routed experts' SwiGLU MLPs stacked on the "experts" axis: w1 and w3 [e, f, d], w2 [e, d, f]."""
    return {
        "w1": Param((e, f, d), ("experts", "expert_mlp", "embed")),
        "w2": Param((e, d, f), ("experts", "embed", "expert_mlp")),
        "w3": Param((e, f, d), ("experts", "expert_mlp", "embed")),
    }


def norm_weight(n: int) -> dict:
    """An RMS-norm scale (float32, initialised to ones) under the key "weight"."""
    return {"weight": Param((n,), (None,), "float32", "ones")}


def is_param(x) -> bool:
    return isinstance(x, Param)


def declare(config: ModelConfig) -> dict:
    """The model's parameter tree as `Param` leaves (nested dicts and lists, DeepSeek's names)."""
    from djax.models import model_module

    return model_module(config).declare(config)


def _dtype(p: Param, config: ModelConfig):
    return jnp.dtype(p.dtype if p.dtype is not None else config.dtype)


def abstract_params(config: ModelConfig, shardings: Any = None) -> dict:
    """`jax.ShapeDtypeStruct` for every weight, without allocating anything (works for the 671B V3)."""
    decl = declare(config)
    if shardings is None:
        return jax.tree.map(
            lambda p: jax.ShapeDtypeStruct(p.shape, _dtype(p, config)), decl, is_leaf=is_param
        )
    return jax.tree.map(
        lambda p, s: jax.ShapeDtypeStruct(p.shape, _dtype(p, config), sharding=s),
        decl,
        shardings,
        is_leaf=is_param,
    )


def _init_one(p: Param, key, config: ModelConfig):
    dtype = _dtype(p, config)
    if p.init == "ones":
        return jnp.ones(p.shape, dtype)
    if p.init == "zeros":
        return jnp.zeros(p.shape, dtype)
    if p.init == "hash":
        return jax.random.randint(key, p.shape, 0, p.high, dtype)
    if p.init == "uniform":
        return jax.random.uniform(key, p.shape, jnp.float32, -0.5, 0.5).astype(dtype)
    fan_in = p.shape[-1] if len(p.shape) > 1 else 1
    std = min(0.02, fan_in**-0.5) if len(p.shape) > 1 else 0.02
    return (std * jax.random.normal(key, p.shape, jnp.float32)).astype(dtype)


@functools.cache
def _init_fn(p: Param, config: ModelConfig, sharding: Any):
    # One compiled initializer per distinct declaration: the layers of a model repeat a few shapes.
    return jax.jit(lambda k: _init_one(p, k, config), out_shardings=sharding)


def init_params_host(config: ModelConfig, seed: int = 0) -> dict:
    """`init_params`'s distributions drawn by numpy on the host: numpy arrays, the same on every host for
    a seed, and no compiles (`init_params` compiles one initializer per distinct weight shape, which
    dominates small models on a CPU). `jax.device_put` or `shard_params` places them."""
    rng = np.random.default_rng(seed)

    def one(p: Param) -> np.ndarray:
        dtype = np.dtype(_dtype(p, config))
        if p.init in ("ones", "zeros"):
            return (np.ones if p.init == "ones" else np.zeros)(p.shape, dtype)
        if p.init == "hash":
            return rng.integers(0, p.high, p.shape).astype(dtype)
        if p.init == "uniform":
            return rng.uniform(-0.5, 0.5, p.shape).astype(dtype)
        std = min(0.02, p.shape[-1] ** -0.5) if len(p.shape) > 1 else 0.02
        return (std * rng.standard_normal(p.shape)).astype(dtype)

    return jax.tree.map(one, declare(config), is_leaf=is_param)


def init_params(config: ModelConfig, key: jax.Array, shardings: Any = None) -> dict:
    """Random weights from the declaration, each leaf from its own folded key (optionally placed with shardings)."""
    decl = declare(config)
    leaves, treedef = jax.tree.flatten(decl, is_leaf=is_param)
    shard_leaves = jax.tree.leaves(shardings) if shardings is not None else [None] * len(leaves)
    out = [
        _init_fn(p, config, s)(jax.random.fold_in(key, i))
        for i, (p, s) in enumerate(zip(leaves, shard_leaves, strict=True))
    ]
    return jax.tree.unflatten(treedef, out)


def param_axes(config: ModelConfig) -> dict:
    """The logical axes of every weight, as a tree of tuples."""
    return jax.tree.map(lambda p: p.axes, declare(config), is_leaf=is_param)


def flatten_names(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{'layers.0.attn.wq_a.weight': leaf, ...}: the dotted DeepSeek name of every leaf."""
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(flatten_names(v, f"{prefix}{k}."))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(flatten_names(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = tree
    return out


def unflatten_names(flat: dict[str, Any], like: Any, prefix: str = "") -> Any:
    """Inverse of `flatten_names` against a tree of the same structure."""
    if isinstance(like, dict):
        return {k: unflatten_names(flat, v, f"{prefix}{k}.") for k, v in like.items()}
    if isinstance(like, (list, tuple)):
        return type(like)(unflatten_names(flat, v, f"{prefix}{i}.") for i, v in enumerate(like))
    return flat[prefix[:-1]]


def count_bytes(config: ModelConfig) -> int:
    """Total bytes of the weights in the declared dtypes."""
    return sum(
        int(np.prod(p.shape)) * _dtype(p, config).itemsize
        for p in jax.tree.leaves(declare(config), is_leaf=is_param)
    )
