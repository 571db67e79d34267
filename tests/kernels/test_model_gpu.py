"""On a CUDA GPU: the model with its fast paths ("grouped" MoE = the Triton grouped GEMMs there) against the
slow twin ("dense" MoE), in bf16, measured against a float32 run of the slow twin."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import djax

pytestmark = pytest.mark.gpu


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _typical_rel(a, b, per=None):
    """The median over positions of each position's largest logit error, relative to b's largest entry; with
    `per` = n, one median for each of the n leading rows (a sequence each), else one over all positions.

    These random-weight models are chaotic in bf16: a rounding difference flips a near-tied expert or index
    pick now and then, and that position's logits move by 5-37% of the largest. On the H200 (tiny-v41, the
    prefill's and 8 decode steps' logits x 4 sequences) both bf16 paths had such a flip at about a quarter of
    the positions, at different ones, and two runs of the same inputs flipped differently (the last step's
    largest error, fast against slow: 0.120 vs 0.036 in one run, 0.041 vs 0.129 in the other). The largest
    error measures whether a flip happened; the median measures the arithmetic (about 1.5% for both paths).
    A fast path wrong at a minority of positions is the kernel tests' to catch (`test_grouped_gemm_gpu.py`:
    moe_experts against the dense float32 twin, every element, partial tiles); the per-sequence medians here
    catch one wrong sequence."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    errs = np.abs(a - b).max(-1) / np.abs(b).max()
    if per is None:
        return float(np.median(errs))
    return np.median(errs.reshape(per, -1), axis=1)


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_forward_and_decode_fast_paths_within_bf16_error(name):
    # Kernel-friendly sizes (multiples of the GEMM tiles), more experts than picks so routing is uneven.
    # Sinkhorn rolled: it halves the GPU compile time and is not what is tested here.
    cfg = djax.preset(name).replace(
        hidden_size=256, moe_intermediate_size=256, n_routed_experts=16, hc_sinkhorn_unroll=False
    )
    bf = cfg.replace(dtype="bfloat16")
    pbf = djax.init_params(bf, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (4, 96), 0, cfg.vocab_size)
    # The truth: the same (bf16-rounded) weights computed in float32 by the slow twin.
    p32 = jax.tree.map(lambda w: w.astype(jnp.float32) if w.dtype == jnp.bfloat16 else w, pbf)
    truth = djax.forward(p32, tokens, cfg, moe_impl="dense")
    slow = djax.forward(pbf, tokens, bf, moe_impl="dense")
    fast = djax.forward(pbf, tokens, bf, moe_impl="grouped")
    # Per sequence (96 positions each): the fast path may round differently, but no worse than the bf16 slow
    # twin does (plus slack for order).
    err_slow, err_fast = _typical_rel(slow, truth, per=4), _typical_rel(fast, truth, per=4)
    assert (err_fast <= 2 * err_slow + 1e-3).all(), (err_fast, err_slow)

    # Teacher-forced decode steps through the state: every step's logits, judged the same way over all of
    # them (8 steps are too few for a median per sequence).
    lens = jnp.full((4,), 64, jnp.int32)

    def decode(p, c, impl):
        logits, state = djax.prefill(p, tokens[:, :64], lens, c, max_len=96, moe_impl=impl)
        steps = []
        for t in range(64, 72):
            logits, state = djax.decode(p, tokens[:, t], state, c, moe_impl=impl)
            steps.append(logits)
        return jnp.stack(steps)

    truth = decode(p32, cfg, "dense")
    err_slow = _typical_rel(decode(pbf, bf, "dense"), truth)
    err_fast = _typical_rel(decode(pbf, bf, "grouped"), truth)
    assert err_fast <= 2 * err_slow + 1e-3, (err_fast, err_slow)


def _decode_logits(params, cfg, tokens, lens, kernels: str, steps: int = 12):
    """Prefill row r's first lens[r] of tokens [b, 96] (a prompt of 64), then `steps` decode steps, each fed
    the row's next token, all under `kernels`: the prefill's logits, then the steps', [1 + steps, b, vocab]."""
    from djax.models import deepseek_v4 as v4

    prompt = jnp.where(jnp.arange(64)[None] < lens[:, None], tokens[:, :64], 0)
    prefill = jax.jit(functools.partial(v4.prefill, cfg=cfg, max_len=96, kernels=kernels))
    logits, state = prefill(params, prompt, lens)
    step = jax.jit(functools.partial(v4.decode_step, cfg=cfg, kernels=kernels))
    out = [logits]
    for _ in range(steps):
        tok = jnp.take_along_axis(tokens, state["lengths"][:, None], axis=1)[:, 0]
        logits, state = step(params, tok, state)
        out.append(logits)
    return jnp.stack(out)


