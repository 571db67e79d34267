"""Routed experts with FP8 weights read as stored (`moe_experts_fp8`): the jnp path against a numpy brute force
that quantizes each pick's activations itself, the Triton kernels (interpreted, f32 stand-ins) against the jnp
path, and the weights it refuses."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from checks import assert_close, needs_triton_interp

from djax.kernels import fp8_gemm
from djax.kernels.fp8_gemm_ref import quantize_act
from djax.kernels.fp8_gemm_triton import Fp8Config
from djax.kernels.grouped_gemm import GemmConfig
from djax.kernels.moe_experts import (
    FP8_DECODE_CFG,
    FP8_PREFILL_CFG,
    PICK_ROWS_MIN_BYTES,
    fp8_split,
    layout,
    moe_experts_fp8,
    quantize_down_acts,
    quantize_padded_rows,
    quantize_pick_rows,
    swiglu_config,
)
from djax.quant import QArray, quantize
from tests.fp8_numpy import quantize_rows


def _np_dense(w: QArray):
    s = np.repeat(np.repeat(np.asarray(w.scale.astype(jnp.float32), np.float64), 128, -2), 128, -1)
    return np.asarray(w.values).astype(np.float64) * s


def _np_moe_fp8(x, weights, idx, w1, w2, w3, limit):
    """One pick at a time: quantized token row times its expert's dequantized matrices, SwiGLU in float64,
    its output quantized again before w2; picks with an id outside [0, e) contribute nothing."""
    x = np.asarray(x, np.float64)
    d1, d2, d3 = _np_dense(w1), _np_dense(w2), _np_dense(w3)
    e = d1.shape[0]
    ue8m0 = w1.scale.dtype == ml_dtypes.float8_e8m0fnu  # the weights' scale format sets the activations'
    xq = quantize_rows(x, ue8m0)
    out = np.zeros_like(x)
    for t, (ids, ws) in enumerate(zip(np.asarray(idx), np.asarray(weights, np.float64))):
        for ex, wt in zip(ids, ws):
            if not 0 <= ex < e:
                continue
            gate, up = d1[ex] @ xq[t], d3[ex] @ xq[t]
            if limit > 0:
                gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
            h = gate / (1 + np.exp(-gate)) * up
            out[t] += wt * (d2[ex] @ quantize_rows(h[None], ue8m0)[0])
    return out


def _inputs(seed, n, d, f, e, k, scale_fmt=None):
    """Uneven loads (one expert takes more picks than a 16-row tile, two none) and uneven magnitudes, so that
    every weight block and activation group has a scale of its own; weight scales as `scale_fmt` says."""
    rng = np.random.default_rng(seed)
    probs = np.r_[0.5, 0.2, 0.0, 0.0, np.full(e - 4, 0.3 / (e - 4))]
    idx = np.stack([rng.choice(e, k, replace=False, p=probs) for _ in range(n)]).astype(np.int32)
    weights = rng.random((n, k)).astype(np.float32)
    x = rng.standard_normal((n, d)).astype(np.float32) * np.linspace(0.2, 3.0, d, dtype=np.float32)

    def w(o, i):
        uneven = np.linspace(0.3, 2.0, o)[:, None] * np.linspace(2.0, 0.5, i)[None, :]
        w = rng.standard_normal((e, o, i)) * i**-0.5 * uneven
        return quantize(jnp.asarray(w, jnp.float32), scale_fmt=scale_fmt)

    return jnp.asarray(x), jnp.asarray(weights), jnp.asarray(idx), w(f, d), w(d, f), w(f, d)


@pytest.mark.parametrize(
    "n,limit,scale_fmt", [(37, 1.5, None), (37, 0.0, None), (1, 1.5, None), (37, 1.5, "ue8m0")]
)
def test_ref_matches_numpy(n, limit, scale_fmt):
    """scale_fmt "ue8m0": weights with power-of-two scales, whose activations (x, and the SwiGLU output before
    the down projection) are quantized with power-of-two scales too, as DeepSeek's inference does."""
    x, weights, idx, w1, w2, w3 = _inputs(n, n, 256, 128, 6, 3, scale_fmt)
    idx = idx.at[0, 1].set(-1).at[n // 2, 0].set(6)  # ids outside [0, e): dropped
    got = np.asarray(jax.jit(lambda *a: moe_experts_fp8(*a, limit, impl="ref"))(x, weights, idx, w1, w2, w3))
    want = _np_moe_fp8(x, weights, idx, w1, w2, w3, limit)
    # float32 sums against float64 ones; a rounding of h to e4m3 that lands the other side of a tie in one of
    # the two costs one e4m3 step of one element, far under this bound (a scale misplaced costs O(1))
    assert_close(got, want, 1e-4)
    if n > 1:
        assert np.abs(got[0]).max() > 0  # the token with a dropped pick keeps its others


@needs_triton_interp
@pytest.mark.parametrize("n,row_quant", [(37, False), (37, True), (1, True), (1, False)])
def test_interpreted_matches_ref(n, row_quant, monkeypatch):
    """The Triton kernels interpreted; the down projection's activations quantized by `row_quant`'s kernel
    (its count of picks an expert lowered to 0 here) or, below that count as at these sizes, by XLA."""
    from djax.kernels import moe_experts
    from djax.kernels import row_quant as rq

    if row_quant:
        monkeypatch.setattr(moe_experts, "ROW_QUANT_MIN_PICKS_PER_EXPERT", 0)
    calls = []
    real = rq.quantize_rows
    monkeypatch.setattr(rq, "quantize_rows", lambda *a, **kw: calls.append(kw["impl"]) or real(*a, **kw))
    args = _inputs(10 + n, n, 256, 128, 6, 3)
    cfg = GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=1)
    run = jax.jit(lambda *a, impl: moe_experts_fp8(*a, 1.5, impl=impl, cfg=cfg), static_argnames="impl")
    assert_close(run(*args, impl="interpret"), run(*args, impl="ref"), 1e-5)
    assert calls == (["interpret"] if row_quant else [])


