#!/usr/bin/env python3
"""djax generation on one GPU against HF transformers' DeepseekV4ForCausalLM, same config and same weights.

The model has DeepSeek-V4-Flash's per-layer shapes (hidden 4096, 64 heads x 512, q_lora 1024, 8 output
groups x 1024, 256 experts x 2048 top-6, indexer 64 x 128 top-512, window 128, vocab 129280, hc_mult 4)
and few layers: compress_ratios (0, 0, 4, 128) = two sliding-window layers, one CSA, one HCA; the first
layer hash-routed. Random bf16 weights from `djax.init_params`; the float32 leaves (norms, mHC, sinks,
biases) are rounded to bf16 values so that HF, whose older releases hold every weight in bf16, gets
exactly the same numbers.

One run, in this order (no compilation runs while anything is timed):
  1. compile djax's forward and decode programs ahead of time in background threads while the weights
     are drawn and the HF model is built on the same weights (zero-copy through DLPack where the layouts
     agree; the packed gate_up_proj is a copy); prefill and generate compile after step 4;
  2. logits check: djax `forward` against HF's forward on one short prompt, bf16;
  3. device-to-device copy bandwidth and a bf16 matmul rate (torch), the ceilings;
  4. HF: prefill tokens/s, decode steps with its cache (manual loop) at a few batch sizes, experts
     touched per step (router hooks); then HF's memory is freed;
  5. djax: prefill tokens/s, decode steps (`djax.decode` in a loop, state donated, greedy feedback) at
     batch 1, 32, 128 from 1k-token contexts (synthetic states: random ring and pool entries; djax's step
     cost does not depend on their values), `djax.generate` end to end, and the decode roofline ratio:
     (bytes a step must read / step time) / copy bandwidth. Part `decode_xla` times the same decode
     steps without djax.kernels (jnp attention and indexer, XLA's MoE path): the kernels' speed-up. Programs whose XLA temp memory cannot fit are
     skipped and recorded (XLA may lower ragged_dot densely: every expert on every row).

Run (GPU):   python benchmarks/bench_generate.py --out $OUT
FP8 model:   python benchmarks/bench_generate.py --fp8 --parts ceilings,decode,decode_dequant,decode_xla --name h200_fp8
             (projections and routed experts as an FP8 checkpoint holds them; with kernels they run through
             fp8_gemm and the FP8 grouped GEMM, in part decode_dequant they are made dense on use, as
             without kernels; parts prefill,prefill_dequant do the same for prefill)
FP4 experts: python benchmarks/bench_generate.py --fp4-experts --parts ceilings,decode,decode_dequant,decode_xla
             --name h200_fp4 (routed experts as V4.1 stores them; decode_dequant makes them dense on use)
Debug (CPU): python benchmarks/bench_generate.py --tiny --out /tmp/bench
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import re
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import djax  # noqa: E402
from djax.params import flatten_names  # noqa: E402

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# ---- workloads ------------------------------------------------------------------------------------------
FULL = dict(
    ratios=(0, 0, 4, 128),
    check_len=256,  # logits check prompt: past the window, 64 CSA entries, 2 HCA entries
    prefill=[(4, 1024), (1, 4096), (1, 1024)],
    context=1024,  # decode: synthetic states at this context
    max_len=2048,
    decode_batches=[1, 32, 128],
    decode_steps=16,
    decode_reps=3,
    prefill_reps=5,
    hf_prefill=[(4, 1024), (1, 4096), (1, 1024)],
    hf_decode_batches=[1, 32],
    hf_decode_steps=8,
    generate=(32, 64),  # batch, new tokens
    generate_prompt=64,
    generate_reps=3,
    copy_bytes=4 << 30,
    matmul=8192,
)
TINY = dict(
    ratios=(0, 0, 4, 16),
    check_len=48,
    prefill=[(2, 64), (1, 256)],
    context=64,
    max_len=128,
    decode_batches=[1, 4, 8],
    decode_steps=4,
    decode_reps=2,
    prefill_reps=2,
    hf_prefill=[(2, 64)],
    hf_decode_batches=[1, 4],
    hf_decode_steps=3,
    generate=(4, 8),
    generate_prompt=16,
    generate_reps=2,
    copy_bytes=64 << 20,
    matmul=512,
)


def make_config(tiny: bool) -> djax.ModelConfig:
    w = TINY if tiny else FULL
    base = djax.preset("tiny-v4" if tiny else "deepseek-v4-flash")
    return base.replace(
        num_hidden_layers=len(w["ratios"]),
        compress_ratios=w["ratios"],
        num_hash_layers=1,
        num_nextn_predict_layers=0,  # the MTP block is not used for decoding; don't allocate its experts
        dtype="bfloat16",
    )


def median(xs):
    return float(statistics.median(xs))


def decode_without_kernels(cfg: djax.ModelConfig, b: int):
    """djax's decode step as it runs without djax.kernels: attention and the indexer on the jnp path, the
    routed experts on the XLA path a non-CUDA backend takes at this batch (gathered matrices for a few
    tokens, every expert batched otherwise; see models.moe.experts_grouped)."""
    from djax.models import deepseek_v4

    moe_impl = "gather" if b * cfg.num_experts_per_tok <= cfg.n_routed_experts else "batched"
    step = partial(deepseek_v4.decode_step, cfg=cfg, moe_impl=moe_impl, kernels="off")
    return jax.jit(step, donate_argnums=(2,))


def dense_on_use(params):
    """The quantized weights the kernels read as stored, in a form they do not read, which the model then
    makes dense on use: the same weights. FP8 (projections, stacked experts that `fp8_gemm` and the FP8
    grouped GEMM take): each 128 x 128 scale repeated over four 64 x 64 blocks (`fp8_gemm` and the FP8 grouped
    GEMMs take 128 x 128 blocks only; `fp8_weight_gemm` would read these, so programs on them are traced
    under `no_fp8_weight_reads`). FP4 experts: their UE8M0 scales as float32 (the grouped GEMMs read UE8M0
    bytes only)."""
    from djax.models.layers import takes_fp8_gemm, takes_fp8_grouped
    from djax.quant import QArray, is_ue8m0_fp4

    def one(w):
        if is_ue8m0_fp4(w):
            return QArray(w.values, w.scale.astype(jnp.float32), w.block)
        if not (takes_fp8_gemm(w) or takes_fp8_grouped(w)):
            return w
        return QArray(w.values, jnp.repeat(jnp.repeat(w.scale, 2, -2), 2, -1), (64, 64))

    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, QArray))


@contextlib.contextmanager
def no_fp8_weight_reads():
    """While tracing inside it, `fp8_weight_gemm` reads no weight (its row limit 0): with `dense_on_use`'s
    64 x 64 re-blocking, which `fp8_gemm` and the FP8 grouped GEMMs refuse, every quantized weight is made
    dense on use. A module setting read at trace time: trace only while nothing else traces."""
    from djax.models import layers

    saved = layers.FP8_WEIGHT_MAX_ROWS
    layers.FP8_WEIGHT_MAX_ROWS = 0
    try:
        yield
    finally:
        layers.FP8_WEIGHT_MAX_ROWS = saved


def fp4_experts(params, key, delete_originals: bool = False):
    """The routed experts as FP4 with UE8M0 scales (V4.1's format; the grouped GEMMs read it as stored):
    random e2m1 codes and one scale for the whole stack, the power of two that gives the bf16 weights' RMS
    (the e2m1 codes' RMS is about 2.93). With `delete_originals` each replaced stack's arrays are deleted
    once its FP4 form is ready (the 4-layer model's bf16 experts and their FP4 form do not fit an 80 GB card
    together); `params` is unusable afterwards."""
    from djax import fp4
    from djax.params import flatten_names, unflatten_names

    flat = flatten_names(params)
    for i, name in enumerate(n for n in flat if fp4._ROUTED_EXPERTS.search(n)):
        w = flat[name]
        flat[name] = jax.block_until_ready(_random_fp4_like(w, jax.random.fold_in(key, i)))
        if delete_originals:
            for a in jax.tree.leaves(w):
                a.delete()
    return unflatten_names(flat, params)


@jax.jit
def _random_fp4_like(w, key):
    """One compiled program per stack: the RMS taken eagerly holds float32 copies of a 4 GB stack."""
    from djax import fp4
    from djax.quant import dense

    rms = jnp.sqrt(jnp.mean(jnp.square(dense(w, jnp.float32))))  # w may be FP8 already (--fp8)
    byte = jnp.clip(jnp.round(jnp.log2(rms / 2.93)) + 127, 1, 254).astype(jnp.int32)
    return fp4.random_fp4(key, w.shape, byte, byte + 1)


# ---- ahead-of-time compilation of djax's programs ----------------------------------------------------------
class Compiler:
    """Lower and compile djax's jitted functions in background threads; `get` waits for one.

    For each program it records the compile time, XLA's memory analysis (temp bytes) and how the MoE
    ragged_dot was lowered (a cuDNN fusion, or XLA's dense rewrite that runs every expert on every row).
    """

    def __init__(self, workers: int = 4):
        self.pool = ThreadPoolExecutor(max_workers=workers)
        self.futs: dict = {}
        self.info: dict[str, dict] = {}
        self.lock = threading.Lock()

    def submit(self, name: str, fn, *args):
        """fn a jitted function lowered here for args, or a `jax.stages.Lowered` (no args) to compile."""

        def job():
            t = time.perf_counter()
            out = (fn if isinstance(fn, jax.stages.Lowered) else fn.lower(*args)).compile()
            info = {"compile_s": round(time.perf_counter() - t, 2)}
            try:
                m = out.memory_analysis()
                info["temp_bytes"] = int(m.temp_size_in_bytes)
                info["argument_bytes"] = int(m.argument_size_in_bytes)
                info["output_bytes"] = int(m.output_size_in_bytes)
            except Exception as e:  # noqa: BLE001
                info["memory_analysis"] = repr(e)
            try:
                txt = out.as_text()
                info["hlo_ragged_dot"] = txt.count("ragged-dot(")
                info["hlo_custom_calls"] = dict(Counter(re.findall(r'custom_call_target="([^"]+)"', txt)))
                # Ops shaped [experts, rows, f or d]: XLA's dense rewrite of ragged_dot (every expert, every row).
                info["hlo_all_expert_ops"] = len(re.findall(r"\[256,\d+,(?:2048|4096)\]", txt))
            except Exception as e:  # noqa: BLE001
                info["hlo"] = repr(e)
            with self.lock:
                self.info[name] = info
            return out

        self.futs[name] = self.pool.submit(job)

    def get(self, name: str):
        return self.futs[name].result()

    def wait_all(self) -> None:
        for name, f in self.futs.items():
            try:
                f.result()
            except Exception as e:  # noqa: BLE001
                with self.lock:
                    self.info.setdefault(name, {})["error"] = repr(e)
                log(f"compile {name} failed: {e!r}")


def fits(comp: Compiler, name: str) -> None:
    """Raise (so the measurement is skipped and recorded) if a program's temp memory cannot fit now."""
    temp = comp.info.get(name, {}).get("temp_bytes")
    stats = jax.devices()[0].memory_stats() or {}
    limit, used = stats.get("bytes_limit"), stats.get("bytes_in_use")
    if temp is None or limit is None or used is None:
        return
    free = limit - used
    if temp > free - (2 << 30):
        raise MemoryError(
            f"{name}: needs {temp / 2**30:.1f} GiB of temp memory, {free / 2**30:.1f} GiB free in JAX's pool"
        )


def synthetic_state(cfg, b: int, max_len: int, ctx: int, seed: int):
    """A decoder state of `b` rows at context `ctx`: random entries in every ring and pool (decode's cost does
    not depend on the values; djax's step reads the whole pools whatever the length)."""

    @jax.jit
    def make(key):
        st = djax.init_state(cfg, b, max_len)
        leaves, tree = jax.tree.flatten(st)
        keys = jax.random.split(key, len(leaves))
        out = [
            jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype)
            if jnp.issubdtype(x.dtype, jnp.floating)
            else x
            for k, x in zip(keys, leaves)
        ]
        st = jax.tree.unflatten(tree, out)
        st["lengths"] = jnp.full((b,), ctx, jnp.int32)
        return st

    return make(jax.random.key(seed))


def sds(shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, dtype)


def prefill_max_len(w: dict, t: int) -> int:
    return w["max_len"] if t <= w["context"] else t + 1024


# ---- the same weights in HF transformers -------------------------------------------------------------------
# transformers' conversion_mapping.py "deepseek_v4" renames (DeepSeek names -> HF in-memory names), in order.
HF_RENAMES = (
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight$", "embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_fn$", "hc_head.hc_fn"),
    (r"^hc_head_base$", "hc_head.hc_base"),
    (r"^hc_head_scale$", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn$", ".attn_hc.fn"),
    (r"\.hc_attn_base$", ".attn_hc.base"),
    (r"\.hc_attn_scale$", ".attn_hc.scale"),
    (r"\.hc_ffn_fn$", ".ffn_hc.fn"),
    (r"\.hc_ffn_base$", ".ffn_hc.base"),
    (r"\.hc_ffn_scale$", ".ffn_hc.scale"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)


def hf_name(name: str) -> str:
    for pat, rep in HF_RENAMES:
        name = re.sub(pat, rep, name)
    return name if name.startswith("lm_head.") else "model." + name


def build_hf(cfg: djax.ModelConfig, params: dict, device: str):
    """HF DeepseekV4ForCausalLM (eager attention, default experts backend) holding djax's weights.

    Built on the meta device, then every tensor is set from djax's arrays: shared through DLPack where
    dtype and layout agree, the packed experts gate_up_proj [e, 2f, d] = concat(w1, w3) is a copy.
    """
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    hcfg = DeepseekV4Config(**cfg.to_hf(), attn_implementation="eager")
    torch.set_default_dtype(getattr(torch, cfg.dtype))  # as from_pretrained(dtype=...) would
    try:
        with torch.device("meta"):
            model = DeepseekV4ForCausalLM(hcfg)
    finally:
        torch.set_default_dtype(torch.float32)
    model.eval()
    targets = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    persistent = set(model.state_dict().keys())

    def as_torch(x):
        t = torch.from_dlpack(x)
        return t if t.device.type == device.split(":")[0] else t.to(device)

    src: dict[str, object] = {}
    for name, arr in flatten_names(params).items():
        m = re.match(r"^layers\.(\d+)\.ffn\.experts\.(w[123])$", name)
        if m:
            i, w = m.groups()
            base = f"model.layers.{i}.mlp.experts."
            if w == "w2":
                src[base + "down_proj"] = arr
            elif w == "w1":
                src[base + "gate_up_proj"] = (arr, params["layers"][int(i)]["ffn"]["experts"]["w3"])
            continue
        src[hf_name(name)] = arr
    missing = sorted(persistent - set(src))
    unexpected = sorted(set(src) - persistent)
    if missing or unexpected:
        raise RuntimeError(f"HF name map mismatch: missing {missing[:10]}, unexpected {unexpected[:10]}")

    shared_bytes = copied_bytes = 0
    for name, value in src.items():
        tgt = targets[name]
        if isinstance(value, tuple):
            t = torch.cat([as_torch(value[0]), as_torch(value[1])], dim=1)
            copied_bytes += t.numel() * t.element_size()
        else:
            t = as_torch(value)
            if t.dtype != tgt.dtype:
                t = t.to(tgt.dtype)
                copied_bytes += t.numel() * t.element_size()
            else:
                shared_bytes += t.numel() * t.element_size()
        if tuple(t.shape) != tuple(tgt.shape):
            raise RuntimeError(f"{name}: djax shape {tuple(t.shape)} vs HF {tuple(tgt.shape)}")
        mod_name, _, leaf = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        if leaf in mod._parameters:
            mod._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)
        else:
            mod._buffers[leaf] = t
    # Non-persistent buffers (rotary tables) are rebuilt on the device.
    for mname, mod in list(model.named_modules()):
        if type(mod).__name__.endswith("RotaryEmbedding"):
            with torch.device(device):
                fresh = type(mod)(hcfg)
            parent, _, leaf = mname.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, fresh)
    left = [
        n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"
    ]
    if left:
        raise RuntimeError(f"HF tensors left on meta: {left[:10]}")
    info = {
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "bytes_shared_with_djax": shared_bytes,
        "bytes_copied": copied_bytes,
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    }
    return model, info


# ---- byte accounting for the decode roofline ----------------------------------------------------------------
def nbytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def expected_experts(cfg: djax.ModelConfig, b: int) -> float:
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** b)


def experts_touched(count_step, cfg, params, tok, state) -> list[int]:
    """Distinct routed experts each layer's router picks in one more decode step from `state`, by the step
    compiled with "expert_counts" in its state. With random weights and greedy feedback the picks need not
    be uniform (the hash-routed layer sees only the batch's distinct tokens), so the roofline counts these."""
    counts = jnp.zeros((cfg.num_hidden_layers, cfg.n_routed_experts), jnp.int32)
    _, after = count_step(params, tok, dict(state, expert_counts=counts))
    return [int(n) for n in np.asarray(jnp.sum(after["expert_counts"] > 0, axis=-1))]


def decode_bytes(cfg: djax.ModelConfig, params: dict, b: int, ctx: int, experts_per_layer=None) -> dict:
    """Bytes one decode step at batch b and context ctx must read from device memory.

    Attention, norms and mHC weights of every layer; router, shared expert and the routed experts
    touched (expected distinct count for uniform routing, or `experts_per_layer` if measured); the
    embedding rows; the whole LM head; the decoder state entries that are valid at ctx (sliding window,
    CSA index keys and the top-k entries it selects, HCA entries, the compressors' raw rings).
    """
    itm = jnp.dtype(cfg.dtype).itemsize
    d = cfg.hidden_size
    out = {
        "attention_and_mhc": 0,
        "router_and_shared": 0,
        "routed_experts": 0,
        "embed_rows": b * d * itm,
        "head": nbytes(params["head"])
        + nbytes(params["norm"])
        + nbytes([params[k] for k in ("hc_head_fn", "hc_head_base", "hc_head_scale")]),
        "state": 0,
    }
    k_dim, ik = cfg.head_dim, cfg.index_head_dim
    for i, lp in enumerate(params["layers"]):
        ffn = lp["ffn"]
        out["attention_and_mhc"] += nbytes({k: v for k, v in lp.items() if k != "ffn"})
        gate = nbytes(ffn["gate"]["weight"]) + nbytes(ffn["gate"].get("bias", []))
        if "tid2eid" in ffn["gate"]:
            gate += b * cfg.num_experts_per_tok * 4
        out["router_and_shared"] += gate + nbytes(ffn["shared_experts"])
        n_exp = experts_per_layer[i] if experts_per_layer is not None else expected_experts(cfg, b)
        ex = ffn["experts"]
        per_expert = nbytes([ex[w] for w in ("w1", "w2", "w3")]) / cfg.n_routed_experts  # FP8: with scales
        out["routed_experts"] += int(n_exp * per_expert)
        m = cfg.compress_ratios[i]
        st = min(ctx, cfg.sliding_window) * k_dim
        if m == 4:
            n = ctx // m
            st += n * ik + min(cfg.index_topk, n) * k_dim + 2 * m * (2 * k_dim + 2 * ik) * 2
        elif m:
            st += (ctx // m) * k_dim + m * k_dim * 2
        out["state"] += b * st * itm
    out["total"] = sum(out.values())
    return out


def prefill_flops(cfg: djax.ModelConfig, params: dict, b: int, t: int) -> float:
    """Matmul FLOPs of a prefill (weights touched per token x 2, attention scores and values, last-token head)."""
    d, f, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    itm = jnp.dtype(cfg.dtype).itemsize
    per_tok = 0
    for i, lp in enumerate(params["layers"]):
        attn_params = sum(
            x.size for x in jax.tree.leaves(lp["attn"]) if x.dtype.itemsize == itm and x.ndim == 2
        )
        per_tok += attn_params + lp["ffn"]["gate"]["weight"].size + 3 * f * d * (k + cfg.n_shared_experts)
        m = cfg.compress_ratios[i]
        keys = (
            min(t, cfg.sliding_window)
            if not m
            else min(t, cfg.sliding_window) + (min(cfg.index_topk, t // m) if m == 4 else t // (2 * m))
        )
        per_tok += 2 * cfg.num_attention_heads * cfg.head_dim * keys  # QK and PV (mean visible keys)
        if m == 4:
            per_tok += cfg.index_n_heads * cfg.index_head_dim * t // (2 * m)
    return 2.0 * b * t * per_tok + 2.0 * b * d * cfg.vocab_size


# ---- measurements ------------------------------------------------------------------------------------------
def measure_ceilings(torch, device: str, w: dict) -> dict:
    """Device-to-device copy bandwidth (bytes read + written per second) and a bf16 matmul rate."""
    out = {}
    n = w["copy_bytes"] // 2
    src = torch.randn(n, device=device, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    ts = []
    for i in range(23):
        sync(torch, device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(torch, device)
        if i >= 3:
            ts.append(time.perf_counter() - t)
    out["copy_bytes_moved"] = 2 * n * 2
    out["copy_seconds_median"] = median(ts)
    out["copy_bandwidth_Bps"] = 2 * n * 2 / median(ts)
    del src, dst
    m = w["matmul"]
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    ts = []
    for i in range(13):
        sync(torch, device)
        t = time.perf_counter()
        a @ b
        sync(torch, device)
        if i >= 3:
            ts.append(time.perf_counter() - t)
    out["matmul_n"] = m
    out["matmul_flops_per_s"] = 2 * m**3 / median(ts)
    del a, b
    return out


def sync(torch, device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def guarded(res: dict, key: str, fn, *a) -> None:
    """Run one measurement; an exception is recorded under res['errors'][key] and the run goes on."""
    try:
        fn(*a)
    except Exception as e:  # noqa: BLE001
        import traceback

        res.setdefault("errors", {})[key] = traceback.format_exc()[-3000:]
        log(f"ERROR in {key}: {e!r}")


def run_hf(res: dict, model, torch, device: str, cfg, w: dict, rng) -> None:
    from transformers import DynamicCache

    v = cfg.vocab_size
    cuda = device.startswith("cuda")

    def step(tok, cache):
        return (
            model(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        )

    def prefill(b, t):
        x = torch.tensor(rng.integers(2, v, (b, t)), device=device)
        ts = []
        for i in range(1 + w["prefill_reps"]):
            cache = DynamicCache(config=model.config)
            sync(torch, device)
            s = time.perf_counter()
            model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
            sync(torch, device)
            if i:
                ts.append(time.perf_counter() - s)
            del cache
        res["prefill"][f"{b}x{t}"] = {
            "seconds": ts,
            "median_s": median(ts),
            "tokens_per_s": b * t / median(ts),
        }
        log(f"HF prefill {b}x{t}: {b * t / median(ts):,.0f} tok/s")

    def decode(b):
        ctx = w["context"]
        x = torch.tensor(rng.integers(2, v, (b, ctx)), device=device)
        cache = DynamicCache(config=model.config)
        out = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        del out
        for _ in range(2):  # warm-up
            tok = step(tok, cache)
        # Distinct routed experts touched by one step, per layer (router hooks: gate returns logits, weights, ids).
        seen: list = [None] * len(gates)
        hooks = [
            g.register_forward_hook(partial(lambda i, mod, inp, o: seen.__setitem__(i, o[2]), i))
            for i, g in enumerate(gates)
        ]
        try:
            tok = step(tok, cache)
        finally:
            for h in hooks:
                h.remove()
        touched = [int(torch.unique(s).numel()) for s in seen]
        ts = []
        for _ in range(w["hf_decode_steps"]):
            sync(torch, device)
            s = time.perf_counter()
            tok = step(tok, cache)
            sync(torch, device)
            ts.append(time.perf_counter() - s)
        res["decode"][str(b)] = {
            "context": ctx,
            "step_seconds": ts,
            "median_step_s": median(ts),
            "tokens_per_s": b / median(ts),
            "experts_touched_per_layer": touched,
        }
        log(
            f"HF decode b={b}: {median(ts) * 1e3:.2f} ms/step, {b / median(ts):,.1f} tok/s, experts {touched}"
        )

    gates = [layer.mlp.gate for layer in model.model.layers]
    with torch.no_grad():
        for b, t in w["hf_prefill"]:
            guarded(res, f"prefill_{b}x{t}", prefill, b, t)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        for b in w["hf_decode_batches"]:
            guarded(res, f"decode_{b}", decode, b)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        if cuda:
            res["max_memory_allocated_bytes"] = int(torch.cuda.max_memory_allocated())


def run_djax(res: dict, params, cfg, w: dict, comp: Compiler, rng, save, parts) -> None:
    v = cfg.vocab_size
    argmax = jax.jit(lambda lg: jnp.argmax(lg, axis=-1).astype(jnp.int32))

    def prefill(b, t, program="prefill", p=None):
        p = params if p is None else p
        fn = comp.get(f"{program}_{b}x{t}")
        fits(comp, f"{program}_{b}x{t}")
        x = jnp.asarray(rng.integers(2, v, (b, t)), jnp.int32)
        lengths = jnp.full((b,), t, jnp.int32)
        jax.block_until_ready(fn(p, x, lengths))
        ts = []
        for _ in range(w["prefill_reps"]):
            s = time.perf_counter()
            jax.block_until_ready(fn(p, x, lengths))
            ts.append(time.perf_counter() - s)
        res.setdefault(program, {})[f"{b}x{t}"] = {
            "seconds": ts,
            "median_s": median(ts),
            "tokens_per_s": b * t / median(ts),
            "max_len": prefill_max_len(w, t),
        }
        log(f"djax {program} {b}x{t}: {b * t / median(ts):,.0f} tok/s")

    def decode(b, program="decode", key="decode", p=None):
        p = params if p is None else p
        dec = comp.get(f"{program}_{b}")
        fits(comp, f"{program}_{b}")
        ct = w["context"]
        state = synthetic_state(cfg, b, w["max_len"], ct, b)
        tok = jnp.asarray(rng.integers(2, v, (b,)), jnp.int32)
        for _ in range(2):
            logits, state = dec(p, tok, state)
            tok = argmax(logits)
        tok.block_until_ready()
        ts = []
        for _ in range(w["decode_reps"]):
            s = time.perf_counter()
            for _ in range(w["decode_steps"]):
                logits, state = dec(p, tok, state)
                tok = argmax(logits)
            tok.block_until_ready()
            ts.append((time.perf_counter() - s) / w["decode_steps"])
        res.setdefault(key, {})[str(b)] = {
            "context": ct,
            "context_at_end": int(np.asarray(state["lengths"])[0]),
            "max_len": w["max_len"],
            "state": "synthetic (random entries at this context)",
            "steps_per_rep": w["decode_steps"],
            "step_seconds": ts,
            "median_step_s": median(ts),
            "tokens_per_s": b / median(ts),
        }
        if key == "decode":
            res[key][str(b)]["experts_touched_per_layer"] = experts_touched(
                comp.get(f"count_{b}"), cfg, p, tok, state
            )
        log(f"djax {key} b={b}: {median(ts) * 1e3:.2f} ms/step, {b / median(ts):,.1f} tok/s")

    def generate():
        # End to end: prefill of the prompts, then max_new_tokens - 1 decode steps in a while_loop.
        gb, gn = w["generate"]
        gp = w["generate_prompt"]
        gen = comp.get("generate")
        fits(comp, "generate")
        prompts = jnp.asarray(rng.integers(2, v, (gb, gp)), jnp.int32)
        batch = djax.Batch(prompts, jnp.full((gb,), gp, jnp.int32), jnp.zeros((gb,), jnp.uint32))
        out = jax.block_until_ready(gen(params, batch))
        ts = []
        for _ in range(w["generate_reps"]):
            s = time.perf_counter()
            out = jax.block_until_ready(gen(params, batch))
            ts.append(time.perf_counter() - s)
        n_new = int(np.asarray(out.num_tokens).sum())
        res["generate"] = {
            "batch": gb,
            "prompt_len": gp,
            "max_new_tokens": gn,
            "new_tokens": n_new,
            "seconds": ts,
            "median_s": median(ts),
            "new_tokens_per_s": n_new / median(ts),
        }
        log(
            f"djax generate b={gb} prompt {gp} +{gn}: {median(ts):.3f} s, {n_new / median(ts):,.1f} new tok/s"
        )

    for b, t in w["prefill"] if "prefill" in parts else []:
        guarded(res, f"prefill_{b}x{t}", prefill, b, t)
        save()
    for b in w["decode_batches"] if "decode" in parts else []:
        guarded(res, f"decode_{b}", decode, b)
        save()
    for b in w["decode_batches"] if "decode_xla" in parts else []:
        guarded(res, f"decode_xla_{b}", decode, b, "decode_xla", "decode_xla")
        save()
    dequant = dense_on_use(params) if parts & {"decode_dequant", "prefill_dequant"} else None
    for b in w["decode_batches"] if "decode_dequant" in parts else []:
        guarded(res, f"decode_dequant_{b}", decode, b, "decode_dequant", "decode_dequant", dequant)
        save()
    for b, t in w["prefill"] if "prefill_dequant" in parts else []:
        guarded(res, f"prefill_dequant_{b}x{t}", prefill, b, t, "prefill_dequant", dequant)
        save()
    if "generate" in parts:
        guarded(res, "generate", generate)


# ---- report -------------------------------------------------------------------------------------------------
def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        log(f"no plot: {e}")
        return
    dj, hf = result["djax"], result.get("hf") or {}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    shapes = list(dj["prefill"])
    x = np.arange(len(shapes))
    axes[0].bar(x - 0.2, [dj["prefill"][s]["tokens_per_s"] for s in shapes], 0.4, label="djax")
    if hf.get("prefill"):
        axes[0].bar(
            x + 0.2, [hf["prefill"].get(s, {}).get("tokens_per_s", 0) for s in shapes], 0.4, label="HF"
        )
    axes[0].set_xticks(x, shapes)
    axes[0].set_title("prefill tokens/s")
    axes[0].legend()
    bs = list(dj["decode"])
    x = np.arange(len(bs))
    axes[1].bar(x - 0.2, [dj["decode"][b]["tokens_per_s"] for b in bs], 0.4, label="djax")
    if hf.get("decode"):
        axes[1].bar(x + 0.2, [hf["decode"].get(b, {}).get("tokens_per_s", 0) for b in bs], 0.4, label="HF")
    axes[1].set_xticks(x, [f"b={b}" for b in bs])
    axes[1].set_yscale("log")
    axes[1].set_title("decode tokens/s (log)")
    axes[1].legend()
    rr = result["roofline"]
    axes[2].bar(x - 0.2, [rr["djax"][b]["fraction_of_copy_bw"] for b in bs], 0.4, label="djax")
    if rr.get("hf"):
        axes[2].bar(x + 0.2, [rr["hf"].get(b, {}).get("fraction_of_copy_bw", 0) for b in bs], 0.4, label="HF")
    axes[2].set_xticks(x, [f"b={b}" for b in bs])
    axes[2].set_title("decode: needed bytes/s over copy bandwidth")
    axes[2].legend()
    fig.suptitle(f"{result['device']} - {result['model']['summary']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


def table(result: dict) -> str:
    dj, hf = result.get("djax") or {}, result.get("hf") or {}
    ce, ck, rf = result.get("ceilings", {}), result.get("check", {}), result.get("roofline", {})
    nan = float("nan")

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    q = result.get("quantized") or "FP8"  # which weights part decode_dequant makes dense on use
    lines = [
        f"device {result['device']} | {result['date']} | jax {result['versions']['jax']} | "
        f"torch {result['versions'].get('torch')} | transformers {result['versions'].get('transformers')}",
        f"model: {result['model']['summary']}, {result['model']['param_bytes'] / 1e9:.1f} GB",
        f"copy bw {ce.get('copy_bandwidth_Bps', nan) / 1e12:.2f} TB/s (read+write), "
        f"bf16 matmul {ce.get('matmul_flops_per_s', nan) / 1e12:.0f} TFLOP/s",
        f"logits check bf16, {ck.get('prompt_len')} tokens: max|djax-hf|/max|hf| = {ck.get('max_rel_err', nan):.3e}, "
        f"worst row rel L2 {ck.get('max_row_rel_l2', nan):.3e}, argmax agree {ck.get('argmax_agree', nan):.3f}",
        f"{'what':<24}{'djax':>12}{'HF':>12}{'djax/HF':>9}{'djax roof':>10}{'HF roof':>9}",
    ]
    for s, r in dj.get("prefill", {}).items():
        h = hf.get("prefill", {}).get(s, {}).get("tokens_per_s")
        lines.append(
            f"{'prefill ' + s + ' tok/s':<24}{r['tokens_per_s']:>12,.0f}{fmt(h, ',.0f'):>12}"
            f"{fmt(r['tokens_per_s'] / h if h else None, '.2f'):>9}"
            f"{fmt(result.get('prefill_mfu', {}).get(s), '.3f'):>10}"
            f"{fmt(result.get('prefill_mfu_hf', {}).get(s), '.3f'):>9}"
        )
    for b, r in dj.get("decode", {}).items():
        h = hf.get("decode", {}).get(b, {}).get("tokens_per_s")
        lines.append(
            f"{'decode b=' + b + ' tok/s':<24}{r['tokens_per_s']:>12,.1f}{fmt(h, ',.1f'):>12}"
            f"{fmt(r['tokens_per_s'] / h if h else None, '.2f'):>9}"
            f"{fmt(rf.get('djax', {}).get(b, {}).get('fraction_of_copy_bw'), '.3f'):>10}"
            f"{fmt(rf.get('hf', {}).get(b, {}).get('fraction_of_copy_bw'), '.3f'):>9}"
        )
    for b, r in dj.get("decode", {}).items():
        h = hf.get("decode", {}).get(b, {}).get("median_step_s")
        fl = rf.get("djax", {}).get(b, {}).get("floor_ms")
        lines.append(
            f"{'decode b=' + b + ' ms/step':<24}{r['median_step_s'] * 1e3:>12.2f}"
            f"{fmt(h * 1e3 if h else None, '.2f'):>12}   floor {fmt(fl, '.2f')} ms at copy bw"
        )
    for s, r in dj.get("prefill_dequant", {}).items():  # prefill with the quantized weights made dense on use
        k = dj.get("prefill", {}).get(s)
        lines.append(
            f"{q.lower() + ' dense on use ' + s:<24}{r['tokens_per_s']:>12,.0f}   {q} kernels' speed-up "
            f"{fmt(r['median_s'] / k['median_s'] if k else None, '.2f')}x"
        )
    # the decode step without what a part takes away, and the speed-up of having it
    for part, label, what in (
        ("decode_xla", "no kernels b={} ms", "djax.kernels"),
        ("decode_dequant", f"{q.lower()} dense on use b={{}}", f"{q} kernels'"),
    ):
        for b, r in dj.get(part, {}).items():
            k = dj.get("decode", {}).get(b)
            lines.append(
                f"{label.format(b):<24}{r['median_step_s'] * 1e3:>12.2f}   {what} speed-up "
                f"{fmt(r['median_step_s'] / k['median_step_s'] if k else None, '.2f')}x"
            )
    g = dj.get("generate")
    if g:
        lines.append(
            f"djax generate b={g['batch']} prompt {g['prompt_len']} +{g['max_new_tokens']}: "
            f"{g['median_s']:.3f} s end to end, {g['new_tokens_per_s']:,.1f} new tok/s"
        )
    lines.append(
        "roof: decode = (bytes a step must read / step time) / copy bw; "
        "prefill = matmul FLOPs / time / bf16 matmul rate"
    )
    errs = (
        list(result.get("errors", []))
        + [f"djax {k}" for k in dj.get("errors", {})]
        + [f"hf {k}" for k in hf.get("errors", {})]
    )
    if errs:
        lines.append(f"ERRORS: {[e['where'] if isinstance(e, dict) else e for e in errs]}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny config and sizes (CPU debugging)")
    ap.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results", help="output folder")
    ap.add_argument("--name", default=None, help="result file stem suffix (default: h200, or tiny_<backend>)")
    ap.add_argument(
        "--parts",
        default="check,ceilings,hf,prefill,decode,generate",
        help="comma list of: check (logits vs HF), hfvariants (HF with eager experts too), ceilings, hf "
        "(HF timings), prefill, decode, decode_xla (decode without djax.kernels: the speed-up they bring), "
        "generate; with --fp8 or --fp4-experts also decode_dequant and prefill_dequant (the quantized "
        "weights made dense on use: what the kernels reading them as stored bring)",
    )
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="the projections and routed experts as FP8 with 128x128 scales (djax.quantize_projections), as "
        "an FP8 checkpoint loads them; decode and prefill with kernels then run them through fp8_gemm and "
        "the FP8 grouped GEMM. HF parts are skipped",
    )
    ap.add_argument(
        "--fp4-experts",
        action="store_true",
        help="the routed experts as FP4 with UE8M0 scales (V4.1's format, random codes); decode with kernels "
        "reads them as stored through the grouped GEMMs, part decode_dequant makes them dense on use (what "
        "ran before the kernels read FP4). HF parts are skipped",
    )
    ap.add_argument(
        "--decode-batches",
        default=None,
        help="comma list of batch sizes for the decode parts (default: the workload's, 1,32,128 full size)",
    )
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    # what part decode_dequant makes dense on use: FP8 projections and experts, FP4 experts, or both (FP8
    # projections with FP4 experts is how a V4.1 checkpoint holds its weights)
    quantized = "+".join(q for q, on in (("FP8", args.fp8), ("FP4", args.fp4_experts)) if on) or None
    if quantized:
        parts -= {"check", "hf", "hfvariants"}  # HF would hold these weights in bf16: not the same model
    w = dict(TINY if args.tiny else FULL)
    if args.decode_batches:
        w["decode_batches"] = [int(b) for b in args.decode_batches.split(",")]
    cfg = make_config(args.tiny)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or ("tiny_" + jax.default_backend() if args.tiny else "h200")
    rng = np.random.default_rng(0)

    dev = jax.devices()[0]
    log(f"jax {jax.__version__} on {dev.device_kind} ({jax.default_backend()})")

    # 1. compile djax's programs in the background: the small ones now, prefill and generate once HF's
    # memory is freed (XLA's autotuning and a dense ragged_dot can take large buffers into JAX's pool).
    comp = Compiler(workers=8)
    aparams = djax.abstract_params(cfg)
    if args.fp8:
        aparams = jax.eval_shape(lambda p: djax.quantize_projections(p, cfg), aparams)
    if args.fp4_experts:
        aparams = jax.eval_shape(lambda p: fp4_experts(p, jax.random.key(1)), aparams)
    if not quantized:
        parts -= {"decode_dequant", "prefill_dequant"}
    # The programs with the quantized weights made dense on use are traced first, before any other tracing
    # starts (`no_fp8_weight_reads`), and compiled with the rest.
    dequant = {}
    with no_fp8_weight_reads():
        dense_params = jax.eval_shape(dense_on_use, aparams)
        for b in w["decode_batches"] if "decode_dequant" in parts else []:
            st = jax.eval_shape(lambda b=b: djax.init_state(cfg, b, w["max_len"]))
            dequant[f"decode_dequant_{b}"] = djax.decode.lower(dense_params, sds((b,)), st, cfg)
        for b, t in w["prefill"] if "prefill_dequant" in parts else []:
            dequant[f"prefill_dequant_{b}x{t}"] = djax.prefill.lower(
                dense_params, sds((b, t)), sds((b,)), cfg, prefill_max_len(w, t)
            )
    if "check" in parts:
        comp.submit("forward", djax.forward, aparams, sds((1, w["check_len"])), cfg)
    for b in w["decode_batches"] if "decode" in parts else []:
        st = jax.eval_shape(lambda b=b: djax.init_state(cfg, b, w["max_len"]))
        comp.submit(f"decode_{b}", djax.decode, aparams, sds((b,)), st, cfg)
        # the same step with the router's choices counted (untimed): the experts it touches, for the roofline
        st = dict(st, expert_counts=sds((cfg.num_hidden_layers, cfg.n_routed_experts)))
        comp.submit(f"count_{b}", djax.decode, aparams, sds((b,)), st, cfg)
    for b in w["decode_batches"] if "decode_xla" in parts else []:
        st = jax.eval_shape(lambda b=b: djax.init_state(cfg, b, w["max_len"]))
        comp.submit(f"decode_xla_{b}", decode_without_kernels(cfg, b), aparams, sds((b,)), st)
    for prog, lowered in dequant.items():
        if prog.startswith("decode"):
            comp.submit(prog, lowered)

    def submit_big():
        for b, t in w["prefill"] if "prefill" in parts else []:
            comp.submit(
                f"prefill_{b}x{t}", djax.prefill, aparams, sds((b, t)), sds((b,)), cfg, prefill_max_len(w, t)
            )
        for name, lowered in dequant.items():
            if name.startswith("prefill"):
                comp.submit(name, lowered)
        if "generate" not in parts:
            return
        gb, gn = w["generate"]
        gen_fn = jax.jit(
            partial(
                djax.generate, config=cfg, sampling=djax.SamplingParams(ignore_eos=True), max_new_tokens=gn
            )
        )
        comp.submit(
            "generate",
            gen_fn,
            aparams,
            djax.Batch(sds((gb, w["generate_prompt"])), sds((gb,)), sds((gb,), jnp.uint32)),
        )

    # Weights. float32 leaves are rounded to bf16 values (see the module docstring).
    t = time.perf_counter()
    params = djax.init_params(cfg, jax.random.key(0))
    params = jax.tree.map(
        lambda x: x.astype(jnp.bfloat16).astype(jnp.float32) if x.dtype == jnp.float32 else x, params
    )
    # Quantized in place, leaf by leaf: an 80 GB card holds the bf16 model but not it and its FP8 form.
    if args.fp8:
        params = djax.quantize_projections(params, cfg, delete_originals=True)
    if args.fp4_experts:
        params = fp4_experts(params, jax.random.key(1), delete_originals=True)
    jax.block_until_ready(params)
    init_s = time.perf_counter() - t
    log(f"params: {nbytes(params) / 1e9:.2f} GB in {init_s:.1f} s")

    quantized_summary = ", projections FP8 (128x128 scales)" if args.fp8 else ""
    if args.fp4_experts:
        quantized_summary += ", routed experts FP4 (e2m1, per-32 UE8M0 scales)"
    elif args.fp8:
        quantized_summary += ", routed experts FP8"
    result: dict = {
        "benchmark": "bench_generate",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": dev.device_kind,
        "backend": jax.default_backend(),
        "host": platform.node(),
        "versions": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
            "numpy": np.__version__,
        },
        "model": {
            "summary": f"V4-Flash shapes, {cfg.num_hidden_layers} layers ratios {cfg.compress_ratios}, "
            f"{cfg.num_hash_layers} hash layer, bf16 random weights" + quantized_summary,
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()},
            "param_bytes": nbytes(params),
            "init_seconds": round(init_s, 1),
        },
        "quantized": quantized,
        "workloads": {k: v for k, v in w.items()},
        "check": {},
        "notes": [],
        "parts": sorted(parts),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }

    path = out_dir / f"generate_{name}.json"

    def save() -> None:
        derive(result, cfg, params)
        result["total_seconds"] = round(time.perf_counter() - T0, 1)
        path.write_text(json.dumps(result, indent=1, default=float) + "\n")

    def attempt(what: str, fn, *a):
        try:
            return fn(*a)
        except Exception as e:  # noqa: BLE001 - record and go on to the next measurement
            import traceback

            result.setdefault("errors", []).append(
                {"where": what, "error": repr(e), "trace": traceback.format_exc()[-3000:]}
            )
            log(f"ERROR in {what}: {e!r}")
            return None

    torch = None
    tdev = "cpu"
    try:
        import torch  # noqa: F811

        tdev = "cuda" if torch.cuda.is_available() else "cpu"
        result["versions"]["torch"] = torch.__version__
    except ImportError as e:
        result["notes"].append(f"no torch: {e}")
    hf_model = None
    if not args.no_hf and torch is not None and parts & {"check", "hf"}:
        try:
            import transformers

            result["versions"]["transformers"] = transformers.__version__
            from transformers import DeepseekV4ForCausalLM  # noqa: F401
        except ImportError as e:
            result["notes"].append(f"HF part skipped: {e}")
            log(f"HF part skipped: {e}")
        else:
            t = time.perf_counter()
            built = attempt("build_hf", build_hf, cfg, params, tdev)
            if built is not None:
                hf_model, hf_info = built
                hf_info["build_seconds"] = round(time.perf_counter() - t, 1)
                result["hf_model"] = hf_info
                log(f"HF model built: {hf_info}")

    # 2. logits check on a short prompt.
    def check():
        tokens = rng.integers(2, cfg.vocab_size, (1, w["check_len"]))
        ours = np.asarray(comp.get("forward")(params, jnp.asarray(tokens, jnp.int32)))
        result["check"]["prompt_len"] = w["check_len"]
        result["check"]["djax_finite"] = bool(np.isfinite(ours).all())
        if hf_model is None:
            return
        with torch.no_grad():
            ref = (
                hf_model(input_ids=torch.tensor(tokens, device=tdev), use_cache=False)
                .logits.float()
                .cpu()
                .numpy()
            )
        err = np.abs(ours - ref)
        scale = np.abs(ref).max()
        rel_rows = np.linalg.norm(ours - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
        result["check"].update(
            max_abs_err=float(err.max()),
            max_abs_ref=float(scale),
            max_rel_err=float(err.max() / scale),
            max_row_rel_l2=float(rel_rows.max()),
            mean_row_rel_l2=float(rel_rows.mean()),
            argmax_agree=float((ours.argmax(-1) == ref.argmax(-1)).mean()),
            finite=bool(np.isfinite(ours).all() and np.isfinite(ref).all()),
        )
        log(f"logits check: {result['check']}")
        if "hfvariants" in parts:
            # HF against itself with another op order: the experts as a per-expert loop instead of grouped_mm.
            impl = hf_model.config._experts_implementation
            hf_model.config._experts_implementation = "eager"
            try:
                with torch.no_grad():
                    ref2 = hf_model(
                        input_ids=torch.tensor(tokens, device=tdev), use_cache=False
                    ).logits.float()
                ref2 = ref2.cpu().numpy()
            finally:
                hf_model.config._experts_implementation = impl
            for key, a, b in (
                ("hf_eager_experts_vs_hf_grouped_mm", ref2, ref),
                ("djax_vs_hf_eager_experts", ours, ref2),
            ):
                result["check"][key] = {
                    "max_rel_err": float(np.abs(a - b).max() / np.abs(b).max()),
                    "mean_row_rel_l2": float(
                        np.mean(np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1))
                    ),
                    "argmax_agree": float((a.argmax(-1) == b.argmax(-1)).mean()),
                }
            log(f"HF variants: {result['check']}")

    if "check" in parts:
        attempt("logits_check", check)
        save()
    comp.wait_all()
    result["compiled"] = dict(comp.info)
    log(f"compiled: {comp.info}")

    # 3. ceilings.
    result["ceilings"] = {"copy_bandwidth_Bps": float("nan"), "matmul_flops_per_s": float("nan")}
    if torch is not None and "ceilings" in parts:
        c = attempt("ceilings", measure_ceilings, torch, tdev, w)
        if c:
            result["ceilings"] = {**c, "measured_with": f"torch on {tdev}"}
    log(f"ceilings: {result['ceilings']}")
    save()

    # 4. HF, then free its memory.
    if hf_model is not None:
        if "hf" in parts:
            result["hf"] = {"prefill": {}, "decode": {}}
            attempt("hf", run_hf, result["hf"], hf_model, torch, tdev, cfg, w, rng)
        del hf_model
        gc.collect()
        if tdev == "cuda":
            torch.cuda.empty_cache()
        save()

    # 5. djax (always after HF is freed: see step 1).
    submit_big()
    comp.wait_all()
    result["compiled"] = dict(comp.info)
    log(f"compiled: {comp.info}")
    result["djax"] = {"prefill": {}, "decode": {}, "generate": {}}
    attempt("djax", run_djax, result["djax"], params, cfg, w, comp, rng, save, parts)
    save()
    log(f"wrote {path}")
    attempt("plot", plot, result, out_dir / f"generate_{name}.png")
    print(table(result), flush=True)
    return 0


def derive(result: dict, cfg, params) -> None:
    """Roofline fractions and djax/HF ratios from whatever has been measured so far."""
    bw = result.get("ceilings", {}).get("copy_bandwidth_Bps", float("nan"))
    mm = result.get("ceilings", {}).get("matmul_flops_per_s", float("nan"))
    dj, hf = result.get("djax") or {}, result.get("hf") or {}
    rf = result["roofline"] = {"copy_bandwidth_Bps": bw, "djax": {}, "hf": {}}
    for who, res in (("djax", dj), ("hf", hf)):
        for b, r in res.get("decode", {}).items():
            need = decode_bytes(cfg, params, int(b), r["context"], r.get("experts_touched_per_layer"))
            rf[who][b] = {
                "bytes": need,
                "achieved_Bps": need["total"] / r["median_step_s"],
                "fraction_of_copy_bw": need["total"] / r["median_step_s"] / bw,
                "floor_ms": need["total"] / bw * 1e3,
                "experts_per_layer": r.get("experts_touched_per_layer") or expected_experts(cfg, int(b)),
            }
    result["decode_kernel_speedup"] = {
        b: r["median_step_s"] / dj["decode"][b]["median_step_s"]
        for b, r in dj.get("decode_xla", {}).items()
        if b in dj.get("decode", {})
    }
    q = result.get("quantized") or "FP8"
    speedup_key = (
        "decode_fp8_gemm_speedup" if q == "FP8" else f"decode_{q.lower().replace('+', '_')}_kernels_speedup"
    )
    result[speedup_key] = {
        b: r["median_step_s"] / dj["decode"][b]["median_step_s"]
        for b, r in dj.get("decode_dequant", {}).items()
        if b in dj.get("decode", {})
    }
    result[speedup_key.replace("decode", "prefill", 1)] = {
        s: r["median_s"] / dj["prefill"][s]["median_s"]
        for s, r in dj.get("prefill_dequant", {}).items()
        if s in dj.get("prefill", {})
    }
    result["prefill_mfu"] = {
        s: prefill_flops(cfg, params, *map(int, s.split("x"))) / r["median_s"] / mm
        for s, r in dj.get("prefill", {}).items()
    }
    result["prefill_mfu_hf"] = {
        s: prefill_flops(cfg, params, *map(int, s.split("x"))) / r["median_s"] / mm
        for s, r in hf.get("prefill", {}).items()
    }
    result["ratios_djax_over_hf"] = {
        **{
            f"prefill_{s}": r["tokens_per_s"] / hf["prefill"][s]["tokens_per_s"]
            for s, r in dj.get("prefill", {}).items()
            if s in hf.get("prefill", {})
        },
        **{
            f"decode_b{b}": r["tokens_per_s"] / hf["decode"][b]["tokens_per_s"]
            for b, r in dj.get("decode", {}).items()
            if b in hf.get("decode", {})
        },
    }


if __name__ == "__main__":
    sys.exit(main())
