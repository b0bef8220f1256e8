"""``branchgym bench estimator``: Branching PO and its variants as gradient estimators.

On TreeMDP mazes with a tabular softmax policy the exact policy gradient is known
(:func:`branchgym.envs.toy.estimators.exact_gradient`), on fixed-length mazes and on variable-length
ones where an action or the env ends episodes early. For each maze and policy stage (uniform,
mid and late snapshots of exact ascent) this study draws every estimator many times
(vectorised numpy, straight from the tree's arrays) and reports

* bias: ``|mean - g*|`` over the mean's standard error (about 1 when unbiased; the
  test of bias, where a cosine near 1 is only the Monte Carlo floor), the mean's
  projection ``<E g, g*> / |g*|^2`` and its cosine to ``g*``;
* noise ``tr Cov / |g*|^2`` per draw next to ``tr Cov / |E g|^2`` (which inflates the noise
  of an estimator whose mean is shrunk), and the first at matched cost relative to RLOO:
  env steps, generated tokens, learner tokens without prefix sharing and with
  ``pack_trees`` (per-decision token costs from ``--token-costs``, a ``bench
  gradient-noise`` JSON of the LLM pipeline);
* relative MSE ``E|g - g*|^2 / |g*|^2`` (and at the best scalar step size);
* the same by decision depth, and the share of ``E|g|^2`` carried by backbone decisions
  above the first branch point;
* Theorem 2's decomposition ``Var(G) = sigma_t^2 + nu_t^2`` of each maze by depth;

then a training phase on the maze family where Theorem 2 predicts the largest reduction:
SGD on the logits with each estimator over many seeds at equal env steps, exact ``J``.
docs/estimators.md derives the variants; the study measures and prints, it asserts nothing.

The module is over 600 lines because the study is one pipeline (mazes, policy stages,
every estimator, the cost columns, the training phase, the report): its parts share the
same arrays and tables, and the estimators themselves live in ``branchgym/envs/toy/estimators.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from branchgym.bench.common import Report, positive_int, seed_int
from branchgym.bench.runs import STUDY_MAZE
from branchgym.envs.toy import estimators as est
from branchgym.envs.toy import theory as th
from branchgym.envs.toy.tree_mdp import TreeStructure
from branchgym.error import OptionError

__all__ = ["ESTIMATORS", "MAZES", "VARIANTS", "configure", "main", "mazes"]

#: label -> (design, one-line description). The first two are the references.
ESTIMATORS: dict[str, tuple[est.Design, str]] = {
    "rloo": (est.Design("rloo", n=7), "RLOO, N = 7"),
    "grpo": (est.Design("grpo", n=7), "GRPO (mean/std), N = 7"),
    "bpo": (est.Design(), "spec Branching PO: entropy schedule, M = 2, K = 4, lambda 0.95"),
    "bpo_random": (est.Design(schedule="random"), "spec, random schedule"),
    "bpo_even": (est.Design(schedule="even"), "spec, even schedule"),
    "bpo_lam0": (est.Design(lam=0.0), "spec with lambda = 0"),
    "bpo_fresh": (
        est.Design(backbone="exclude"),
        "(a) entropy schedule, backbone's own actions left out of the comparison",
    ),
    "bpo_root": (
        est.Design(g=2, m=1, schedule="even", credit="root", norm="depth"),
        "(a)+(b) G = 2 backbones, even point, K = 4, root leave-one-out for the prefix",
    ),
    "bpo_vd": (
        est.Design(schedule="root_even", credit="value_diff", norm="depth"),
        "(a)+(b)+(c) root + even point, K = 4 (N = 7), value-difference credit",
    ),
    "bpo_g2_vd": (
        est.Design(g=2, m=1, schedule="even", credit="value_diff", norm="depth"),
        "(a)+(b)+(c) G = 2 backbones, even point, K = 4, value-difference credit",
    ),
    "bpo_tail_vd": (
        est.Design(g=5, m=1, k=4, schedule="last", credit="value_diff", norm="depth"),
        "(a)+(b)+(c) G = 5 backbones branched at their last decision, K = 4, realised "
        "per-depth counts (the previous recommendation; biased on variable lengths)",
    ),
    "bpo_hz_vd": (
        est.Design(
            g=5, m=1, k=4, schedule="fixed", depths=(-1,), credit="value_diff", norm="backbone"
        ),
        "(a)+(b)+(c) G = 5 backbones branched at the horizon's last decision D - 1 if still "
        "running, K = 4, per-backbone weights (recommended: unbiased on any lengths)",
    ),  # fmt: skip
    "bpo_mid_vd": (
        est.Design(
            g=3, m=2, k=4, schedule="fixed", depths=(1, 3), credit="value_diff", norm="backbone"
        ),
        "(a)+(b)+(c) G = 3 backbones branched at depths 1 and 3 if still running, K = 4, "
        "per-backbone weights (unbiased on any lengths)",
    ),  # fmt: skip
}
#: The variants of docs/estimators.md (candidates for "best variant").
VARIANTS = (
    "bpo_fresh",
    "bpo_root",
    "bpo_vd",
    "bpo_g2_vd",
    "bpo_tail_vd",
    "bpo_hz_vd",
    "bpo_mid_vd",
)

#: Variable-length versions of the long noisy maze (docs/estimators.md, "Variable
#: episode lengths"): an action that ends the episode, and the env ending it with
#: probability 0.3 whatever the action.
_LONG6 = {
    "depth": 6,
    "n_actions": 3,
    "transition_noise": 0.6,
    "reward_kind": "bernoulli",
    "seed": 2,
}
VARIABLE_MAZES: dict[str, tuple[dict[str, Any], str]] = {
    "end6": (
        {**_LONG6, "end_actions": 1},
        "long noisy maze, depth <= 6, the third action ends the episode",
    ),
    "stop6": (
        {**_LONG6, "termination_prob": 0.3},
        "long noisy maze, depth <= 6, the env ends the episode with probability 0.3 per step",
    ),
}

#: name -> (TreeStructure.random arguments, description)
MAZES: dict[str, tuple[dict[str, Any], str]] = {
    "study": (dict(STUDY_MAZE, seed=STUDY_MAZE["structure_seed"]), "the learning study's maze"),
    "long7": (
        {
            "depth": 7,
            "n_actions": 3,
            "transition_noise": 0.6,
            "reward_kind": "bernoulli",
            "seed": 2,
        },
        "long noisy maze, depth 7, 3 actions, transition noise 0.6, Bernoulli",
    ),
    "long8": (
        {
            "depth": 8,
            "n_actions": 2,
            "transition_noise": 0.6,
            "reward_kind": "bernoulli",
            "seed": 2,
        },
        "long noisy maze, depth 8, 2 actions, transition noise 0.6, Bernoulli",
    ),
    "early": (
        {
            "depth": 7,
            "n_actions": 2,
            "transition_noise": 0.3,
            "reward_noise": 0.1,
            "seed": 3,
            "depth_weights": "early",
        },
        "depth 7, return resolved early (edge weights 2^-t), Gaussian noise 0.1",
    ),
    "late": (
        {
            "depth": 7,
            "n_actions": 2,
            "transition_noise": 0.3,
            "reward_noise": 0.1,
            "seed": 3,
            "depth_weights": "late",
        },
        "depth 7, return resolved late (edge weights 2^(t-D+1)), Gaussian noise 0.1",
    ),
    "long6": (_LONG6, "long noisy maze, depth 6, 3 actions, transition noise 0.6, Bernoulli"),
    **VARIABLE_MAZES,
}
QUICK_MAZES = {
    "study": MAZES["study"],
    "long6": MAZES["long6"],
    "early": ({**MAZES["early"][0], "depth": 5}, "depth 5, return resolved early"),
    "late": ({**MAZES["late"][0], "depth": 5}, "depth 5, return resolved late"),
    "end4": ({**_LONG6, "depth": 4, "end_actions": 1}, "depth <= 4, an action ends the episode"),
    "stop4": ({**_LONG6, "depth": 4, "termination_prob": 0.3}, "depth <= 4, env stop 0.3"),
}
STAGES = ("uniform", "mid", "late")
#: |bias|/SE above which an estimator counts as biased in the verdict: the norm of the
#: mean's error of an unbiased estimator is about 1 standard error, rarely above 4.
BIAS_SE_LIMIT = 4.0


def mazes(quick: bool, only: list[str] | None = None) -> dict[str, tuple[est.TreeArrays, str]]:
    """Build the study's mazes (the quick set for ``--quick``; ``only`` these names)."""
    out = {}
    table = QUICK_MAZES if quick else MAZES
    unknown = sorted(set(only or ()) - set(table))
    if unknown:
        raise OptionError(
            f"unknown maze(s) {unknown}; pick from {', '.join(table)} (--quick has its own "
            "smaller set)."
        )
    for name, (kw, text) in table.items():
        if only and name not in only:
            continue
        kw = dict(kw)
        kw.pop("structure_seed", None)
        shape = kw.pop("depth_weights", None)
        if shape is not None:
            t = np.arange(kw["depth"])
            kw["depth_weights"] = 2.0 ** (-t) if shape == "early" else 2.0 ** (t - kw["depth"] + 1)
        out[name] = (est.TreeArrays.of(TreeStructure.random(**kw)), text)
    return out


