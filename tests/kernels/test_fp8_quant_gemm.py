"""`fp8_quant_gemm`: the block-scaled FP8 GEMM that quantizes its activations 1 x 128 itself. The reference
against a numpy brute force; the Triton kernel (interpreted, float32 stand-ins) against the reference on fresh
random inputs with partial row tiles and K splits; its quantization exactly equal to `quantize_act`'s; its
e4m3 rounding against ml_dtypes; the refusals; the kernel compiled for sm_90 at V4-Flash's shapes; on a GPU,
the kernel against the reference."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import triton
import triton.language as tl
from checks import assert_close, needs_triton_interp

from djax.kernels.fp8_gemm import fp8_quant_gemm, fp8_quant_gemm_pair
from djax.kernels.fp8_gemm_ref import quantize_act
from djax.kernels.fp8_quant_triton import (
    QUANT_CFG,
    SWAPPED_CFG,
    SWAPPED_WIDE_CFG,
    Fp8Config,
    QuantConfig,
    _round_e4m3,
    quant_config,
)
from djax.quant import pow2_ceil, quantize
from tests.fp8_numpy import hard_rows, quantize_f32

SMALL = Fp8Config(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=1)
SMALL_SWAPPED = QuantConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=1, swap_ab=True)
# swapped with 128 weight rows: on a GPU fp8 wgmmas, m64n8k32 and m64n16k32 (the defaults' dots up to 16 rows)
WGMMA_SWAPPED = QuantConfig(block_m=8, block_n=128, block_k=128, num_warps=4, num_stages=1, swap_ab=True)
WGMMA_SWAPPED_16 = replace(WGMMA_SWAPPED, block_m=16)


def _weight(rng, n, k):
    """An FP8 QArray [n, k] with 128 x 128 scales, magnitudes uneven along both axes (every block its own scale)."""
    uneven = np.linspace(0.2, 3.0, n)[:, None] * np.linspace(3.0, 0.1, k)[None, :]
    return quantize(jnp.asarray(rng.standard_normal((n, k)) * uneven, jnp.float32))


def _acts(rng, m, k, dtype=jnp.float32, spread=(1e-2, 1e2)):
    """Activations whose magnitude runs from spread[0] to spread[1] along k (so their 128-column blocks differ
    by up to four orders), the last row all zeros where there is more than one."""
    a = rng.standard_normal((m, k)) * np.geomspace(*spread, k)[None, :]
    if m > 1:
        a[-1] = 0.0
    return jnp.asarray(a, dtype)


def _numpy(a, w, ue8m0):
    """Brute force in float64: a's blocks quantized by numpy and ml_dtypes (scale amax times float32(1 / 448),
    or its UE8M0 power of two), times the dequantized weight."""
    a = np.asarray(a, np.float32)
    m, k = a.shape
    g = a.reshape(m, k // 128, 128)
    amax = np.abs(g).max(-1, keepdims=True)
    if ue8m0:
        s = pow2_ceil(np.maximum(amax, np.float32(1e-4)) * np.float32(1 / 448))
    else:
        s = np.maximum(amax, np.float32(1e-12)) * np.float32(1 / 448)
    q = (g / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * s
    codes = np.asarray(w.values).astype(np.float64)
    wd = codes * np.repeat(np.repeat(np.asarray(w.scale, np.float64), 128, 0), 128, 1)
    return q.reshape(m, k) @ wd.T


@pytest.mark.parametrize("ue8m0", [False, True])
def test_reference_matches_numpy(ue8m0):
    rng = np.random.default_rng(1 + ue8m0)
    a, w = _acts(rng, 5, 384), _weight(rng, 256, 384)
    got = np.asarray(fp8_quant_gemm(a, w.values, w.scale, ue8m0, impl="ref"), np.float64)
    want = _numpy(a, w, ue8m0)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@needs_triton_interp
@pytest.mark.parametrize(
    "m, n, k, cfg",
    [
        (5, 256, 384, SMALL),  # a partial row tile
        (20, 128, 256, Fp8Config(16, 64, 128, 4, 1)),  # two row tiles
        (3, 128, 640, Fp8Config(16, 128, 128, 4, 1, split_k=3)),  # K split, the last split short
        (2, 128, 384, Fp8Config(16, 32, 128, 4, 1, split_k=4)),  # four splits of three K blocks: one empty
        (5, 256, 384, SMALL_SWAPPED),  # the dot as b a^T, the result transposed back
        (3, 128, 640, QuantConfig(16, 128, 128, 4, 1, split_k=3, swap_ab=True)),
        (7, 256, 512, QuantConfig(8, 64, 128, 4, 1, split_k=2, swap_ab=True)),  # 8-row tiles
        (
            12,
            128,
            384,
            QuantConfig(8, 64, 128, 4, 1, split_k=4, swap_ab=True),
        ),  # two row tiles, an empty split
    ],
)
@pytest.mark.parametrize("ue8m0", [False, True])
def test_triton_kernel_matches_reference(m, n, k, cfg, ue8m0):
    """Rounding "bits" only: the "cast" form cannot be checked by Triton's interpreter (3.6 rounds float32 to
    e4m3 otherwise than a GPU, up to 9% off here; 3.9 refuses e4m3 operands of the dot, "Unsupported rhs dtype
    fp8e4nv"), so it is checked on the GPU (below)."""
    rng = np.random.default_rng(m + n + k)
    a, w = _acts(rng, m, k), _weight(rng, n, k)
    want = fp8_quant_gemm(a, w.values, w.scale, ue8m0, impl="ref")
    got = fp8_quant_gemm(a, w.values, w.scale, ue8m0, impl="interpret", cfg=cfg)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    assert not np.asarray(got)[-1].any()  # the zero row stays zero
    assert np.asarray(got)[0].any()
    assert_close(got, want, 1e-6)


