"""On a CUDA GPU: the grouped GEMM, moe_experts, moe_experts_fp8 and FP8 Triton kernels (cubins launched through the FFI
handler) against their references, in bf16 / fp8, and with FP4 weights read as stored."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from checks import assert_close, needs_tilelang, random_fp4

from djax import fp4
from djax.kernels.fp8_gemm import fp8_gemm, grouped_contiguous, grouped_masked, grouped_swiglu_contiguous
from djax.kernels.fp8_gemm_ref import quantize_act, quantize_weight
from djax.kernels.fp8_gemm_triton import Fp8Config
from djax.kernels.grouped_gemm import GemmConfig, grouped_gemm, grouped_gemm_masked, grouped_swiglu_masked
from djax.kernels.grouped_gemm_triton import Fp4Config
from djax.kernels.moe_experts import (
    DECODE_CFG,
    FP8_DECODE_CFG,
    PREFILL_CFG,
    layout,
    moe_experts,
    moe_experts_fp8,
)
from djax.models.moe import experts_dense
from djax.quant import dense, from_fp4, quantize

pytestmark = pytest.mark.gpu
BF16 = jnp.bfloat16
# the TileLang kernels' bf16 output: the f32 result (within 4e-4 of the f32 reference: the FP8 MMA
# accumulator, promoted every 128 k) rounded to bf16, at most half an ulp more
BF16_OUT_RTOL = 4e-4 + 2.0**-9


def needs_tilelang_gpu(fn):
    """TileLang installed and a CUDA GPU present."""
    gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
    return needs_tilelang(gpu(fn))


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
    "n,k,e,bm",
    [(1, 6, 256, 16), (64, 6, 256, 16), (300, 8, 256, 64), (600, 2, 6, 64), (682, 6, 256, 128)],
)
def test_layout_kernel_equals_reference(n, k, e, bm, monkeypatch):
    """The one-program layout on the GPU against the jnp spec, exactly, ids outside [0, e) among the picks; up
    to the program's CAPACITY (4,092 picks), past the MAX_PICKS that `layout` takes it to by default."""
    from djax.kernels import moe_layout_triton

    monkeypatch.setattr(moe_layout_triton, "MAX_PICKS", moe_layout_triton.CAPACITY)
    rng = np.random.default_rng(n + e)
    idx = rng.choice(e, (n, k), p=rng.dirichlet(np.full(e, 0.3))).astype(np.int32)
    idx[rng.random((n, k)) < 0.05] = -1
    idx[0, 0] = e  # past the last expert
    want = layout(jnp.asarray(idx), e, bm, "ref")
    got = jax.jit(lambda i: layout(i, e, bm, "triton"))(jnp.asarray(idx))
    for name, g, w in zip(want._fields, got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


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


def _fp4(seed, shape):
    """Random FP4 experts (every e2m1 code, UE8M0 scales 2^-7 .. 2^-5: outputs of O(1) at these widths)."""
    return random_fp4(np.random.default_rng(seed), shape, (120, 123))


@pytest.mark.parametrize(
    "n,cfg",
    [
        (1, DECODE_CFG),
        (37, DECODE_CFG),
        (37, GemmConfig(16, 64, 128, 4, 4)),
        (1000, PREFILL_CFG),
        (1000, GemmConfig(64, 128, 128, 4, 4)),
        (1000, GemmConfig(128, 128, 64, 8, 3)),
        (37, Fp4Config(**vars(DECODE_CFG), fp4_decode="bits")),  # code by code, the PTX decode's slow twin
        (1000, Fp4Config(**vars(PREFILL_CFG), fp4_decode="bits")),
    ],
)
def test_moe_experts_fp4_triton_matches_dense(n, cfg):
    """FP4 experts read as stored (each tile decoded in registers) against the model's dense twin on the same
    weights made dense in float32: the decode is exact, so the error is the bf16 kernels' own (the bound of
    `test_moe_experts_triton_matches_dense`)."""
    x, w, idx, *_ = _moe(n, n, 512, 256, 32, 6)
    q1, q3, q2 = _fp4(1, (32, 256, 512)), _fp4(3, (32, 256, 512)), _fp4(2, (32, 512, 256))
    out = jax.jit(lambda *a: moe_experts(*a, 10.0, impl="triton", cfg=cfg))(x, w, idx, q1, q2, q3)
    dense32 = [dense(q, jnp.float32) for q in (q1, q2, q3)]
    ref = jax.jit(lambda *a: experts_dense(*a, 10.0))(x.astype(jnp.float32), w, idx, *dense32)
    assert out.dtype == BF16
    assert float(jnp.abs(ref).mean()) > 0.1  # outputs of O(1): the scales were not chosen to vanish
    assert_close(out.astype(jnp.float32), ref, 2e-2)


@pytest.mark.parametrize("decode", ["asm", "bits"])
@pytest.mark.parametrize("cfg", [DECODE_CFG, PREFILL_CFG])
def test_fp4_decode_on_the_gpu_is_the_format(cfg, decode):
    """Identity activations read the decoded weight tile back through the GEMM (a product with 1.0 and sums of
    zeros are exact): every e2m1 code under scales 2^-124 .. 2^125 (products stay normal: whether the tensor
    cores keep subnormal inputs is not what this tests; the PTX's subnormal results are checked in numpy),
    for the inline PTX decode and the code-by-code one, against the format computed in numpy float64."""
    rng = np.random.default_rng(10)
    n, k = 256, 512
    codes = rng.integers(0, 16, (1, n, k)).astype(np.uint8)
    codes[0, 0, :16] = np.arange(16)
    scale = rng.integers(3, 253, (1, n, k // fp4.GROUP)).astype(np.uint8)
    w = from_fp4(jnp.asarray(fp4.pack_e2m1(codes)), jnp.asarray(scale))
    a = jnp.eye(k, dtype=BF16)
    c = Fp4Config(**vars(cfg), fp4_decode=decode)
    got = np.asarray(
        jax.jit(lambda a, w: grouped_gemm(a, w, jnp.zeros((k,), jnp.int32), impl="triton", cfg=c))(a, w)
    )
    exact = fp4.E2M1_TABLE[codes[0]].astype(np.float64) * 2.0 ** (np.repeat(scale[0], 32, -1) - 127.0)
    want = exact.T.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))  # -0.0 sums to +0.0


@pytest.mark.parametrize(
    "n,cfg",
    [
        (1, None),  # batch-1 decode, default tiles (gate/up fused, 32 columns; down split along K)
        (1, Fp8Config(16, 128, 128, 4, 4, split_k=4)),  # down: 2 K blocks over 4 splits, two of them empty
        (37, FP8_DECODE_CFG),
        (37, GemmConfig(16, 64, 128, 4, 4)),
        (37, GemmConfig(16, 128, 256, 4, 4)),  # two K blocks a loop step in both kernels
        (1, Fp8Config(16, 128, 256, 4, 4, split_k=4)),  # down: 2 K blocks, one step, over 4 splits
        (1000, None),  # prefill-sized, the default tiling (64-row wgmma tiles)
        (1000, GemmConfig(128, 128, 128, 8, 4)),
    ],
)
def test_moe_experts_fp8_triton_within_bf16_error(n, cfg):
    """FP8 experts read as stored: the Triton grouped GEMMs against the jnp reference, both in bf16, judged
    against the reference in float32 (same quantized weights; activations quantized by each path).

    The bf16 reference runs op by op. Jitted, XLA keeps its bf16 gate and up in float32 (excess precision
    is allowed by default), while the kernels store them in bf16 before the SwiGLU output is rounded to
    e4m3; that rounding alone is most of the bf16 path's error (1.1-1.5e-2 measured on the H200 for both
    paths run op by op, 2.3e-3 for the jitted reference at n 1)."""
    x, w, idx, *ws = _moe(n, n, 512, 256, 32, 6)
    q1, q2, q3 = (quantize(v.astype(jnp.float32)) for v in ws)

    def run(x, impl):
        return moe_experts_fp8(x, w, idx, q1, q2, q3, 10.0, impl=impl, cfg=cfg)

    fast = jax.jit(run, static_argnums=1)(x, "triton")
    slow, truth = run(x, "ref"), run(x.astype(jnp.float32), "ref")
    assert fast.dtype == BF16 and truth.dtype == jnp.float32
    truth = np.asarray(truth, np.float64)
    err = lambda a: float(np.linalg.norm(np.asarray(a, np.float64) - truth) / np.linalg.norm(truth))  # noqa: E731
    assert err(fast) <= 2 * err(slow) + 1e-3, (err(fast), err(slow))


@pytest.mark.parametrize("gate_dtype,rtol", [(jnp.float32, 1e-3), (BF16, 4e-3)])
@pytest.mark.parametrize(
    "n,bm,bn,bk", [(1, 16, 32, 128), (37, 16, 64, 128), (300, 64, 128, 128), (37, 16, 64, 256)]
)
def test_fused_fp8_swiglu_matches_ref(n, bm, bn, bk, gate_dtype, rtol):
    """The fused FP8 gate/up/SwiGLU kernel against its jnp reference on the picks' rows (padding rows are left
    unwritten), with one or two 128-wide K blocks a loop step (bk). Float32 gate and up: the kernel's per-block
    FP8 sums against XLA's float32 product of the dequantized operands. Rounded to bf16 first, in both: where
    the two float32 sums differ at all, a gate or up can round to the neighbouring bf16 value (one step, 2^-8
    relative), so the bound is one such step (a misplaced scale costs O(1))."""
    x, _, idx, w1, _, w3 = _moe(50 + n, n, 512, 256, 32, 6)
    q1, q3 = quantize(w1.astype(jnp.float32)), quantize(w3.astype(jnp.float32))
    lay = layout(idx, 32, bm, "ref")
    xq, xs = quantize_act(x)
    args = (xq, xs, lay.rows, q1.values, q1.scale, q3.values, q3.scale, lay.m_indices)
    cfg = GemmConfig(bm, bn, bk, 4, 4)
    run = lambda *a: grouped_swiglu_contiguous(*a, 10.0, gate_dtype, impl="triton", cfg=cfg)  # noqa: E731
    got = np.asarray(jax.jit(run)(*args))
    want = np.asarray(grouped_swiglu_contiguous(*args, 10.0, gate_dtype, impl="ref"))
    picks = np.asarray(lay.m_indices) >= 0
    assert picks.sum() == n * 6 and np.abs(want[picks]).max() > 0.1
    assert_close(got[picks], want[picks], rtol)


@pytest.mark.parametrize("weights", ["bf16", "fp4"])
@pytest.mark.parametrize("cfg", [DECODE_CFG, GemmConfig(16, 64, 128, 4, 4)])
def test_masked_triton_matches_ref(cfg, weights):
    """bf16 weights, and FP4 ones read as stored (gate, up and down)."""
    x, w, idx, w1, w2, w3 = _moe(3, 64, 512, 256, 32, 6)
    g, mm = 32, 64
    if weights == "fp4":
        w1, w3, w2 = _fp4(4, (g, 256, 512)), _fp4(5, (g, 256, 512)), _fp4(6, (g, 512, 256))
    a = jax.random.normal(jax.random.key(9), (g, mm, 512), BF16)
    cnt = jnp.bincount(idx.ravel(), length=g).astype(jnp.int32)
    live = np.arange(mm)[None] < np.asarray(cnt)[:, None]
    h = grouped_swiglu_masked(a, w1, w3, cnt, 10.0, impl="triton", cfg=cfg)
    hr = grouped_swiglu_masked(a, w1, w3, cnt, 10.0, impl="ref")
    assert_close(np.asarray(h, np.float32)[live], np.asarray(hr, np.float32)[live], 2e-2)
    y = grouped_gemm_masked(hr, w2, cnt, impl="triton", cfg=cfg)
    yr = grouped_gemm_masked(hr, w2, cnt, impl="ref")
    assert_close(np.asarray(y, np.float32)[live], np.asarray(yr, np.float32)[live], 1e-2)


@pytest.mark.parametrize("mm", [64, 48])
def test_masked_auto_takes_a_tile_that_fits_the_rows_per_group(mm):
    """No config: 64 rows per group (V4-Flash's decode capacity) and 48 are not multiples of the 128-row
    default tile; the masked GEMMs, bf16 and FP8, take tiles that divide them."""
    g, k, n = 8, 512, 256
    cnt = jnp.asarray([0, mm, 5, mm - 1, 1, 0, 17, 3], jnp.int32)
    live = np.arange(mm)[None] < np.asarray(cnt)[:, None]
    a = jax.random.normal(jax.random.key(20), (g, mm, k), BF16)
    b = jax.random.normal(jax.random.key(21), (g, n, k), BF16) * k**-0.5
    got = grouped_gemm_masked(a, b, cnt)
    assert_close(
        np.asarray(got, np.float32)[live],
        np.asarray(grouped_gemm_masked(a, b, cnt, impl="ref"), np.float32)[live],
        1e-2,
    )
    f32 = jnp.float32
    am, am_s = quantize_act(jax.random.normal(jax.random.key(22), (g, mm, k), f32))
    bg, bg_s = quantize_weight(jax.random.normal(jax.random.key(23), (g, n, k), f32))
    out = grouped_masked(am, am_s, bg, bg_s, cnt, f32)
    ref = grouped_masked(am, am_s, bg, bg_s, cnt, f32, impl="ref")
    assert_close(np.asarray(out)[live], np.asarray(ref)[live], 4e-4)  # the FP8 accumulator, as below


@pytest.mark.parametrize(
    "cfg",
    [
        GemmConfig(128, 128, 128, 8, 4),
        GemmConfig(64, 128, 128, 4, 4),
        Fp8Config(64, 128, 128, 4, 4, split_k=3),
    ],
)
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
    [None, Fp8Config(64, 64, 128, 4, 6, split_k=4), Fp8Config(64, 32, 128, 4, 6, split_k=3)]
    + [Fp8Config(64, 64, 256, 4, 4, split_k=3), Fp8Config(16, 64, 512, 4, 3, split_k=2)],
)
def test_fp8_split_k_matches_ref(cfg):
    """Decode-sized m with split-K (None: the shape's default config), K = 1000: 8 K blocks, the last
    partial, so some splits get fewer blocks than others; block_k 256 and 512 take 2 and 4 of them a loop
    step (a split of 3 blocks in steps of 2 reaching into the next split's)."""
    f32 = jnp.float32
    a, a_s = quantize_act(jax.random.normal(jax.random.key(11), (37, 1000), f32))
    b, b_s = quantize_weight(jax.random.normal(jax.random.key(12), (384, 1000), f32))
    ref = fp8_gemm(a, a_s, b, b_s, f32, impl="ref")
    assert_close(fp8_gemm(a, a_s, b, b_s, f32, impl="triton", cfg=cfg), ref, 4e-4)  # as above
    out = fp8_gemm(a, a_s, b, b_s, jnp.bfloat16, impl="triton", cfg=cfg)
    assert out.dtype == jnp.bfloat16
    assert_close(out.astype(f32), ref, 1e-2)


