"""Logged diagnostics: rollout and advantage statistics, ratio spread, running stats.

Every key is namespaced (``charts/*``, ``env/*``, ``tokens/*``, ``branching/*``,
``advantages/*``, ``ratio/*``, ``omega/*``) as the run's JSONL log writes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from branchgym.agents.forward.rows import Batch, Chunk
from branchgym.error import DependencyMissingError

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra(
        "branchgym.agents.training.metrics", "llm", "torch"
    ) from exc

__all__ = ["RunningStats", "advantage_metrics", "ratio_spread", "rollout_metrics"]


def advantage_metrics(
    values: Sequence[float] | np.ndarray, groups: Sequence[int] | np.ndarray
) -> dict[str, float]:
    """``advantages/*``: mean, std, max |A|, and the share of groups with max |A| > 0.1.

    ``values`` are per-decision (or per-token) advantages over counted decisions and
    ``groups`` the prompt of each; a group is non-degenerate when some advantage in it
    exceeds 0.1 in size (the BPO source's statistic: 71 % -> 94 % on SWE-bench).
    """
    v = np.asarray(values, dtype=np.float64)
    g = np.asarray(groups)
    if v.size == 0:
        return {
            "advantages/mean": 0.0,
            "advantages/std": 0.0,
            "advantages/max_abs": 0.0,
            "advantages/nondegenerate_frac": 0.0,
        }
    ids = np.unique(g)
    nondeg = [float(np.abs(v[g == i]).max() > 0.1) for i in ids]
    return {
        "advantages/mean": float(v.mean()),
        "advantages/std": float(v.std()),
        "advantages/max_abs": float(np.abs(v).max()),
        "advantages/nondegenerate_frac": float(np.mean(nondeg)),
    }


def rollout_metrics(batch: Batch) -> dict[str, float]:
    """``charts/*``, ``env/*``, ``tokens/*`` and ``branching/*`` of a rollout batch."""
    trees = batch.trees
    stats = [t.stats for t in trees]
    paths = [p for t in trees for p in t.paths()]
    rets = [r.reward for r in batch.rows]
    snaps = sum(s.snapshots_taken for s in stats)
    env_steps = sum(s.env_steps for s in stats)
    restores = sum(max(0, len(t.paths()) - 1) for t in trees if t.branch_points())
    nodes = [n for t in trees for n in t.nodes]
    gen_s = sum(s.generate_s for s in stats)
    rollout_s = gen_s + sum(s.env_s for s in stats)
    generated = sum(s.generated_tokens for s in stats)
    independent = sum(s.independent_tokens for s in stats)
    return {
        "charts/success": float(np.mean([r.success for r in batch.rows])) if batch.rows else 0.0,
        "charts/return": float(np.mean(rets)) if rets else 0.0,
        "charts/episode_length": float(np.mean([len(p) for p in paths])) if paths else 0.0,
        "charts/invalid_frac": float(np.mean([n.parse_error is not None for n in nodes]))
        if nodes
        else 0.0,
        "charts/rollouts": float(sum(s.rollouts for s in stats)),
        "env/steps": float(env_steps),
        "env/step_ms": 1000.0 * sum(s.env_s for s in stats) / max(env_steps, 1),
        "env/errors": float(sum(s.errors for s in stats)),
        # rollouts left out of every advantage group (eq. 4, group baselines): a sandbox
        # error anywhere on them, or never run
        "groups/invalid_rollouts": float(sum(int((~t.valid_paths()).sum()) for t in trees)),
        "tokens/generated": float(sum(s.generated_tokens for s in stats)),
        "tokens/independent": float(sum(s.independent_tokens for s in stats)),
        "tokens/per_second": sum(s.generated_tokens for s in stats) / gen_s if gen_s else 0.0,
        # share of tokens the shared prefixes saved against independent rollouts
        "branching/tokens_saved": 1.0 - generated / independent if independent else 0.0,
        "branching/snapshots": float(snaps),
        "branching/snapshot_ms": 1000.0 * sum(s.snapshot_s for s in stats) / max(snaps, 1),
        "branching/restore_ms": 1000.0 * sum(s.restore_s for s in stats) / max(restores, 1),
        "branching/overhead": sum(s.snapshot_s + s.restore_s for s in stats) / rollout_s
        if rollout_s
        else 0.0,
        "branching/peak_live": float(max([s.peak_live_snapshots for s in stats] + [0])),
        "branching/branch_points": float(sum(len(t.branch_points()) for t in trees)),
    }


def ratio_spread(c: Chunk, *, omega_eps: float | None = None) -> dict[str, float]:
    """How far the current policy has drifted from the behaviour policy on counted tokens.

    ``ratio/*`` describe the importance ratio ``pi/mu``; with ``omega_eps`` also Bellman
    PO's weight ``omega = (1 + eps - mu) / (1 + eps - pi)`` (algorithms.md §3), whose spread
    stays bounded where the ratio's does not. Diagnostics only (no gradient).
    """
    with torch.no_grad():
        m = c.mask > 0
        if not bool(m.any()):
            return {}
        pi, mu = c.logp.detach()[m].exp(), c.old_logp[m].exp()
        ratio = pi / mu
        out = {
            "ratio/absdev": float((ratio - 1).abs().mean()),
            "ratio/std": float(ratio.std()) if ratio.numel() > 1 else 0.0,
            "ratio/max": float(ratio.max()),
        }
        if omega_eps is not None:
            from branchgym.agents.estimators.advantages import bellman_po_weights

            omega = bellman_po_weights(mu, pi, eps=omega_eps)
            out.update(
                {
                    "omega/absdev": float((omega - 1).abs().mean()),
                    "omega/std": float(omega.std()) if omega.numel() > 1 else 0.0,
                    "omega/max": float(omega.max()),
                }
            )
        return out


#: policy name -> how it acts and how its log-probs are recomputed.


@dataclasses.dataclass
class RunningStats:
    """Welford's running mean and variance (of the gradient norm, across updates)."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        """Add one value."""
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (x - self.mean)

    @property
    def var(self) -> float:
        """Sample variance (0 before two values)."""
        return self.m2 / (self.n - 1) if self.n > 1 else 0.0
