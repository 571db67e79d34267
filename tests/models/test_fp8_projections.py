"""FP8 projections through `fp8_gemm`: `layers.linear` with an FP8 weight in DeepGEMM's layout quantizes the
activations 1x128 and runs the block-scaled GEMM; the model does so in every chunk (decode steps and
prefill) under kernels "ref" and "auto", and makes the weight dense under "off"."""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from djax.checkpoint import quantize_projections
from djax.config import preset
from djax.kernels import fp8_gemm as kfp8
from djax.models import deepseek_v4 as v4
from djax.models.layers import (
    FP8_QUANT_GEMM_MAX_ROWS,
    FP8_WEIGHT_MAX_ROWS,
    grouped_linear,
    linear,
    linear_pair,
    takes_fp8_gemm,
    takes_fp8_weight_gemm,
)
from djax.params import flatten_names, init_params_host
from djax.quant import QArray, quantize
from tests.fp8_numpy import quantize_rows

FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _numpy_fp8_linear(x, w: QArray):
    """Brute force: each row's 128-column groups scaled to a max of 448, rounded to e4m3 (ml_dtypes), times
    the dequantized weight, in float64. For a weight with UE8M0 scales the activations' scale is rounded up
    to a power of two (from an amax floored at 1e-4), the group's max then at 224-448."""
    ue8m0 = w.scale.dtype == ml_dtypes.float8_e8m0fnu
    xq = quantize_rows(np.asarray(x, np.float64).reshape(-1, x.shape[-1]), ue8m0)
    s = np.repeat(np.repeat(np.asarray(w.scale.astype(jnp.float32), np.float64), 128, 0), 128, 1)
    wd = np.asarray(w.values).astype(np.float64) * s[: w.values.shape[0], : w.values.shape[1]]
    return xq @ wd.T


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_linear_fp8_ref_matches_numpy(scale_fmt):
    """scale_fmt "ue8m0": a weight with power-of-two (UE8M0) scales, as DeepSeek V4 ships them, whose
    activations DeepSeek's inference quantizes with power-of-two scales too."""
    kx, kw = jax.random.split(jax.random.key(0))
    # uneven magnitudes, so that every activation group and weight block has a scale of its own
    x = jax.random.normal(kx, (2, 3, 256), jnp.float32) * jnp.linspace(0.1, 4.0, 256)
    uneven = jnp.linspace(0.2, 3.0, 384)[:, None] * jnp.linspace(3.0, 0.5, 256)[None, :]
    w = quantize(jax.random.normal(kw, (384, 256), jnp.float32) * 0.05 * uneven, scale_fmt=scale_fmt)
    assert takes_fp8_gemm(w)
    got = np.asarray(linear(x, w, fp8="ref"), np.float64).reshape(6, 384)
    want = _numpy_fp8_linear(x, w)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # the activations' rounding is there: the dense path differs by far more than float32 error
    plain = np.asarray(linear(x, w), np.float64).reshape(6, 384)
    assert np.abs(plain - want).max() > 1e-3 * np.abs(want).max()
    # and the scale rule is the weight's: the same codes and scale values held as float32 take amax / 448
    other = (
        QArray(w.values, w.scale.astype(jnp.float32), w.block)
        if scale_fmt
        else quantize(w.dense(jnp.float32), scale_fmt="ue8m0")
    )
    other_out = np.asarray(linear(x, other, fp8="ref"), np.float64).reshape(6, 384)
    assert np.abs(other_out - got).max() > 1e-3 * np.abs(want).max()


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_linear_quantizes_inside_the_gemm_for_few_rows(scale_fmt, monkeypatch):
    """UE8M0 and plain weights at up to FP8_QUANT_GEMM_MAX_ROWS rows: one `fp8_quant_gemm` call (the
    activations quantized in the kernel, with the weight's kind of scale), no separate `fp8_gemm`; more rows
    take `quantize_act` then `fp8_gemm`. The numbers are the brute force's either way."""
    calls = []
    for name in ("fp8_quant_gemm", "fp8_gemm"):
        real = getattr(kfp8, name)
        spy = lambda *a, name=name, real=real, **kw: calls.append((name, a[0].shape[0])) or real(*a, **kw)  # noqa: E731
        monkeypatch.setattr(kfp8, name, spy)
    uneven = jnp.linspace(0.2, 3.0, 256)[:, None] * jnp.linspace(3.0, 0.5, 256)[None, :]
    w = quantize(
        jax.random.normal(jax.random.key(4), (256, 256), jnp.float32) * 0.05 * uneven, scale_fmt=scale_fmt
    )
    limit = FP8_QUANT_GEMM_MAX_ROWS
    assert limit == 32
    for rows, path in ((1, "fp8_quant_gemm"), (limit, "fp8_quant_gemm"), (limit + 1, "fp8_gemm")):
        x = jax.random.normal(jax.random.key(rows), (rows, 256), jnp.float32) * jnp.linspace(0.1, 4.0, 256)
        calls.clear()
        got = np.asarray(linear(x, w, fp8="ref"), np.float64)
        assert calls == [(path, rows)], (rows, calls)
        want = _numpy_fp8_linear(x, w)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_linear_pair_runs_two_projections_of_one_x_in_one_call_where_both_would_quantize_inside(monkeypatch):
    """Both weights FP8 with the same kind of scales, at few rows: one `fp8_quant_gemm_pair` call, each product
    exactly `linear`'s; scales of two kinds, more rows than the quantizing GEMM takes, a bf16 weight, or no
    fp8 impl: the two `linear`s."""
    calls = []
    for name in ("fp8_quant_gemm", "fp8_quant_gemm_pair", "fp8_gemm"):
        real = getattr(kfp8, name)
        spy = lambda *a, name=name, real=real, **kw: calls.append(name) or real(*a, **kw)  # noqa: E731
        monkeypatch.setattr(kfp8, name, spy)
    rng = jax.random.split(jax.random.key(8), 3)
    raw = [jax.random.normal(r, (n, 256), jnp.float32) * 0.05 for r, n in zip(rng, (256, 128), strict=False)]
    x = jax.random.normal(rng[2], (3, 256), jnp.float32) * jnp.linspace(0.1, 4.0, 256)
    for fmt in (None, "ue8m0"):
        w, w2 = (quantize(r, scale_fmt=fmt) for r in raw)
        calls.clear()
        got = linear_pair(x, w, w2, fp8="ref")
        assert calls == ["fp8_quant_gemm_pair"], calls
        for g, v in zip(got, (w, w2), strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(linear(x, v, fp8="ref")))
    plain, pow2 = quantize(raw[0]), quantize(raw[1], scale_fmt="ue8m0")
    cases = [
        ((x, plain, pow2, "ref"), ["fp8_quant_gemm"] * 2),  # scales of two kinds
        ((jnp.tile(x, (11, 1)), plain, quantize(raw[1]), "ref"), ["fp8_gemm"] * 2),  # 33 rows
        ((x, plain, raw[1].astype(jnp.bfloat16), "ref"), ["fp8_quant_gemm"]),  # a bf16 weight: dense
        ((x, plain, quantize(raw[1]), None), []),  # no fp8 impl: both dense
    ]
    for args, want in cases:
        calls.clear()
        got = linear_pair(*args)
        assert calls == want, (want, calls)
        for g, v in zip(got, args[1:3], strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(linear(args[0], v, args[3])))


