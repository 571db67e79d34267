"""Kernel tests: Triton runs in its interpreter (CPU, float32) on machines without a CUDA GPU, and the sm_90
cubins the tests compile ahead of a GPU come from one compiling child process per test process."""

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading

import pytest

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`

# Under the interpreter every @triton.jit function is an interpreter object, so `djax.ffi.cubin.compile_triton`
# compiles each cubin in a fresh child process without it (`_compile_in_child`): a Python start and imports of
# jax, djax and Triton, about 2 s of CPU, paid again for each of the ~45 cubins these tests compile.
# Here one child compiles them all, one after another, through the same `cubin._compile` with the same
# arguments and the caller's environment, and a failure raises what `_compile_in_child` raises (RuntimeError
# with the child's traceback). The modules below keep the per-kernel child: they test it (its error, and its
# importing a kernel's module by name through PYTHONPATH).
PER_KERNEL_CHILD = {"test_ffi", "test_bench_l2_read"}

_SERVER = r"""
import importlib, os, pickle, sys, traceback
results = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)  # whatever compiling prints goes to stderr, not into the results
from djax.ffi import cubin
while True:
    try:
        env, module, name, args = pickle.load(sys.stdin.buffer)
    except EOFError:
        break
    os.environ.clear()
    os.environ.update(env)
    try:
        fn = getattr(importlib.import_module(module), name)
        reply = (True, cubin._compile(fn, *args))
    except BaseException:
        reply = (False, traceback.format_exc())
    pickle.dump(reply, results)
    results.flush()
"""


class _CompilingChild:
    """The child process behind `compile` (started on first use, restarted if it dies)."""

    def __init__(self):
        self.proc = None
        self.log = None
        self.lock = threading.Lock()

    def _start(self):
        self.log = tempfile.TemporaryFile()
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
        )

    def compile(self, fn, ptrs, constexprs, num_warps, num_stages):
        py = fn.fn
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        request = (env, py.__module__, py.__name__, (ptrs, constexprs, num_warps, num_stages))
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            try:
                pickle.dump(request, self.proc.stdin)
                self.proc.stdin.flush()
                ok, reply = pickle.load(self.proc.stdout)
            except (EOFError, BrokenPipeError, pickle.UnpicklingError):
                self.proc.kill()
                self.proc.wait()
                self.log.seek(0)
                reply, ok = self.log.read().decode(errors="replace"), False
                self.proc = None
        if not ok:
            raise RuntimeError(f"compiling {py.__name__} failed:\n{reply[-4000:]}")
        return reply

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()  # the child's read ends: it exits
            self.proc.wait()
        if self.log is not None:
            self.log.close()


@pytest.fixture(scope="session")
def _compiling_child():
    child = _CompilingChild()
    yield child
    child.close()


@pytest.fixture(autouse=True)
def _one_compiling_child(request, monkeypatch):
    if request.module.__name__.rpartition(".")[2] in PER_KERNEL_CHILD:
        return
    try:
        from djax.ffi import cubin
    except ImportError:
        return
    monkeypatch.setattr(cubin, "_compile_in_child", request.getfixturevalue("_compiling_child").compile)
