"""``branchgym bench learners``: the reference learners side by side at matched compute.

Every learner trains the tiny random Qwen2 (scoring policy) on the CI maze
(TextTreeMDP, depth 3, 3 exits, Bernoulli rewards, structure seed 2: uniform policy
0.43, optimal 0.92) with the same rollouts per prompt (N = 7: Branching PO's M = 2,
K = 4; GRPO/RLOO N = 7; Bellman PO G = 7; Branching OPD 1 + B k = 7 at most, its
multi-rollout baseline n = 7), the same prompts per step and learning rate, over
several seeds. Success is exact (``branchgym.agents.evaluation.exact_value``), so the
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

import numpy as np

from branchgym.bench.common import Report

__all__ = ["configure", "main", "ENV_KWARGS"]

ENV_KWARGS = {"depth": 3, "n_actions": 3, "reward_kind": "bernoulli", "structure_seed": 2}

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


def configure(parser: argparse.ArgumentParser) -> None:
    """Add this study's options."""
    parser.add_argument("--out", default="results", help="results folder (default: results)")
    parser.add_argument(
        "--algos", nargs="*", default=["bpo", "grpo", "rloo", "bellman_po"], choices=list(MATCHED)
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="1 seed, 4 steps (CI)")


def _teacher(folder: Path, args: argparse.Namespace) -> str:
    from branchgym.agents.train import train

    result = train(
        "sft",
        env_kwargs=ENV_KWARGS,
        policy="scoring",
        lr=3e-4,
        steps=60,
        episodes=64,
        batch_episodes=8,
        noise=0.3,
        threads=args.threads,
        progress=False,
        out_dir=str(folder / "teacher"),
    )
    return str(result.checkpoint)


def _one(algo: str, seed: int, args: argparse.Namespace, folder: Path, teacher: str | None) -> dict:
    from branchgym.agents.train import train

    options = {
        "env_kwargs": ENV_KWARGS,
        "policy": "scoring",
        "seed": seed,
        "steps": args.steps,
        "prompts_per_step": args.prompts,
        "lr": args.lr,
        "threads": args.threads,
        "progress": False,
        "eval_episodes": 1,
        "eval_every": args.eval_every,
        "out_dir": str(folder / f"{algo}-{seed}"),
        **MATCHED[algo],
    }
    if algo in DISTILL:
        options["teacher"] = teacher
    result = train(algo, **options)
    hist = result.history
    curve = [(h["step"], h["eval/exact_value"]) for h in hist if "eval/exact_value" in h]
    curve = sorted(dict(curve).items())
    steps = [h for h in hist if "charts/success" in h]
    norms = [h["grad/norm"] for h in steps if "grad/norm" in h]
    half = len(norms) // 2
    return {
        "curve": curve,
        "start": curve[0][1],
        "end": curve[-1][1],
        "grad_var_early": float(np.var(norms[:half], ddof=1)) if half > 1 else float("nan"),
        "grad_var_late": float(np.var(norms[half:], ddof=1))
        if len(norms) - half > 1
        else float("nan"),
        "nondegenerate": float(np.mean([h["advantages/nondegenerate_frac"] for h in steps])),
        "rollouts": float(np.mean([h["charts/rollouts"] for h in steps])),
        "env_steps": float(np.mean([h["env/steps"] for h in steps])),
        "tokens": float(np.mean([h["tokens/generated"] for h in steps])),
        "step_s": float(np.mean([h["time/step_s"] for h in steps])),
    }


def _mean_se(values: list[float]) -> tuple[float, float]:
    v = np.asarray(values, dtype=float)
    se = float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 else float("nan")
    return float(v.mean()), se


def main(args: argparse.Namespace) -> int:
    """Train every learner on every seed; print and save the table and the curves."""
    from tqdm import tqdm

    if args.quick:
        args.seeds, args.steps, args.eval_every = 1, 4, 2
    report = Report(args.out, "learners", "branchgym bench learners")
    report.add(
        f"TextTreeMDP {ENV_KWARGS}, tiny Qwen2 with the scoring policy, N = 7 rollouts per "
        f"prompt, {args.prompts} prompts per step, {args.steps} steps, lr {args.lr}, "
        f"{args.seeds} seeds; exact success (no evaluation noise)."
    )
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_learners_") as tmp:
        folder = Path(tmp)
        teacher = _teacher(folder, args) if any(a in DISTILL for a in args.algos) else None
        jobs = [(a, s) for a in args.algos for s in range(args.seeds)]
        for algo, seed in tqdm(jobs, desc="learners", unit="run"):
            runs.setdefault(algo, []).append(_one(algo, seed, args, folder, teacher))
    report.data = {"args": vars(args), "runs": runs}
    mean_curves = {}
    for algo, rs in runs.items():
        steps = [s for s, _ in rs[0]["curve"]]
        mean_curves[algo] = (steps, np.mean([[v for _, v in r["curve"]] for r in rs], axis=0))
    target = mean_curves["grpo"][1][-1] if "grpo" in mean_curves else None
    rows = []
    for algo, rs in runs.items():
        start, start_se = _mean_se([r["start"] for r in rs])
        end, end_se = _mean_se([r["end"] for r in rs])
        reach = "n/a"
        if target is not None:
            steps, curve = mean_curves[algo]
            hit = [s for s, v in zip(steps, curve, strict=True) if s > 0 and v >= target]
            reach = str(hit[0]) if hit else f"> {steps[-1]}"
        rows.append(
            [
                algo,
                f"{start:.3f}",
                f"{end:.3f} ± {end_se:.3f}" if not math.isnan(end_se) else f"{end:.3f}",
                reach,
                _mean_se([r["grad_var_early"] for r in rs])[0],
                _mean_se([r["grad_var_late"] for r in rs])[0],
                _mean_se([r["nondegenerate"] for r in rs])[0],
                _mean_se([r["rollouts"] for r in rs])[0] / args.prompts,
                _mean_se([r["env_steps"] for r in rs])[0],
                _mean_se([r["tokens"] for r in rs])[0],
                _mean_se([r["step_s"] for r in rs])[0],
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
        for key in ("grad_var_early", "grad_var_late"):
            b = _mean_se([r[key] for r in runs["bpo"]])[0]
            g = _mean_se([r[key] for r in runs["grpo"]])[0]
            ratios.append(b / g if g else float("nan"))
        line = (
            f"grad-norm variance BPO/GRPO: early {ratios[0]:.2f}, late {ratios[1]:.2f} "
            "(source: 0.42 early, 0.58 late)"
        )
        report.add(line)
        print(line)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for algo, (steps, curve) in mean_curves.items():
        ax.plot(steps, curve, marker="o", label=algo)
    ax.axhline(0.918, color="gray", ls=":", label="optimal")
    ax.set_xlabel("step")
    ax.set_ylabel("exact success")
    ax.legend(fontsize=8)
    report.figure(fig, "success", f"exact success by step, mean of {args.seeds} seeds")
    path = report.save()
    print(f"report: {path}")
    return 0