def test_q_kv_runs_wq_a_and_wkv_as_one_pair(monkeypatch):
    """With a head dim that is a multiple of 128 (V4-Flash's 512; the tiny configs' 64 is not) wkv is in
    DeepGEMM's layout too: at a decode step's rows the q LoRA down and KV projections run as one
    `fp8_quant_gemm_pair` call, and give exactly what the two `linear`s give."""

    cfg = _config().replace(head_dim=128)
    attn = quantize_projections(init_params_host(cfg), cfg)["layers"][0]["attn"]
    assert takes_fp8_gemm(attn["wq_a"]["weight"]) and takes_fp8_gemm(attn["wkv"]["weight"])
    x = jax.random.normal(jax.random.key(9), (2, 1, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
    pos = jnp.array([[5], [40]], jnp.int32)
    inv_freq = v4._rope(cfg, v4.SLIDING)
    pairs = []
    real = kfp8.fp8_quant_gemm_pair
    monkeypatch.setattr(
        kfp8, "fp8_quant_gemm_pair", lambda *a, **kw: pairs.append(a[1].shape) or real(*a, **kw)
    )
    paired = v4._q_kv(attn, x, pos, cfg, inv_freq, "ref")
    assert pairs == [attn["wq_a"]["weight"].values.shape], pairs
    monkeypatch.setattr(v4, "linear_pair", lambda x, w, w2, fp8: (linear(x, w, fp8), linear(x, w2, fp8)))
    apart = v4._q_kv(attn, x, pos, cfg, inv_freq, "ref")
    assert len(pairs) == 1
    for got, want in zip(paired, apart, strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize(
    "make, weight_only",
    [
        (lambda w: w.astype(jnp.bfloat16), False),  # a plain weight: dense
        (lambda w: quantize(w, (32, 32)), True),  # V4.1's 32x32 blocks
        (lambda w: quantize(w, (32, 32), "ue8m0"), True),  # the same with UE8M0 scales
        (lambda w: quantize(w[:192]), True),  # out not a multiple of 128
        (lambda w: quantize(w, (32, 48)), False),  # a block's input side not dividing 128: dense
    ],
    ids=["plain", "blocks32", "blocks32_ue8m0", "out192", "blocks32x48"],
)
def test_linear_takes_other_fp8_blocks_as_stored_or_makes_them_dense(make, weight_only, monkeypatch):
    """FP8 weights `fp8_gemm` does not take: those `fp8_weight_gemm` reads go there (the activations not
    quantized, so the dense path's result), others are made dense; either way the dense path's numbers."""
    calls = []
    real = kfp8.fp8_weight_gemm
    monkeypatch.setattr(kfp8, "fp8_weight_gemm", lambda *a, **kw: calls.append(a[3]) or real(*a, **kw))
    x = jax.random.normal(jax.random.key(2), (4, 256), jnp.float32)
    w = make(jax.random.normal(jax.random.key(3), (256, 256), jnp.float32) * 0.05)
    assert not takes_fp8_gemm(w) and takes_fp8_weight_gemm(w) == weight_only
    got = np.asarray(linear(x, w, fp8="ref"))
    assert calls == ([w.block] if weight_only else [])
    np.testing.assert_allclose(got, np.asarray(linear(x, w)), rtol=1e-6, atol=1e-6)
    many = jnp.ones((FP8_WEIGHT_MAX_ROWS + 1, 256), jnp.float32)  # prefill-sized: made dense
    calls.clear()
    linear(many, w, fp8="ref")
    assert calls == []


@pytest.mark.parametrize(
    "block, o, read",
    [((32, 32), 64, True), ((128, 128), 128, True), ((32, 32), 48, False)],
    ids=["blocks32", "blocks128", "block_rows_straddle_groups"],
)
def test_grouped_linear_reads_fp8_groups_in_one_call_or_makes_them_dense(block, o, read, monkeypatch):
    """The output LoRA's grouped product: with an FP8 weight whose scale blocks fall inside groups, one
    `fp8_weight_gemm` call over [groups, o, in] (the activations not quantized: the dense path's numbers);
    blocks straddling groups (o 48 over 32-row blocks) and more than FP8_WEIGHT_MAX_ROWS rows: made dense."""
    calls = []
    real = kfp8.fp8_weight_gemm
    monkeypatch.setattr(kfp8, "fp8_weight_gemm", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    g, i = 3, 256
    x = jax.random.normal(jax.random.key(6), (2, 5, g, i), jnp.float32)
    w = quantize(jax.random.normal(jax.random.key(7), (g * o, i), jnp.float32) * 0.05, block)
    got = grouped_linear(x, w, fp8="ref")
    assert calls == ([(g, o, i)] if read else [])
    want = jnp.einsum("...gi,goi->...go", x, w.dense(jnp.float32).reshape(g, o, i))
    assert got.shape == (2, 5, g, o)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(grouped_linear(x, w)), np.asarray(want))  # fp8 None: dense
    calls.clear()
    grouped_linear(jnp.ones((FP8_WEIGHT_MAX_ROWS + 1, g, i)), w, fp8="ref")
    assert calls == []


def _avals(jaxpr):
    """Every value a jaxpr computes, inside the jaxprs its equations carry (custom_partitioning's call,
    jit, scan) too."""
    for e in jaxpr.eqns:
        yield from (v.aval for v in e.outvars)
        for p in e.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _avals(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _avals(sub)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_linear_auto_on_cuda_reads_v41_blocks_as_stored(monkeypatch):
    """`linear` as it runs on CUDA (fp8 "auto", the backend check answered yes, the kernel interpreted): a
    32x32-block FP8 weight reaches the kernel as its codes (no [out, in] float weight in the computation)
    and the result is the dense path's."""
    from djax.kernels import dispatch

    monkeypatch.setattr(dispatch, "on_cuda", lambda: True)
    monkeypatch.setattr(dispatch, "has_triton", lambda: True)
    real, use = kfp8.fp8_weight_gemm, ["interpret"]
    monkeypatch.setattr(kfp8, "fp8_weight_gemm", lambda *a, impl, **kw: real(*a, impl=use[0], **kw))
    x = jax.random.normal(jax.random.key(4), (3, 5, 256), jnp.float32)
    w = quantize(jax.random.normal(jax.random.key(5), (384, 256), jnp.float32) * 0.05, (32, 32))

    def dense_weights_made():
        jaxpr = jax.make_jaxpr(lambda x, w: linear(x, w, fp8="auto"))(x, w).jaxpr
        return [a for a in _avals(jaxpr) if a.shape == (384, 256) and jnp.issubdtype(a.dtype, jnp.floating)]

    assert not dense_weights_made()
    use[0] = "ref"  # the check sees inside the partitioning wrapper: the reference makes the dense weight
    assert dense_weights_made()
    use[0] = "interpret"
    got = jax.jit(lambda x, w: linear(x, w, fp8="auto"))(x, w)
    assert got.shape == (3, 5, 384)
    np.testing.assert_allclose(np.asarray(got), np.asarray(linear(x, w)), rtol=1e-5, atol=1e-5)


def _config():
    """tiny-v4 with 128-multiple projections (q LoRA, q, output LoRA, shared experts) and SWA, CSA, HCA layers."""
    return preset("tiny-v4").replace(
        num_nextn_predict_layers=0,
        num_hidden_layers=3,
        compress_ratios=(0, 4, 16),
        num_hash_layers=1,
        hidden_size=256,
        q_lora_rank=128,
        num_attention_heads=2,
        head_dim=64,
        qk_rope_head_dim=16,
        o_lora_rank=64,
        o_groups=2,
        moe_intermediate_size=128,
    )


def test_quantize_projections_takes_what_an_fp8_checkpoint_holds():
    cfg = _config()
    params = init_params_host(cfg)
    flat = flatten_names(quantize_projections(params, cfg))
    quantized = {n for n, w in flat.items() if isinstance(w, QArray)}
    for name in (
        "layers.0.attn.wq_b.weight",
        "layers.1.ffn.shared_experts.w2.weight",
        "layers.1.ffn.experts.w1",
    ):
        assert name in quantized, name
    for name in ("embed.weight", "head.weight", "layers.0.ffn.gate.weight"):
        assert name in flat and name not in quantized
    assert all(flat[n].values.dtype == jnp.float8_e4m3fn and flat[n].block == (128, 128) for n in quantized)
    assert flat["layers.1.ffn.experts.w2"].scale.shape == (cfg.n_routed_experts, 2, 1)  # one per expert block
    no_experts = flatten_names(quantize_projections(params, cfg, experts=False))
    assert {n for n, w in no_experts.items() if isinstance(w, QArray)} == quantized - {
        f"layers.{i}.ffn.experts.{w}" for i in range(cfg.num_hidden_layers) for w in ("w1", "w2", "w3")
    }


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_quantize_projections_on_device_matches_the_host_and_frees_what_it_replaced(scale_fmt):
    """Device weights go through one compiled program each; its output is quantizing op by op (jnp, eager)
    bit for bit, and with delete_originals exactly the replaced arrays are deleted. (The host's numpy
    quantization is no bit-for-bit twin: XLA divides by the broadcast scale as a product with its reciprocal,
    which moves a rare value onto an e4m3 tie.)"""
    cfg = _config()
    host = init_params_host(cfg, 3)
    flat_host = flatten_names(host)
    on_host = flatten_names(quantize_projections(host, cfg))
    want = {
        n: quantize(jnp.asarray(w), scale_fmt=scale_fmt) if isinstance(on_host[n], QArray) else w
        for n, w in flat_host.items()
    }
    dev = jax.device_put(host)
    before = flatten_names(dev)
    got = flatten_names(quantize_projections(dev, cfg, scale_fmt=scale_fmt, delete_originals=True))
    assert got.keys() == want.keys()
    for name, w in want.items():
        if isinstance(w, QArray):
            assert isinstance(got[name], QArray) and before[name].is_deleted(), name
            for a, b in ((got[name].values, w.values), (got[name].scale, w.scale)):
                assert a.dtype == b.dtype and a.shape == b.shape, name
                np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
        else:
            assert got[name] is before[name] and not before[name].is_deleted(), name
    kept = flatten_names(quantize_projections(jax.device_put(host), cfg))
    assert not any(a.is_deleted() for a in jax.tree.leaves(kept))


_WEIGHT_AT = {
    "fp8_gemm": 2,
    "grouped_contiguous": 2,
    "grouped_swiglu_contiguous": 3,
    "fp8_weight_gemm": 1,
    "fp8_quant_gemm": 1,
}  # op -> weight's position


def _record_fp8_kernels(monkeypatch) -> dict[str, list]:
    """The weight shapes `fp8_gemm`, `grouped_contiguous` and `grouped_swiglu_contiguous` (its gate's) are
    traced with from now on, by op; `fp8_quant_gemm_pair`'s as (first, second) pairs."""
    calls = {op: [] for op in [*_WEIGHT_AT, "fp8_quant_gemm_pair"]}
    for op, seen in calls.items():
        fn = getattr(kfp8, op)
        if op == "fp8_quant_gemm_pair":
            shapes = lambda a: (tuple(a[1].shape), tuple(a[3].shape))  # noqa: E731
        else:
            shapes = lambda a, at=_WEIGHT_AT[op]: tuple(a[at].shape)  # noqa: E731
        monkeypatch.setattr(
            kfp8, op, lambda *a, fn=fn, f=shapes, seen=seen, **kw: seen.append(f(a)) or fn(*a, **kw)
        )
    return calls


# Projections of the same activations that `linear_pair` runs in one launch where both are FP8 in DeepGEMM's
# layout: (first weight, second weight), siblings in one module
PAIRS = (("wq_a", "wkv"), ("wkv", "wgate"), ("w1", "w3"))


def _decode_split(params, projections: list) -> dict:
    """A decode step's expected quantizing-GEMM calls: {"fp8_quant_gemm": the projections (weight shapes) not in
    a pair, "fp8_quant_gemm_pair": the (first, second) shapes of the pairs both of whose weights take
    `fp8_gemm`}, from the parameter names."""
    eligible = {
        name.removesuffix(".weight"): tuple(w.values.shape)
        for name, w in flatten_names(params).items()
        if takes_fp8_gemm(w)
    }
    pairs = []
    for path in eligible:
        parent, _, leaf = path.rpartition(".")
        for first, second in PAIRS:
            if leaf == first and f"{parent}.{second}" in eligible:
                pairs.append((eligible[path], eligible[f"{parent}.{second}"]))
    single = list(projections)
    for pair in pairs:
        for shape in pair:
            single.remove(shape)
    assert pairs, "no pair in this model: the pair path is not tested"
    return {"fp8_quant_gemm": sorted(single), "fp8_quant_gemm_pair": sorted(pairs)}


def _logits_off_and_ref(run, params, tokens, calls, expected) -> dict:
    """run(params, tokens, kernels) compiled and run under "off" and "ref": the logits of each, after checking
    that "off" traced no FP8 kernel and "ref" each of `expected` (op -> sorted weight shapes)."""
    out = {}
    for mode in ("off", "ref"):
        for seen in calls.values():
            seen.clear()
        compiled = (
            jax.jit(lambda p, t, mode=mode: run(p, t, mode)).lower(params, tokens).compile(FAST_COMPILE)
        )
        out[mode] = np.asarray(compiled(params, tokens))
        for op, want in expected.items():
            assert sorted(calls[op]) == ([] if mode == "off" else want), (mode, op)
    return out


def _typical_error(out) -> float:
    """The median over steps and rows of the largest logit error of "ref" against "off", relative to the
    largest logit."""
    return float(np.median(np.abs(out["ref"] - out["off"]).max(-1)) / np.abs(out["off"]).max())


def _v4_fp8_model(scale_fmt=None):
    """The FP8 tiny-v4 (block scales as `scale_fmt` says) and what one pass over its layers traces: {op:
    sorted weight shapes}."""
    cfg = _config()
    params = quantize_projections(init_params_host(cfg), cfg, scale_fmt=scale_fmt)
    projections = sorted(
        tuple(w.values.shape)
        for name, w in flatten_names(params).items()
        if takes_fp8_gemm(w) and not name.endswith("wo_a.weight")  # wo_a: a grouped einsum, made dense
    )
    assert len(projections) >= 12
    e, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    expected = {
        "fp8_gemm": projections,
        "grouped_swiglu_contiguous": [(e, f, d)] * cfg.num_hidden_layers,
        "grouped_contiguous": [(e, d, f)] * cfg.num_hidden_layers,
        "fp8_quant_gemm_pair": [],  # a decode step's (`_decode_split`)
    }
    return cfg, params, expected


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_decode_runs_fp8_weights_through_fp8_kernels(monkeypatch, scale_fmt):
    """kernels="ref": every 128-multiple projection of a decode step goes through fp8_quant_gemm (a decode
    step's few rows quantized inside the GEMM; once per trace), two of one x together through
    fp8_quant_gemm_pair and every layer's routed experts through the
    FP8 gate/up kernel and one FP8 grouped GEMM; the logits stay near the dense path's, which does not round
    activations. "ue8m0": V4's power-of-two weight scales, and so power-of-two activation scales."""
    cfg, params, expected = _v4_fp8_model(scale_fmt)
    # a decode step's few rows: the projections quantize them inside the GEMM, with either kind of scale,
    # those of one x in pairs
    expected |= _decode_split(params, expected["fp8_gemm"])
    expected["fp8_gemm"] = []
    calls = _record_fp8_kernels(monkeypatch)

    b, n = 2, 24
    tokens = jax.random.randint(jax.random.key(4), (b, n), 0, cfg.vocab_size)

    def run(p, t, mode):
        def step(state, tok):
            h, state = v4.extend(p, tok[:, None], state, cfg, kernels=mode)
            return state, v4.logits_from_hidden(p, h[:, 0], cfg)

        return jax.lax.scan(step, v4.init_state(cfg, b, n + 8), t.T)[1]

    out = _logits_off_and_ref(run, params, tokens, calls, expected)

    # Rounding the activations to e4m3 (3 mantissa bits: a relative error of up to 2^-4, 3.6% rms) moves each
    # projection's output by about 3.6% rms; through three layers of this random-weight model the median over
    # steps and rows of the largest logit error measured 0.049 of the largest logit with the projections alone
    # in FP8 and 0.057 with the routed experts too (0.13 and 0.10 at the worst row). A missing activation scale
    # moves the logits by orders of magnitude; where each scale goes is checked element by element in
    # test_linear_fp8_ref_matches_numpy and tests/kernels/test_moe_experts_fp8.py.
    typical = _typical_error(out)
    assert 1e-4 < typical < 0.1, typical


def test_prefill_runs_fp8_weights_through_fp8_kernels(monkeypatch):
    """A prefill chunk reads FP8 weights as stored too: under kernels="ref" every projection through fp8_gemm
    and the routed experts through the FP8 grouped GEMMs, over all the chunk's rows at once (the traced
    weight shapes as at a decode step), under "off" none; the last tokens' logits near the dense path's.
    Per-row activation scales keep a row's result its own: a row prefilled beside another of a different
    length gets the logits it gets alone."""
    cfg, params, expected = _v4_fp8_model()
    calls = _record_fp8_kernels(monkeypatch)
    b, t = 4, 40  # 40: not a multiple of the compression ratios or of 128 rows
    tokens = jax.random.randint(jax.random.key(6), (b, t), 0, cfg.vocab_size)
    lengths = jnp.array([t, 29, 13, 37], jnp.int32)

    def run(p, tok, mode, lengths=lengths):
        return v4.prefill(p, tok, lengths, cfg, t + 8, kernels=mode)[0]

    out = _logits_off_and_ref(run, params, tokens, calls, expected)
    # as at decode, the activations' e4m3 rounding through three layers: measured 0.069 of the largest logit
    typical = _typical_error(out)
    assert 1e-4 < typical < 0.1, typical

    alone = jax.jit(lambda p, tok: run(p, tok, "ref", lengths[1:2]))(params, tokens[1:2])
    np.testing.assert_allclose(
        np.asarray(alone)[0], out["ref"][1], rtol=2e-5, atol=2e-5 * np.abs(out["ref"]).max()
    )


def test_v41_32x32_fp8_projections_read_as_stored_keep_the_dense_paths_logits(monkeypatch):
    """V4.1 holds its projections in FP8 with 32 x 32 blocks, which `fp8_gemm` does not take: under
    kernels="ref" a decode step and a prefill chunk read each of them through `fp8_weight_gemm`, the Engram
    layers' wkv and the output LoRA's grouped half (all groups in one call) included, and since the
    activations are not quantized the logits are the dense path's ("off") up to the order of float32 sums."""
    cfg = preset("tiny-v41").replace(
        num_nextn_predict_layers=0, o_lora_rank=32
    )  # whole 32-row blocks a group
    params = quantize_projections(init_params_host(cfg), cfg, block=(32, 32), experts=False)
    flat = flatten_names(params)
    assert not isinstance(flat["layers.1.engram.embed.weight"], QArray)  # a table: looked up, kept as is
    g = cfg.o_groups
    shapes = sorted(
        tuple(w.values.shape) if not name.endswith("wo_a.weight") else (g, w.shape[0] // g, w.shape[1])
        for name, w in flat.items()
        if takes_fp8_weight_gemm(w)
    )
    assert len(shapes) >= 40 and (g, 32, cfg.num_attention_heads * cfg.head_dim // g) in shapes
    calls = _record_fp8_kernels(monkeypatch)
    b, n = 2, 12
    tokens = jax.random.randint(jax.random.key(8), (b, n), 0, cfg.vocab_size)
    lengths = jnp.array([9, 5], jnp.int32)

    def run(p, t, mode):
        logits, state = v4.prefill(p, t[:, :9], lengths, cfg, n + 4, kernels=mode)

        def step(state, tok):
            logits, state = v4.decode_step(p, tok, state, cfg, kernels=mode)
            return state, logits

        # two decode steps in a scan: the step is traced (and compiled) once, not once per step
        steps = jax.lax.scan(step, state, t[:, 9:11].T)[1]
        return jnp.concatenate([logits[None], steps])

    expected = {"fp8_weight_gemm": sorted(shapes * 2), "fp8_gemm": []}  # the prefill and the step
    out = _logits_off_and_ref(run, params, tokens, calls, expected)
    err = np.abs(out["ref"] - out["off"]).max() / np.abs(out["off"]).max()
    assert err <= 1e-5, err


def _v3_config():
    """tiny-v3 with 128-multiple projections: q LoRA, q (2 heads x 128), kv LoRA + rope (192 + 64), output,
    the dense layer's MLP, the shared and routed experts."""
    return preset("tiny-v3").replace(
        hidden_size=256,
        q_lora_rank=128,
        num_attention_heads=2,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        head_dim=128,
        v_head_dim=64,
        kv_lora_rank=192,
        moe_intermediate_size=128,
        intermediate_size=256,
    )


def _v3_fp8_model():
    """The FP8 tiny V3 and what one pass over its layers traces: {op: sorted weight shapes} (wkv_b, split per
    head for the absorbed attention, made dense)."""
    cfg = _v3_config()
    params = quantize_projections(init_params_host(cfg), cfg)
    projections = sorted(
        tuple(w.values.shape)
        for name, w in flatten_names(params).items()
        if takes_fp8_gemm(w) and not name.endswith("wkv_b.weight")
    )
    assert len(projections) >= 10 and (cfg.kv_lora_rank + cfg.qk_rope_head_dim, 256) in projections  # wkv_a
    e, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    expected = {
        "fp8_gemm": projections,
        "grouped_swiglu_contiguous": [(e, f, d)] * moe_layers,
        "grouped_contiguous": [(e, d, f)] * moe_layers,
        "fp8_quant_gemm_pair": [],  # a decode step's (`_decode_split`)
    }
    return cfg, params, expected


def test_v3_decode_runs_fp8_weights_through_fp8_kernels(monkeypatch):
    """V3's decode step under kernels="ref": every FP8 projection in DeepGEMM's layout through fp8_quant_gemm
    (or with its sibling through fp8_quant_gemm_pair: w1 and w3) (the step's two rows quantized inside the GEMM; wkv_b, split per head, made dense) and each MoE layer's
    routed experts through the FP8 gate/up kernel and one FP8 grouped GEMM; "off" through neither; the logits
    near the dense path's."""
    from djax.models import deepseek_v3 as v3

    cfg, params, expected = _v3_fp8_model()
    expected |= _decode_split(params, expected["fp8_gemm"])
    expected["fp8_gemm"] = []
    calls = _record_fp8_kernels(monkeypatch)

    b, n = 2, 16
    tokens = jax.random.randint(jax.random.key(5), (b, n), 0, cfg.vocab_size)

    def run(p, t, mode):
        def step(state, tok):
            logits, state = v3.decode_step(p, tok, state, cfg, kernels=mode)
            return state, logits

        return jax.lax.scan(step, v3.init_state(cfg, b, n + 4), t.T)[1]

    out = _logits_off_and_ref(run, params, tokens, calls, expected)
    typical = _typical_error(out)  # the activations' e4m3 rounding, as in the V4 test (measured 0.043 here)
    assert 1e-4 < typical < 0.1, typical
    with pytest.raises(ValueError, match="kernels must be one of"):
        v3.decode_step(params, tokens[:, 0], v3.init_state(cfg, b, n), cfg, kernels="fast")


def test_v3_prefill_runs_fp8_weights_through_fp8_kernels(monkeypatch):
    """V3's prefill under kernels="ref" takes the same FP8 kernels as its decode step (wkv_b made dense),
    "off" none; the last tokens' logits near the dense path's."""
    from djax.models import deepseek_v3 as v3

    cfg, params, expected = _v3_fp8_model()
    calls = _record_fp8_kernels(monkeypatch)
    b, t = 4, 24
    tokens = jax.random.randint(jax.random.key(7), (b, t), 0, cfg.vocab_size)
    lengths = jnp.array([t, 17, 9, 22], jnp.int32)

    def run(p, tok, mode):
        return v3.prefill(p, tok, lengths, cfg, t + 4, kernels=mode)[0]

    out = _logits_off_and_ref(run, params, tokens, calls, expected)
    typical = _typical_error(out)  # measured 0.036
    assert 1e-4 < typical < 0.1, typical
    with pytest.raises(ValueError, match="kernels must be one of"):
        v3.prefill(params, tokens, lengths, cfg, t, kernels="fast")