@needs_triton_interp
def test_interpreted_split_k_matches_ref():
    """The decode tiles with each grouped GEMM split along K, as `fp8_split` picks for a token or two."""
    args = _inputs(21, 2, 256, 128, 6, 3)
    cfg = GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=1)
    assert fp8_split(cfg, 6, 6, 128, 256).split_k == 1  # 2 K blocks: no split leaves two in each
    split = Fp8Config(**vars(cfg), split_k=2)
    run = jax.jit(
        lambda *a, impl, c: moe_experts_fp8(*a, 1.5, impl=impl, cfg=c), static_argnames=("impl", "c")
    )
    assert_close(run(*args, impl="interpret", c=split), run(*args, impl="ref", c=cfg), 1e-5)


@pytest.mark.parametrize("impl", ["ref", pytest.param("interpret", marks=needs_triton_interp)])
@pytest.mark.parametrize("n,e,block_m,ue8m0", [(32, 256, 16, True), (5, 8, 16, False), (300, 8, 64, True)])
def test_quantize_pick_rows_equals_every_row_quantized(impl, n, e, block_m, ue8m0):
    """The down projection's activations quantized from the picks' rows only, bit for bit what quantizing
    every padded row (padding zeroed) gives, with nan and huge values in the padding rows (the unwritten
    rows of skipped tiles) and picks dropped (ids outside [0, e)); under jit, as the model runs it."""
    rng = np.random.default_rng(n + e)
    idx = np.stack([rng.choice(e, 6, replace=False) for _ in range(n)]).astype(np.int32)
    idx[0, 2], idx[-1, 0] = -1, e  # dropped
    lay = layout(jnp.asarray(idx), e, block_m, impl)
    m_pad, f = lay.m_indices.shape[0], 320  # 320: a last scale block of 64 columns
    h = rng.standard_normal((m_pad, f)) * rng.uniform(0.01, 30, (m_pad, 1))
    pad = np.asarray(lay.m_indices) < 0
    # one row per pick kept; at 32 tokens 2,880 of the 3,072 rows are padding
    assert (~pad).sum() == n * 6 - 2 and pad.any()
    h[pad] = np.where(rng.random((pad.sum(), f)) < 0.5, np.nan, 3e38).astype(np.float32)
    h = jnp.asarray(h, jnp.float32)
    fast = jax.jit(quantize_pick_rows, static_argnums=2)(h, lay.pos, ue8m0)
    slow = jax.jit(quantize_padded_rows, static_argnums=2)(h, lay.m_indices, ue8m0)
    for a, b in zip(fast, slow):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    assert np.isfinite(np.asarray(fast[0], np.float32)).all() and (np.asarray(fast[1])[~pad] > 0).all()


