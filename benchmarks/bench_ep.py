#!/usr/bin/env python3
"""Expert-parallel decode on two GPUs against one GPU: tokens/s, all-to-all time per step, weight bytes per device.

Model: `bench_generate.make_config` (DeepSeek-V4-Flash per-layer shapes, four layers: ratios 0, 0, 4, 128, the
first hash-routed; 256 experts x 2048, top-6), random bf16 weights from `djax.init_params` (about 55 GB).
Decode as in bench_generate: synthetic decoder states at a 1k-token context, greedy feedback, the state
donated, compiled once per shape ahead of time (all programs in parallel) and timed with no compile inside.

Settings, each at the same global batch (so tokens/s compare directly):
  - "1gpu": no mesh, everything on device 0;
  - "ep2": `djax.make_mesh(dp=1, ep=2)`, params by `djax.shard_params` (routed experts split over "ep",
    everything else replicated), the MoE expert-parallel (`djax.ExpertParallel`: all_to_all dispatch and
    combine); decoder state and tokens split over the two GPUs on ("dp", "ep") (the rows `moe_ep` gives
    each device), so attention is data-parallel: DeepSeek's DP-attention + EP layout on two GPUs. A two-device
    mesh cannot hold dp=2 and ep=2 at once; with dp=1 the library's default rules would replicate the batch;
  - "ep2_rep": the same mesh with state and tokens replicated (the engine's layout on a dp=1 mesh): every GPU
    runs attention over the whole batch, only the experts are split.

Per setting and batch: median ms/step and tokens/s, compile seconds, XLA temp bytes and the collectives in
the compiled HLO. For the EP settings a `jax.profiler` trace of a few steps is summed per kernel
(`profile_decode.kernel_table`): all-to-all (dispatch + combine; NCCL runs it as grouped send/recv, so
"SendRecv" kernels count) and other collectives, per device per step, and as a fraction of the measured step.
NCCL kernel time includes waiting for the peer, so it is the time a GPU's stream is held by the collective.
Also weight bytes per device from the arrays' shardings, EP/1-GPU speed-ups, and whether the greedy tokens of
the first steps agree between settings (bf16 may differ in reduction order; --tiny runs float32 and
should match exactly).

Run (2 GPUs):  python3 benchmarks/bench_ep.py --out $OUT          # writes ep_decode_h200x2.json (+ .png)
Debug (CPU):   python benchmarks/bench_ep.py --tiny --out /tmp/bench_ep  # 2 fake CPU devices
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import re
import shutil
import sys
import time
import traceback
from pathlib import Path

# XLA reads the fake device count once, at start-up: set it before anything imports jax. LLVM optimisation
# off halves the CPU compile time; every setting runs under the same flags.
if "--tiny" in sys.argv and not glob.glob("/dev/nvidia[0-9]*"):
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = (
            f"{_flags} --xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0".strip()
        )

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generate as bg  # noqa: E402  (its import sets the allocator environment before any backend starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from profile_decode import kernel_table  # noqa: E402

import djax  # noqa: E402

log = bg.log

FULL = dict(
    batches=[32, 128, 256],
    context=bg.FULL["context"],  # 1024
    max_len=bg.FULL["max_len"],
    check_steps=3,  # warm-up steps whose greedy tokens are compared across settings
    steps=8,
    reps=3,
    profile_steps=3,
)
TINY = dict(
    batches=[4, 8, 16],
    context=bg.TINY["context"],
    max_len=bg.TINY["max_len"],
    check_steps=3,
    steps=4,
    reps=2,
    profile_steps=2,
)
SETTINGS = ("1gpu", "ep2", "ep2_rep")
LABELS = {"1gpu": "one GPU", "ep2": "EP=2, batch split", "ep2_rep": "EP=2, batch replicated"}
# NCCL runs all-to-all as grouped point-to-point transfers (ncclDevKernel_SendRecv); on CPU the trace shows
# the HLO op ("all-to-all.N"). Decode has no collective-permute, the other user of send/recv (the JSON's
# hlo_collectives lists what each compiled program holds).
A2A = re.compile(r"all-?to-?all|alltoall|sendrecv", re.I)
COLLECTIVE = re.compile(r"nccl|all-?gather|all-?reduce|reduce-?scatter|collective-?permute", re.I)
HLO_COLLECTIVE = re.compile(
    r"\b(all-to-all|all-gather|all-reduce|reduce-scatter|collective-permute)(?:-start)?\("
)


# ---- layouts --------------------------------------------------------------------------------------------------
def layout(setting: str, mesh):
    """(moe_impl, sharding of every batch-leading array or None for device 0) of a setting."""
    if setting == "1gpu":
        return "grouped", None
    batch = P(("dp", "ep")) if setting == "ep2" else P()
    return djax.ExpertParallel(mesh, "grouped"), NamedSharding(mesh, batch)


def make_step(cfg: djax.ModelConfig, impl, row):
    """One greedy decode step (tokens int32[b], state) -> (next tokens, state), the state donated.

    `djax.decode` is inlined; on a mesh the outputs are pinned to the inputs' layout (`row` on every
    batch-leading array), so the compiled program takes its own outputs back without resharding.
    """

    def step(params, tok, state):
        logits, state = djax.decode(params, tok, state, cfg, moe_impl=impl)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), state

    return jax.jit(step, donate_argnums=2, out_shardings=None if row is None else row)


def abstract_args(cfg, w: dict, b: int, mesh, row):
    st = jax.eval_shape(lambda: djax.init_state(cfg, b, w["max_len"]))
    if row is None:
        return djax.abstract_params(cfg), bg.sds((b,)), st
    aparams = djax.abstract_params(cfg, djax.param_shardings(cfg, mesh))
    st = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=row), st)
    return aparams, jax.ShapeDtypeStruct((b,), jnp.int32, sharding=row), st


def bytes_per_device(tree) -> dict[str, int]:
    """Bytes each device holds of `tree`, from the arrays' shardings (metadata only)."""
    out: dict[str, int] = {}
    for x in jax.tree.leaves(tree):
        shard = int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
        for d in x.sharding.device_set:
            out[str(d)] = out.get(str(d), 0) + shard
    return dict(sorted(out.items()))


