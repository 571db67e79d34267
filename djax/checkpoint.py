"""Checkpoints: HF-format directories (config.json + *.safetensors, DeepSeek's tensor names) -> (config, params)."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm import tqdm

from djax.config import ModelConfig
from djax.models import model_module
from djax.params import Param, flatten_names, is_param, unflatten_names
from djax.quant import QArray
from djax.safetensors_io import SafetensorsFile

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])$")
_SCALE = re.compile(r"^(.*)\.(weight_scale_inv|scale)$")


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not match the model's declaration (names the tensor)."""


def _declared(config: ModelConfig, with_mtp: bool) -> dict:
    return model_module(config).declare(config, with_mtp=with_mtp)


def _dequant(values: np.ndarray, scale: np.ndarray, dtype) -> np.ndarray:
    *_, o, i = values.shape
    bo, bi = -(-o // scale.shape[-2]), -(-i // scale.shape[-1])
    s = np.repeat(np.repeat(scale.astype(np.float32), bo, axis=-2), bi, axis=-1)[..., :o, :i]
    return (values.astype(np.float32) * s).astype(dtype)


def load_checkpoint(
    path: str | Path,
    *,
    dtype: str | None = None,
    keep_quantized: bool = False,
    shardings=None,
    progress: bool = True,
) -> tuple[ModelConfig, dict]:
    """Read an HF-format checkpoint directory tensor by tensor.

    dtype overrides the config's compute dtype. FP8 weights with block scales (`weight_scale_inv`
    or `scale`) are dequantized, or kept as `QArray` when keep_quantized. shardings: an optional
    tree (same structure as the params) of `jax.sharding.Sharding` to place each tensor with.
    Raises CheckpointError naming any missing, unexpected or mis-shaped tensor. MTP tensors are
    optional: when the files hold none, the returned params have no "mtp" entry.
    """
    path = Path(path)
    config = ModelConfig.from_hf(path / "config.json")
    if dtype is not None:
        config = config.replace(dtype=dtype)
    module = model_module(config)
    files = [SafetensorsFile(f) for f in sorted(path.glob("*.safetensors"))]
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    where: dict[str, tuple[SafetensorsFile, str]] = {}
    scales: dict[str, tuple[SafetensorsFile, str]] = {}
    for f in files:
        for raw in f.keys():
            m = _SCALE.match(raw)
            if m and f.dtype(raw) in ("F32", "BF16", "F8_E8M0") and raw.endswith(("_scale_inv", ".scale")):
                target = module.canonical_name(m.group(1) + ".weight", config)
                if target is not None:
                    scales[_EXPERT.sub(r"\1.\2.\3", target)] = (f, raw)
                    continue
            name = module.canonical_name(raw, config)
            if name is not None:
                where[name] = (f, raw)
    with_mtp = any(n.startswith("mtp.") for n in where)
    decl = flatten_names(_declared(config, with_mtp), "")
    decl = {k: v for k, v in decl.items() if is_param(v)}

    def read(name: str, p: Param) -> np.ndarray | QArray:
        f, raw = where.pop(name)
        arr = f.get(raw)
        qscale = scales.pop(name, None)
        if arr.dtype == ml_dtypes.float8_e4m3fn:
            if qscale is None:
                raise CheckpointError(f"tensor {raw!r} is FP8 but has no scale tensor")
            s = qscale[0].get(qscale[1]).astype(np.float32)
            if keep_quantized:
                bo, bi = -(-arr.shape[-2] // s.shape[-2]), -(-arr.shape[-1] // s.shape[-1])
                return QArray(np.asarray(arr), s, (bo, bi))
            arr = _dequant(arr, s, np.float32)
        return arr

    flat_out: dict[str, object] = {}
    names = list(decl)
    for name in tqdm(names, desc="loading", disable=not progress, unit="tensor"):
        p = decl[name]
        m = re.match(r"^(.*\.experts)\.(w[123])$", name)
        if m:
            parts = []
            for e in range(p.shape[0]):
                key = f"{m.group(1)}.{e}.{m.group(2)}"
                if key not in where:
                    raise CheckpointError(f"missing tensor {key!r}")
                parts.append(read(key, Param(p.shape[1:], p.axes[1:], p.dtype)))
            if isinstance(parts[0], QArray):
                value = QArray(np.stack([q.values for q in parts]), np.stack([q.scale for q in parts]), parts[0].block)
            else:
                value = np.stack(parts)
        else:
            if name not in where:
                raise CheckpointError(f"missing tensor {name!r}")
            value = read(name, p)
        shape = value.shape
        if tuple(shape) != tuple(p.shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(shape)}, expected {tuple(p.shape)}")
        flat_out[name] = value
    if where:
        extra = sorted(raw for _, raw in where.values())
        raise CheckpointError(f"unexpected tensors in checkpoint: {extra[:10]}{' ...' if len(extra) > 10 else ''}")

    tree_decl = _declared(config, with_mtp)
    flat_shard = flatten_names(shardings) if shardings is not None else {}

    def place(name: str, p: Param):
        v = flat_out[name]
        dt = jnp.dtype(p.dtype if p.dtype is not None else config.dtype)
        s = flat_shard.get(name)
        if isinstance(v, QArray):
            return QArray(jax.device_put(v.values, s), jax.device_put(v.scale, s and None), v.block)
        return jax.device_put(np.asarray(v).astype(dt), s)

    params = unflatten_names({n: place(n, decl[n]) for n in decl}, tree_decl)
    return config, params
