"""The side-by-side scripts' picture (`ab_fp8_tilings.py`, `ab_attn_tilings.py`, `ab_fp8_grouped.py`): one
panel per shape, per variant a bar at the median of its rounds and a dot per round, as a fraction of a ceiling
(the axis starts near the slowest round: the differences are a few per cent), the median's microseconds beside
it."""

import numpy as np


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
