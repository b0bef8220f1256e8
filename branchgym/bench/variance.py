"""``branchgym bench variance``: will branching pay on this task?

The source's diagnostic before training (docs/algorithms.md §1, "Diagnostic
before training"): for a batch of prompts, sample 8 independent trajectories, snapshot
each at its midpoint and sample 4 completions from each snapshot; compare the variance of
the 8 independent returns with the mean variance within a snapshot. By the law of total
variance (Theorem 2) the first is ``sigma_t^2 + nu_t^2`` and the second ``sigma_t^2``, so

    Var(A^BPO) / Var(A^GRPO) = sigma_t^2 / (sigma_t^2 + nu_t^2) ~ within / independent

(the K/(K-1) factors cancel). A ratio well below 1 means siblings share much of their
variance through the prefix: branching pays. On TreeMDP the exact ratio is printed next
to the measured one.

The rollouts come from the branching engine itself: each trajectory is a rollout tree
with one branch point at the middle of its backbone (schedule ``even``, M = 1) and
K = 5 (the backbone plus 4 fresh completions). The backbones are the independent
trajectories; the 4 fresh siblings give the within-snapshot variance (the backbone's own
continuation is left out of it, since the midpoint was chosen knowing its length).

``branchgym diagnose`` (:mod:`branchgym.bench.diagnose`) states its answer from this
diagnostic and from an estimator-level figure.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
from tqdm import tqdm

from branchgym.bench.common import Report

__all__ = [
    "configure",
    "main",
    "Diagnostic",
    "diagnose",
    "make_policy",
    "DEFAULT_ENVS",
]

#: env id -> gym.make kwargs for the default study.
DEFAULT_ENVS: dict[str, dict[str, Any]] = {
    "branchgym/TreeMDP-v0": {"depth": 6, "n_outcomes": 2, "transition_noise": 0.3},
    "branchgym/TextTreeMDP-v0": {"depth": 6, "n_outcomes": 2, "transition_noise": 0.3},
    "branchgym/WebShop-v0": {"max_episode_steps": 15},
    "branchgym/ALFWorld-v0": {"max_episode_steps": 12, "expert_plan_in_info": True},
}

#: env id -> the policy the default study uses there (``random`` elsewhere). A random
#: agent never solves an ALFWorld task, so its returns carry no variance to decompose;
#: the planner expert with half of its actions random, within 12 steps, does.
DEFAULT_POLICY = {"branchgym/ALFWorld-v0": "expert"}

#: Ratio below which branching is worth it (a third of the variance removed or more).
PAYS_BELOW = 0.8


@dataclasses.dataclass
class Diagnostic:
    """The diagnostic's figures for one env and policy.

    Attributes:
        env_id: The env.
        policy: What played.
        prompts: Task instances (reset seeds).
        var_independent: Mean over prompts of the variance of the independent returns.
        var_within: Mean over prompts and snapshots of the variance within a snapshot.
        ratio: ``var_within / var_independent``: the implied Var(A^BPO)/Var(A^GRPO).
        ratio_se: Bootstrap standard error of ``ratio`` over prompts.
        exact_ratio: On TreeMDP, ``sigma_t^2 / (sigma_t^2 + nu_t^2)`` at the midpoint.
        mean_return: Mean independent return.
        mean_length: Mean backbone length (decisions).
        seconds: Wall-clock time.
    """

    env_id: str
    policy: str
    prompts: int
    var_independent: float
    var_within: float
    ratio: float
    ratio_se: float
    exact_ratio: float | None
    mean_return: float
    mean_length: float
    seconds: float

    @property
    def verdict(self) -> str:
        """One line: does branching pay here?"""
        if not np.isfinite(self.ratio):
            return (
                "no verdict: the independent returns do not vary (every trajectory scores "
                "the same), so there is no advantage signal to reduce; try a better policy"
            )
        cut = 100 * (1 - self.ratio)
        if self.ratio < PAYS_BELOW:
            return (
                f"branching pays: siblings cut the advantage variance by about {cut:.0f} % "
                f"(within-snapshot variance is {100 * self.ratio:.0f} % of the independent one)"
            )
        return (
            f"branching hardly pays: within-snapshot variance is {100 * self.ratio:.0f} % of "
            "the independent one (most variance arises after the midpoint); independent "
            "rollouts are about as good"
        )


def make_policy(env: Any, name: str, *, max_new_tokens: int = 32) -> tuple[Any, str]:
    """A policy by name.

    ``random``: uniform tabular on TreeMDP, uniform over the admissible actions elsewhere.
    ``expert``: the env's planner (``info["expert_plan"]``, e.g. ALFWorld with
    ``expert_plan_in_info=True``) with probability 0.5, a uniform admissible action
    otherwise. Anything else is a model (``tiny``, ``smollm2``, a folder) behind LLMPolicy.
    """
    from branchgym.agents.policies.policy import TabularPolicy, TextPolicy

    base = env.unwrapped
    if name == "expert":
        return TextPolicy(weights=_expert_weights(0.5)), "planner expert, 50 % random"
    if name == "random":
        if hasattr(base, "tree"):
            return TabularPolicy.uniform(env), "uniform tabular"
        return TextPolicy(), "uniform over admissible actions"
    from branchgym.agents.engines.hf import HFEngine
    from branchgym.agents.policies.models import load_model
    from branchgym.agents.policies.policy import LLMPolicy

    model, tok = load_model(name)
    engine = HFEngine(model, tok, max_new_tokens=max_new_tokens, threads=1)
    return LLMPolicy(engine, max_new_tokens=max_new_tokens), f"{name} (LLMPolicy)"


def _expert_weights(eps: float) -> Callable[[Any, list[str]], list[float]]:
    """TextPolicy weights: the first step of ``info["expert_plan"]`` w.p. 1 - eps."""

    def weights(context: Any, candidates: list[str]) -> list[float]:
        plan = context.current_info.get("expert_plan") or []
        if not plan:
            raise ValueError(
                "the expert policy needs info['expert_plan'] (ALFWorld: make the env with "
                "expert_plan_in_info=True)"
            )
        base = eps / len(candidates)
        return [base + (1 - eps) * (c == plan[0]) for c in candidates]

    return weights


def _exact_ratio(env: Any, policy: Any, depth: int) -> float | None:
    base = env.unwrapped
    table = getattr(policy, "table", None)
    if not hasattr(base, "tree") or table is None:
        return None
    from branchgym.envs.toy.theory import variance_decomposition

    d = variance_decomposition(
        base.tree, np.broadcast_to(table, (base.tree.n_nodes, table.shape[-1])), depth
    )
    total = d.sigma2 + d.nu2
    return float(d.sigma2 / total) if total > 0 else None


def diagnose(
    env_id: str,
    env_kwargs: dict[str, Any] | None = None,
    *,
    policy: str | Any = "random",
    prompts: int = 8,
    independent: int = 8,
    completions: int = 4,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> Diagnostic:
    """Run the source's diagnostic on one env.

    Args:
        env_id: A registered env id.
        env_kwargs: ``gym.make`` kwargs.
        policy: ``random``, a model name/folder (``tiny``, ``smollm2``, a path), or a
            :class:`~branchgym.agents.policies.policy.Policy`.
        prompts: Task instances (reset seeds ``seed .. seed + prompts - 1``).
        independent: Independent trajectories per prompt (the source: 8).
        completions: Completions sampled from each midpoint snapshot (the source: 4).
        seed: First reset seed; also seeds the policy's sampling.
        progress: Called with 1 after each trajectory (for progress bars).
    """
    import time

    import gymnasium as gym

    from branchgym.rollout.executor_base import EnvRecipe
    from branchgym.rollout.executors import InProcessExecutor
    from branchgym.rollout.grow import grow_tree

    if independent < 2 or completions < 2:
        raise ValueError("need at least 2 independent trajectories and 2 completions")
    kwargs = dict(env_kwargs or {})
    probe = gym.make(env_id, **kwargs)
    if isinstance(policy, str):
        pol, label = make_policy(probe, policy)
    else:
        pol, label = policy, type(policy).__name__
    t0 = time.perf_counter()
    spec = EnvRecipe(env_id, kwargs)
    ex = InProcessExecutor()
    var_ind, var_win, rets, lengths = [], [], [], []
    mid_depths = []
    try:
        for p in range(prompts):
            backbone_returns, within = [], []
            for i in range(independent):
                tree = grow_tree(
                    spec,
                    pol,
                    "even",
                    m=1,
                    k=1 + completions,
                    seed=seed + p,
                    rng=(seed + p) * 10_007 + i,
                    env_seed=(seed + p) * 10_007 + i,  # same task, independent env noise
                    executor=ex,
                )
                rtg = tree.returns_to_go()
                backbone = tree.backbone
                backbone_returns.append(float(rtg[backbone[0]]) if backbone else 0.0)
                lengths.append(len(backbone))
                bps = tree.branch_points()
                if bps:
                    fresh = np.asarray(bps[0].returns[1:], dtype=float)
                    within.append(float(fresh.var(ddof=1)))
                    mid_depths.append(bps[0].step)
                if progress:
                    progress(1)
            var_ind.append(float(np.var(backbone_returns, ddof=1)))
            var_win.append(float(np.mean(within)) if within else float("nan"))
            rets.extend(backbone_returns)
    finally:
        ex.shutdown()
    vi, vw = np.asarray(var_ind), np.asarray(var_win)
    ratio = float(np.nanmean(vw) / vi.mean()) if vi.mean() > 0 else float("nan")
    boot = []
    rng = np.random.default_rng(seed)
    for _ in range(500):
        idx = rng.integers(len(vi), size=len(vi))
        if vi[idx].mean() > 0:
            boot.append(np.nanmean(vw[idx]) / vi[idx].mean())
    exact = None
    if mid_depths and len(set(mid_depths)) == 1:
        exact = _exact_ratio(probe, pol, mid_depths[0])
    probe.close()
    return Diagnostic(
        env_id=env_id,
        policy=label,
        prompts=prompts,
        var_independent=float(vi.mean()),
        var_within=float(np.nanmean(vw)),
        ratio=ratio,
        ratio_se=float(np.std(boot)) if boot else float("nan"),
        exact_ratio=exact,
        mean_return=float(np.mean(rets)),
        mean_length=float(np.mean(lengths)),
        seconds=time.perf_counter() - t0,
    )


# ------------------------------------------------------------------------ the study


def configure(parser: argparse.ArgumentParser) -> None:
    """Add this study's options."""
    parser.add_argument("--out", default="results", help="results folder (default: results)")
    parser.add_argument("--envs", nargs="*", default=None, help="env ids (default: toy + adapters)")
    parser.add_argument(
        "--policy", default="random", help="random, tiny, smollm2 or a model folder"
    )
    parser.add_argument("--prompts", type=int, default=8, help="task instances per env")
    parser.add_argument("--independent", type=int, default=8, help="trajectories per prompt")
    parser.add_argument("--completions", type=int, default=4, help="completions per snapshot")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="4 prompts, toy envs only (CI)")