def configure(parser: argparse.ArgumentParser) -> None:
    """Add this study's options."""
    parser.add_argument("--out", default="results", help="results folder (default: results)")
    parser.add_argument(
        "--repeats", type=positive_int, default=60000, help="draws per estimator and policy"
    )
    parser.add_argument("--seeds", type=positive_int, default=64, help="training seeds")
    parser.add_argument(
        "--budget", type=positive_int, default=20000, help="env steps per training seed"
    )
    parser.add_argument(
        "--lrs",
        default="2,8,32",
        help="SGD steps on the logits tried per estimator (comma list; each keeps its best)",
    )
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--no-training", action="store_true", help="skip the training phase")
    parser.add_argument("--quick", action="store_true", help="small mazes and sizes (CI)")
    parser.add_argument(
        "--mazes",
        default="",
        help=f"comma list of mazes to run (default: all of {', '.join(MAZES)})",
    )
    parser.add_argument(
        "--token-costs",
        default=None,
        help="a bench gradient-noise JSON: per-decision token costs of the LLM pipeline for "
        "the token columns (default: decision counts)",
    )


def theorem2_rows(name: str, arr: est.TreeArrays, pi: np.ndarray) -> list[list[Any]]:
    """``sigma_t^2`` and ``nu_t^2`` by depth (Theorem 2), exactly (ended episodes frozen)."""
    rows = []
    for dec in th.decomposition_by_depth(arr.tree, pi):
        total, nu2 = dec.total, dec.nu2
        ratio = nu2 / total if total > 0 else float("nan")
        # prefix credit from the mean of K = 4 siblings branched at t, vs one return
        rows.append([name, dec.depth, total, dec.sigma2, nu2, ratio, ratio + (1 - ratio) / 4])
    return rows


