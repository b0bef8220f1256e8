"""Statistics of an evaluation: intervals over tasks, pass@k, pass^k, paired tests.

Every interval resamples *tasks*, the unit a benchmark samples: with K attempts per task
the attempts of one task are averaged first, so the bootstrap (and the standard error) is
clustered by task and K attempts never pass for K times the evidence. Where every task
failed (or every task succeeded) resampling shows no uncertainty at all, so the interval
is the exact (Clopper-Pearson) binomial one over the tasks instead. The resampling and
the exact tests are scipy's (:func:`scipy.stats.bootstrap`, :func:`scipy.stats.binomtest`);
``tests/evaluation/test_stats.py`` checks the intervals' coverage on synthetic data with
a known mean.

* :func:`task_means`: per-task means of per-attempt values;
* :func:`mean_interval`: mean over tasks, its clustered standard error and a bootstrap
  percentile interval;
* :func:`pass_at_k` / :func:`pass_hat_k`: the unbiased pass@k of Chen et al.
  ("Evaluating Large Language Models Trained on Code") and pass^k (all k of k succeed,
  from "tau-bench"), from n attempts with c successes;
* :func:`paired_difference`: the mean per-task difference of two runs on the tasks both
  ran, with its interval;
* :func:`mcnemar_exact`: the exact McNemar test on discordant pairs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "CONFIDENCE",
    "Interval",
    "mcnemar_exact",
    "mean_interval",
    "paired_difference",
    "pass_at_k",
    "pass_hat_k",
    "task_means",
]

#: Two-sided confidence of every interval in a report.
CONFIDENCE = 0.95
#: Bootstrap resamples (the interval's Monte Carlo error is far below its width at this).
RESAMPLES = 4000


@dataclasses.dataclass(frozen=True)
class Interval:
    """A mean over tasks with its uncertainty.

    Attributes:
        mean: Mean over tasks of each task's mean over its attempts.
        low: Lower end of the bootstrap percentile interval.
        high: Upper end.
        se: Standard error, clustered by task (the standard deviation of the task means
            over the square root of their number).
        tasks: Tasks it averages over.
        confidence: Two-sided level of ``[low, high]``.
    """

    mean: float
    low: float
    high: float
    se: float
    tasks: int
    confidence: float = CONFIDENCE

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return dataclasses.asdict(self)

    def format(self, scale: float = 1.0, digits: int = 3) -> str:
        """``0.412 [0.371, 0.455]`` (values times ``scale``)."""
        f = f"{{:.{digits}f}}"
        return (
            f"{f.format(self.mean * scale)} "
            f"[{f.format(self.low * scale)}, {f.format(self.high * scale)}]"
        )


def task_means(values: Iterable[tuple[Hashable, float]]) -> dict[Hashable, float]:
    """``{task: mean of its attempts}`` from ``(task, value)`` pairs."""
    sums: dict[Hashable, list[float]] = {}
    for task, value in values:
        sums.setdefault(task, []).append(float(value))
    return {t: float(np.mean(v)) for t, v in sums.items()}


def _percentile_bootstrap(
    x: np.ndarray, confidence: float, seed: int, rate: bool
) -> tuple[float, float]:
    from scipy import stats

    if x.size < 2 or np.all(x == x[0]):
        if rate and x[0] in (0.0, 1.0):
            # every task failed (or succeeded): resampling cannot show the uncertainty, the
            # exact binomial interval over the tasks can (0 of 140 is not a rate of 0)
            ci = stats.binomtest(int(x[0]) * x.size, x.size).proportion_ci(
                confidence, method="exact"
            )
            return float(ci.low), float(ci.high)
        return float(x.mean()), float(x.mean())  # no spread in a non-binary value
    res = stats.bootstrap(
        (x,),
        np.mean,
        confidence_level=confidence,
        n_resamples=RESAMPLES,
        method="percentile",
        vectorized=True,
        rng=np.random.default_rng(seed),
    )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def mean_interval(
    per_task: Mapping[Hashable, float] | Sequence[float],
    *,
    confidence: float = CONFIDENCE,
    seed: int = 0,
    rate: bool = False,
) -> Interval:
    """The mean over tasks with a bootstrap interval and a clustered standard error.

    Args:
        per_task: Each task's value (its mean over attempts: :func:`task_means`).
        confidence: Two-sided level.
        seed: The bootstrap's seed (the same data give the same interval).
        rate: The values are success rates in [0, 1]: when every task failed (or every
            task succeeded) the interval is the exact binomial one over the tasks.
    """
    x = np.asarray(list(per_task.values()) if isinstance(per_task, Mapping) else per_task, float)
    if x.size == 0:
        raise ValueError("no tasks to average: the run has no finished episode")
    if not np.all(np.isfinite(x)):
        raise ValueError("a task's value is not finite; check the episodes' rewards")
    se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else float("nan")
    low, high = _percentile_bootstrap(x, confidence, seed, rate)
    return Interval(float(x.mean()), low, high, se, int(x.size), confidence)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` attempts with ``c`` successes: ``1 - C(n-c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    # the product form of C(n-c, k) / C(n, k): no huge binomials
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_hat_k(n: int, c: int, k: int) -> float:
    """Unbiased pass^k (all of k attempts succeed) from ``n`` attempts: ``C(c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass^k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    return float(math.comb(c, k) / math.comb(n, k))


def paired_difference(
    a: Mapping[Hashable, float],
    b: Mapping[Hashable, float],
    *,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> Interval:
    """Mean of ``a[t] - b[t]`` over the tasks both have, with its interval.

    Pairing removes the variance the two runs share through the tasks (a hard task is
    hard for both), so the interval is narrower than the one of two independent means.
    """
    shared = sorted(set(a) & set(b), key=repr)
    if not shared:
        raise ValueError("the two runs share no task: nothing to pair")
    return mean_interval([a[t] - b[t] for t in shared], confidence=confidence, seed=seed)


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value from the discordant pairs.

    Args:
        only_a: Pairs where A succeeded and B failed.
        only_b: Pairs where B succeeded and A failed.
    """
    from scipy import stats

    if only_a < 0 or only_b < 0:
        raise ValueError("discordant counts are never negative")
    if only_a + only_b == 0:
        return 1.0
    return float(stats.binomtest(only_a, only_a + only_b, 0.5).pvalue)