def main(args: argparse.Namespace) -> int:
    """Run the diagnostic per env; write ``<out>/variance.md`` and a plot."""
    from branchgym.registration import branch_spec

    if args.envs:
        envs = {e: DEFAULT_ENVS.get(e, {}) for e in args.envs}
    elif args.quick:
        envs = {e: v for e, v in DEFAULT_ENVS.items() if "TreeMDP" in e}
    else:
        envs = dict(DEFAULT_ENVS)
    prompts = min(args.prompts, 4) if args.quick else args.prompts
    for env_id in list(envs):
        missing = branch_spec(env_id).missing() if env_id.startswith("branchgym/") else []
        if missing:
            print(f"variance bench: {env_id} skipped (needs extra {', '.join(missing)})")
            del envs[env_id]
    results: list[Diagnostic] = []
    total = len(envs) * prompts * args.independent
    with tqdm(total=total, desc="variance bench: trajectories") as bar:
        for env_id, kwargs in envs.items():
            policy = (
                args.policy if args.policy != "random" else DEFAULT_POLICY.get(env_id, "random")
            )
            results.append(
                diagnose(
                    env_id,
                    kwargs,
                    policy=policy,
                    prompts=prompts,
                    independent=args.independent,
                    completions=args.completions,
                    seed=args.seed,
                    progress=bar.update,
                )
            )
    report = Report(args.out, "variance", "branchgym bench variance")
    report.add(
        f"## The diagnostic before training\n\nPer env: {prompts} prompts (reset seeds "
        f"{args.seed}..{args.seed + prompts - 1}), {args.independent} independent "
        f"trajectories each, one snapshot at each trajectory's midpoint and "
        f"{args.completions} fresh completions from it. *ratio* = mean within-snapshot "
        "variance / variance of the independent returns = the implied "
        "Var(A^BPO) / Var(A^GRPO) (Theorem 2; the K/(K-1) factors cancel), with a "
        "bootstrap standard error over prompts. *exact*: sigma_t^2 / (sigma_t^2 + "
        "nu_t^2) at the midpoint, from TreeMDP's exact values (same policy)."
    )
    rows = [
        [
            d.env_id.split("/")[-1],
            d.policy,
            d.prompts,
            f"{d.mean_return:.3f}",
            f"{d.mean_length:.1f}",
            f"{d.var_independent:.4f}",
            f"{d.var_within:.4f}",
            f"{d.ratio:.3f} ± {d.ratio_se:.3f}",
            "" if d.exact_ratio is None else f"{d.exact_ratio:.3f}",
            f"{d.seconds:.1f}",
        ]
        for d in results
    ]
    print(
        report.table(
            [
                "env",
                "policy",
                "prompts",
                "mean return",
                "length",
                "Var indep",
                "Var within",
                "ratio (BPO/GRPO)",
                "exact",
                "s",
            ],
            rows,
        )
    )
    for d in results:
        line = f"{d.env_id}: {d.verdict}"
        print(line)
        report.add(f"- {line}")
    report.data["diagnostics"] = [dataclasses.asdict(d) for d in results]
    if results:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 0.6 + 0.5 * len(results)))
        y = np.arange(len(results))
        ax.barh(
            y,
            [d.ratio for d in results],
            xerr=[d.ratio_se for d in results],
            color="tab:blue",
            label="measured",
        )
        for i, d in enumerate(results):
            if d.exact_ratio is not None:
                ax.plot(d.exact_ratio, i, "k|", markersize=16, label="exact" if i == 0 else None)
        ax.axvline(1.0, color="0.5", lw=0.8, ls=":")
        ax.axvline(PAYS_BELOW, color="tab:green", lw=0.8, ls="--", label="pays below")
        ax.set_yticks(y, [d.env_id.split("/")[-1] for d in results])
        ax.set_xlabel("Var(A^BPO) / Var(A^GRPO) implied by the diagnostic")
        ax.legend(fontsize=7, loc="lower right")
        report.figure(
            fig, "ratio", "Implied advantage-variance ratio per env (lower: branching pays)"
        )
    path = report.save()
    print(f"\nreport: {path}")
    return 0
