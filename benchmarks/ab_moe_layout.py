"""The MoE experts' layout (`moe_experts.layout`) side by side: the one-program Triton kernel
(`moe_layout_triton`) against XLA's ops (`layout_ref`), by token count and group size, in alternating rounds
(device time from a profiler trace, `bench_kernels.bench`). What `moe_layout_triton.MAX_PICKS` is chosen by.

python benchmarks/ab_moe_layout.py [--tokens 32,128,256,512,682] [--block-m 16,64,128] [--rounds 3] [--out DIR]
python benchmarks/ab_moe_layout.py --plot DIR/moe_layout_ab.json                      (only the PNG)

V4-Flash's routing (top-6 of 256 experts) under bench_moe's skewed routing. The kernel is taken up to its
`CAPACITY`, past `MAX_PICKS`. Each kernel's layout is checked
against the reference's first (every output equal); a wrong one is recorded and not timed. Writes
moe_layout_ab.json (rewritten after every shape) and its PNG under --out: microseconds by picks, a line for each
impl and group size.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import numpy as np  # noqa: E402
from ab_plot import save, side_by_side_args, timed_rounds  # noqa: E402

E, K = 256, 6  # V4-Flash's routing
IMPL = "triton"  # the kernel's impl ("interpret" runs this script's flow on a CPU)


def variants(e: int, block_m: int) -> dict:
    """name -> the layout of a pick table at group size block_m: the kernel (up to its CAPACITY, whatever
    MAX_PICKS says) or XLA's."""
    from djax.kernels.moe_experts import layout, layout_ref

    def kernel(idx):
        from djax.kernels import moe_layout_triton

        before = moe_layout_triton.MAX_PICKS
        moe_layout_triton.MAX_PICKS = moe_layout_triton.CAPACITY  # while traced
        try:
            return layout(idx, e, block_m, IMPL)
        finally:
            moe_layout_triton.MAX_PICKS = before

    return {"kernel": kernel, "xla": lambda idx: layout_ref(idx, e, block_m)}


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for bm in sorted({row["block_m"] for row in result["rows"]}):
        rows = sorted((r for r in result["rows"] if r["block_m"] == bm), key=lambda r: r["picks"])
        for name, style in (("kernel", "-o"), ("xla", "--s")):
            pts = [(r["picks"], min(t[name] for t in r["rounds"])) for r in rows if name in r["rounds"][0]]
            if pts:
                ax.plot(*zip(*pts), style, label=f"{name}, {bm}-row groups")
    ax.set_xlabel("picks (tokens x 6)")
    ax.set_ylabel("device us per layout (best round)")
    ax.set_title(
        f"MoE layout: one Triton program against XLA's ops, {result['device']}, {result['date'][:10]}"
    )
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="32,128,256,512,682")
    p.add_argument("--block-m", default="16,64,128")
    args = side_by_side_args(p, 3, plot)
    if args is None:
        return
    from bench_moe import _routing

    os.makedirs(args.out, exist_ok=True)
    res = dict(device=jax.devices()[0].device_kind, date=time.strftime("%Y-%m-%d %H:%M:%S"), rows=[])
    for n in [int(t) for t in args.tokens.split(",")]:
        sets = [(_routing(jax.random.key(s), n, E, K)[1],) for s in range(8)]
        for bm in [int(b) for b in args.block_m.split(",")]:
            row = dict(tokens=n, picks=n * K, block_m=bm, equal={}, rounds=[], kernels={})
            fns = variants(E, bm)
            want = [np.asarray(a) for a in jax.jit(fns["xla"])(*sets[0])]
            timed = {"xla": (fns["xla"], sets)}  # the reference
            for name, fn in fns.items():
                if name == "xla":
                    continue
                try:
                    got = [np.asarray(a) for a in jax.jit(fn)(*sets[0])]
                    row["equal"][name] = ok = all(np.array_equal(g, w) for g, w in zip(got, want))
                except Exception as e:  # noqa: BLE001 - a kernel that does not build is recorded, not timed
                    row["equal"][name] = ok = False
                    print(n, bm, name, "failed:", repr(e)[:300], flush=True)
                if ok:
                    timed[name] = (fn, sets)
            row["rounds"] += timed_rounds(
                timed, args.rounds, (n * K, "picks", bm, "rows"), (), row["kernels"]
            )
            res["rows"].append(row)
            save(res, args.out, "moe_layout_ab", plot)


if __name__ == "__main__":
    main()
