"""The summary table of a benchmark run: one row per headline number, with its goal and whether a full run met it.

A tiny run exercises every benchmark at its smallest size in seconds: its timings are noise, so its table says so
in its header and shows no goals. A value that could not be measured (nan, a clock reading of zero, a peer
package missing) reads "not measured", never ``nan`` or ``0.00``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Row", "at_least", "at_most", "below", "info", "table", "value_text"]

NOT_MEASURED = "not measured"


@dataclass(frozen=True)
class Row:
    """One headline: ``value`` (a number, a flag or a text), how to print it, its goal and whether it is met."""

    measure: str
    value: float | int | bool | str | None
    fmt: str = ".3f"
    goal: str = ""  # empty: reported for information, no goal
    met: bool | None = None  # None where there is no goal or no measurement


def value_text(value: float | int | bool | str | None, fmt: str) -> str:
    """``value`` printed with ``fmt``; "not measured" for None, nan, inf, and ratios that print as zero (a time
    ratio whose clock read nothing)."""
    if value is None:
        return NOT_MEASURED
    if isinstance(value, (bool, str)):
        return str(value)
    if not math.isfinite(value):
        return NOT_MEASURED
    text = format(value, fmt)
    if fmt.endswith("f") and not any(c in "123456789" for c in text):
        return NOT_MEASURED
    return text


def _measured(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _bound(bound: float, fmt: str) -> str:
    return format(bound, ".0%") if fmt.endswith("%") else format(bound, "g")


def _judge(value: float | None, fmt: str, holds: bool) -> bool | None:
    return holds if _measured(value) and value_text(value, fmt) != NOT_MEASURED else None


def at_most(measure: str, value: float | None, bound: float, fmt: str = ".3f") -> Row:
    return Row(measure, value, fmt, f"<= {_bound(bound, fmt)}", _judge(value, fmt, _measured(value) and value <= bound))  # type: ignore[operator]


def below(measure: str, value: float | None, bound: float, fmt: str = ".3f") -> Row:
    return Row(measure, value, fmt, f"< {_bound(bound, fmt)}", _judge(value, fmt, _measured(value) and value < bound))  # type: ignore[operator]


def at_least(measure: str, value: float | None, bound: float, fmt: str = ".3f") -> Row:
    return Row(measure, value, fmt, f">= {_bound(bound, fmt)}", _judge(value, fmt, _measured(value) and value >= bound))  # type: ignore[operator]


def info(measure: str, value: float | int | bool | str | None, fmt: str = ".3f") -> Row:
    return Row(measure, value, fmt)


def table(rows: list[tuple[str, Row]], tiny: bool) -> str:
    """Markdown table of ``(benchmark, row)``; tiny: a header saying what it checks, and no goal column."""
    if tiny:
        lines = [
            "tiny run: every benchmark ran at its smallest size to check that it works; the figures are not "
            "speed or memory measurements and no goal applies (run without --tiny to measure).",
            "",
            "| benchmark | measure | value |",
            "|---|---|---|",
        ]
        lines += [f"| {name} | {r.measure} | {value_text(r.value, r.fmt)} |" for name, r in rows]
        return "\n".join(lines)
    lines = ["| benchmark | measure | value | goal | met |", "|---|---|---|---|---|"]
    for name, r in rows:
        met = "" if r.met is None else ("met" if r.met else "MISSED")
        lines.append(f"| {name} | {r.measure} | {value_text(r.value, r.fmt)} | {r.goal or '—'} | {met} |")
    judged = [r.met for _, r in rows if r.met is not None]
    lines += ["", f"goals met: {sum(judged)} of {len(judged)} (— : reported for information)"]
    return "\n".join(lines)
