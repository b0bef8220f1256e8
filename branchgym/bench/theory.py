"""``branchgym bench theory``: the branching theory of the spec, exact next to measured.

On TreeMDP, whose values are exact, this study prints what ``docs/algorithms.md``
claims and what sampling through ``snapshot()``/``restore()`` measures:

* Theorem 2's worked example (two prefixes with V = 0.8 / 0.2, residual variance 0.05,
  K = 4: Var GRPO 0.187 vs Var BPO 0.067);
* Theorem 2 and Corollary 1 on a random tree: ``sigma_t^2``, ``nu_t^2`` and the
  advantage variances of independent vs branched groups at every branch depth, with a
  PNG plot;
* unbiasedness of eq. (4) at one branch state: measured mean sibling advantage per
  action against exact ``Q - V`` (and the self-including baseline's ``(K-1)/K`` shrink);
* Proposition 1 of Branching OPD: coverage ``1 - pi_old(a_0|s_b)^k`` by ``k``;
* what an engine that forgets to reseed siblings after ``restore()`` would measure.

Measured figures carry their standard errors; the study measures and prints, it
asserts nothing (the tests in ``tests/test_theory.py`` do).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import numpy as np
from tqdm import tqdm

from branchgym.bench.common import Report
from branchgym.envs.toy import TreeMDP, TreeStructure
from branchgym.envs.toy import theory as th

__all__ = ["configure", "main"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add this study's options."""
    parser.add_argument("--out", default="results", help="results folder (default: results)")
    parser.add_argument("--groups", type=int, default=4000, help="Monte Carlo groups per figure")
    parser.add_argument("--k", type=int, default=4, help="group size K (default 4, as the spec)")
    parser.add_argument("--depth", type=int, default=4, help="depth of the random tree")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="500 groups per figure (CI)")


def _loo_variance(returns: np.ndarray) -> tuple[float, float]:
    """Var of the leave-one-out advantage (mean 0): per-group mean of A^2, and its SE."""
    import torch

    from branchgym.agents.estimators.advantages import rloo_advantages

    adv = rloo_advantages(torch.as_tensor(returns)).advantages.numpy()
    stat = (adv**2).mean(axis=1)
    return float(stat.mean()), float(stat.std(ddof=1) / math.sqrt(stat.size))


def _pm(value: float, se: float) -> str:
    return f"{value:.4f} ± {se:.4f}"


def section_worked_example(report: Report, args: argparse.Namespace, rng: Any) -> None:
    """The spec's worked example of Theorem 2, exact and sampled."""
    leaf = lambda m: {"reward": m, "std": 0.05**0.5}  # noqa: E731
    prefix = lambda m: {"actions": [[(1.0, leaf(m))]]}  # noqa: E731
    tree = TreeStructure.from_nested({"actions": [[(0.5, prefix(0.8)), (0.5, prefix(0.2))]]})
    env = TreeMDP(structure=tree)
    policy = np.ones((tree.n_nodes, 1))
    exact = th.advantage_variances(tree, policy, 1, args.k)
    g = _loo_variance(th.independent_groups(env, policy, args.k, args.groups, rng))
    b = _loo_variance(th.branched_groups(env, policy, 1, args.k, args.groups, rng))
    report.add(
        "## Theorem 2, the worked example\n\nTwo equally likely prefixes with V = 0.8 and "
        f"0.2, residual variance 0.05 each, K = {args.k}; branching after the prefix. "
        f"{args.groups} groups per topology."
    )
    rows = [
        ["Var(A) independent (GRPO/RLOO)", "0.187", f"{exact.grpo:.4f}", _pm(*g)],
        ["Var(A) branched at t = 1 (BPO)", "0.067", f"{exact.bpo:.4f}", _pm(*b)],
        ["reduction", "64 %", f"{100 * exact.reduction:.1f} %", f"{100 * (1 - b[0] / g[0]):.1f} %"],
    ]
    print(report.table(["quantity", "spec", "exact", "measured ± SE"], rows))
    report.data["worked_example"] = {"exact": exact.__dict__, "grpo": g, "bpo": b}


