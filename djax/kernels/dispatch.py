"""Picks an implementation for `impl="auto"`: the fast kernel on CUDA, the jnp reference elsewhere."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import threading
from pathlib import Path

import jax

# The SMs of the GPUs the default tilings were measured on (H100 SXM, H200): `sm_count` off CUDA
MEASURED_SMS = 132


# Triton's CPU interpreter patches its language module while a kernel runs, so two runs at once break each
# other ("_semantic argument must be provided outside of JIT functions"); XLA's CPU client may run the host
# callbacks of overlapping executions in parallel (a benchmark's calls over rotating inputs), so the
# "interpret" paths take turns (`interpreted`).
_INTERPRETER = threading.Lock()


def interpreted(host):
    """`host` (a host callback that runs Triton's interpreter) holding the interpreter's lock."""

    @functools.wraps(host)
    def run(*args):
        with _INTERPRETER:
            return host(*args)

    return run


# The compute capability every kernel is built for (Triton's cubins and TileLang's are sm_90: Hopper)
KERNEL_ARCH_MAJOR = 9


def on_cuda() -> bool:
    """True when JAX's default backend is a GPU the kernels run on: CUDA, compute capability 9.x (H100, H200).
    Elsewhere, an Ampere or a Blackwell GPU among them, "auto" takes the references, which XLA compiles for
    any GPU; the kernels' sm_90 cubins would not load there."""
    try:
        if jax.default_backend() != "gpu":
            return False
        capability = getattr(jax.devices()[0], "compute_capability", None)
    except RuntimeError:
        return False
    return capability is None or str(capability).split(".")[0] == str(KERNEL_ARCH_MAJOR)


def sm_count() -> int:
    """The SMs of the GPU the kernels run on, which the default grids are sized to fill (once, or twice where
    two programs share an SM): the CUDA device's own count (78 on an H20, 114 on an H100 PCIe), else
    MEASURED_SMS, so that grids traced off CUDA (tests, CPU meshes) are those of an H100 SXM or H200."""
    if not on_cuda():
        return MEASURED_SMS
    return int(getattr(jax.devices()[0], "core_count", None) or MEASURED_SMS)


def per_gpu(programs: int) -> int:
    """A program count chosen on MEASURED_SMS SMs (256: about two a SM), scaled to this GPU's SMs."""
    return round(programs * sm_count() / MEASURED_SMS)


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def has_tilelang() -> bool:
    """TileLang importable and nvcc found: every TileLang kernel here is compiled to a cubin by nvcc."""
    return importlib.util.find_spec("tilelang") is not None and nvcc_path() is not None


def nvcc_path() -> str | None:
    """nvcc under $CUDA_HOME, $CUDA_PATH or /usr/local/cuda, else on PATH; None if there is none."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").exists():
            return str(Path(root) / "bin" / "nvcc")
    return shutil.which("nvcc")


def resolve(impl: str, allowed: tuple[str, ...], fast: str | None = "triton") -> str:
    """Maps `impl` to one of `allowed`; "auto" is `fast` on CUDA with Triton present, else "ref"."""
    if impl == "auto":
        impl = fast if (fast is not None and on_cuda() and has_triton()) else "ref"
    if impl not in allowed:
        raise ValueError(f"impl must be 'auto' or one of {allowed}, got {impl!r}")
    return impl
