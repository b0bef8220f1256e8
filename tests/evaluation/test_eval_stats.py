"""The evaluation's statistics: intervals cover a known mean at their nominal rate."""

import itertools
import math

import numpy as np
import pytest
from scipy import stats as sps

from branchgym.evaluation.stats import (
    mcnemar_exact,
    mean_interval,
    paired_difference,
    pass_at_k,
    pass_hat_k,
    task_means,
)


def _coverage(draw, truth, reps, seed=0):
    rng = np.random.default_rng(seed)
    hits = 0
    for r in range(reps):
        iv = mean_interval(draw(rng), seed=r)
        hits += iv.low <= truth <= iv.high
    return hits / reps


def test_interval_covers_a_known_success_rate_at_its_nominal_rate():
    """Bernoulli(0.3) successes on 120 tasks, 300 synthetic runs: about 95 % cover 0.3."""
    cov = _coverage(lambda rng: rng.random(120) < 0.3, 0.3, reps=300)
    # 300 runs: the coverage's own standard error is about 0.013
    assert 0.91 <= cov <= 0.985, cov


def test_clustered_interval_covers_when_tasks_differ_and_attempts_repeat():
    """K = 4 attempts per task whose success rates spread (Beta(1, 2), mean 1/3).

    Treating the 400 attempts as independent would understate the uncertainty; the task
    means (clustering by task) keep the coverage nominal.
    """

    def draw(rng):
        p = rng.beta(1.0, 2.0, size=100)
        pairs = [(t, float(rng.random() < p[t])) for t in range(100) for _ in range(4)]
        return task_means(pairs)

    cov = _coverage(draw, 1 / 3, reps=300, seed=1)
    assert 0.91 <= cov <= 0.985, cov
    # the naive interval over attempts is narrower than the clustered one
    rng = np.random.default_rng(5)
    p = rng.beta(1.0, 2.0, size=100)
    flat = [float(rng.random() < p[t]) for t in range(100) for _ in range(4)]
    clustered = mean_interval(task_means((i // 4, v) for i, v in enumerate(flat)))
    naive = mean_interval(flat)
    assert naive.high - naive.low < clustered.high - clustered.low


def test_constant_values_and_bad_values():
    """All tasks failed: not a rate of exactly 0, but the exact binomial interval."""
    assert mean_interval([0.0] * 140).high == 0.0  # not a rate (a difference, a score)
    iv = mean_interval([0.0] * 140, rate=True)
    assert iv.mean == 0.0 and iv.low == 0.0
    assert iv.high == pytest.approx(sps.binomtest(0, 140).proportion_ci(0.95, "exact").high)
    assert 0.02 < iv.high < 0.03
    iv = mean_interval([1.0] * 20, rate=True)
    assert iv.high == 1.0 and iv.low == pytest.approx(0.8316, abs=1e-3)
    iv = mean_interval([0.5] * 10, rate=True)  # a constant rate short of 0 or 1: the point
    assert (iv.mean, iv.low, iv.high, iv.se) == (0.5, 0.5, 0.5, 0.0)
    with pytest.raises(ValueError, match="no tasks"):
        mean_interval([])
    with pytest.raises(ValueError, match="not finite"):
        mean_interval([0.0, float("nan")])


@pytest.mark.parametrize(("n", "c"), [(5, 0), (5, 2), (5, 5), (6, 3)])
def test_pass_at_k_and_pass_hat_k_equal_their_definitions_over_subsets(n, c):
    """pass@k = P(some of k attempts drawn without replacement succeeds); pass^k = P(all)."""
    outcomes = [1] * c + [0] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(outcomes, k))
        assert pass_at_k(n, c, k) == pytest.approx(np.mean([any(s) for s in subsets]))
        assert pass_hat_k(n, c, k) == pytest.approx(np.mean([all(s) for s in subsets]))
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_mcnemar_is_scipys_exact_binomial_test_on_discordant_pairs():
    assert mcnemar_exact(9, 1) == pytest.approx(sps.binomtest(9, 10, 0.5).pvalue)
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(3, 3) == pytest.approx(1.0)


def test_pairing_narrows_the_interval_of_a_difference():
    """Two agents on the same 200 tasks whose difficulty varies: pairing removes it."""
    rng = np.random.default_rng(2)
    difficulty = rng.random(200)
    a = {t: float(rng.random() < 0.9 * difficulty[t] + 0.05) for t in range(200)}
    b = {t: float(rng.random() < 0.9 * difficulty[t]) for t in range(200)}
    paired = paired_difference(a, b)
    ia, ib = mean_interval(a), mean_interval(b)
    independent_se = math.hypot(ia.se, ib.se)
    assert paired.se < independent_se
    assert paired.mean == pytest.approx(ia.mean - ib.mean)
    with pytest.raises(ValueError, match="share no task"):
        paired_difference({1: 1.0}, {2: 1.0})