def section_depths(report: Report, args: argparse.Namespace, rng: Any) -> None:
    """Theorem 2 and Corollary 1 at every branch depth of a random tree."""
    env = TreeMDP(
        depth=args.depth,
        n_actions=2,
        n_outcomes=2,
        transition_noise=0.4,
        reward_noise=0.2,
        structure_seed=args.seed,
    )
    policy = np.random.default_rng(args.seed).dirichlet(np.full(2, 2.0), size=env.tree.n_nodes)
    g = _loo_variance(th.independent_groups(env, policy, args.k, args.groups, rng))
    rows, data = [], []
    for t in tqdm(range(args.depth), desc="theory bench: branch depths", unit="depth"):
        dec = th.variance_decomposition(env, policy, t)
        exact = th.advantage_variances(env, policy, t, args.k)
        b = _loo_variance(th.branched_groups(env, policy, t, args.k, args.groups, rng))
        gap, se_gap = g[0] - b[0], math.hypot(g[1], b[1])
        rows.append(
            [
                t,
                f"{dec.sigma2:.4f}",
                f"{dec.nu2:.4f}",
                f"{exact.bpo:.4f}",
                _pm(*b),
                f"{exact.difference:.4f}",
                _pm(gap, se_gap),
                f"{exact.ratio:.3f}",
                f"{b[0] / g[0]:.3f}",
            ]
        )
        data.append({"t": t, **dec.__dict__, "exact_bpo": exact.bpo, "bpo": b, "gap": gap})
    report.add(
        f"## Theorem 2 and Corollary 1 by branch depth\n\nRandom TreeMDP (depth {args.depth}, "
        f"2 actions, 2 outcomes, seed {args.seed}), random tabular policy, K = {args.k}, "
        f"{args.groups} groups per row. Independent groups: Var(A) exact "
        f"{th.advantage_variances(env, policy, 0, args.k).grpo:.4f}, measured {_pm(*g)}. "
        "*gap* = Var(A_GRPO) - Var(A_BPO), exact K/(K-1) nu_t^2; *ratio* = Var(A_BPO) / "
        "Var(A_GRPO)."
    )
    print(
        report.table(
            [
                "t",
                "sigma_t^2",
                "nu_t^2",
                "Var BPO exact",
                "Var BPO measured",
                "gap exact",
                "gap measured",
                "ratio exact",
                "ratio measured",
            ],
            rows,
        )
    )
    report.data["depths"] = {"grpo": g, "rows": data}
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    ts = [d["t"] for d in data]
    f = args.k / (args.k - 1)
    ax.plot(ts, [f * (d["sigma2"] + d["nu2"]) for d in data], "k--", label="GRPO exact")
    ax.errorbar(ts, [g[0]] * len(ts), yerr=[g[1]] * len(ts), fmt="ks", ms=4, label="GRPO measured")
    ax.plot(ts, [d["exact_bpo"] for d in data], "C0-", label="BPO exact, K/(K-1) sigma_t^2")
    bpo = [d["bpo"] for d in data]
    ax.errorbar(
        ts, [m for m, _ in bpo], yerr=[se for _, se in bpo], fmt="C0o", ms=4, label="BPO measured"
    )
    ax.set_xlabel("branch depth t")
    ax.set_ylabel("Var(leave-one-out advantage)")
    ax.set_xticks(ts)
    ax.legend(fontsize=8)
    report.figure(fig, "depths", "Advantage variance by branch depth: exact lines, measured dots")


def section_unbiased(report: Report, args: argparse.Namespace, rng: Any) -> None:
    """Eq. (4) at one branch state: measured mean per action vs exact Q - V."""
    import torch

    from branchgym.agents.estimators.advantages import sibling_advantages

    env = TreeMDP(
        depth=3, n_actions=3, n_outcomes=2, transition_noise=0.3, reward_noise=0.2, structure_seed=1
    )
    policy = np.random.default_rng(1).dirichlet(np.full(3, 2.0), size=env.tree.n_nodes)
    env.reset(seed=0)
    env.step(0)
    state, k, n = int(env.node), args.k, args.groups
    returns, actions = np.empty((n, k)), np.empty((n, k), dtype=int)
    with env.snapshot() as snap:
        for i in range(n):
            returns[i], actions[i] = th.branch_siblings(env, snap, policy, k, rng)
    loo = sibling_advantages(torch.as_tensor(returns)).numpy()
    centred = returns - returns.mean(axis=1, keepdims=True)
    rows = []
    for a in range(3):
        hit = actions == a
        exact = th.sibling_advantage_mean(env, policy, state, a, k)
        rows.append(
            [
                a,
                f"{policy[state, a]:.3f}",
                f"{exact:+.4f}",
                _pm(*_cluster_mean(loo, hit)),
                f"{(k - 1) / k * exact:+.4f}",
                _pm(*_cluster_mean(centred, hit)),
            ]
        )
    report.add(
        f"## Unbiasedness of the sibling advantage (eq. 4)\n\nBranch state {state} of a "
        f"random TreeMDP, {n} groups of K = {k} siblings from one snapshot. Eq. (4)'s "
        "leave-one-out mean matches Q - V; a baseline that includes the sibling itself "
        "shrinks it by (K-1)/K."
    )
    print(
        report.table(
            ["action", "pi(a∣s)", "Q - V exact", "eq. 4 measured", "(K-1)/K (Q-V)", "self-incl."],
            rows,
        )
    )


