"""HF-format checkpoints (config.json + *.safetensors, DeepSeek's tensor names) <-> (ModelConfig, params).

On disk every routed expert is its own tensor (`layers.3.ffn.experts.5.w1.weight`); in the params
tree the experts of a layer are stacked on a leading axis (`layers.3.ffn.experts.w1`: [e, f, d]).
FP8 weights sit beside a block scale named `<name>.scale` (DeepSeek) or `<name>.weight_scale_inv`
(HF) that multiplies each block (128 x 128 unless config.json's `quantization_config` says
otherwise); the scale is float32, bf16 or e8m0. FP4 weights (V4.1's routed experts) are int8 / uint8
tensors of two e2m1 codes a byte beside a `.scale` with one factor per 32 inputs (UE8M0 as U8 or
F8_E8M0, or F32 / BF16).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from djax.config import ModelConfig
from djax.fp4 import GROUP as FP4_GROUP
from djax.models import model_module
from djax.params import Param, flatten_names, is_param, unflatten_names
from djax.quant import (
    E8M0,
    FP8,
    SCALE_FMTS,
    QArray,
    from_fp4,
    has_ue8m0_scales,
    quantize,
    scale_shape,
    scale_sharding,
)
from djax.safetensors_io import DTYPES, Lazy, SafetensorsFile, nbytes, save_file

INDEX = "model.safetensors.index.json"
DEFAULT_BLOCK = (128, 128)
_FP8 = ("F8_E4M3", "F8_E5M2")
_SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")
_FP4_SCALE_DTYPES = ("U8", "F8_E8M0", "F32", "BF16")
_SCALE_SUFFIXES = (".weight_scale_inv", ".scale")
_STACKED = re.compile(r"^(.*\.experts)\.(w[123])$")  # tree name of a layer's stacked experts
_MAX_LISTED = 10


class CheckpointError(ValueError):
    """A checkpoint that does not match the model's declaration; the message names each bad tensor."""


# ---- reading -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Tensor:
    """One tensor in the files and, when it is FP8, its block scale."""

    file: SafetensorsFile
    raw: str
    scale: tuple[SafetensorsFile, str] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.file.shape(self.raw)

    @property
    def quantized(self) -> bool:
        return self.file.dtype(self.raw) in _FP8

    @property
    def fp4(self) -> bool:
        """Two e2m1 codes a byte (int8 / uint8) beside a per-32 UE8M0 scale: V4.1's routed experts."""
        return self.file.dtype(self.raw) in ("I8", "U8") and self.scale is not None

    def array(self, scale: bool = False) -> np.ndarray:
        """A memory-mapped view (nothing is read until it is sliced or copied)."""
        f, raw = self.scale if scale else (self.file, self.raw)
        return f.get(raw)


@dataclass(frozen=True)
class _Source:
    """The bytes of one declared weight: one tensor, or per-expert tensors stacked on a new leading axis."""

    parts: tuple[_Tensor, ...]
    stacked: bool

    @property
    def quantized(self) -> bool:
        return self.parts[0].quantized

    @property
    def fp4(self) -> bool:
        return self.parts[0].fp4

    def shape(self, scale: bool = False) -> tuple[int, ...]:
        t = self.parts[0]
        one = t.scale[0].shape(t.scale[1]) if scale else t.shape
        return (len(self.parts), *one) if self.stacked else one

    def read(self, index: tuple = (), scale: bool = False, dtype=None) -> np.ndarray:
        """Copy out `index` (a tuple of slices, as `make_array_from_callback` passes) in `dtype`.

        Bytes are reinterpreted, not converted, between int8 and uint8 (packed FP4 codes) and from
        uint8 to float8_e8m0fnu (UE8M0 exponents); every other pair converts values, floats to
        float8_e8m0fnu only where each is a power of two.
        """
        index = tuple(index)
        name = (lambda t: t.scale[1]) if scale else (lambda t: t.raw)
        if not self.stacked:
            t = self.parts[0]
            return _copy(t.array(scale)[index], dtype, name(t))
        lead, rest = (index[0], index[1:]) if index else (slice(None), ())
        return np.stack([_copy(t.array(scale)[rest], dtype, name(t)) for t in self.parts[lead]])


