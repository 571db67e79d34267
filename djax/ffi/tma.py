"""Launches cubins whose parameters include TMA descriptors (TileLang's Hopper kernels) on XLA's stream.

`djax/ffi/csrc/tma_launch.cc` encodes each `CUtensorMap` per call with cuTensorMapEncodeTiled from the buffer
addresses XLA passes and launches the cubin with the descriptors by value (see that file for the plan format).
Here: the plan, read from TileLang's lowered host module (`tma_descriptor_args`, the arguments TileLang's own
host wrapper hands to cuTensorMapEncodeTiled) and the device kernel's parameter list; loading; launching.

Why this route rather than compiling TileLang's generated host wrapper: the wrapper launches through the CUDA
runtime (`<<<>>>` / cudaLaunchKernelEx with its own registered fatbin, cudaFuncSetAttribute on every call and
a `TILELANG_CHECK_LAST_ERROR`), and its source format changes between TileLang releases; the plan is a short list
of integers checked here on the host and in C++ against the buffer sizes XLA passes, and the launch path is the
same driver-API one as `cubin_launch.cc`.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

from djax.ffi import cubin
from djax.ffi.build import library

POINTER, TENSOR_MAP = 0, 1


@dataclass(frozen=True)
class TensorMap:
    """The arguments of one cuTensorMapEncodeTiled call, except the address: that of buffer `buffer`.
    dims / box / element_strides are innermost first; strides in bytes, strides[0] the element size."""

    buffer: int
    dtype: int  # CUtensorMapDataType
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    element_strides: tuple[int, ...]
    interleave: int
    swizzle: int
    l2_promotion: int
    oob_fill: int

    @property
    def rank(self) -> int:
        return len(self.dims)

    def words(self) -> list[int]:
        return [
            TENSOR_MAP,
            self.buffer,
            self.dtype,
            self.rank,
            *self.dims,
            *self.strides,
            *self.box,
            *self.element_strides,
            self.interleave,
            self.swizzle,
            self.l2_promotion,
            self.oob_fill,
        ]


@dataclass(frozen=True)
class TmaKernel:
    """A compiled kernel and how to launch it. `params` describes each kernel parameter in order: an int (the
    index of the operand, or result after the operands, whose device pointer it is) or a TensorMap."""

    key: str
    name: str
    binary: bytes
    grid: tuple[int, int, int]
    threads: int
    shared_bytes: int
    params: tuple[int | TensorMap, ...]

    @classmethod
    def from_launch(cls, key: str, binary: bytes, launch: dict) -> TmaKernel:
        """From a lowering's launch description (name, grid, threads, shared_bytes, params)."""
        fields = ("name", "grid", "threads", "shared_bytes", "params")
        name, grid, threads, shared, params = (launch[f] for f in fields)
        return cls(key, name, binary, grid, threads, shared, params)

    @property
    def plan(self) -> np.ndarray:
        words: list[int] = []
        for p in self.params:
            words += p.words() if isinstance(p, TensorMap) else [POINTER, p]
        return np.asarray(words, np.int64)


def _int(x) -> int:
    try:
        return int(x)
    except TypeError:
        raise NotImplementedError(f"TMA descriptor argument {x} is not a constant (dynamic shapes)") from None


def params_from_tilelang(device_fn, host_fn, buffers: Sequence[str]) -> tuple[int | TensorMap, ...]:
    """Kernel parameters of a lowered TileLang kernel: `device_fn` from the artifact's device module, `host_fn`
    the host function (it holds `tma_descriptor_args`), `buffers` the buffer names in FFI order (operands, then
    results). Raises NotImplementedError for anything the launcher cannot pass (scalars, im2col maps)."""
    index = {name: i for i, name in enumerate(buffers)}
    descs = {}
    for var, args in (host_fn.attrs.get("tma_descriptor_args") or {}).items():
        kind, _, dtype, rank, address, *rest = args
        if str(kind.value) != "__tvm_tensormap_create_tiled":
            raise NotImplementedError(f"{var.name}: only tiled tensor maps are supported, got {kind.value}")
        rank = _int(rank)
        if len(rest) != 4 * rank + 4:
            raise NotImplementedError(f"{var.name}: {len(rest)} encode arguments for rank {rank}")
        if address.name not in index:
            raise NotImplementedError(f"{var.name} describes {address.name}, not one of {tuple(buffers)}")
        v = [_int(x) for x in rest]
        descs[var.name] = TensorMap(
            buffer=index[address.name],
            dtype=_int(dtype),
            dims=tuple(v[:rank]),
            strides=tuple(v[rank : 2 * rank]),
            box=tuple(v[2 * rank : 3 * rank]),
            element_strides=tuple(v[3 * rank : 4 * rank]),
            interleave=v[4 * rank],
            swizzle=v[4 * rank + 1],
            l2_promotion=v[4 * rank + 2],
            oob_fill=v[4 * rank + 3],
        )
    params: list[int | TensorMap] = []
    for p in device_fn.params:
        if p.name in descs:
            params.append(descs[p.name])
        elif p.name in index and str(p.dtype) == "handle":
            params.append(index[p.name])
        else:
            raise NotImplementedError(
                f"kernel parameter {p.name} ({p.dtype}) is neither a buffer nor a descriptor"
            )
    return tuple(params)


@functools.cache
def _lib():
    lib = library("tma_launch", cuda=True)
    lib.djax_tma_load_cubin.argtypes = cubin.LOADER_ARGTYPES
    lib.djax_tma_check_plan.argtypes = [
        ctypes.POINTER(ctypes.c_int64),
        ctypes.c_int64,
        ctypes.POINTER(ctypes.c_int64),
        ctypes.c_int64,
        ctypes.c_char_p,
        ctypes.c_int,
    ]
    return lib


@functools.cache
def _register() -> None:
    jax.ffi.register_ffi_target("djax_tma_launch", jax.ffi.pycapsule(_lib().DjaxTmaLaunch), platform="CUDA")


def check(kernel: TmaKernel, buffer_bytes: Sequence[int]) -> int:
    """Runs the C++ handler's plan parser and descriptor checks (no GPU) over buffers of the given sizes in
    bytes; returns the number of kernel parameters. Raises ValueError with the handler's message."""
    plan = kernel.plan
    sizes = np.asarray(buffer_bytes, np.int64)
    err = ctypes.create_string_buffer(512)
    p64 = ctypes.POINTER(ctypes.c_int64)
    n = _lib().djax_tma_check_plan(
        plan.ctypes.data_as(p64), plan.size, sizes.ctypes.data_as(p64), sizes.size, err, len(err)
    )
    if n < 0:
        raise ValueError(err.value.decode())
    return n


def load(kernel: TmaKernel) -> None:
    """Loads the cubin into every local GPU's primary context (host work, done once at trace time)."""
    cubin.load_on_devices(_lib().djax_tma_load_cubin, kernel)


def launch(kernel: TmaKernel, args: list, out_types):
    """Enqueues `kernel` on XLA's stream over `args` and fresh results (`out_types`: one ShapeDtypeStruct or a
    list), building its tensor maps from their addresses."""
    _register()
    load(kernel)
    outs = out_types if isinstance(out_types, (list, tuple)) else [out_types]
    nbytes = [int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in [*args, *outs]]
    check(kernel, nbytes)  # the same checks the handler makes, at trace time, with a Python traceback
    call = jax.ffi.ffi_call("djax_tma_launch", out_types)
    attrs = cubin.launch_attrs(kernel.key, kernel.grid, kernel.threads, kernel.shared_bytes)
    return call(*args, **attrs, plan=kernel.plan)
