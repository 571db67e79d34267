"""TileLang FP8 GEMM tilings side by side, in alternating rounds, so that drift within a run shows.

python benchmarks/ab_fp8_tilings.py [--shapes 4096x4096x4096,...] [--only _ss,_g2,...] [--rounds 3] [--out DIR]
(CUDA GPU, tilelang importable; `--build` lowers and compiles only, no GPU needed; `--plot JSON` only draws an
earlier run's PNG beside it.)
Per shape: the "ws" default (`default_ws_tiling`) and every tiling of the shape's phase in `WS_VARIANTS`
whose name contains one of `--only`, each checked against the f32 reference first (a wrong one is recorded
and not timed), then `--rounds` rounds each timing every variant once, each round starting with the next
variant (device time from a profiler trace, `bench_kernels.bench`). Writes fp8_tilings_ab.json (rewritten
after every shape) under --out, and its PNG (per shape, every variant's rounds as dots on its bar of the
median, as a fraction of the FP8 peak).
"""

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from ab_plot import save, side_by_side_args, timed_rounds  # noqa: E402

from djax.kernels import fp8_gemm_tilelang as F  # noqa: E402


def tilings(m, n, k, only):
    """(name, tiling) pairs: the default first, then the chosen variants valid for the shape."""
    default = F.default_ws_tiling(m, n, k)
    out = [("ws_default", default)]
    for t in F.WS_VARIANTS["decode" if m <= 64 else "prefill"]:
        if t != default and any(s in t.name for s in only):
            try:
                F.check_ws_tiling(m, n, k, t)
            except ValueError:
                continue
            out.append((t.name, t))
    return out


def plot(result: dict, path: str) -> None:
    """Per shape, each variant's rounds as a fraction of the FP8 peak (red: the 60% target)."""
    from ab_plot import plot_rounds
    from bench_tilelang import FP8_PEAK

    panels = [
        (
            f"m{row['m']} n{row['n']} k{row['k']}: fraction of the FP8 peak (red: 60%)",
            lambda us, flops=2 * row["m"] * row["n"] * row["k"]: flops / (us * 1e-6) / FP8_PEAK,
            row["rounds"],
        )
        for row in result["rows"]
    ]
    suptitle = f"TileLang FP8 tilings side by side, {result['device']}, {result['date'][:10]}"
    plot_rounds(panels, "ws_default", 0.6, suptitle, path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="4096x4096x4096,4096x7168x7168,4096x4096x7168")
    p.add_argument("--only", default="", help="comma list of substrings of WS_VARIANTS names (default: all)")
    args = side_by_side_args(p, 3, plot)
    if args is None:
        return
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    only = tuple(args.only.split(","))
    if args.build:
        for m, n, k in shapes:
            for name, t in tilings(m, n, k, only):
                F.ws_kernel(m, n, k, t)
                print("built", name, m, n, k, flush=True)
        return

    from bench_moe import timing_sets
    from bench_tilelang import FP8_PEAK, RTOL, make_sets, rel_err

    from djax.kernels.fp8_gemm_ref import fp8_gemm_ref

    res = dict(device=jax.devices()[0].device_kind, date=time.strftime("%Y-%m-%d %H:%M:%S"), rows=[])
    for m, n, k in shapes:
        sets = make_sets(timing_sets(m), m, n, k)
        ref = np.asarray(jax.jit(functools.partial(fp8_gemm_ref, out_dtype=jnp.float32))(*sets[0]))
        fns = {name: functools.partial(F.fp8_gemm_tilelang, tiling=t) for name, t in tilings(m, n, k, only)}
        row = dict(m=m, n=n, k=k, tilings={name: str(fn.keywords["tiling"]) for name, fn in fns.items()})
        row.update(rel_err={}, rounds=[])
        for name, fn in fns.items():
            out = jax.block_until_ready(jax.jit(fn)(*sets[0]))
            row["rel_err"][name] = err = rel_err(np.asarray(out.astype(jnp.float32)), ref)
            print(m, n, k, name, "rel_err", err, "ok" if err <= RTOL else "WRONG", flush=True)
        timed = {name: (fn, sets) for name, fn in fns.items() if row["rel_err"][name] <= RTOL}
        row["rounds"] += timed_rounds(timed, args.rounds, (m, n, k), (2 * m * n * k, FP8_PEAK, "FP8 peak"))
        res["rows"].append(row)
        save(res, args.out, "fp8_tilings_ab", plot)


if __name__ == "__main__":
    main()
