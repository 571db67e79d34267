"""The FFI library: CPU handlers built and called through XLA; Triton kernels compiled ahead to sm_90 cubins."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from djax.ffi import build
from djax.ffi.cpu_ops import gather_rows, scatter_add_rows


def test_cpu_handlers_under_jit_and_vs_numpy():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 5)).astype(np.float32)
    idx = np.array([6, -1, 0, 7, 3, 3], np.int32)
    out = np.asarray(jax.jit(gather_rows)(jnp.asarray(x), jnp.asarray(idx)))
    ref = np.stack([x[i] if 0 <= i < 7 else np.zeros(5, np.float32) for i in idx])
    np.testing.assert_array_equal(out, ref)
    w = rng.random(6).astype(np.float32)
    acc = np.asarray(
        jax.jit(scatter_add_rows, static_argnums=3)(jnp.asarray(out), jnp.asarray(w), jnp.asarray(idx), 7)
    )
    ref2 = np.zeros((7, 5))
    for i, t in enumerate(idx):
        if 0 <= t < 7:
            ref2[t] += w[i] * out[i]
    np.testing.assert_allclose(acc, ref2, rtol=1e-6, atol=1e-6)


def test_library_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("DJAX_FFI_CACHE", str(tmp_path))
    build.library.cache_clear()
    try:
        build.library("cpu_ops")
        files = list(tmp_path.glob("libcpu_ops-*.so"))
        assert len(files) == 1
        mtime = files[0].stat().st_mtime_ns
        build.library.cache_clear()
        build.library("cpu_ops")
        assert files[0].stat().st_mtime_ns == mtime  # reused, not rebuilt
    finally:
        build.library.cache_clear()


@pytest.mark.skipif(build.cuda_include() is None, reason="needs CUDA headers (cuda.h)")
def test_cuda_launcher_builds_without_a_gpu():
    lib = build.library("cubin_launch", cuda=True)
    assert hasattr(lib, "DjaxCubinLaunch") and hasattr(lib, "djax_load_cubin")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_triton_compiles_ahead_to_sm90_cubin():
    from djax.ffi.cubin import compile_triton
    from djax.kernels.sparse_attn_triton import constexprs, sparse_decode_kernel

    names = ["q_ptr", "win_ptr", "valid_ptr", "pool_ptr", "topk_ptr", "sink_ptr", "out_ptr"]
    dtypes = [jnp.bfloat16, jnp.bfloat16, jnp.int32, jnp.bfloat16, jnp.int32, jnp.float32, jnp.bfloat16]
    k = compile_triton(
        sparse_decode_kernel, names, dtypes, constexprs(64, 512, 128, 1024, 512, 0.05, 16, 32), 4, 2
    )
    assert k.binary[:4] == b"\x7fELF" and k.name == "sparse_decode_kernel"
    assert k.threads == 128 and k.shared_bytes > 0 and k.extra_null == 2


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_kernel_over_the_shared_memory_limit_is_refused_at_compile_time():
    """float32 key tiles of 128 x 512 need more shared memory than an sm_90 block has: a clear error when
    compiled (no GPU needed), instead of CUDA's "invalid argument" when the cubin is loaded."""
    from djax.ffi.cubin import compile_triton
    from djax.kernels.sparse_attn_triton import constexprs, sparse_decode_kernel

    names = ["q_ptr", "win_ptr", "valid_ptr", "pool_ptr", "topk_ptr", "sink_ptr", "out_ptr"]
    f32 = jnp.float32
    dtypes = [f32, f32, jnp.int32, f32, jnp.int32, f32, f32]
    with pytest.raises(
        (ValueError, RuntimeError), match="more than sm_90.s 232448"
    ):  # RuntimeError: compiled in a child
        compile_triton(
            sparse_decode_kernel, names, dtypes, constexprs(64, 512, 128, 1024, 512, 0.05, 64, 128), 8, 3
        )


