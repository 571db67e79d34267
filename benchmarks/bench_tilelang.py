"""TileLang FP8 block-scaled GEMM variants vs XLA (its lowering of the jnp ref, and a plain fp8 dot).

python benchmarks/bench_tilelang.py [--out DIR] [--small] [--jobs N]   (CUDA GPU, tilelang importable)
Writes tilelang_fp8_gemm.json (rewritten after every shape, so a run cut short leaves what it measured).
Per shape: the "pointer" kernel (cp.async, raw pointers) at its default tiling, every "ws" tiling (TMA + warp
specialisation, launched through djax.ffi.tma) of the shape's phase (WS_VARIANTS: the measured-best older tilings
and the newer 128x256 / two-warpgroup / shared-memory-scale ones, side by side), xla_ref, xla_fp8_dot. Every output is
checked against the f32 reference before it is timed (rel_err, ok); a failing variant records its error and the
run goes on. All kernels are compiled first, in parallel worker processes (nvcc, no GPU), into the disk cache.
FP8_PEAK is the H200 spec sheet's dense fp8 rate (1979 TFLOP/s, no sparsity): a published ceiling, so the ratios
are lower bounds on the fraction of the chip used. Decode shapes are memory bound: GB/s against the card's copy
roof (`bench_kernels.roof_ceilings`).
On a GPU `us` is device time (the kernels summed from a profiler trace, `time_is`), wall time beside it.
"""

import argparse
import concurrent.futures as cf
import functools
import json
import multiprocessing
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import bench, measure_ceilings, roof_ceilings  # noqa: E402
from bench_moe import timing_sets  # noqa: E402

from djax.kernels.fp8_gemm_ref import fp8_gemm_ref, quantize_act, quantize_weight
from djax.kernels.fp8_gemm_tilelang import (
    WS_VARIANTS,
    check_ws_tiling,
    cuda_kernel,
    default_tiling,
    default_ws_tiling,
    fp8_gemm_tilelang,
    ws_kernel,
)

FP8_PEAK = 1979e12  # H200 SXM spec sheet, fp8 dense
DECODE = [(64, 4096, 4096), (64, 4096, 7168), (64, 7168, 4096), (64, 16384, 7168)]
PREFILL = [(4096, 4096, 4096), (4096, 7168, 7168)]
RTOL = 4e-4 + 2.0**-9  # f32 accumulation bound plus bf16 output rounding (tests/kernels/test_tilelang.py)
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def make_sets(n_sets, m, n, k, seed=0):
    key = jax.random.key(seed)
    sets = []
    for i in range(n_sets):
        ka, kb = jax.random.split(jax.random.fold_in(key, i))
        a, sa = quantize_act(jax.random.normal(ka, (m, k), jnp.float32))
        b, sb = quantize_weight(jax.random.normal(kb, (n, k), jnp.float32) * 0.05)
        sets.append(jax.block_until_ready((a, sa, b, sb)))
    return sets


def xla_fp8_dot(a, sa, b, sb):
    """XLA's own fp8 x fp8 -> f32 dot, ignoring the block scales: the time a cuBLAS-style fp8 GEMM takes."""
    out = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return out.astype(jnp.bfloat16)


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


ONLY: tuple[
    str, ...
] = ()  # --only: substrings of the "ws" variant names to run (pointer and ws_default always)


def variants(phase, m, n, k):
    """(name, tiling or None for the pointer kernel's default) for one shape: the pointer kernel, the "ws"
    default, then every other tiling of the phase (measured best first, newer ones after) valid for the shape."""
    out = [("pointer", None), ("ws_default", default_ws_tiling(m, n, k))]
    for t in WS_VARIANTS[phase]:
        if t == out[1][1] or (ONLY and not any(s in t.name for s in ONLY)):
            continue
        try:
            check_ws_tiling(m, n, k, t)
        except ValueError:
            continue
        out.append((t.name, t))
    return out


def _compile(m, n, k, tiling) -> str:
    """Worker: lower + nvcc into the disk cache (no GPU). Returns an error string or ''."""
    try:
        (ws_kernel if tiling is not None else cuda_kernel)(m, n, k, tiling)
        return ""
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"[:2000]