def _record_launches(monkeypatch) -> list:
    """The entry names of the Triton / TileLang pointer kernels enqueued from now on (a list that grows)."""
    from djax.ffi import cubin

    launched, launch = [], cubin.launch
    monkeypatch.setattr(cubin, "launch", lambda kern, *a: launched.append(kern.name) or launch(kern, *a))
    return launched


@pytest.mark.parametrize("name, heads", [("tiny-v4", 32), ("tiny-v41", 32), ("tiny-v4", 64)])
def test_decode_kernels_auto_within_bf16_error(name, heads, monkeypatch):
    """Decode with kernels="auto" (sparse_decode and index_scores kernels) against the jnp path ("off"),
    both bf16, judged against a float32 run of the jnp path. 32 heads of 64 take the Triton attention
    kernel, 64 heads the TileLang one (where TileLang is installed); 16 indexer heads of 16 meet the
    indexer kernel's rules; rows of different lengths, the shortest with empty HCA / CSA pools at first."""
    import importlib.util

    from djax.kernels import indexer, partition, sparse_attn, sparse_attn_tilelang

    # Fresh traces: the ops are counted when traced, and an earlier case with the same indexer shapes
    # would otherwise reuse its cached trace of the partitioned indexer and record no call.
    for cached in (partition.sparse_decode, partition.index_scores, partition.topk):
        cached.cache_clear()
    jax.clear_caches()

    cfg = djax.preset(name).replace(
        hidden_size=256,
        moe_intermediate_size=256,
        n_routed_experts=16,
        hc_sinkhorn_unroll=False,  # halves the GPU compile time; not what is tested here
        num_attention_heads=heads,
        head_dim=64,
    )
    bf = cfg.replace(dtype="bfloat16")
    pbf = djax.init_params(bf, jax.random.key(0))
    p32 = jax.tree.map(lambda w: w.astype(jnp.float32) if w.dtype == jnp.bfloat16 else w, pbf)
    tokens = jax.random.randint(jax.random.key(1), (4, 96), 0, cfg.vocab_size)
    lens = jnp.array([64, 40, 17, 5], jnp.int32)

    calls = []

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls.append((name, kwargs.get("impl")))
            return fn(*args, **kwargs)

        return wrapped

    patch = [(sparse_attn, "sparse_decode"), (indexer, "index_scores"), (sparse_attn, "_triton")]
    patch.append((sparse_attn_tilelang, "sparse_decode_tilelang"))
    for module, name in patch:
        monkeypatch.setattr(module, name, counting(name, getattr(module, name)))
    launched = _record_launches(monkeypatch)
    truth = _decode_logits(p32, cfg, tokens, lens, "off")
    slow = _decode_logits(pbf, bf, tokens, lens, "off")
    assert not calls
    fast = _decode_logits(pbf, bf, tokens, lens, "auto")
    layers = cfg.num_hidden_layers
    assert [i for n, i in calls if n == "sparse_decode"] == ["auto"] * layers, calls
    tilelang = heads % 64 == 0 and importlib.util.find_spec("tilelang") is not None
    backend = "sparse_decode_tilelang" if tilelang else "_triton"
    assert sum(n == backend for n, _ in calls) == layers, calls
    assert calls.count(("index_scores", "auto")) >= 1, calls
    assert "index_scores_kernel" in launched, launched  # "auto" took the Triton indexer
    err_slow, err_fast = _rel(slow, truth), _rel(fast, truth)
    assert err_fast <= 2 * err_slow + 1e-3, (err_fast, err_slow)


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_decode_fp8_model_auto_within_bf16_error(monkeypatch, scale_fmt):
    """An FP8 model (projections and routed experts as e4m3 with 128x128 scales, `quantize_projections`)
    prefilling and decoding with kernels="auto" (activations quantized 1x128, then the CUDA kernels of
    fp8_gemm, of the FP8 gate/up kernel and of the FP8 grouped GEMM) against kernels="ref" (the same
    quantization, their jnp references), both bf16, judged against a float32 run of "ref". The decode steps'
    projections (4 rows) quantize inside the GEMM (`fp8_quant_gemm`, two of one x in one launch through
    `fp8_quant_gemm_pair`), with plain or UE8M0 (V4's) scales."""
    from djax.kernels import fp8_gemm as kfp8

    jax.clear_caches()
    cfg = djax.preset("tiny-v4").replace(
        hidden_size=256,
        q_lora_rank=128,
        o_lora_rank=64,
        moe_intermediate_size=256,
        n_routed_experts=16,
        hc_sinkhorn_unroll=False,
        num_attention_heads=32,
        head_dim=64,
    )
    bf = cfg.replace(dtype="bfloat16")
    pbf = djax.quantize_projections(djax.init_params(bf, jax.random.key(0)), bf, scale_fmt=scale_fmt)
    p32 = jax.tree.map(lambda w: w.astype(jnp.float32) if w.dtype == jnp.bfloat16 else w, pbf)
    tokens = jax.random.randint(jax.random.key(1), (4, 96), 0, cfg.vocab_size)
    lens = jnp.array([64, 40, 17, 5], jnp.int32)

    impls = []
    ops = {
        "fp8_gemm",
        "fp8_quant_gemm",
        "fp8_quant_gemm_pair",
        "grouped_contiguous",
        "grouped_swiglu_contiguous",
    }
    for op in ops:
        fn = getattr(kfp8, op)
        monkeypatch.setattr(
            kfp8, op, lambda *a, fn=fn, op=op, **kw: impls.append((op, kw["impl"])) or fn(*a, **kw)
        )
    launched = _record_launches(monkeypatch)
    truth = _decode_logits(p32, cfg, tokens, lens, "ref")
    slow = _decode_logits(pbf, bf, tokens, lens, "ref")

    # the ops called with `impl`, in the prefill and the steps
    def took(impl):
        return {op for op, i in impls if i == impl}

    assert took("ref") == ops and not took("auto"), impls
    impls.clear()
    fast = _decode_logits(pbf, bf, tokens, lens, "auto")
    assert took("auto") == ops and not took("ref"), impls
    assert "fp8_gemm_kernel" in launched, launched  # Triton's FP8 GEMM: projections and the experts' down
    assert "fp8_swiglu_kernel" in launched, launched  # the experts' gate, up and SwiGLU
    assert "fp8_quant_gemm_kernel" in launched, launched  # the decode steps' projections
    assert "fp8_quant_gemm_pair_kernel" in launched, launched  # two of one x: shared w1 and w3, compressors
    err_slow, err_fast = _typical_rel(slow, truth), _typical_rel(fast, truth)
    assert err_fast <= 2 * err_slow + 1e-3, (err_fast, err_slow)


