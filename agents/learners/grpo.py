"""GRPO and RLOO: N independent rollouts per prompt, a group baseline, PPO-clip (algorithms.md §4).

The baselines every Branching PO comparison needs. Per prompt (task instance), one step:

1. sample N independent trajectories from ``pi_old`` (``group_rollouts``: the reset
   state is the root of a tree with N children, the same engine as Branching PO's);
2. advantages from the N returns, an entry of
   :data:`branchgym.agents.estimators.advantages.ADVANTAGES`:
   ``grpo``: ``(R_i - mean) / (std + eps)`` (Shao et al., 2024, DeepSeekMath eq. 3), or
   ``rloo``: ``R_i - mean_{j != i} R_j`` (Ahmadian et al., 2024), unnormalised;
   groups whose returns are all equal carry no signal and are counted as skipped;
3. PPO-clip on every generated token with the trajectory's advantage broadcast to its
   tokens, plus ``beta * KL(pi_theta || pi_ref)`` (algorithms.md eq. 6 without a tree).

``N = 1 + M(K - 1)`` by default, so a GRPO/RLOO step costs what a Branching PO step with
the same M and K costs (algorithms.md §1: N = 7 against GRPO's 8 in the source; matched here).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from branchgym.agents.estimators import advantages, losses
from branchgym.agents.training.run import (
    WEIGHTS,
    Batch,
    Chunk,
    Run,
    TrainArgs,
    TrainResult,
    advantage_metrics,
    ratio_spread,
    require,
    require_one_of,
    rollout_metrics,
)
from branchgym.rollout.grow import group_rollouts

__all__ = ["Args", "loss", "main"]


@dataclasses.dataclass
class Args(TrainArgs):
    """GRPO / RLOO options (defaults: the BPO source's training set-up, algorithms.md §1)."""

    advantage: str = "grpo"
    """``grpo`` (group-normalised, Shao et al. 2024) or ``rloo`` (leave-one-out, Ahmadian et
    al. 2024), an entry of
    :data:`branchgym.agents.estimators.advantages.ADVANTAGES` (algorithms.md §4)."""
    n: int | None = None
    """Rollouts per prompt N; default ``1 + m * (k - 1)`` (matched compute with Branching PO)."""
    m: int = 2
    """M of the Branching PO run to match (only sets the default N)."""
    k: int = 4
    """K of the Branching PO run to match (only sets the default N)."""
    eps: float = 0.2
    """PPO clip range epsilon (algorithms.md eq. 6; 0.2 in the source)."""
    eps_high: float | None = None
    """Upper clip range (DAPO's clip-higher); default ``eps``."""
    beta: float = 0.05
    """KL coefficient to the reference policy (algorithms.md eq. 6; 0.05); 0 drops pi_ref."""
    kl_estimator: str = "k3"
    """Schulman's ``k1``, ``k2`` or ``k3`` estimator of KL(pi_theta || pi_ref)."""
    aggregation: str = "seq-mean-token-mean"
    """Loss aggregation: GRPO's per-sequence token mean, then the mean over sequences
    (DeepSeekMath eq. 3); ``token-mean`` weighs every token alike (algorithms.md eq. 6)."""

    @property
    def group_size(self) -> int:
        """N: rollouts per prompt."""
        return self.n if self.n is not None else 1 + self.m * (self.k - 1)

    def check(self) -> None:
        """Ranges of the GRPO/RLOO options."""
        super().check()
        require_one_of("advantage", self.advantage, advantages.GROUP_ESTIMATORS)
        require_one_of("aggregation", self.aggregation, losses.AGGREGATIONS)
        require_one_of("kl_estimator", self.kl_estimator, losses.KL_ESTIMATORS)
        require(self.m >= 0 and self.k >= 1, f"need m >= 0 and k >= 1; got {self.m}, {self.k}.")
        require(
            self.group_size >= 2,
            f"a group baseline needs N >= 2 rollouts per prompt; got N = {self.group_size}.",
        )
        require(self.eps >= 0 and self.beta >= 0, "eps and beta must be >= 0.")


def loss(args: Args, c: Chunk) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip on the chunk's tokens (each carries its trajectory's advantage) + beta KL."""
    out = losses.ppo_clip_loss(
        c.logp,
        c.old_logp,
        c.advantages,
        c.mask,
        eps=args.eps,
        eps_high=args.eps_high,
        aggregation=args.aggregation,
        ref_logp=c.ref_logp,
        beta=args.beta,
        kl_estimator=args.kl_estimator,
    )
    return out.loss, {**out.metrics(), **ratio_spread(c)}


def main(args: Args, algo: str | None = None) -> TrainResult:
    """Train with GRPO (or RLOO: ``args.advantage = "rloo"``)."""
    algo = algo or args.advantage
    run = Run(args, algo, needs_ref=args.beta > 0)
    options = advantages.AdvantageOptions.of(args)
    for _ in run.loop():
        # 1. N independent rollouts per prompt
        # (all prompts' groups in lockstep: one batched policy call per turn)
        trees = run.rollouts(
            [
                functools.partial(
                    group_rollouts,
                    run.spec,
                    n=args.group_size,
                    seed=s,
                    rng=run.rng(i),
                    max_steps=args.max_episode_steps,
                )
                for i, s in enumerate(run.prompt_seeds())
            ]
        )
        batch = Batch(trees, success_threshold=args.success_threshold)
        # 2. group baseline over the N returns of each prompt
        # (a rollout whose sandbox failed is left out of the statistics and gets 0)
        adv, degenerate, _ = advantages.per_prompt(
            args.advantage, trees, range(len(trees)), options
        )
        batch.set_advantages(lambda row, d, adv=adv: adv[row.tree][row.leaf])
        if run.ref is not None:
            run.frozen_logprobs(run.ref, batch, "ref_logp")

        # 3. PPO-clip with the trajectory's advantage on each of its tokens, + beta KL
        metrics = run.updates(
            batch, functools.partial(loss, args), weight=WEIGHTS[args.aggregation]
        )
        run.log(metrics)
        run.log(rollout_metrics(batch))
        run.log(
            advantage_metrics(
                [adv[r.tree][r.leaf] for r in batch.rows],
                [r.group for r in batch.rows],
            )
        )
        run.log({"groups/skipped": degenerate, "groups/total": len(trees)})
    return run.close()
