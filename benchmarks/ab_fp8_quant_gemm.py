"""An FP8 projection at decode, the activations quantized inside the GEMM against before it, in alternating rounds.

python benchmarks/ab_fp8_quant_gemm.py [--shapes 2048x4096,...] [--rows 1,32] [--sweep-rows 1] [--rounds 2]
  [--out DIR]   (CUDA GPU; `--plot JSON` only draws an earlier run's PNG beside it)
python benchmarks/ab_fp8_quant_gemm.py --pairs 1024+512x4096,... [--rows 1,32]   (two projections of one x)

Per projection shape (n x k, V4-Flash's FP8 projections by default) and row count m, bf16 activations x [m, k]
and a 128 x 128-block FP8 weight:
  - "two-step": `quantize_act` then `fp8_gemm` ("auto": what the model's `linear` ran before `fp8_quant_gemm`;
    TileLang's kernel where that picks it);
  - "quant default": `fp8_quant_gemm` at its default tiles (`fp8_quant_triton.quant_config`); "quant default
    ieee (before)" the same with plain scales divided element by element (`fp8_quant_triton.MARKSTEIN` off),
    "quant default markstein div (before)" with Markstein's reciprocal by a division (`fp8_quant_triton.NEWTON`
    off);
  - each also with UE8M0 (power-of-two) activation scales, "... ue8m0";
  - at the --sweep-rows counts, `fp8_quant_gemm` (UE8M0) at other tiles: "quant m{BLOCK_M} n{BLOCK_N} s{split}",
    "... swap" where the dot is taken as b a^T, "... st{stages}" at other than six stages;
  - "bf16 weight": x @ w^T on the bf16 weight (XLA), twice the bytes.
With --pairs (n1+n2 x k: V4-Flash's projections of one x by default) instead: "two calls" (`fp8_quant_gemm` once
per weight) against "pair" (`fp8_quant_gemm_pair`, one launch), UE8M0 scales and, up to 32 rows, plain ones
(and "pair plain ieee (before)", their IEEE division an element, "pair plain markstein div (before)" their
reciprocal by a division).
Each is checked against the two-step jnp reference first (a wrong one is recorded and not timed); then every
round times each once (device time from a profiler trace), each round starting with the next variant. Input sets
rotate over at least --weight-mb (150) MB of weights, so that the 50 MB L2 does not hold them. Writes fp8_quant_gemm_ab.json
(rewritten after every shape) and its PNG under --out: per shape, the weight bytes' rate as a fraction of the
run's measured copy bandwidth.
"""

import argparse
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from ab_plot import save, side_by_side_args, timed_rounds  # noqa: E402

from djax.kernels import fp8_quant_triton as qk  # noqa: E402
from djax.kernels.fp8_gemm import fp8_gemm, fp8_quant_gemm, fp8_quant_gemm_pair  # noqa: E402
from djax.kernels.fp8_gemm_ref import quantize_act  # noqa: E402
from djax.kernels.fp8_gemm_triton import fewest_splits  # noqa: E402
from djax.quant import quantize  # noqa: E402

# V4-Flash's FP8 projections (out x in): shared expert up and down, q LoRA up, output LoRA down, q LoRA down,
# the KV projection
SHAPES = "2048x4096,4096x2048,32768x1024,4096x8192,1024x4096,512x4096"
# wq_a with wkv, a CSA compressor's wkv with wgate, an HCA one's, the indexer's, the shared expert's w1 with w3
PAIRS = "1024+512x4096,1024+1024x4096,512+512x4096,256+256x4096,2048+2048x4096"
RTOL = 2.0**-7  # bf16 results of float32 sums in a different order: a few bf16 ulps


def two_step(x, v, s, ue8m0=False):
    return fp8_gemm(*quantize_act(x, ue8m0), v, s, x.dtype)


def quant_plain(x, v, s, wd):
    return fp8_quant_gemm(x, v, s)


def traced_with(fn, **flags):
    """fn as traced with `fp8_quant_triton`'s module flags set (MARKSTEIN=False: the plain scales' IEEE division
    an element, the kernel before Markstein's quotient; NEWTON=True: its reciprocal without a division). jit
    traces on the first call, so the flags hold for that trace."""

    def traced(*args):
        was = {name: getattr(qk, name) for name in flags}
        for name, value in flags.items():
            setattr(qk, name, value)
        try:
            return fn(*args)
        finally:
            for name, value in was.items():
                setattr(qk, name, value)

    return traced


