"""``branchgym bench learners``: the reference learners side by side at matched compute.

Every learner trains the tiny random Qwen2 (scoring policy) on the CI maze
(TextTreeMDP, depth 3, 3 exits, Bernoulli rewards, structure seed 2: uniform policy
0.43, optimal 0.92) with the same rollouts per prompt (N = 7: Branching PO's M = 2,
K = 4; GRPO/RLOO N = 7; Bellman PO G = 7; Branching OPD 1 + B k = 7 at most, its
multi-rollout baseline n = 7), the same prompts per step and learning rate, over
several seeds. Success is exact (``branchgym.agents.training.evaluation.exact_value``), so the
curves carry no evaluation noise, only training noise across seeds.

Reported per learner: exact success at the start and the end (mean and standard error
over seeds), the first evaluated step at which the mean curve reaches GRPO's final
level (the source: GRPO's level in 38 % fewer updates), the variance of the gradient
norm across updates in the first and second half (the source's BPO/GRPO ratio: 0.42
early, 0.58 late), the share of prompts with a non-degenerate advantage (max |A| >
0.1), rollouts, environment steps and generated tokens per step, and seconds per step.
A PNG plots the mean curves. This study measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path
from typing import Any

from branchgym.bench import source
from branchgym.bench.common import Report
from branchgym.bench.runs import (
    CI_MAZE,
    RECOMMENDED_BPO,
    SeedResult,
    mean_curve,
    mean_se,
    reach_step,
    run_learner,
    sft_checkpoint,
    window_variance,
)

__all__ = ["configure", "main", "ENV_KWARGS", "MAZES", "VARIANTS", "variant_options"]

#: The default maze (``MAZES["ci"]``).
ENV_KWARGS = CI_MAZE

#: learner -> options that give it N = 7 rollouts per prompt
MATCHED: dict[str, dict[str, Any]] = {
    "bpo": {"m": 2, "k": 4, "gap_unit": "steps"},
    "grpo": {"n": 7},
    "rloo": {"n": 7},
    "bellman_po": {"g": 7, "updates_per_batch": 4},
    "branch_opd": {"b": 3, "k": 2},
    "opd": {},
    "opd_multi": {"n": 7},
}
DISTILL = ("branch_opd", "opd", "opd_multi")

#: labelled runs of a learner with other options: the unbiased branching variant the
#: estimator study recommends (docs/estimators.md: G = 5 backbones branched at the
#: horizon's last decision where the line still runs, value-difference credit, planned
#: per-depth weights; N = 20 rollouts per prompt), unbiased whether or not episodes end
#: early, and RLOO at the same N. ``branch_depths`` comes from the maze
#: (:func:`variant_options`).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "bpo_hz_vd": ("bpo", RECOMMENDED_BPO),
    "rloo_n20": ("rloo", {"n": 20}),
}

#: the mazes: the CI maze, and a long noisy one of the family where the estimator study
#: finds branching pays (most of the return's variance resolved late)
MAZES: dict[str, dict[str, Any]] = {
    "ci": ENV_KWARGS,
    "long_noisy": {  # depth 6: the deepest whose 1,365 states still evaluate exactly
        "depth": 6,
        "n_actions": 2,
        "transition_noise": 0.6,
        "reward_kind": "bernoulli",
        "structure_seed": 2,
    },
}


def variant_options(label: str, maze: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(learner, options) of the run ``label`` on ``maze``.

    A ``depths`` variant without its ``branch_depths`` branches at the maze's last
    decision (depth - 1).
    """
    learner, fixed = VARIANTS.get(label, (label, MATCHED.get(label, {})))
    if fixed.get("schedule") == "depths" and "branch_depths" not in fixed:
        fixed = {**fixed, "branch_depths": (int(maze["depth"]) - 1,)}
    return learner, dict(fixed)


_SRC = source.GRAD_NORM_VARIANCE_RATIO  # the source's BPO/GRPO ratios


def configure(parser: argparse.ArgumentParser) -> None:
    """Add this study's options."""
    parser.add_argument("--out", default="results", help="results folder (default: results)")
    parser.add_argument(
        "--algos",
        nargs="*",
        default=["bpo", "grpo", "rloo", "bellman_po"],
        choices=[*MATCHED, *VARIANTS],
    )
    parser.add_argument(
        "--maze",
        default="ci",
        choices=list(MAZES),
        help="ci (default) or long_noisy (depth 6, transition noise 0.6: where branching pays)",
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="1 seed, 4 steps (CI)")


