"""Branching On-Policy Distillation (docs/algorithms.md §2), and the loop of its baselines.

On-policy distillation: the student samples its own trajectories and a frozen teacher
scores every token the student generated, ``dlogp_t = log pi_T(a_t|s_t) - log
pi_theta(a_t|s_t)``; environment observations are context only, never in the loss.
Per input, one step:

1. a main trajectory from ``pi_old`` (temperature 1, no truncation);
2. fork scores per generated token: ``U_t`` (student entropy from its top-20
   probabilities) and ``D_t`` (``-dlogp`` over a 128-token window), rank-normalised,
   ``v_t = alpha R(U_t) + (1 - alpha) R(D_t)`` (the ``fork_score`` schedule);
3. forks: multi-turn tasks take at most B = 3 turns (mean of their top 20 % scores), at
   least one turn apart, and one of each turn's 3 best eligible positions (U_t >= 0.5);
4. from each fork, the env restored by snapshot (or replay), k = 2 continuations from
   ``pi_old`` that keep the main trajectory's tokens before the fork; every suffix is kept,
   so at most 1 + B k = 7 trajectories per input;
5. ``L_tree``: token-mean PPO-clip (eps 0.2) on ``A = clip(sg(dlogp), -delta, delta)``
   over the mask M that counts the shared prefix once
   (:func:`~branchgym.agents.estimators.losses.opd_tree_loss`);
6. protocol-boundary repair: pluggable detectors emit constraints ``(s, C, b)``;
   ``L = L_tree + Psi[lambda mean l_proto]``, lambda 0.01, capped at 0.02
   (:func:`~branchgym.agents.estimators.losses.pbr_loss`).

The baselines share this loop and differ only in how rollouts are drawn
(:data:`ROLLOUTS`): ``single`` is vanilla OPD (the main trajectory alone), ``multi`` is
multi-rollout OPD (n = 7 independent trajectories). :class:`OPDArgs` and
:class:`MultiOPDArgs` name them (``--algo opd`` and ``--algo opd_multi``).

The teacher must share the student's tokenizer. For TextTreeMDP in CI it is the tiny
model fine-tuned on the maze's optimal policy (``branchgym train --algo sft --set
noise=0``), so the teacher's distribution is the expert's, learnt.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from branchgym.agents.estimators import losses, pbr
from branchgym.agents.training.run import (
    Batch,
    Chunk,
    GenerateKind,
    Row,
    Run,
    TrainArgs,
    TrainResult,
    advantage_metrics,
    path_decisions,
    require,
    require_one_of,
    rollout_metrics,
)
from branchgym.error import TrainingConfigError
from branchgym.rollout.grow import KEEP_MODES, group_rollouts, grow_tree
from branchgym.rollout.tree import RolloutTree

__all__ = [
    "DETECTOR_SETS",
    "ROLLOUTS",
    "Args",
    "MultiOPDArgs",
    "OPDArgs",
    "loss",
    "main",
    "react_action_end",
]


@dataclasses.dataclass
class Args(TrainArgs):
    """Branching OPD options (algorithms.md §2); the baselines reuse them."""

    teacher: str = ""
    """The frozen teacher: a model folder (e.g. an SFT checkpoint), ``tiny`` or ``smollm2``;
    it must share the student's tokenizer."""
    rollouts: str = "tree"
    """How trajectories are drawn, a key of :data:`ROLLOUTS`: ``tree`` (Branching OPD),
    ``single`` (vanilla OPD), ``multi`` (multi-rollout OPD)."""
    b: int = 3
    """Fork budget B (step 3; 3)."""
    k: int = 2
    """Continuations resampled per fork (step 4; 2 beats 3 in the source)."""
    n: int = 7
    """Independent trajectories of multi-rollout OPD (7 = 1 + B k, matched)."""
    alpha: float = 0.5
    """Weight of the entropy rank in the fork score (step 2; 0.5)."""
    window: int = 128
    """Tokens aggregated into the disagreement D_t (step 2; 128)."""
    window_mode: str = "forward"
    """Where D_t's window sits (the source does not say): ``forward`` from the token on."""
    min_entropy: float = 0.5
    """Eligible fork positions have U_t >= this (step 3; 0.5)."""
    fork_mode: str = "turns"
    """``turns`` (multi-turn agent tasks: pick turns, then a position) or ``tokens``
    (single-turn text: the B best positions)."""
    min_turn_distance: int = 2
    """Chosen turns are at least this far apart (2 = "at least one turn apart")."""
    top_frac: float = 0.2
    """A turn's score is the mean of its top this-fraction of position scores (20 %)."""
    pick_from: int = 3
    """Inside a chosen turn, one of its this-many best eligible positions, uniformly."""
    keep: str = "snapshot"
    """Fork states restored by ``snapshot``, or by ``replay`` of the actions (fallback)."""
    delta: float = 1.0
    """Clip bound of the per-token advantage clip(dlogp, -delta, delta) (not given in the
    source; 1.0)."""
    eps: float = 0.2
    """PPO clip range (step 5; 0.2)."""
    student: str = "current"
    """Which student log-prob enters dlogp: ``current`` (pi_theta, the paper's wording) or
    ``old`` (pi_old)."""
    pbr: str = "react"
    """Protocol-boundary repair detectors, a key of :data:`DETECTOR_SETS` (``react``:
    end-of-turn after a complete ReAct action line + stray ``</think>``; ``none``)."""
    pbr_lambda: float = 0.01
    """lambda of the PBR term (step 6; 0.01)."""
    pbr_cap: float = 0.02
    """Cap Psi on the PBR term (step 6; 0.02)."""
    pbr_cap_mode: str = "scale"
    """How Psi caps: ``scale`` (rescale, gradient kept) or ``clamp``."""

    def check(self) -> None:
        """Ranges of the OPD options."""
        super().check()
        if not self.teacher:
            raise TrainingConfigError(
                "on-policy distillation needs a frozen teacher: --set teacher=PATH (a model "
                "folder sharing the student's tokenizer, e.g. an SFT checkpoint: branchgym "
                "train --algo sft ..., then teacher=<out_dir>/checkpoint-NNNNNN)."
            )
        require_one_of("rollouts", self.rollouts, ROLLOUTS)
        require_one_of("fork_mode", self.fork_mode, ("turns", "tokens"))
        require_one_of("window_mode", self.window_mode, ("forward", "backward", "centered"))
        require_one_of("keep", self.keep, KEEP_MODES)
        require_one_of("student", self.student, ("current", "old"))
        require_one_of("pbr", self.pbr, DETECTOR_SETS)
        require_one_of("pbr_cap_mode", self.pbr_cap_mode, losses.PBR_CAPS)
        require(self.b >= 0 and self.k >= 1, f"need b >= 0, k >= 1; got {self.b}, {self.k}.")
        require(self.n >= 1, f"n must be >= 1; got {self.n}.")
        require(0.0 <= self.alpha <= 1.0, f"alpha must be in [0, 1]; got {self.alpha}.")
        require(self.delta > 0 and self.eps >= 0, "delta must be > 0 and eps >= 0.")


