"""Test setup: float32 matmuls on CPU, GPU tests skipped without CUDA, XLA's CPU compiler without LLVM's
optimisation passes."""

import os
import shutil

import pytest

# The suite compiles hundreds of small programs and runs each a few times: on CPU, LLVM's optimisation passes are
# about a third of its time (the decode tests: 64 s with them, 46 without). Set before jax starts its backend;
# both sides of every comparison run under it (`tests/cpu_devices.py` sets the same for its subprocesses). Not
# where there is a GPU, whose XLA kernels it would slow.
flags = os.environ.get("XLA_FLAGS", "")
if shutil.which("nvidia-smi") is None and "xla_backend_optimization_level" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
