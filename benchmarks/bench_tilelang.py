"""TileLang FP8 block-scaled GEMM vs XLA (its lowering of the jnp ref, and a plain fp8 dot): error, time, TFLOP/s.

python benchmarks/bench_tilelang.py [--out DIR] [--small]    (on a CUDA GPU with tilelang importable)
Writes tilelang_fp8_gemm.json. FP8_PEAK is the H200 spec sheet's dense fp8 rate (1979 TFLOP/s, no sparsity):
a published ceiling, not a measurement, so the ratios are lower bounds on what fraction of the chip is used.
Decode shapes are memory bound: they also report GB/s against COPY_BW.
"""

import argparse
import functools
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import COPY_BW, bench  # noqa: E402

from djax.kernels.fp8_gemm_ref import fp8_gemm_ref, quantize_act, quantize_weight
from djax.kernels.fp8_gemm_tilelang import Tiling, cuda_kernel, default_tiling, fp8_gemm_tilelang

FP8_PEAK = 1979e12  # H200 SXM spec sheet, fp8 dense
DECODE = [(64, 4096, 4096), (64, 4096, 7168), (64, 7168, 4096), (64, 16384, 7168)]
PREFILL = [(4096, 4096, 4096), (4096, 7168, 7168)]
SWEEP_SHAPE = (64, 4096, 7168)
SWEEP = [Tiling(64, 32, 4), Tiling(64, 64, 4), Tiling(64, 128, 4), Tiling(64, 32, 2), Tiling(64, 32, 6)]


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


def run(out_dir: str, small: bool) -> dict:
    dev = jax.devices()[0]
    cases = [("decode", s) for s in (DECODE[:1] if small else DECODE)]
    cases += [("prefill", s) for s in (PREFILL[:1] if small else PREFILL)]
    rows = []
    for phase, (m, n, k) in cases:
        row = dict(phase=phase, m=m, n=n, k=k, tiling=default_tiling(m, n, k).__dict__)
        flops = 2 * m * n * k
        nbytes = m * k + n * k + 2 * m * n + 4 * (m * k // 128 + n * k // 16384)
        try:
            t0 = time.perf_counter()
            kern = cuda_kernel(m, n, k)
            row["compile_s"] = round(time.perf_counter() - t0, 1)
            row["launch"] = dict(
                grid=kern.grid, threads=kern.cubin.threads, shared_bytes=kern.cubin.shared_bytes
            )
            sets = make_sets(6 if phase == "decode" else 2, m, n, k)
            ref = jax.jit(fp8_gemm_ref)(*sets[0]).astype(jnp.float32)
            row["rel_err"] = rel_err(jax.jit(fp8_gemm_tilelang)(*sets[0]).astype(jnp.float32), ref)
            for name, fn in (
                ("tilelang", fp8_gemm_tilelang),
                ("xla_ref", fp8_gemm_ref),
                ("xla_fp8_dot", xla_fp8_dot),
            ):
                t = bench(fn, sets)
                row[name] = dict(
                    us=round(t * 1e6, 2),
                    tflops=round(flops / t / 1e12, 1),
                    peak_ratio=round(flops / t / FP8_PEAK, 4),
                    gbps=round(nbytes / t / 1e9, 1),
                    bw_ratio=round(nbytes / t / COPY_BW, 4),
                )
            row["speedup_vs_xla_ref"] = round(row["xla_ref"]["us"] / row["tilelang"]["us"], 2)
            row["ratio_to_xla_fp8_dot"] = round(row["xla_fp8_dot"]["us"] / row["tilelang"]["us"], 2)
        except Exception as e:  # noqa: BLE001 - keep the other shapes
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = dict(
        device=dev.device_kind,
        jax=jax.__version__,
        fp8_peak_tflops=FP8_PEAK / 1e12,
        copy_bw_tbs=COPY_BW / 1e12,
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        rows=rows,
    )
    sweep = []
    if not small:
        m, n, k = SWEEP_SHAPE
        sets = make_sets(6, m, n, k, seed=1)
        for tiling in SWEEP:
            fn = functools.partial(fp8_gemm_tilelang, tiling=tiling)
            try:
                t = bench(fn, sets)
                sweep.append(dict(tiling=tiling.__dict__, us=round(t * 1e6, 2)))
            except Exception as e:  # noqa: BLE001
                sweep.append(dict(tiling=tiling.__dict__, error=f"{type(e).__name__}: {e}"[:500]))
            print(json.dumps(sweep[-1]), flush=True)
    result["decode_tiling_sweep"] = dict(shape=SWEEP_SHAPE, rows=sweep)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tilelang_fp8_gemm.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--small", action="store_true", help="one decode and one prefill shape")
    args = p.parse_args()
    run(args.out, args.small)