@needs_triton_interp
@pytest.mark.parametrize("ue8m0", [False, True])
def test_quantize_down_acts_by_the_kernel_equals_every_row_quantized(ue8m0):
    """`quantize_down_acts` with `row_quant`'s kernel (interpreted): the bits of quantizing every padded row
    (padding zeroed; nan and huge values in it) on every row it writes; the rows it leaves unwritten (nan here)
    are whole runs of the kernel's BLOCK_ROWS padding rows, which no tile reads."""
    from djax.kernels.row_quant_triton import BLOCK_ROWS

    rng = np.random.default_rng(7)
    idx = np.stack([rng.choice(8, 6, replace=False) for _ in range(40)]).astype(np.int32)
    idx[0, 2] = -1  # dropped
    lay = layout(jnp.asarray(idx), 8, 64, "ref")
    m_pad, f = lay.m_indices.shape[0], 256
    h = rng.standard_normal((m_pad, f)) * rng.uniform(0.01, 30, (m_pad, 1))
    pad = np.asarray(lay.m_indices) < 0
    h[pad] = np.where(rng.random((pad.sum(), f)) < 0.5, np.nan, 3e38).astype(np.float32)
    h = jnp.asarray(h, jnp.float32)
    q, s = jax.jit(quantize_down_acts, static_argnums=(2, 3))(h, lay, ue8m0, "interpret")
    want_q, want_s = quantize_padded_rows(h, lay.m_indices, ue8m0)
    q, s = np.asarray(q, np.float32), np.asarray(s)
    skipped = np.isnan(s[:, 0])
    runs = pad.reshape(-1, BLOCK_ROWS).all(1)  # m_pad is a multiple of the layout's 64 rows
    assert skipped.any() and (skipped == np.repeat(runs, BLOCK_ROWS)).all()
    np.testing.assert_array_equal(np.asarray(want_q, np.float32)[~skipped], q[~skipped])
    np.testing.assert_array_equal(np.asarray(want_s)[~skipped], s[~skipped])


@pytest.mark.parametrize("tokens,scatter", [(1, False), (5, False), (6, True), (32, True)])
def test_quantize_down_acts_reads_the_picks_rows_from_its_size(tokens, scatter):
    """V4-Flash's experts (256, 6 picks a token, 2,048 columns, 16-row tiles): from 6 tokens (576 padded rows,
    4.7 MB of float32) the picks' rows are read and scattered; below (5 tokens: 480 rows, 3.9 MB), every row
    is quantized."""
    idx = jnp.asarray(np.arange(tokens * 6).reshape(tokens, 6) % 256, jnp.int32)
    lay = layout(idx, 256, 16, "ref")
    h = jax.ShapeDtypeStruct((lay.m_indices.shape[0], 2048), jnp.float32)
    assert (h.shape[0] * 2048 * 4 >= PICK_ROWS_MIN_BYTES) == scatter
    eqns = jax.make_jaxpr(lambda h: quantize_down_acts(h, lay, True))(h).jaxpr.eqns
    assert any(e.primitive.name == "scatter" for e in eqns) == scatter


@needs_triton_interp
@pytest.mark.parametrize(
    "gate_dtype,limit,block_k",
    [(jnp.bfloat16, 1.5, 128), (jnp.float16, 1.5, 128), (jnp.float32, 0.0, 128), (jnp.bfloat16, 1.5, 256)]
    + [(jnp.bfloat16, 1.5, 512)],
)
def test_fused_swiglu_interpreted_matches_ref(gate_dtype, limit, block_k):
    """The fused gate/up/SwiGLU kernel alone: token rows read through `rows` (one expert with more picks than a
    16-row tile, so padding rows inside a live tile, then whole tiles of padding), 192 output columns (a
    partial weight-scale block, the last of three 64-column tiles), gate and up rounded to the model's dtype;
    only the picks' rows written. block_k 256 loads both K blocks of the 256 inputs in one loop step; 512 runs
    two blocks past K."""
    x, _, idx, w1, _, w3 = _inputs(5, 9, 256, 192, 6, 3)
    lay = layout(idx, 6, 16, "ref")
    xq, xs = quantize_act(x)
    cfg = GemmConfig(block_m=16, block_n=64, block_k=block_k, num_warps=4, num_stages=1)
    args = (xq, xs, lay.rows, w1.values, w1.scale, w3.values, w3.scale, lay.m_indices, limit, gate_dtype)
    got = np.asarray(fp8_gemm.grouped_swiglu_contiguous(*args, impl="interpret", cfg=cfg))
    want = np.asarray(fp8_gemm.grouped_swiglu_contiguous(*args, impl="ref"))
    m_idx = np.asarray(lay.m_indices)
    written = np.repeat(m_idx[::16] >= 0, 16)  # tiles whose first row is a pick
    assert (m_idx >= 0).sum() == 27 and (written & (m_idx < 0)).any() and not written.all()
    assert np.isnan(got[m_idx < 0]).all()  # padding rows are left as they were, in live tiles too
    assert np.abs(want).max() > 0.1
    assert_close(got[m_idx >= 0], want[m_idx >= 0], 1e-5)


