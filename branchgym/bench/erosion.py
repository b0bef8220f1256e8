"""``branchgym bench erosion``: how much a fidelity violation biases sibling advantages.

On a TreeMDP, whose values are exact, one branch point per prompt: a backbone reaches a
state ``s_t`` (depth ``t`` uniform), takes a snapshot, and continues as sibling 1; siblings
2..K restore the snapshot and roll out from ``s_t``. Each sibling's leave-one-out
advantage (docs/algorithms.md eq. 4)

    A_local(t, k) = G_k - 1/(K-1) * sum_{j != k} G_j

is compared with the exact advantage ``Q(s_t, a_k) - V(s_t)`` of the policy. Without a
fault, ``E[A_local | s_t, a_k] = Q - V`` exactly. Faults are injected into restores with
:class:`branchgym.scenarios.faults.RestoreFault` at rates ``p``:

* ``slip``: after a restore, each step executes another (uniformly drawn) action with
  probability ``p``: restored branches are not the original state's dynamics. The
  expected bias has a closed form here (the restored branches follow the mixed policy
  ``(1-p) pi + p (1 - pi)/(n-1)``), computed by backward induction and printed next to the
  measurement;
* ``rng``: with probability ``p`` a restore leaves the env's RNG where it was. Every such
  restore is an exact-mode violation, yet continuations stay draws from the right
  distribution: the control that shows *which* violations erode the estimator.

Reported per fault and rate: the mean error of A_local for the backbone sibling and for
restored siblings (95 % intervals) with its exact expectation, the OLS slope of A_local
on Q - V (1 = unbiased, < 1 = attenuated signal) next to the slope the closed form
predicts for the same samples, the RMS of the exact conditional bias
relative to the RMS of Q - V, and whether the property suite flags the faulty env.
"""

from __future__ import annotations

import argparse
from typing import Any

import gymnasium as gym
import numpy as np
from tqdm import tqdm

from branchgym.bench.common import Report

__all__ = ["configure", "main", "sibling_advantages", "exact_expected_error", "run_rate"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add this study's options."""
    parser.add_argument("--out", default="results", help="results folder (default: results)")
    parser.add_argument(
        "--rates", type=float, nargs="+", default=[0.0, 0.01, 0.05, 0.2], help="fault rates p"
    )
    parser.add_argument(
        "--faults", nargs="+", default=["slip", "rng"], choices=["slip", "rng"], help="fault kinds"
    )
    parser.add_argument("--prompts", type=int, default=4000, help="branch points per rate")
    parser.add_argument("--K", type=int, default=4, help="siblings per branch point (spec: 4)")
    parser.add_argument("--depth", type=int, default=5, help="TreeMDP depth")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="600 prompts, no suite runs (CI)")
    parser.add_argument(
        "--no-detect", action="store_true", help="skip running the property suite per rate"
    )


def sibling_advantages(returns: np.ndarray) -> np.ndarray:
    """Eq. (4) on NumPy returns: the shared definition in ``branchgym.agents.estimators.losses``."""
    import torch

    from branchgym.agents.estimators.advantages import sibling_advantages as eq4

    return eq4(torch.as_tensor(np.asarray(returns, dtype=np.float64))).numpy()


def exact_expected_error(
    tree: Any, policy: np.ndarray, p: float, K: int, kind: str
) -> tuple[np.ndarray, np.ndarray]:
    """Exact ``E[A_local | s, a] - (Q(s, a) - V(s))`` for the backbone and a restored sibling.

    Returns two ``(n_nodes, n_actions)`` arrays: the error of sibling 1 (the backbone,
    never restored) given its action, and of a restored sibling given its action.
    """
    v, _, q, _ = tree.moments(policy)
    n = tree.n_actions
    if kind == "rng" or p == 0 or n < 2:
        z = np.zeros_like(q)
        return z, z
    # After a restore every executed action is the chosen one w.p. 1-p, else uniform among
    # the others: the branch follows pi_eff from the next state on.
    pi_eff = (1 - p) * policy + p * (1 - policy) / (n - 1)
    _, _, q_eff, _ = tree.moments(pi_eff)
    g_rest = (1 - p) * q_eff + p * (q_eff.sum(axis=1, keepdims=True) - q_eff) / (n - 1)
    v_rest = (policy * g_rest).sum(axis=1)
    backbone = np.broadcast_to((v - v_rest)[:, None], q.shape)
    # Sibling k >= 2: its baseline averages the backbone and K-2 restored siblings.
    baseline = (v + (K - 2) * v_rest) / (K - 1)
    restored = g_rest - baseline[:, None] - (q - v[:, None])
    return np.array(backbone), restored


