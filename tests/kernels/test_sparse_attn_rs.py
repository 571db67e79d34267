"""The register-operand sparse decode kernel (`sparse_decode_rs.cu`): its sm_90a cubin (every product a
wgmma from registers, nothing in local memory), clear errors for shapes it does not take, and (GPU) values
against sparse_decode_ref. The CPU tests need nvcc; the SASS check needs cuobjdump (Triton ships one)."""

import re
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import assert_close, sparse_decode_inputs

from djax.ffi import build
from djax.kernels import sparse_attn_rs
from djax.kernels.sparse_attn import sparse_decode
from djax.kernels.sparse_attn_ref import sparse_decode_ref

needs_nvcc = pytest.mark.skipif(
    build.cuda_include() is None or shutil.which("nvcc") is None, reason="needs nvcc"
)
BF16 = jnp.bfloat16


def _cuobjdump() -> str | None:
    try:
        import triton
    except ImportError:
        return shutil.which("cuobjdump")
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else shutil.which("cuobjdump")


@needs_nvcc
def test_cubin_keeps_wgmma_pipelined_and_registers_only(tmp_path):
    """At the benchmark's shape: 32 register-operand wgmmas a key block (16 for S^T, 16 for O^T), each
    group of two waited on with one still in flight (not serialised by ptxas), no local memory (spills),
    384 threads and the shared memory the launcher reserves under sm_90's limit."""
    kern = sparse_attn_rs.cuda_kernel(64, 128, 2048, 512, 512**-0.5)
    assert kern.name == "sparse_decode_rs" and kern.threads == 384 and kern.extra_null == 0
    assert kern.shared_bytes == sparse_attn_rs.shared_bytes(128, 512) <= 227 * 1024
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump")
    path = tmp_path / "k.cubin"
    path.write_bytes(kern.binary)
    sass = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    hgmma = re.findall(r"HGMMA\.64x64x16\.F32\.BF16 R\d+, R\d+, gdesc", sass)  # A from registers
    assert len(hgmma) == 32
    waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[01])", sass)
    assert waits.count("0x1") >= 12 and len(waits) < len(hgmma)  # serialised would be one wait per wgmma
    assert not re.search(r"\b(STL|LDL)\b", sass)


def test_shapes_it_does_not_take_raise():
    with pytest.raises(ValueError, match="head dim 512"):
        sparse_attn_rs.check_shapes(64, 256, 128, 2048, 512)
    with pytest.raises(ValueError, match="multiple of 64"):
        sparse_attn_rs.check_shapes(96, 512, 128, 2048, 512)
    with pytest.raises(ValueError, match="W, C, T >= 1"):
        sparse_attn_rs.check_shapes(64, 512, 128, 2048, 0)
    with pytest.raises(ValueError, match="shared memory"):  # the slot table of 6,000 picks does not fit
        sparse_attn_rs.check_shapes(64, 512, 128, 8192, 6000)
    sparse_attn_rs.check_shapes(128, 512, 129, 2048, 1024)  # the model's ring of 129, top-1024


def test_public_op_rejects_tilelang_options_and_f32_q():
    args = list(map(jnp.asarray, sparse_decode_inputs(3, 2, 64, 512, 8, 16, 8)))
    with pytest.raises(ValueError, match="dim_pair is a TileLang option"):
        sparse_decode(*args, scale=0.1, impl="rs", dim_pair=True)
    with pytest.raises(ValueError, match="merge_splits is a TileLang option"):
        sparse_decode(*args, scale=0.1, impl="rs", merge_splits="push")
    from djax.kernels.sparse_attn_rs import sparse_decode_rs

    with pytest.raises(ValueError, match="bf16 q"):
        sparse_decode_rs(args[0].astype(jnp.float32), *args[1:], scale=0.1)


def _check(args, scale):
    out = jax.jit(lambda *a: sparse_decode(*a, scale=scale, impl="rs"))(*args)
    ref = sparse_decode_ref(*[a.astype(jnp.float32) if a.dtype == BF16 else a for a in args], scale)
    assert out.dtype == BF16 and out.shape == args[0].shape
    assert_close(out.astype(jnp.float32), ref, 1e-2)
    assert np.all(np.asarray(out[-1], np.float32) == 0)  # nothing valid: all mass on the sink


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [
        (3, 128, 512, 100, 300, 77),  # two head groups, W and T not multiples of 64 (4 blocks, 2 a warpgroup)
        (2, 64, 512, 60, 300, 5),  # one block each way: one per warpgroup
        (4, 64, 512, 129, 1000, 512),  # the model's ring of 129: 11 blocks (6 and 5) round 3 stages
        (64, 64, 512, 128, 2048, 512),  # the benchmark's shape
        (8, 64, 512, 128, 2048, 512),
    ],
)
def test_rs_matches_ref(shape):
    _check(sparse_decode_inputs(sum(shape) % 1000, *shape), 512**-0.5)


@pytest.mark.gpu
def test_rs_large_logits():
    """Scores far above the sink (the sink's term underflows): the running max must carry the softmax."""
    args = list(sparse_decode_inputs(5, 4, 64, 512, 129, 1000, 512))
    args[0] = args[0] * 16
    _check(args, 512**-0.5)


def test_phase_stamps_find_every_anchor():
    """benchmarks/profile_rs_phases.py stamps a copy of the kernel's source at anchor lines: each must still
    be there once (else it raises), every point of its table gets a store, and the stamps reach the output."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import profile_rs_phases as P

    src = P.stamped_source(sparse_attn_rs.SOURCE.read_text())
    stamped = {int(i) for i in re.findall(r"STAMP1?\((\d+)", src)} | {
        int(i) for i in re.findall(r"PSTAMP\((\d+)", src)
    }
    for first, _ in P.POINTS.values():
        assert first in stamped
    assert "reinterpret_cast<unsigned*>(out)[k] = stamps[k] - stamps[63]" in src