def memory_in_use() -> dict[str, int]:
    out = {}
    for d in jax.devices():
        stats = d.memory_stats() or {}
        if "bytes_in_use" in stats:
            out[str(d)] = int(stats["bytes_in_use"])
    return out


# ---- measurements -------------------------------------------------------------------------------------------
def measure(step, params, cfg, w: dict, b: int, row) -> tuple[dict, np.ndarray, tuple]:
    """Median step time at batch b from a synthetic state; returns (result, first steps' tokens, (tok, state))."""
    # The same seed in every setting: the same state and tokens, so the greedy tokens can be compared.
    state = bg.synthetic_state(cfg, b, w["max_len"], w["context"], b)
    tok = jnp.asarray(np.random.default_rng(b).integers(2, cfg.vocab_size, (b,)), jnp.int32)
    if row is not None:
        state, tok = jax.device_put((state, tok), row)
    seq = []
    for _ in range(w["check_steps"]):
        tok, state = step(params, tok, state)
        seq.append(np.asarray(tok))
    ts = []
    for _ in range(w["reps"]):
        s = time.perf_counter()
        for _ in range(w["steps"]):
            tok, state = step(params, tok, state)
        tok.block_until_ready()
        ts.append((time.perf_counter() - s) / w["steps"])
    med = bg.median(ts)
    res = {
        "context": w["context"],
        "max_len": w["max_len"],
        "steps_per_rep": w["steps"],
        "step_seconds": ts,
        "median_step_ms": med * 1e3,
        "tokens_per_s": b / med,
    }
    return res, np.stack(seq, 1), (tok, state)


