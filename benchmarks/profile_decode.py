#!/usr/bin/env python3
"""Where a decode step's time goes: the GPU kernels of `djax.decode`, summed by name from a profiler trace.

The bench_generate model (V4-Flash per-layer shapes, 4 layers, random bf16 weights) decodes from a synthetic
1k-token state; `jax.profiler` records a few steps and the Perfetto trace it writes is summed per kernel
name (the device-side events), printed as a table and written as JSON.

    python benchmarks/profile_decode.py --batch 1 64 --out $OUT          # on a GPU
    python benchmarks/profile_decode.py --batch 1 --also-fp8 --out $OUT  # then FP8 projections and experts
    python benchmarks/profile_decode.py --batch 1 --also-fp8 --hlo --out $OUT  # and the top fusions' HLO
    python benchmarks/profile_decode.py --batch 1 --also-fp8 --scale-fmt ue8m0 --out $OUT  # V4's scales
    python benchmarks/profile_decode.py --tiny --batch 2 --out /tmp/prof # CPU smoke run (host events)
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generate as bg  # noqa: E402

import djax  # noqa: E402


def fresh_trace_dir(path: Path) -> Path:
    """`path`, with any earlier trace there deleted: readers take the first trace file they find under it, so a
    trace left by an earlier run into the same folder would be read in place of this one."""
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        raise RuntimeError(f"{path}: an earlier trace there could not be deleted")
    return path


def step_tokens(cfg, b: int) -> jax.Array:
    """The tokens every decode step is fed: one random id per row, the same each step (so that a step's input
    buffer can stay in place). One id for all rows would send every row to the same experts in the
    hash-routed layers, which route by token id: a lighter step than a batch of different tokens."""
    return jax.random.randint(jax.random.key(b), (b,), 2, cfg.vocab_size, jnp.int32)


def stream_kernels(trace_dir: Path) -> list[dict]:
    """The trace's complete events on the device's stream threads (all its events if it has no device track).

    On a GPU only the stream threads count: the trace's "XLA Ops" and "XLA Modules" threads span the same
    kernels again, so summing every device thread would count each kernel two or three times.
    """
    path = next(trace_dir.rglob("*.trace.json.gz"))
    events = json.load(gzip.open(path))["traceEvents"]
    procs = {
        e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    dev_pids = {p for p, n in procs.items() if "/device:" in n.lower() or "gpu" in n.lower()}
    streams = {
        (e["pid"], e["tid"])
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "thread_name"
        and e["pid"] in dev_pids
        and e["args"]["name"].lower().startswith("stream")
    }
    return [
        e
        for e in events
        if e.get("ph") == "X"
        and (not dev_pids or e["pid"] in dev_pids)
        and (not streams or (e["pid"], e.get("tid")) in streams)
    ]


def kernel_table(trace_dir: Path) -> tuple[list[dict], float]:
    """The stream kernels' time summed per name, largest first, and the total."""
    tot, cnt = defaultdict(float), defaultdict(int)
    for e in stream_kernels(trace_dir):
        tot[e["name"]] += e.get("dur", 0.0)
        cnt[e["name"]] += 1
    rows = sorted(({"name": n, "us": t, "calls": cnt[n]} for n, t in tot.items()), key=lambda r: -r["us"])
    return rows, sum(tot.values())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--moe-impl", default="grouped")
    ap.add_argument(
        "--also-fp8",
        action="store_true",
        help="then quantize the same weights in place (djax.quantize_projections: projections and routed "
        "experts FP8, 128x128 scales) and profile the same batches again, keyed fp8 in the JSON",
    )
    ap.add_argument(
        "--scale-fmt",
        choices=["ue8m0"],
        help="with --also-fp8: the FP8 block scales as V4's checkpoints hold them (powers of two, UE8M0); "
        "default plain float32 scales",
    )
    ap.add_argument(
        "--hlo",
        action="store_true",
        help="also write each step's optimized HLO, and give the top kernels that are XLA fusions their HLO",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/profile"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = bg.make_config(a.tiny)
    params = djax.init_params(cfg, jax.random.key(0))
    w = bg.TINY if a.tiny else bg.FULL
    res = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind, "runs": {}}
    profile(params, cfg, w, a, out, res["runs"], "")
    if a.also_fp8:
        params = djax.quantize_projections(params, cfg, scale_fmt=a.scale_fmt, delete_originals=True)
        res["fp8"], res["fp8_scale_fmt"] = {}, a.scale_fmt or "float32"
        profile(params, cfg, w, a, out, res["fp8"], "fp8 ")
    (out / "profile_decode.json").write_text(json.dumps(res, indent=1))


