"""`fp8_weight_gemm`: FP8 weights with block scales of any shape (V4.1's 32 x 32) read as stored against
unquantized activations. The reference against a numpy brute force; the Triton kernel (interpreted, float32)
against the reference on fresh random inputs with partial tiles, partial scale blocks and K splits; its decode
of every e4m3 code against ml_dtypes; the refusals; the kernel compiled for sm_90 at V4.1's shapes."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from checks import assert_close, needs_triton_interp

from djax.kernels.fp8_gemm import fp8_weight_gemm
from djax.kernels.fp8_weight_triton import DECODE_CFG, FEW_ROWS_CFG, PREFILL_CFG, Fp8Config, weight_config
from djax.quant import QArray, quantize

SMALL = Fp8Config(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=1)


def _weight(rng, n, k, block):
    """An FP8 QArray [n, k] with `block` scales, its magnitudes uneven along both axes so that every block
    has a scale of its own."""
    uneven = np.linspace(0.2, 3.0, n)[:, None] * np.linspace(3.0, 0.1, k)[None, :]
    return quantize(jnp.asarray(rng.standard_normal((n, k)) * uneven, jnp.float32), block)


def _numpy(a, w: QArray):
    """Brute force in float64: every code decoded by ml_dtypes, times its block's scale, rounded to a's dtype
    (the model's dense weight), then the product."""
    codes = np.asarray(w.values).astype(np.float64)
    s = np.asarray(w.scale, np.float64)
    n, k = codes.shape
    bo, bi = w.block
    scale = np.array([[s[i // bo, j // bi] for j in range(k)] for i in range(n)])
    wd = (codes * scale).astype(np.float32).astype(np.asarray(a).dtype).astype(np.float64)
    return np.asarray(a, np.float64) @ wd.T


@pytest.mark.parametrize(
    "m, n, k, block",
    [(3, 64, 96, (32, 32)), (5, 100, 70, (32, 32)), (4, 256, 256, (128, 128)), (2, 48, 64, (16, 64))],
)
def test_reference_matches_numpy(m, n, k, block):
    """Partial scale blocks along n and k included (100 x 70 rows and columns over 32 x 32 blocks)."""
    rng = np.random.default_rng(m * n + k)
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = _weight(rng, n, k, block)
    got = np.asarray(fp8_weight_gemm(a, w.values, w.scale, block, impl="ref"), np.float64)
    want = _numpy(a, w)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_reference_rounds_the_weight_to_the_activations_dtype():
    """In bf16 the weight is rounded to bf16 before the product, as `QArray.dense(bf16)` rounds it: the result
    is the model's dense path, x @ dense(w)^T, not a float32 weight's."""
    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.standard_normal((4, 128)), jnp.bfloat16)
    w = _weight(rng, 64, 128, (32, 32))
    got = np.asarray(fp8_weight_gemm(a, w.values, w.scale, w.block, impl="ref"), np.float64)
    dense_path = np.asarray(jnp.einsum("mk,nk->mn", a, w.dense(jnp.bfloat16)), np.float64)
    assert np.abs(got - dense_path).max() <= 2**-8 * np.abs(dense_path).max()  # one bf16 rounding of out
    assert np.abs(got - _numpy(a, w)).max() <= 2**-8 * np.abs(dense_path).max()


@needs_triton_interp
@pytest.mark.parametrize(
    "m, n, k, block, cfg",
    [
        (5, 96, 200, (32, 32), SMALL),  # partial row, column and K tiles
        (20, 100, 130, (32, 32), SMALL),  # two row tiles, a partial scale block along n and k
        (3, 64, 256, (128, 128), Fp8Config(16, 32, 128, 4, 1)),  # DeepGEMM's blocks, one per K step
        (7, 64, 320, (32, 32), Fp8Config(16, 32, 64, 4, 1, split_k=3)),  # K split, the last split short
        (4, 32, 128, (16, 64), Fp8Config(16, 32, 64, 4, 1, split_k=4)),  # every split one K step
    ],
)
@pytest.mark.parametrize("decode", ["bits", "cast"])
def test_triton_kernel_matches_reference(m, n, k, block, cfg, decode):
    rng = np.random.default_rng(m + n + k)
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = _weight(rng, n, k, block)
    want = fp8_weight_gemm(a, w.values, w.scale, block, impl="ref")
    got = fp8_weight_gemm(a, w.values, w.scale, block, impl="interpret", cfg=cfg, decode=decode)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    assert_close(got, want, 1e-6)


@needs_triton_interp
def test_kernel_decodes_every_e4m3_code():
    """With a the identity, c = dense(w)^T: each of the 254 finite codes (both signs, subnormals) in every row
    comes back as ml_dtypes decodes it times its scale, exactly (a zero's sign does not survive the sum with
    the other products); the two nan codes turn the whole column they sit in into nan, as the reference's
    product does."""
    finite = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)  # 254 codes
    k = 256
    codes = np.zeros((32, k), np.uint8)
    for r in range(32):
        codes[r, : finite.size] = np.roll(finite, 8 * r)
    scale = np.exp2(np.arange(-2, 2, dtype=np.float32))[None]  # 1 x 4 blocks of 32 x 64
    values = jnp.asarray(codes.view(ml_dtypes.float8_e4m3fn))
    eye = jnp.eye(k, dtype=jnp.float32)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.repeat(scale, 64, 1)
    for decode in ("bits", "cast"):
        got = np.asarray(
            fp8_weight_gemm(eye, values, jnp.asarray(scale), (32, 64), "interpret", SMALL, decode)
        )
        np.testing.assert_array_equal(got.T, want)
    nan_codes = codes.copy()
    nan_codes[3, 10], nan_codes[7, 200] = 0x7F, 0xFF
    values = jnp.asarray(nan_codes.view(ml_dtypes.float8_e4m3fn))
    for impl in ("ref", "interpret"):
        got = np.asarray(fp8_weight_gemm(eye[:16], values, jnp.asarray(scale), (32, 64), impl, SMALL))
        assert np.isnan(got[:, [3, 7]]).all() and not np.isnan(np.delete(got, [3, 7], 1)).any(), impl


def test_grouped_reference_is_each_groups_product():
    rng = np.random.default_rng(9)
    a = jnp.asarray(rng.standard_normal((3, 5, 96)), jnp.float32)
    ws = [_weight(rng, 64, 96, (32, 32)) for _ in range(3)]
    values = jnp.stack([w.values for w in ws])
    scale = jnp.stack([w.scale for w in ws])
    got = np.asarray(fp8_weight_gemm(a, values, scale, (32, 32), impl="ref"), np.float64)
    for j, w in enumerate(ws):
        want = _numpy(a[j], w)
        assert np.abs(got[j] - want).max() <= 1e-5 * np.abs(want).max(), j


@needs_triton_interp
@pytest.mark.parametrize("cfg", [SMALL, Fp8Config(16, 32, 64, 4, 1, split_k=2)])
def test_grouped_kernel_matches_reference(cfg):
    """Three products in one launch (the grid's third axis), partial tiles and scale blocks, split or not."""
    rng = np.random.default_rng(10)
    a = jnp.asarray(rng.standard_normal((3, 20, 130)), jnp.float32)
    ws = [_weight(rng, 70, 130, (32, 32)) for _ in range(3)]
    values = jnp.stack([w.values for w in ws])
    scale = jnp.stack([w.scale for w in ws])
    want = fp8_weight_gemm(a, values, scale, (32, 32), impl="ref")
    got = fp8_weight_gemm(a, values, scale, (32, 32), impl="interpret", cfg=cfg)
    assert got.shape == (3, 20, 70)
    assert_close(got, want, 1e-6)


def test_refusals_name_the_problem():
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((4, 128)), jnp.float32)
    w = _weight(rng, 64, 128, (32, 32))
    with pytest.raises(ValueError, match=r"fp8_weight_gemm: b_scale has shape \[2, 4\], expected \[2, 2\]"):
        fp8_weight_gemm(a, w.values, w.scale, (32, 64), impl="ref")
    with pytest.raises(ValueError, match=r"fp8_weight_gemm: b has shape \[64, 128\], expected \[\*, 96\]"):
        fp8_weight_gemm(a[:, :96], w.values, w.scale, w.block, impl="ref")
    with pytest.raises(ValueError, match=r"b has shape \[64, 128\], expected \[2, \*, 128\]"):
        fp8_weight_gemm(jnp.stack([a, a]), w.values, w.scale, w.block, impl="ref")
    with pytest.raises(ValueError, match=r"a must be \[m, k\] or \[groups, m, k\], got shape \[128\]"):
        fp8_weight_gemm(a[0], w.values, w.scale, w.block, impl="ref")
    with pytest.raises(ValueError, match="block must be two positive ints"):
        fp8_weight_gemm(a, w.values, w.scale, (32, 0), impl="ref")
    with pytest.raises(ValueError, match="b must hold float8_e4m3fn codes, got bfloat16"):
        fp8_weight_gemm(a, w.values.astype(jnp.bfloat16), w.scale, w.block, impl="ref")
    with pytest.raises(ValueError, match=r"scale block \(32, 48\) must have its K side dividing BLOCK_K 128"):
        q = quantize(jnp.ones((64, 96)), (32, 48))
        fp8_weight_gemm(a[:, :96], q.values, q.scale, (32, 48), impl="interpret")
    with pytest.raises(ValueError, match="decode must be one of"):
        fp8_weight_gemm(a, w.values, w.scale, w.block, impl="interpret", decode="ptx")
    with pytest.raises(ValueError, match="impl must be 'auto' or one of"):
        fp8_weight_gemm(a, w.values, w.scale, w.block, impl="tilelang")


def test_weight_config_splits_k_at_decode_and_not_at_prefill():
    """A 1024 x 5120 projection (V4.1's hidden size in): at one row 16 tiles of 16 x 64, split 8 ways (40 K
    steps); at 32 rows the same count of 64 x 64 tiles; at 4,096 rows 128 x 128 tiles, 256 of them, unsplit.
    V4.1's output LoRA (8 groups of 1024 x 4096) at one row: 128 tiles over the groups, split 2 ways."""
    assert weight_config(1, 1024, 5120) == replace(FEW_ROWS_CFG, split_k=8)
    assert weight_config(16, 1024, 5120) == replace(FEW_ROWS_CFG, split_k=8)
    assert weight_config(32, 1024, 5120) == replace(DECODE_CFG, split_k=8)
    assert weight_config(4096, 1024, 5120) == PREFILL_CFG
    assert weight_config(1, 1024, 4096, groups=8) == replace(FEW_ROWS_CFG, split_k=2)


@pytest.mark.parametrize(
    "cfg, groups, n, k",
    [
        (DECODE_CFG, 1, 1024, 5120),
        (replace(FEW_ROWS_CFG, split_k=8), 1, 1024, 5120),
        (PREFILL_CFG, 1, 1024, 5120),
        (replace(FEW_ROWS_CFG, split_k=2), 8, 1024, 4096),
    ],
    ids=["decode", "few_rows", "prefill", "wo_a"],
)
def test_kernel_compiles_to_sm90_cubin_at_v41_shapes(cfg, groups, n, k):
    """The kernel with the fp8 conversion a GPU runs ("cast"), bf16 activations and V4.1's 32 x 32 blocks (a
    1024 x 5120 projection; the output LoRA's 8 groups of 1024 x 4096) compiles for sm_90 within its shared
    memory (no GPU needed)."""
    pytest.importorskip("triton")
    from djax.ffi.cubin import MAX_SHARED_BYTES, compile_triton
    from djax.kernels import fp8_weight_triton as wk

    cx = wk.constexprs(64, n, k, (32, 32), "cast", cfg, groups)
    names = ["a_ptr", "b_ptr", "bs_ptr", "c_ptr"]
    out = jnp.float32 if cfg.split_k > 1 else jnp.bfloat16
    dtypes = [jnp.bfloat16, jnp.uint8, jnp.float32, out]
    kern = compile_triton(wk.fp8_weight_gemm_kernel, names, dtypes, cx, cfg.num_warps, cfg.num_stages)
    assert kern.binary[:4] == b"\x7fELF" and kern.threads == 32 * cfg.num_warps
    assert 0 < kern.shared_bytes <= MAX_SHARED_BYTES


def test_under_jit_matches_numpy():
    rng = np.random.default_rng(5)
    a = jnp.asarray(rng.standard_normal((6, 64)), jnp.float32)
    w = _weight(rng, 32, 64, (32, 32))
    f = jax.jit(lambda a, v, s: fp8_weight_gemm(a, v, s, (32, 32), impl="ref"))
    np.testing.assert_allclose(np.asarray(f(a, w.values, w.scale)), _numpy(a, w), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 37, 4096])  # K split 8 and 2 ways; 4,096 rows: 128 x 128 tiles, unsplit
@pytest.mark.parametrize("decode", ["cast", "bits"])
def test_triton_on_the_gpu_matches_reference(m, decode):
    """bf16 activations against a 1024 x 5120 weight with 32 x 32 blocks, the shape's default tiles. Kernel
    and reference round the same bf16 weight and sum in float32, then round to bf16: apart from the order of
    the sums they differ by the output's rounding, at most one bf16 ulp (2^-8 relative)."""
    rng = np.random.default_rng(m)
    a = jnp.asarray(rng.standard_normal((m, 5120)), jnp.bfloat16)
    w = _weight(rng, 1024, 5120, (32, 32))
    want = fp8_weight_gemm(a, w.values, w.scale, w.block, impl="ref")
    got = fp8_weight_gemm(a, w.values, w.scale, w.block, impl="triton", decode=decode)
    assert got.dtype == jnp.bfloat16 and got.shape == (m, 1024)
    assert_close(got.astype(jnp.float32), want.astype(jnp.float32), 2**-8)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [(32, 32), (128, 128)])
def test_grouped_triton_on_the_gpu_matches_reference(block):
    """The output LoRA's shape (8 groups of 1024 x 4096) at 37 rows in one launch, bf16, as above."""
    rng = np.random.default_rng(11)
    a = jnp.asarray(rng.standard_normal((8, 37, 4096)), jnp.bfloat16)
    ws = [_weight(rng, 1024, 4096, block) for _ in range(8)]
    values, scale = jnp.stack([w.values for w in ws]), jnp.stack([w.scale for w in ws])
    want = fp8_weight_gemm(a, values, scale, block, impl="ref")
    got = fp8_weight_gemm(a, values, scale, block, impl="triton")
    assert got.dtype == jnp.bfloat16 and got.shape == (8, 37, 1024)
    assert_close(got.astype(jnp.float32), want.astype(jnp.float32), 2**-8)