def run_rate(*, p: float, kind: str, prompts: int, K: int, depth: int, seed: int) -> dict[str, Any]:
    """Measure one fault kind at rate ``p``; returns samples and summary figures."""
    from branchgym.core import SnapshotAPI
    from branchgym.scenarios.faults import RestoreFault

    base = gym.make(
        "branchgym/TreeMDP-v0",
        depth=depth,
        n_actions=3,
        n_outcomes=2,
        transition_noise=0.2,
        reward_noise=0.1,
        structure_seed=seed,
    )
    tree = base.unwrapped.tree
    rng = np.random.default_rng(seed)
    policy = rng.dirichlet(np.ones(tree.n_actions), size=tree.n_nodes)
    cum = policy.cumsum(axis=1)
    v, _, q, _ = tree.moments(policy)
    env = SnapshotAPI(RestoreFault(base, p, kind=kind, seed=seed + 1))

    def act(node: int) -> int:
        return int(min(np.searchsorted(cum[node], rng.random(), side="right"), tree.n_actions - 1))

    def rollout(node: int) -> tuple[int, float]:
        a0 = act(node)
        obs, r, term, trunc, _ = env.step(a0)
        g = float(r)
        while not (term or trunc):
            obs, r, term, trunc, _ = env.step(act(int(obs)))
            g += float(r)
        return a0, g

    states, actions, sibling, returns = [], [], [], []
    for i in range(prompts):
        obs, _ = env.reset(seed=seed * 100_000 + i)
        for _ in range(int(rng.integers(0, depth))):
            obs, *_ = env.step(act(int(obs)))
        s = int(obs)
        acts, gs = [], []
        with env.snapshot() as snap:
            for k in range(K):
                if k:
                    env.restore(snap)
                a, g = rollout(s)
                acts.append(a)
                gs.append(g)
        states += [s] * K
        actions += acts
        sibling += list(range(K))
        returns.append(gs)
    env.close()
    s_arr, a_arr, k_arr = np.array(states), np.array(actions), np.array(sibling)
    adv = sibling_advantages(np.array(returns)).ravel()
    target = q[s_arr, a_arr] - v[s_arr]
    err = adv - target
    bb, rest = exact_expected_error(tree, policy, p, K, kind)
    exact = np.where(k_arr == 0, bb[s_arr, a_arr], rest[s_arr, a_arr])

    def mean_ci(x: np.ndarray) -> tuple[float, float]:
        return float(x.mean()), float(1.96 * x.std(ddof=1) / np.sqrt(max(x.size, 2)))

    slope = float(np.polyfit(target, adv, 1)[0])
    # The slope the closed form predicts for the same visited (s, a) pairs.
    exact_slope = float(np.polyfit(target, target + exact, 1)[0])
    return {
        "p": p,
        "kind": kind,
        "samples": int(adv.size),
        "backbone": mean_ci(err[k_arr == 0]),
        "siblings": mean_ci(err[k_arr > 0]),
        "exact_backbone": float(exact[k_arr == 0].mean()),
        "exact_siblings": float(exact[k_arr > 0].mean()),
        "slope": slope,
        "exact_slope": exact_slope,
        "relative_rms_bias": float(np.sqrt(np.mean(exact**2)) / np.sqrt(np.mean(target**2))),
        "faulty_restores": int(getattr(env.env, "faulty_restores", 0)),
    }


def _detects(p: float, kind: str, depth: int, seed: int) -> str:
    from branchgym.core import SnapshotAPI
    from branchgym.fidelity.suite import check_snapshot_fidelity
    from branchgym.scenarios.faults import RestoreFault

    def make() -> gym.Env:
        return SnapshotAPI(
            RestoreFault(gym.make("branchgym/TreeMDP-v0", depth=depth), p, kind=kind, seed=None)
        )

    r = check_snapshot_fidelity(make, seed=seed, shrink_seconds=0, reproduce=0)
    return "ok" if r.ok else f"flagged @{r.first_detection_steps} steps"


