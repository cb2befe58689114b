"""Results of a reproduction: rows "setting | published | ours", written atomically to ``results/<name>.json``."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from cde_nets.train.snapshots import atomic_write

from .spread import of_row

__all__ = ["SIZES", "row", "result", "write_result", "format_table", "summary", "reference_cell", "save_figure"]

SIZES = ("tiny", "quick", "full")
FILE_MODE = 0o644  # results are for reading by anyone; mkstemp (inside atomic_write) would leave them 0600


def row(setting: str, published: float | str | None, ours: float | str | None, unit: str = "", **extra: Any) -> dict:
    """One table row; ``published`` is ``None`` where the paper gives no number."""
    return {"setting": setting, "published": published, "ours": ours, "unit": unit, **extra}


def result(
    name: str,
    rows: list[dict],
    *,
    size: str,
    seed: int,
    time_s: float,
    settings: dict | None = None,
    notes: list[str] | None = None,
    figures: list[str] | None = None,
    **extra: Any,
) -> dict:
    """The JSON payload of one reproduction; ``extra`` holds its raw measurements (curves, traffic, ...)."""
    return {
        "name": name,
        "size": size,
        "seed": seed,
        "time_s": round(time_s, 2),
        "settings": settings or {},
        "rows": rows,
        "notes": notes or [],
        "figures": figures or [],
        **extra,
    }


def _clean(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if hasattr(obj, "tolist"):
        return _clean(obj.tolist())
    return obj


def write_result(res: dict, out_dir: str | Path) -> Path:
    """Write ``<out_dir>/<name>.json`` atomically (temporary file, fsync, rename), mode 0644."""

    def write(fh) -> None:
        json.dump(_clean(res), fh, indent=2)
        os.fchmod(fh.fileno(), FILE_MODE)  # before the rename, so the file never appears with another mode

    return atomic_write(Path(out_dir) / f"{res['name']}.json", write)


def _fmt(v: Any, unit: str) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        s = f"{v:.4g}" if abs(v) < 1e4 else f"{v:.3e}"
        return f"{s}{(' ' + unit) if unit else ''}"
    return f"{v}{(' ' + unit) if unit and not isinstance(v, str) else ''}"


def seeds_label(res: dict) -> str:
    """``seed 0`` or ``seeds 0–4`` (a result aggregated over seeds carries their list)."""
    seeds = res.get("seeds", [res["seed"]])
    return f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {seeds[0]}–{seeds[-1]}"


def summary(row: dict, digits: int = 4) -> str:
    """``mean ± sd (min–max, n seeds)`` for a row aggregated over several seeds, the plain value otherwise; a
    heavy-tailed row (``sd > |mean|``) adds the median and MAD-sd it is judged by (:mod:`experiments.spread`)."""
    unit = row.get("unit", "")
    if row.get("n_seeds", 1) < 2 or "sd" not in row:
        return _fmt(row["ours"], unit)
    if row["min"] == row["max"]:  # a count or a closed form: every seed gives the same number
        return f"{_fmt(row['min'], unit)} (all {row['n_seeds']} seeds)"  # min: the recorded number, an int stays one
    g = f".{digits}g"
    text = (
        f"{row['ours']:{g}} ± {row['sd']:.2g}{(' ' + unit) if unit else ''} "
        f"({row['min']:{g}}–{row['max']:{g}}, {row['n_seeds']} seeds)"
    )
    gone = row.get("diverged")
    if isinstance(gone, dict) and gone:
        text = text[:-1] + f"; seed{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} diverged)"
    s = of_row(row)
    if s and s.by_median:  # the mean is one far seed's: say so, and what the row is judged by
        text += f"; sd > mean: median {s.centre:{g}} ± {s.spread:.2g} (MAD)"
    return text


def reference_cell(row: dict) -> str:
    """``mean ± sd (n seeds)`` of the reference code's runs on ``row``, ``—`` where it has none."""
    ref = row.get("reference")
    if not ref:
        return "—"
    unit = f" {row['unit']}" if row.get("unit") else ""
    return f"{ref['mean']:.4g} ± {ref['sd']:.2g}{unit} ({len(ref['values'])} seeds)"


def format_table(res: dict) -> str:
    """A markdown table of the rows: ``mean ± sd (min–max)`` where the result is over several seeds, and a
    column for the reference code's runs where a row has them (:func:`reference_cell`)."""
    with_ref = any(r.get("reference") for r in res["rows"])
    lines = [
        f"### {res['name']} ({res['size']}, {seeds_label(res)}, {res['time_s']:.1f} s)",
        "",
        "| setting | published | reference code | ours |" if with_ref else "| setting | published | ours |",
        "|---|---|---|---|" if with_ref else "|---|---|---|",
    ]
    for r in res["rows"]:
        unit = r.get("unit", "")
        ref = f" {reference_cell(r)} |" if with_ref else ""
        lines.append(f"| {r['setting']} | {_fmt(r['published'], unit)} |{ref} {summary(r)} |")
    for n in res.get("notes", []):
        lines.append(f"\n_{n}_")
    return "\n".join(lines)


def save_figure(fig, out_dir: str | Path, name: str) -> str:
    """Save a matplotlib figure as ``<out_dir>/<name>.png`` (atomically, mode 0644); returns the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"

    def write(fh) -> None:
        fig.savefig(fh, format="png", dpi=110, bbox_inches="tight")
        os.fchmod(fh.fileno(), FILE_MODE)

    atomic_write(path, write, binary=True)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(path)