def profile(step, params, carry, steps: int, n_dev: int, trace_dir: Path) -> dict:
    """Per-device per-step device time of the all-to-alls (dispatch + combine) and of other collectives."""
    tok, state = carry
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(steps):
            tok, state = step(params, tok, state)
        tok.block_until_ready()
    rows, _ = kernel_table(trace_dir)
    per = steps * n_dev
    # CPU traces mark each op's end with an "end: <op>" event: not time spent in it.
    coll = [
        r
        for r in rows
        if (A2A.search(r["name"]) or COLLECTIVE.search(r["name"])) and "end: " not in r["name"]
    ]
    # If both NCCL kernels and HLO op names show up (an "XLA Ops" line over the kernels), count the kernels only.
    coll = [r for r in coll if re.search(r"nccl|sendrecv", r["name"], re.I)] or coll
    a2a = [r for r in coll if A2A.search(r["name"])]
    other = [r for r in coll if not A2A.search(r["name"])]
    out = {
        "steps_traced": steps,
        "dispatch_combine_ms_per_step": sum(r["us"] for r in a2a) / per / 1e3 if a2a else None,
        "other_collectives_ms_per_step": sum(r["us"] for r in other) / per / 1e3,
        "a2a_events": [dict(r, us=r["us"] / per, calls=r["calls"] / per) for r in a2a],
        "other_collective_events": [dict(r, us=r["us"] / per, calls=r["calls"] / per) for r in other[:10]],
    }
    if jax.default_backend() == "gpu":  # on CPU the table is host events, not device busy time
        out["device_busy_ms_per_step"] = sum(r["us"] for r in rows) / per / 1e3
        if out["dispatch_combine_ms_per_step"] is not None and out["device_busy_ms_per_step"]:
            out["dispatch_combine_fraction_of_busy"] = (
                out["dispatch_combine_ms_per_step"] / out["device_busy_ms_per_step"]
            )
        out["top_kernels"] = [dict(r, us=r["us"] / per, calls=r["calls"] / per) for r in rows[:15]]
    if not a2a:
        out["note"] = "no all-to-all / SendRecv events in the trace: " + ", ".join(
            r["name"] for r in rows[:8]
        )
    return out


def hlo_collectives(compiled) -> dict[str, int]:
    """Collective ops in a compiled program's HLO (async starts counted under the op's name)."""
    try:
        found = HLO_COLLECTIVE.findall(compiled.as_text())
    except Exception as e:  # noqa: BLE001
        return {"error": repr(e)}
    return {name: found.count(name) for name in sorted(set(found))}


# ---- report -------------------------------------------------------------------------------------------------
def derive(result: dict) -> None:
    """Speed-ups over one GPU and the dispatch + combine share of each EP step, from what is measured so far."""
    one = result["settings"].get("1gpu", {}).get("batches", {})
    for name, s in result["settings"].items():
        for b, r in s.get("batches", {}).items():
            base = one.get(b, {}).get("tokens_per_s")
            if name != "1gpu" and base and "tokens_per_s" in r:
                r["speedup_over_1gpu"] = r["tokens_per_s"] / base
            a2a = (r.get("profile") or {}).get("dispatch_combine_ms_per_step")
            if a2a is not None and "median_step_ms" in r:
                r["dispatch_combine_fraction_of_step"] = a2a / r["median_step_ms"]
    # The headline numbers in one place; the per-setting entries hold the details.
    keys = ("tokens_per_s", "median_step_ms", "speedup_over_1gpu", "dispatch_combine_fraction_of_step")
    result["summary"] = {
        name: {
            b: {"error": r["error"][:200]}
            if "error" in r
            else {k: r.get(k) for k in keys}
            | {"dispatch_combine_ms_per_step": (r.get("profile") or {}).get("dispatch_combine_ms_per_step")}
            for b, r in s.get("batches", {}).items()
        }
        for name, s in result["settings"].items()
    }


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - no plot without matplotlib
        return
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    batches: set[int] = set()
    for name, s in result["settings"].items():
        pts = sorted(
            (int(b), r["tokens_per_s"]) for b, r in s.get("batches", {}).items() if "tokens_per_s" in r
        )
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"{name} ({LABELS[name]})")
            batches.update(p[0] for p in pts)
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    ax.set_xticks(sorted(batches), [str(b) for b in sorted(batches)])
    ax.set_xlabel("global batch")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{result['device']} x{result['device_count']}: {result['model']['summary']}", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"wrote {path}")