def main(args: argparse.Namespace) -> int:
    """Run every fault kind and rate; write ``<out>/erosion.md`` and a PNG."""
    if args.quick:
        args.prompts = min(args.prompts, 600)
        args.no_detect = True
    if args.K < 2:
        print("branchgym bench erosion: --K must be >= 2 (eq. 4 needs siblings)")
        return 2
    report = Report(args.out, "erosion", "branchgym bench erosion")
    report.add(
        f"TreeMDP depth {args.depth}, 3 actions, 2 outcomes, transition noise 0.2, reward "
        f"noise 0.1, a random tabular policy; {args.prompts} branch points per rate (depth "
        f"uniform), K = {args.K} siblings (sibling 1 = the backbone, never restored). Error "
        "= A_local (eq. 4) - (Q - V), exact values by backward induction. Intervals are "
        "95 %."
    )
    results = []
    jobs = [(kind, p) for kind in args.faults for p in args.rates]
    for kind, p in tqdm(jobs, desc="erosion", unit="rate"):
        r = run_rate(
            p=p, kind=kind, prompts=args.prompts, K=args.K, depth=args.depth, seed=args.seed
        )
        r["suite"] = "-" if args.no_detect else _detects(p, kind, args.depth, args.seed)
        results.append(r)
    rows = [
        [
            r["kind"],
            r["p"],
            r["samples"],
            f"{r['backbone'][0]:+.4f} ± {r['backbone'][1]:.4f}",
            f"{r['exact_backbone']:+.4f}",
            f"{r['siblings'][0]:+.4f} ± {r['siblings'][1]:.4f}",
            f"{r['exact_siblings']:+.4f}",
            f"{r['slope']:.3f}",
            f"{r['exact_slope']:.3f}",
            f"{100 * r['relative_rms_bias']:.1f} %",
            r["suite"],
        ]
        for r in results
    ]
    print(
        report.table(
            [
                "fault",
                "p",
                "samples",
                "error backbone",
                "exact",
                "error restored siblings",
                "exact",
                "slope on Q-V",
                "exact",
                "RMS bias / RMS(Q-V)",
                "property suite",
            ],
            rows,
        )
    )
    report.data["results"] = results
    _plot(report, results)
    path = report.save()
    print(f"\nreport: {path}")
    return 0


def _plot(report: Report, results: list[dict[str, Any]]) -> None:
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for kind, color in (("slip", "C0"), ("rng", "C7")):
        rs = [r for r in results if r["kind"] == kind]
        if not rs:
            continue
        x = np.arange(len(rs))
        labels = [f"{r['p']:g}" for r in rs]
        for who, marker, dx in (("backbone", "o", -0.08), ("siblings", "s", 0.08)):
            ax1.errorbar(
                x + dx + (0.02 if kind == "rng" else 0),
                [r[who][0] for r in rs],
                yerr=[r[who][1] for r in rs],
                fmt=marker,
                color=color,
                label=f"{kind}: {who} (measured)",
                capsize=3,
            )
            ax1.plot(x + dx, [r[f"exact_{who}"] for r in rs], "--", color=color, lw=0.8)
        ax2.plot(x, [r["slope"] for r in rs], "o-", color=color, label=f"{kind}: slope")
        ax2.plot(
            x,
            [r["relative_rms_bias"] for r in rs],
            "s--",
            color=color,
            label=f"{kind}: RMS bias / RMS(Q-V)",
        )
        ax1.set_xticks(x, labels)
        ax2.set_xticks(x, labels)
    ax1.axhline(0, color="k", lw=0.6)
    ax1.set_xlabel("fault rate p")
    ax1.set_ylabel("mean of A_local - (Q - V)")
    ax1.set_title("mean error (dashed: exact expectation)")
    ax1.legend(fontsize=7)
    ax2.axhline(1, color="k", lw=0.6)
    ax2.set_xlabel("fault rate p")
    ax2.set_title("signal kept (slope) and conditional bias")
    ax2.legend(fontsize=7)
    report.figure(fig, "bias", "Bias of eq. (4) sibling advantages under injected faults")