def test_fused_swiglu_refuses_bad_operands():
    """A gate dtype it cannot round to and a mismatched up weight fail at trace time, naming the problem."""
    x, _, idx, w1, _, w3 = _inputs(6, 4, 256, 128, 6, 2)
    lay = layout(idx, 6, 16, "ref")
    xq, xs = quantize_act(x)
    args = (xq, xs, lay.rows, w1.values, w1.scale, w3.values, w3.scale, lay.m_indices, 1.5)
    with pytest.raises(ValueError, match="gate_dtype must be one of"):
        fp8_gemm.grouped_swiglu_contiguous(*args, jnp.int8, impl="ref")
    bad = (*args[:5], w3.values[:, :64], *args[6:])
    with pytest.raises(ValueError, match="w3 has shape"):
        fp8_gemm.grouped_swiglu_contiguous(*bad, jnp.bfloat16, impl="ref")


def test_swiglu_config_narrows_decode_tiles():
    """V4-Flash gate/up (f 2048, 256 experts, top-6): half the GEMMs' 128 columns (two accumulators), and at
    one token 32 (6 experts x 64 tiles: 384 programs); prefill tiles keep 64-row tiles and take 64 columns;
    a caller's Fp8Config is kept as given."""
    assert swiglu_config(FP8_DECODE_CFG, 6, 256, 2048).block_n == 32
    assert swiglu_config(FP8_DECODE_CFG, 192, 256, 2048) == replace(FP8_DECODE_CFG, block_n=64)
    assert swiglu_config(FP8_PREFILL_CFG, 6 * 4096, 256, 2048) == replace(FP8_PREFILL_CFG, block_n=64)
    own = Fp8Config(**vars(FP8_DECODE_CFG), split_k=2)
    assert swiglu_config(own, 6, 256, 2048) is own


def test_fp8_split_fills_the_sms_at_decode():
    """V4-Flash experts (d 4096, f 2048, 256 experts, top-6) under the decode tiles: one token's gate and up
    (6 experts x 16 column tiles) split 4 ways and its down projection (6 x 32 tiles, 16 K blocks) 2 ways;
    at 32 tokens every GEMM has tiles enough; a config naming its split keeps it."""
    dec = FP8_DECODE_CFG
    assert fp8_split(dec, 6, 256, 2048, 4096).split_k == 4
    assert fp8_split(dec, 6, 256, 4096, 2048).split_k == 2
    assert fp8_split(dec, 192, 256, 2048, 4096).split_k == 1
    assert fp8_split(FP8_PREFILL_CFG, 6 * 4096, 256, 2048, 4096).split_k == 1
    own = Fp8Config(**vars(dec), split_k=1)
    assert fp8_split(own, 6, 256, 2048, 4096) is own
    assert fp8_split(dec, 6, 256, 2048, 4096).block_m == dec.block_m


@pytest.mark.parametrize(
    "make",
    [
        lambda w: w.astype(jnp.bfloat16),  # a plain weight
        lambda w: quantize(w, (32, 32)),  # V4.1's 32x32 blocks
        lambda w: quantize(w[:, :, :192]),  # in not a multiple of 128
    ],
    ids=["plain", "blocks32", "in192"],
)
def test_refuses_weights_it_cannot_read(make):
    x, weights, idx, w1, w2, w3 = _inputs(3, 4, 256, 128, 6, 2)
    bad = make(jnp.asarray(np.random.default_rng(0).standard_normal((6, 128, 256)), jnp.float32))
    with pytest.raises(ValueError, match="w3 is not an e4m3 QArray"):
        moe_experts_fp8(x, weights, idx, w1, w2, bad, 1.0, impl="ref")


