"""The two-sample permutation test behind the distributional fidelity mode.

:func:`permutation_test` compares two sets of continuations (sequences of step tuples)
by the largest distance over their features (total variation for discrete features,
Kolmogorov-Smirnov for float ones) and returns a permutation p-value, which is
super-uniform under the null hypothesis: ``P(p <= a) <= a``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from branchgym.digest import stable_hash
from branchgym.error import (
    FidelitySetupError,
)

__all__ = [
    "PermutationResult",
    "permutation_test",
]


@dataclasses.dataclass(frozen=True)
class PermutationResult:
    """Outcome of :func:`permutation_test`."""

    p_value: float
    statistic: float
    feature: str
    summary_a: str
    summary_b: str


def _category(v: Any) -> str:
    try:
        return stable_hash(v)
    except TypeError:
        return repr(v)


def _features(samples: Sequence[Sequence[tuple[Any, ...]]]) -> list[tuple[str, str, list[Any]]]:
    """Per-step features of continuations: (name, 'num' | 'cat', one value per sample)."""
    horizon = max((len(s) for s in samples), default=0)
    out: list[tuple[str, str, list[Any]]] = []
    names = ("obs", "reward", "terminated", "truncated", "info")
    for j in range(horizon):
        for f, name in enumerate(names):
            vals = [s[j][f] if j < len(s) else _ENDED for s in samples]
            present = [v for v in vals if v is not _ENDED]
            label = f"step {j + 1} {name}"
            if present and all(isinstance(v, float | np.floating) for v in present):
                out.append((label, "num", vals))
            elif (
                present
                and all(isinstance(v, np.ndarray) for v in present)
                and np.issubdtype(np.asarray(present[0]).dtype, np.floating)
                and len({np.shape(v) for v in present}) == 1
                and np.size(present[0]) <= 16
            ):
                for c in range(int(np.size(present[0]))):
                    comp = [np.ravel(v)[c] if v is not _ENDED else _ENDED for v in vals]
                    out.append((f"{label}[{c}]", "num", comp))
            else:
                out.append((label, "cat", vals))
    return out


class _Ended:
    def __repr__(self) -> str:
        return "<episode ended>"


_ENDED = _Ended()


def _tv_distance(member: np.ndarray, codes: np.ndarray, na: int, nb: int) -> np.ndarray:
    onehot = np.zeros((codes.size, int(codes.max()) + 1))
    onehot[np.arange(codes.size), codes] = 1.0
    counts_a = member.astype(float) @ onehot
    counts_b = onehot.sum(axis=0) - counts_a
    return 0.5 * np.abs(counts_a / na - counts_b / nb).sum(axis=1)


def _ks_distance(member: np.ndarray, values: np.ndarray, na: int, nb: int) -> np.ndarray:
    order = np.argsort(values, kind="stable")
    v = values[order]
    last = np.flatnonzero(np.r_[v[1:] != v[:-1], True])  # ECDFs jump after each tie group
    cum_a = np.cumsum(member[:, order], axis=1)[:, last].astype(float)
    cum_b = (last + 1)[None, :] - cum_a
    return np.abs(cum_a / na - cum_b / nb).max(axis=1)


def _describe(kind: str, vals: Sequence[Any]) -> str:
    if kind == "num":
        x = np.array([v for v in vals if v is not _ENDED], dtype=float)
        ended = sum(v is _ENDED for v in vals)
        tail = f", {ended} ended" if ended else ""
        if x.size == 0:
            return f"all {ended} ended"
        return f"mean {x.mean():.4g}, sd {x.std():.3g}, {np.unique(x).size} distinct{tail}"
    counts: dict[str, tuple[int, Any]] = {}
    for v in vals:
        k = _category(v) if v is not _ENDED else "<ended>"
        n, rep = counts.get(k, (0, v))
        counts[k] = (n + 1, rep)
    top = sorted(counts.values(), key=lambda t: -t[0])[:3]
    parts = [f"{n}x {repr(rep)[:40]}" for n, rep in top]
    more = f" +{len(counts) - 3} more" if len(counts) > 3 else ""
    return f"{len(vals)} samples: " + ", ".join(parts) + more


def permutation_test(
    a: Sequence[Sequence[tuple[Any, ...]]],
    b: Sequence[Sequence[tuple[Any, ...]]],
    *,
    permutations: int = 1999,
    seed: int = 0,
) -> PermutationResult:
    """Two-sample permutation test that continuations ``a`` and ``b`` share one distribution.

    Each continuation is a list of step tuples (as :func:`branchgym.fidelity.checks.run_actions`
    returns). Features are each step's observation, reward, terminated, truncated and
    info; the statistic is the largest distance over features: Kolmogorov-Smirnov for
    float features (episode end counts as -inf), total variation for the rest. Its null
    distribution comes from ``permutations`` random relabellings of the pooled samples,
    so ``p = (1 + #{permuted >= observed}) / (1 + permutations)`` satisfies
    ``P(p <= alpha) <= alpha`` for any alpha when both samples come from one distribution.
    """
    na, nb = len(a), len(b)
    if na == 0 or nb == 0:
        raise FidelitySetupError("permutation_test needs at least one sample on each side")
    n = na + nb
    rng = np.random.default_rng(seed)
    member = np.zeros((permutations + 1, n), dtype=bool)
    member[0, :na] = True
    perms = np.argsort(rng.random((permutations, n)), axis=1)[:, :na]
    member[np.arange(1, permutations + 1)[:, None], perms] = True
    stat = np.zeros(permutations + 1)
    best = ("", "cat", [])
    best_obs = -1.0
    for name, kind, vals in _features(list(a) + list(b)):
        if kind == "num":
            x = np.array([-np.inf if v is _ENDED else float(v) for v in vals])
            d = _ks_distance(member, x, na, nb)
        else:
            _, codes = np.unique(
                np.array([_category(v) if v is not _ENDED else "<ended>" for v in vals]),
                return_inverse=True,
            )
            d = _tv_distance(member, codes.ravel(), na, nb)
        stat = np.maximum(stat, d)
        if d[0] > best_obs:
            best_obs, best = float(d[0]), (name, kind, vals)
    p = float((1 + np.sum(stat[1:] >= stat[0] - 1e-12)) / (permutations + 1))
    name, kind, vals = best
    return PermutationResult(
        p,
        float(stat[0]),
        name,
        _describe(kind, vals[:na]) if vals else "",
        _describe(kind, vals[na:]) if vals else "",
    )
