"""Run a test script on fake CPU devices in a fresh process: XLA reads its device count once, when jax
starts, so a test needing 4 or 8 devices cannot share the pytest process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_on_cpu_devices(
    script: str, devices: int, *args: str, stdin: str | None = None, timeout: int = 600
) -> str:
    """Run `python -c script args...` from the repository root with `devices` fake CPU devices; fail the
    test with the script's output if it fails; return its stdout. LLVM optimisation is off (half the
    compile time); every side of a comparison inside the script runs under the same flags."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    env["JAX_PLATFORMS"] = "cpu"
    run = subprocess.run(
        [sys.executable, "-c", script, *args],
        input=stdin,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if run.returncode != 0:
        pytest.fail(run.stdout[-3000:] + run.stderr[-6000:])
    return run.stdout
