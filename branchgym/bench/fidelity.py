"""``branchgym bench fidelity``: what online fidelity checking costs, per env and mode.

Two workloads on every registered env that can be built here, each run plain and under
``FidelityCheck`` in ``digest`` mode (every snapshot checked, and 1 in 10), and in
``shadow`` mode:

* *steps*: seeded episodes, timing each ``step()`` call: the per-step overhead (the
  target: digest mode adds under 10 % to step time);
* *branching*: what a branching learner does (two snapshots per backbone, three
  siblings from each, algorithms.md §1 with M = 2, K = 4), timing everything: the
  overhead per step once snapshot and restore costs (one ``state_digest`` each in digest
  mode) are amortised.

The variants run the same seeded episodes, interleaved episode by episode, with the
garbage collector off while timing. A block summarises each variant by the median
``step()`` call (steps) and the median per-step time of its episodes (branching): on a
shared machine a preempted call lasts 100 times a normal one, and sums would measure the
scheduler. Each overhead is the median over blocks of the paired ratio to the plain env
in the same block. A
last section times the property suite (``check_snapshot_fidelity`` at its default
budget) per env.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import gymnasium as gym
import numpy as np
from tqdm import tqdm

from branchgym.bench.common import Report
from branchgym.fidelity.checks import ActionChooser

__all__ = ["configure", "main", "VARIANTS", "step_episode", "branching_episode"]

#: variant name -> wrapper applied to ``gym.make(id)`` (None: the plain env).
VARIANTS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "digest": {"mode": "digest"},
    "digest 1/10": {"mode": "digest", "sample_rate": 0.1},
    "shadow": {"mode": "shadow"},
}

TARGET = 0.10  # digest mode must add under 10 % to step time


#: What ``--quick`` measures when no ``--envs`` are named (the issue's target envs).
QUICK_ENVS = ("branchgym/TreeMDP-v0", "branchgym/TextTreeMDP-v0", "branchgym/WebShop-v0")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add this study's options."""
    parser.add_argument("--out", default="results", help="results folder (default: results)")
    parser.add_argument("--blocks", type=int, default=15, help="blocks (each gives one ratio)")
    parser.add_argument("--episodes", type=int, default=200, help="episodes per block")
    parser.add_argument("--envs", nargs="*", default=None, help="env ids (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer blocks and episodes; the in-process envs unless --envs is given",
    )
    parser.add_argument(
        "--no-suite", action="store_true", help="skip timing the property suite per env"
    )


def _make(env_id: str, variant: dict[str, Any] | None) -> gym.Env:
    from branchgym.wrappers import FidelityCheck

    env = gym.make(env_id)
    if variant is None:
        return env
    return FidelityCheck(env, on_violation="record", **variant)


def step_episode(env: gym.Env, chooser: ActionChooser, seed: int) -> list[float]:
    """One seeded episode; returns the duration of each ``step()`` call in seconds."""
    _, info = env.reset(seed=seed)
    out: list[float] = []
    done = False
    while not done and len(out) < 10_000:
        a = chooser(info)
        t0 = time.perf_counter()
        _, _, term, trunc, info = env.step(a)
        out.append(time.perf_counter() - t0)
        done = term or trunc
    return out


def branching_episode(
    env: gym.Env, chooser: ActionChooser, seed: int, rng: np.random.Generator
) -> tuple[float, int]:
    """Backbone + 2 branch points x 3 siblings; returns (seconds for all of it, steps)."""
    t0 = time.perf_counter()
    _, info = env.reset(seed=seed)
    points, done, steps = [], False, 0
    while not done:
        if len(points) < 2 and rng.random() < 0.5:
            points.append(env.snapshot())
        _, _, term, trunc, info = env.step(chooser(info))
        steps += 1
        done = term or trunc
    for snap in points:
        for _ in range(3):
            _, info = env.restore(snap)
            done = False
            while not done:
                _, _, term, trunc, info = env.step(chooser(info))
                steps += 1
                done = term or trunc
        snap.release()
    return time.perf_counter() - t0, steps


def _measure(env_id: str, *, seed: int, blocks: int, episodes: int) -> dict[str, Any]:
    envs = {name: _make(env_id, v) for name, v in VARIANTS.items()}
    names = list(envs)
    # Same seeds, same choosers, same branch points: every variant runs the same episodes.
    choosers = {n: ActionChooser(e, seed) for n, e in envs.items()}
    rngs = {n: np.random.default_rng(seed) for n in envs}
    per_step: dict[str, dict[str, list[float]]] = {
        w: {n: [] for n in envs} for w in ("steps", "branching")
    }
    try:
        for b in range(blocks):
            calls: dict[str, list[float]] = {n: [] for n in envs}
            episodes_us: dict[str, list[float]] = {n: [] for n in envs}
            gc.collect()
            gc.disable()  # as timeit does: a collection would land on whoever runs then
            try:
                for ep in range(episodes):
                    # Variants alternate episode by episode (rotating who goes first), so a
                    # change of load on the machine hits all of them alike.
                    order = names[ep % len(names) :] + names[: ep % len(names)]
                    ep_seed = seed + 100_000 * b + ep
                    for name in order:
                        calls[name] += step_episode(envs[name], choosers[name], ep_seed)
                    for name in order:
                        secs, steps = branching_episode(
                            envs[name], choosers[name], ep_seed, rngs[name]
                        )
                        episodes_us[name].append(secs / max(steps, 1) * 1e6)
            finally:
                gc.enable()
            # Medians, not sums: on a shared machine a preempted call is 100x a normal one.
            for name in envs:
                per_step["steps"][name].append(float(np.median(calls[name])) * 1e6)
                per_step["branching"][name].append(float(np.median(episodes_us[name])))
        violations = {n: len(getattr(e, "violations", ())) for n, e in envs.items()}
    finally:
        for e in envs.values():
            e.close()
    out: dict[str, Any] = {"violations": violations}
    for w, by_name in per_step.items():
        plain = np.asarray(by_name["plain"])
        out[w] = {
            n: {
                "us_per_step": float(np.median(v)),
                "overhead": float(np.median(np.asarray(v) / plain) - 1.0),
            }
            for n, v in by_name.items()
        }
    return out


