#!/usr/bin/env python3
"""Generated tokens/s of a shipped tiny model (djax-tiny or djax-tiny-v4) on the CPU, batch 1, float32 (the demo's setting).

Two ways to generate, both greedy from a 13-token prompt with EOS ignored so every run makes the same
number of tokens, each compiled first (nothing compiles while timed) and timed `--repeats` times
(median reported):
  - `djax.generate`: one jitted program, prefill then a `lax.while_loop` of decode steps; new tokens
    over the whole call (prefill included);
  - the CLI's loop: `djax.prefill`, then `djax.decode` once per token from Python (state donated),
    the way `djax generate` streams tokens; decode tokens/s after the first token.
The machine is recorded (CPU model, cores, load average before and after): on a shared machine the
load average says how many other processes competed for the cores.

Run: python benchmarks/bench_cpu_tiny.py --model djax-tiny-v4 --out benchmarks/results/cpu_tiny_v4.json
     python benchmarks/bench_cpu_tiny.py --model djax-tiny --out benchmarks/results/cpu_tiny_v41.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import djax
from djax.sampling import sample

ASSETS = Path(djax.__file__).resolve().parent / "assets"
MODELS = ("djax-tiny", "djax-tiny-v4")  # DeepSeek-V4.1 and V4 at toy size
PROMPT = "class Stack:\n    def __init__(self):\n"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def time_generate(params, config, prompt: list[int], new: int, repeats: int) -> dict:
    batch = djax.Batch.from_lists([prompt])
    sampling = djax.SamplingParams(ignore_eos=True)

    def run():
        out = djax.generate(params, batch, config, sampling, max_new_tokens=new)
        return jax.block_until_ready(out.tokens)

    t = time.perf_counter()
    run()
    compile_s = time.perf_counter() - t
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    return {
        "new_tokens": new,
        "first_call_s": round(compile_s, 2),
        "seconds": [round(x, 4) for x in times],
        "tokens_per_s": round(new / med, 1),
    }


def time_cli_loop(params, config, prompt: list[int], new: int, repeats: int) -> dict:
    batch = djax.Batch.from_lists([prompt])
    sampling = djax.SamplingParams()
    max_len = batch.tokens.shape[1] + new

    def run():
        logits, state = djax.prefill(params, batch.tokens, batch.lengths, config, max_len)
        tok = sample(logits, batch.seeds, jnp.int32(0), sampling)
        tok.block_until_ready()
        t_first = time.perf_counter()
        for step in range(1, new):
            logits, state = djax.decode(params, tok, state, config)
            tok = sample(logits, batch.seeds, jnp.int32(step), sampling)
            int(tok[0])  # the CLI reads every token back to print it
        return (new - 1) / (time.perf_counter() - t_first)

    run()  # compile prefill, decode and sampling
    rates = [run() for _ in range(repeats)]
    return {
        "new_tokens": new,
        "decode_tokens_per_s": [round(r, 1) for r in rates],
        "median": round(statistics.median(rates), 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=MODELS, default="djax-tiny", help="which shipped model")
    ap.add_argument("--checkpoint", help="another HF-format directory instead of a shipped model")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", help="write the JSON result here")
    args = ap.parse_args(argv)
    from tokenizers import Tokenizer

    path = Path(args.checkpoint) if args.checkpoint else ASSETS / args.model
    load_before = os.getloadavg()
    config, params = djax.load_checkpoint(path, progress=False)
    prompt = Tokenizer.from_file(str(path / "tokenizer.json")).encode(PROMPT).ids
    result = {
        "model": path.name,
        "model_type": config.model_type,
        "dtype": config.dtype,
        "batch": 1,
        "prompt_tokens": len(prompt),
        "generate": time_generate(params, config, prompt, args.new_tokens, args.repeats),
        "cli_loop": time_cli_loop(params, config, prompt, args.new_tokens, args.repeats),
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(),
            "jax": jax.__version__,
            "backend": jax.default_backend(),
        },
        "date": datetime.date.today().isoformat(),
    }
    print(f"{path.name + ', CPU, batch 1':<40}{'tokens/s':>10}")
    print(f"{'djax.generate (prefill + while_loop)':<40}{result['generate']['tokens_per_s']:>10}")
    print(f"{'CLI loop (djax.decode per token)':<40}{result['cli_loop']['median']:>10}")
    print(
        f"load average before/after: {result['machine']['load_average_before']} / {result['machine']['load_average_after']}"
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
