"""Two processes on localhost joined by `jax.distributed` run one sharded forward equal to one device."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_forward_equals_one_device():
    from jax._src.lib import _jax

    if not hasattr(_jax, "make_gloo_tcp_collectives"):
        pytest.skip("this jaxlib has no gloo CPU collectives, so CPU devices cannot span processes")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    # CPU processes: without LLVM's optimisation passes, as `tests/cpu_devices.py` runs its subprocesses (both
    # sides of the comparison run in each process, under the same flags)
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
    port = _free_port()
    cmd = [sys.executable, "-m", "djax.multihost_check", "--coordinator", f"127.0.0.1:{port}"]
    cmd += ["--num-processes", "2", "--cpu-devices", "2", "--layers", "1", "--timeout", "120"]
    procs = [
        subprocess.Popen(
            [*cmd, "--process-id", str(i)],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"multi-process forward did not finish within {TIMEOUT_S} s")
    for i, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{out[-3000:]}"
        assert f"multihost ok process {i}/2 devices 4 mesh dp=1 ep=4" in out, out[-3000:]