@needs_triton_interp
@pytest.mark.parametrize(
    "m, n, n2, k, cfg",
    [
        (5, 256, 128, 384, SMALL),  # a partial row tile, 8 + 4 column tiles
        (3, 128, 256, 640, Fp8Config(16, 128, 128, 4, 1, split_k=3)),  # K split, the last split short
        (7, 384, 128, 512, QuantConfig(8, 64, 128, 4, 1, split_k=2, swap_ab=True)),  # swapped 8-row tiles
        (20, 128, 128, 256, QuantConfig(16, 128, 128, 4, 1, swap_ab=True)),  # two row tiles
    ],
)
@pytest.mark.parametrize("ue8m0", [False, True])
def test_pair_kernel_matches_two_references(m, n, n2, k, cfg, ue8m0):
    """The pair kernel (interpreted, "bits") gives each weight's product as `fp8_quant_gemm`'s reference does;
    the pair's reference is the two references exactly."""
    rng = np.random.default_rng(m + n + n2 + k)
    a, w, w2 = _acts(rng, m, k), _weight(rng, n, k), _weight(rng, n2, k)
    want = [fp8_quant_gemm(a, v.values, v.scale, ue8m0, impl="ref") for v in (w, w2)]
    ref = fp8_quant_gemm_pair(a, w.values, w.scale, w2.values, w2.scale, ue8m0, impl="ref")
    for r, x in zip(ref, want, strict=True):
        np.testing.assert_array_equal(np.asarray(r), np.asarray(x))
    got = fp8_quant_gemm_pair(a, w.values, w.scale, w2.values, w2.scale, ue8m0, impl="interpret", cfg=cfg)
    assert [g.shape for g in got] == [(m, n), (m, n2)]
    for g, x in zip(got, want, strict=True):
        assert not np.asarray(g)[-1].any() and np.asarray(g)[0].any()
        assert_close(g, x, 1e-6)


def test_pair_refuses_mismatched_weights():
    rng = np.random.default_rng(3)
    a, w, w2 = _acts(rng, 2, 256), _weight(rng, 128, 256), _weight(rng, 128, 384)
    with pytest.raises(ValueError, match="fp8_quant_gemm_pair: b2 has shape"):
        fp8_quant_gemm_pair(a, w.values, w.scale, w2.values, w2.scale, impl="ref")
    empty = jnp.zeros((0, 256), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="n not 0"):
        fp8_quant_gemm_pair(a, w.values, w.scale, empty, jnp.zeros((0, 2), jnp.float32), impl="ref")
    from djax.kernels.fp8_quant_triton import constexprs

    with pytest.raises(ValueError, match="first weight's 64 rows"):
        constexprs(2, 256, 256, False, "cast", SMALL, n1=64)


