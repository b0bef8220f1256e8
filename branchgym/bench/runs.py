"""Training runs for the learning studies: one function runs a learner, one summarises seeds.

:func:`run_learner` trains one learner on one seed through :func:`branchgym.agents.train.train`
and reduces its metrics history to what the studies report: the evaluation curve (exact
success on TextTreeMDP, sampled success elsewhere) against updates and against student
tokens, gradient norms per update, the share of non-degenerate advantages, rollouts,
environment steps, tokens and seconds per step. :func:`summarise` turns several seeds into
means and standard errors. The ``learning``, ``distill``, ``bellman`` and ``learners``
studies all use them, so every study measures the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "RECOMMENDED_BPO",
    "recommended_bpo",
    "CI_MAZE",
    "STUDY_MAZE",
    "SeedResult",
    "mean_curve",
    "mean_se",
    "reach_step",
    "run_learner",
    "sft_checkpoint",
    "training_options",
    "window_variance",
]

#: The CI maze of the learner tests (uniform 0.43, optimal 0.92; exact success).
CI_MAZE = {"depth": 3, "n_actions": 3, "reward_kind": "bernoulli", "structure_seed": 2}
#: A deeper maze for the learning studies (uniform 0.44, optimal 0.955).
STUDY_MAZE = {"depth": 4, "n_actions": 3, "reward_kind": "bernoulli", "structure_seed": 2}


#: The Branching PO design docs/estimators.md recommends, as ``bpo`` options: G = 5
#: backbones branched at the horizon's last decision (``branch_depths``, from the maze:
#: :func:`recommended_bpo`), value-difference credit, planned per-depth weights; N = 20
#: rollouts per prompt, unbiased whether or not episodes end early.
RECOMMENDED_BPO: dict[str, Any] = {
    "schedule": "depths",
    "m": 1,
    "k": 4,
    "backbones": 5,
    "credit": "value_diff",
    "depth_weight": True,
    "depth_count": "backbone",
    "gap_unit": "steps",
}


def recommended_bpo(maze: dict[str, Any]) -> dict[str, Any]:
    """:data:`RECOMMENDED_BPO` on ``maze``: branched at its last decision (depth - 1)."""
    return {**RECOMMENDED_BPO, "branch_depths": (int(maze["depth"]) - 1,)}


@dataclasses.dataclass
class SeedResult:
    """One learner on one seed, reduced to what the studies report.

    Attributes:
        algo: The learner.
        seed: Its seed.
        label: The configuration's name in tables (``bpo K=8``).
        curve: ``(update, success)`` at each evaluation (exact on TextTreeMDP).
        tokens_at: Student tokens generated before each evaluation.
        grad_norms: Gradient norm of every optimizer update.
        history: Every logged metrics line (for study-specific figures).
        nondegenerate: Mean share of prompts with max |A| > 0.1.
        rollouts: Rollouts per step; env_steps and tokens per step; step_s seconds.
        checkpoint: The final checkpoint folder.
    """

    algo: str
    seed: int
    label: str
    curve: list[tuple[int, float]]
    tokens_at: list[float]
    grad_norms: list[float]
    history: list[dict[str, float]]
    nondegenerate: float
    rollouts: float
    env_steps: float
    tokens: float
    step_s: float
    checkpoint: str | None

    @property
    def start(self) -> float:
        """Success before training."""
        return self.curve[0][1] if self.curve else float("nan")

    @property
    def end(self) -> float:
        """Success after training."""
        return self.curve[-1][1] if self.curve else float("nan")

    def metric(self, key: str) -> list[float]:
        """Every logged value of ``key`` (training steps only)."""
        return [float(h[key]) for h in self.history if key in h]


#: Options every training run of the current study gets (``branchgym bench --log``).
_OPTIONS: dict[str, Any] = {}


@contextlib.contextmanager
def training_options(**options: Any) -> Iterator[None]:
    """Give every run :func:`run_learner` and :func:`sft_checkpoint` start these options.

    ``branchgym bench STUDY --log tensorboard`` uses it, so the studies that train log
    through the same sinks as ``branchgym train`` without each study passing them on.
    """
    saved = dict(_OPTIONS)
    _OPTIONS.update(options)
    try:
        yield
    finally:
        _OPTIONS.clear()
        _OPTIONS.update(saved)


def run_learner(
    algo: str,
    seed: int,
    folder: Path,
    *,
    label: str | None = None,
    env_id: str = "branchgym/TextTreeMDP-v0",
    env_kwargs: dict[str, Any] | None = None,
    **options: Any,
) -> SeedResult:
    """Train ``algo`` on ``seed`` (options as for ``branchgym train``) and reduce the history."""
    from branchgym.agents.train import train

    label = label or algo
    out = folder / f"{label.replace(' ', '_').replace('=', '')}-{seed}"
    opts = {"policy": "scoring", "progress": False, "overwrite": True, **_OPTIONS, **options}
    result = train(
        algo, env_id=env_id, env_kwargs=dict(env_kwargs or {}), seed=seed, out_dir=str(out), **opts
    )
    hist = result.history
    key = "eval/exact_value" if any("eval/exact_value" in h for h in hist) else "eval/success"
    evals = dict((int(h["step"]), float(h[key])) for h in hist if key in h)
    steps = [h for h in hist if "charts/success" in h]
    tokens_by_step = {int(h["step"]): float(h.get("tokens/generated", 0.0)) for h in steps}
    cum, tokens_at = 0.0, []
    for s in sorted(evals):
        cum = sum(v for k, v in tokens_by_step.items() if k <= s)
        tokens_at.append(cum)

    def mean_of(k: str) -> float:
        vals = [float(h[k]) for h in steps if k in h]
        return float(np.mean(vals)) if vals else float("nan")

    return SeedResult(
        algo=algo,
        seed=seed,
        label=label,
        curve=sorted(evals.items()),
        tokens_at=tokens_at,
        grad_norms=[float(h["grad/norm"]) for h in hist if "grad/norm" in h],
        history=hist,
        nondegenerate=mean_of("advantages/nondegenerate_frac"),
        rollouts=mean_of("charts/rollouts"),
        env_steps=mean_of("env/steps"),
        tokens=mean_of("tokens/generated"),
        step_s=mean_of("time/step_s"),
        checkpoint=str(result.checkpoint) if result.checkpoint else None,
    )


def sft_checkpoint(
    folder: Path, *, env_id: str, env_kwargs: dict[str, Any], steps: int = 60, **options: Any
) -> str:
    """SFT the tiny model on the env's scripted expert (the source's warm start)."""
    from branchgym.agents.train import train

    opts = {
        "policy": "scoring",
        "lr": 3e-4,
        "episodes": 64,
        "batch_episodes": 8,
        "noise": 0.3,
        "progress": False,
        "overwrite": True,
        **_OPTIONS,
        **options,
    }
    result = train(
        "sft", env_id=env_id, env_kwargs=env_kwargs, steps=steps, out_dir=str(folder), **opts
    )
    return str(result.checkpoint)


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error (NaN-free inputs; SE is NaN for one value)."""
    v = np.asarray([x for x in values if not math.isnan(x)], dtype=float)
    if v.size == 0:
        return float("nan"), float("nan")
    se = float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 else float("nan")
    return float(v.mean()), se


