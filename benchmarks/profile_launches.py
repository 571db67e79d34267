#!/usr/bin/env python3
"""How a decode step reaches the GPU: the time the host takes to issue it, the GPU's idle gaps between kernels,
and what XLA's command buffers (CUDA graphs) do to both, for djax's custom calls and XLA's own kernels.

Workloads, each compiled once per XLA option set (`VARIANTS`, passed as compiler options):
- `chain`: a chain of projections at one row (decode's shape), x <- rms(x @ W_i^T): with FP8 weights through
  `layers.linear` (activation quantization, then the `fp8_gemm` custom call) and with bf16 weights (XLA's
  dot), so the cost of one custom call on the host and on the GPU shows alone; each also with its input
  donated to its output (its buffers the same every call);
- the bench_generate model (V4-Flash per-layer shapes, 4 layers, random bf16 weights) at a synthetic 1k
  context, then (with --fp8) the same weights quantized in place (djax.quantize_projections); with
  --keep-logits also the step with the last step's logits donated, so that no buffer moves between steps;
- with --generate N1 N2, `djax.generate`'s decode loop (a `lax.while_loop`) for each model: a decode step's
  time and GPU busy time from calls of N1 and N2 new tokens (`generate_loop`).
Per workload and option set: step time (median over reps of `steps` back-to-back calls, as bench_generate
times decode) and the time the host takes to issue a call (the calls returned before the first result is
waited for). For the default options also (for generate's loop, every option set), from a profiler trace:
the GPU's busy time per call (stream kernels, overlaps merged), its idle time within the span and the largest
gaps with the kernels around them.

    python benchmarks/profile_launches.py --batch 1 --fp8 --out $OUT    # on a GPU
    python benchmarks/profile_launches.py --batch 1 --fp8 --chain 0 --generate 16 80 --out $OUT
    python benchmarks/profile_launches.py --tiny --batch 2 --out /tmp/pl  # CPU smoke run
    python benchmarks/profile_launches.py --plot RESULT.json               # only redraw its PNG
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_generate as bg  # noqa: E402
import profile_decode  # noqa: E402

import djax  # noqa: E402

# XLA's command buffer kinds by default (FUSION, CUBLAS, CUBLASLT, CUSTOM_CALL, CUDNN, DYNAMIC_SLICE_FUSION),
# none, all but custom calls, and the default's with while loops and conditionals added (a `lax.while_loop`
# then runs as a CUDA graph's conditional node: its trip test is read on the device, not by the host)
DEFAULT_KINDS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"
VARIANTS = {
    "default": {},
    "no_command_buffers": {"xla_gpu_enable_command_buffer": ""},
    "no_custom_calls_in_command_buffers": {
        "xla_gpu_enable_command_buffer": DEFAULT_KINDS.replace("CUSTOM_CALL,", "")
    },
    "while_in_command_buffers": {"xla_gpu_enable_command_buffer": DEFAULT_KINDS + ",WHILE,CONDITIONAL"},
}


def busy_and_gaps(trace_dir: Path, steps: int, n_gaps: int = 12) -> dict:
    """From the trace's stream kernels (`profile_decode.stream_kernels`): busy time (overlaps merged), idle
    time within the span and the largest idle gaps, with the kernels that end before and start after each."""
    ks = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0.0), e["name"]) for e in profile_decode.stream_kernels(trace_dir)
    )
    if not ks:
        return {"kernels_per_step": 0}
    busy, gaps, end, last = 0.0, [], ks[0][0], ks[0][2]
    for s, e, name in ks:
        if s > end:
            gaps.append((s - end, last, name))
        busy += max(0.0, e - max(s, end))
        if e >= end:
            end, last = e, name
    span = end - ks[0][0]
    gaps.sort(reverse=True)
    return {
        "kernels_per_step": len(ks) / steps,
        "busy_us_per_step": busy / steps,
        "idle_us_per_step_within_span": (span - busy) / steps,
        "largest_gaps": [{"us": g, "after": a[:90], "before": b[:90]} for g, a, b in gaps[:n_gaps]],
    }


def measure(call, a, out: Path, label: str, trace: bool) -> dict:
    """Time `call` (which runs one step and returns what to wait for): step and host issue time; with
    `trace`, the trace's busy time and gaps too."""
    for _ in range(2):
        jax.block_until_ready(call())
    step, issue = [], []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        for _ in range(a.steps):
            r = call()
        t1 = time.perf_counter()
        jax.block_until_ready(r)
        t2 = time.perf_counter()
        issue.append((t1 - t0) / a.steps)
        step.append((t2 - t0) / a.steps)
    res = {
        "median_step_ms": sorted(step)[len(step) // 2] * 1e3,
        "step_ms": [t * 1e3 for t in step],
        "host_issue_ms_per_step": sorted(issue)[len(issue) // 2] * 1e3,
    }
    if trace:
        tdir = profile_decode.fresh_trace_dir(out / f"trace_{label}")
        with jax.profiler.trace(str(tdir), create_perfetto_trace=True):
            for _ in range(a.trace_steps):
                r = call()
            jax.block_until_ready(r)
        res["trace"] = busy_and_gaps(tdir, a.trace_steps)
        for f in tdir.rglob("*.xplane.pb"):
            f.unlink()
    t = res.get("trace", {})
    print(
        f"{label}: {res['median_step_ms']:.3f} ms/step, host issues one in {res['host_issue_ms_per_step']:.3f} ms"
        + (
            f"; traced busy {t['busy_us_per_step']:.0f} us, idle in span {t['idle_us_per_step_within_span']:.0f}"
            f" us, {t['kernels_per_step']:.0f} kernels"
            if t.get("kernels_per_step")
            else ""
        ),
        flush=True,
    )
    return res


def compile_variants(fn, args, label: str, variants, **static) -> dict:
    """{variant: compiled executable, or the error's text where XLA refused the options}."""
    out = {}
    for v in variants:
        try:
            out[v] = fn.lower(*args, **static).compile(compiler_options=VARIANTS[v] or None)
        except Exception as e:  # an option this XLA does not know: recorded, the others still run
            out[v] = f"{type(e).__name__}: {e}"[:300]
            print(f"{label} {v}: {out[v]}", flush=True)
    return out


def chain(a, out: Path, variants) -> dict:
    """`a.chain` projections of n x n at one row, FP8 (custom calls) and bf16 (XLA's dots); each also with its
    input donated to its output, so that a call's buffers are where the last call's were."""
    from djax.models.layers import linear
    from djax.quant import quantize

    n = a.chain_dim
    keys = jax.random.split(jax.random.key(3), a.chain)
    ws = [jax.random.normal(k, (n, n), jnp.float32).astype(jnp.bfloat16) * n**-0.5 for k in keys]
    weights = {"bf16": ws, "fp8": [quantize(w) for w in ws]}
    res = {}
    for kind, wl in weights.items():
        fp8 = "auto" if kind == "fp8" else None

        def f(x, wl, fp8=fp8):
            for w in wl:
                y = linear(x, w, fp8).astype(jnp.float32)
                x = (y * jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + 1e-6)).astype(jnp.bfloat16)
            return x

        for donated in (False, True):
            fn = jax.jit(f, donate_argnums=(0,) if donated else ())
            x = jax.ShapeDtypeStruct((1, n), jnp.bfloat16)
            name = f"chain {kind}" + (" donated" if donated else "")
            for v, c in compile_variants(fn, (x, wl), name, variants).items():
                label = f"chain_{kind}{'_donated' if donated else ''}_{v}"
                if isinstance(c, str):
                    res[label] = c
                    continue
                box = [
                    jax.random.normal(jax.random.key(4), (1, n), jnp.bfloat16)
                ]  # fresh: a donated one is gone

                def call(c=c, wl=wl, box=box, donated=donated):
                    y = c(box[0], wl)
                    if donated:
                        box[0] = y  # the next call's input is this call's output, in the same buffer
                    return y

                res[label] = measure(call, a, out, label, v == "default")
    return res


def model(params, cfg, w, a, out: Path, kind: str, variants) -> dict:
    """The decode step as `djax.decode` runs it (state donated, logits in a new buffer each step) and, with
    `a.keep_logits`, wrapped so that the last step's logits are donated too: their buffer takes the next
    step's logits, so a step's inputs and outputs stay where they were (the tokens are one array throughout)."""
    res = {}
    forms = {"": djax.decode}
    if a.keep_logits:
        forms["_logits_kept"] = jax.jit(
            lambda p, t, s, last: djax.decode(p, t, s, cfg), donate_argnums=(2, 3)
        )  # `last` unused: donated, its buffer (same shape and dtype) takes the new logits
    for b in a.batch:
        state = bg.synthetic_state(cfg, b, w["max_len"], w["context"], b)
        toks = profile_decode.step_tokens(cfg, b)
        for form, fn in forms.items():
            args = (
                (params, toks, state, cfg)
                if not form
                else (params, toks, state, jnp.zeros((b, cfg.vocab_size)))
            )
            for v, c in compile_variants(fn, args, f"{kind} b{b}{form}", variants).items():
                label = f"{kind}_b{b}{form}_{v}"
                if isinstance(c, str):
                    res[label] = c
                    continue
                box = [state, jnp.zeros((b, cfg.vocab_size)) if form else None]  # [state, last logits]

                def step(c=c, box=box, toks=toks, form=form):
                    if form:
                        box[1], box[0] = c(params, toks, box[0], box[1])
                    else:
                        box[1], box[0] = c(params, toks, box[0])
                    return box[1]

                res[label] = measure(step, a, out, label, v == "default")
                state = box[0]
    return res


def loop_step_figures(r: dict) -> dict:
    """A decode step of generate's loop from its calls of n1 and n2 new tokens: the difference over n2 - n1
    steps of the call's time, and of the traced GPU busy time and kernel count. A loop that runs as one CUDA
    graph node (while loops in command buffers) shows the profiler none of its body's kernels (the trace has
    the same kernels at both lengths): its busy time is None rather than a step's few launch kernels."""
    n1, n2 = r["new_tokens"]
    t1, t2 = r[f"trace_{n1}"], r[f"trace_{n2}"]
    r["ms_per_decode_step"] = (r[f"ms_per_call_{n2}"] - r[f"ms_per_call_{n1}"]) / (n2 - n1)
    r["kernels_per_decode_step"] = (t2.get("kernels_per_step", 0) - t1.get("kernels_per_step", 0)) / (n2 - n1)
    r["gpu_busy_ms_per_decode_step"] = (
        (t2.get("busy_us_per_step", 0.0) - t1.get("busy_us_per_step", 0.0)) / (n2 - n1) / 1e3
        if r["kernels_per_decode_step"] >= 1
        else None
    )
    return r


def generate_loop(params, cfg, a, out: Path, kind: str, variants) -> dict:
    """`djax.generate`'s decode loop (a `lax.while_loop`, every step inside one call): compiled for `a.generate`
    = (n1, n2) new tokens with the same prompt and cache size, so the two calls differ only by n2 - n1 decode
    steps; per step: the time, and from a trace of each call the GPU's busy time, both as that difference.
    Greedy, no EOS, so every row runs every step."""
    gm = importlib.import_module("djax.generate")  # the module (the package exports the function by its name)
    n1, n2 = a.generate
    eos = jnp.asarray(gm._eos_table(()))
    cfg = cfg.replace(eos_token_id=())
    res, first = {}, {}
    for b in a.batch:
        prompts = jax.random.randint(jax.random.key(b), (b, a.prompt), 2, cfg.vocab_size, jnp.int32)
        batch = djax.Batch(prompts, jnp.full((b,), a.prompt, jnp.int32), jnp.zeros((b,), jnp.uint32))
        gm.validate(batch, cfg, n2, a.prompt + n2)  # what djax.generate checks before it compiles
        compiled = {
            n: compile_variants(
                gm._generate,
                (params, batch, eos),
                f"{kind} generate b{b} +{n}",
                variants,
                config=cfg,
                sampling=gm.GREEDY,
                max_new_tokens=n,
                max_len=a.prompt + n2,
                moe_impl="grouped",
            )
            for n in (n1, n2)
        }
        for v in variants:
            label = f"{kind}_generate_b{b}_{v}"
            if any(isinstance(compiled[n][v], str) for n in (n1, n2)):
                res[label] = next(compiled[n][v] for n in (n1, n2) if isinstance(compiled[n][v], str))
                continue
            r = {"new_tokens": [n1, n2], "prompt": a.prompt}
            for n in (n1, n2):
                c = compiled[n][v]
                tokens = jax.block_until_ready(c(params, batch, eos)).tokens
                # the same program under other options: the same tokens (greedy) as the first option set's
                ref = first.setdefault((b, n), (v, tokens))
                r[f"same_tokens_as_{ref[0]}_{n}"] = bool((tokens == ref[1]).all())
                ts = []
                for _ in range(a.reps):
                    t0 = time.perf_counter()
                    jax.block_until_ready(c(params, batch, eos))
                    ts.append((time.perf_counter() - t0) * 1e3)
                tdir = profile_decode.fresh_trace_dir(out / f"trace_{label}_{n}")
                with jax.profiler.trace(str(tdir)):
                    jax.block_until_ready(c(params, batch, eos))
                r[f"ms_per_call_{n}"] = sorted(ts)[len(ts) // 2]
                r[f"trace_{n}"] = busy_and_gaps(tdir, 1, n_gaps=4)
                for f in tdir.rglob("*.xplane.pb"):
                    f.unlink()
            res[label] = loop_step_figures(r)
            busy = r["gpu_busy_ms_per_decode_step"]
            print(
                f"{label}: {r['ms_per_decode_step']:.3f} ms a decode step in the loop, GPU busy "
                + ("not traced" if busy is None else f"{busy:.3f} ms")
                + f", {r['kernels_per_decode_step']:.0f} kernels",
                flush=True,
            )
    return res


def plot(res: dict, path: str) -> None:
    """Per workload (the chain, each model), a bar per option set: the step's time, and inside it the time the
    host took to issue the step, so a step whose two bars meet was paced by the host. With generate's loop in
    the result, a second panel: its time a decode step, and inside it the GPU's busy time a step."""
    if "runs" in res:
        raise SystemExit("a result of several runs: draw it with --plot-runs")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [  # (title, groups {workload: {variant: result}}, outer bar's key, inner bar's key, inner's name)
        (
            "step time and the host's time to issue it",
            {},
            "median_step_ms",
            "host_issue_ms_per_step",
            "host issue",
        ),
        (
            "generate's loop: a decode step, the GPU busy in it",
            {},
            "ms_per_decode_step",
            "gpu_busy_ms_per_decode_step",
            "GPU busy",
        ),
    ]
    for sec in ("chain", "bf16", "fp8"):
        for label, r in res.get(sec, {}).items():
            if isinstance(r, dict):
                variant = next(v for v in VARIANTS if label.endswith("_" + v))
                groups = panels[1 if "_generate_" in label else 0][1]
                groups.setdefault(label.removesuffix("_" + variant), {})[variant] = r
    panels = [p for p in panels if p[1]]
    widths = [1.6 + 1.5 * len(p[1]) for p in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(sum(widths), 4.2), width_ratios=widths, squeeze=False)
    for ax, (title, groups, outer, inner, inner_name) in zip(axes[0], panels):
        variants = [v for v in VARIANTS if any(v in g for g in groups.values())]
        width = 0.8 / max(1, len(variants))
        for i, v in enumerate(variants):
            xs = [j + (i - (len(variants) - 1) / 2) * width for j, g in enumerate(groups.values()) if v in g]
            rs = [g[v] for g in groups.values() if v in g]
            bars = ax.bar(xs, [r[outer] for r in rs], width, label=f"{v}: time", alpha=0.45, color=f"C{i}")
            ax.bar(  # a loop the profiler could not see into has no inner bar
                xs, [r[inner] or 0 for r in rs], width * 0.45, color=f"C{i}", label=f"{v}: {inner_name}"
            )
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks(range(len(groups)), [g.replace("_", " ") for g in groups], fontsize=8, rotation=15)
        ax.set_ylabel("ms")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"{res['device']}, {res['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_runs(res: dict, path: str) -> None:
    """Runs of the same workloads side by side (`res["runs"]`: {run name: a result of this script}, as an A/B
    of a change keeps them): per workload a bar per run at its step time, a dot per rep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = res["runs"]

    def steps(r):
        """The timed steps: an option set XLA refused holds its error's text, generate's loop other figures."""
        return {
            k: v
            for sec in ("bf16", "fp8")
            for k, v in r.get(sec, {}).items()
            if isinstance(v, dict) and "median_step_ms" in v
        }

    labels = list(dict.fromkeys(k for r in runs.values() for k in steps(r)))
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 + 1.4 * len(labels)), 4.2))
    for i, (name, r) in enumerate(runs.items()):
        got = steps(r)
        xs = [j + (i - (len(runs) - 1) / 2) * width for j, k in enumerate(labels) if k in got]
        meds = [got[k]["median_step_ms"] for k in labels if k in got]
        bars = ax.bar(xs, meds, width, color=f"C{i}", alpha=0.6, label=name)
        ax.bar_label(bars, fmt="%.3f", fontsize=6)
        for x, k in zip(xs, [k for k in labels if k in got]):
            ax.plot([x] * len(got[k]["step_ms"]), got[k]["step_ms"], ".", color="k", ms=3)
    ax.set_xticks(
        range(len(labels)), [k.removesuffix("_default").replace("_", " ") for k in labels], fontsize=8
    )
    ax.set_ylabel("ms a step")
    ax.set_title(f"{res['device']}, {res['date']}: {res.get('title', '')}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNG of an earlier run's JSON, beside it")
    ap.add_argument("--plot-runs", metavar="JSON", help="the same for a JSON of several runs (`plot_runs`)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--trace-steps", type=int, default=4)
    ap.add_argument("--chain", type=int, default=40, help="projections in the chain workload (0: none)")
    ap.add_argument("--chain-dim", type=int, default=2048)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names from VARIANTS")
    ap.add_argument(
        "--fp8", action="store_true", help="then the model's weights as FP8 (quantize_projections)"
    )
    ap.add_argument(
        "--scale-fmt",
        choices=["ue8m0"],
        help="with --fp8: the block scales as V4's checkpoints hold them (UE8M0); default plain float32",
    )
    ap.add_argument(
        "--keep-logits", action="store_true", help="also the step with its logits' buffer donated"
    )
    ap.add_argument(
        "--generate",
        type=int,
        nargs=2,
        metavar=("N1", "N2"),
        help="also djax.generate's decode loop, from calls of N1 and N2 new tokens",
    )
    ap.add_argument("--prompt", type=int, default=32, help="prompt length for --generate")
    ap.add_argument("--name", default="launches")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/profile_launches"))
    a = ap.parse_args()
    if a.plot or a.plot_runs:
        draw = plot if a.plot else plot_runs
        path = a.plot or a.plot_runs
        draw(json.loads(Path(path).read_text()), path.removesuffix(".json") + ".png")
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = a.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        ap.error(f"unknown variants {sorted(unknown)}; known: {list(VARIANTS)}")
    res = {
        "date": time.strftime("%Y-%m-%d"),
        "device": jax.devices()[0].device_kind,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "variants": {v: VARIANTS[v] for v in variants},
    }
    path = out / f"{a.name}.json"
    if a.chain:
        res["chain"] = chain(a, out, variants)
        path.write_text(json.dumps(res, indent=1))
    cfg = bg.make_config(a.tiny)
    w = bg.TINY if a.tiny else bg.FULL
    params = djax.init_params(cfg, jax.random.key(0))
    res["bf16"] = model(params, cfg, w, a, out, "bf16", variants)
    if a.generate:
        res["bf16"].update(generate_loop(params, cfg, a, out, "bf16", variants))
    path.write_text(json.dumps(res, indent=1))
    if a.fp8:
        params = djax.quantize_projections(params, cfg, scale_fmt=a.scale_fmt, delete_originals=True)
        res["fp8_scale_fmt"] = a.scale_fmt or "float32"
        res["fp8"] = model(params, cfg, w, a, out, "fp8", variants)
        if a.generate:
            res["fp8"].update(generate_loop(params, cfg, a, out, "fp8", variants))
        path.write_text(json.dumps(res, indent=1))
    try:
        plot(res, str(path.with_suffix(".png")))
    except ImportError:
        print("matplotlib is not installed: no PNG (the JSON is written)")


if __name__ == "__main__":
    main()