@needs_triton_interp
def test_kernel_loads_and_stores_bf16():
    """bf16 activations in and a bf16 result out, as on a GPU (the other interpreted tests pass float32): the
    reference's bf16 result within one bf16 rounding."""
    import torch

    from djax.kernels.fp8_quant_triton import constexprs, launch_torch

    rng = np.random.default_rng(9)
    a = _acts(rng, 5, 384, jnp.bfloat16, spread=(0.5, 2.0))
    w = _weight(rng, 256, 384)
    a_t = torch.from_numpy(np.array(a, np.float32)).to(torch.bfloat16)
    b_t = torch.from_numpy(np.array(w.values, np.float32))
    cx = constexprs(5, 256, 384, True, "bits", SMALL, newton=False)
    got = launch_torch(a_t, b_t, torch.from_numpy(np.array(w.scale)), cx, SMALL)
    with pytest.raises(ValueError, match="do not match"):  # operands other than the constants describe
        launch_torch(a_t[:4], b_t, torch.from_numpy(np.array(w.scale)), cx, SMALL)
    assert got.dtype == torch.bfloat16
    want = fp8_quant_gemm(a, w.values, w.scale, True, impl="ref")
    assert_close(got.float().numpy(), want.astype(jnp.float32), 2**-8)


def _identity_weight(k):
    """The identity as an FP8 weight with unit scales: the product returns the activations as quantized."""
    eye = jnp.eye(k, dtype=jnp.float32).astype(jnp.float8_e4m3fn)
    return eye, jnp.ones((k // 128, k // 128), jnp.float32)


def _quantized(a, ue8m0):
    q, s = quantize_act(a, ue8m0)
    return np.asarray(q.astype(jnp.float32)) * np.repeat(np.asarray(s), 128, 1)


@needs_triton_interp
@pytest.mark.parametrize("cfg", [SMALL, SMALL_SWAPPED])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_kernel_quantizes_exactly_as_quantize_act(ue8m0, cfg):
    """Against the identity each output is one product, q times its scale: exactly quantize_act's values.
    Row 1's second block is tiny (amax 3e-13, under both scale floors: 1e-12 plain, 1e-4 UE8M0), so its
    values land on e4m3's subnormals or below them."""
    rng = np.random.default_rng(7)
    a = np.array(_acts(rng, 4, 256))
    a[1, 128:] = rng.uniform(-3e-13, 3e-13, 128)
    a = jnp.asarray(a)
    eye, ones = _identity_weight(256)
    got = np.asarray(fp8_quant_gemm(a, eye, ones, ue8m0, impl="interpret", cfg=cfg))
    np.testing.assert_array_equal(got, _quantized(a, ue8m0))


def _rule_times_scale(x):
    """What the kernel returns against the identity with plain scales: each value's e4m3 quotient by the rule
    (`quantize_f32`: numpy's IEEE division) times its row's scale, in float32."""
    q, s = quantize_f32(x)
    return q.astype(np.float32) * np.repeat(s, 128, 1)


def _hard_gemm_rows(seed, m, k):
    """`hard_rows` without its infinity's row (row 5: the dot spreads its NaN over the whole output row)."""
    return np.delete(hard_rows(seed, m + 1, k), 5, axis=0)


@needs_triton_interp
@pytest.mark.parametrize("cfg", [SMALL, SMALL_SWAPPED])
def test_interpreted_markstein_quotient_is_the_division(cfg, monkeypatch):
    """Plain scales, `fp8_quant_triton.MARKSTEIN` (one reciprocal a row and two fmas) and the IEEE division:
    against the identity both give the rule's quotients exactly on `hard_rows` (quotients at e4m3 rounding
    midpoints, zeros, subnormals, rows under the amax floor, scales from 1e-14 to 1e30; a zero's sign does not
    reach the output, whose sums start at +0: `test_row_quant.py` checks it by bits). The
    rule's, not `quantize_act`'s: XLA's CPU backend turns that division into a product with the reciprocal,
    which rounds some of these quotients the other way."""
    from djax.kernels import fp8_quant_triton as qk

    x = _hard_gemm_rows(8, 23, 256)
    eye, ones = _identity_weight(256)
    for markstein in (False, True):
        monkeypatch.setattr(qk, "MARKSTEIN", markstein)
        got = fp8_quant_gemm(jnp.asarray(x), eye, ones, False, impl="interpret", cfg=cfg)
        np.testing.assert_array_equal(np.asarray(got), _rule_times_scale(x), err_msg=f"markstein {markstein}")


@needs_triton_interp
def test_interpreted_markstein_is_read_when_traced(monkeypatch):
    """The interpreter's callback runs after tracing: it launches with `MARKSTEIN` as it was when the call was
    traced."""
    from djax.kernels import fp8_quant_triton as qk

    seen = []
    real = qk.launch_torch
    monkeypatch.setattr(qk, "launch_torch", lambda *a: seen.append(a[3]["MARKSTEIN"]) or real(*a))
    rng = np.random.default_rng(2)
    a, w = _acts(rng, 3, 256), _weight(rng, 128, 256)

    def traced_without(a, v, s):
        monkeypatch.setattr(qk, "MARKSTEIN", False)
        try:
            return fp8_quant_gemm(a, v, s, impl="interpret", cfg=SMALL)
        finally:
            monkeypatch.setattr(qk, "MARKSTEIN", True)

    jax.block_until_ready(jax.jit(traced_without)(a, w.values, w.scale))
    assert seen == [False] and qk.MARKSTEIN


@triton.jit
def round_kernel(x_ptr, y_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    tl.store(y_ptr + r, _round_e4m3(tl.load(x_ptr + r)))


@needs_triton_interp
def test_e4m3_rounding_matches_ml_dtypes():
    """`_round_e4m3` on values spread over e4m3's range, its subnormals and the exact midpoints between
    neighbouring codes (ties go to the even code)."""
    import torch

    values = np.array([c for c in range(256) if c & 0x7F < 0x7F], np.uint8).view(ml_dtypes.float8_e4m3fn)
    grid = np.sort(values.astype(np.float32))
    mids = (grid[:-1] + grid[1:]) / 2
    rng = np.random.default_rng(3)
    rand = rng.uniform(-448, 448, 4096).astype(np.float32) * np.exp2(rng.integers(-12, 0, 4096)).astype(
        np.float32
    )
    x = np.concatenate([grid, mids, rand]).astype(np.float32)
    x = np.pad(x, (0, 8192 - x.size))
    y = torch.empty(8192, dtype=torch.float32)
    round_kernel[(1,)](torch.from_numpy(x), y, N=8192)
    np.testing.assert_array_equal(y.numpy(), x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32))


def test_refusals_name_the_problem():
    rng = np.random.default_rng(0)
    a, w = _acts(rng, 4, 256), _weight(rng, 128, 256)
    with pytest.raises(ValueError, match=r"fp8_quant_gemm: b has shape \[128, 256\], expected \[\*, 200\]"):
        fp8_quant_gemm(a[:, :200], w.values, w.scale, impl="ref")
    with pytest.raises(ValueError, match="n 100 and k 256 must be multiples of 128"):
        fp8_quant_gemm(a, w.values[:100], w.scale, impl="ref")
    with pytest.raises(ValueError, match=r"b_scale has shape \[1, 1\], expected \[1, 2\]"):
        fp8_quant_gemm(a, w.values, w.scale[:, :1], impl="ref")
    with pytest.raises(ValueError, match="b must hold float8_e4m3fn codes, got bfloat16"):
        fp8_quant_gemm(a, w.values.astype(jnp.bfloat16), w.scale, impl="ref")
    with pytest.raises(ValueError, match="rounding must be one of"):
        fp8_quant_gemm(a, w.values, w.scale, impl="interpret", rounding="ptx")
    with pytest.raises(ValueError, match="BLOCK_N 96 must divide 128"):
        fp8_quant_gemm(a, w.values, w.scale, impl="interpret", cfg=replace(SMALL, block_n=96))
    with pytest.raises(ValueError, match="split_k 0 must be >= 1"):
        fp8_quant_gemm(a, w.values, w.scale, impl="interpret", cfg=replace(SMALL, split_k=0))
    with pytest.raises(ValueError, match="impl must be 'auto' or one of"):
        fp8_quant_gemm(a, w.values, w.scale, impl="tilelang")


def test_quant_config_covers_the_rows_and_splits_k():
    """The swapped dot up to 32 rows: 8-row tiles at six stages up to 8 rows, 16- and 32-row tiles at four up to
    16 and 32; above, QUANT_CFG's 64-row tiles; K split the fewest ways that make 256 programs, at most 16 and
    keeping two K blocks a split."""
    assert SWAPPED_CFG.swap_ab and SWAPPED_CFG.block_m == 8 and SWAPPED_CFG.num_stages == 6
    assert SWAPPED_WIDE_CFG.swap_ab and SWAPPED_WIDE_CFG.num_stages == 4 and not QUANT_CFG.swap_ab
    assert quant_config(1, 2048, 4096) == replace(SWAPPED_CFG, split_k=16)  # 16 tiles, 32 K blocks
    assert quant_config(8, 512, 4096) == replace(SWAPPED_CFG, split_k=16)  # 4 tiles: the most splits
    assert quant_config(1, 4096, 2048) == replace(SWAPPED_CFG, split_k=8)  # 32 tiles
    assert quant_config(1, 32768, 1024) == replace(SWAPPED_CFG, split_k=1)  # 256 tiles
    assert quant_config(1, 128, 256) == replace(SWAPPED_CFG, split_k=1)  # two K blocks: no split
    assert quant_config(9, 2048, 4096) == replace(SWAPPED_WIDE_CFG, block_m=16, split_k=16)
    assert quant_config(16, 32768, 1024) == replace(SWAPPED_WIDE_CFG, block_m=16, split_k=1)
    assert quant_config(17, 4096, 8192) == replace(SWAPPED_WIDE_CFG, block_m=32, split_k=8)
    assert quant_config(32, 4096, 8192) == replace(SWAPPED_WIDE_CFG, block_m=32, split_k=8)
    assert quant_config(33, 2048, 4096) == replace(QUANT_CFG, block_m=64, split_k=16)
    assert quant_config(300, 2048, 4096).block_m == 64  # five row tiles


_SHAPES = [
    (1, 2048, 4096),
    (1, 32768, 1024),
    (16, 4096, 8192),
    (32, 4096, 8192),
    (64, 512, 4096),
    (300, 4096, 2048),
]


@pytest.mark.parametrize(
    "m, n, k, ue8m0, rounding",
    [(*shape, ue8m0, "cast") for shape in _SHAPES for ue8m0 in (False, True)]
    + [(*shape, True, "bits") for shape in _SHAPES if shape[0] <= 32],
)
def test_kernel_compiles_to_sm90_cubin_at_v4_flash_shapes(m, n, k, ue8m0, rounding):
    """With bf16 activations, the default tiles of every row count compile within sm_90's shared memory (no GPU
    needed); the "bits" twin too up to 32 rows (at 64 its float32 operands need 256 KB)."""
    pytest.importorskip("triton")
    from djax.ffi.cubin import MAX_SHARED_BYTES, compile_triton
    from djax.kernels import fp8_quant_triton as qk

    cfg = quant_config(m, n, k)
    cx = qk.constexprs(m, n, k, ue8m0, rounding, cfg)
    assert cx["MARKSTEIN"] == cx["NEWTON"] == (not ue8m0)  # the defaults: plain scales divide nowhere
    out = jnp.float32 if cfg.split_k > 1 else jnp.bfloat16
    dtypes = [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32, out]
    kern = compile_triton(
        qk.fp8_quant_gemm_kernel, ["a_ptr", "b_ptr", "bs_ptr", "c_ptr"], dtypes, cx, 4, cfg.num_stages
    )
    assert kern.binary[:4] == b"\x7fELF" and kern.threads == 32 * cfg.num_warps
    assert 0 < kern.shared_bytes <= MAX_SHARED_BYTES


@pytest.mark.parametrize("m, n1, n2", [(1, 1024, 512), (8, 1024, 1024), (32, 2048, 2048)])
def test_pair_kernel_compiles_to_sm90_cubin_at_v4_flash_pairs(m, n1, n2):
    """wq_a with wkv, a compressor's wkv with wgate, the shared expert's w1 with w3 (k 4096): the pair kernel at
    its default tiles fits sm_90's shared memory (no GPU needed)."""
    pytest.importorskip("triton")
    from djax.ffi.cubin import MAX_SHARED_BYTES, compile_triton
    from djax.kernels import fp8_quant_triton as qk

    k = 4096
    cfg = quant_config(m, n1 + n2, k)
    cx = qk.constexprs(m, n1 + n2, k, True, "cast", cfg, n1)
    out = jnp.float32 if cfg.split_k > 1 else jnp.bfloat16
    names = ["a_ptr", "b_ptr", "bs_ptr", "b2_ptr", "bs2_ptr", "c_ptr"]
    dtypes = [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32, jnp.float8_e4m3fn, jnp.float32, out]
    kern = compile_triton(qk.fp8_quant_gemm_pair_kernel, names, dtypes, cx, 4, cfg.num_stages)
    assert kern.binary[:4] == b"\x7fELF" and 0 < kern.shared_bytes <= MAX_SHARED_BYTES


def test_under_jit_matches_numpy():
    rng = np.random.default_rng(5)
    a, w = _acts(rng, 6, 256), _weight(rng, 128, 256)
    f = jax.jit(lambda a, v, s: fp8_quant_gemm(a, v, s, True, impl="ref"))
    got, want = np.asarray(f(a, w.values, w.scale), np.float64), _numpy(a, w, True)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 12, 16, 24, 32, 64])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_triton_on_the_gpu_matches_reference(m, ue8m0):
    """bf16 activations against a 2048 x 4096 weight at the shape's default tiles (the swapped dot up to 32
    rows; 12 and 24 rows fill part of a 16- and a 32-row tile): the same quantized operands, their products
    summed in another order (in float32; the fp8 wgmmas of 16 rows or more land further from the reference),
    then rounded to bf16. Every 128-column block weighs within 4x of the others, so a K block lost or counted
    twice moves the result by far more than the 2^-10 allowed (on an H100 the kernel's error against the
    reference was at most 6.3e-5 with 8-row swapped tiles, 6.5-7.3e-4 with 16- and 32-row swapped tiles,
    7.6e-4 with 64-row wgmma tiles)."""
    rng = np.random.default_rng(m)
    a, w = _acts(rng, m, 4096, jnp.bfloat16, spread=(0.5, 2.0)), _weight(rng, 2048, 4096)
    want = fp8_quant_gemm(a, w.values, w.scale, ue8m0, impl="ref")
    got = fp8_quant_gemm(a, w.values, w.scale, ue8m0, impl="triton")
    assert got.dtype == jnp.bfloat16 and got.shape == (m, 2048)
    assert_close(got.astype(jnp.float32), want.astype(jnp.float32), 2**-10)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 12, 32])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_pair_on_the_gpu_matches_two_calls_and_reference(m, ue8m0):
    """wq_a with wkv (1024 + 512 rows, k 4096) at the pair's default tiles: each product within the single
    kernel's bound of the reference (above), and element by element within one bf16 step of the single
    kernel's own result, at most 1% of the elements differing at all: the programs compute the same float32
    partials (here at the same 16 K splits), which XLA sums for arrays of another width, so a sum may round to
    the neighbouring bf16 value; reading the other weight's rows or scales would move every element."""
    rng = np.random.default_rng(100 + m)
    a = _acts(rng, m, 4096, jnp.bfloat16, spread=(0.5, 2.0))
    w, w2 = _weight(rng, 1024, 4096), _weight(rng, 512, 4096)
    got = fp8_quant_gemm_pair(a, w.values, w.scale, w2.values, w2.scale, ue8m0, impl="triton")
    for g, v in zip(got, (w, w2), strict=True):
        assert g.dtype == jnp.bfloat16 and g.shape == (m, v.values.shape[0])
        want = fp8_quant_gemm(a, v.values, v.scale, ue8m0, impl="ref")
        assert_close(g.astype(jnp.float32), want.astype(jnp.float32), 2**-10)
        single = np.asarray(fp8_quant_gemm(a, v.values, v.scale, ue8m0, impl="triton"), np.float32)
        g = np.asarray(g, np.float32)
        np.testing.assert_allclose(g, single, rtol=2**-7, atol=0)  # one bf16 step of 8 significant bits
        assert np.mean(g != single) <= 0.01, np.mean(g != single)


