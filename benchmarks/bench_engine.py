#!/usr/bin/env python3
"""Offline engine throughput: djax.LLM (continuous batching) against HF transformers `generate` (static batches).

Model: DeepSeek-V4-Flash per-layer shapes with few layers (`bench_generate.make_config`: ratios 0, 0, 4, 128),
random bf16 weights from `djax.init_params`; HF gets the same weights (`bench_generate.build_hf`).
Workload: 1,000 requests, input lengths uniform in [128, 1024], output lengths uniform in [32, 256]
(ignore_eos, greedy), the same prompts for both.

Reported (JSON under --out, PNG if matplotlib is there):
  - djax: wall time, total (prompt + output) and output tokens/s, steps, preemptions; with async scheduling
    on and off;
  - device idle fraction = 1 - device busy / wall, device busy = sum over the run's steps of the device
    time of a step of that width, measured afterwards by timing back-to-back steps with no host work in
    between (idle rows, so the step's cost is the padded shape's, which is what the engine pays);
  - HF: static batches of --hf-batch prompts (left-padded), max_new_tokens = the batch's longest output,
    useful tokens counted as requested; on --hf-requests of the prompts (throughput is per token).

Run (GPU):   python benchmarks/bench_engine.py --out $OUT
Debug (CPU): python benchmarks/bench_engine.py --tiny --out /tmp/bench
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import numpy as np  # noqa: E402

import djax  # noqa: E402
from djax.engine import LLM, EngineConfig, RequestParams  # noqa: E402
from djax.scheduler import Plan  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from bench_generate import build_hf, make_config  # noqa: E402

FULL = dict(
    requests=1000,
    inp=(128, 1024),
    out=(32, 256),
    seqs=128,
    budget=8192,
    max_len=1280,
    hf_batch=32,
    hf_requests=128,
)
TINY = dict(
    requests=48, inp=(8, 96), out=(4, 24), seqs=8, budget=128, max_len=128, hf_batch=8, hf_requests=16
)
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def workload(w: dict, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    n = w["requests"]
    lens = rng.integers(w["inp"][0], w["inp"][1] + 1, n)
    outs = rng.integers(w["out"][0], w["out"][1] + 1, n)
    prompts = [rng.integers(2, vocab, int(k)).tolist() for k in lens]
    return prompts, [int(o) for o in outs]


def step_device_times(llm: LLM, reps: int = 5) -> dict[int, float]:
    """Seconds per step of each width, back to back with no host work between them (all rows idle)."""
    eng = llm.engine
    S, P = eng.ec.max_num_seqs, -(-eng.ec.max_model_len // eng.ec.block_size)
    out = {}
    for c in eng.ec.widths:
        plan = Plan.idle(S, c, P)
        jax.block_until_ready(eng.launch(plan, 0)[0])
        t = time.perf_counter()
        for _ in range(reps):
            res = eng.launch(plan, 0)
        jax.block_until_ready(res[0])
        out[c] = (time.perf_counter() - t) / reps
    return out


def run_djax(cfg, params, prompts, outs, w, async_on: bool) -> tuple[LLM, dict]:
    ec = EngineConfig(
        max_num_seqs=w["seqs"],
        max_model_len=w["max_len"],
        max_num_batched_tokens=w["budget"],
        async_scheduling=async_on,
        enable_prefix_caching=True,
    )
    llm = LLM((cfg, params), ec)
    t = time.perf_counter()
    llm.engine.warmup()
    log(f"djax warmup (compile {len(llm.engine.ec.widths)} widths): {time.perf_counter() - t:.1f}s")
    sp = [RequestParams(max_tokens=o, ignore_eos=True) for o in outs]
    t = time.perf_counter()
    res = llm.generate(prompts, sp, use_tqdm=True)
    wall = time.perf_counter() - t
    n_out = sum(len(r.outputs[0].token_ids) for r in res)
    n_in = sum(len(p) for p in prompts)
    eng = llm.engine
    return llm, {
        "async_scheduling": async_on,
        "wall_s": wall,
        "output_tokens": n_out,
        "prompt_tokens": n_in,
        "output_tokens_per_s": n_out / wall,
        "total_tokens_per_s": (n_in + n_out) / wall,
        "steps": eng.num_steps,
        "widths": dict(Counter(eng.step_widths)),
        "preemptions": eng.sched.num_preemptions,
        "host_dispatch_s": eng.step_time["dispatch"],
        "host_readback_wait_s": eng.step_time["readback"],
        "engine_config": {
            k: getattr(eng.ec, k)
            for k in (
                "max_num_seqs",
                "max_model_len",
                "block_size",
                "num_pages",
                "max_num_batched_tokens",
                "widths",
            )
        },
    }


def run_hf(cfg, params, prompts, outs, w) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, info = build_hf(cfg, params, device)
    n = min(w["hf_requests"], len(prompts))
    b = w["hf_batch"]
    useful = total_in = 0
    t = time.perf_counter()
    for i in range(0, n, b):
        batch, want = prompts[i : i + b], outs[i : i + b]
        width = max(len(p) for p in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(batch):  # left padding, as decoder-only generate expects
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        with torch.no_grad():
            model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max(want),
                min_new_tokens=max(want),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        useful += sum(want)
        total_in += sum(len(p) for p in batch)
        log(f"HF batch {i // b + 1}/{-(-n // b)}")
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    return {
        "requests": n,
        "batch": b,
        "wall_s": wall,
        "output_tokens_per_s": useful / wall,
        "total_tokens_per_s": (useful + total_in) / wall,
        **info,
    }


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names, tot, outp = [], [], []
    for key, label in (("djax_async", "djax async"), ("djax_sync", "djax sync"), ("hf", "HF generate")):
        if key in result and "output_tokens_per_s" in result[key]:
            names.append(label)
            tot.append(result[key]["total_tokens_per_s"])
            outp.append(result[key]["output_tokens_per_s"])
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    x = np.arange(len(names))
    ax[0].bar(x - 0.2, tot, 0.4, label="total tok/s")
    ax[0].bar(x + 0.2, outp, 0.4, label="output tok/s")
    ax[0].set_xticks(x, names)
    ax[0].set_yscale("log")
    ax[0].legend()
    ax[0].set_title("offline throughput")
    idle = [result.get(k, {}).get("device_idle_fraction", np.nan) for k in ("djax_async", "djax_sync")]
    ax[1].bar(["async on", "async off"], idle)
    ax[1].set_ylim(0, 1)
    ax[1].set_title("device idle fraction")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny config and sizes (CPU debugging)")
    ap.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    ap.add_argument("--name", default=None)
    ap.add_argument("--budget", type=int, help="tokens per engine step (default: the workload's)")
    ap.add_argument("--hf-requests", type=int, help="requests HF runs (default: the workload's)")
    args = ap.parse_args()
    w = dict(TINY if args.tiny else FULL)
    w["budget"] = args.budget or w["budget"]
    w["hf_requests"] = args.hf_requests or w["hf_requests"]
    cfg = make_config(args.tiny)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or ("tiny_" + jax.default_backend() if args.tiny else "h200")
    log(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    params = djax.init_params(cfg, jax.random.key(0))
    prompts, outs = workload(w, cfg.vocab_size)
    result = {
        "benchmark": "offline engine throughput",
        "date": time.strftime("%Y-%m-%d"),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "config": {
            k: getattr(cfg, k)
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "compress_ratios",
                "vocab_size",
                "n_routed_experts",
                "dtype",
            )
        },
        "workload": {**w, "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(outs)},
    }
    path = out_dir / f"engine_{name}.json"
    # Async first, then HF, then sync: a run cut short still has the headline comparison.
    for key in ("djax_async", "hf", "djax_sync"):
        if key == "hf":
            if args.no_hf:
                continue
            try:
                result["hf"] = run_hf(cfg, params, prompts, outs, w)
                log(f"HF: {result['hf']['output_tokens_per_s']:,.0f} out tok/s")
            except Exception as e:  # recorded, not fatal: the djax numbers stand alone
                result["hf"] = {"error": f"{type(e).__name__}: {e}"}
                log(f"HF failed: {e}")
            path.write_text(json.dumps(result, indent=1, default=str))
            continue
        llm, r = run_djax(cfg, params, prompts, outs, w, key == "djax_async")
        times = step_device_times(llm)
        busy = sum(times[c] for c in llm.engine.step_widths)
        r["step_device_s"] = {str(c): t for c, t in times.items()}
        r["device_busy_s"] = busy
        r["device_idle_fraction"] = max(0.0, 1 - busy / r["wall_s"])
        result[key] = r
        log(
            f"{key}: {r['output_tokens_per_s']:,.0f} out tok/s, {r['total_tokens_per_s']:,.0f} total tok/s, idle {r['device_idle_fraction']:.2f}"
        )
        del llm
        path.write_text(json.dumps(result, indent=1, default=str))
    if plot(result, out_dir / f"engine_{name}.png"):
        log(f"wrote {path} and the PNG")
    else:
        log(f"wrote {path} (no matplotlib: no PNG)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
