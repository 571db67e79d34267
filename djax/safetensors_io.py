"""Tensor-by-tensor safetensors reading and writing with every dtype DeepSeek ships (bf16, FP8, E8M0).

The `safetensors` package's numpy backend cannot represent FP8 or bf16, so files are read through
their documented layout (8-byte header length, JSON header, raw little-endian data) with
`ml_dtypes` supplying the narrow types; memory-mapped so only the tensor asked for is read.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


class SafetensorsFile:
    """Read-only, memory-mapped view of one .safetensors file.

    `keys()`, `shape(name)`, `dtype(name)` (safetensors spelling, e.g. "F8_E4M3") come from the
    header; `get(name)` returns a numpy view of the mapped bytes, so slicing it reads only the
    slice.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        self.metadata = header.pop("__metadata__", {})
        self.header = header
        self._base = 8 + n
        self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")

    def keys(self) -> list[str]:
        return list(self.header)

    def __contains__(self, name: str) -> bool:
        return name in self.header

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{self.path.name}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        raw = self._mmap[self._base + start : self._base + end]
        return np.frombuffer(raw, dtype=DTYPES[info["dtype"]]).reshape(info["shape"])


class Lazy:
    """A tensor made only when `save_file` writes its bytes (`np.asarray`); shape and dtype known ahead."""

    def __init__(self, shape: tuple[int, ...], dtype: Any, make: Callable[[], Any]):
        self.shape, self.dtype, self.make = tuple(shape), np.dtype(dtype), make

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self.make(), dtype=dtype)


def nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def save_file(tensors: Mapping[str, Any], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write arrays (anything with `.shape` / `.dtype` that `np.asarray` reads: numpy, jax, `Lazy`) as one file.

    Tensors are laid out in the mapping's order, each converted to numpy only when its bytes are
    written, so jax arrays (or lazy stand-ins) are fetched one at a time. Every dtype in DTYPES can
    be written (bf16 and FP8 included).
    """
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, a in tensors.items():
        dtype = np.dtype(a.dtype)
        if dtype not in NAMES:
            raise ValueError(f"tensor {name!r}: dtype {dtype} cannot be written to safetensors")
        size = nbytes(tuple(a.shape), dtype)
        header[name] = {
            "dtype": NAMES[dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, a in tensors.items():
            info = header[name]
            a = np.ascontiguousarray(np.asarray(a))
            if list(a.shape) != info["shape"] or NAMES.get(a.dtype) != info["dtype"]:
                raise ValueError(
                    f"tensor {name!r} gave {a.dtype}{list(a.shape)}, announced {info['dtype']}{info['shape']}"
                )
            f.write(a.reshape(-1).view(np.uint8).data)