@pytest.mark.gpu
@pytest.mark.parametrize("m, block_m, block_n", [(1, 16, 128), (7, 8, 64), (24, 16, 128)])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_swapped_dot_on_the_gpu_matches_reference(m, block_m, block_n, ue8m0):
    """The dot taken as b a^T (an fp8 wgmma with the weight rows as its 64-row side, n8 or n16) at tiles the
    defaults do not take (a 16-row tile for one row, 64 weight rows, 24 rows in two 16-row tiles), as above."""
    rng = np.random.default_rng(100 + m)
    a, w = _acts(rng, m, 4096, jnp.bfloat16, spread=(0.5, 2.0)), _weight(rng, 2048, 4096)
    cfg = replace(quant_config(m, 2048, 4096), block_m=block_m, block_n=block_n, swap_ab=True)
    want = fp8_quant_gemm(a, w.values, w.scale, ue8m0, impl="ref")
    got = fp8_quant_gemm(a, w.values, w.scale, ue8m0, impl="triton", cfg=cfg)
    assert got.dtype == jnp.bfloat16 and got.shape == (m, 2048)
    assert_close(got.astype(jnp.float32), want.astype(jnp.float32), 2**-10)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [SMALL, SMALL_SWAPPED, WGMMA_SWAPPED, WGMMA_SWAPPED_16])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_gpu_kernel_quantizes_exactly_as_quantize_act(ue8m0, cfg):
    """On the GPU too (Triton's fp8 conversion and IEEE division against XLA's): against the identity the
    kernel returns quantize_act's values exactly, float32 in and out; one block under both scale floors."""
    rng = np.random.default_rng(8)
    a = np.array(_acts(rng, 16, 512))
    a[1, 128:256] = rng.uniform(-3e-13, 3e-13, 128)
    a = jnp.asarray(a)
    eye, ones = _identity_weight(512)
    got = np.asarray(fp8_quant_gemm(a, eye, ones, ue8m0, impl="triton", cfg=cfg))
    np.testing.assert_array_equal(got, _quantized(a, ue8m0))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16, 32, 64])
