"""Building TileLang programs: lowering to CUDA (or AscendC), keeping the lowering on disk, compiling the CUDA
to an sm_90a cubin with nvcc, and declaring a thread-block cluster in the lowered source. Shared by the FP8
GEMM, its decode program and the sparse decode attention; none of it needs a GPU.

The on-disk keys hold everything the output depends on: the arguments, TileLang's version and the text of
the modules that write the program (for a lowering), or the source, nvcc's version and the flags (for a cubin).
"""

import functools
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

ARCH = "sm_90a"  # wgmma needs the arch-specific target
# Kernels launched by `djax/ffi/csrc/cubin_launch.cc` take plain device pointers: no TMA descriptors, and no
# warp specialisation (it would come with TMA).
POINTER_ONLY = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}
HOPPER: dict = {}  # TileLang's defaults on Hopper: TMA lowering and warp specialisation on


def lower(program, target: dict, pass_config: dict):
    """TileLang's lowering of `program` for `target` (a TVM target dict) under `pass_config`."""
    import tilelang
    from tilelang import tvm

    tgt = tvm.target.Target(target)
    with tvm.transform.PassContext(config=pass_config), tgt:
        return tilelang.lower(program, target=tgt)


def pointer_kernel(art, want_params: tuple[str, ...]) -> tuple[str, dict]:
    """The CUDA source and launch description (name, grid, threads, shared_bytes, params) of a lowered TileLang
    program for the pointer-only launcher: one kernel, 1-D blocks, exactly `want_params` (device pointers in
    the launcher's order). Raises NotImplementedError for anything else."""
    fn, launch = one_kernel(art)
    params = tuple(p.name for p in fn.params)
    if params != want_params:  # a scalar, descriptor or reordered parameter would break the pointer-only ABI
        raise NotImplementedError(f"unexpected kernel parameters {params}, want {want_params}")
    return art.kernel_source, {**launch, "params": params}


def tma_kernel(art, buffers: tuple[str, ...]) -> tuple[str, dict]:
    """The CUDA source and launch description of a lowered TileLang program for the TMA launcher
    (`djax.ffi.tma`): as `pointer_kernel`, with params one entry per kernel parameter, the FFI index of the
    buffer it points into or the `TensorMap` describing it; `buffers` names the FFI operands, then results."""
    from djax.ffi.tma import params_from_tilelang

    fn, launch = one_kernel(art)
    (host_fn,) = art.host_mod.functions.values()
    return art.kernel_source, {**launch, "params": params_from_tilelang(fn, host_fn, buffers)}


def one_kernel(art) -> tuple[object, dict]:
    """The lowered program's one device function and its launch shape (name, grid, threads, shared_bytes), as
    the FFI launchers take it: 1-D blocks, no clusters. Raises NotImplementedError for anything else."""
    (gvar, fn), *rest = art.device_mod.functions.items()
    if rest:
        raise NotImplementedError("TileLang split the program into several kernels")
    ext = {str(t): int(v) for t, v in fn.attrs["thread_extent"].items()}
    if ext.get("threadIdx.y", 1) != 1 or ext.get("threadIdx.z", 1) != 1:
        raise NotImplementedError(f"the FFI launcher takes 1-D blocks, got {ext}")
    if "cluster_dims" in fn.attrs:
        raise NotImplementedError("thread block clusters are not launched by the FFI handlers")
    launch = dict(
        name=gvar.name_hint,
        grid=(ext.get("blockIdx.x", 1), ext.get("blockIdx.y", 1), ext.get("blockIdx.z", 1)),
        threads=ext["threadIdx.x"],
        shared_bytes=int(fn.attrs.get("dyn_shared_memory_buf", 0)),
    )
    return fn, launch