def _copy(a: np.ndarray, dtype, name: str) -> np.ndarray:
    dtype = a.dtype if dtype is None else np.dtype(dtype)
    if a.itemsize == 1 and a.dtype in (np.int8, np.uint8) and dtype in (np.int8, np.uint8, E8M0):
        return np.array(a).view(dtype)
    out = np.array(a, dtype=dtype)
    if dtype == E8M0 and a.dtype != E8M0:  # the conversion rounds: float scales must be powers of two
        bad = out.astype(np.float32) != np.asarray(a, np.float32)
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise CheckpointError(
                f"scale {name!r} holds {float(np.asarray(a)[where])} at {where}, not a power of two, but "
                'config.json\'s quantization_config says "scale_fmt": "ue8m0"'
            )
    return out


def _disk_name(name: str) -> str:
    """DeepSeek's on-disk spelling of a canonical name (per-expert tensors carry `.weight`)."""
    return name + ".weight" if re.search(r"\.experts\.\d+\.w[123]$", name) else name


def _listing(what: str, names: list[str]) -> str:
    more = f" ... ({len(names)} in all)" if len(names) > _MAX_LISTED else ""
    return f"{what}: {', '.join(names[:_MAX_LISTED])}{more}"


def _open_files(path: Path) -> list[SafetensorsFile]:
    index = path / INDEX
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        absent = [n for n in names if not (path / n).exists()]
        if absent:
            raise CheckpointError(_listing(f"{INDEX} names files that are not in {path}", absent))
    else:
        names = sorted(p.name for p in path.glob("*.safetensors"))
    if not names:
        raise CheckpointError(f"no *.safetensors files in {path}")
    return [SafetensorsFile(path / n) for n in names]


def _index(files: list[SafetensorsFile], canonical: Callable[[str], str | None]) -> dict[str, _Tensor]:
    """canonical name -> tensor (with its scale paired), over every file; skipped tensors left out."""
    where: dict[str, SafetensorsFile] = {}
    for f in files:
        for raw in f.keys():
            if raw in where:
                raise CheckpointError(f"tensor {raw!r} is in both {where[raw].path.name} and {f.path.name}")
            where[raw] = f
    scale_of: dict[str, str] = {}
    for raw in where:
        for suffix in _SCALE_SUFFIXES:
            weight = raw.removesuffix(suffix) + ".weight"
            if raw.endswith(suffix) and weight in where and weight not in scale_of:
                scale_of[weight] = raw
    scales = set(scale_of.values())
    found: dict[str, _Tensor] = {}
    for raw, f in where.items():
        if raw in scales:
            continue
        name = canonical(raw)
        if name is None:
            continue
        if name in found:
            raise CheckpointError(f"tensors {found[name].raw!r} and {raw!r} both name the weight {name!r}")
        s = scale_of.get(raw)
        found[name] = _Tensor(f, raw, None if s is None else (where[s], s))
    return found


