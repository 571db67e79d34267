"""What the side-by-side scripts (`ab_fp8_tilings.py`, `ab_attn_tilings.py`, `ab_fp8_grouped.py`, ...) share:
their options, the rounds of timings, and the picture: one panel per shape, per variant a bar at the median of its
rounds and a dot per round, as a fraction of a ceiling (the axis starts near the slowest round: the
differences are a few per cent), the median's microseconds beside it."""

import json
import os

import numpy as np


def side_by_side_args(p, rounds: int, plot=None):
    """Adds the options every side-by-side script takes to the parser `p` (--rounds, --out, --build and, with
    a `plot(result, path)`, --plot) and parses. With --plot it only draws that earlier run's PNG beside its
    JSON and returns None."""
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    p.add_argument("--build", action="store_true", help="lower and compile only")
    if plot is not None:
        p.add_argument("--plot", metavar="JSON", help="only draw the PNG of an earlier run's JSON, beside it")
    args = p.parse_args()
    if plot is not None and args.plot:
        with open(args.plot) as f:
            plot(json.load(f), args.plot.removesuffix(".json") + ".png")
        return None
    return args


def one_round(timed: dict, rnd: int, kernels: dict | None = None) -> dict:
    """Device microseconds per call of each entry of `timed` (name -> (fn, input sets);
    `bench_kernels.bench`) in round `rnd`, which starts with entry rnd mod len, so that no variant is always
    timed first (or last). With a `kernels` dict, each entry's largest kernels this round are appended to
    kernels[name]."""
    from bench_kernels import bench

    names = list(timed)
    start = rnd % len(names) if names else 0
    times = {}
    for name in names[start:] + names[:start]:
        fn, sets = timed[name]
        wall, dev, top = bench(fn, sets, trace=True)
        times[name] = round((dev or wall) * 1e6, 2)
        if kernels is not None:
            kernels.setdefault(name, []).append(top)
    return times


def timed_rounds(timed: dict, rounds: int, label: tuple, share: tuple = (), kernels: dict | None = None):
    """Yields the times of `rounds` rounds of `one_round` over `timed`, printing each after `label` and, given
    `share` = (work per call, ceiling per second, its name), e.g. (bytes, copy bandwidth, "copy"), each
    variant's fraction of that ceiling."""
    for rnd in range(rounds):
        times = one_round(timed, rnd, kernels)
        shares = ()
        if share:
            work, ceiling, of = share
            shares = (f"of {of}", {n: round(work / (us * 1e-6) / ceiling, 4) for n, us in times.items()})
        print(*label, "round", rnd, times, *shares, flush=True)
        yield times


def save(result: dict, out: str, stem: str, plot) -> None:
    """Writes `result` as out/stem.json and its picture, `plot(result, path)`, as out/stem.png."""
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(out, stem + ".png"))


def plot_rounds(panels, default: str, target: float, suptitle: str, path: str) -> None:
    """panels: (title, ratio, rounds) per shape, `ratio` mapping microseconds to the fraction of the ceiling,
    `rounds` a list of {variant: microseconds}; `default` is drawn grey, `target` as a red line. Skipped where
    matplotlib is missing or nothing was timed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = [p for p in panels if p[2]]
    if not panels:
        return
    names = [list(dict.fromkeys(n for rd in rounds for n in rd)) for _, _, rounds in panels]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(8, 0.3 * sum(map(len, names)) + 1.1 * len(panels)), squeeze=False
    )
    for ax, (title, ratio, rounds), order in zip(axes[:, 0], panels, names, strict=True):
        for i, name in enumerate(order):
            times = [rd[name] for rd in rounds if name in rd]
            median = float(np.median(times))
            ax.barh(i, ratio(median), color="grey" if name == default else "C0")
            ax.plot([ratio(t) for t in times], [i] * len(times), "k.", markersize=3)
            ax.text(ratio(min(times)), i, f"  {median:.2f} us", va="center", fontsize=6)  # right of the dots
        ax.set_yticks(range(len(order)), order, fontsize=6)
        ax.invert_yaxis()
        ax.axvline(target, color="C3", linewidth=0.8)
        lows = [ratio(max(rd.values())) for rd in rounds]
        ax.set_xlim(left=max(0.0, np.floor(min(lows) * 0.9 / 0.05) * 0.05))
        ax.set_title(title, fontsize=8)
    fig.suptitle(suptitle, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