def _contiguous_case(seed, e, n, d, counts):
    """fp8 rows in the contiguous layout for the given rows per group (each padded to 128), then 384 rows of
    padding; fresh weights."""
    f32 = jnp.float32
    bg, bg_s = quantize_weight(jax.random.normal(jax.random.key(seed), (e, n, d), f32))
    groups = np.concatenate([np.full(-(-c // 128) * 128, -1, np.int32) for c in counts] + [np.full(384, -1)])
    at = 0
    for gid, c in enumerate(counts):
        groups[at : at + c] = gid
        at += -(-c // 128) * 128
    x = jax.random.normal(jax.random.key(seed + 1), (groups.size, d), f32)
    a, a_s = quantize_act(x)
    return a, a_s, bg, bg_s, jnp.asarray(groups.astype(np.int32))


@needs_tilelang_gpu
@pytest.mark.parametrize(
    "n, half_tiles, persistent",
    [
        (512, False, ""),  # 128x256 tiles
        (512, True, ""),
        (384, False, ""),  # 128x128 (256 does not divide 384)
        (384, True, ""),
        (512, True, "static"),  # one CTA per SM walking the live tiles
        (512, False, "atomic"),
    ],
)
def test_tilelang_grouped_contiguous_matches_ref(n, half_tiles, persistent):
    """The TileLang grouped kernel against the f32 reference on the live rows: groups of 1, 128, 129, 300 and
    0 rows (a group with none takes no tile), 256 rows of padding tiles at the end (skipped), a tile of a
    group past the last weight (its rows are 0 in the reference and in the kernel: TMA reads zeros there), called
    through the public op in a jit and inside a scan. With `half_tiles` three tiles (the groups of 1, 129 and
    300 rows) have padding in rows 64-127, which their second warpgroup skips: those rows come out 0. The
    persistent kernel (`persistent`) takes the same contract."""
    from djax.kernels.fp8_gemm_tilelang import default_grouped_tiling

    e, d = 6, 1024
    a, a_s, b, b_s, groups = _contiguous_case(n, e, n, d, [1, 128, 129, 0, 300, 77])
    groups = groups.at[-384:-256].set(e)  # one tile of a group past the last weight, before the padding
    live = np.asarray(groups) >= 0
    tiling = dataclasses.replace(default_grouped_tiling(n, d), half_tiles=half_tiles, persistent=persistent)
    f = lambda *z: grouped_contiguous(*z, impl="tilelang", tiling=tiling)  # noqa: E731
    out = jax.jit(f)(a, a_s, b, b_s, groups)
    ref = grouped_contiguous(a, a_s, b, b_s, groups, jnp.float32, impl="ref")
    assert out.dtype == jnp.bfloat16 and out.shape == (groups.shape[0], n)
    assert_close(np.asarray(out.astype(jnp.float32))[live], np.asarray(ref)[live], BF16_OUT_RTOL)
    if half_tiles:
        g = np.asarray(groups).reshape(-1, 128)
        idle = (g[:, 0] >= 0) & (g[:, 64] < 0)  # live tiles whose second half is padding
        assert idle.sum() == 3
        assert not np.asarray(out).reshape(-1, 128, n)[idle, 64:].astype(np.float32).any()

    def body(c, _):
        return c, f(a, a_s, b, b_s, groups).astype(jnp.float32)

    _, ys = jax.jit(lambda: jax.lax.scan(body, 0, None, length=2))()
    for y in np.asarray(ys):
        assert_close(y[live], np.asarray(ref)[live], BF16_OUT_RTOL)


def _layout(counts, rows, past_last=0):
    """m_indices for groups of `counts` rows (each padded to 128) then padding up to `rows`; with `past_last`
    that many tiles of a group past the last weight (counts' length) ahead of the padding."""
    g = np.full(rows, -1, np.int32)
    at = 0
    for gid, c in enumerate(counts):
        g[at : at + c] = gid
        at += -(-c // 128) * 128
    g[at : at + 128 * past_last] = len(counts)
    assert at + 128 * past_last <= rows
    return g


def _persistent_calls(tiling, layouts, n, d, groups, seed):
    """The grouped kernel with `tiling` over each layout (fresh inputs each), all in one jit and as the steps
    of a scan, each output against the f32 reference on its live rows; with half tiles, the idle halves 0."""
    f32 = jnp.float32
    calls = []
    for i, g in enumerate(layouts):
        b, b_s = quantize_weight(jax.random.normal(jax.random.key(seed + 2 * i), (groups, n, d), f32))
        a, a_s = quantize_act(jax.random.normal(jax.random.key(seed + 2 * i + 1), (g.size, d), f32))
        calls.append((a, a_s, b, b_s, jnp.asarray(g)))
    f = lambda *z: grouped_contiguous(*z, impl="tilelang", tiling=tiling)  # noqa: E731
    outs = jax.jit(lambda cs: [f(*c) for c in cs])(calls)
    stacked = [jnp.stack(parts) for parts in zip(*calls)]
    _, scanned = jax.jit(lambda xs: jax.lax.scan(lambda c, x: (c, f(*x)), 0, xs))(stacked)
    for i, (c, g) in enumerate(zip(calls, layouts)):
        live = g >= 0
        ref = np.asarray(grouped_contiguous(*c, f32, impl="ref"))
        tile_rows = g.reshape(-1, 128)
        idle = (tile_rows[:, 0] >= 0) & (tile_rows[:, 64] < 0)
        for out in (outs[i], scanned[i]):
            got = np.asarray(out.astype(f32))
            if live.any():  # (a layout with no live row leaves every row unwritten)
                assert_close(got[live], ref[live], BF16_OUT_RTOL)
            if tiling.half_tiles:
                assert not got.reshape(-1, 128, n)[idle, 64:].any()


@needs_tilelang_gpu
@pytest.mark.parametrize("walk", ["static", "atomic"])
@pytest.mark.parametrize("half_tiles", [True, False])
def test_tilelang_grouped_persistent_many_tiles_a_cta(walk, half_tiles):
    """The grouped persistent kernel with about three live tiles a CTA (24 groups of 0 to 700 rows, random,
    over 8 tile columns, then a tile of a group past the last weight and padding), three layouts with other
    group sizes over the same rows, in one jit and as three steps of a scan, each against the f32 reference:
    every launch lists its own live tile rows, and the atomic walk's counter is back at zero after each."""
    from djax.kernels.fp8_gemm_tilelang import default_grouped_tiling

    e, n, d, rows = 24, 2048, 512, 10240
    rng = np.random.default_rng(5)
    layouts = []
    for _ in range(3):
        counts = rng.integers(0, 700, e)
        counts[:3] = (1, 64, 65)  # the smallest groups: one row, a whole half, a row into the second half
        layouts.append(_layout(counts, rows, past_last=1))
        tile_rows = layouts[-1].reshape(-1, 128)
        assert (tile_rows[:, 0] >= 0).sum() * (n // 256) > 2 * 132  # more live tiles than two a CTA
        assert ((tile_rows[:, 0] >= 0) & (tile_rows[:, 64] < 0)).any()
    tiling = dataclasses.replace(default_grouped_tiling(n, d), half_tiles=half_tiles, persistent=walk)
    _persistent_calls(tiling, layouts, n, d, e, seed=70)


@needs_tilelang_gpu
@pytest.mark.parametrize("walk", ["static", "atomic"])
def test_tilelang_grouped_persistent_long_lists_and_none_live(walk):
    """The list of live tile rows built over many chunks: 1,100 tile rows, every other one padding (a layout
    the contract allows), at 2 k blocks a tile (fewer than the ring's stages) in row-major tile order; then a
    layout with no live tile at all (nothing to compute; rows unwritten), followed in the same jit by a live
    one, which the atomic walk's counter must have been reset for."""
    from djax.kernels.fp8_gemm_tilelang import WsTiling

    n, d, groups, tiles = 256, 256, 3, 1100
    every_other = np.full((tiles, 128), -1, np.int32)
    every_other[::2, :100] = (np.arange(tiles)[::2] % groups)[:, None]
    every_other[1::4, 0] = 1  # some tiles of padding but for their first row: live, one row each
    tiling = WsTiling(128, 256, 3, 0, scales_ahead=True, half_tiles=True, persistent=walk)
    _persistent_calls(tiling, [every_other.reshape(-1)], n, d, groups, seed=90)
    none = np.full(tiles * 128, -1, np.int32)
    _persistent_calls(tiling, [none, every_other.reshape(-1), none], n, d, groups, seed=95)


@needs_tilelang_gpu
def test_grouped_contiguous_auto_runs_the_persistent_default(monkeypatch):
    """`grouped_contiguous(impl="auto")` on a layout of more than two waves of 128x256 tiles takes TileLang
    with no tiling given, whose default for the layout's rows is the persistent kernel's atomic walk with
    whole tiles: the kernel built is that one, and its output matches the f32 reference on the live rows
    (groups of 1 to 900 rows, a group of none, padding after the last)."""
    from djax.kernels import fp8_gemm_tilelang

    built = []
    ws_kernel = fp8_gemm_tilelang.ws_kernel
    monkeypatch.setattr(fp8_gemm_tilelang, "ws_kernel", lambda *z: built.append(z) or ws_kernel(*z))
    counts = [1, 900, 0, 640, 129, 700, 64, 513]
    mi = _layout(counts, 48 * 128)
    n, d, e = 2048, 512, len(counts)
    b, b_s = quantize_weight(jax.random.normal(jax.random.key(120), (e, n, d), jnp.float32))
    a, a_s = quantize_act(jax.random.normal(jax.random.key(121), (mi.size, d), jnp.float32))
    groups = jnp.asarray(mi)
    out = jax.jit(grouped_contiguous)(a, a_s, b, b_s, groups)
    ((m, nn, k, tiling, g),) = built
    assert (m, nn, k, g) == (mi.size, n, d, e) and tiling.persistent == "atomic" and not tiling.half_tiles
    live = mi >= 0
    ref = grouped_contiguous(a, a_s, b, b_s, groups, jnp.float32, impl="ref")
    assert out.dtype == BF16
    assert_close(np.asarray(out.astype(jnp.float32))[live], np.asarray(ref)[live], BF16_OUT_RTOL)


def _err_against(truth):
    truth = np.asarray(truth, np.float64)
    return lambda a: float(np.linalg.norm(np.asarray(a, np.float64) - truth) / np.linalg.norm(truth))


@needs_tilelang_gpu
def test_tilelang_swiglu_contiguous_within_bf16_error():
    """Gate and up as two TileLang grouped GEMMs (the persistent default for the layout) and the SwiGLU in
    XLA, against the reference that rounds gate and up to bf16 too, both judged against the SwiGLU of the
    unrounded float32 products; padding rows 0. 700 tokens of top-6 over 24 experts in 128-row groups."""
    x, _, idx, *ws = _moe(7, 700, 512, 256, 24, 6)
    q1, _, q3 = (quantize(v.astype(jnp.float32)) for v in ws)
    lay = layout(idx, 24, 128, "ref")
    xq, xs = quantize_act(x.astype(jnp.float32))
    args = (xq, xs, lay.rows, q1.values, q1.scale, q3.values, q3.scale, lay.m_indices)
    fast = jax.jit(lambda *a: grouped_swiglu_contiguous(*a, 10.0, impl="tilelang"))(*args)
    slow = grouped_swiglu_contiguous(*args, 10.0, impl="ref")
    truth = grouped_swiglu_contiguous(*args, 10.0, jnp.float32, impl="ref")
    live = np.asarray(lay.m_indices) >= 0
    assert not np.asarray(fast)[~live].any()
    err = _err_against(np.asarray(truth)[live])
    assert err(np.asarray(fast)[live]) <= 2 * err(np.asarray(slow)[live]) + 1e-3


@needs_tilelang_gpu
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_moe_experts_fp8_tilelang_within_bf16_error(scale_fmt):
    """`moe_experts_fp8(impl="tilelang")`: 128-row groups, gate/up and down by TileLang's grouped GEMM, against
    the jnp reference in bf16, both judged against the reference in float32 (as the Triton test); a pick
    dropped (an id past the experts); UE8M0 weight scales too."""
    x, w, idx, *ws = _moe(1000, 1000, 512, 256, 32, 6)
    idx = idx.at[3, 2].set(32)
    q1, q2, q3 = (quantize(v.astype(jnp.float32), scale_fmt=scale_fmt) for v in ws)

    def run(x, impl):
        return moe_experts_fp8(x, w, idx, q1, q2, q3, 10.0, impl=impl)

    fast = jax.jit(run, static_argnums=1)(x, "tilelang")
    slow, truth = run(x, "ref"), run(x.astype(jnp.float32), "ref")
    assert fast.dtype == BF16 and truth.dtype == jnp.float32
    err = _err_against(truth)
    assert err(fast) <= 2 * err(slow) + 1e-3, (err(fast), err(slow))
