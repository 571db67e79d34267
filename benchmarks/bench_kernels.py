"""Times each djax kernel against XLA's lowering of its jnp reference: time, TFLOP/s, GB/s, roofline ratio.

python benchmarks/bench_kernels.py [--out DIR] [--small] [--only moe,fp8]
(on a CUDA GPU; writes kernels_<device>.json and .png; the MoE and FP8 cases are in bench_moe.py)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from bench_moe import fp8_cases, moe_cases, rel_err  # noqa: E402 (the script's directory is on sys.path)

from djax.kernels.indexer import index_scores, indexer_topk
from djax.kernels.sparse_attn import sparse_decode
from djax.kernels.topk import topk

BF16 = jnp.bfloat16
COPY_BW = 4.3e12  # measured device copy bandwidth on the lent H200 (bytes read + written per second)
BF16_RATE = 790e12  # measured dense bf16 matmul rate on the lent H200


def bench(fn, sets, reps: int = 7) -> float:
    """Median seconds per call of `fn` over rotating input sets (so repeated calls do not hit L2)."""
    many = jax.jit(lambda ss: [fn(*s) for s in ss])
    jax.block_until_ready(many(sets))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(many(sets))
        times.append((time.perf_counter() - t0) / len(sets))
    return float(np.median(times))


def measure_ceilings():
    x = jnp.ones((1 << 29,), jnp.float32) + 1  # 2 GiB
    t = bench(lambda a: a * 1.0001, [(x,)], reps=5)
    bw = 2 * x.size * 4 / t
    a = jax.random.normal(jax.random.key(0), (8192, 8192), BF16)
    t = bench(lambda p, q: p @ q, [(a, a)], reps=5)
    return bw, 2 * 8192**3 / t


def attn_sets(n_sets, b, h, k, w, c, t, seed=0):
    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(n_sets):
        q = jnp.asarray(rng.standard_normal((b, h, k)), BF16)
        win = jnp.asarray(rng.standard_normal((b, w, k)), BF16)
        valid = jnp.asarray(rng.random((b, w)) < 0.98)
        pool = jnp.asarray(rng.standard_normal((b, c, k)), BF16)
        top = jnp.asarray(np.where(rng.random((b, t)) < 0.02, -1, rng.integers(0, c, (b, t))), jnp.int32)
        sinks = jnp.asarray(rng.standard_normal(h), jnp.float32)
        sets.append((q, win, valid, pool, top, sinks))
    return sets


def run(out_dir: str, small: bool = False, only: tuple[str, ...] = ("attn", "moe", "fp8")):
    dev = jax.devices()[0]
    rows, errors = [], []
    bw, rate = measure_ceilings() if not small else (COPY_BW, BF16_RATE)
    print(
        f"device {dev.device_kind}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s (measured now)"
    )

    def record(kernel, shape, variant, fn, sets, flops, nbytes, ref_time=None, check=None):
        """check: (ref_fn, select) -> the relative error of fn vs ref_fn on sets[0] over select(output)."""
        err = None
        try:
            if check is not None:
                err = rel_err(fn, *check, sets[0])
            t = bench(fn, sets)
        except Exception as e:  # noqa: BLE001 - keep timing the other variants
            errors.append(dict(kernel=kernel, shape=shape, variant=variant, error=repr(e)[:2000]))
            traceback.print_exc()
            print(f"{kernel} {shape} {variant}: FAILED {repr(e)[:200]}", flush=True)
            return None
        print(f"{kernel} {shape} {variant}: {t * 1e6:.1f} us, err {err}", flush=True)
        row = dict(
            kernel=kernel,
            shape=shape,
            variant=variant,
            time_us=t * 1e6,
            tflops=flops / t / 1e12,
            gbps=nbytes / t / 1e9,
            roofline=max(flops / BF16_RATE, nbytes / COPY_BW) / t,
            speedup_vs_xla_ref=(ref_time / t) if ref_time else None,
            vs_bf16_peak=flops / t / BF16_RATE,
            rel_err=err,
        )
        rows.append(row)
        return t

    if "attn" in only:
        # (a) sparse decode attention: b=64, 64 heads x 512, SWA 128 + top-512 of an 8k context (ratio 4 -> 2048)
        h, k, w, c, t = (64, 512, 128, 2048, 512) if not small else (16, 64, 16, 64, 32)
        scale = k**-0.5
        for b in (64, 8):
            sets = attn_sets(6 if b == 64 else 16, b, h, k, w, c, t)
            flops = 4 * b * h * (w + t) * k
            nbytes = 2 * b * (w + t) * k + 2 * 2 * b * h * k + 4 * b * (w + t)
            shape = f"b{b} h{h} k{k} W{w} top{t} of {c}"
            tr = record(
                "sparse_decode",
                shape,
                "xla_ref",
                lambda *a: sparse_decode(*a, scale=scale, impl="ref"),
                sets,
                flops,
                nbytes,
            )
            for bh, bs, nw, st, ns in [
                (32, 64, 8, 2, 1),
                (32, 64, 8, 1, 1),
                (64, 32, 8, 2, 1),
                (32, 64, 8, 1, 2),
                (32, 64, 8, 1, 4),
                (32, 64, 8, 1, 8),
                (64, 32, 8, 2, 4),
                (16, 32, 4, 2, 4),
                (16, 32, 4, 2, 8),
            ]:
                record(
                    "sparse_decode",
                    shape,
                    f"triton bh{bh} bs{bs} w{nw} st{st} split{ns}",
                    lambda *a, bh=bh, bs=bs, nw=nw, st=st, ns=ns: sparse_decode(
                        *a,
                        scale=scale,
                        impl="triton",
                        block_h=bh,
                        block_s=bs,
                        num_warps=nw,
                        num_stages=st,
                        nsplit=ns,
                    ),
                    sets,
                    flops,
                    nbytes,
                    tr,
                )

        # (b) indexer scoring (64 heads x 128) and top-512; vocab top-k
        rng = np.random.default_rng(1)
        h, c = (64, 128) if not small else (16, 32)
        for b, s in [(64, 2048), (8, 65536)] if not small else [(2, 300)]:
            sets = [
                (
                    jnp.asarray(rng.standard_normal((b, h, c)), BF16),
                    jnp.asarray(rng.standard_normal((b, s, c)), BF16),
                    jnp.asarray(rng.random((b, h)), jnp.float32),
                    jnp.full((b,), s, jnp.int32),
                )
                for _ in range(8)
            ]
            flops, nbytes = 2 * b * h * s * c, 2 * b * s * c + 4 * b * s + 2 * b * h * c
            shape = f"b{b} H{h} c{c} s{s}"
            tr = record(
                "index_scores", shape, "xla_ref", lambda *a: index_scores(*a, impl="ref"), sets, flops, nbytes
            )
            for bs in (64, 128):
                record(
                    "index_scores",
                    shape,
                    f"triton bs{bs}",
                    lambda *a, bs=bs: index_scores(*a, impl="triton", block_s=bs),
                    sets,
                    flops,
                    nbytes,
                    tr,
                )
            kk = min(512, s)
            tr = record(
                "indexer_topk",
                shape + f" k{kk}",
                "xla_ref",
                lambda *a, kk=kk: indexer_topk(*a, kk, impl="ref"),
                sets,
                flops,
                nbytes,
            )
            record(
                "indexer_topk",
                shape + f" k{kk}",
                "triton",
                lambda *a, kk=kk: indexer_topk(*a, kk, impl="triton"),
                sets,
                flops,
                nbytes,
                tr,
            )
            record(
                "indexer_topk",
                shape + f" k{kk}",
                "auto",
                lambda *a, kk=kk: indexer_topk(*a, kk),
                sets,
                flops,
                nbytes,
                tr,
            )
        sizes = (
            [(64, 2048, 512), (4, 262144, 512), (64, 129280, 50), (1, 262144, 512)]
            if not small
            else [(2, 3000, 64)]
        )
        for b, s, k in sizes:
            sets = [(jnp.asarray(rng.standard_normal((b, s)), jnp.float32),) for _ in range(8)]
            nbytes = 4 * b * s + 8 * b * k
            shape = f"b{b} s{s} k{k}"
            tr = record(
                "topk", shape, "xla lax.top_k", lambda x, k=k: topk(x, k, impl="ref"), sets, 0, nbytes
            )
            for blk, nw in [(2048, 16), (4096, 16)]:
                record(
                    "topk",
                    shape,
                    f"triton blk{blk} w{nw}",
                    lambda x, k=k, blk=blk, nw=nw: topk(x, k, impl="triton", block=blk, num_warps=nw),
                    sets,
                    0,
                    nbytes,
                    tr,
                )

    if "moe" in only:
        moe_cases(record, small)
    if "fp8" in only:
        fp8_cases(record, small)

    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%MZ")
    result = dict(
        device=dev.device_kind,
        date=stamp,
        jax=jax.__version__,
        measured_copy_bw=bw,
        measured_bf16_rate=rate,
        roofline_copy_bw=COPY_BW,
        roofline_bf16_rate=BF16_RATE,
        rows=rows,
        errors=errors,
    )
    os.makedirs(out_dir, exist_ok=True)
    tag = dev.device_kind.lower().replace("nvidia", "").strip().replace(" ", "_") or "gpu"
    with open(os.path.join(out_dir, f"kernels_{tag}.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"\n{'kernel':14} {'shape':28} {'variant':34} {'us':>9} {'TFLOP/s':>8} {'GB/s':>7} {'roof':>5} "
        f"{'/peak':>5} {'vs xla':>6} {'err':>8}"
    )
    for r in rows:
        sp = f"{r['speedup_vs_xla_ref']:.2f}" if r["speedup_vs_xla_ref"] else "-"
        er = f"{r['rel_err']:.1e}" if r["rel_err"] is not None else "-"
        print(
            f"{r['kernel']:14} {r['shape']:28} {r['variant']:34} {r['time_us']:9.1f} {r['tflops']:8.1f} "
            f"{r['gbps']:7.0f} {r['roofline']:5.2f} {r['vs_bf16_peak']:5.2f} {sp:>6} {er:>8}"
        )
    print(f"{len(errors)} errors")
    plot(rows, os.path.join(out_dir, f"kernels_{tag}.png"))


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = [f"{r['kernel']} {r['shape']}\n{r['variant']}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(rows) + 1))
    ax.barh(
        range(len(rows)),
        [r["roofline"] for r in rows],
        color=["grey" if "xla" in r["variant"] else "C0" for r in rows],
    )
    ax.set_yticks(range(len(rows)), labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("fraction of roofline (max of bytes / 4.3 TB/s, FLOPs / 790 TFLOP/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--small", action="store_true", help="tiny shapes: a smoke run of the script on CPU")
    ap.add_argument(
        "--only",
        default="attn,moe,fp8",
        help="comma list of sections: attn (attention, indexer, top-k), moe, fp8",
    )
    args = ap.parse_args()
    run(args.out, args.small, tuple(args.only.split(",")))
