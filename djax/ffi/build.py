"""Builds djax/ffi/csrc/<name>.cc into a shared library on first use, cached by a hash of source and headers."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

CSRC = Path(__file__).parent / "csrc"


def cache_dir() -> Path:
    root = os.environ.get("DJAX_FFI_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "djax", "ffi")
    return Path(root)


def cuda_include() -> str | None:
    """CUDA's include folder (for cuda.h), from $CUDA_HOME or the usual places; None when absent."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda.h").exists():
            return str(Path(root) / "include")
    nvcc = shutil.which("nvcc")
    if nvcc and (Path(nvcc).parent.parent / "include" / "cuda.h").exists():
        return str(Path(nvcc).parent.parent / "include")
    return None


@functools.cache
def library(name: str, cuda: bool = False) -> ctypes.CDLL:
    """Compiles (once per source/header version) and loads `csrc/<name>.cc`. Raises RuntimeError on failure."""
    src = CSRC / f"{name}.cc"
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or "c++"
    flags = ["-O2", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}", f"-I{CSRC}"]
    if cuda:
        inc = cuda_include()
        if inc is None:
            raise RuntimeError("cuda.h not found: set CUDA_HOME")
        flags.append(f"-I{inc}")
    libs = ["-ldl"] if cuda else []
    headers = b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))
    text = src.read_bytes() + headers + " ".join([cxx, *flags, jax.__version__]).encode()
    key = hashlib.sha256(text).hexdigest()[:16]
    out = cache_dir() / f"lib{name}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            part = Path(tmp) / out.name
            run = subprocess.run(
                [cxx, *flags, str(src), "-o", str(part), *libs], capture_output=True, text=True
            )
            if run.returncode:
                raise RuntimeError(f"building {src.name} failed:\n{run.stderr[-4000:]}")
            os.replace(part, out)  # atomic: concurrent builders agree on one file
    return ctypes.CDLL(str(out))
