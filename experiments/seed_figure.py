"""One figure per reproduction table: our mean over seeds as bars with ± 1 sd error bars, the reference code's
runs beside them where they exist, the published numbers as markers."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plotted_rows", "seed_figure"]


def plotted_rows(res: dict) -> list[dict]:
    """The rows a figure shows: accuracies (unit %) with a published number and a numeric result."""
    return [
        r
        for r in res["rows"]
        if r.get("unit") == "%" and isinstance(r.get("published"), (int, float)) and isinstance(r["ours"], (int, float))
    ]


def seed_figure(res: dict, path: str | Path) -> Path | None:
    """Write the figure of ``res`` (a result, reference runs attached) to ``path``; None if no row qualifies."""
    rows = plotted_rows(res)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    x = np.arange(len(rows))
    with_ref = any(r.get("reference") for r in rows)
    width = 0.4 if with_ref else 0.6
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(rows) + 2), 4.2))
    ours_x = x + width / 2 if with_ref else x
    ax.bar(ours_x, [r["ours"] for r in rows], width, yerr=[r.get("sd", 0.0) for r in rows], capsize=3, label="ours")
    if with_ref:
        ref = [r.get("reference") or {} for r in rows]
        ax.bar(
            x - width / 2,
            [e.get("mean", np.nan) for e in ref],
            width,
            yerr=[e.get("sd", 0.0) for e in ref],
            capsize=3,
            hatch="//",
            alpha=0.6,
            label="reference code",
        )
    ax.plot(x, [r["published"] for r in rows], "k_", markersize=16, markeredgewidth=2, label="published")
    ax.set_xticks(x, [r["setting"].replace(" (test)", "") for r in rows], rotation=60, ha="right", fontsize=7)
    seeds = res.get("seeds", [res["seed"]])
    ax.set(ylabel="test accuracy (%)", title=f"{res['name']}: mean ± sd over {len(seeds)} seed(s)")
    lo = min(min(r["ours"] - r.get("sd", 0.0) for r in rows), min(r["published"] for r in rows))
    ax.set_ylim(max(0.0, lo - 5), 101)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return path