def precompile(cases, jobs: int) -> dict:
    todo = {(m, n, k, t) for phase, (m, n, k) in cases for _, t in variants(phase, m, n, k)}
    errors = {}
    ctx = multiprocessing.get_context("spawn")  # never fork a process that has initialised the GPU
    with cf.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        futs = {pool.submit(_compile, *key): key for key in todo}
        for i, f in enumerate(cf.as_completed(futs)):
            key = futs[f]
            try:
                err = f.result()
            except Exception as e:  # noqa: BLE001 - a dead worker
                err = f"{type(e).__name__}: {e}"
            if err:
                errors[key] = err
            log(f"compiled {i + 1}/{len(todo)} {key[:3]} {getattr(key[3], 'name', 'pointer')} {err[:200]}")
    return errors


def timing(t, flops, nbytes, copy_bw, roof_bw):
    """bw_ratio against the card's fixed roof (`bench_kernels.roof_ceilings`), vs_measured_copy against this
    run's own copy figure."""
    return dict(
        us=round(t * 1e6, 2),
        tflops=round(flops / t / 1e12, 1),
        peak_ratio=round(flops / t / FP8_PEAK, 4),
        gbps=round(nbytes / t / 1e9, 1),
        bw_ratio=round(nbytes / t / roof_bw, 4),
        vs_measured_copy=round(nbytes / t / copy_bw, 4),
    )