def _one(
    algo: str, seed: int, args: argparse.Namespace, folder: Path, teacher: str | None
) -> SeedResult:
    maze = MAZES[args.maze]
    learner, fixed = variant_options(algo, maze)
    options: dict[str, Any] = {
        "steps": args.steps,
        "prompts_per_step": args.prompts,
        "lr": args.lr,
        "threads": args.threads,
        "eval_episodes": 1,
        "eval_every": args.eval_every,
        **fixed,
    }
    if algo in DISTILL:
        options["teacher"] = teacher
    return run_learner(learner, seed, folder, label=algo, env_kwargs=maze, **options)


def main(args: argparse.Namespace) -> int:
    """Train every learner on every seed; print and save the table and the curves."""
    from tqdm import tqdm

    if args.quick:
        args.seeds, args.steps, args.eval_every = 1, 4, 2
    report = Report(args.out, "learners", "branchgym bench learners")
    maze = MAZES[args.maze]
    report.add(
        f"TextTreeMDP {maze}, tiny Qwen2 with the scoring policy, N = 7 rollouts per "
        f"prompt (bpo_hz_vd and rloo_n20: N = 20), {args.prompts} prompts per step, "
        f"{args.steps} steps, lr {args.lr}, {args.seeds} seeds; exact success (no "
        "evaluation noise); env steps and tokens per step are in the table."
    )
    runs: dict[str, list[SeedResult]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_learners_") as tmp:
        folder = Path(tmp)
        teacher = None
        if any(a in DISTILL for a in args.algos):
            teacher = sft_checkpoint(
                folder / "teacher",
                env_id="branchgym/TextTreeMDP-v0",
                env_kwargs=maze,
                threads=args.threads,
            )
        jobs = [(a, s) for a in args.algos for s in range(args.seeds)]
        for algo, seed in tqdm(jobs, desc="learners", unit="run"):
            runs.setdefault(algo, []).append(_one(algo, seed, args, folder, teacher))
    report.data = {
        "args": vars(args),
        "runs": {
            a: [
                {
                    "seed": r.seed,
                    "curve": r.curve,
                    "start": r.start,
                    "end": r.end,
                    "rollouts": r.rollouts,
                    "tokens": r.tokens,
                    "grad_norms": r.grad_norms,
                }
                for r in rs
            ]
            for a, rs in runs.items()
        },
    }
    target = mean_curve(runs["grpo"])[1][-1] if "grpo" in runs else None

    def grad_var(r: SeedResult, part: int) -> float:
        return window_variance(r.grad_norms, 2)[part]

    rows = []
    for algo, rs in runs.items():
        end, end_se = mean_se([r.end for r in rs])
        reach = "n/a"
        if target is not None:
            hit = reach_step(rs, target)
            reach = str(hit) if hit is not None else f"> {mean_curve(rs)[0][-1]}"
        rows.append(
            [
                algo,
                f"{mean_se([r.start for r in rs])[0]:.3f}",
                f"{end:.3f} ± {end_se:.3f}" if not math.isnan(end_se) else f"{end:.3f}",
                reach,
                mean_se([grad_var(r, 0) for r in rs])[0],
                mean_se([grad_var(r, 1) for r in rs])[0],
                mean_se([r.nondegenerate for r in rs])[0],
                mean_se([r.rollouts for r in rs])[0] / args.prompts,
                mean_se([r.env_steps for r in rs])[0],
                mean_se([r.tokens for r in rs])[0],
                mean_se([r.step_s for r in rs])[0],
            ]
        )
    table = report.table(
        [
            "learner",
            "success start",
            "success end",
            "step reaching GRPO's end",
            "grad-norm var early",
            "grad-norm var late",
            "non-degenerate",
            "rollouts/prompt",
            "env steps/step",
            "tokens/step",
            "s/step",
        ],
        rows,
    )
    print(table)
    if "bpo" in runs and "grpo" in runs:
        ratios = []
        for part in (0, 1):
            b = mean_se([grad_var(r, part) for r in runs["bpo"]])[0]
            g = mean_se([grad_var(r, part) for r in runs["grpo"]])[0]
            ratios.append(b / g if g else float("nan"))
        line = (
            f"grad-norm variance BPO/GRPO: early {ratios[0]:.2f}, late {ratios[1]:.2f} "
            f"(source: {_SRC['early']} early, {_SRC['late']} late)"
        )
        report.add(line)
        print(line)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for algo, rs in runs.items():
        steps, curve, _ = mean_curve(rs)
        ax.plot(steps, curve, marker="o", label=algo)
    if args.maze == "ci":
        ax.axhline(0.918, color="gray", ls=":", label="optimal")
    ax.set_xlabel("step")
    ax.set_ylabel("exact success")
    ax.legend(fontsize=8)
    report.figure(fig, "success", f"exact success by step, mean of {args.seeds} seeds")
    path = report.save()
    print(f"report: {path}")
    return 0