# ------------------------------------------------------------------ rollouts


@dataclasses.dataclass
class OPDArgs(Args):
    """Vanilla OPD (``--algo opd``): Branching OPD's options with one trajectory per input."""

    rollouts: str = "single"
    """``single``: the main trajectory alone (vanilla on-policy distillation)."""


@dataclasses.dataclass
class MultiOPDArgs(Args):
    """Multi-rollout OPD (``--algo opd_multi``): n independent trajectories per input."""

    rollouts: str = "multi"
    """``multi``: n independent trajectories."""
    n: int = 7
    """Trajectories per input (7 = Branching OPD's 1 + B k at B = 3, k = 2)."""


def _tree(
    run: Run,
    args: Args,
    seed: int,
    rng: np.random.Generator,
    hook: Any,
    policy: Any = None,
    *,
    executor: Any = None,
) -> RolloutTree:
    """Branching OPD: the main trajectory, B forks by fork score, k continuations each."""
    return grow_tree(
        run.spec,
        run.behaviour if policy is None else policy,
        "fork_score",
        m=args.b,
        k=1 + args.k,  # grow_tree counts the main trajectory's own continuation
        seed=seed,
        rng=rng,
        executor=run.executor if executor is None else executor,
        keep=args.keep,
        max_steps=args.max_episode_steps,
        teacher=hook,
        schedule_options={
            "alpha": args.alpha,
            "window": args.window,
            "window_mode": args.window_mode,
            "min_entropy": args.min_entropy,
            "mode": args.fork_mode,
            "min_turn_distance": args.min_turn_distance,
            "top_frac": args.top_frac,
            "pick_from": args.pick_from,
        },
    )


