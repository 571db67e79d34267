"""Sparse decode attention tilings (TileLang's, the register-operand CUDA kernel "rs", and Triton's) side by
side, in alternating rounds, so that drift within a run shows.

python benchmarks/ab_attn_tilings.py [--batches 64] [--variants pair3,pair4_pie] [--rounds 5] [--out DIR]
(CUDA GPU, tilelang importable for its variants; `--build` lowers and compiles only, no GPU needed; `--plot
JSON` draws only.) A Triton variant is named by its arguments: `tr16x32w4s2n8` is block_h 16, block_s 32, 4
warps, 2 stages, 8 splits.
Per batch size, at `bench_kernels.py`'s shape (64 heads x 512, ring of 128, top 512 of 2,048 pool rows): "auto"
(the default tiling) and every chosen variant of `VARIANTS`, each checked against the reference first (a wrong
one is recorded and not timed), then `--rounds` rounds each timing every variant once, each round starting
with the next variant (device time from a profiler trace, `bench_kernels.bench`, over input sets that rotate
so repeats miss L2). Writes attn_tilings_ab.json under --out and its PNG (per batch, each variant's rounds as
dots on its bar of the median, as a fraction of the copy bandwidth measured in the same run), both rewritten
after every round; `--plot JSON` only draws an earlier run's PNG beside it.
"""

import argparse
import functools
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from ab_plot import save, side_by_side_args, timed_rounds  # noqa: E402

from djax.kernels.sparse_attn import sparse_decode  # noqa: E402

H, K, W, C, T = 64, 512, 128, 2048, 512
SCALE = K**-0.5
RTOL = 1e-2  # bf16 output against the f32 reference (the GPU tests' tolerance)
WS = dict(impl="tilelang", block_s=64, num_stages=2, num_warps=12)
VARIANTS = {  # name -> sparse_decode's tiling arguments (on top of WS)
    "after": dict(nsplit=2),  # 2 splits merged by XLA after the kernel
    "gmem": dict(nsplit=2, merge_splits=True),  # merged in the cluster through global memory
    "dsmem": dict(nsplit=2, merge_splits="dsmem"),  # staged partials read through distributed shared memory
    "push": dict(nsplit=2, merge_splits="push"),  # pushed from registers, no cluster barrier after the loop
    "push_bf16": dict(nsplit=2, merge_splits="push_bf16"),  # the same, the values crossing as bf16
    "split4": dict(nsplit=4),
    "push_tmaq": dict(nsplit=2, merge_splits="push", tma_q=True),  # push, q loaded by TMA
    "gmem8": dict(nsplit=8, merge_splits=True),  # the b8 default: 8 splits merged through global memory
    "gmem8_tmaq": dict(nsplit=8, merge_splits=True, tma_q=True),
    "pair": dict(nsplit=1, dim_pair=True),  # a CTA pair splitting the head dim, scores summed every block
    "pair3": dict(nsplit=1, num_stages=3, dim_pair=True),
    "pair32_6": dict(nsplit=1, block_s=32, num_stages=6, dim_pair=True),  # 32-key blocks: more in flight
    "pair32_8": dict(nsplit=1, block_s=32, num_stages=8, dim_pair=True),
    # each block's P in the score buffer just read: the 17 KB of P and the end's table free a fourth stage
    "pair3_pie": dict(nsplit=1, num_stages=3, dim_pair=True, p_in_exchange=True),
    "pair4_pie": dict(nsplit=1, num_stages=4, dim_pair=True, p_in_exchange=True),
    "rs": dict(impl="rs"),  # the CUDA kernel with the keys as wgmma's register operand (no tiling)
}


def variant(name: str) -> dict:
    """sparse_decode's arguments for a variant name: one of `VARIANTS` (TileLang's on top of WS), or a Triton
    tiling spelled out as tr{block_h}x{block_s}w{warps}s{stages}n{splits}."""
    if name in VARIANTS:
        return {**WS, **VARIANTS[name]}
    m = re.fullmatch(r"tr(\d+)x(\d+)w(\d+)s(\d+)n(\d+)", name)
    if m is None:
        raise ValueError(
            f"unknown variant {name!r}: one of {', '.join(VARIANTS)} or tr<bh>x<bs>w<warps>s<stages>n<splits>"
        )
    bh, bs, nw, st, ns = map(int, m.groups())
    return dict(impl="triton", block_h=bh, block_s=bs, num_warps=nw, num_stages=st, nsplit=ns)