@pytest.mark.parametrize("capability, runs", [("9.0", True), ("8.0", False), ("10.0", False), (None, True)])
def test_auto_takes_the_kernels_only_on_the_gpus_they_are_built_for(monkeypatch, capability, runs):
    """`on_cuda` (what every "auto" asks) is true on a GPU of the kernels' compute capability (sm_90
    cubins) and false on other GPUs, where the references run; a device that does not say its capability
    is taken at its word as a CUDA GPU."""
    from types import SimpleNamespace

    from djax.ffi import cubin
    from djax.kernels import dispatch

    assert dispatch.KERNEL_ARCH_MAJOR == cubin.TARGET_ARCH // 10
    device = SimpleNamespace() if capability is None else SimpleNamespace(compute_capability=capability)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [device])
    assert dispatch.on_cuda() is runs
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert dispatch.on_cuda() is False


def test_default_grids_follow_the_gpus_sm_count(monkeypatch):
    """Every default rule that sizes a grid to the SMs fills the GPU it runs on: on a Hopper part of 78 SMs
    (an H20) each gives another answer than on 132 (fewer splits, wider tiles, the TileLang GEMM at fewer
    rows); off CUDA, or where a device does not say its SM count, each gives the 132-SM answer it was
    measured at."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from djax.kernels import dispatch, moe_experts
    from djax.kernels import fp8_gemm as fg
    from djax.kernels import fp8_gemm_tilelang as fgt
    from djax.kernels import fp8_gemm_triton as ft
    from djax.kernels import fp8_weight_triton as fw
    from djax.kernels import sparse_attn_tilelang as sat
    from djax.kernels.sparse_attn import triton_tiling

    fp8 = jnp.float8_e4m3fn

    def operand(*shape):
        return jax.ShapeDtypeStruct(shape, fp8)

    def grids():
        attn = sat.default_tiling(32, 64, 512, 128, 512), sat.default_tiling(64, 64, 512, 128, 64)
        return dict(
            sms=(dispatch.sm_count(), dispatch.per_gpu(256)),
            triton_attn=[triton_tiling(b, 64, 128, 512)["nsplit"] for b in (8, 32, 64)],
            tilelang_attn=[(t.nsplit, t.dim_pair) for t in attn],
            decode_k_split=(ft.fewest_splits(40, 56), fgt.default_ws_tiling(1, 7168, 1024).split_k),
            decode_tile_n=fgt.default_tiling(64, 10240, 7168).block_n,
            prefill_tiles=(
                ft.dense_config(128, 10240, 1024).block_m,
                fw.weight_config(128, 10240, 1024).block_m,
            ),
            swiglu_n=moe_experts.swiglu_config(moe_experts.FP8_DECODE_CFG, 6, 256, 2048).block_n,
            tilelang_gemm=(
                fg.auto_takes_tilelang(operand(2048, 4096), operand(4096, 4096), jnp.bfloat16),
                fg.contiguous_takes_tilelang(operand(2048, 2048), operand(8, 4096, 2048), jnp.bfloat16),
            ),
        )

    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")  # off CUDA, whatever this host has
    measured = grids()
    assert measured == dict(
        sms=(132, 256),
        triton_attn=[7, 4, 2],
        tilelang_attn=[(4, False), (1, True)],
        decode_k_split=(8, 2),
        decode_tile_n=64,
        prefill_tiles=(ft.DECODE_CFG.block_m, fw.DECODE_CFG.block_m),
        swiglu_n=32,
        tilelang_gemm=(False, False),
    )
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(dispatch, "has_tilelang", lambda: True)
    h20 = SimpleNamespace(compute_capability="9.0", core_count=78)
    for device in (
        SimpleNamespace(compute_capability="9.0", core_count=132),
        SimpleNamespace(compute_capability="9.0"),
    ):
        monkeypatch.setattr(jax, "devices", lambda *a, d=device: [d])
        assert grids() == measured
    monkeypatch.setattr(jax, "devices", lambda *a: [h20])
    on_h20 = grids()
    assert on_h20 == dict(
        sms=(78, 151),
        triton_attn=[5, 2, 1],
        tilelang_attn=[(1, True), (1, False)],
        decode_k_split=(4, 1),
        decode_tile_n=128,
        prefill_tiles=(ft.DEFAULT_CFG.block_m, fw.PREFILL_CFG.block_m),
        swiglu_n=64,
        tilelang_gemm=(True, True),
    )