def _measure_all(
    report: Report, args: argparse.Namespace, maze_set: dict, rng: np.random.Generator
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    jobs = [(m, s, e) for m in maze_set for s in STAGES for e in ESTIMATORS]
    snaps: dict[str, dict[str, np.ndarray]] = {}
    truths: dict[tuple[str, str], np.ndarray] = {}
    for m, s, e in tqdm(jobs, desc="estimator bench", unit="measure"):
        arr = maze_set[m][0]
        if m not in snaps:
            snaps[m] = est.policy_snapshots(arr)
        pi = snaps[m][s]
        if (m, s) not in truths:
            truths[(m, s)] = est.exact_gradient(arr, pi)
        meas = est.measure(arr, ESTIMATORS[e][0], pi, args.repeats, rng, truth=truths[(m, s)])
        results.setdefault(m, {}).setdefault(s, {})[e] = meas.summary()
    for m in snaps:
        results[m]["j"] = {s: est.exact(maze_set[m][0], snaps[m][s]).j for s in STAGES}
        results[m]["theorem2"] = theorem2_rows(m, maze_set[m][0], snaps[m]["mid"])
    report.data["repeats"] = args.repeats
    report.data["measure"] = results
    return results


@dataclasses.dataclass(frozen=True)
class TokenCosts:
    """Per-decision token costs of the LLM pipeline, for the study's token columns.

    ``prompt``: tokens of a line's first prompt (system prompt, task); ``generated``:
    tokens the policy generates per decision; ``step``: tokens a decision adds to a row's
    sequence (its reply and the next observation). Learner tokens without prefix sharing
    read every line's whole path; with ``pack_trees`` each tree's shared prefix once.
    """

    prompt: float = 0.0
    generated: float = 1.0
    step: float = 1.0
    source: str = "decision counts (no --token-costs)"

    @classmethod
    def from_gradient_noise(cls, path: str) -> TokenCosts:
        """Calibrate on the RLOO rows of a ``bench gradient-noise`` JSON (real token counts).

        RLOO rows share nothing but their group's prompt, so ``learner tokens = rows x
        prompt + decisions x step`` gives ``step``.
        """
        data = json.loads(Path(path).read_text())
        res = data["results"]
        r = res.get("rloo") or next(iter(res.values()))
        need = ("prompt_tokens_per_row", "learner_tokens_per_batch", "decisions_per_batch")
        if any(k not in r for k in need):
            raise OptionError(
                f"{path} has no learner token counts; rerun branchgym bench gradient-noise "
                "(this version records them) and pass its JSON."
            )
        p0, dec = float(r["prompt_tokens_per_row"]), float(r["decisions_per_batch"])
        step = (float(r["learner_tokens_per_batch"]) - float(r["rollouts_per_batch"]) * p0) / dec
        gen = float(r["tokens_per_batch"]) / dec
        env = str(data.get("env", "branchgym/TextTreeMDP-v0")).rpartition("/")[2]
        return cls(p0, gen, step, f"{path} ({env} {data.get('maze', {})}, RLOO rows)")

    def costs(self, res: dict[str, Any], trees: int) -> tuple[float, float, float]:
        """(generated, learner plain, learner pack_trees) tokens per draw."""
        gen = res["decisions"] * self.generated
        plain = res["lines"] * self.prompt + res["path_decisions"] * self.step
        packed = trees * self.prompt + res["decisions"] * self.step
        return gen, plain, packed


def _trees(e: str) -> int:
    """Rollout trees per prompt: RLOO/GRPO's group is one (its prompt shared), G for BPO."""
    d = ESTIMATORS[e][0]
    return 1 if d.kind != "tree" else d.g


def _cost_ratios(
    res: dict[str, Any], e: str, ref: dict[str, Any], tokens: TokenCosts
) -> dict[str, float]:
    """NSR against |g*|^2 at matched cost, relative to RLOO's, in every cost unit."""
    mine = tokens.costs(res, _trees(e))
    theirs = tokens.costs(ref, 1)
    base = ref["noise_to_truth"]
    out = {"steps": res["noise_to_truth"] * res["steps"] / ref["steps"] / base}
    for name, a, b in zip(("generated", "learner", "packed"), mine, theirs, strict=True):
        out[name] = res["noise_to_truth"] * a / b / base
    return out


def _geo(x: list[float]) -> float:
    """Geometric mean (nan for none)."""
    return float(np.exp(np.mean(np.log(x)))) if x else float("nan")


def _matched(res: dict[str, Any], e: str, ref: dict[str, Any]) -> tuple[float, float]:
    d = ESTIMATORS[e][0]
    nsr = res["noise_to_signal"]
    return nsr * d.rollouts / 7, nsr * res["steps"] / ref["steps"]


def _tables(
    report: Report, results: dict, maze_set: dict, tokens: TokenCosts | None = None
) -> dict[str, Any]:
    tokens = tokens or TokenCosts()
    report.add(
        "## Estimators\n\n"
        + "\n".join(f"- `{k}`: {v[1]} (N = {v[0].rollouts})" for k, v in ESTIMATORS.items())
    )
    report.add("## Mazes\n\n" + "\n".join(f"- `{k}`: {v[1]}" for k, v in maze_set.items()))
    report.add(
        f"Token costs per decision: prompt {tokens.prompt:.1f}, generated {tokens.generated:.2f}, "
        f"learner {tokens.step:.2f} tokens; from {tokens.source}."
    )
    rows = []
    for m in results:
        for s in STAGES:
            ref = results[m][s]["rloo"]
            for e in ESTIMATORS:
                r = results[m][s][e]
                cr = _cost_ratios(r, e, ref, tokens)
                gen, plain, packed = tokens.costs(r, _trees(e))
                rows.append(
                    [
                        m,
                        s,
                        e,
                        r["bias_se"],
                        r["projection"],
                        r["cosine"],
                        r["noise_to_truth"],
                        r["noise_to_signal"],
                        cr["steps"],
                        cr["learner"],
                        cr["packed"],
                        r["steps"],
                        gen,
                        plain,
                        packed,
                    ]
                )
    report.add(
        "## Bias, noise and cost, every maze, policy and estimator\n\n`|bias|/SE`: |mean - g*| "
        "over the mean's standard error sqrt(tr Cov / R) (about 1 when unbiased; a biased "
        "estimator's grows as sqrt(R)). `proj`: <E g, g*>/|g*|^2. `NSR*`: tr Cov/|g*|^2 per "
        "draw; `NSR`: tr Cov/|E g|^2 (inflated where the mean is shrunk). `@steps`, "
        "`@learner`, `@packed`: NSR* at matched env steps, learner tokens without prefix "
        "sharing and with pack_trees, relative to RLOO's. Costs per draw (one prompt)."
    )
    print(
        report.table(
            [
                "maze",
                "policy",
                "estimator",
                "|bias|/SE",
                "proj",
                "cos",
                "NSR*",
                "NSR",
                "NSR* @steps / RLOO",
                "@learner / RLOO",
                "@packed / RLOO",
                "env steps",
                "gen tokens",
                "learner tokens",
                "packed tokens",
            ],
            rows,
        )
    )
    # by depth, mid policy
    drows = []
    for m in results:
        for e in ESTIMATORS:
            by = results[m]["mid"][e]["by_depth"]
            drows.append([m, e] + [f"{b['cosine']:.2f} / {b['rel_mse']:.3g}" for b in by])
    width = max(len(results[m]["mid"]["rloo"]["by_depth"]) for m in results)
    report.add("## By decision depth (mid policy): cosine / relative MSE of each depth's block")
    report.table(
        ["maze", "estimator"] + [f"t={t}" for t in range(width)],
        [r + [""] * (width + 2 - len(r)) for r in drows],
    )
    prows = []
    for m in results:
        for e in ESTIMATORS:
            pre = results[m]["mid"][e]["prefix"]
            if ESTIMATORS[e][0].kind == "tree":
                prows.append(
                    [m, e, pre["second_moment_share"], pre["mean_norm_ratio"], pre["cosine"]]
                )
    report.add(
        "## Before the first branch point (mid policy)\n\nThe part of g made by backbone "
        "decisions above the first branch point: its share of E|g|^2, the norm of its mean "
        "relative to |g*|, and its mean's cosine to g* (n/a: no such decisions)."
    )
    report.table(["maze", "estimator", "share of E|g|^2", "|E g_pre|/|g*|", "cos"], prows)
    trows = [row for m in results for row in results[m]["theorem2"]]
    report.add("## Theorem 2 by depth (mid policy): Var(G) = sigma_t^2 + nu_t^2")
    report.add(
        "`(nu^2 + sigma^2/4)/Var`: variance of a prefix decision's credit taken from the mean "
        "of K = 4 siblings branched at t, relative to one return (the tail variant's gain). "
        "Episodes that ended before t count at their leaf."
    )
    report.table(
        ["maze", "t", "Var(G)", "sigma_t^2", "nu_t^2", "nu_t^2/Var", "(nu^2 + sigma^2/4)/Var"],
        trows,
    )
    # summary: worst |bias|/SE over policies; NSR* at matched cost relative to RLOO
    srows, best = [], {}
    for e in ESTIMATORS:
        row = [e]
        worst = 0.0
        ratios, var_ratios = [], []
        for m in results:
            bias = max(results[m][s][e]["bias_se"] for s in STAGES)
            proj = min(results[m][s][e]["projection"] for s in STAGES)
            cr = [_cost_ratios(results[m][s][e], e, results[m][s]["rloo"], tokens) for s in STAGES]
            geo = {k: float(np.exp(np.mean([np.log(c[k]) for c in cr]))) for k in cr[0]}
            worst = max(worst, bias)
            row.append(
                f"{bias:.1f} / {proj:.2f} / {geo['steps']:.2f} / {geo['learner']:.2f} / "
                f"{geo['packed']:.2f}"
            )
            if m.startswith("long"):
                ratios.append(geo["steps"])
            elif m in VARIABLE_MAZES or m.startswith(("end", "stop")):
                var_ratios.append(geo["steps"])
        srows.append(row)
        best[e] = (worst, _geo(ratios), _geo(var_ratios))
    report.add(
        "## Summary\n\nPer maze: worst |bias|/SE over the three policies / smallest projection "
        "<E g, g*>/|g*|^2 / NSR* (tr Cov/|g*|^2) relative to RLOO's at matched env steps, at "
        "matched learner tokens without prefix sharing, and with pack_trees (geometric mean "
        "over the policies)."
    )
    print(
        report.table(
            ["estimator"] + [f"{m}: bias/SE / proj / @steps / @learner / @packed" for m in results],
            srows,
        )
    )
    limit = BIAS_SE_LIMIT
    qualified = [e for e in VARIANTS if best[e][0] < limit]
    pool = qualified or list(VARIANTS)

    # rank by the long fixed-length mazes, or the variable ones when none was run
    def rank(e: str) -> float:
        r = best[e][1] if np.isfinite(best[e][1]) else best[e][2]
        return float(r) if np.isfinite(r) else float("inf")

    choice = min(pool, key=rank)
    verdict = (
        f"Best variant: `{choice}` (worst |bias|/SE {best[choice][0]:.1f}, NSR* at matched env "
        f"steps {best[choice][1]:.2f}x RLOO's on the long fixed-length mazes and "
        f"{best[choice][2]:.2f}x on the variable-length ones, geometric means). "
    )
    if not qualified:
        verdict += f"No variant stayed within {limit:g} standard errors of g* on every maze. "
    elif not rank(choice) < 1.0:
        verdict += "It does not beat RLOO's noise at matched env steps there."
    else:
        verdict += (
            f"It is unbiased everywhere (|bias|/SE < {limit:g}) and below RLOO's noise on the "
            + ("long mazes." if np.isfinite(best[choice][1]) else "variable-length mazes.")
        )
    report.add(verdict)
    print(verdict)
    report.data["summary"] = {
        e: {"worst_bias_se": b[0], "long_nsr_star_vs_rloo": b[1], "variable_nsr_star_vs_rloo": b[2]}
        for e, b in best.items()
    }
    report.data["best_variant"] = choice
    report.data["token_costs"] = dataclasses.asdict(tokens)
    return {"best": choice}


def _plot_nsr(report: Report, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(ESTIMATORS)
    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 4), sharey=False)
    for ax, m in zip(np.atleast_1d(axes), results, strict=False):
        for i, s in enumerate(STAGES):
            ref = results[m][s]["rloo"]
            y = [
                results[m][s][e]["noise_to_truth"] * results[m][s][e]["steps"] / ref["steps"]
                for e in names
            ]
            ax.bar(np.arange(len(names)) + 0.27 * (i - 1), y, width=0.27, label=s)
        ax.set_yscale("log")
        ax.set_xticks(np.arange(len(names)), names, rotation=75, fontsize=7)
        ax.set_title(m)
    np.atleast_1d(axes)[0].set_ylabel("tr Cov / |g*|^2 at matched env steps")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    report.figure(
        fig, "nsr", "Noise against |g*|^2 at matched env steps (RLOO's steps), per maze and policy"
    )
    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 4))
    for ax, m in zip(np.atleast_1d(axes), results, strict=False):
        y = [max(results[m][s][e]["bias_se"] for s in STAGES) for e in names]
        ax.bar(np.arange(len(names)), y)
        ax.axhline(BIAS_SE_LIMIT, color="k", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_xticks(np.arange(len(names)), names, rotation=75, fontsize=7)
        ax.set_title(m)
    np.atleast_1d(axes)[0].set_ylabel("worst |mean - g*| / SE over policies")
    report.figure(fig, "bias", "Bias of each estimator's mean in standard errors (log)")


def train(
    arr: est.TreeArrays,
    design: est.Design,
    seeds: int,
    budget: int,
    lr: float,
    rng: np.random.Generator,
    grid: np.ndarray,
) -> np.ndarray:
    """SGD on the logits with ``design`` for ``seeds`` policies at once.

    Each seed runs ``budget`` env steps; returns the exact ``J`` of every seed at the
    env-step ``grid`` (the last value carried forward).
    """
    theta = np.zeros((seeds, arr.n_nodes, arr.n_actions))
    pis = est.softmax(theta)
    used = np.zeros(seeds)
    out = np.full((seeds, grid.size), np.nan)
    out[:, 0] = est.exact_j(arr, pis)
    while used.min() < budget:
        rep, s, rows, steps = est.estimate(arr, design, pis, rng)
        live = used < budget
        keep = live[rep]
        rep, s = rep[keep], s[keep]
        theta[rep, s] += lr * rows[keep]
        pis[rep, s] = est.softmax(theta[rep, s])
        before = used.copy()
        used = used + np.where(live, steps, 0)
        hit = (grid[None, :] > before[:, None]) & (grid[None, :] <= used[:, None])
        seeds_hit = np.flatnonzero(hit.any(axis=1))
        if seeds_hit.size:  # exact J only when a seed passes a grid point
            j = est.exact_j(arr, pis[seeds_hit])
            out[seeds_hit] = np.where(hit[seeds_hit], j[:, None], out[seeds_hit])
    # grid points past the budget keep the last value
    for i in range(1, grid.size):
        out[:, i] = np.where(np.isnan(out[:, i]), out[:, i - 1], out[:, i])
    return out


def _training(report: Report, args: argparse.Namespace, maze_set: dict, best: str) -> None:
    long = [m for m in maze_set if m.startswith("long")]
    train_on = [min(long, key=lambda m: maze_set[m][0].n_nodes)] if long else []
    train_on += [m for m in maze_set if m == "late"]
    train_on += [m for m in maze_set if m.startswith("stop")][:1]  # a variable-length maze
    if not train_on:
        return
    report.add(
        "## Training at equal env steps\n\nSGD on the logits, "
        f"{args.seeds} seeds, {args.budget} env steps per seed, exact J; each estimator at its "
        f"best step size among [{args.lrs}] (final J by step size in the JSON). Best variant "
        f"from the measurements above: `{best}`. Mazes: the smallest long noisy maze (most "
        "return variance resolved by the last step's Bernoulli reward and noisy transitions) "
        "and `late`."
    )
    report.data["training"] = {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(train_on), figsize=(6 * len(train_on), 4))
    for ax, maze in zip(np.atleast_1d(axes), train_on, strict=True):
        _train_maze(report, args, maze_set, maze, best, ax)
    report.figure(fig, "training", "Exact J vs env steps, mean ± SE over seeds")


def _train_maze(
    report: Report, args: argparse.Namespace, maze_set: dict, maze: str, best: str, ax: Any
) -> None:
    arr, text = maze_set[maze]
    names = list(dict.fromkeys(["rloo", "grpo", "bpo", "bpo_tail_vd", best]))
    grid = np.linspace(0, args.budget, 41)
    lrs = [float(x) for x in str(args.lrs).split(",")]
    curves: dict[str, np.ndarray] = {}
    best_lr: dict[str, float] = {}
    final: dict[str, dict[float, float]] = {}
    t0 = time.perf_counter()
    jobs = [(e, lr) for e in names for lr in lrs]
    for i, (e, lr) in enumerate(tqdm(jobs, desc=f"estimator bench: training {maze}", unit="run")):
        rng = np.random.default_rng(args.seed + 1000 + i)
        c = train(arr, ESTIMATORS[e][0], args.seeds, args.budget, lr, rng, grid)
        final.setdefault(e, {})[lr] = float(c[:, -1].mean())
        if e not in curves or final[e][lr] > final[e][best_lr[e]]:
            curves[e], best_lr[e] = c, lr
    rows = []
    half = grid.size // 2
    for e in names:
        c = curves[e]
        se = c.std(axis=0, ddof=1) / np.sqrt(c.shape[0])
        rows.append([e, best_lr[e], c[:, half].mean(), se[half], c[:, -1].mean(), se[-1]])
        ax.plot(grid, c.mean(axis=0), label=f"{e} (step {best_lr[e]:g})")
        ax.fill_between(grid, c.mean(axis=0) - se, c.mean(axis=0) + se, alpha=0.25)
    j0 = float(curves[names[0]][:, 0].mean())
    report.add(
        f"### `{maze}` ({text})\n\nUniform policy J = {j0:.3f}, optimal J = "
        f"{est.optimal_j(arr):.3f}. ({time.perf_counter() - t0:.0f} s)"
    )
    print(f"training on {maze}:")
    print(
        report.table(
            [
                "estimator",
                "step size",
                f"J @ {int(grid[half])} steps",
                "SE",
                f"J @ {args.budget} steps",
                "SE",
            ],
            rows,
        )
    )
    ax.set_title(maze)
    ax.set_xlabel("env steps per seed")
    ax.set_ylabel("exact J")
    ax.legend(fontsize=7)
    report.data["training"][maze] = {
        "grid": grid.tolist(),
        "seeds": args.seeds,
        "best_lr": best_lr,
        "final_by_lr": {e: {str(k): v for k, v in d.items()} for e, d in final.items()},
        "mean": {e: curves[e].mean(axis=0).tolist() for e in names},
        "se": {e: (curves[e].std(axis=0, ddof=1) / np.sqrt(args.seeds)).tolist() for e in names},
    }


def main(args: argparse.Namespace) -> int:
    """Measure every estimator on every maze and policy; then train; write the report."""
    if args.quick:
        args.repeats = min(args.repeats, 3000)
        args.seeds = min(args.seeds, 8)
        args.budget = min(args.budget, 1500)
    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    report = Report(args.out, "estimator", "branchgym bench estimator")
    report.add(
        "Policy-gradient estimators on TreeMDP against the exact gradient of a tabular softmax "
        f"policy; {args.repeats} draws per estimator and policy. Derivations: "
        "docs/estimators.md."
    )
    wanted = [m.strip() for m in str(getattr(args, "mazes", "") or "").split(",") if m.strip()]
    maze_set = mazes(args.quick, wanted or None)
    tokens = (
        TokenCosts.from_gradient_noise(args.token_costs)
        if getattr(args, "token_costs", None)
        else TokenCosts()
    )
    results = _measure_all(report, args, maze_set, rng)
    choice = _tables(report, results, maze_set, tokens)["best"]
    _plot_nsr(report, results)
    if not args.no_training:
        _training(report, args, maze_set, choice)
    report.add(f"Wall time: {time.perf_counter() - t0:.0f} s.")
    path = report.save()
    print(f"\nreport: {path}")
    return 0
