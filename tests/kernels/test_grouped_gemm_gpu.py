"""On a CUDA GPU: the grouped GEMM, moe_experts and FP8 Triton kernels (cubins launched through the FFI
handler) against their references, in bf16 / fp8."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checks import assert_close

from djax.kernels.fp8_gemm import fp8_gemm, grouped_contiguous, grouped_masked
from djax.kernels.fp8_gemm_ref import quantize_act, quantize_weight
from djax.kernels.fp8_gemm_triton import Fp8Config
from djax.kernels.grouped_gemm import GemmConfig, grouped_gemm_masked, grouped_swiglu_masked
from djax.kernels.moe_experts import DECODE_CFG, PREFILL_CFG, layout, moe_experts
from djax.models.moe import experts_dense

pytestmark = pytest.mark.gpu
BF16 = jnp.bfloat16


def _moe(seed, n, d, f, e, k):
    key = jax.random.key(seed)
    ks = jax.random.split(key, 6)
    logits = jax.random.normal(ks[0], (n, e)) + 2 * jax.random.normal(ks[1], (e,))  # skewed loads
    vals, idx = jax.lax.top_k(logits, k)
    w = jax.nn.softmax(vals, -1)
    x = jax.random.normal(ks[2], (n, d), BF16)
    w1 = (jax.random.normal(ks[3], (e, f, d)) * d**-0.5).astype(BF16)
    w3 = (jax.random.normal(ks[4], (e, f, d)) * d**-0.5).astype(BF16)
    w2 = (jax.random.normal(ks[5], (e, d, f)) * f**-0.5).astype(BF16)
    return x, w, idx.astype(jnp.int32), w1, w2, w3


@pytest.mark.parametrize(
    "n,cfg",
    [
        (1000, PREFILL_CFG),
        (1000, GemmConfig(128, 128, 64, 8, 3)),
        (1000, GemmConfig(64, 64, 64, 4, 4)),
        (37, DECODE_CFG),
        (1, DECODE_CFG),  # batch-1 decode: the model takes this path at every size on CUDA
    ],
)
def test_moe_experts_triton_matches_dense(n, cfg):
    args = _moe(n, n, 512, 256, 32, 6)
    out = jax.jit(lambda *a: moe_experts(*a, 10.0, impl="triton", cfg=cfg))(*args)
    ref = jax.jit(
        lambda *a: experts_dense(*(v.astype(jnp.float32) if v.dtype == BF16 else v for v in a), 10.0)
    )(*args)
    assert out.dtype == BF16
    assert_close(out.astype(jnp.float32), ref, 2e-2)


@pytest.mark.parametrize("cfg", [DECODE_CFG, GemmConfig(16, 64, 128, 4, 4)])
def test_masked_triton_matches_ref(cfg):
    x, w, idx, w1, w2, w3 = _moe(3, 64, 512, 256, 32, 6)
    g, mm = 32, 64
    a = jax.random.normal(jax.random.key(9), (g, mm, 512), BF16)
    cnt = jnp.bincount(idx.ravel(), length=g).astype(jnp.int32)
    live = np.arange(mm)[None] < np.asarray(cnt)[:, None]
    h = grouped_swiglu_masked(a, w1, w3, cnt, 10.0, impl="triton", cfg=cfg)
    hr = grouped_swiglu_masked(a, w1, w3, cnt, 10.0, impl="ref")
    assert_close(np.asarray(h, np.float32)[live], np.asarray(hr, np.float32)[live], 2e-2)
    y = grouped_gemm_masked(hr, w2, cnt, impl="triton", cfg=cfg)
    yr = grouped_gemm_masked(hr, w2, cnt, impl="ref")
    assert_close(np.asarray(y, np.float32)[live], np.asarray(yr, np.float32)[live], 1e-2)


@pytest.mark.parametrize("cfg", [GemmConfig(128, 128, 128, 8, 4), GemmConfig(64, 128, 128, 4, 4)])
def test_fp8_triton_matches_ref(cfg):
    f32 = jnp.float32
    a, a_s = quantize_act(jax.random.normal(jax.random.key(1), (300, 1000), f32))  # partial K block
    b, b_s = quantize_weight(jax.random.normal(jax.random.key(2), (384, 1000), f32))
    # Hopper's FP8 MMA keeps about 14 mantissa bits in its accumulator (DeepSeek-V3 report, 3.3.2); the
    # kernel promotes to f32 every 128 K as DeepGEMM does, so each 128-long partial sum carries a relative
    # error near 2^-13 (1.26e-4 measured on the H200 at K = 1000) against the exact f32 reference.
    assert_close(
        fp8_gemm(a, a_s, b, b_s, f32, impl="triton", cfg=cfg), fp8_gemm(a, a_s, b, b_s, f32, impl="ref"), 4e-4
    )
    e, n, d = 8, 256, 512
    bg, bg_s = quantize_weight(jax.random.normal(jax.random.key(3), (e, n, d), f32))
    idx = jax.random.randint(jax.random.key(4), (200, 2), 0, e - 2)  # the last two groups stay empty
    lay = layout(idx, e, 128)
    x = jax.random.normal(jax.random.key(5), (200, d), f32)
    ac, ac_s = quantize_act(jnp.where((lay.rows >= 0)[:, None], x[jnp.maximum(lay.rows, 0)], 0))
    live = np.asarray(lay.m_indices) >= 0
    out = grouped_contiguous(ac, ac_s, bg, bg_s, lay.m_indices, f32, impl="triton", cfg=cfg)
    ref = grouped_contiguous(ac, ac_s, bg, bg_s, lay.m_indices, f32, impl="ref")
    assert_close(np.asarray(out)[live], np.asarray(ref)[live], 4e-4)  # the FP8 accumulator, as above
    am, am_s = quantize_act(jax.random.normal(jax.random.key(6), (e, 128, d), f32))
    cnt = jnp.asarray([0, 128, 5, 64, 1, 0, 77, 3], jnp.int32)
    mlive = np.arange(128)[None] < np.asarray(cnt)[:, None]
    out = grouped_masked(am, am_s, bg, bg_s, cnt, f32, impl="triton", cfg=cfg)
    ref = grouped_masked(am, am_s, bg, bg_s, cnt, f32, impl="ref")
    assert_close(np.asarray(out)[mlive], np.asarray(ref)[mlive], 4e-4)


@pytest.mark.parametrize(
    "cfg",
    [None, Fp8Config(64, 64, 128, 4, 6, split_k=4), Fp8Config(64, 32, 128, 4, 6, split_k=3)],
)
def test_fp8_split_k_matches_ref(cfg):
    """Decode-sized m with split-K (None: the shape's default config), K = 1000: 8 K blocks, the last
    partial, so some splits get fewer blocks than others."""
    f32 = jnp.float32
    a, a_s = quantize_act(jax.random.normal(jax.random.key(11), (37, 1000), f32))
    b, b_s = quantize_weight(jax.random.normal(jax.random.key(12), (384, 1000), f32))
    ref = fp8_gemm(a, a_s, b, b_s, f32, impl="ref")
    assert_close(fp8_gemm(a, a_s, b, b_s, f32, impl="triton", cfg=cfg), ref, 4e-4)  # as above
    out = fp8_gemm(a, a_s, b, b_s, jnp.bfloat16, impl="triton", cfg=cfg)
    assert out.dtype == jnp.bfloat16
    assert_close(out.astype(f32), ref, 1e-2)
