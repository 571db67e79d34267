"""Grouped GEMMs with FP4 weights (e2m1 codes, one UE8M0 scale per 32 inputs; V4.1's routed experts): the PTX
decode run in numpy and the kernels' code-by-code decode (interpreted, f32) against the format exactly, the
contiguous GEMMs and SwiGLU against their references (the masked ones: `test_grouped_gemm.py`), `moe_experts`
and the model's CUDA MoE path on FP4 QArrays against the model's dense experts, reading the codes as stored
(no dense copy of the stack), the refusals, and the kernels compiled for sm_90."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from checks import assert_close, needs_triton_interp, random_fp4

from djax import fp4
from djax.kernels import fp4_decode
from djax.kernels.grouped_gemm import (
    GemmConfig,
    grouped_gemm,
    grouped_gemm_masked,
    grouped_swiglu,
    grouped_swiglu_masked,
)
from djax.kernels.moe_experts import moe_experts
from djax.models.moe import experts_dense
from djax.quant import QArray, dense, from_fp4, is_ue8m0_fp4

# 32-wide K steps: the smallest the 32-input scale groups allow
SMALL = GemmConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=1)
WIDE_K = GemmConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=1)


def _contiguous_groups(sizes, bm):
    """m_indices for groups of `sizes`, each padded to bm, and one trailing empty tile."""
    mi = []
    for g, s in enumerate(sizes):
        mi += [g] * s + [-1] * (-(-s // bm) * bm - s)
    return np.array(mi + [-1] * bm, np.int32)


def _bf16_bits(x) -> np.ndarray:
    return np.asarray(x).astype(ml_dtypes.bfloat16).view(np.uint16)


def test_ptx_decode_program_is_the_format_bit_for_bit():
    """The PTX the kernels inline on CUDA, run instruction by instruction in numpy (`fp4_decode.emulate`,
    the same PROGRAM `ptx()` renders): every byte value in every position of the word under every UE8M0
    scale gives `fp4.dequantize_fp4`'s bf16 bits, signed zeros and the nan of scale byte 255 included."""
    rng = np.random.default_rng(8)
    scales = np.arange(256, dtype=np.uint8)
    # every byte value at each of the four positions of a word, under every scale
    words = np.stack([np.roll(np.arange(256), 64 * j) for j in range(4)], -1).astype(np.uint8)  # [256, 4]
    words = np.concatenate([words, rng.integers(0, 256, (256, 4), dtype=np.uint8)])
    packed = np.repeat(words[None], 256, 0)  # [scale, word, byte]
    # the scales as the kernels hand them to the PTX: bf16 2^(s - 127) (exact for every byte but 255, nan)
    with np.errstate(over="ignore"):
        scale_bits = _bf16_bits(2.0 ** (scales.astype(np.float64) - 127))
    scale_bits[255] = 0x7FC0
    s_pair = scale_bits.astype(np.uint32) * 0x10001  # both halves of a bf16x2
    w32 = packed.view(np.uint32)[..., 0]  # little-endian: byte 0 lowest
    s2 = np.broadcast_to(s_pair[:, None], w32.shape)
    lo01, lo23, hi01, hi23 = fp4_decode.emulate(w32, s2, s2)
    got = np.zeros((*w32.shape, 8), np.uint16)  # codes 2j (low nibble) and 2j + 1 of byte j
    for j, (lo, hi) in enumerate([(lo01, hi01), (lo01, hi01), (lo23, hi23), (lo23, hi23)]):
        half = 16 * (j % 2)
        got[..., 2 * j] = (lo >> half) & 0xFFFF
        got[..., 2 * j + 1] = (hi >> half) & 0xFFFF
    # in numpy float64: XLA on CPU flushes subnormal products (scale bytes 0 and 1) to zero, the GPU does not
    codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(*packed.shape[:-1], 8)
    exact = fp4.E2M1_TABLE[codes].astype(np.float64) * 2.0 ** (scales[:, None, None].astype(np.float64) - 127)
    exact[scales == 255] = np.nan
    with np.errstate(over="ignore"):  # 6 x 2^127 is inf in bf16, as on the GPU
        want = exact.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(exact)
    assert nan.any() and (nan == (scales[:, None, None] == 255)).all()
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert ((got[nan] & 0x7F80) == 0x7F80).all() and (got[nan] & 0x7F).all()  # nan where the reference has it