def table(result: dict) -> str:
    lines = [f"{'setting':<9}{'batch':>6}{'ms/step':>10}{'tok/s':>11}{'x 1gpu':>8}{'a2a ms':>8}{'a2a %':>7}"]
    for name, s in result["settings"].items():
        for b, r in s.get("batches", {}).items():
            if "error" in r:
                lines.append(f"{name:<9}{b:>6}  ERROR {r['error'][:80]}")
                continue
            a2a = (r.get("profile") or {}).get("dispatch_combine_ms_per_step")
            frac = r.get("dispatch_combine_fraction_of_step")
            sp = r.get("speedup_over_1gpu")
            lines.append(
                f"{name:<9}{b:>6}{r['median_step_ms']:>10.2f}{r['tokens_per_s']:>11,.0f}"
                f"{'-' if sp is None else format(sp, '.2f'):>8}{'-' if a2a is None else format(a2a, '.2f'):>8}"
                f"{'-' if frac is None else format(100 * frac, '.1f'):>7}"
            )
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny float32 config, small batches (CPU debugging)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results", help="output folder")
    ap.add_argument(
        "--name", default=None, help="result file stem suffix (default: h200x2, or tiny_<backend>)"
    )
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma list of {', '.join(SETTINGS)}")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="global batch sizes")
    ap.add_argument("--keep-traces", action="store_true", help="keep the profiler traces under --out")
    args = ap.parse_args()
    w = dict(TINY if args.tiny else FULL)
    if args.batches:
        w["batches"] = args.batches
    wanted = {s for s in args.settings.split(",") if s}
    if wanted - set(SETTINGS):
        ap.error(f"unknown settings {sorted(wanted - set(SETTINGS))}; choose from {SETTINGS}")
    settings = [s for s in SETTINGS if s in wanted]  # one GPU first: its weights are freed after it
    cfg = bg.make_config(args.tiny)
    if args.tiny:
        cfg = cfg.replace(dtype="float32")  # so that EP and one device give the same greedy tokens
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or ("tiny_" + jax.default_backend() if args.tiny else "h200x2")
    path = out_dir / f"ep_decode_{name}.json"
    devs = jax.devices()
    log(f"jax {jax.__version__} on {len(devs)} x {devs[0].device_kind} ({jax.default_backend()})")

    mesh = None
    if len(devs) >= 2:
        mesh = djax.make_mesh(dp=1, ep=2)
    result: dict = {
        "benchmark": "bench_ep",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": devs[0].device_kind,
        "device_count": len(devs),
        "backend": jax.default_backend(),
        "host": platform.node(),
        "versions": {"python": platform.python_version(), "jax": jax.__version__, "numpy": np.__version__},
        "model": {
            "summary": f"V4-Flash shapes, {cfg.num_hidden_layers} layers ratios {cfg.compress_ratios}, "
            f"{cfg.num_hash_layers} hash layer, {cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}, "
            f"{cfg.dtype} random weights",
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()},
        },
        "mesh": None
        if mesh is None
        else {"axes": dict(mesh.shape), "devices": [str(d) for d in mesh.devices.flat]},
        "workload": w,
        "settings": {},
        "errors": [],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    desc = {
        "1gpu": "no mesh, device 0",
        "ep2": "mesh dp=1 x ep=2; experts on ep; state and tokens split on (dp, ep): attention data-parallel",
        "ep2_rep": "mesh dp=1 x ep=2; experts on ep; state and tokens replicated: attention on every GPU",
    }
    for s in settings:
        result["settings"][s] = {"description": desc[s], "batches": {}}
        if s != "1gpu":
            result["settings"][s]["moe_impl"] = "ExpertParallel(mesh, 'grouped')"
            result["settings"][s]["batch_spec"] = str(layout(s, mesh)[1].spec) if mesh is not None else None

    def save() -> None:
        derive(result)
        result["total_seconds"] = round(time.perf_counter() - bg.T0, 1)
        path.write_text(json.dumps(result, indent=1, default=float) + "\n")

    def record(where: str, e: Exception) -> str:
        msg = f"{type(e).__name__}: {e}"[:2000]
        result["errors"].append({"where": where, "error": msg, "trace": traceback.format_exc()[-3000:]})
        log(f"ERROR in {where}: {msg[:300]}")
        return msg

    # Compile every (setting, batch) program in the background while the weights are drawn.
    comp = bg.Compiler(workers=len(settings) * len(w["batches"]))
    steps = {}
    for s in settings:
        if s != "1gpu" and mesh is None:
            for b in w["batches"]:
                result["settings"][s]["batches"][str(b)] = {"error": f"needs 2 devices, found {len(devs)}"}
            continue
        impl, row = layout(s, mesh)
        steps[s] = make_step(cfg, impl, row)
        for b in w["batches"]:
            comp.submit(f"{s}_{b}", steps[s], *abstract_args(cfg, w, b, mesh, row))

    t = time.perf_counter()
    params = djax.init_params(cfg, jax.random.key(0))
    jax.block_until_ready(params)
    result["model"]["param_bytes"] = bg.nbytes(params)
    result["model"]["init_seconds"] = round(time.perf_counter() - t, 1)
    log(f"params: {bg.nbytes(params) / 1e9:.2f} GB in {time.perf_counter() - t:.1f} s")
    comp.wait_all()
    for key, info in comp.info.items():
        s, b = key.rsplit("_", 1)
        entry = result["settings"][s].setdefault("compiled", {})[b] = dict(info)
        if "error" not in info:
            entry["hlo_collectives"] = hlo_collectives(comp.get(key))
    log("compile seconds: " + ", ".join(f"{k} {v.get('compile_s', 'failed')}" for k, v in comp.info.items()))
    save()

    tokens: dict[str, dict[str, np.ndarray]] = {}
    ep_params = None
    for s in settings:
        if s not in steps:
            continue
        _, row = layout(s, mesh)
        res = result["settings"][s]
        if row is None:
            placed = params
        else:
            if ep_params is None:
                t = time.perf_counter()
                try:
                    ep_params = djax.shard_params(params, cfg, mesh)
                    jax.block_until_ready(ep_params)
                except Exception as e:  # noqa: BLE001 - record and go on
                    msg = record("shard_params", e)
                    for b in w["batches"]:
                        res["batches"][str(b)] = {"error": msg}
                    continue
                log(f"shard_params: {time.perf_counter() - t:.1f} s")
                params = None  # one GPU is done: free its copy on device 0
            placed = ep_params
        res["weight_bytes_per_device"] = bytes_per_device(placed)
        res["memory_in_use_bytes"] = memory_in_use()
        log(
            f"{s}: weight GB per device {[round(v / 1e9, 2) for v in res['weight_bytes_per_device'].values()]}"
        )
        for b in w["batches"]:
            key = f"{s}_{b}"
            try:
                if "error" in comp.info.get(key, {}):
                    raise RuntimeError(f"compile failed: {comp.info[key]['error']}")
                compiled = comp.get(key)
                bg.fits(comp, key)
                r, seq, carry = measure(compiled, placed, cfg, w, b, row)
                tokens.setdefault(s, {})[str(b)] = seq
                log(f"{s} b={b}: {r['median_step_ms']:.2f} ms/step, {r['tokens_per_s']:,.1f} tok/s")
                if s != "1gpu":
                    tdir = out_dir / f"trace_{name}_{key}"
                    shutil.rmtree(tdir, ignore_errors=True)
                    try:
                        r["profile"] = profile(compiled, placed, carry, w["profile_steps"], 2, tdir)
                        p = r["profile"]
                        a2a = p["dispatch_combine_ms_per_step"]
                        log(
                            f"{s} b={b}: dispatch+combine {'-' if a2a is None else format(a2a, '.3f')} ms/step, "
                            f"other collectives {p['other_collectives_ms_per_step']:.3f} ms/step per device"
                        )
                    except Exception as e:  # noqa: BLE001
                        r["profile"] = {"error": record(f"profile {key}", e)}
                    if not args.keep_traces:
                        shutil.rmtree(tdir, ignore_errors=True)
                del carry
                res["batches"][str(b)] = r
            except Exception as e:  # noqa: BLE001 - an OOM or a failure is recorded, the run goes on
                res["batches"][str(b)] = {"error": record(key, e)}
            save()

    # Greedy tokens of the first steps: the same state, tokens and weights in every setting.
    base = tokens.get("1gpu", {})
    for s, per in tokens.items():
        if s == "1gpu":
            continue
        agree = {b: float((seq == base[b]).mean()) for b, seq in per.items() if b in base}
        result["settings"][s]["tokens_agree_with_1gpu"] = agree
        result["settings"][s]["tokens_match"] = bool(agree) and all(a == 1.0 for a in agree.values())
        log(f"{s}: greedy tokens agree with 1gpu over {w['check_steps']} steps: {agree}")
    result["tokens_match"] = {s: result["settings"][s]["tokens_match"] for s in tokens if s != "1gpu"}
    result["tokens_compared"] = (
        f"greedy tokens of the first {w['check_steps']} steps from the same state, {cfg.dtype}"
    )
    save()
    log(f"wrote {path}")
    try:
        plot(result, out_dir / f"ep_decode_{name}.png")
    except Exception as e:  # noqa: BLE001
        record("plot", e)
        save()
    print(table(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
