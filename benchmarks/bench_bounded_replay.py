"""SWA bounded replay (V4.1 prefill): XLA-counted FLOPs with and without it, and the drift of the last logits.

FLOPs: a V4.1-shaped stack with every per-layer shape of V4.1-Flash (hidden 5120, 64 x 512 heads,
384 x 2304 experts, indexer 32 x 128, window 128) but 8 layers keeping the source / reader split
(sliding, ratio-2 source, ratio-2 reader, ratio-1 candidate source, readers, a second index source),
lowered with abstract weights (nothing allocated) and counted by XLA's cost analysis on this host.
Drift: a narrow stack with the same layout and window, random weights, run on CPU; the last prompt
position's logits of bounded-replay prefill against exact prefill.
Time (`--time`, on a GPU): a 3-layer stack with full V4.1-Flash per-layer shapes and random bf16 weights
(about 85 GB: two KV-source layers, ratio 2 then ratio 1 with the candidate selection, then a reader),
prefill of one prompt timed with and without bounded replay (median of repeats, device synced), with
XLA's FLOP count of the same compiled programs.

    python benchmarks/bench_bounded_replay.py [--tokens 2048] [--out benchmarks/results/bounded_replay_cpu.json]
    python benchmarks/bench_bounded_replay.py --time --time-tokens 1024 4096 --out $OUT/bounded_replay_h200.json
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import djax
from djax.config import preset
from djax.models import deepseek_v4 as v4

LAYOUT = dict(
    num_hidden_layers=8,
    compress_ratios=(0, 2, 2, 1, 1, 1, 1, 1),
    kv_source_layer_ids=(1, 3),
    index_source_layer_ids=(1, 3, 5),
    candidate_source_layer_id=3,
    engram_layer_ids=(),
    engram_num_embeddings=(),
    dspark_target_layer_ids=(),
    num_nextn_predict_layers=0,
)


# The timed stack: what fits one H200 in bf16 and still has layers after the last KV source.
TIME_LAYOUT = dict(
    LAYOUT,
    num_hidden_layers=3,
    compress_ratios=(2, 1, 1),
    kv_source_layer_ids=(0, 1),
    index_source_layer_ids=(0, 1),
    candidate_source_layer_id=1,
)


def flops(cfg, tokens: int, keep: int, moe_impl: str = "gather") -> float:
    """XLA cost-analysis FLOPs of one prefill of `tokens` tokens (batch 1), weights abstract.

    MoE as "gather" (each pick's expert matrices): XLA counts the routed work as it is; it counts a
    `ragged_dot` as if every expert ran on every pick (n k e d f), which hides the attention part."""
    params = djax.abstract_params(cfg)
    fn = jax.jit(functools.partial(v4.prefill, cfg=cfg, max_len=tokens, keep=keep, moe_impl=moe_impl))
    toks = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
    lens = jax.ShapeDtypeStruct((1,), jnp.int32)
    cost = fn.lower(params, toks, lens).cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"])


def drift(tokens: int, seed: int = 0) -> dict:
    """Last-position logits of bounded replay vs exact prefill on a narrow V4.1-layout model."""
    cfg = preset("tiny-v41", **LAYOUT).replace(
        hidden_size=256, sliding_window=128, replay_keep_tokens=140, index_topk=64, candidate_topk_blocks=16,
        candidate_block_size=8, q_lora_rank=64, o_lora_rank=32,
    )  # fmt: skip
    params = djax.init_params(cfg, jax.random.key(seed))
    toks = jax.random.randint(jax.random.key(seed + 1), (1, tokens), 0, cfg.vocab_size)
    lens = jnp.array([tokens], jnp.int32)
    run = jax.jit(functools.partial(v4.prefill, cfg=cfg, max_len=tokens), static_argnames="keep")
    exact = np.asarray(run(params, toks, lens, keep=0)[0])[0]
    approx = np.asarray(run(params, toks, lens, keep=cfg.replay_keep_tokens)[0])[0]
    cos = float(exact @ approx / np.linalg.norm(exact) / np.linalg.norm(approx))
    return {
        "prompt_tokens": tokens,
        "keep_tokens": cfg.replay_keep_tokens,
        "max_abs_diff": float(np.abs(exact - approx).max()),
        "max_abs_logit": float(np.abs(exact).max()),
        "rel_max_diff": float(np.abs(exact - approx).max() / np.abs(exact).max()),
        "cosine": cos,
        "same_argmax": bool(exact.argmax() == approx.argmax()),
    }


def time_prefill(cfg, token_counts, impls, repeats: int = 5, progress=None) -> list[dict]:
    """Wall time of one prefill (batch 1) with and without bounded replay, per prompt length and MoE impl.

    progress(rows) is called after each measurement (so a run cut short still leaves its results)."""
    params = djax.init_params(cfg, jax.random.key(0))
    jax.block_until_ready(params)
    rows = []
    for t in token_counts:
        toks = jax.random.randint(jax.random.key(t), (1, t), 0, cfg.vocab_size)
        lens = jnp.array([t], jnp.int32)
        for impl in impls:
            for keep in (0, cfg.replay_keep_tokens):
                row = {"prompt_tokens": t, "moe_impl": impl, "keep": keep}
                try:
                    fn = jax.jit(functools.partial(v4.prefill, cfg=cfg, max_len=t, moe_impl=impl, keep=keep))
                    compiled = fn.lower(params, toks, lens).compile()
                    cost = compiled.cost_analysis()
                    cost = cost[0] if isinstance(cost, list) else cost
                    row["xla_flops"] = float(cost["flops"])
                    jax.block_until_ready(compiled(params, toks, lens))
                    times = []
                    for _ in range(repeats):
                        t0 = time.perf_counter()
                        jax.block_until_ready(compiled(params, toks, lens))
                        times.append(time.perf_counter() - t0)
                    row["seconds"] = times
                    row["median_s"] = float(np.median(times))
                    del compiled
                except Exception as e:  # an OOM or compile failure is a result too
                    row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                print(json.dumps(row), flush=True)
                rows.append(row)
                if progress:
                    progress(rows)
    for r in rows:
        if "median_s" in r and r["keep"]:
            exact = [x for x in rows if x["prompt_tokens"] == r["prompt_tokens"] and x["moe_impl"] == r["moe_impl"]
                     and not x["keep"] and "median_s" in x]  # fmt: skip
            if exact:
                r["time_ratio_vs_exact"] = r["median_s"] / exact[0]["median_s"]
                r["flops_ratio_vs_exact"] = r["xla_flops"] / exact[0]["xla_flops"]
    return rows


def main_time(a):
    cfg = preset("deepseek-v4.1-flash", **TIME_LAYOUT).replace(dtype="bfloat16")
    dev = jax.devices()[0]
    res = {
        "benchmark": "bounded replay prefill time",
        "date": time.strftime("%Y-%m-%d"),
        "device": getattr(dev, "device_kind", str(dev)),
        "jax": jax.__version__,
        "config": "V4.1-Flash per-layer shapes, 3 layers: ratios (2,1,1), KV sources (0,1), index sources "
        "(0,1), candidate source 1; random bf16 weights; batch 1",
        "keep_tokens": cfg.replay_keep_tokens,
    }

    def write(rows):
        with open(a.out, "w") as f:
            json.dump(dict(res, runs=rows), f, indent=1)

    write(time_prefill(cfg, a.time_tokens, a.moe_impls, progress=write))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--drift-tokens", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--out", default="benchmarks/results/bounded_replay_cpu.json")
    ap.add_argument("--time", action="store_true", help="time prefill on the default device (a GPU)")
    ap.add_argument("--time-tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--moe-impls", nargs="+", default=["grouped", "batched"])
    a = ap.parse_args()
    if a.time:
        return main_time(a)
    big = preset("deepseek-v4.1-flash", **LAYOUT)
    t0 = time.time()
    f_exact = flops(big, a.tokens, 0)
    f_replay = flops(big, a.tokens, big.replay_keep_tokens)
    timed = preset("deepseek-v4.1-flash", **TIME_LAYOUT)
    timed_flops = {
        t: {"exact": flops(timed, t, 0), "bounded_replay": flops(timed, t, timed.replay_keep_tokens)}
        for t in a.time_tokens
    }
    for v in timed_flops.values():
        v["ratio"] = v["bounded_replay"] / v["exact"]
    res = {
        "host": platform.processor() or platform.machine(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "flops_config": "V4.1-Flash per-layer shapes, 8 layers: ratios (0,2,2,1,1,1,1,1), sources (1,3), "
        "index sources (1,3,5), candidate source 3",
        "prompt_tokens": a.tokens,
        "keep_tokens": big.replay_keep_tokens,
        "flops_exact": f_exact,
        "flops_bounded_replay": f_replay,
        "flops_ratio": f_replay / f_exact,
        "flops_timed_config": "the --time stack (3 layers: ratios (2,1,1), KV sources (0,1), candidate source 1)",
        "flops_timed_by_prompt_tokens": timed_flops,
        "flops_seconds": time.time() - t0,
        "drift": [drift(n) for n in a.drift_tokens],
        "gpu_time": "benchmarks/results/bounded_replay_h200.json (--time)",
    }
    print(json.dumps(res, indent=1))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
