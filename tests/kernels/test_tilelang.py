"""The TileLang FP8 block-scaled GEMM: CUDA lowering and sm_90a cubin, AscendC lowering, and (GPU) values vs the ref.

TileLang is not in the `test` extra (a 50 MB wheel pulling torch, z3 and TVM's FFI): these tests skip where it
is not installed. `pip install tilelang==0.1.15` (the version gpu-carry.sh packs) enables them.
"""

import importlib.util
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import assert_close

from djax.ffi import build
from djax.kernels.fp8_gemm_ref import fp8_gemm_ref, quantize_act, quantize_weight

needs_tilelang = pytest.mark.skipif(
    importlib.util.find_spec("tilelang") is None, reason="needs tilelang (pip install tilelang==0.1.15)"
)


def _ascend_backend_missing() -> str | None:
    """Mainline TileLang wheels (0.1.15 here) ship the Ascend target; a build without it says why not."""
    import tilelang
    from tilelang import tvm

    if not hasattr(tilelang, "ascend"):
        return f"tilelang {tilelang.__version__} has no tilelang.ascend package"
    if tvm.get_global_func("target.build.tilelang_ascend_without_compile", allow_missing=True) is None:
        return "tilelang was built without its Ascend codegen (USE_ASCEND=OFF)"
    return None


@needs_tilelang
def test_default_tiling_fits_shapes():
    from djax.kernels.fp8_gemm_tilelang import default_tiling

    decode = default_tiling(64, 4096, 7168)
    assert (decode.block_m, decode.threads) == (64, 128) and 128 % decode.block_n == 0
    prefill = default_tiling(4096, 4096, 4096)
    assert (prefill.block_m, prefill.block_n, prefill.threads) == (128, 128, 256)
    assert default_tiling(8, 128, 128).stages == 1  # never more stages than k blocks


@needs_tilelang
def test_cuda_lowering_gives_pointer_only_kernel():
    """No GPU needed: TileLang lowers to CUDA source whose entry takes exactly the five device pointers the FFI
    launcher passes (TMA off), with wgmma for Hopper and guards for a partial m tile."""
    from djax.kernels.fp8_gemm_tilelang import Tiling, lower_cuda

    src, launch = lower_cuda(40, 256, 384, Tiling(64, 64, 2))
    assert launch["name"] == "fp8_gemm_kernel"
    assert launch["params"] == ("A", "AS", "B", "BS", "C")
    assert launch["grid"] == (256 // 64, 1, 1) and launch["threads"] == 128
    assert launch["shared_bytes"] >= 2 * (64 + 64) * 128  # two stages of fp8 tiles
    assert 'extern "C" __global__' in src and "fp8_gemm_kernel(" in src
    assert "wgmma" in src and "CUtensorMap" not in src
    assert "cp_async_gs_conditional" in src  # rows past m are masked


@needs_tilelang
@pytest.mark.slow
@pytest.mark.skipif(build.cuda_include() is None or shutil.which("nvcc") is None, reason="needs nvcc")
def test_cubin_for_sm90_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("DJAX_FFI_CACHE", str(tmp_path / "ffi"))
    from djax.kernels.fp8_gemm_tilelang import Tiling, cuda_kernel

    k = cuda_kernel.__wrapped__(64, 128, 256, Tiling(64, 64, 2))
    assert k.cubin.binary[:4] == b"\x7fELF" and k.cubin.name.encode() in k.cubin.binary
    assert k.cubin.threads == 128 and k.cubin.extra_null == 0 and k.grid == (2, 1, 1)
    assert list((tmp_path / "tilelang").glob("fp8_gemm-*.cubin"))  # cached for the next process


@needs_tilelang
def test_ascend_lowering_emits_ascendc():
    """TileLang's "ascend" target lowers the program to AscendC source (bisheng, absent here, compiles it)."""
    if reason := _ascend_backend_missing():
        pytest.skip(reason)
    from djax.kernels.fp8_gemm_tilelang import ascend_source

    src = ascend_source(128, 128, 256)
    assert "tl_templates/ascend" in src
    assert 'extern "C" __global__' in src and "fp8_gemm_kernel(" in src
    assert "__gm__ fp8_e4_t* A" in src and "__gm__ bfloat16_t* C" in src
    assert "ASC_IS_AIC" in src and "ASC_IS_AIV" in src  # Cube GEMM and Vector promotion in one mixed kernel
    assert "ascend_gemm_l1" in src and "asc_copy_l0c2ub" in src


def _inputs(seed, m, n, k):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[:, :128] *= 30.0  # scales that differ between k blocks exercise the promotion
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    a, sa = quantize_act(jnp.asarray(x))
    b, sb = quantize_weight(jnp.asarray(w))
    return a, sa, b, sb


@needs_tilelang
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(64, 4096, 7168), (5, 1024, 512), (200, 512, 1024), (512, 2048, 4096)])
def test_tilelang_fp8_gemm_matches_ref_on_gpu(m, n, k):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA GPU")
    from djax.kernels.fp8_gemm_tilelang import fp8_gemm_tilelang

    a, sa, b, sb = _inputs(m + n + k, m, n, k)
    out = jax.jit(fp8_gemm_tilelang)(a, sa, b, sb)
    ref = jax.jit(fp8_gemm_ref)(a, sa, b, sb)
    assert out.dtype == jnp.bfloat16 and out.shape == (m, n)
    assert_close(np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)), rtol=1e-2)