def test_decode_v41_fp8_weights_auto_within_bf16_error(monkeypatch):
    """V4.1 with its projections in FP8 of 32 x 32 blocks (its checkpoint's layout; experts bf16), prefilling
    and decoding with kernels="auto" (each such weight read as stored by Triton's weight-only kernel, the
    output LoRA's groups in one launch) against kernels="ref" (the kernel's jnp reference: the weight made
    dense, then a matmul), both bf16, judged against a float32 run of "ref"."""
    from djax.kernels import fp8_gemm as kfp8
    from djax.kernels import partition

    partition.fp8_weight_gemm.cache_clear()
    partition.fp8_weight_gemm_grouped.cache_clear()
    jax.clear_caches()
    cfg = djax.preset("tiny-v41").replace(
        num_nextn_predict_layers=0,
        o_lora_rank=32,
        hidden_size=256,
        moe_intermediate_size=256,
        n_routed_experts=16,
        hc_sinkhorn_unroll=False,
    )
    bf = cfg.replace(dtype="bfloat16")
    pbf = djax.quantize_projections(
        djax.init_params(bf, jax.random.key(0)), bf, block=(32, 32), experts=False
    )
    p32 = jax.tree.map(lambda w: w.astype(jnp.float32) if w.dtype == jnp.bfloat16 else w, pbf)
    tokens = jax.random.randint(jax.random.key(1), (4, 96), 0, cfg.vocab_size)
    lens = jnp.array([64, 40, 17, 5], jnp.int32)

    impls = []
    fn = kfp8.fp8_weight_gemm
    monkeypatch.setattr(kfp8, "fp8_weight_gemm", lambda *a, **kw: impls.append(kw["impl"]) or fn(*a, **kw))
    launched = _record_launches(monkeypatch)
    truth = _decode_logits(p32, cfg, tokens, lens, "ref")
    slow = _decode_logits(pbf, bf, tokens, lens, "ref")
    assert impls and set(impls) == {"ref"}, impls
    impls.clear()
    fast = _decode_logits(pbf, bf, tokens, lens, "auto")
    assert impls and set(impls) == {"auto"}, impls
    assert "fp8_weight_gemm_kernel" in launched, launched
    err_slow, err_fast = _typical_rel(slow, truth), _typical_rel(fast, truth)
    assert err_fast <= 2 * err_slow + 1e-3, (err_fast, err_slow)