def _check(t: _Tensor, want: tuple[int, ...], block: tuple[int, int], p: Param) -> str | None:
    """What is wrong with tensor t as the weight declared as p (shape `want`), or None."""
    dtype = t.file.dtype(t.raw)
    if dtype not in DTYPES:
        return f"tensor {t.raw!r} has unsupported dtype {dtype}"
    if t.fp4:
        return _check_fp4(t, want)
    if t.shape != want:
        return f"tensor {t.raw!r} has shape {t.shape}, expected {want}"
    if not t.quantized:
        return None if t.scale is None else f"scale {t.scale[1]!r} sits beside {t.raw!r}, which is not FP8"
    if t.scale is None:
        return f"tensor {t.raw!r} is FP8 but has no scale (`.scale` or `.weight_scale_inv`) beside it"
    if len(want) != 2 or (p.dtype is not None and jnp.issubdtype(jnp.dtype(p.dtype), jnp.integer)):
        return f"tensor {t.raw!r} is FP8, which djax reads only for float matrices"
    sf, sname = t.scale
    expect = tuple(-(-n // b) for n, b in zip(want, block))
    if sf.dtype(sname) not in _SCALE_DTYPES:
        return f"scale {sname!r} has dtype {sf.dtype(sname)}; expected one of {_SCALE_DTYPES}"
    if sf.shape(sname) != expect:
        return f"scale {sname!r} has shape {sf.shape(sname)}, expected {expect} for {block} blocks of {want}"
    return None


def _check_fp4(t: _Tensor, want: tuple[int, ...]) -> str | None:
    if len(want) != 2 or want[-1] % FP4_GROUP:
        return f"tensor {t.raw!r} is FP4-packed, which djax reads only for matrices with inputs in groups of {FP4_GROUP}"
    packed = (want[0], want[1] // 2)
    if t.shape != packed:
        return f"FP4 tensor {t.raw!r} has shape {t.shape}, expected {packed} (two codes a byte) for {want}"
    sf, sname = t.scale
    expect = (want[0], want[1] // FP4_GROUP)
    if sf.dtype(sname) not in _FP4_SCALE_DTYPES:
        return f"FP4 scale {sname!r} has dtype {sf.dtype(sname)}; expected one of {_FP4_SCALE_DTYPES}"
    if sf.shape(sname) != expect:
        return f"FP4 scale {sname!r} has shape {sf.shape(sname)}, expected {expect}"
    return None


def _plan(found: dict[str, _Tensor], decl: dict[str, Param], block: tuple[int, int]) -> dict[str, _Source]:
    """Match every declared weight with its tensors; raise one CheckpointError listing every problem."""
    plan, missing, problems = {}, [], []
    for name, p in decl.items():
        m = _STACKED.match(name)
        if m and len(p.shape) == 3:
            keys = [f"{m[1]}.{e}.{m[2]}" for e in range(p.shape[0])]
            want, stacked = p.shape[1:], True
        else:
            keys, want, stacked = [name], p.shape, False
        parts = [found.pop(k, None) for k in keys]
        missing += [_disk_name(k) for k, t in zip(keys, parts) if t is None]
        problems += [msg for t in parts if t is not None and (msg := _check(t, tuple(want), block, p))]
        if all(t is not None for t in parts):
            if len({(t.quantized, t.fp4) for t in parts}) > 1:
                problems.append(f"experts of {name!r} mix quantized and unquantized tensors")
            plan[name] = _Source(tuple(parts), stacked)
    lines = []
    if missing:
        lines.append(_listing("missing tensors", missing))
    if found:
        lines.append(_listing("unexpected tensors", sorted(t.raw for t in found.values())))
    lines += problems[:_MAX_LISTED]
    if lines:
        raise CheckpointError("checkpoint does not match the model:\n  " + "\n  ".join(lines))
    return plan


def _put(src: _Source, dtype, sharding, scale: bool = False) -> jax.Array:
    """One array on device(s): the whole tensor, or each device's slice read by itself when sharded."""
    if sharding is None:
        return jax.device_put(src.read(scale=scale, dtype=dtype))
    shape = src.shape(scale)
    return jax.make_array_from_callback(shape, sharding, partial(src.read, scale=scale, dtype=dtype))


@partial(jax.jit, static_argnames="dtype")
def _dequantize(q: QArray, dtype) -> jax.Array:
    return q.dense(dtype)


def _scale_dtype(src: _Source, quant) -> np.dtype:
    """The dtype a quantized weight's scale loads in: UE8M0 (float8_e8m0fnu) where stored so (U8 exponent
    bytes, the same bits, for FP4) or, for FP8, where config.json says `"scale_fmt": "ue8m0"`; otherwise
    float32 for FP8 and the stored float dtype for FP4."""
    stored = src.parts[0].array(scale=True).dtype
    if stored == E8M0 or (src.fp4 and stored == np.uint8) or (not src.fp4 and quant.scale_fmt == "ue8m0"):
        return E8M0
    return stored if src.fp4 else np.dtype(np.float32)


def _load(src: _Source, p: Param, config: ModelConfig, quant, keep_quantized: bool, sharding):
    """One weight from its on-disk tensors: dense in its dtype, or with keep_quantized the QArray it is
    stored as (callers pass keep_quantized only for weights the model multiplies, `_stored_fp8`). FP8
    scales stored as F8_E8M0, or as floats under `"scale_fmt": "ue8m0"`, are kept UE8M0 (float8_e8m0fnu),
    which tells the model to quantize activations as DeepSeek does for them (`has_ue8m0_scales`)."""
    dtype = np.dtype(p.dtype if p.dtype is not None else config.dtype)
    if not src.quantized and not src.fp4:
        return _put(src, dtype, sharding)
    if src.fp4:
        # Packed [.., o, i / 2] and scale [.., o, i / 32] shard like the weight where their dims divide.
        values = _put(src, np.uint8, scale_sharding(sharding, src.shape()))
        scale_shard = scale_sharding(sharding, src.shape(scale=True))
        scale = _put(src, _scale_dtype(src, quant), scale_shard, scale=True)
        q = from_fp4(values, scale)
    else:
        values = _put(src, src.parts[0].array().dtype, sharding)
        scale_shard = scale_sharding(sharding, src.shape(scale=True))
        q = QArray(values, _put(src, _scale_dtype(src, quant), scale_shard, scale=True), quant.block)
    if keep_quantized and p.dtype is None:
        return q
    out = _dequantize(q, dtype)
    return out if sharding is None else jax.device_put(out, sharding)


def _shardings_by_name(shardings: Any, decl: dict[str, Param]) -> dict[str, Any]:
    """{weight name: Sharding or None} from None, one Sharding, or a tree like the params."""
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        return dict.fromkeys(decl, shardings)
    flat = flatten_names(shardings)
    absent = [n for n in decl if not isinstance(flat.get(n), jax.sharding.Sharding)]
    if absent:
        raise ValueError(_listing("shardings has no jax.sharding.Sharding for the weights", absent))
    return flat


@dataclass(frozen=True)
class _Quant:
    """config.json's `quantization_config`, the parts the loader uses."""

    block: tuple[int, int] = DEFAULT_BLOCK
    scale_fmt: str | None = None  # "ue8m0": every FP8 block scale is a power of two


def _read_config(path: Path, dtype: str | None) -> tuple[ModelConfig, _Quant]:
    file = path / "config.json"
    if not file.exists():
        raise CheckpointError(f"no config.json in {path}")
    raw = json.loads(file.read_text())
    config = ModelConfig.from_hf(raw)
    if dtype is not None:
        config = config.replace(dtype=dtype)
    quant = raw.get("text_config", raw).get("quantization_config") or raw.get("quantization_config") or {}
    fmt = quant.get("scale_fmt")
    if fmt not in SCALE_FMTS:
        raise CheckpointError(
            f"quantization_config.scale_fmt {fmt!r} is not supported (known: {[f for f in SCALE_FMTS if f]})"
        )
    return config, _Quant(tuple(quant.get("weight_block_size") or DEFAULT_BLOCK), fmt)


def load_checkpoint(
    path: str | Path,
    dtype: str | None = None,
    keep_quantized: bool = False,
    shardings: Any = None,
    progress: bool = True,
) -> tuple[ModelConfig, dict]:
    """Read an HF-format checkpoint directory, tensor by tensor, into (config, params).

    path: a folder with config.json and *.safetensors (or model.safetensors.index.json and the
    shards it names). Tensor names are DeepSeek's (`layers.0.attn.wq_a.weight`) or any spelling the
    model's `canonical_name` maps to them (HF transformers' `model.` prefix, ...).
    dtype: the compute dtype ("bfloat16", "float32"), overriding config.json's; weights declared
    float32 (norms, mHC, router biases) stay float32.
    keep_quantized: FP8 weights become `QArray` (e4m3 values + float32 block scales) and FP4
    weights (V4.1's routed experts) `QArray` of packed e2m1 codes + per-32 scales (UE8M0 as
    float8_e8m0fnu: 0.53 byte a value), which the model dequantizes on use; otherwise both are
    dequantized to the dtype while loading (the same math, so the model's results are the same).
    Embedding tables stored quantized (V4.1's Engram tables) are made dense either way: they are
    looked up by row, not multiplied.
    shardings: None (default device), one `jax.sharding.Sharding` for every weight, or a tree like
    the params (e.g. `djax.sharding.param_shardings(config, mesh)`); each device then reads only
    its own slice of each tensor. A kept-quantized weight's scale shards like the weight where
    the block dims divide.

    Headers are checked before any data is read: a missing, unexpected or mis-shaped tensor, or an
    FP8 tensor without a scale, raises CheckpointError naming it. MTP tensors are optional; when
    the files hold none, the params have no "mtp" entry. V4.1's Engram token map
    (`engram_token_map`) is optional too: DeepSeek derives it from the tokenizer, so without the
    tensor it is built from the folder's tokenizer.json.
    """
    path = Path(path)
    config, quant = _read_config(path, dtype)
    module = model_module(config)
    found = _index(_open_files(path), lambda raw: module.canonical_name(raw, config))
    with_mtp = any(n.startswith("mtp.") for n in found)
    tree = module.declare(config, with_mtp=with_mtp)
    decl = {k: v for k, v in flatten_names(tree).items() if is_param(v)}
    derived = {}
    if ENGRAM_MAP in decl and ENGRAM_MAP not in found:
        derived[ENGRAM_MAP] = _engram_map_from_tokenizer(path, config)
    plan = _plan(found, {k: v for k, v in decl.items() if k not in derived}, quant.block)

    shard_of = _shardings_by_name(shardings, decl)
    out = {}
    for name in tqdm(decl, desc="loading", unit="tensor", disable=not progress):
        if name in derived:
            out[name] = jax.device_put(derived[name], shard_of.get(name))
        else:
            # kept quantized: only the matrices the model multiplies (a table stored in FP8, such as V4.1's
            # Engram embeddings, is looked up by row, so it is made dense while loading)
            keep = keep_quantized and _stored_fp8(name, decl[name])
            out[name] = _load(plan[name], decl[name], config, quant, keep, shard_of.get(name))
    return config, unflatten_names(out, tree)


ENGRAM_MAP = "engram_token_map"


def _engram_map_from_tokenizer(path: Path, config: ModelConfig) -> np.ndarray:
    """V4.1's token -> compressed id map, from the checkpoint's tokenizer.json, checked against the config."""
    from tokenizers import Tokenizer

    from djax.models.engram import compressed_token_map

    file = path / "tokenizer.json"
    if not file.exists():
        raise CheckpointError(
            f"checkpoint does not match the model:\n  missing tensors: {ENGRAM_MAP!r}, and no tokenizer.json in "
            f"{path} to build it from"
        )
    token_map, count = compressed_token_map(Tokenizer.from_file(str(file)))
    if token_map.shape[0] != config.vocab_size or count != config.engram_compressed_vocab_size:
        raise CheckpointError(
            f"{ENGRAM_MAP} built from {file} maps {token_map.shape[0]} tokens to {count} ids; the config "
            f"says vocab_size {config.vocab_size}, engram_compressed_vocab_size {config.engram_compressed_vocab_size}"
        )
    return token_map


# ---- writing -----------------------------------------------------------------------------------------
def _tensors(
    name: str, w: Any, expert: int | None, quant: tuple[int, int] | None, scale_fmt: str | None = None
) -> dict[str, Lazy]:
    """The on-disk tensors of weight w (or of its expert `expert`): the weight, and its `.scale` if FP8
    (float32, or F8_E8M0 for UE8M0 scales; a plain weight is quantized with `scale_fmt`)."""
    shape = tuple(w.shape[1:] if expert is not None else w.shape)

    def get():
        return w if expert is None else w[expert]

    if not isinstance(w, QArray) and quant is None:
        return {name: Lazy(shape, w.dtype, get)}
    if not name.endswith(".weight"):
        raise CheckpointError(f"quantized weight {name!r} must be a `.weight` to name its `.scale`")
    scale_name = name.removesuffix(".weight") + ".scale"
    if isinstance(w, QArray) and w.is_fp4:
        return {
            name: Lazy((*shape[:-1], shape[-1] // 2), np.uint8, lambda: get().values),
            scale_name: Lazy((*shape[:-1], shape[-1] // FP4_GROUP), w.scale.dtype, lambda: get().scale),
        }
    if isinstance(w, QArray):
        sdtype = E8M0 if has_ue8m0_scales(w) else np.float32
        return {
            name: Lazy(shape, w.values.dtype, lambda: get().values),
            scale_name: Lazy(scale_shape(shape, w.block), sdtype, lambda: jnp.asarray(get().scale, sdtype)),
        }
    held: dict[str, QArray] = {}  # the values are written first; the scale right after frees it

    def values():
        held["q"] = quantize(np.asarray(get()), quant, scale_fmt)
        return held["q"].values

    sdtype = E8M0 if scale_fmt == "ue8m0" else np.float32
    return {
        name: Lazy(shape, np.dtype(FP8), values),
        scale_name: Lazy(scale_shape(shape, quant), sdtype, lambda: held.pop("q").scale),
    }


def _fp8_eligible(name: str, p: Param) -> bool:
    """The matrices DeepSeek ships in FP8: every projection, but not the embedding tables (the token
    embedding, V4.1's Engram tables: looked up by row, not multiplied), the head or the router."""
    return (
        p.dtype is None
        and name.endswith(".weight")
        and len(p.shape) == 2
        and name != "head.weight"
        and not name.endswith(("embed.weight", ".gate.weight"))
    )


def quantize_projections(
    params: Any,
    config: ModelConfig,
    block: tuple[int, int] = DEFAULT_BLOCK,
    experts: bool = True,
    scale_fmt: str | None = None,
    delete_originals: bool = False,
) -> Any:
    """params with every matrix DeepSeek ships in FP8 (the projections and, with `experts`, the stacked
    routed experts; not the embedding, head, router or float32-declared weights) as an FP8 QArray with `block`
    scales (power-of-two UE8M0 ones with scale_fmt "ue8m0", as V4's checkpoints), the way a checkpoint saved
    with fp8=True loads them. Leaves already quantized are kept.

    Device arrays are quantized one at a time, each in one compiled program, which needs no memory beyond
    the FP8 form it returns (op by op, several float32 copies of the weight would be live at once). With
    `delete_originals` each replaced device array is deleted as soon as its FP8 form is ready: a device that
    holds the bf16 model but not both it and the quantized one can still build the latter. The caller's
    `params` is unusable afterwards."""
    flat = flatten_names(params)
    tree = model_module(config).declare(config, with_mtp=any(n.startswith("mtp.") for n in flat))
    decl = {k: v for k, v in flatten_names(tree).items() if is_param(v)}
    out = {}
    for name, w in flat.items():
        p = decl.get(name)
        eligible = p is not None and not isinstance(w, QArray) and _stored_fp8(name, p)
        if not (eligible and (experts or not _per_expert(name, p))):
            out[name] = w
        elif isinstance(w, jax.Array):
            out[name] = jax.block_until_ready(_quantize_on_device(w, tuple(block), scale_fmt))
            if delete_originals:
                w.delete()
        else:
            out[name] = quantize(w, block, scale_fmt)
    return unflatten_names(out, params)


# One fused program per weight shape: quantizing eagerly holds several float32 copies of the weight at once.
_quantize_on_device = jax.jit(quantize, static_argnums=(1, 2))


def _per_expert(name: str, p: Param) -> bool:
    """Whether a tree weight is a layer's stacked routed experts, stored on disk one tensor per expert."""
    return _STACKED.match(name) is not None and len(p.shape) == 3


def _stored_fp8(name: str, p: Param) -> bool:
    """Whether a checkpoint saved with fp8=True holds this tree weight in FP8 (stacked experts: each one)."""
    if _per_expert(name, p):
        return _fp8_eligible(name + ".weight", Param(p.shape[1:], p.axes[1:], p.dtype))
    return _fp8_eligible(name, p)


def _disk_tensors(
    params: Any, config: ModelConfig, fp8: bool
) -> tuple[list[dict[str, Lazy]], set, str | None]:
    """Per weight (per expert), its on-disk tensors under DeepSeek's names; the quant blocks used; and the
    FP8 scales' format ("ue8m0" where the params' FP8 QArrays have UE8M0 scales)."""
    flat = flatten_names(params)
    tree = model_module(config).declare(config, with_mtp=any(n.startswith("mtp.") for n in flat))
    decl = {k: v for k, v in flatten_names(tree).items() if is_param(v)}
    missing, unexpected = sorted(set(decl) - set(flat)), sorted(set(flat) - set(decl))
    if missing or unexpected:
        lines = [
            _listing(what, names)
            for what, names in (("missing weights", missing), ("unexpected weights", unexpected))
            if names
        ]
        raise CheckpointError("params do not match the config:\n  " + "\n  ".join(lines))
    fp8_weights = [w for w in flat.values() if isinstance(w, QArray) and not w.is_fp4]
    blocks = {w.block for w in fp8_weights}
    qblock = next(iter(blocks)) if blocks else DEFAULT_BLOCK  # fp8 matches the params' own blocks
    formats = {has_ue8m0_scales(w) for w in fp8_weights}
    if len(formats) > 1:
        raise CheckpointError(
            "some FP8 weights have UE8M0 scales and others float ones; config.json holds one scale_fmt"
        )
    scale_fmt = "ue8m0" if formats == {True} else None  # fp8 quantizes plain weights the same way
    units = []
    for name, p in decl.items():
        w = flat[name]
        if tuple(w.shape) != p.shape:
            raise CheckpointError(f"weight {name!r} has shape {tuple(w.shape)}, expected {p.shape}")
        m = _STACKED.match(name)
        per_expert = _per_expert(name, p)
        quant = qblock if fp8 and _stored_fp8(name, p) else None
        if quant is not None and not isinstance(w, QArray):
            blocks.add(quant)
        if per_expert:
            units += [
                _tensors(f"{m[1]}.{e}.{m[2]}.weight", w, e, quant, scale_fmt) for e in range(p.shape[0])
            ]
        else:
            units.append(_tensors(name, w, None, quant, scale_fmt))
    return units, blocks, scale_fmt


def save_pretrained(
    params: Any,
    config: ModelConfig,
    path: str | Path,
    fp8: bool = False,
    max_shard_bytes: int = 4 << 30,
) -> None:
    """Write params as an HF-format directory that `load_checkpoint` and HF transformers read.

    config.json is `config.to_hf()`; tensors carry DeepSeek's on-disk names (`embed.weight`,
    `layers.0.attn.wq_a.weight`, `layers.0.ffn.experts.3.w1.weight` one per expert, `hc_head_fn`,
    `head.weight`) in the params' dtypes, in one `model.safetensors` or, above max_shard_bytes,
    in `model-0000i-of-0000n.safetensors` files listed by `model.safetensors.index.json`.
    fp8: write every projection matrix (not the embedding, head or router) as FP8 e4m3 with
    float32 block scales (128 x 128, or the params' own QArray blocks) named `<name>.scale`;
    `QArray` weights are written that way whatever fp8 says, with config.json's
    `quantization_config` giving the block. FP8 `QArray`s with UE8M0 scales (`quantize(...,
    scale_fmt="ue8m0")`) are written with F8_E8M0 scales and `"scale_fmt": "ue8m0"` (plain weights
    that fp8 quantizes then take power-of-two scales too), as DeepSeek V4's checkpoints hold them.
    FP4 `QArray` weights are written packed (U8, two codes a
    byte) beside their per-32 `.scale` in its dtype (F8_E8M0 for UE8M0), and config.json then says
    `"expert_dtype": "fp4"`. Tensors are fetched from the device (and quantized) one
    at a time as they are written.
    """
    path = Path(path)
    units, blocks, scale_fmt = _disk_tensors(params, config, fp8)
    if len(blocks) > 1:
        raise CheckpointError(
            f"quantized weights use several block shapes {sorted(blocks)}; config.json holds one"
        )
    shards: list[dict[str, Lazy]] = [{}]
    size = 0
    for unit in units:
        unit_bytes = sum(nbytes(t.shape, t.dtype) for t in unit.values())
        if shards[-1] and size + unit_bytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1].update(unit)
        size += unit_bytes

    path.mkdir(parents=True, exist_ok=True)
    for old in [*path.glob("model*.safetensors"), path / INDEX]:
        old.unlink(missing_ok=True)
    hf = config.to_hf()
    if any(isinstance(w, QArray) and w.is_fp4 for w in flatten_names(params).values()):
        hf["expert_dtype"] = "fp4"  # DeepSeek's config.json field for FP4 routed experts
    if blocks:
        hf["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(blocks.pop()),
        }
        if scale_fmt is not None:
            hf["quantization_config"]["scale_fmt"] = scale_fmt
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    weight_map = {}
    for i, shard in enumerate(shards):
        file = (
            "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        save_file(shard, path / file)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(nbytes(t.shape, t.dtype) for shard in shards for t in shard.values())
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (path / INDEX).write_text(json.dumps(index, indent=2) + "\n")


__all__ = ["CheckpointError", "load_checkpoint", "save_pretrained"]
