"""TileLang's FP8 grouped contiguous GEMM (MoE prefill): tilings side by side, in alternating rounds.

python benchmarks/ab_fp8_grouped.py [--only v4flash,ep] [--rounds 3] [--out DIR]
(CUDA GPU, tilelang importable; `--build` lowers and compiles only, no GPU needed; `--plot JSON` only draws an
earlier run's PNG beside it.)
Layouts: V4-Flash's experts on one GPU at 4,096 tokens (top-6 of 256 with `bench_moe._routing`'s skew, each
group padded to 128 rows, the layout's static bound of rows, so tiles of padding follow the last group), gate
or up (n 2048, k 4096) and down (n 4096, k 2048); and `bench_moe.GROUPED_EP_SHAPES`' expert-parallel rank
layouts (DeepGEMM's shapes, and V4-Flash's 32 local experts of about 768 rows).
Variants: the default (`default_grouped_tiling` for the layout's rows: where the tiles are 128x256, the
persistent kernel with the atomic walk, one CTA per SM walking the live tiles only), the default with
`half_tiles` flipped, and where the default is persistent, its static walk and the one-tile-a-CTA kernel
(`default_grouped_tiling` without the rows: its own rule for half tiles) with half tiles as that rule says and
flipped. Each is checked against the f32 reference on the rows of 16 groups (every variant's check includes
tiles whose second half is padding), then timed in `--rounds` rounds (device time, `bench_kernels.bench`),
each round starting with the next variant.
FLOPs count the picks, not the padding.
Writes fp8_grouped_ab.json under --out (rewritten after every layout) and its PNG.
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

from djax.kernels import fp8_gemm_tilelang as F  # noqa: E402

CHECK_GROUPS = 16


def layouts(only):
    """(name, m_indices, n, k, groups) per layout chosen by `only` (substrings of the names); groups is the
    number of weight matrices (V4-Flash's 256 experts, of which the routing touches 94)."""
    from bench_moe import GROUPED_EP_SHAPES, _routing, contiguous_indices, group_sizes

    from djax.kernels.moe_experts import layout

    out = []
    _, idx = _routing(jax.random.key(80), 4096, 256, 6)  # bench_moe's contiguous rows
    mi = np.asarray(layout(idx, 256, 128, impl="ref").m_indices)
    for n, k in ((2048, 4096), (4096, 2048)):
        out.append((f"v4flash 1 GPU 4096 tokens n{n} k{k}", mi, n, k, 256))
    for groups, mean, n, k in GROUPED_EP_SHAPES:
        sizes = group_sizes(groups, mean, seed=groups + mean + n + k)  # bench_moe's layouts
        out.append((f"ep g{groups} x~{mean} n{n} k{k}", contiguous_indices(sizes), n, k, groups))
    return [x for x in out if any(s in x[0] for s in only)]


def variants(mi, n, k):
    """(name, tiling, rows) per variant: rows is how many of the layout's rows it computes."""

    def flipped(t):
        return ("half_tiles" if not t.half_tiles else "whole tiles"), replace(t, half_tiles=not t.half_tiles)

    default = F.default_grouped_tiling(n, k, mi.size)
    out = [("default", default, mi.size), (*flipped(default), mi.size)]
    if default.persistent:  # the other walk, and one tile a CTA with its own half-tile rule and the other
        one_a_cta = F.default_grouped_tiling(n, k)
        name, other = flipped(one_a_cta)
        out.append(("persistent static", replace(default, persistent="static"), mi.size))
        out.append(("one tile a CTA", one_a_cta, mi.size))
        out.append((f"one tile a CTA, {name}", other, mi.size))
    return out


def check_rows(mi):
    """Rows of CHECK_GROUPS groups (or all): up to half of them groups with a tile whose second half is
    padding, then the largest others, then more of the first kind."""
    starts = np.flatnonzero(np.r_[True, mi[1:] != mi[:-1]] & (mi >= 0))  # each group's first row
    sizes = np.array([np.count_nonzero(mi == mi[s]) for s in starts])
    half = [i for i, r in enumerate(sizes) if 1 <= r % 128 <= 64]
    rest = [i for i in np.argsort(-sizes) if i not in half]
    chosen = sorted((half[: CHECK_GROUPS // 2] + rest + half[CHECK_GROUPS // 2 :])[:CHECK_GROUPS])
    return np.concatenate([np.arange(starts[i], starts[i] + -(-sizes[i] // 128) * 128) for i in chosen])


def plot(result: dict, path: str) -> None:
    from ab_plot import plot_rounds
    from bench_tilelang import FP8_PEAK

    panels = [
        (
            f"{row['layout']}: fraction of the FP8 peak (picks' FLOPs; red: 60%)",
            lambda us, flops=row["flops"]: flops / (us * 1e-6) / FP8_PEAK,
            row["rounds"],
        )
        for row in result["rows"]
    ]
    suptitle = (
        f"TileLang FP8 grouped contiguous, variants side by side, {result['device']}, {result['date'][:10]}"
    )
    plot_rounds(panels, "default", 0.6, suptitle, path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="v4flash,ep", help="comma list of substrings of the layouts' names")
    args = side_by_side_args(p, 3, plot)
    if args is None:
        return
    chosen = layouts(tuple(args.only.split(",")))
    if args.build:
        for name, mi, n, k, g in chosen:
            for vname, t, rows in variants(mi, n, k):
                F.ws_kernel(rows, n, k, t, g)
                print("built", name, vname, flush=True)
        return

    from bench_tilelang import FP8_PEAK, RTOL, rel_err

    from djax.kernels.fp8_gemm import grouped_contiguous
    from djax.kernels.fp8_gemm_ref import quantize_act, quantize_weight

    res = dict(device=jax.devices()[0].device_kind, date=time.strftime("%Y-%m-%d %H:%M:%S"), rows=[])
    for name, mi, n, k, g in chosen:
        m = mi.size
        b, b_s = quantize_weight(jax.random.normal(jax.random.key(1), (g, n, k), jnp.bfloat16))
        sets = []
        for s in range(2):  # two input sets (the GEMM is compute-bound), padding rows of A zero
            x = jax.random.normal(jax.random.key(10 + s), (m, k), jnp.float32)
            a, a_s = quantize_act(jnp.where(jnp.asarray(mi >= 0)[:, None], x, 0))
            sets.append((a, a_s, b, b_s, jnp.asarray(mi)))
        picks = int((mi >= 0).sum())
        rows = check_rows(mi)
        sub = mi[rows]
        a, a_s = sets[0][0][rows], sets[0][1][rows]
        uniq, local = np.unique(sub[sub >= 0], return_inverse=True)
        local_mi = np.full(sub.shape, -1, np.int32)
        local_mi[sub >= 0] = local
        ref = grouped_contiguous(a, a_s, b[uniq], b_s[uniq], jnp.asarray(local_mi), jnp.float32, impl="ref")
        ref = np.asarray(ref)
        live, idle = sub >= 0, (sub < 0) & (np.arange(rows.size) % 128 >= 64)
        fns, row = {}, dict(layout=name, m=m, n=n, k=k, picks=picks, flops=2 * picks * n * k)
        row.update(tilings={}, rel_err={}, idle_rows_nonzero={}, rounds=[])
        for vname, t, r in variants(mi, n, k):
            # a variant over fewer rows gets its own inputs cut ahead (a cut inside the jit would be timed)
            vsets = [tuple(x[:r] if i in (0, 1, 4) else x for i, x in enumerate(s)) for s in sets]
            fn = jax.jit(lambda a, a_s, b, b_s, mi, t=t: grouped_contiguous(a, a_s, b, b_s, mi, tiling=t))
            out = np.asarray(fn(*vsets[0]).astype(jnp.float32))
            out = np.concatenate([out, np.zeros((m - r, n), np.float32)])[rows]
            row["tilings"][vname] = f"{t} over {r} rows"
            row["rel_err"][vname] = err = rel_err(out[live], ref[live])
            # a tile's padding rows are undefined in the op's contract; with half_tiles the idle half stores 0
            row["idle_rows_nonzero"][vname] = int(np.count_nonzero(out[idle]))
            print(name, vname, "rel_err", err, "ok" if err <= RTOL else "WRONG", flush=True)
            fns[vname] = fn, vsets
        timed = {v: x for v, x in fns.items() if row["rel_err"][v] <= RTOL}
        row["rounds"] += timed_rounds(timed, args.rounds, (name,), (row["flops"], FP8_PEAK, "FP8 peak"))
        res["rows"].append(row)
        save(res, args.out, "fp8_grouped_ab", plot)


if __name__ == "__main__":
    main()