def run(out_dir: str, small: bool, jobs: int, phases: tuple[str, ...] = ("decode", "prefill")) -> dict:
    dev = jax.devices()[0]
    cases = [("decode", s) for s in (DECODE[:1] if small else DECODE) if "decode" in phases]
    cases += [("prefill", s) for s in (PREFILL[:1] if small else PREFILL) if "prefill" in phases]
    log(f"{dev.device_kind}: compiling {len(cases)} shapes' kernels with {jobs} workers")
    compile_errors = precompile(cases, jobs)
    copy_bw, rate = measure_ceilings()  # the decode rows' bandwidth is judged against this run's own copy
    roof_bw, _ = roof_ceilings(dev.device_kind, copy_bw, rate)
    log(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    result = dict(
        device=dev.device_kind,
        jax=jax.__version__,
        fp8_peak_tflops=FP8_PEAK / 1e12,
        copy_bw_tbs=roof_bw / 1e12,
        measured_copy_bw_tbs=round(copy_bw / 1e12, 3),
        rtol=RTOL,
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        rows=[],
    )
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tilelang_fp8_gemm.json")
    for phase, (m, n, k) in cases:
        row = dict(phase=phase, m=m, n=n, k=k, pointer_tiling=default_tiling(m, n, k).__dict__, impls={})
        flops = 2 * m * n * k
        nbytes = m * k + n * k + 2 * m * n + 4 * (m * k // 128 + n * k // 16384)
        try:
            sets = make_sets(timing_sets(m), m, n, k)
            ref = np.asarray(jax.jit(functools.partial(fp8_gemm_ref, out_dtype=jnp.float32))(*sets[0]))
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            result["rows"].append(row)
            continue
        impls = [
            (name, functools.partial(fp8_gemm_tilelang, tiling=t), t) for name, t in variants(phase, m, n, k)
        ]
        impls += [("xla_ref", fp8_gemm_ref, None), ("xla_fp8_dot", xla_fp8_dot, None)]
        for name, fn, tiling in impls:
            rec = {}
            if tiling is not None:
                rec["tiling"] = tiling.__dict__
            try:
                if name not in ("xla_ref", "xla_fp8_dot"):
                    err = compile_errors.get((m, n, k, tiling if name != "pointer" else None))
                    if err:
                        raise RuntimeError(f"compile: {err}")
                    if name == "pointer":
                        kern = cuda_kernel(m, n, k)
                        rec["launch"] = dict(
                            grid=kern.grid, threads=kern.cubin.threads, smem=kern.cubin.shared_bytes
                        )
                    else:
                        kern = ws_kernel(m, n, k, tiling)
                        rec["launch"] = dict(grid=kern.grid, threads=kern.threads, smem=kern.shared_bytes)
                out = jax.block_until_ready(jax.jit(fn)(*sets[0]))
                rec["rel_err"] = rel_err(np.asarray(out.astype(jnp.float32)), ref)
                rec["ok"] = name == "xla_fp8_dot" or rec["rel_err"] <= RTOL
                if not rec["ok"]:
                    raise RuntimeError(f"wrong output: rel err {rec['rel_err']:.3e} > {RTOL:.2e}; not timed")
                wall, dev, kernels = bench(fn, sets, trace=True)  # device time from a profiler trace on GPUs
                rec.update(timing(dev or wall, flops, nbytes, copy_bw, roof_bw))
                rec.update(
                    time_is="device" if dev else "wall", wall_us=round(wall * 1e6, 2), kernels_us=kernels
                )
            except Exception as e:  # noqa: BLE001 - keep the other variants and shapes
                rec["error"] = f"{type(e).__name__}: {e}"[:2000]
                traceback.print_exc()
            row["impls"][name] = rec
            log(f"{phase} {m}x{n}x{k} {name}: {json.dumps(rec)}")
        timed = {k_: v for k_, v in row["impls"].items() if "us" in v and not k_.startswith("xla")}
        if timed:
            best = min(timed, key=lambda k_: timed[k_]["us"])
            row["best"] = best
            xla = row["impls"].get("xla_fp8_dot", {}).get("us")
            log(f"BEST {phase} {m}x{n}x{k}: {best} {timed[best]['us']} us (xla_fp8_dot {xla} us)")
            for base in ("pointer", "xla_ref", "xla_fp8_dot"):
                if "us" in row["impls"].get(base, {}):
                    row[f"best_speedup_vs_{base}"] = round(row["impls"][base]["us"] / timed[best]["us"], 2)
        result["rows"].append(row)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    plot(result, path.removesuffix(".json") + ".png")
    log(f"wrote {path}")
    return result


def plot(result: dict, path: str) -> None:
    """One panel per shape: each timed variant's fraction of its ceiling (prefill: the FP8 peak, decode: the copy
    roof), XLA's in grey, the microseconds beside each bar. Skipped where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in result["rows"] if any("us" in v for v in r["impls"].values())]
    if not rows:
        return
    heights = [sum("us" in v for v in r["impls"].values()) for r in rows]
    fig, axes = plt.subplots(len(rows), 1, figsize=(8, 0.28 * sum(heights) + 1.2 * len(rows)), squeeze=False)
    for ax, row in zip(axes[:, 0], rows, strict=True):
        timed = [(name, v) for name, v in row["impls"].items() if "us" in v]
        measured = "measured_copy_bw_tbs" in result  # runs before it have only the fixed roof
        key = "peak_ratio" if row["phase"] == "prefill" else ("vs_measured_copy" if measured else "bw_ratio")
        ax.barh(
            range(len(timed)),
            [v[key] for _, v in timed],
            color=["grey" if name.startswith("xla") else "C0" for name, _ in timed],
        )
        for i, (_, v) in enumerate(timed):
            ax.text(v[key], i, f" {v['us']:.1f} us", va="center", fontsize=6)
        ax.set_yticks(range(len(timed)), [name for name, _ in timed], fontsize=6)
        ax.invert_yaxis()
        ceiling = {
            "peak_ratio": f"the {result['fp8_peak_tflops']:.0f} TFLOP/s FP8 peak",
            "bw_ratio": f"{result['copy_bw_tbs']} TB/s (fixed roof)",
            "vs_measured_copy": f"the {result.get('measured_copy_bw_tbs')} TB/s copy measured in the run",
        }[key]
        ax.set_title(f"{row['phase']} m{row['m']} n{row['n']} k{row['k']}: fraction of {ceiling}", fontsize=8)
    fig.suptitle(f"TileLang FP8 block-scaled GEMM, {result['device']}, {result['date'][:10]}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.97))  # room for the title above the first panel
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--small", action="store_true", help="one decode and one prefill shape")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="parallel compiles")
    p.add_argument("--phases", default="decode,prefill", help="comma list: decode, prefill")
    p.add_argument(
        "--only", default="", help="comma-separated substrings of ws variant names (e.g. _ss,x256)"
    )
    p.add_argument("--plot", metavar="JSON", help="only draw the PNG of an earlier run's JSON, beside it")
    args = p.parse_args()
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), args.plot.removesuffix(".json") + ".png")
        sys.exit()
    ONLY = tuple(s for s in args.only.split(",") if s)
    run(args.out, args.small, args.jobs, tuple(args.phases.split(",")))