def _tilelang_stand_in(monkeypatch):
    """`grouped_contiguous_tilelang` replaced by its reference rounded to bf16, with NaN in every padding row
    (the kernel leaves a skipped tile's rows unwritten and promises nothing for padding rows in a live tile),
    and `row_quant`'s kernel by its reference; returns the list of its calls' m_indices."""
    from djax.kernels import fp8_gemm_tilelang, moe_experts
    from djax.kernels.fp8_gemm_ref import grouped_contiguous_ref

    calls = []

    def stand_in(a, a_scale, b, b_scale, m_indices, tiling=None):
        calls.append(np.asarray(m_indices))
        f32 = jnp.float32  # (the kernel takes scales of any float dtype, as f32)
        out = grouped_contiguous_ref(a, a_scale.astype(f32), b, b_scale.astype(f32), m_indices, jnp.bfloat16)
        return jnp.where((m_indices < 0)[:, None], jnp.nan, out).astype(jnp.bfloat16)

    monkeypatch.setattr(fp8_gemm_tilelang, "grouped_contiguous_tilelang", stand_in)
    # the row-quantizing kernel (`row_quant`) as its jnp reference wherever the path would launch it: its SwiGLU
    # in the interpreter takes numpy's exp, which may round a value the other way (the kernel's own tests)
    real = moe_experts.row_quant_impl
    monkeypatch.setattr(moe_experts, "row_quant_impl", lambda *a: None if real(*a) is None else "ref")
    return calls


@pytest.mark.parametrize(
    "scale_fmt,row_quant,pick_rows",
    [
        (None, True, False),
        ("ue8m0", True, False),
        (None, False, False),
        ("ue8m0", False, True),
    ],
)
def test_tilelang_prefill_path_wires_the_gemms_as_the_reference(monkeypatch, scale_fmt, row_quant, pick_rows):
    """`moe_experts_fp8(impl="tilelang")` with the TileLang GEMM replaced by its reference: the picks in
    128-row groups, gate, up and down through that GEMM (three calls over the same layout), the SwiGLU's
    padding rows zero (the stand-in leaves NaN in every padding row), picks dropped (ids outside [0, e)), and
    the same result, bit for bit, as the jnp path in bf16 over its own layout; with UE8M0 weight scales. The
    tokens' and the SwiGLU's quantization through `row_quant.quantize_rows` (its reference), or (`row_quant`
    off) by XLA, the down projection's activations from the picks' rows (`pick_rows`) or from
    every row; the fused form's own op likewise."""
    from djax.kernels import moe_experts

    monkeypatch.setattr(moe_experts, "ROW_QUANT", row_quant)
    monkeypatch.setattr(moe_experts, "PICK_ROWS_MIN_BYTES", 0 if pick_rows else 1 << 40)
    calls = _tilelang_stand_in(monkeypatch)
    x, weights, idx, w1, w2, w3 = _inputs(40, 300, 256, 128, 6, 3, scale_fmt)
    idx = idx.at[0, 1].set(-1).at[150, 0].set(6)
    x = x.astype(jnp.bfloat16)
    got = moe_experts_fp8(x, weights, idx, w1, w2, w3, 1.5, impl="tilelang")
    want = moe_experts_fp8(x, weights, idx, w1, w2, w3, 1.5, impl="ref")
    assert got.dtype == jnp.bfloat16 and np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert np.abs(np.asarray(got[0], np.float32)).max() > 0  # the token with a dropped pick keeps its others
    assert len(calls) == 3 and all((c == calls[0]).all() for c in calls)
    m_idx = calls[0]
    starts = np.flatnonzero(np.r_[True, m_idx[1:] != m_idx[:-1]] & (m_idx >= 0))
    assert m_idx.size % 128 == 0 and (starts % 128 == 0).all() and (m_idx[::128] < 0).any()
    assert (m_idx >= 0).sum() == 300 * 3 - 2

    lay = layout(idx, 6, 128, "ref")
    xq, xs = quantize_act(x)
    s1, s3 = w1.scale.astype(jnp.float32), w3.scale.astype(jnp.float32)  # as moe_experts_fp8 passes them
    args = (xq, xs, lay.rows, w1.values, s1, w3.values, s3, lay.m_indices, 1.5)
    fused = np.asarray(fp8_gemm.grouped_swiglu_contiguous(*args, impl="tilelang"))
    ref = np.asarray(fp8_gemm.grouped_swiglu_contiguous(*args, impl="ref"))
    assert np.abs(ref).max() > 0.1 and not fused[np.asarray(lay.m_indices) < 0].any()
    np.testing.assert_array_equal(fused, ref)