def _cluster_mean(values: np.ndarray, hit: np.ndarray) -> tuple[float, float]:
    sums, counts = (values * hit).sum(1), hit.sum(1).astype(float)
    est = sums.sum() / counts.sum()
    resid = sums - est * counts
    n = sums.size
    return float(est), float(math.sqrt(n / (n - 1) * (resid**2).sum()) / counts.sum())


def section_coverage(report: Report, args: argparse.Namespace, rng: Any) -> None:
    """Proposition 1: coverage of k resampled branches."""
    probs = np.array([0.6, 0.3, 0.1])
    tree = TreeStructure.random(depth=2, n_actions=3, n_outcomes=1, seed=4)
    env = TreeMDP(structure=tree)
    policy = np.tile(probs, (tree.n_nodes, 1))
    n, kmax = args.groups, 4
    main = np.array([th.sample_action(policy, 0, rng) for _ in range(n)])
    env.reset(seed=0)
    with env.snapshot() as fork:
        branches = np.array([th.branch_siblings(env, fork, policy, kmax, rng)[1] for _ in range(n)])
    rows = []
    for k in range(1, kmax + 1):
        covered = (branches[:, :k] != main[:, None]).any(axis=1)
        exact = th.expected_coverage(probs, k)
        cond = [
            f"{th.coverage_probability(probs[a], k):.3f} / {covered[main == a].mean():.3f}"
            for a in range(3)
        ]
        se = math.sqrt(exact * (1 - exact) / n)
        rows.append([k, f"{exact:.4f}", _pm(float(covered.mean()), se), *cond])
    report.add(
        "## Proposition 1 (Branching OPD): coverage\n\nFork with pi_old = (0.6, 0.3, 0.1); "
        f"{n} main tokens, k branches each. Conditional columns: exact 1 - pi(a0)^k / measured."
    )
    print(
        report.table(
            ["k", "E[coverage] exact", "measured ± SE", "a0 = 0", "a0 = 1", "a0 = 2"], rows
        )
    )


def section_reseed(report: Report, args: argparse.Namespace, rng: Any) -> None:
    """Siblings restored without a fresh env RNG share their randomness."""
    tree = TreeStructure.random(depth=3, n_actions=2, n_outcomes=2, transition_noise=0.6, seed=3)
    env = TreeMDP(structure=tree)
    policy = np.random.default_rng(3).dirichlet(np.full(2, 2.0), size=tree.n_nodes)
    exact = th.advantage_variances(tree, policy, 1, args.k)
    fresh = _loo_variance(th.branched_groups(env, policy, 1, args.k, args.groups, rng))
    shared = _loo_variance(
        th.branched_groups(env, policy, 1, args.k, args.groups, rng, reseed=False)
    )
    report.add(
        "## Reseeding siblings after restore\n\nA snapshot carries the env's RNG, so "
        "siblings restored from it replay the same environment randomness unless the "
        "engine reseeds each one. Shared randomness (common random numbers) shrinks the "
        "measured sibling variance below Theorem 2's, the siblings are no longer "
        "independent draws."
    )
    rows = [
        ["exact (Theorem 2)", f"{exact.bpo:.4f}"],
        ["measured, reseeded siblings", _pm(*fresh)],
        ["measured, shared RNG", _pm(*shared)],
    ]
    print(report.table([f"Var(A_BPO), K = {args.k}, t = 1", "value"], rows))


#: Report sections, run in order, each ``section(report, args, rng)``.
SECTIONS = [
    section_worked_example,
    section_depths,
    section_unbiased,
    section_coverage,
    section_reseed,
]


def main(args: argparse.Namespace) -> int:
    """Run every section and write ``<out>/theory.md``."""
    if args.quick:
        args.groups = min(args.groups, 500)
    if args.k < 2:
        print("branchgym bench theory: --k must be >= 2", flush=True)
        return 2
    rng = np.random.default_rng(args.seed)
    report = Report(args.out, "theory", "branchgym bench theory")
    for section in SECTIONS:
        section(report, args, rng)
    path = report.save()
    print(f"\nreport: {path}")
    return 0
