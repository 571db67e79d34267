"""Memory plans for machines that are not here: per-device bytes of the weights and of the decoder state.

Everything comes from abstract shapes (the parameter declarations, `param_shardings` on an
`AbstractMesh`, and `jax.eval_shape` of the model's `init_state`), so the full V4-Flash and V4.1-Flash
plan on a laptop without allocating a byte.

Layout (DESIGN.md section 3): a mesh dp x ep over `num_devices`; expert weights sharded over "ep"
(and whatever else the rules say), every other weight replicated; requests and their decoder state
sharded over "dp" (each dp shard holds batch / dp rows, replicated over "ep"). Bytes are in the
config's declared dtypes (bf16 for the presets unless `config.replace(dtype=...)`), except routed
experts of an `expert_dtype="fp4"` config (V4.1-Flash), counted packed as `load_checkpoint(...,
keep_quantized=True)` holds them.
"""

from __future__ import annotations

import jax
import numpy as np

from djax.config import ModelConfig
from djax.fp4 import stored_nbytes
from djax.params import _dtype, declare, flatten_names, is_param
from djax.sharding import DEFAULT_RULES, ShardingRules, abstract_mesh, param_shardings

GiB = 1024**3


def _shard_factor(spec, mesh_shape: dict[str, int]) -> int:
    n = 1
    for entry in spec:
        if entry is None:
            continue
        for axis in (entry,) if isinstance(entry, str) else entry:
            n *= mesh_shape.get(axis, 1)
    return n


def weight_bytes(
    config: ModelConfig, dp: int, ep: int, rules: ShardingRules = DEFAULT_RULES
) -> dict[str, int]:
    """Weight bytes: {"total", "per_device", "experts_per_device", "other_per_device"}, from abstract shapes only."""
    mesh = abstract_mesh(dp=dp, ep=ep)
    shardings = flatten_names(param_shardings(config, mesh, rules))
    decl = flatten_names(jax.tree.map(lambda p: p, declare(config), is_leaf=is_param))
    sizes = dict(mesh.shape)
    total = experts = other = 0
    for name, p in decl.items():
        nbytes = stored_nbytes(name, p.shape, _dtype(p, config).itemsize, config.expert_dtype)
        per = nbytes // _shard_factor(shardings[name].spec, sizes)
        total += nbytes
        if "experts" in p.axes:
            experts += per
        else:
            other += per
    return {
        "total": total,
        "per_device": experts + other,
        "experts_per_device": experts,
        "other_per_device": other,
    }


def state_bytes(config: ModelConfig, batch: int, context: int) -> int:
    """Bytes of the decoder state for `batch` rows of `context` tokens (`jax.eval_shape`: nothing allocated)."""
    from djax.models import model_module

    shapes = jax.eval_shape(lambda: model_module(config).init_state(config, batch, context))
    return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes))


def plan(
    config: ModelConfig,
    num_devices: int,
    ep: int | None = None,
    dp: int | None = None,
    context: int = 65536,
    batch: int = 1,
    rules: ShardingRules = DEFAULT_RULES,
) -> dict:
    """Per-device bytes of weights and decoder state when `num_devices` serve `batch` requests of `context` tokens.

    DeepSeek's layout: attention data-parallel over dp groups and MoE expert-parallel over ep groups
    of the same devices (each of dp and ep divides num_devices; both default to num_devices). Expert
    weights are divided over ep (by the rules, on an abstract mesh), every other weight is
    replicated; the `batch` requests and their decoder state are divided over dp.
    """
    ep = num_devices if ep is None else ep
    dp = num_devices if dp is None else dp
    for k, v in (
        ("num_devices", num_devices),
        ("ep", ep),
        ("dp", dp),
        ("context", context),
        ("batch", batch),
    ):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{k} must be a positive int, got {v!r}")
    if num_devices % ep or num_devices % dp:
        raise ValueError(f"ep={ep} and dp={dp} must each divide num_devices={num_devices}")
    if batch % dp:
        raise ValueError(f"batch={batch} is not divisible by dp={dp}")
    w = weight_bytes(config, 1, ep, rules)
    per_shard = batch // dp
    s = state_bytes(config, per_shard, context)
    return {
        "model_type": config.model_type,
        "dtype": str(config.dtype),
        "num_devices": num_devices,
        "dp": dp,
        "ep": ep,
        "context": context,
        "batch": batch,
        "batch_per_device": per_shard,
        "weights_total_bytes": w["total"],
        "weights_per_device_bytes": w["per_device"],
        "expert_weights_per_device_bytes": w["experts_per_device"],
        "other_weights_per_device_bytes": w["other_per_device"],
        "state_per_device_bytes": s,
        "state_per_request_bytes": s // per_shard,
        "total_per_device_bytes": w["per_device"] + s,
    }


def format_table(rows: list[dict], names: list[str] | None = None) -> str:
    """A plain-text table of plans (GiB per device)."""
    names = names or [r["model_type"] for r in rows]
    head = (
        f"{'model':<22} {'dev':>4} {'dp':>3} {'ep':>3} {'context':>8} {'batch':>6} "
        f"{'experts':>9} {'other':>9} {'weights':>9} {'state':>9} {'total':>9}  (GiB per device)"
    )
    lines = [head, "-" * len(head)]
    for name, r in zip(names, rows, strict=True):

        def g(k: str, r=r) -> str:
            return f"{r[k] / GiB:9.2f}"

        lines.append(
            f"{name:<22} {r['num_devices']:>4} {r['dp']:>3} {r['ep']:>3} {r['context']:>8} {r['batch']:>6} "
            f"{g('expert_weights_per_device_bytes')} {g('other_weights_per_device_bytes')} "
            f"{g('weights_per_device_bytes')} {g('state_per_device_bytes')} {g('total_per_device_bytes')}"
        )
    return "\n".join(lines)


def standard_plans(
    context: int = 65536,
    batch: int = 64,
    presets=("deepseek-v4-flash", "deepseek-v4.1-flash"),
    devices=(8, 16),
):
    """(names, plans) for each preset at each device count, dp = ep = devices."""
    from djax.config import preset

    names, rows = [], []
    for name in presets:
        cfg = preset(name)
        for n in devices:
            names.append(name)
            rows.append(plan(cfg, n, ep=n, dp=n, context=context, batch=batch))
    return names, rows


__all__ = ["format_table", "plan", "standard_plans", "state_bytes", "weight_bytes"]