def sweep(m, n, k):
    """(name, QuantConfig) pairs of the kernel's tiles to try at one shape, each at the K split of
    `fewest_splits` and twice that (where every split keeps two K blocks or more): 16-row tiles of 64 and 128
    weight rows, 6 stages (64-row and 32-column ones lost by 1.1-1.5x in `fp8_quant_gemm_h100_ab.json`); and the
    dot swapped (b a^T: an fp8 wgmma whose 64-row side is the weight's): up to 8 rows 8- and 16-row tiles of 64
    and 128 weight rows at 6 stages, above 8 rows 16-row tiles and the tiles that cover m (up to 64 rows) of 128
    weight rows at 4 and 6 stages (fewer stages: less shared memory, two programs a SM)."""
    base = qk.quant_config(m, n, k)
    variants = [(16, bn, False, 6) for bn in (64, 128)]
    if m <= 8:
        variants += [(bm, bn, True, 6) for bm in (8, 16) for bn in (64, 128)]
    else:
        cover = next(b for b in (16, 32, 64) if b >= min(m, 64))
        variants += [(bm, 128, True, st) for bm in sorted({16, cover}) for st in (4, 6)]
    out = []
    for bm, bn, swap, stages in variants:
        tiles = -(-m // bm) * (n // bn)
        s = fewest_splits(tiles, k // 128)
        for split in (s, 2 * s):
            if (k // 128) % split == 0 and k // 128 // split >= 2:
                out.append(
                    replace(base, block_m=bm, block_n=bn, split_k=split, swap_ab=swap, num_stages=stages)
                )
    names = [
        f"quant m{c.block_m} n{c.block_n} s{c.split_k}"
        + (" swap" if c.swap_ab else "")
        + (f" st{c.num_stages}" if c.num_stages != 6 else "")
        for c in out
    ]
    return [(name, c) for name, c in dict(zip(names, out)).items() if c != base]


def plot(result: dict, path: str) -> None:
    """Per shape, each variant's rounds as a fraction of the run's copy bandwidth over the FP8 weight's bytes
    (red: 70%)."""
    from ab_plot import plot_rounds

    bw = result["copy_bw"]
    panels = [
        (
            f"m{row['m']} n{row['n']} k{row['k']}: FP8 weight bytes / time, fraction of copy (red: 70%)",
            lambda us, nbytes=row["n"] * row["k"]: nbytes / (us * 1e-6) / bw,
            row["rounds"],
        )
        for row in result["rows"]
    ]
    pairs = bool(result["rows"]) and "n1" in result["rows"][0]
    what = "two projections of one x, in two calls or one" if pairs else "quantized in the GEMM or before it"
    suptitle = f"FP8 projection, {what}, {result['device']}, {result['date'][:10]}"
    plot_rounds(panels, "two calls ue8m0" if pairs else "two-step", 0.7, suptitle, path)


def make_sets(m, n, k, weight_bytes, seed=0):
    """Input sets (x, codes, scales, the bf16 weight) over at least `weight_bytes` of weights; `seed` draws
    other ones (a second weight of a pair: the same keys would give the first one's leading rows)."""
    sets = []
    for i in range(max(3, -(-weight_bytes // (n * k)))):
        kx, kw = jax.random.split(jax.random.fold_in(jax.random.key(1000 * m + i), seed))
        w = quantize(jax.random.normal(kw, (n, k), jnp.float32) * 0.05)
        x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
        sets.append(jax.block_until_ready((x, w.values, w.scale, w.dense(jnp.bfloat16))))
    return sets


def run_pairs(args, res) -> None:
    """--pairs: per pair of weights (n1+n2 x k) and row count, two `fp8_quant_gemm` calls against one
    `fp8_quant_gemm_pair`, each checked against the two references first."""
    from bench_tilelang import rel_err

    for m in [int(r) for r in args.rows.split(",")]:
        for pair in args.pairs.split(","):
            widths, k = pair.split("x")
            n1, n2, k = *(int(w) for w in widths.split("+")), int(k)
            firsts = make_sets(m, n1, k, args.weight_mb * 1_000_000 * n1 // (n1 + n2))
            seconds = make_sets(m, n2, k, args.weight_mb * 1_000_000 * n2 // (n1 + n2), seed=1)
            count = min(len(firsts), len(seconds))
            sets = [(*a[:3], *b[1:3]) for a, b in zip(firsts[:count], seconds[:count], strict=True)]
            kinds = (True, False) if m <= 32 else (True,)
            fns = {}
            for u in kinds:
                tag = " ue8m0" if u else " plain"
                fns["two calls" + tag] = (
                    lambda x, v, s, v2, s2, u=u: (fp8_quant_gemm(x, v, s, u), fp8_quant_gemm(x, v2, s2, u)),
                    u,
                )
                fns["pair" + tag] = (lambda x, v, s, v2, s2, u=u: fp8_quant_gemm_pair(x, v, s, v2, s2, u), u)
                if not u:
                    fns["pair plain ieee (before)"] = (traced_with(fns["pair plain"][0], MARKSTEIN=False), u)
                    fns["pair plain markstein div (before)"] = (
                        traced_with(fns["pair plain"][0], NEWTON=False),
                        u,
                    )
            x, v, s, v2, s2 = sets[0]
            refs = {
                u: np.concatenate(
                    [
                        np.asarray(fp8_quant_gemm(x, w, sc, u, impl="ref"), np.float32)
                        for w, sc in ((v, s), (v2, s2))
                    ],
                    axis=1,
                )
                for u in kinds
            }
            row = dict(m=m, n=n1 + n2, n1=n1, k=k, sets=count, rel_err={}, rounds=[])
            for name, (fn, u) in fns.items():
                out = jax.block_until_ready(jax.jit(fn)(*sets[0]))
                got = np.concatenate([np.asarray(o, np.float32) for o in out], axis=1)
                row["rel_err"][name] = err = rel_err(got, refs[u])
                print(m, pair, name, "rel_err", err, flush=True)
            timed = {name: (fn, sets) for name, (fn, _) in fns.items() if row["rel_err"][name] <= RTOL}
            row["rounds"] += timed_rounds(timed, args.rounds, (m, pair))
            res["rows"].append(row)
            save(res, args.out, "fp8_quant_gemm_pair_ab", plot)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--rows", default="1,32")
    p.add_argument("--sweep-rows", default="1", help="row counts at which other tiles are tried too")
    p.add_argument("--weight-mb", type=int, default=150, help="weight bytes the input sets rotate over")
    p.add_argument(
        "--pairs", nargs="?", const=PAIRS, help=f"pairs of weights n1+n2xk instead (default {PAIRS})"
    )
    args = side_by_side_args(p, 2, plot)
    if args is None:
        return
    from bench_kernels import measure_ceilings
    from bench_tilelang import rel_err

    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    sweep_rows = {int(r) for r in args.sweep_rows.split(",") if r}
    os.makedirs(args.out, exist_ok=True)
    copy_bw, _ = measure_ceilings()
    from djax.kernels import dispatch

    res = dict(device=jax.devices()[0].device_kind, date=time.strftime("%Y-%m-%d %H:%M:%S"), copy_bw=copy_bw)
    res["tilelang"] = dispatch.has_tilelang()
    res["rows"] = []
    print("copy", copy_bw / 1e12, "TB/s", flush=True)
    if args.pairs:
        run_pairs(args, res)
        return
    for m in [int(r) for r in args.rows.split(",")]:
        for n, k in shapes:
            sets = make_sets(m, n, k, args.weight_mb * 1_000_000)
            fns = {  # name -> (fn(x, v, s, wd), ue8m0)
                "two-step": (lambda x, v, s, wd: two_step(x, v, s), False),
                "two-step ue8m0": (lambda x, v, s, wd: two_step(x, v, s, True), True),
                "quant default": (quant_plain, False),
                "quant default ieee (before)": (traced_with(quant_plain, MARKSTEIN=False), False),
                "quant default markstein div (before)": (traced_with(quant_plain, NEWTON=False), False),
                "quant default ue8m0": (lambda x, v, s, wd: fp8_quant_gemm(x, v, s, True), True),
                "bf16 weight": (lambda x, v, s, wd: x @ wd.T, False),
            }
            if m in sweep_rows:
                for name, cfg in sweep(m, n, k):
                    fns[name + " ue8m0"] = (
                        lambda x, v, s, wd, c=cfg: fp8_quant_gemm(x, v, s, True, cfg=c),
                        True,
                    )
            x, v, s, wd = sets[0]
            refs = {
                u: np.asarray(fp8_quant_gemm(x, v, s, u, impl="ref").astype(jnp.float32))
                for u in (False, True)
            }
            row = dict(
                m=m, n=n, k=k, sets=len(sets), default=str(qk.quant_config(m, n, k)), rel_err={}, rounds=[]
            )
            for name, (fn, ue8m0) in fns.items():
                try:
                    out = jax.block_until_ready(jax.jit(fn)(*sets[0]))
                    row["rel_err"][name] = err = rel_err(np.asarray(out.astype(jnp.float32)), refs[ue8m0])
                except Exception as e:  # noqa: BLE001 - a config that does not build is recorded, not timed
                    row["rel_err"][name] = err = float("inf")
                    print(m, n, k, name, "failed:", repr(e)[:300], flush=True)
                print(m, n, k, name, "rel_err", err, flush=True)
            # the bf16 weight is another product (the weight not rounded to e4m3): timed, not held to RTOL
            timed = {
                name: (fn, sets)
                for name, (fn, _) in fns.items()
                if row["rel_err"][name] <= RTOL or name == "bf16 weight"
            }
            row["rounds"] += timed_rounds(timed, args.rounds, (m, n, k), (n * k, copy_bw, "copy"))
            res["rows"].append(row)
            save(res, args.out, "fp8_quant_gemm_ab", plot)


if __name__ == "__main__":
    main()
