"""Triton kernels compiled ahead to sm_90 cubins and launched through the CUDA FFI handler on XLA's stream."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pickle
import re
import subprocess
import sys
from dataclasses import dataclass

import jax
import numpy as np

from djax.ffi.build import library

TARGET_ARCH = 90  # Hopper (H100/H200); the cubin is built for exactly this compute capability
MAX_SHARED_BYTES = 227 * 1024  # an sm_90 block's opt-in shared memory limit

_TRITON_TYPES = {
    np.dtype("float32"): "fp32",
    np.dtype("int32"): "i32",
    np.dtype("int64"): "i64",
    np.dtype("uint64"): "u64",
    np.dtype("uint8"): "u8",
    np.dtype("float16"): "fp16",
    np.dtype(jax.numpy.bfloat16): "bf16",
    np.dtype(jax.numpy.float8_e4m3fn): "fp8e4nv",
}


@dataclass(frozen=True)
class Cubin:
    """One compiled kernel: its binary, entry name and launch resources."""

    key: str
    name: str
    binary: bytes
    threads: int
    shared_bytes: int
    extra_null: int  # trailing pointer parameters Triton appends (global and profile scratch)


def triton_type(dtype) -> str:
    return "*" + _TRITON_TYPES[np.dtype(dtype)]


@functools.cache
def _compile(
    fn, pointer_types: tuple[tuple[str, str], ...], constexprs: tuple, num_warps: int, num_stages: int
):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cx = dict(constexprs)
    sig = dict(pointer_types)
    sig.update({k: "constexpr" for k in cx})
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, _ in pointer_types}
    src = ASTSource(fn, sig, cx, attrs)
    k = triton.compile(
        src,
        target=GPUTarget("cuda", TARGET_ARCH, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )
    md = k.metadata
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        raise NotImplementedError(
            f"{k.name} needs Triton scratch memory, which the FFI launcher does not provide"
        )
    if md.shared > MAX_SHARED_BYTES:
        raise ValueError(
            f"{k.name} needs {md.shared} bytes of shared memory per block, more than sm_90's "
            f"{MAX_SHARED_BYTES}: use smaller tiles or fewer stages (or 2-byte operands)"
        )
    binary = k.asm["cubin"]
    key = hashlib.sha256(binary).hexdigest()[:24]
    entry = re.search(r"\.entry\s+\w+\s*\(([^)]*)\)", k.asm["ptx"])
    extra = (entry.group(1).count(".param") if entry else len(pointer_types)) - len(pointer_types)
    return Cubin(key, k.name, binary, 32 * md.num_warps, md.shared, extra)


def _compile_in_child(fn, ptrs, constexprs, num_warps, num_stages) -> Cubin:
    """Under TRITON_INTERPRET=1 every @triton.jit function (Triton's own library too) is an interpreter
    object that cannot be compiled, so a child process without the interpreter compiles the kernel."""
    py = fn.fn
    code = (
        "import importlib, pickle, sys\n"
        "from djax.ffi import cubin\n"
        f"fn = getattr(importlib.import_module({py.__module__!r}), {py.__name__!r})\n"
        f"k = cubin._compile(fn, {ptrs!r}, {constexprs!r}, {num_warps}, {num_stages})\n"
        "sys.stdout.buffer.write(pickle.dumps(k))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env)
    if run.returncode:
        raise RuntimeError(f"compiling {py.__name__} failed:\n{run.stderr.decode()[-4000:]}")
    return pickle.loads(run.stdout)


def compile_triton(
    fn, arg_names: list[str], dtypes: list, constexprs: dict, num_warps: int = 4, num_stages: int = 2
) -> Cubin:
    """Compiles `fn` for sm_90 with every pointer 16-byte aligned; `arg_names` are its pointer parameters in
    order (operands first, then results) and `dtypes` their element types. No GPU is needed."""
    ptrs = tuple((n, triton_type(d)) for n, d in zip(arg_names, dtypes, strict=True))
    cx = tuple(sorted(constexprs.items()))
    if hasattr(fn, "rewriter"):  # an interpreter object: TRITON_INTERPRET=1
        return _compile_in_child(fn, ptrs, cx, num_warps, num_stages)
    return _compile(fn, ptrs, cx, num_warps, num_stages)


# (key, cubin, entry name, device ordinal, dynamic shared bytes, error buffer, its length) -> 0 or an error code:
# the loader every launcher library exports (djax/ffi/csrc/cuda_driver.h's LoadCubin)
LOADER_ARGTYPES = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_int,
]


@functools.cache
def _lib():
    lib = library("cubin_launch", cuda=True)
    lib.djax_load_cubin.argtypes = LOADER_ARGTYPES
    jax.ffi.register_ffi_target("djax_cubin_launch", jax.ffi.pycapsule(lib.DjaxCubinLaunch), platform="CUDA")
    return lib


def load_on_devices(loader, kernel) -> None:
    """Loads `kernel` (key, binary, name, shared_bytes) into every local GPU's primary context through a
    launcher library's `loader` (host work, done once at trace time)."""
    err = ctypes.create_string_buffer(512)
    for dev in jax.local_devices(backend="gpu"):
        args = (kernel.key.encode(), kernel.binary, kernel.name.encode(), dev.local_hardware_id or 0)
        if loader(*args, kernel.shared_bytes, err, len(err)):
            raise RuntimeError(err.value.decode())


def load(kernel: Cubin) -> None:
    """Loads the cubin into every local GPU's primary context (host work, done once at trace time)."""
    load_on_devices(_lib().djax_load_cubin, kernel)


def launch(kernel: Cubin, grid: tuple[int, ...], args: list, out_types: list, aliases: dict | None = None):
    """Enqueues `kernel` on XLA's stream over `args` (device pointers, in order) and its results: fresh
    buffers, or for {operand position: result position} in `aliases` the operand's own buffer, which the
    kernel updates in place (it then gets that pointer twice)."""
    load(kernel)
    call = jax.ffi.ffi_call("djax_cubin_launch", out_types, input_output_aliases=aliases)
    attrs = launch_attrs(kernel.key, grid, kernel.threads, kernel.shared_bytes)
    return call(*args, **attrs, extra_null=np.int64(kernel.extra_null))


def launch_attrs(key: str, grid: tuple[int, ...], threads: int, shared_bytes: int) -> dict:
    """The FFI attributes both launch handlers share: the loaded kernel's key and the launch shape."""
    gx, gy, gz = (*grid, 1, 1)[:3]
    return dict(
        key=key,
        grid_x=np.int64(gx),
        grid_y=np.int64(gy),
        grid_z=np.int64(gz),
        threads=np.int64(threads),
        shared_bytes=np.int64(shared_bytes),
    )