def lowered_on_disk(name: str, args: tuple, lowering, files: tuple[str, ...]) -> tuple[str, dict]:
    """`lowering(*args)` -> (CUDA source, launch description), kept on disk beside the cubins as JSON: lowering
    takes seconds per shape and tiling and depends only on `args`, TileLang's version and the text of
    `files` (the modules that write the program), all in the key. TensorMap parameters round-trip."""
    import dataclasses
    import importlib.metadata
    import json

    from djax.ffi.build import cache_dir
    from djax.ffi.tma import TensorMap

    text = "".join(Path(f).read_text() for f in files)
    version = importlib.metadata.version("tilelang")  # not `import tilelang`: that alone takes seconds
    key = hashlib.sha256(repr((args, version, text)).encode()).hexdigest()[:24]
    path = cache_dir().parent / "tilelang" / f"{name}-{key}.json"
    if path.exists():
        saved = json.loads(path.read_text())
        launch = saved["launch"]
        params = tuple(
            TensorMap(**{f: tuple(v) if isinstance(v, list) else v for f, v in p.items()})
            if isinstance(p, dict)
            else p
            for p in launch["params"]
        )
        return saved["source"], {**launch, "grid": tuple(launch["grid"]), "params": params}
    source, launch = lowering(*args)
    params = [dataclasses.asdict(p) if isinstance(p, TensorMap) else p for p in launch["params"]]
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(f".{os.getpid()}.part")
    part.write_text(json.dumps({"source": source, "launch": {**launch, "params": params}}))
    os.replace(part, path)  # atomic: a concurrent reader sees the whole file or none
    return source, launch


def _nvcc() -> str:
    from djax.kernels.dispatch import nvcc_path

    found = nvcc_path()
    if found is None:
        raise RuntimeError("nvcc not found: set CUDA_HOME")
    return found


@functools.cache
def _nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout


def nvcc_cubin(source: str, tilelang_headers: bool = True) -> bytes:
    """Compiles CUDA source (TileLang's, or with `tilelang_headers=False` a self-contained kernel) to an sm_90a
    cubin, cached on disk by source, compiler and TileLang version (its headers are the version's). TileLang
    itself is imported only to compile with its headers: that takes seconds."""
    import importlib.metadata

    from djax.ffi.build import cache_dir

    nvcc = _nvcc()
    flags = ["-cubin", f"-arch={ARCH}", "-O3", "-std=c++20", "-w"]
    headers = "tilelang " + importlib.metadata.version("tilelang") if tilelang_headers else "cuda"
    key = hashlib.sha256("\0".join([source, _nvcc_version(nvcc), headers, *flags]).encode()).hexdigest()[:24]
    out = cache_dir().parent / "tilelang" / f"kernel-{key}.cubin"
    if not out.exists():
        includes = []
        if tilelang_headers:
            from tilelang.env import CUTLASS_INCLUDE_DIR, TILELANG_TEMPLATE_PATH

            includes = [f"-I{TILELANG_TEMPLATE_PATH}", f"-I{CUTLASS_INCLUDE_DIR}"]
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            src = Path(tmp) / "kernel.cu"
            src.write_text(source)
            part = Path(tmp) / out.name
            run = subprocess.run(
                [nvcc, *flags, *includes, str(src), "-o", str(part)], capture_output=True, text=True
            )
            if run.returncode:
                raise RuntimeError(f"nvcc failed on the kernel's source:\n{run.stderr[-4000:]}")
            os.replace(part, out)
    return out.read_bytes()


def with_cluster(source: str, name: str, dims: tuple[int, int, int]) -> str:
    """Declares the kernel's thread-block cluster shape in its source (`__cluster_dims__`): a compile-time
    cluster needs no launch attribute, so the plain cuLaunchKernel of the FFI launcher runs it clustered.
    (TileLang's own cluster launch goes through cudaLaunchKernelEx instead.)"""
    head = 'extern "C" __global__ void __launch_bounds__('
    at = source.index(head)
    at = source.index(f" {name}(", at)
    if source.count(f" {name}(") != 2:  # the forward declaration and the definition
        raise NotImplementedError(f"unexpected declarations of {name} in the lowered source")
    return source[:at] + " __cluster_dims__({}, {}, {})".format(*dims) + source[at:]


# A shared-memory address of this CTA as the same address in a peer CTA of its cluster (for st.async, remote
# mbarrier arrives and ld.shared::cluster), from a 32-bit shared address or from a generic pointer into shared
# memory; device code that pushes to or reads from peers puts this ahead of its own.
PEER_ADDRESS = r"""
__device__ __forceinline__ uint32_t djax_peer(uint32_t local, int peer) {  // that address in a peer's memory
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(peer));
  return remote;
}

__device__ __forceinline__ uint32_t djax_peer(const void* local, int peer) {
  return djax_peer((uint32_t)__cvta_generic_to_shared(local), peer);
}
"""


def with_device_code(source: str, code: str) -> str:
    """The lowered source with `code` (CUDA device functions the program calls through `T.call_extern`) put
    ahead of the first kernel declaration, after TileLang's includes."""
    at = source.index('extern "C" __global__')
    return source[:at] + code + "\n" + source[at:]