def test_auto_takes_tilelang_from_the_prefill_picks(monkeypatch):
    """impl "auto" on a CUDA GPU with TileLang (both faked here; the GEMM the reference stand-in, the layout
    jnp's) takes the TileLang path from `TILELANG_MIN_PICKS_PER_EXPERT` picks an expert: its three GEMMs, the
    same bits as impl "tilelang". Below that count, with tiles given, x not bf16, widths not multiples of 128,
    or TileLang missing, it does not."""
    from djax.kernels import dispatch, moe_experts

    monkeypatch.setattr(dispatch, "on_cuda", lambda: True)
    monkeypatch.setattr(dispatch, "has_tilelang", lambda: True)
    calls = _tilelang_stand_in(monkeypatch)
    real_layout = moe_experts.layout
    monkeypatch.setattr(moe_experts, "layout", lambda idx, e, bm, impl="auto": real_layout(idx, e, bm, "ref"))
    x, weights, idx, w1, w2, w3 = _inputs(42, 300, 256, 128, 6, 3)  # 150 picks an expert
    x = x.astype(jnp.bfloat16)
    got = moe_experts_fp8(x, weights, idx, w1, w2, w3, 1.5, impl="auto")
    assert len(calls) == 3
    want = moe_experts_fp8(x, weights, idx, w1, w2, w3, 1.5, impl="tilelang")
    assert np.abs(np.asarray(want, np.float32)).max() > 0
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))

    def takes(x, picks, f=128, cfg=None, swiglu_cfg=None):
        return moe_experts.tilelang_takes(x, picks, 6, f, cfg, swiglu_cfg)

    least = moe_experts.TILELANG_MIN_PICKS_PER_EXPERT * 6
    assert takes(x, least) and not takes(x, least - 1)
    assert not takes(x.astype(jnp.float32), 900) and not takes(x[:, :192], 900) and not takes(x, 900, f=192)
    assert not takes(x, 900, cfg=FP8_PREFILL_CFG) and not takes(x, 900, swiglu_cfg=FP8_PREFILL_CFG)
    monkeypatch.setattr(dispatch, "has_tilelang", lambda: False)
    assert not takes(x, 900)
    monkeypatch.setattr(dispatch, "has_tilelang", lambda: True)
    monkeypatch.setattr(dispatch, "on_cuda", lambda: False)
    assert not takes(x, 900)


def test_row_quant_impl_follows_the_path(monkeypatch):
    """Which `row_quant` impl each `moe_experts_fp8` path takes: none for the reference, off CUDA under "auto",
    for widths not multiples of 128, or with `ROW_QUANT` off; the interpreter for "interpret"; the kernel on
    every GPU path."""
    from djax.kernels import dispatch, moe_experts

    rule = moe_experts.row_quant_impl
    assert rule("ref", 256, 128) is None and rule("auto", 256, 128) is None  # (no CUDA here)
    assert rule("interpret", 256, 128) == "interpret"
    assert rule("triton", 256, 128) == rule("tilelang", 256, 128) == "triton"
    assert rule("triton", 200, 128) is None and rule("triton", 256, 192) is None
    monkeypatch.setattr(dispatch, "on_cuda", lambda: True)
    assert rule("auto", 256, 128) == "triton"
    monkeypatch.setattr(moe_experts, "ROW_QUANT", False)
    assert rule("auto", 256, 128) is None and rule("interpret", 256, 128) is None


def test_tilelang_prefill_path_refuses_what_it_does_not_take():
    """Tiles other than 128 rows, a fused kernel's tiles, x or a gate dtype other than bf16 fail at trace time."""
    x, weights, idx, w1, w2, w3 = _inputs(41, 8, 256, 128, 6, 3)
    x = x.astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="128-row groups"):
        moe_experts_fp8(x, weights, idx, w1, w2, w3, 1.5, impl="tilelang", cfg=FP8_PREFILL_CFG)
    with pytest.raises(ValueError, match="128-row groups"):
        moe_experts_fp8(x, weights, idx, w1, w2, w3, 1.5, impl="tilelang", swiglu_cfg=FP8_PREFILL_CFG)
    with pytest.raises(ValueError, match="x must be bfloat16"):
        moe_experts_fp8(x.astype(jnp.float32), weights, idx, w1, w2, w3, 1.5, impl="tilelang")
    lay = layout(idx, 6, 128, "ref")
    xq, xs = quantize_act(x)
    args = (xq, xs, lay.rows, w1.values, w1.scale, w3.values, w3.scale, lay.m_indices, 1.5, jnp.float32)
    with pytest.raises(ValueError, match="write bfloat16"):
        fp8_gemm.grouped_swiglu_contiguous(*args, impl="tilelang")
