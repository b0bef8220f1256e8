"""Bellman Policy Optimization (docs/algorithms.md §3).

GRPO-shaped, for terminal rewards. Per rollout batch:

1. sample G trajectories per prompt from the rollout policy ``mu`` (the current weights);
2. group-normalised advantages ``A_i = (R_i - mean_j R_j) / std_j R_j``; groups whose
   rewards are all equal carry no signal and are skipped (counted in ``groups/skipped``);
3. several optimizer updates on that batch (8 in the source), so the current policy
   ``pi`` drifts from ``mu``; each token is weighted by the smoothed complementary ratio
   ``omega = (1 + eps - mu_t) / (1 + eps - pi_t)``, capped at ``C`` with its gradient
   stopped, and masked by the sign-dependent rule
   (:func:`~branchgym.agents.estimators.losses.bellman_po_loss`):
   ``L = -A_i M_{i,t} min(sg(omega_{i,t}), C) log pi_t``, averaged over the tokens of a
   sequence, then over sequences.

No KL penalty, no entropy bonus; AdamW at a constant 1e-6 with betas (0.9, 0.98),
weight decay 0.1 and gradient-norm clipping at 1.0, as in the source.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from branchgym.agents.estimators import advantages, losses
from branchgym.agents.training.run import (
    Batch,
    Chunk,
    Run,
    TrainArgs,
    TrainResult,
    advantage_metrics,
    ratio_spread,
    require,
    rollout_metrics,
)
from branchgym.rollout.grow import group_rollouts

__all__ = ["Args", "loss", "main"]


@dataclasses.dataclass
class Args(TrainArgs):
    """Bellman PO options; the optimiser defaults are the source's (algorithms.md §3)."""

    g: int = 8
    """Responses (trajectories) G per prompt (algorithms.md §3)."""
    omega_eps: float = 0.1
    """eps of ``omega = (1 + eps - mu) / (1 + eps - pi)`` (0.1; the source finds 0.05-0.2 flat)."""
    cap: float = 3.0
    """Weight cap C on ``sg(omega)`` (3.0; 2-4 flat in the source)."""
    eps_high: float = 0.28
    """Mask threshold for A > 0: drop tokens with omega > 1 + eps_high. The source keeps it
    separate without a value; DAPO's clip-higher 0.28."""
    eps_low: float = 0.2
    """Mask threshold for A < 0: drop tokens with omega < 1 - eps_low (DAPO's 0.2)."""
    lr: float = 1e-6
    """AdamW learning rate, constant (algorithms.md §3)."""
    lr_schedule: str = "constant"
    """Constant learning rate (algorithms.md §3)."""
    adam_betas: tuple[float, float] = (0.9, 0.98)
    """AdamW betas (algorithms.md §3)."""
    weight_decay: float = 0.1
    """AdamW weight decay (algorithms.md §3)."""
    grad_clip: float = 1.0
    """Gradient-norm clip (algorithms.md §3)."""
    updates_per_batch: int = 8
    """Optimizer updates per rollout batch (8: mu and pi differ from the second on)."""

    def check(self) -> None:
        """Ranges of the Bellman PO options."""
        super().check()
        require(self.g >= 2, f"a group needs G >= 2 responses; got {self.g}.")
        require(self.omega_eps > 0, f"omega_eps must be > 0 (0.1); got {self.omega_eps}.")
        require(self.cap > 0, f"cap C must be > 0 (3.0); got {self.cap}.")
        require(self.eps_high >= 0 and self.eps_low >= 0, "eps_high and eps_low must be >= 0.")


def loss(args: Args, c: Chunk) -> tuple[torch.Tensor, dict[str, float]]:
    """The Bellman PO loss of the chunk's groups (rows come G per group, in order)."""
    groups = c.logp.shape[0] // args.g
    shape = (groups, args.g, c.logp.shape[-1])
    out = losses.bellman_po_loss(
        c.logp.reshape(shape),
        c.old_logp.reshape(shape),
        c.rewards.reshape(groups, args.g),
        c.mask.reshape(shape),
        eps=args.omega_eps,
        cap=args.cap,
        eps_high=args.eps_high,
        eps_low=args.eps_low,
    )
    return out.loss, {
        "losses/policy_loss": float(out.loss.detach()),
        "losses/mask_fraction": float(out.mask_fraction),
        "losses/cap_fraction": float(out.cap_fraction),
        "losses/omega_mean": float(out.omega_mean),
        **ratio_spread(c, omega_eps=args.omega_eps),
    }


def _sequence_weight(degenerate: dict[int, bool]) -> Callable[[Batch, list[int]], float]:
    """Chunk weight: sequences of non-skipped groups (the loss's normaliser)."""

    def weight(batch: Batch, rows: list[int]) -> float:
        return float(
            sum(
                1
                for r in rows
                if not degenerate[batch.rows[r].group]
                and any(d.mask.sum() > 0 for d in batch.rows[r].decisions)
            )
        )

    return weight


def main(args: Args, algo: str = "bellman_po") -> TrainResult:
    """Train with Bellman PO."""
    run = Run(args, algo, needs_ref=False)  # no KL penalty: no reference model
    options = advantages.AdvantageOptions.of(args)
    for _ in run.loop():
        # 1. G rollouts per prompt from mu
        trees = run.rollouts(
            [
                functools.partial(
                    group_rollouts,
                    run.spec,
                    n=args.g,
                    seed=s,
                    rng=run.rng(i),
                    max_steps=args.max_episode_steps,
                )
                for i, s in enumerate(run.prompt_seeds())
            ]
        )
        batch = Batch(trees, success_threshold=args.success_threshold)
        # 2. the advantages (the loss recomputes them from the rewards; here for logging)
        adv, skipped = [], {}
        for g, t in enumerate(trees):  # sandbox errors are left out of the statistics
            out = advantages.advantage("grpo")([t], options)
            adv.append(out.nodes[0])
            skipped[g] = bool(out.degenerate)

        # 3. the omega-weighted loss over G rows per group, several updates
        update = functools.partial(loss, args)
        # the loss reads whole groups: token-budget micro-batches cut between groups
        run.log(run.updates(batch, update, weight=_sequence_weight(skipped), whole_groups=True))
        run.log(rollout_metrics(batch))
        run.log(
            advantage_metrics(
                [adv[r.tree][r.leaf] for r in batch.rows], [r.group for r in batch.rows]
            )
        )
        run.log({"groups/skipped": sum(skipped.values()), "groups/total": len(trees)})
    return run.close()
