"""TileLang FP8 GEMM tilings side by side, in alternating rounds, so that drift within a run shows.

python benchmarks/ab_fp8_tilings.py [--shapes 4096x4096x4096,...] [--only _ss,_g2,...] [--rounds 3] [--out DIR]
(CUDA GPU, tilelang importable; `--build` lowers and compiles only, no GPU needed.)
Per shape: the "ws" default (`default_ws_tiling`) and every tiling of the shape's phase in `WS_VARIANTS`
whose name contains one of `--only`, each checked against the f32 reference first (a wrong one is recorded
and not timed), then `--rounds` rounds each timing every variant once (device time from a profiler trace,
`bench_kernels.bench`). Writes fp8_tilings_ab.json (rewritten after every shape) under --out.
"""

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="4096x4096x4096,4096x7168x7168,4096x4096x7168")
    p.add_argument("--only", default="", help="comma list of substrings of WS_VARIANTS names (default: all)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    p.add_argument("--build", action="store_true", help="lower and compile only")
    args = p.parse_args()
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    only = tuple(args.only.split(","))
    if args.build:
        for m, n, k in shapes:
            for name, t in tilings(m, n, k, only):
                F.ws_kernel(m, n, k, t)
                print("built", name, m, n, k, flush=True)
        return

    from bench_kernels import bench
    from bench_tilelang import FP8_PEAK, RTOL, make_sets, rel_err

    from djax.kernels.fp8_gemm_ref import fp8_gemm_ref

    res = dict(device=jax.devices()[0].device_kind, date=time.strftime("%Y-%m-%d %H:%M:%S"), rows=[])
    for m, n, k in shapes:
        sets = make_sets(2, m, n, k)
        ref = np.asarray(jax.jit(functools.partial(fp8_gemm_ref, out_dtype=jnp.float32))(*sets[0]))
        fns = {name: functools.partial(F.fp8_gemm_tilelang, tiling=t) for name, t in tilings(m, n, k, only)}
        row = dict(m=m, n=n, k=k, tilings={name: str(fn.keywords["tiling"]) for name, fn in fns.items()})
        row.update(rel_err={}, rounds=[])
        for name, fn in fns.items():
            out = jax.block_until_ready(jax.jit(fn)(*sets[0]))
            row["rel_err"][name] = err = rel_err(np.asarray(out.astype(jnp.float32)), ref)
            print(m, n, k, name, "rel_err", err, "ok" if err <= RTOL else "WRONG", flush=True)
        for r in range(args.rounds):
            times = {}
            for name, fn in fns.items():
                if row["rel_err"][name] <= RTOL:
                    wall, dev, _ = bench(fn, sets, trace=True)
                    times[name] = round((dev or wall) * 1e6, 2)
            row["rounds"].append(times)
            peak = {name: round(2 * m * n * k / (us * 1e-6) / FP8_PEAK, 4) for name, us in times.items()}
            print(m, n, k, "round", r, times, "of FP8 peak", peak, flush=True)
        res["rows"].append(row)
        with open(os.path.join(args.out, "fp8_tilings_ab.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