def mean_curve(runs: list[SeedResult]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(updates, mean success, standard error) over the runs' common evaluation steps."""
    steps = sorted(set.intersection(*(set(s for s, _ in r.curve) for r in runs)))
    vals = np.array([[dict(r.curve)[s] for s in steps] for r in runs])
    se = vals.std(axis=0, ddof=1) / math.sqrt(len(runs)) if len(runs) > 1 else np.zeros(len(steps))
    return np.array(steps), vals.mean(axis=0), se


def reach_step(runs: list[SeedResult], target: float) -> int | None:
    """First evaluated update (> 0) at which the mean curve reaches ``target``."""
    steps, mean, _ = mean_curve(runs)
    hits = [int(s) for s, v in zip(steps, mean, strict=True) if s > 0 and v >= target - 1e-9]
    return hits[0] if hits else None


def window_variance(norms: list[float], parts: int = 3, *, scale_free: bool = False) -> list[float]:
    """Variance of the gradient norm within each of ``parts`` consecutive windows.

    ``scale_free`` divides by the window's squared mean (the squared coefficient of
    variation), so learners whose advantages have different scales compare fairly.
    """
    out = []
    for chunk in np.array_split(np.asarray(norms, dtype=float), parts):
        if chunk.size < 2:
            out.append(float("nan"))
            continue
        v = float(chunk.var(ddof=1))
        out.append(v / float(chunk.mean()) ** 2 if scale_free and chunk.mean() else v)
    return out
