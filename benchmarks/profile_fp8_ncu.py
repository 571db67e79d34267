#!/usr/bin/env python3
"""Nsight Compute on the TileLang FP8 GEMM: a runner for `ncu` and a summary of its CSV pages as JSON.

On a GPU with Nsight Compute (TileLang importable), one launch after a warm-up, clocks left to the driver:

    ncu -k regex:fp8_gemm_kernel --launch-skip 1 --launch-count 1 --set full --clock-control none \\
        -o prof python benchmarks/profile_fp8_ncu.py run --shape 4096x4096x4096
    for page in details raw; do ncu --import prof.ncu-rep --page $page --csv > $page.csv; done
    ncu --import prof.ncu-rep --page source --print-source sass --csv > sass.csv
    python benchmarks/profile_fp8_ncu.py summarize details.csv raw.csv sass.csv --variant default > prof.json

`run` takes `--tiling` as the name of one of `WS_VARIANTS` (default: the shape's default tiling). `summarize` keeps the
speed-of-light, scheduler, warp-state and launch sections, the tensor-pipe, L2, shared-memory and clock
metrics, and every SASS instruction holding at least 1.5% of the stall samples with its main stall reason
(`profile_h200_fp8_prefill_ncu.json` has two kernels summarised this way).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys

SECTIONS = {
    "GPU Speed Of Light Throughput": "speed_of_light",
    "Scheduler Statistics": "scheduler",
    "Warp State Statistics": "warp_state",
    "Launch Statistics": "launch",
}
METRICS = (
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed",
    "gpc__cycles_elapsed.max.per_second",
    "sm__cycles_active.avg",
)
HOT_SHARE = 0.015  # instructions with at least this share of the stall samples are listed


def details(text: str) -> dict:
    """The `--page details` CSV's metrics of the kept sections, as "value unit" strings."""
    rows = list(csv.reader(io.StringIO(text)))
    col = {name: i for i, name in enumerate(rows[0])}
    out: dict = {}
    for row in rows[1:]:
        if len(row) <= col["Metric Value"]:
            continue
        section, name = row[col["Section Name"]], row[col["Metric Name"]]
        if section in SECTIONS and name:
            value = f"{row[col['Metric Value']]} {row[col['Metric Unit']]}".strip()
            out.setdefault(SECTIONS[section], {})[name] = value
    return out


def raw_metrics(text: str, keys=METRICS) -> dict:
    """The `--page raw` CSV (names, units, then one row of values) for `keys`, as "value unit" strings."""
    names, units, values = list(csv.reader(io.StringIO(text)))[:3]
    found = {n: f"{v} {u}".strip() for n, u, v in zip(names, units, values, strict=False)}
    return {k: found[k] for k in keys if k in found}


def hot_instructions(text: str, share: float = HOT_SHARE) -> tuple[int, list[dict]]:
    """(all stall samples, the SASS instructions with at least `share` of them) from the source page's CSV
    (a kernel-name line, then the header). Each: index in the listing, SASS, samples, share, times
    executed, and the stall reason with the most samples."""
    rows = list(csv.reader(io.StringIO(text)))
    head = next(i for i, r in enumerate(rows) if "Source" in r and "Address" in r)
    col = {name: i for i, name in enumerate(rows[head])}
    body = rows[head + 1 :]
    samples_col = col["Warp Stall Sampling (All Samples)"]
    stalls = [n for n in col if n.startswith("stall_") and "Not Issued" not in n]

    def count(row, name):
        return int(row[col[name]] or 0)

    total = sum(int(r[samples_col] or 0) for r in body)
    hot = []
    for i, row in enumerate(body):
        s = int(row[samples_col] or 0)
        if total and s >= share * total:
            hot.append(
                {
                    "index": i,
                    "sass": row[col["Source"]].strip(),
                    "samples": s,
                    "share": round(s / total, 3),
                    "executed": count(row, "Instructions Executed"),
                    "main_stall": max(stalls, key=lambda n, row=row: count(row, n)),
                }
            )
    return total, hot


def summarize(details_csv: str, raw_csv: str, sass_csv: str, variant: str) -> dict:
    total, hot = hot_instructions(sass_csv)
    return {
        "variant": variant,
        **details(details_csv),
        "metrics": raw_metrics(raw_csv),
        "stall_samples": total,
        "hot_instructions": hot,
    }


def run(shape: str, tiling: str | None, launches: int) -> None:
    """`launches` calls of the TileLang FP8 GEMM on fresh random inputs (the first compiles and warms up)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import jax
    from bench_tilelang import make_sets

    from djax.kernels import fp8_gemm_tilelang as F

    m, n, k = (int(d) for d in shape.split("x"))
    t = F.default_ws_tiling(m, n, k)
    if tiling:
        named = {v.name: v for vs in F.WS_VARIANTS.values() for v in vs}
        if tiling not in named:
            raise SystemExit(f"--tiling must name one of WS_VARIANTS: {sorted(named)}")
        t = named[tiling]
    a, sa, b, sb = make_sets(1, m, n, k)[0]
    fn = jax.jit(lambda *x: F.fp8_gemm_tilelang(*x, tiling=t))
    for _ in range(launches):
        jax.block_until_ready(fn(a, sa, b, sb))
    print(f"ran {t} at {shape} {launches} times", file=sys.stderr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the kernel, for ncu to profile")
    r.add_argument("--shape", default="4096x4096x4096", help="m x n x k")
    r.add_argument(
        "--tiling", help="a WS_VARIANTS name, e.g. ws128x256s3_p8_sa (default: the shape's default)"
    )
    r.add_argument("--launches", type=int, default=3)
    s = sub.add_parser("summarize", help="ncu's details, raw and source (SASS) CSV pages -> JSON on stdout")
    s.add_argument("details")
    s.add_argument("raw")
    s.add_argument("sass")
    s.add_argument("--variant", default="", help="what was profiled, recorded in the JSON")
    args = p.parse_args()
    if args.cmd == "run":
        run(args.shape, args.tiling, args.launches)
        return
    texts = [open(path).read() for path in (args.details, args.raw, args.sass)]
    json.dump(summarize(*texts, args.variant), sys.stdout, indent=1)


if __name__ == "__main__":
    main()