def section_overhead(report: Report, args: argparse.Namespace) -> dict[str, Any]:
    """The overhead table and plot."""
    from branchgym.registration import branch_specs

    specs = [s for s in branch_specs() if not s.missing() and (not args.envs or s.id in args.envs)]
    data: dict[str, Any] = {}
    for spec in tqdm(specs, desc="fidelity bench: envs", unit="env"):
        data[spec.id] = _measure(
            spec.id, seed=args.seed, blocks=args.blocks, episodes=args.episodes
        )
    rows = []
    for env_id, d in data.items():
        for name in VARIANTS:
            s, b = d["steps"][name], d["branching"][name]
            rows.append(
                [
                    env_id,
                    name,
                    f"{s['us_per_step']:.1f}",
                    "-" if name == "plain" else f"{100 * s['overhead']:+.1f} %",
                    f"{b['us_per_step']:.1f}",
                    "-" if name == "plain" else f"{100 * b['overhead']:+.1f} %",
                    d["violations"].get(name, 0),
                ]
            )
    report.add(
        f"## Overhead of FidelityCheck\n\n{args.blocks} blocks of {args.episodes} episodes, "
        "the variants alternating episode by episode; overhead = median over blocks of the "
        "paired ratio to the plain env in the same block. *steps*: the median step() call. "
        "*branching*: the median over episodes of everything (steps, snapshots, restores, "
        "digests, twins) per step of a backbone + 2 branch points x 3 siblings workload. "
        "The garbage collector is off while timing."
    )
    print(
        report.table(
            [
                "env",
                "variant",
                "step us",
                "step overhead",
                "branching us/step",
                "branching overhead",
                "violations",
            ],
            rows,
        )
    )
    verdicts = []
    for env_id, d in data.items():
        o = d["steps"]["digest"]["overhead"]
        verdicts.append(
            f"{env_id}: digest mode adds {100 * o:+.1f} % to step time "
            f"(target < {100 * TARGET:.0f} %): {'PASS' if o < TARGET else 'FAIL'}"
        )
    text = "\n".join(verdicts)
    report.add(text)
    print(text)
    report.data["overhead"] = data
    if data:
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 0.9 + 0.5 * len(data) * 3), sharey=True)
        variants = [v for v in VARIANTS if v != "plain"]
        y = np.arange(len(data))
        h = 0.8 / len(variants)
        for ax, w in zip(axes, ("steps", "branching"), strict=True):
            for i, v in enumerate(variants):
                vals = [100 * data[e][w][v]["overhead"] for e in data]
                ax.barh(y + (i - (len(variants) - 1) / 2) * h, vals, height=h, label=v)
            ax.axvline(100 * TARGET, color="k", ls="--", lw=1)
            ax.set_title(f"{w} workload")
            ax.set_xlabel("overhead vs plain env (%)")
        axes[0].set_yticks(y, list(data))
        axes[0].legend(fontsize=8, loc="lower right")
        report.figure(fig, "overhead", "FidelityCheck overhead per env and mode (dashed: 10 %)")
    return data


def section_suite(report: Report, args: argparse.Namespace) -> None:
    """Wall time of the property suite at its default budget, per env."""
    from branchgym.fidelity.suite import check_snapshot_fidelity
    from branchgym.registration import branch_specs

    specs = [s for s in branch_specs() if not s.missing() and (not args.envs or s.id in args.envs)]
    rows = []
    for spec in tqdm(specs, desc="fidelity bench: property suite", unit="env"):
        r = check_snapshot_fidelity(spec.id, seed=args.seed)
        rows.append(
            [
                spec.id,
                r.mode,
                "ok" if r.ok else "FAILED",
                r.examples,
                r.steps,
                r.restores,
                r.seconds,
            ]
        )
    report.add(
        "## Property suite cost\n\ncheck_snapshot_fidelity at its default budget "
        "(what `branchgym check` adds per env)."
    )
    print(
        report.table(["env", "mode", "verdict", "programs", "steps", "restores", "seconds"], rows)
    )


def main(args: argparse.Namespace) -> int:
    """Run the sections and write ``<out>/fidelity.md``."""
    report = Report(args.out, "fidelity", "branchgym bench fidelity")
    if args.quick:
        args.blocks, args.episodes = min(args.blocks, 5), min(args.episodes, 40)
        if not args.envs:  # ALFWorld and SWE-bench steps take 10+ ms: minutes, not seconds
            args.envs = list(QUICK_ENVS)
            report.add(
                "Quick mode: the in-process envs only (" + ", ".join(QUICK_ENVS) + "); "
                "name others with --envs."
            )
    section_overhead(report, args)
    if not args.no_suite:
        section_suite(report, args)
    path = report.save()
    print(f"\nreport: {path}")
    return 0
