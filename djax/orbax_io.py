"""Params in JAX's own checkpoint format (orbax-checkpoint): save, and restore straight onto shardings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from djax.checkpoint import CheckpointError, _listing, _shardings_by_name
from djax.config import ModelConfig
from djax.models import model_module
from djax.params import Param, flatten_names, is_param, unflatten_names
from djax.quant import E8M0, QArray, scale_sharding

_QUANT_KEY = "djax_quant_blocks"  # custom metadata: tree name -> block of every QArray weight


def _weight_name(saved: str, blocks: dict) -> str:
    """The weight a saved array belongs to (a QArray is saved as `<name>.values` and `<name>.scale`)."""
    for part in (".values", ".scale"):
        if saved.endswith(part) and saved.removesuffix(part) in blocks:
            return saved.removesuffix(part)
    return saved


def save_params(params: Any, path: str | Path) -> None:
    """Write a params tree (plain arrays and `QArray` weights, any sharding) as an Orbax checkpoint at path.

    An existing checkpoint at path is replaced. Returns when the files are complete.
    """
    blocks = {n: list(w.block) for n, w in flatten_names(params).items() if isinstance(w, QArray)}
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(Path(path).absolute(), params, force=True, custom_metadata={_QUANT_KEY: blocks})


def _target(name: str, p: Param, saved: dict, blocks: dict, config: ModelConfig, sharding):
    """The abstract array (or QArray of them) to restore weight `name` into."""
    if name not in blocks:
        dtype = np.dtype(p.dtype if p.dtype is not None else config.dtype)
        return jax.ShapeDtypeStruct(tuple(saved[name].shape), dtype, sharding=sharding)
    values, scale = saved[name + ".values"], saved[name + ".scale"]
    # FP4 (uint8 values) and UE8M0 scales come back in their saved dtype: Orbax's cast from e8m0 is wrong.
    kept = values.dtype == np.uint8 or np.dtype(scale.dtype) == E8M0
    scale_dtype = scale.dtype if kept else jnp.float32
    return QArray(
        jax.ShapeDtypeStruct(tuple(values.shape), values.dtype, sharding=sharding),
        jax.ShapeDtypeStruct(
            tuple(scale.shape), scale_dtype, sharding=scale_sharding(sharding, tuple(scale.shape))
        ),
        tuple(blocks[name]),
    )


def restore_params(path: str | Path, config: ModelConfig, shardings: Any = None) -> dict:
    """Read an Orbax checkpoint written by `save_params` into the params tree `config` declares.

    shardings: None (default device), one `jax.sharding.Sharding` for all, or a tree like the params
    (`djax.sharding.param_shardings`); each device reads only its slices. Weights declared in the
    config dtype come back in `config.dtype`; `QArray` weights come back quantized (their scales
    sharded like the weight where the block dims divide). The "mtp" entry is restored when saved.
    Raises CheckpointError naming any missing, unexpected or mis-shaped weight.
    """
    path = Path(path).absolute()
    with ocp.StandardCheckpointer() as ckpt:
        meta = ckpt.metadata(path)
        saved = flatten_names(meta.item_metadata.tree)
        blocks = (meta.custom_metadata or {}).get(_QUANT_KEY, {})
        tree = model_module(config).declare(config, with_mtp=any(n.startswith("mtp.") for n in saved))
        decl = {n: p for n, p in flatten_names(tree).items() if is_param(p)}
        shard_of = _shardings_by_name(shardings, decl)
        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

        stored = {_weight_name(n, blocks) for n in saved}
        missing, unexpected = sorted(set(decl) - stored), sorted(stored - set(decl))
        problems = [
            _listing(w, ns)
            for w, ns in (("missing weights", missing), ("unexpected weights", unexpected))
            if ns
        ]
        if not missing:
            target = {
                n: _target(n, p, saved, blocks, config, shard_of[n] or default) for n, p in decl.items()
            }
            problems += [
                f"weight {n!r} has shape {tuple(t.shape)}, expected {p.shape}"
                for n, p in decl.items()
                if (t := target[n]).shape != p.shape
            ]
        if problems:
            raise CheckpointError(
                f"Orbax checkpoint {path} does not match the config:\n  " + "\n  ".join(problems)
            )
        return ckpt.restore(path, unflatten_names(target, tree))


__all__ = ["restore_params", "save_params"]
