#!/usr/bin/env python3
"""FP4 routed experts read as stored (V4.1-Flash: d 5120, f 2304, e 384, top-6, e2m1 codes with UE8M0
scales) at decode token counts: `moe_experts`' Triton tilings side by side in alternating rounds, each output
checked against the first tiling's (the same kernels over the same picks: bit for bit), device time per call
and the fraction of the copy bandwidth (the touched experts' codes and scales).

  python benchmarks/ab_fp4_tilings.py --tokens 1,4,16,32,64 --tilings 16x128x128w4s4,16x128x256w8s3 --out $OUT
  python benchmarks/ab_fp4_tilings.py --plot benchmarks/results/moe_fp4_tilings_h100_ab.json
"""

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse_tiling(s: str):
    """'16x128x256w8s3' -> GemmConfig(16, 128, 256, num_warps=8, num_stages=3)."""
    from djax.kernels.grouped_gemm_triton import GemmConfig

    tiles, rest = s.split("w")
    warps, stages = rest.split("s")
    bm, bn, bk = (int(v) for v in tiles.split("x"))
    return GemmConfig(bm, bn, bk, int(warps), int(stages))


def plot(result: dict, path: str) -> None:
    from ab_plot import plot_rounds

    panels = []
    for n in dict.fromkeys(r["n"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["n"] == n and "us" in r]
        rounds = [
            {r["cfg"]: r["us"] for r in rows if r["round"] == i} for i in sorted({r["round"] for r in rows})
        ]
        nbytes = rows[0]["of_copy"] * rows[0]["us"] * 1e-6 * result["copy"] if rows else 0
        panels.append(
            (
                f"{n} tokens: fraction of the copy bandwidth",
                lambda us, b=nbytes: b / (us * 1e-6) / result["copy"],
                rounds,
            )
        )
    first = result["rows"][0]["cfg"] if result["rows"] else ""
    plot_rounds(panels, first, 0.7, f"FP4 experts, tilings side by side, {result['device']}", path)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,64")
    p.add_argument("--tilings", default="16x128x128w4s4,16x128x256w8s3", help="the first is the baseline")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    p.add_argument("--name", default="moe_fp4_tilings_ab")
    p.add_argument("--plot", metavar="JSON", help="only draw the PNG of an earlier run's JSON, beside it")
    args = p.parse_args()
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), args.plot.removesuffix(".json") + ".png")
        return

    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench_kernels import bench, measure_ceilings
    from bench_moe import LIMIT, fp4_experts, routed_sets

    from djax.kernels.moe_experts import moe_experts

    d, f, e, k, (q1, q2, q3), per_expert = fp4_experts(small=False)  # bench_kernels --only moe_fp4's
    bw, _ = measure_ceilings()
    print(f"copy {bw / 1e12:.2f} TB/s", flush=True)
    cfgs = [parse_tiling(s) for s in args.tilings.split(",")]
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%MZ")
    result = dict(device=jax.devices()[0].device_kind, date=stamp, copy=bw, rows=[])
    for n in (int(t) for t in args.tokens.split(",")):
        sets, touched = routed_sets(n, d, e, k, (60, 65), (q1, q2, q3))
        first = None
        for rnd in range(args.rounds):
            for c in cfgs:
                tag = f"bm{c.block_m} bn{c.block_n} bk{c.block_k} w{c.num_warps} st{c.num_stages}"
                row = dict(n=n, cfg=tag, round=rnd)
                try:
                    fn = lambda *a, c=c: moe_experts(*a, LIMIT, impl="triton", cfg=c)  # noqa: E731
                    out = np.asarray(fn(*sets[0]).astype(jnp.float32))
                    first = out if first is None else first
                    wall, dev, kernels = bench(fn, sets, trace=True)
                    t = dev or wall
                    err = float(np.abs(out - first).max() / np.abs(first).max())
                    row.update(
                        us=t * 1e6, of_copy=touched * per_expert / t / bw, err_vs_first=err, kernels=kernels
                    )
                except Exception as ex:  # noqa: BLE001 - record and time the others
                    row.update(error=repr(ex)[:300])
                print(json.dumps({key: v for key, v in row.items() if key != "kernels"}), flush=True)
                result["rows"].append(row)
                with open(os.path.join(args.out, args.name + ".json"), "w") as fh:
                    json.dump(result, fh, indent=1)
    plot(result, os.path.join(args.out, args.name + ".png"))


if __name__ == "__main__":
    main()