def _single(
    run: Run,
    args: Args,
    seed: int,
    rng: np.random.Generator,
    hook: Any,
    policy: Any = None,
    *,
    executor: Any = None,
) -> RolloutTree:
    """Vanilla OPD: the main trajectory alone."""
    return grow_tree(
        run.spec,
        run.behaviour if policy is None else policy,
        m=0,
        seed=seed,
        rng=rng,
        executor=run.executor if executor is None else executor,
        max_steps=args.max_episode_steps,
    )


def _multi(
    run: Run,
    args: Args,
    seed: int,
    rng: np.random.Generator,
    hook: Any,
    policy: Any = None,
    *,
    executor: Any = None,
) -> RolloutTree:
    """Multi-rollout OPD: n independent trajectories."""
    return group_rollouts(
        run.spec,
        run.behaviour if policy is None else policy,
        args.n,
        seed=seed,
        rng=rng,
        executor=run.executor if executor is None else executor,
        max_steps=args.max_episode_steps,
    )


#: rollout mode -> ``(run, args, seed, rng, teacher_hook, policy=None, executor=None) -> tree``
#: (policy and executor default to the run's; :meth:`Run.rollouts` passes batched ones).
ROLLOUTS: dict[str, Callable[..., RolloutTree]] = {
    "tree": _tree,
    "single": _single,
    "multi": _multi,
}


# ------------------------------------------------------------------ PBR detectors


def react_action_end(text: str) -> int | None:
    """End of a complete ReAct action: the ``Action: ...`` line, once a newline closes it.

    A reply that goes on after its action line should have ended there; the constraint
    then raises the end-of-turn token at the action's last token. A reply that stops right
    after the action has no newline to detect and emits nothing.
    """
    low = text.lower()
    start = low.find("action:")
    if start < 0:
        return None
    nl = text.find("\n", start)
    if nl < 0 or not text[start + len("action:") : nl].strip():
        return None
    return len(text[:nl].rstrip())


def _react(run: Run) -> list[Any]:
    return [
        pbr.FinalAnswerEOS(tuple(run.engine.stop_token_ids), answer_end=react_action_end),
        pbr.StrayThinkClose(),
    ]


#: detector set name -> ``run -> [detector, ...]`` (rules are protocol-specific).
DETECTOR_SETS: dict[str, Callable[[Run], list[Any]]] = {
    "react": _react,
    "none": lambda run: [],
}


def _constraints(run: Run, batch: Batch, detectors: list[Any]) -> None:
    """Run the detectors on each row's dialogue; keep its constraints in ``row.cache``."""
    decode = run.tokenizer.decode
    for row in batch.rows:
        row.cache["pbr"] = []
        if not detectors or not row.decisions:
            continue
        if len(GenerateKind.runs(run.policy, row)) > 1:
            continue  # dialogue shortened to fit the context: no single sequence to check
        seq, spans = GenerateKind.sequence(run.policy, row)
        pieces = [decode([t]) for t in seq]
        ps = pbr.ProtocolSequence(seq, pieces, spans)
        row.cache["pbr"] = pbr.detect([ps], detectors)