@pytest.mark.parametrize("markstein", [False, True])
def test_gpu_markstein_quotient_is_the_division(m, markstein, monkeypatch):
    """On a CUDA GPU, plain scales at each row count's default tiles: with `MARKSTEIN` and with the IEEE
    division the kernel returns the rule's quotients times their scales exactly against the identity, on
    `hard_rows` (e4m3 midpoints and corner values), float32 in and out (at 64 rows on three stages: six of
    float32 tiles overflow shared memory)."""
    from djax.kernels import fp8_quant_triton as qk

    x = _hard_gemm_rows(9, 64, 2048)[:m] if m > 1 else _hard_gemm_rows(9, 8, 2048)[6:7]
    eye, ones = _identity_weight(2048)
    cfg = quant_config(m, 2048, 2048)
    cfg = replace(cfg, num_stages=3) if m > 32 else cfg
    monkeypatch.setattr(qk, "MARKSTEIN", markstein)
    got = jax.jit(lambda a, b, s: fp8_quant_gemm(a, b, s, impl="triton", cfg=cfg))(jnp.asarray(x), eye, ones)
    np.testing.assert_array_equal(np.asarray(got), _rule_times_scale(x))


@pytest.mark.gpu
def test_gpu_newton_reciprocal_is_correctly_rounded():
    """`fp8_quant_triton._reciprocal`'s Newton step from the hardware's approximate reciprocal gives numpy's
    IEEE 1 / s, bit for bit, on every float32 significand (2^23) in binades from the plain scales' floor
    (1e-12 / 448, about 2^-49) to their ceiling (float32's largest / 448, about 2^119), and 0 for an
    infinite s; the kernel's division (NEWTON off) too."""
    from djax.ffi import cubin
    from djax.kernels import fp8_quant_triton as qk

    significands = (np.arange(2**23, dtype=np.uint32) | np.uint32(127 << 23)).view(np.float32)  # [1, 2)
    s = np.concatenate([significands * np.float32(2.0**e) for e in (-49, -20, -1, 0, 1, 64, 119)])
    s = np.concatenate([s, np.full(1024, np.inf, np.float32)])
    want = np.float32(1.0) / s
    for newton in (True, False):
        kern = cubin.compile_triton(
            qk.reciprocal_kernel, ["s_ptr", "y_ptr"], [jnp.float32] * 2, {"NEWTON": newton}
        )
        out = jax.ShapeDtypeStruct(s.shape, jnp.float32)
        got = jax.jit(lambda v, k=kern, o=out: cubin.launch(k, (s.size // 1024,), [v], [o])[0])(
            jnp.asarray(s)
        )
        bad = np.flatnonzero(np.asarray(got).view(np.uint32) != want.view(np.uint32))
        assert bad.size == 0, f"newton {newton}: {bad.size} of {s.size} differ, e.g. 1 / {s[bad[:4]]}"
