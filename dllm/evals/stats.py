"""Intervals and significance for quality figures (scipy).

Evaluations here use 20-100 examples per task, where a few samples move a score by points; every reported
quality figure carries a 95 % interval, and comparisons of two methods on the same examples say whether the
difference is significant:

* :func:`proportion_ci` — Wilson score interval of an accuracy ``k / n`` (``scipy.stats.binomtest``).
* :func:`mean_ci` — interval of a mean score: Wilson when every score is 0 or 1, else a percentile bootstrap
  (``scipy.stats.bootstrap``, fixed seed).
* :func:`paired_test` — two methods scored on the same examples: the mean difference, its bootstrap interval
  and the two-sided p-value of a paired sign-flip permutation test (``scipy.stats.permutation_test``).
* :func:`bootstrap_indices` — resampled example indices (fixed seed), for figures computed from many examples
  at once (ParallelBench's AUP and PBx: ``dllm.evals.parallelbench.report``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats

LEVEL = 0.95
RESAMPLES = 2000
SEED = 0

__all__ = ["LEVEL", "RESAMPLES", "SEED", "bootstrap_indices", "fmt_ci", "mean_ci", "paired_test", "percentile_ci",
           "proportion_ci"]


def proportion_ci(k: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """Wilson score interval of the proportion ``k / n`` (fractions in [0, 1]); ``(nan, nan)`` when ``n = 0``."""
    if n <= 0:
        return math.nan, math.nan
    if not 0 <= k <= n:
        raise ValueError(f"k={k} must be between 0 and n={n}")
    ci = stats.binomtest(int(k), int(n)).proportion_ci(confidence_level=level, method="wilson")
    return float(ci.low), float(ci.high)


def _binary(x: np.ndarray) -> bool:
    return bool(np.all((x == 0) | (x == 1)))


def mean_ci(values: Sequence[float], level: float = LEVEL, *, resamples: int = RESAMPLES,
            seed: int = SEED) -> tuple[float, float]:
    """Interval of the mean of ``values``: Wilson for 0/1 scores, else a percentile bootstrap. One value (or
    identical values) gives a zero-width bootstrap interval; no values ``(nan, nan)``."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return math.nan, math.nan
    if _binary(x):
        return proportion_ci(int(x.sum()), x.size, level)
    if x.size == 1 or np.all(x == x[0]):
        return float(x[0]), float(x[0])
    res = stats.bootstrap((x,), np.mean, confidence_level=level, n_resamples=resamples, method="percentile",
                          random_state=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def paired_test(a: Sequence[float], b: Sequence[float], level: float = LEVEL, *, resamples: int = RESAMPLES,
                seed: int = SEED) -> dict:
    """``a`` and ``b``: the scores of two methods on the same examples, in the same order. Returns ``diff``
    (mean of ``a - b``), ``low`` / ``high`` (its percentile-bootstrap interval), ``p`` (two-sided, paired
    sign-flip permutation test of a zero mean difference; 1.0 when every pair is equal) and ``n``."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"paired scores need two sequences of one length, got {x.shape} and {y.shape}")
    d = x - y
    if d.size == 0:
        return {"diff": math.nan, "low": math.nan, "high": math.nan, "p": math.nan, "n": 0}
    if np.all(d == d[0]):
        return {"diff": float(d[0]), "low": float(d[0]), "high": float(d[0]), "p": 1.0 if d[0] == 0 else 0.0,
                "n": int(d.size)}
    rng = np.random.default_rng(seed)
    boot = stats.bootstrap((d,), np.mean, confidence_level=level, n_resamples=resamples, method="percentile",
                           random_state=rng)
    perm = stats.permutation_test((d,), np.mean, permutation_type="samples", n_resamples=resamples,
                                  alternative="two-sided", random_state=rng)
    return {"diff": float(d.mean()), "low": float(boot.confidence_interval.low),
            "high": float(boot.confidence_interval.high), "p": float(perm.pvalue), "n": int(d.size)}


def bootstrap_indices(n: int, resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """``[resamples, n]`` indices drawn with replacement from ``range(n)`` (fixed seed)."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def percentile_ci(draws: Sequence[float], level: float = LEVEL) -> tuple[float, float]:
    """The central ``level`` interval of bootstrap ``draws`` (NaN draws, e.g. a PBx no resample reaches, are
    ignored; all NaN: ``(nan, nan)``)."""
    x = np.asarray(draws, dtype=float)
    x = x[~np.isnan(x)]
    if x.size == 0:
        return math.nan, math.nan
    lo, hi = np.quantile(x, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def fmt_ci(lo: float, hi: float, digits: int = 1, scale: float = 1.0) -> str:
    """``"[lo, hi]"`` (``scale``: e.g. 100 for percent); ``"-"`` for an undefined interval."""
    if math.isnan(lo) or math.isnan(hi):
        return "-"
    return f"[{lo * scale:.{digits}f}, {hi * scale:.{digits}f}]"