def _teacher_hook(run: Run, teacher: Any) -> Callable[[RolloutTree, list[int]], None]:
    """Fill the backbone's ``teacher_logprobs`` (the fork score's D_t needs them)."""

    @torch.no_grad()
    def hook(tree: RolloutTree, backbone: list[int]) -> None:
        decisions = [d for d in path_decisions(tree, backbone, 0) if d.n_tokens]
        if not decisions:
            return
        row = Row(0, backbone[-1], 0, decisions, 0.0, False)
        (lps,), _ = run.logprobs(teacher, [row])
        for d, lp in zip(decisions, lps, strict=True):
            tree[d.node].teacher_logprobs = lp.float().cpu().numpy()

    return hook


# ------------------------------------------------------------------ the loop


def loss(args: Args, c: Chunk, batch: Batch | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """``L_tree`` (token-mean PPO-clip on the clipped teacher-minus-student advantage) + PBR.

    The PBR term needs the rows' constraints (``row.cache["pbr"]`` of ``batch``) and the
    chunk's logits at their positions; without them it is zero.
    """
    tree_loss = losses.opd_tree_loss(
        c.logp,
        c.old_logp,
        c.teacher_logp,
        c.mask,
        delta=args.delta,
        eps=args.eps,
        student=args.student,
    )
    metrics = tree_loss.metrics()
    total = tree_loss.loss
    cons = [con for r in c.rows for con in batch.rows[r].cache.get("pbr", [])] if batch else []
    if cons and c.logits is not None:
        flat = [dataclasses.replace(con, seq=0, position=i) for i, con in enumerate(cons)]
        aux = losses.pbr_loss(
            c.logits.unsqueeze(0),
            flat,
            lam=args.pbr_lambda,
            cap=args.pbr_cap,
            cap_mode=args.pbr_cap_mode,
        )
        total = total + aux.loss
        metrics.update(aux.metrics())
    else:
        metrics.update({"losses/pbr": 0.0, "losses/pbr_constraints": 0.0})
    return total, metrics


def _distillation_metrics(batch: Batch, delta: float) -> dict[str, float]:
    """Advantage statistics over counted tokens, the teacher-student gap, forks, tokens."""
    adv, groups, gap = [], [], []
    for d in batch.decisions():
        on = d.mask > 0
        diff = (d.teacher_logp - d.old_logp)[on]
        adv.extend(np.clip(diff, -delta, delta))
        groups.extend([d.tree] * int(on.sum()))
        gap.extend(diff)
    return {
        **advantage_metrics(adv, groups),
        "opd/teacher_minus_student": float(np.mean(gap)) if gap else 0.0,
        "opd/forks": float(sum(len(t.meta.get("forks", [])) for t in batch.trees)),
        "tokens/student": float(sum(t.stats.generated_tokens for t in batch.trees)),
    }


def main(args: Args, algo: str = "branch_opd") -> TrainResult:
    """Train the student by (Branching) on-policy distillation from ``args.teacher``."""
    run = Run(args, algo)
    teacher = run.load_frozen(args.teacher)
    hook = _teacher_hook(run, teacher)
    detectors = DETECTOR_SETS[args.pbr](run) if run.kind.name == "generate" else []
    for _ in run.loop():
        # steps 1-4: main trajectory, forks, k continuations (or a baseline's rollouts)
        # (all prompts' trees in lockstep: one batched policy call per turn)
        trees = run.rollouts(
            [
                functools.partial(ROLLOUTS[args.rollouts], run, args, s, run.rng(i), hook)
                for i, s in enumerate(run.prompt_seeds())
            ]
        )
        batch = Batch(trees, success_threshold=args.success_threshold)
        run.frozen_logprobs(teacher, batch, "teacher_logp")  # the teacher scores every token
        _constraints(run, batch, detectors)

        # steps 5-6: L_tree + Psi[lambda mean l_proto]
        positions = (lambda row: [con.position for con in row.cache["pbr"]]) if detectors else None
        update = functools.partial(loss, args, batch=batch)
        run.log(run.updates(batch, update, logit_positions=positions))
        run.log(rollout_metrics(batch))
        run.log(_distillation_metrics(batch, args.delta))
    return run.close()