@needs_triton_interp
def test_kernel_decodes_every_code_and_scale_exactly():
    """Identity activations make each output row one input column of the weight, so the kernel's decoded
    tile is read back directly: every e2m1 code under scales from 2^-127 to 2^125, against
    `fp4.dequantize_fp4`, exactly (on CPU both flush products below 2^-126 to zero: the subnormal ones are
    the PTX decode's test's, which runs in numpy float64); a scale byte of 255 (nan in float8_e8m0fnu) gives nan there."""
    rng = np.random.default_rng(0)
    n, k = 20, 96  # n past the 16-wide tiles' edge
    codes = rng.integers(0, 16, (1, n, k)).astype(np.uint8)
    codes[0, 0, :16] = np.arange(16)
    # 252 is the largest whose 6 x 2^(s - 127) is finite in float32 (an inf would make 0 x inf = nan in the sums)
    scale = rng.choice([0, 1, 2, 60, 126, 127, 128, 200, 251, 252], (1, n, k // fp4.GROUP)).astype(np.uint8)
    w = from_fp4(jnp.asarray(fp4.pack_e2m1(codes)), jnp.asarray(scale))
    a = jnp.eye(k, dtype=jnp.float32)
    mi = jnp.zeros((k,), jnp.int32)
    got = np.asarray(grouped_gemm(a, w, mi, impl="interpret", cfg=SMALL))
    want = np.asarray(fp4.dequantize_fp4(w.values, w.scale, jnp.float32))[0].T
    # equal as numbers: a sum of products cannot keep -0.0 (-0 + 0 = +0), every other bit pattern must match
    np.testing.assert_array_equal(got, want)

    scale[0, 3, 1] = 255
    w = from_fp4(jnp.asarray(fp4.pack_e2m1(codes)), jnp.asarray(scale))
    got = np.asarray(grouped_gemm(a, w, mi, impl="interpret", cfg=SMALL))
    ref = np.asarray(grouped_gemm(a, w, mi, impl="ref"))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    assert np.isnan(got[:, 3]).all() and not np.isnan(np.delete(got, 3, axis=1)).any()


@needs_triton_interp
@pytest.mark.parametrize("cfg", [SMALL, WIDE_K], ids=["k32", "k64"])
def test_contiguous_fp4_matches_reference(cfg):
    """Rows gathered through `rows`, uneven groups, an empty one; k 160 is not a multiple of 64-wide K
    steps (their second half reads past the row, masked), n 40 not of the column tiles."""
    rng = np.random.default_rng(1)
    g, n, k, n_src = 4, 40, 160, 9
    mi = _contiguous_groups([5, 0, 20, 3], cfg.block_m)
    rows = np.where(mi >= 0, rng.integers(0, n_src, mi.size), -1).astype(np.int32)
    a = jnp.asarray(rng.standard_normal((n_src, k)), jnp.float32)
    w1, w3 = random_fp4(rng, (g, n, k)), random_fp4(rng, (g, n, k))
    live = mi >= 0
    mi, rows = jnp.asarray(mi), jnp.asarray(rows)
    out = grouped_gemm(a, w1, mi, rows, impl="interpret", cfg=cfg)
    want = grouped_gemm(a, w1, mi, rows, impl="ref")
    assert_close(np.asarray(out)[live], np.asarray(want)[live], 1e-5)
    h = grouped_swiglu(a, w1, w3, mi, 1.5, rows, impl="interpret", cfg=cfg)
    hr = grouped_swiglu(a, w1, w3, mi, 1.5, rows, impl="ref")
    assert_close(np.asarray(h)[live], np.asarray(hr)[live], 1e-5)
    # the reference is the dense weight's: the same numbers as the plain kernels on dense weights
    dense_out = grouped_gemm(a, dense(w1, jnp.float32), mi, rows, impl="interpret", cfg=cfg)
    assert_close(np.asarray(out)[live], np.asarray(dense_out)[live], 1e-6)


def _moe_fp4_inputs(rng, n, d, f, e, k):
    probs = rng.dirichlet(np.full(e, 0.5))
    idx = np.stack([rng.choice(e, k, replace=False, p=probs) for _ in range(n)]).astype(np.int32)
    weights = jnp.asarray(rng.random((n, k)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    # scales near 2^-4: the activations stay O(1) through the two layers
    fp4_w = lambda shape: random_fp4(rng, shape, (121, 125))  # noqa: E731
    return x, weights, jnp.asarray(idx), fp4_w((e, f, d)), fp4_w((e, d, f)), fp4_w((e, f, d))


@needs_triton_interp
@pytest.mark.parametrize("n", [1, 23])
def test_moe_experts_reads_fp4_as_stored_and_matches_the_model(n):
    """`moe_experts` on FP4 QArrays (interpreted kernels) against the model's slow twin `experts_dense` on
    the same QArrays, and no float array of the stack's size in the traced computation: the codes are what
    the kernels read."""
    rng = np.random.default_rng(3 + n)
    e, d, f = 8, 64, 96
    x, weights, idx, w1, w2, w3 = _moe_fp4_inputs(rng, n, d, f, e, 3)
    cfg = GemmConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)
    run = jax.jit(lambda *a: moe_experts(*a, 1.5, impl="interpret", cfg=cfg))
    out = run(x, weights, idx, w1, w2, w3)
    want = jax.jit(lambda *a: experts_dense(*a, 1.5))(x, weights, idx, w1, w2, w3)
    assert_close(out, want, 1e-5)

    jaxpr = jax.make_jaxpr(lambda *a: moe_experts(*a, 1.5, impl="interpret", cfg=cfg))(
        x, weights, idx, w1, w2, w3
    )
    stacks = {(e, f, d), (e, d, f)}
    made = [v.aval for eqn in jaxpr.eqns for v in eqn.outvars if tuple(v.aval.shape) in stacks]
    assert not [v for v in made if jnp.issubdtype(v.dtype, jnp.floating)], made


@needs_triton_interp
def test_fp4_takes_its_few_picks_tiles_by_default(monkeypatch):
    """With fewer picks than half the experts, `moe_experts` given no tiles runs FP4 weights on
    FP4_FEW_PICKS_CFG (256-wide K steps: here one partial step in each GEMM, K 64 and 96) and still matches
    the model's dense twin; bf16 weights, and FP4 at more picks, keep DECODE_CFG."""
    from djax.kernels import moe_experts as mx

    assert mx.default_config(4, 8, fp4=True) == mx.FP4_FEW_PICKS_CFG
    assert mx.default_config(5, 8, fp4=True) == mx.DECODE_CFG
    assert mx.default_config(4, 8) == mx.DECODE_CFG
    taken = []
    down = mx.grouped_gemm
    monkeypatch.setattr(mx, "grouped_gemm", lambda *a, **kw: taken.append(a[5]) or down(*a, **kw))
    rng = np.random.default_rng(11)
    x, weights, idx, w1, w2, w3 = _moe_fp4_inputs(rng, 1, 64, 96, 8, 3)
    out = moe_experts(x, weights, idx, w1, w2, w3, 1.5, impl="interpret")
    want = jax.jit(lambda *a: experts_dense(*a, 1.5))(x, weights, idx, w1, w2, w3)
    assert taken == [mx.FP4_FEW_PICKS_CFG]
    assert_close(out, want, 1e-5)


def test_fp4_with_float_scales_is_made_dense_and_still_right():
    """The format's QArray also allows float scales; the kernels read only UE8M0 bytes, so such weights take
    the dense route, through the reference here."""
    rng = np.random.default_rng(4)
    w = random_fp4(rng, (2, 16, 64))
    wf = QArray(w.values, w.scale.astype(jnp.float32), w.block)
    assert is_ue8m0_fp4(w) and not is_ue8m0_fp4(wf)
    assert not is_ue8m0_fp4(dense(w, jnp.float32))
    a = jnp.asarray(rng.standard_normal((2, 16, 64)), jnp.float32)
    cnt = jnp.asarray([16, 5], jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(grouped_gemm_masked(a, wf, cnt, impl="ref")),
        np.asarray(grouped_gemm_masked(a, w, cnt, impl="ref")),
    )


def test_fp4_config_must_step_whole_scale_groups():
    rng = np.random.default_rng(5)
    w = random_fp4(rng, (2, 16, 64))
    a = jnp.asarray(rng.standard_normal((2, 16, 64)), jnp.float32)
    bad = GemmConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="FP4 weights need BLOCK_K 16 and K 64 multiples of their 32-input"):
        grouped_gemm_masked(a, w, jnp.asarray([3, 4], jnp.int32), impl="interpret", cfg=bad)


@pytest.mark.parametrize("impl", ["ref", pytest.param("interpret", marks=needs_triton_interp)])
def test_fp4_weights_of_the_wrong_width_are_named(impl):
    """Packed codes hold two inputs a byte: a weight whose logical width is not a's is named, for every impl,
    not misread."""
    rng = np.random.default_rng(6)
    a = jnp.asarray(rng.standard_normal((2, 16, 64)), jnp.float32)
    cnt = jnp.asarray([3, 4], jnp.int32)
    narrow = random_fp4(rng, (2, 16, 32))  # 32 inputs: packed [2, 16, 16]
    with pytest.raises(
        ValueError, match=r"grouped_gemm_masked: b has shape \[2, 16, 32\], expected \[2, \*, 64\]"
    ):
        grouped_gemm_masked(a, narrow, cnt, impl=impl, cfg=SMALL)
    w1 = random_fp4(rng, (2, 16, 64))
    with pytest.raises(
        ValueError, match=r"grouped_swiglu_masked: w3 has shape \[2, 16, 32\], expected \[2, 16, 64\]"
    ):
        grouped_swiglu_masked(a, w1, narrow, cnt, 0.0, impl=impl, cfg=SMALL)


@pytest.mark.parametrize("asm", [True, False], ids=["ptx_decode", "bits_decode"])
@pytest.mark.parametrize("fused", [True, False], ids=["gate_up", "down"])
@pytest.mark.parametrize("tiles", ["few_picks", "decode", "prefill"])
def test_fp4_kernels_compile_to_sm90_cubins(fused, tiles, asm):
    """The FP4 kernels at V4.1-Flash's expert shapes (d 5120, f 2304) with `moe_experts`' default tiles
    compile for sm_90 within its shared memory (no GPU needed): uint8 operands included, and the inline PTX
    decode (what a GPU runs by default) accepted by ptxas."""
    pytest.importorskip("triton")
    from djax.ffi.cubin import MAX_SHARED_BYTES, compile_triton
    from djax.kernels import grouped_gemm_triton as tk
    from djax.kernels.moe_experts import DECODE_CFG, FP4_FEW_PICKS_CFG, PREFILL_CFG

    cfg = {"few_picks": FP4_FEW_PICKS_CFG, "decode": DECODE_CFG, "prefill": PREFILL_CFG}[tiles]
    n, k = (2304, 5120) if fused else (5120, 2304)
    cx = tk.constexprs(384 * cfg.block_m, n, k, 0, False, fused, cfg, fp4=True, asm=asm)
    assert cx["FP4_ASM"] == asm
    bf16, u8, i32 = jnp.bfloat16, jnp.uint8, jnp.int32
    if fused:
        names = ["a_ptr", "rows_ptr", "w1_ptr", "w3_ptr", "s1_ptr", "s3_ptr", "grp_ptr", "h_ptr"]
        dtypes = [bf16, i32, u8, u8, u8, u8, i32, bf16]
        fn, cx = tk.grouped_swiglu_kernel, {**cx, "LIMIT": 10.0}
    else:
        names, dtypes = (
            ["a_ptr", "rows_ptr", "b_ptr", "bs_ptr", "grp_ptr", "c_ptr"],
            [bf16, i32, u8, u8, i32, bf16],
        )
        fn = tk.grouped_gemm_kernel
    kern = compile_triton(fn, names, dtypes, cx, cfg.num_warps, cfg.num_stages)
    assert kern.binary[:4] == b"\x7fELF" and kern.threads == 32 * cfg.num_warps
    assert 0 < kern.shared_bytes <= MAX_SHARED_BYTES


@needs_triton_interp
def test_model_fast_path_hands_fp4_experts_to_the_kernels(monkeypatch):
    """The model's MoE fast path as it runs on CUDA (`experts_grouped`, bf16 activations, widths multiples of
    128), with the backend check answered yes and the kernels interpreted: FP4 experts reach the grouped GEMMs
    as stored (no bf16 stack in the computation) and match the model's dense twin."""
    from djax.kernels import dispatch
    from djax.kernels import moe_experts as me
    from djax.models.moe import experts_grouped

    monkeypatch.setattr(dispatch, "on_cuda", lambda: True)
    monkeypatch.setattr(me, "moe_experts_triton", lambda *a: moe_experts(*a, impl="interpret", cfg=SMALL))
    rng = np.random.default_rng(7)
    e, d, f = 8, 128, 128
    x, weights, idx, w1, w2, w3 = _moe_fp4_inputs(rng, 5, d, f, e, 2)
    x = x.astype(jnp.bfloat16)
    run = lambda *a: experts_grouped(*a, 1.5)  # noqa: E731
    jaxpr = jax.make_jaxpr(run)(x, weights, idx, w1, w2, w3)
    made = [v.aval for eqn in jaxpr.eqns for v in eqn.outvars if tuple(v.aval.shape) == (e, f, d)]
    assert not [v for v in made if jnp.issubdtype(v.dtype, jnp.floating)], made
    out = jax.jit(run)(x, weights, idx, w1, w2, w3)
    want = experts_dense(x.astype(jnp.float32), weights, idx, w1, w2, w3, 1.5)
    assert out.dtype == jnp.bfloat16
    assert_close(np.asarray(out, np.float32), want, 1e-2)
