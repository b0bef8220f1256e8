"""Branching Policy Optimization (docs/algorithms.md §1).

Per prompt, one gradient step:

1. sample a backbone from ``pi_theta`` to termination, recording the policy's
   distribution at every decision (a decision is one complete action);
2. score each decision by its entropy ``H_t`` (eq. 3) and pick the top-M as branch
   points, at least ``Delta_min`` apart (the ``entropy`` schedule; others for ablations);
3. at each branch point restore the snapshot and sample K-1 new actions, each rolled
   out to termination; the backbone's own action is sibling ``k = 1``, so a prompt costs
   ``N = 1 + M(K-1)`` rollouts;
4. local sibling advantage, eq. (4): each sibling's return-to-go minus the mean of the
   other K-1 (:func:`~branchgym.agents.estimators.advantages.sibling_advantages`);
5. propagate along each node's owning path, eq. (5): ``A(t') = sum_{b >= t'}
   lambda^(b - t') A_local(b, k_b)``, with steps after the last branch point getting its
   advantage (``tail="last"``) or zero (``tail="zero"``)
   (:func:`~branchgym.agents.estimators.advantages.propagate_advantages`); steps 4-5 are the ``bpo``
   entry of :data:`branchgym.agents.estimators.advantages.ADVANTAGES`, and ``credit`` picks the
   variants' entries (``root``, ``value_diff``) instead;
6. PPO-clip over every (s, a) pair of the tree, each shared-prefix pair counted once (its
   owning path's row), plus ``beta * KL(pi_theta || pi_ref)``, eq. (6).

With ``M = 0`` or ``K = 1`` there are no siblings: the learner falls back to the RLOO
group baseline over independent backbones (the registry's ``rloo``), the source's K = 1
ablation row.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np
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
    require,
    require_one_of,
    rollout_metrics,
)
from branchgym.rollout.grow import KEEP_MODES, group_rollouts, grow_tree
from branchgym.rollout.schedules import ForkPoint, depths_schedule
from branchgym.rollout.tree import ENTROPY_REDUCTIONS, RolloutTree

__all__ = [
    "FIXED_HORIZON_ONLY",
    "SCHEDULE_OPTIONS",
    "Args",
    "depths_schedule",
    "last_schedule",
    "loss",
    "main",
    "root_even_schedule",
]

#: Branch schedules of step 3 and which of the Args options each takes.
SCHEDULE_OPTIONS: dict[str, tuple[str, ...]] = {
    "entropy": ("reduce", "min_gap", "gap_unit", "fill"),
    "lowest_entropy": ("reduce", "min_gap", "gap_unit", "fill"),
    "random": ("min_gap", "gap_unit", "fill"),
    "even": (),
    "oracle": (),
    "last": (),
    "root_even": (),
    "depths": ("depths",),
}

#: Schedules whose points depend only on what happened before them (docs/estimators.md):
#: ``depths`` on any env; the others read the backbone's length, which is fixed only
#: when every episode has the same length.
FIXED_HORIZON_ONLY = ("even", "random", "last", "root_even")


def last_schedule(
    tree: RolloutTree, backbone: Sequence[int], m: int, rng: np.random.Generator
) -> list[ForkPoint]:
    """The last M decisions of the backbone: cheap siblings where the residual variance is.

    Not fixed in advance: the points are picked after seeing where the backbone ended.
    That is harmless only when every episode has the same length (TreeMDP's default);
    where episodes end at different lengths, the backbone's action and return at a point
    are conditioned on the episode ending right after it and the credit is biased
    (docs/estimators.md, "Variable episode lengths"). Use :func:`depths_schedule` there.
    """
    t_max = len(backbone)
    return [ForkPoint(t, 0, float(t)) for t in range(max(0, t_max - m), t_max)]


def root_even_schedule(
    tree: RolloutTree, backbone: Sequence[int], m: int, rng: np.random.Generator
) -> list[ForkPoint]:
    """The first decision plus M - 1 evenly spaced ones, fixed in advance.

    The root's K siblings are K independent backbones; the prefix gets no credit of its own.
    """
    t_max = len(backbone)
    steps = {0}
    for i in range(1, m):
        t = min(t_max - 1, max(1, int(round(i * t_max / m))))
        while t in steps and t < t_max - 1:
            t += 1
        steps.add(t)
    return [ForkPoint(t, 0, float(t)) for t in sorted(steps)][:m]


#: Schedules this learner adds to branchgym.rollout.schedules' (``depths`` lives there:
#: it is planned, so trees overlap its siblings with the backbone).
LOCAL_SCHEDULES = {
    "last": last_schedule,
    "root_even": root_even_schedule,
}


@dataclasses.dataclass
class Args(TrainArgs):
    """Branching PO options; defaults are the source's (algorithms.md §1), CI runs override them."""

    m: int = 2
    """Branch points M per backbone (algorithms.md §1 step 3; the source uses 2)."""
    k: int = 4
    """Siblings K per branch point, the backbone's own action included (step 4; 4, where
    the source finds K saturates). Rollouts per prompt N = 1 + M(K - 1) = 7."""
    schedule: str = "entropy"
    """Branch schedule (step 3): ``entropy`` (top-M by H_t), or the ablations
    ``lowest_entropy``, ``random``, ``even``, ``oracle`` (TreeMDP only), and for the
    unbiased variants ``last`` (the last M decisions), ``root_even`` and ``depths`` (the
    fixed decision depths ``branch_depths``, where the backbone is still running: the
    only one unbiased when episodes end at different lengths, docs/estimators.md)."""
    branch_depths: tuple[int, ...] = ()
    """Decision depths of ``schedule="depths"`` (M of them, ``m`` must match), e.g.
    ``(2,)``; a backbone that ended before a depth does not branch there."""
    entropy_reduce: str = "mean"
    """H_t of an action from its per-token entropies (eq. 3 on token spans): ``mean``
    (algorithms.md default), ``first`` or ``sum``."""
    min_gap: int | None = None
    """Delta_min between branch points; default 64 tokens of the trajectory (1 step for
    envs whose actions are single tokens)."""
    gap_unit: str = "auto"
    """Unit of ``min_gap``: ``tokens``, ``steps`` or ``auto``."""
    fill: bool = False
    """Top up to M branch points when the gap rule leaves fewer (keeps N fixed)."""
    lam: float = 0.95
    """lambda of eq. (5) (0.95; the source's plateau is 0.9-0.99, 1.0 hurts slightly)."""
    tail: str = "last"
    """Steps after the last branch point of a path (eq. 5's ambiguity): ``last`` gives them
    that branch point's local advantage undiscounted (algorithms.md default), ``zero`` gives 0."""
    eps: float = 0.2
    """PPO clip range epsilon (eq. 6; 0.2)."""
    eps_high: float | None = None
    """Upper clip range (clip-higher); default ``eps``."""
    beta: float = 0.05
    """KL coefficient to the reference policy (eq. 6; 0.05); 0 drops pi_ref."""
    kl_estimator: str = "k3"
    """Schulman's ``k1``, ``k2`` or ``k3`` estimator of KL(pi_theta || pi_ref)."""
    aggregation: str = "token-mean"
    """Loss aggregation; eq. (6) sums over the tree's (s, a) pairs, so every counted token
    weighs the same (``token-mean``)."""
    keep: str = "snapshot"
    """How candidate branch states are kept until the schedule picks: ``snapshot`` every
    step, or ``replay`` to the chosen ones (deterministic envs only)."""
    env_noise: str = "fresh"
    """``fresh``: each sibling draws its own env randomness after restore (independent
    siblings, Theorem 2); ``shared``: common random numbers."""
    fallback_n: int = 7
    """Independent backbones per prompt when branching is off (M = 0 or K = 1): the RLOO
    group baseline of the source's K = 1 ablation (7 = N of M = 2, K = 4)."""
    credit: str = "lambda"
    """Credit of the backbone's decisions (docs/estimators.md): ``lambda`` is eq. (5)
    (the spec; biased: its prefix credit is mean-zero); ``root`` gives decisions above the
    first branch point a leave-one-out baseline among the prompt's ``backbones`` and later
    ones the comparison at the latest branch point at or above them; ``value_diff`` gives
    decisions between two branch points the mean sibling return at the next point (the
    line's own return if it ends before it) minus the fresh siblings' mean at the previous
    one. Both give the exact policy gradient in mean, together with ``depth_weight``, when
    the schedule decides each point before the actions it conditions on: ``depths`` on any
    env; ``even``, ``random``, ``last`` and ``root_even`` only when every episode has the
    same length (they read the backbone's length); never ``entropy``."""
    backbone_credit: str = "include"
    """``include`` (spec): the backbone's action is sibling 1 of each comparison.
    ``exclude``: the backbone's own decisions get advantage 0 (its return still serves
    in the fresh siblings' baselines), removing the bias of an entropy schedule that
    chose the point by the backbone's later states (the chosen states stay biased)."""
    backbones: int = 1
    """Backbones G per prompt, each grown with its own branch points (N = G(1 + M(K - 1)));
    ``credit="root"`` and ``value_diff`` use their leave-one-out baseline for the prefix."""
    depth_weight: bool = False
    """Scale each decision's advantage by N / n_t, N = G(1 + M(K - 1)) the planned rollouts,
    so every depth weighs as one trajectory's and the gradient's mean is the policy
    gradient (docs/estimators.md); off: every counted decision weighs the same (spec)."""
    depth_count: str = "backbone"
    """What n_t of ``depth_weight`` is. ``backbone``: G times the lines planned in the
    decision's own tree at its depth (1 + (K - 1) x the points at or above it: with
    ``schedule="depths"`` every ``branch_depths`` entry there, reached or not), which does
    not depend on how long any line ran: unbiased with ``depths`` on any env, and with the
    other trajectory-free schedules on fixed-length episodes. ``realised``: the prompt's
    decisions at that depth (the previous design), equal on fixed-length episodes but
    biased when lines end at different lengths (the count is random and correlated with
    the returns)."""

    @property
    def branching(self) -> bool:
        """Whether trees branch (M > 0 and K > 1)."""
        return self.m > 0 and self.k > 1

    def check(self) -> None:
        """Ranges of the Branching PO options."""
        super().check()
        require(self.m >= 0, f"m (branch points) must be >= 0; got {self.m}.")
        require(self.k >= 1, f"k (siblings per branch point) must be >= 1; got {self.k}.")
        require(0.0 <= self.lam <= 1.0, f"lam must be in [0, 1] (0.95); got {self.lam}.")
        require(self.eps >= 0 and self.beta >= 0, "eps and beta must be >= 0.")
        require(self.fallback_n >= 2, "fallback_n needs at least 2 backbones per prompt.")
        require_one_of("schedule", self.schedule, SCHEDULE_OPTIONS)
        require_one_of("entropy_reduce", self.entropy_reduce, ENTROPY_REDUCTIONS)
        require_one_of("gap_unit", self.gap_unit, ("auto", "tokens", "steps"))
        require_one_of("tail", self.tail, advantages.TAILS)
        require_one_of("aggregation", self.aggregation, losses.AGGREGATIONS)
        require_one_of("kl_estimator", self.kl_estimator, losses.KL_ESTIMATORS)
        require_one_of("keep", self.keep, KEEP_MODES)
        require_one_of("env_noise", self.env_noise, ("fresh", "shared"))
        require_one_of("credit", self.credit, advantages.CREDITS)
        require_one_of("backbone_credit", self.backbone_credit, ("include", "exclude"))
        require_one_of("depth_count", self.depth_count, advantages.DEPTH_COUNTS)
        require(
            self.schedule != "depths"
            or (len(self.branch_depths) == self.m and len(set(self.branch_depths)) == self.m),
            f"schedule='depths' needs m = {self.m} distinct branch_depths; got "
            f"{tuple(self.branch_depths)} (e.g. --set branch_depths=2 --set m=1).",
        )
        require(
            all(int(t) >= 0 for t in self.branch_depths),
            f"branch_depths are decision depths >= 0; got {tuple(self.branch_depths)}.",
        )
        require(self.backbones >= 1, f"backbones must be >= 1; got {self.backbones}.")
        require(
            self.credit != "root" or self.backbones >= 2,
            "credit='root' needs backbones >= 2 (the prefix's leave-one-out baseline).",
        )
        require(
            self.credit != "value_diff" or self.backbones >= 2 or self.schedule == "root_even",
            "credit='value_diff' needs backbones >= 2 or schedule='root_even' (a baseline "
            "for the decisions above the first branch point).",
        )
        require(
            self.credit == "lambda" or self.schedule not in ("entropy", "lowest_entropy"),
            f"credit={self.credit!r} is unbiased only with a schedule fixed before the "
            "backbone's future is seen: use depths (any env), or even, random, last or "
            "root_even (fixed-length episodes only).",
        )
        spec = (self.credit, self.backbone_credit, self.backbones, self.depth_weight)
        require(
            self.branching or spec == ("lambda", "include", 1, False),
            "credit, backbone_credit, backbones and depth_weight need branching (M, K > 1).",
        )


def loss(args: Args, c: Chunk) -> tuple[torch.Tensor, dict[str, float]]:
    """Eq. (6): PPO-clip over the counted tokens with their eq. (5) advantages + beta KL."""
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
    return out.loss, out.metrics()


def main(args: Args, algo: str = "bpo") -> TrainResult:
    """Train with Branching PO."""
    run = Run(args, algo, needs_ref=args.beta > 0)
    given = {
        "reduce": args.entropy_reduce,
        "min_gap": args.min_gap,
        "gap_unit": args.gap_unit,
        "fill": args.fill,
        "depths": tuple(args.branch_depths),
    }
    schedule_options = {k: given[k] for k in SCHEDULE_OPTIONS[args.schedule]}
    schedule = LOCAL_SCHEDULES.get(args.schedule, args.schedule)
    options = advantages.AdvantageOptions.of(args)
    for _ in run.loop():
        seeds = run.prompt_seeds()
        if args.branching:
            # steps 1-3: a backbone, M branch points by entropy, K-1 siblings at each
            # (G backbones per prompt; G = 1 is the spec and draws from run.rng(i) as before)
            # (all prompts' trees in lockstep: one batched policy call per turn)
            trees = run.rollouts(
                [
                    functools.partial(
                        grow_tree,
                        run.spec,
                        schedule=schedule,
                        m=args.m,
                        k=args.k,
                        seed=s,
                        rng=run.rng(i) if j == 0 else run.rng(i, j),
                        keep=args.keep,
                        max_steps=args.max_episode_steps,
                        schedule_options=schedule_options,
                        env_noise=args.env_noise,
                    )
                    for i, s in enumerate(seeds)
                    for j in range(args.backbones)
                ]
            )
            # steps 4-5: eq. 4 at each branch point, eq. 5 along each owning path (or a
            # credit variant of docs/estimators.md), per prompt's G trees
            groups = [i for i in range(len(seeds)) for _ in range(args.backbones)]
            per_tree, n_degenerate, _ = advantages.per_prompt(
                advantages.CREDITS[args.credit], trees, groups, options
            )
            skipped = sum(all(v == 0 for v in a.values()) for a in per_tree)
        else:
            # K = 1 ablation: independent backbones with the RLOO group baseline
            trees = run.rollouts(
                [
                    functools.partial(
                        group_rollouts,
                        run.spec,
                        n=args.fallback_n,
                        seed=s,
                        rng=run.rng(i),
                        max_steps=args.max_episode_steps,
                    )
                    for i, s in enumerate(seeds)
                ]
            )
            per_tree, skipped, _ = advantages.per_prompt("rloo", trees, range(len(trees)), options)
            n_degenerate = 0
        batch = Batch(trees, success_threshold=args.success_threshold)
        batch.set_advantages(lambda row, d, adv=per_tree: adv[row.tree][d.node])
        if run.ref is not None:
            run.frozen_logprobs(run.ref, batch, "ref_logp")

        # step 6, eq. 6: PPO-clip over every (s, a) pair of the tree, shared prefixes once
        run.log(run.updates(batch, functools.partial(loss, args), weight=WEIGHTS[args.aggregation]))
        run.log(rollout_metrics(batch))
        counted = list(batch.decisions())
        run.log(advantage_metrics([d.advantage for d in counted], [d.tree for d in counted]))
        run.log(
            {
                "groups/skipped": skipped,
                "groups/total": len(trees),
                "branching/degenerate_points": n_degenerate,
            }
        )
    return run.close()