def fusion_text(hlo: str, name: str, limit: int = 3000) -> str | None:
    """The HLO of the fusion a kernel is named after: its instruction line in the module, then the fused
    computation it calls (cut at `limit` characters), or None where no instruction has that name."""
    lines = hlo.splitlines()
    # the trace names a kernel after its instruction with the number's "." as "_" (fusion.7: fusion_7)
    head, _, num = name.rpartition("_")
    names = {name, f"{head}.{num}"} if num.isdigit() else {name}
    insts = (ln.strip().removeprefix("ROOT ") for ln in lines)
    inst = next((i for i in insts if i.split(" = ")[0][1:] in names), None)
    if inst is None:
        return None
    called = inst.split("calls=%")[1].split(",")[0].split(" ")[0] if "calls=%" in inst else None
    body = []
    if called:
        start = next((i for i, ln in enumerate(lines) if ln.startswith(f"%{called} ")), None)
        if start is not None:
            for ln in lines[start:]:
                body.append(ln)
                if ln.startswith("}"):
                    break
    return "\n".join([inst, *body])[:limit]


def profile(params, cfg, w, a, out: Path, runs: dict, label: str):
    """Per batch size: a few traced decode steps, their kernels summed by name into runs[b]."""
    for b in a.batch:
        state = bg.synthetic_state(cfg, b, w["max_len"], w["context"], b)
        toks = step_tokens(cfg, b)
        for _ in range(2):  # compile and warm up
            logits, state = djax.decode(params, toks, state, cfg, moe_impl=a.moe_impl)
        jax.block_until_ready(logits)
        tdir = fresh_trace_dir(out / f"trace_{label.strip()}b{b}")
        t0 = time.perf_counter()
        with jax.profiler.trace(str(tdir), create_perfetto_trace=True):
            for _ in range(a.steps):
                logits, state = djax.decode(params, toks, state, cfg, moe_impl=a.moe_impl)
            jax.block_until_ready(logits)
        wall = (time.perf_counter() - t0) / a.steps
        rows, total = kernel_table(tdir)
        runs[b] = {
            "step_wall_ms": wall * 1e3,
            "device_us_per_step": total / a.steps,
            "top": [dict(r, us=r["us"] / a.steps, calls=r["calls"] / a.steps) for r in rows[:40]],
        }
        if a.hlo:
            text = djax.decode.lower(params, toks, state, cfg, moe_impl=a.moe_impl).compile().as_text()
            (out / f"hlo_{label.strip()}b{b}.txt").write_text(text)
            for r in runs[b]["top"][:25]:
                if hlo := fusion_text(text, r["name"]):
                    r["hlo"] = hlo
        print(
            f"{label}batch {b}: {wall * 1e3:.2f} ms/step wall, {total / a.steps / 1e3:.2f} ms/step in traced events"
        )
        for r in rows[:25]:
            print(f"  {r['us'] / a.steps:10.1f} us  x{r['calls'] / a.steps:5.1f}  {r['name'][:110]}")
        for f in tdir.rglob("*.xplane.pb"):
            f.unlink()  # large; the JSON table is what we keep


if __name__ == "__main__":
    main()
