"""A row's centre and spread over seeds, robust to one seed far out, and the band where a seed's value falls.

Normally the mean and the sample standard deviation. Where the standard deviation exceeds the mean's magnitude
(``sd > |mean|``) one or a few seeds dominate both, and ``mean ± 2 sd`` would hold almost any number: the row is
then *heavy-tailed* and its centre is the median, its spread the normal-consistent median absolute deviation
``1.4826 · median |x_i − median|`` (Hampel, J. Amer. Statist. Assoc. 69, 1974, eq. 4: it estimates the standard
deviation of normal data, so ``median ± 2 · MAD-sd`` reads as ``mean ± 2 sd``).

The band (:class:`Band`) is ``centre ± 2 spread``: where a seed's number falls, which is what a published number
from one run is compared with. An accuracy lives in ``[0, 100]`` and piles up against 100, where ``mean ± 2 sd``
runs past the bound (``95.58 ± 6.9`` gave ``[81.8, 109.3]``). A seed's test accuracy is a binomial proportion
``p``, whose standard deviation ``√(p(1 − p)/N)`` shrinks towards the bounds; on the angular scale
``φ = arcsin √p`` it is ``1/(2√N)`` whatever ``p`` (the variance-stabilising transformation of a proportion:
Bartlett 1947, "The use of transformations", Biometrics 3, §4; Anscombe 1948, Biometrika 35). So for an accuracy
the band is taken there,

    ``mean(φ_i) ± 2 sd(φ_i)``, cut to ``[0, π/2]`` and mapped back by ``p = sin² φ``,

the same two-sd band of the seeds (every one of up to five seeds lies inside it, as in the linear band), but
inside ``[0, 100]`` and as skewed away from the bound as the accuracies themselves. Unlike the logit, the angle is
finite at 0 and 100 %, so a seed at exactly 100 % needs no fudge; the band reaches 100 % when a seed does.
"""

from __future__ import annotations

import math
import statistics
from typing import NamedTuple

__all__ = [
    "MAD_TO_SD",
    "Band",
    "Spread",
    "band",
    "heavy_tailed",
    "linear_band",
    "of_reference",
    "of_row",
    "of_values",
    "reference_band",
]

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


def _angle(percent: float) -> float:
    """``arcsin √p`` of an accuracy in percent (``p = percent / 100``), in ``[0, π/2]``."""
    return math.asin(math.sqrt(min(max(percent / 100.0, 0.0), 1.0)))


def _percent(angle: float) -> float:
    return 100.0 * math.sin(angle) ** 2


class Band(NamedTuple):
    """Where a seed's number falls: ``[low, high]`` on the band's own scale (the angle ``arcsin √p`` for an
    accuracy, see the module's text), compared there with a bound."""

    low: float
    high: float
    angular: bool

    @property
    def interval(self) -> tuple[float, float]:
        """The band in the row's own unit."""
        return (_percent(self.low), _percent(self.high)) if self.angular else (self.low, self.high)

    def _scaled(self, x: float) -> float:
        return _angle(x) if self.angular else x

    def reaches(self, op: str, bound: float) -> bool:
        """Whether some part of the band lies on the side ``op`` (``">="`` or ``"<="``) of ``bound``."""
        if op == ">=":
            return self.high >= self._scaled(bound)
        if op == "<=":
            return self.low <= self._scaled(bound)
        raise ValueError(f"`op` must be '>=' or '<=', got {op!r}")

    def holds(self, x: float) -> bool:
        """Whether ``x`` lies within the band."""
        return self.low <= self._scaled(x) <= self.high


def linear_band(s: Spread) -> Band:
    """``centre ± 2 spread``."""
    return Band(s.centre - 2 * s.spread, s.centre + 2 * s.spread, False)


def _angular_band(values: list[float]) -> Band:
    """``mean ± 2 sd`` of the accuracies' angles ``arcsin √p``, cut to ``[0, π/2]``."""
    angles = [_angle(v) for v in values]
    mean = statistics.fmean(angles)
    sd = statistics.stdev(angles) if len(angles) > 1 else 0.0
    return Band(max(mean - 2 * sd, 0.0), min(mean + 2 * sd, math.pi / 2), True)


def _band(values: list, s: Spread, percent: bool, what: str) -> Band:
    if not percent:
        return linear_band(s)
    numbers = [float(v) for v in values if _number(v)]
    if len(numbers) >= 2:
        return _angular_band(numbers)
    if s.spread > 0:
        raise ValueError(
            f"{what}: an accuracy's band is taken on the seeds' angles arcsin √p, but only its mean ± sd is given; "
            "give the per-seed values (`per_seed`)."
        )
    return _angular_band([s.centre])


def band(row: dict) -> Band | None:
    """The band of our seeds on ``row`` (:class:`Band`; on the angular scale for an accuracy, ``unit`` ``"%"``); None
    where its value is no number."""
    s = of_row(row)
    if s is None:
        return None
    return _band(row.get("per_seed") or [], s, row.get("unit") == "%", f"row {row.get('setting')!r}")


def reference_band(ref: dict, percent: bool) -> Band:
    """The band of the reference code's runs (``row["reference"]``), on the angular scale for an accuracy."""
    return _band(ref["values"], of_reference(ref), percent, "the reference code's runs")