def plot(result: dict, path: str) -> None:
    """Per batch size, each variant's rounds as a fraction of the run's copy bandwidth (red: the 70% target)."""
    from ab_plot import plot_rounds

    panels = [
        (
            f"b{row['b']}: fraction of the measured copy bandwidth (red: 70%)",
            lambda us, nbytes=row["bytes"]: nbytes / (us * 1e-6) / result["measured_copy_bw"],
            row["rounds"],
        )
        for row in result["rows"]
    ]
    suptitle = f"Sparse decode tilings, {result['device']}, {result['date'][:10]}"
    plot_rounds(panels, "auto", 0.7, suptitle, path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="64")
    p.add_argument(
        "--variants",
        default="pair3,pair4_pie",
        help=f"comma list of {', '.join(VARIANTS)} or Triton tilings "
        "tr<heads>x<keys>w<warps>s<stages>n<splits>",
    )
    args = side_by_side_args(p, 5, plot)
    if args is None:
        return
    batches = [int(b) for b in args.batches.split(",")]
    chosen = {name: variant(name) for name in args.variants.split(",") if name}
    if args.build:
        for b in batches:
            for name, kw in chosen.items():
                if kw["impl"] == "triton":
                    continue  # compiled on first use
                if kw["impl"] == "rs":
                    from djax.kernels.sparse_attn_rs import cuda_kernel as rs_kernel

                    rs_kernel(H, W, C, T, SCALE)
                    print("built", name, b, flush=True)
                    continue
                from djax.kernels.sparse_attn import tilelang_tiling
                from djax.kernels.sparse_attn_tilelang import cuda_kernel

                tiling = tilelang_tiling(**{k: v for k, v in kw.items() if k != "impl"})
                cuda_kernel(b, H, K, W, C, T, SCALE, tiling)
                print("built", name, b, flush=True)
        return

    from bench_kernels import attn_cost, attn_sets, measure_ceilings

    bw, _ = measure_ceilings()
    res = dict(
        device=jax.devices()[0].device_kind,
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        measured_copy_bw=bw,
        shape=dict(h=H, k=K, W=W, C=C, T=T),
        rows=[],
    )
    print(f"copy {bw / 1e12:.2f} TB/s", flush=True)
    for b in batches:
        sets = attn_sets(24, b, H, K, W, C, T)
        nbytes = attn_cost(b, H, K, W, T)[1]
        f32 = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in sets[0]]
        ref = np.asarray(jax.jit(functools.partial(sparse_decode, scale=SCALE, impl="ref"))(*f32))
        fns = {"auto": functools.partial(sparse_decode, scale=SCALE)}
        fns |= {name: functools.partial(sparse_decode, scale=SCALE, **kw) for name, kw in chosen.items()}
        row = dict(
            b=b, bytes=nbytes, variants={n: str(kw) for n, kw in chosen.items()}, rel_err={}, rounds=[]
        )
        res["rows"].append(row)
        for name, fn in fns.items():
            try:
                out = np.asarray(jax.jit(fn)(*sets[0]).astype(jnp.float32))
                err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
            except Exception as e:  # noqa: BLE001 - record it, time the others
                err = f"failed: {e!r}"[:500]
            row["rel_err"][name] = err
            print(b, name, "rel_err", err, flush=True)
        ok = {name for name, err in row["rel_err"].items() if isinstance(err, float) and err <= RTOL}
        timed = {name: (fn, sets) for name, fn in fns.items() if name in ok}
        for times in timed_rounds(timed, args.rounds, (b,), (nbytes, bw, "copy")):
            row["rounds"].append(times)
            save(res, args.out, "attn_tilings_ab", plot)


if __name__ == "__main__":
    main()
