"""A row's centre and spread over seeds, robust to one seed far out.

Normally the mean and the sample standard deviation. Where the standard deviation exceeds the mean's magnitude
(``sd > |mean|``) one or a few seeds dominate both, and ``mean ± 2 sd`` would hold almost any number: the row is
then *heavy-tailed* and its centre is the median, its spread the normal-consistent median absolute deviation
``1.4826 · median |x_i − median|`` (Hampel, J. Amer. Statist. Assoc. 69, 1974, eq. 4: it estimates the standard
deviation of normal data, so ``median ± 2 · MAD-sd`` reads as ``mean ± 2 sd``).
"""

from __future__ import annotations

import math
import statistics
from typing import NamedTuple

__all__ = ["MAD_TO_SD", "Spread", "heavy_tailed", "of_reference", "of_row", "of_values"]

MAD_TO_SD = 1 / statistics.NormalDist().inv_cdf(0.75)  # 1.4826...: MAD -> sd for normal data


class Spread(NamedTuple):
    """``centre ± spread`` over ``n`` seeds; ``by_median`` when the seeds are heavy-tailed."""

    centre: float
    spread: float
    n: int
    by_median: bool


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def of_values(values: list[float]) -> Spread:
    """Mean and sample sd of ``values``, or their median and MAD-sd where ``sd > |mean|``."""
    if not values:
        raise ValueError("of_values needs at least one value")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return Spread(mean, 0.0, 1, False)
    sd = statistics.stdev(values)
    if sd <= abs(mean):
        return Spread(mean, sd, len(values), False)
    med = statistics.median(values)
    return Spread(med, MAD_TO_SD * statistics.median(abs(v - med) for v in values), len(values), True)


def _recorded(values: list, mean, sd, n: int = 1) -> Spread | None:
    """:func:`of_values` of the numeric ``values``, but the recorded ``mean ± sd`` where the tail is light (the
    numbers the tables print, to the last bit)."""
    values = [v for v in values if v is not None]
    if values and all(_number(v) for v in values):
        s = of_values([float(v) for v in values])
        if s.by_median or not _number(mean) or not _number(sd):
            return s
        return Spread(float(mean), float(sd), s.n, False)
    return Spread(float(mean), float(sd or 0.0), n, False) if _number(mean) else None


def of_row(row: dict) -> Spread | None:
    """Our centre and spread on a row (its ``per_seed``, ``ours``, ``sd``); None where its value is no number."""
    n = row.get("n_seeds") or 1
    return _recorded(row.get("per_seed") or [], row.get("ours"), row.get("sd", 0.0), n)


def of_reference(ref: dict) -> Spread:
    """The reference code's centre and spread on a row (``row["reference"]``: ``values``, ``mean``, ``sd``)."""
    s = _recorded(ref["values"], ref.get("mean"), ref.get("sd"), len(ref["values"]))
    if s is None:
        raise ValueError(f"the reference's values {ref['values']} hold no number")
    return s


def heavy_tailed(row: dict) -> bool:
    """The row's seeds spread wider than its mean: judged by the median (:func:`of_row`)."""
    s = of_row(row)
    return bool(s and s.by_median)
