"""``branchgym bench branching``: what branching costs and what shared prefixes save.

For every env in :data:`ENVS` (adapters add theirs with one line) and the same policy,
the study grows rollout trees and reports:

* branching overhead = (snapshot + restore time) / rollout time (generation + env
  steps), next to the source's 0.6 % (WebShop), 2.4 % (ALFWorld), 4.2 % (SWE-bench);
* tokens saved by shared prefixes against independent rollouts with the same leaves,
  next to the source's 19-31 % (BranchOPD, 7 trajectories per input);
* the state-keeping choice: ``keep="snapshot"`` (snapshot every backbone step, release
  the unchosen) against ``keep="replay"`` (replay the backbone to the chosen steps):
  time spent and peak live snapshots/bytes.

Setups: Branching PO (M = 2, K = 4, entropy schedule: N = 7) and BranchOPD (B = 3 forks
by fork score with a second random model as teacher, k = 2 continuations: up to 7).
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
from tqdm import tqdm

from branchgym.bench import source
from branchgym.bench.common import Report
from branchgym.rollout.executors import InProcessExecutor
from branchgym.rollout.tree import TreeStats

__all__ = ["configure", "main", "ENVS", "SOURCE_OVERHEAD", "SOURCE_TOKENS_SAVED"]

#: env id -> gym.make kwargs. Adapters add one line each, e.g.
#: ``"branchgym/WebShop-v0": {"max_episode_steps": 15},``
ENVS: dict[str, dict[str, Any]] = {
    "branchgym/TextTreeMDP-v0": {"depth": 6, "max_episode_steps": 10},
    "branchgym/WebShop-v0": {"max_episode_steps": 15},
    "branchgym/ALFWorld-v0": {"max_episode_steps": 20},
    "branchgym/SWEBench-v0": {"max_episode_steps": 10},
}

#: Branching overhead the BPO source reports (its Table 4): :mod:`branchgym.bench.source`.
SOURCE_OVERHEAD = source.BRANCHING_OVERHEAD

#: Student tokens saved by BranchOPD vs 7 independent rollouts, as the source reports.
SOURCE_TOKENS_SAVED = source.TOKENS_SAVED


def configure(parser: argparse.ArgumentParser) -> None:
    """Add this study's options."""
    parser.add_argument("--out", default="results", help="results folder (default: results)")
    parser.add_argument("--envs", nargs="*", default=None, help="env ids (default: ENVS)")
    parser.add_argument("--trees", type=int, default=6, help="trees (task seeds) per setup")
    parser.add_argument("--model", default="tiny", help="tiny, smollm2 or a model folder")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="2 trees per setup")
    parser.add_argument(
        "--swebench-tasks",
        default="generated",
        help="SWE-bench task set: generated (12 toys) or realistic (20 real-project tasks)",
    )
    parser.add_argument(
        "--swebench-backend",
        default="local",
        help="SWE-bench sandbox backend: local (overlay where it mounts, else git), overlay, "
        "git, docker or docker-git",
    )


class _RestoreTimes(InProcessExecutor):
    """The study's executor: it also keeps each restore's seconds (``seconds``)."""

    def __init__(self) -> None:
        """An in-process pool with no cap on instances."""
        super().__init__()
        self.seconds: list[float] = []

    def restore(self, specs: Any, refs: Any, **kw: Any) -> list[Any]:
        """Restore as usual; record how long each successful restore took."""
        outs = super().restore(specs, refs, **kw)
        self.seconds += [o.seconds for o in outs if o.error is None]
        return outs


def _grow(
    env_id: str,
    kwargs: dict,
    policy: Any,
    setup: str,
    keep: str,
    seeds: Any,
    teacher: Any,
    ex: Any,
) -> TreeStats:
    """Sum the stats of one tree per seed; ``ex``'s pool is shared, so no env is rebuilt."""
    from branchgym.rollout.executor_base import EnvRecipe
    from branchgym.rollout.grow import group_rollouts, grow_tree

    spec = EnvRecipe(env_id, kwargs)
    total = TreeStats()
    for s in seeds:
        common = {"seed": int(s), "rng": int(s), "executor": ex}
        if setup == "bpo":
            opts = {"min_gap": 16, "fill": True}
            tree = grow_tree(
                spec, policy, "entropy", m=2, k=4, keep=keep, schedule_options=opts, **common
            )
        elif setup == "branch_opd":
            tree = grow_tree(
                spec,
                policy,
                "fork_score",
                m=3,
                k=3,
                keep=keep,
                teacher=teacher,
                schedule_options={"min_entropy": 0.5},
                **common,
            )
        else:
            tree = group_rollouts(spec, policy, 7, **common)
        total += tree.stats
    return total


def _state_keeping(report: Report, envs: dict[str, dict[str, Any]], n_trees: int, ex: Any) -> None:
    """Snapshot every step vs replay to the chosen steps, with a fast random text policy."""
    from branchgym.agents.policies.policy import TextPolicy
    from branchgym.rollout.executor_base import EnvRecipe
    from branchgym.rollout.grow import grow_tree

    rows = []
    for env_id, kwargs in envs.items():
        spec = EnvRecipe(env_id, kwargs)
        for keep in ("snapshot", "replay"):
            st = TreeStats()
            try:
                for s in range(n_trees):
                    st += grow_tree(
                        spec,
                        TextPolicy(),
                        "entropy",
                        m=2,
                        k=4,
                        seed=s,
                        rng=s,
                        keep=keep,
                        executor=ex,
                        schedule_options={"gap_unit": "steps"},
                    ).stats
            except ValueError as exc:  # no admissible actions to sample from
                print(f"state keeping: {env_id} skipped ({exc})")
                break
            rows.append(
                [
                    env_id.split("/")[-1],
                    keep,
                    st.snapshots_taken / n_trees,
                    st.replay_steps / n_trees,
                    f"{1000 * st.snapshot_s / n_trees:.3f}",
                    f"{1000 * st.restore_s / n_trees:.3f}",
                    f"{1000 * st.wall_s / n_trees:.2f}",
                    f"{st.peak_live_snapshots}",
                    f"{st.peak_live_bytes}",
                ]
            )
            report.data[f"state_keeping|{env_id}|{keep}"] = st.as_dict()
    report.add(
        f"## Keeping candidate states until the schedule picks\n\nRandom text policy "
        f"(admissible actions), M = 2, K = 4, {n_trees} trees; per tree. *snapshot*: a "
        "snapshot before every backbone decision, unchosen ones released after the pick. "
        "*replay*: reset with the seed and replay the backbone once, snapshotting only "
        "at the chosen steps (replay time counts as restore time)."
    )
    print(
        report.table(
            [
                "env",
                "keep",
                "snapshots",
                "replay steps",
                "snapshot ms",
                "restore ms",
                "tree ms",
                "peak live",
                "peak bytes",
            ],
            rows,
        )
    )


def main(args: argparse.Namespace) -> int:
    """Run the study and write ``<out>/branching.md``."""
    from branchgym import live_snapshots
    from branchgym.agents.engines.hf import HFEngine
    from branchgym.agents.policies.models import load_model, tiny_qwen2
    from branchgym.agents.policies.policy import LLMPolicy

    n_trees = min(args.trees, 2) if args.quick else args.trees
    seeds = np.arange(n_trees)
    model, tok = load_model(args.model)
    engine = HFEngine(model, tok, max_new_tokens=args.max_new_tokens, threads=args.threads)
    policy = LLMPolicy(engine, max_new_tokens=args.max_new_tokens)
    t_model, t_tok = tiny_qwen2(seed=1)  # a different random model plays the teacher
    t_engine = HFEngine(t_model, t_tok, prefix_cache_entries=4)

    teacher = policy.teacher_hook(t_engine)

    envs = {e: ENVS.get(e, {}) for e in args.envs} if args.envs else dict(ENVS)
    if "branchgym/SWEBench-v0" in envs:
        tasks = getattr(args, "swebench_tasks", "generated")
        backend = getattr(args, "swebench_backend", "local")
        envs["branchgym/SWEBench-v0"] = {
            **envs["branchgym/SWEBench-v0"],
            "tasks": tasks,
            "backend": backend,
        }
    from branchgym.registration import branch_spec

    for env_id in list(envs):  # adapters whose extra is not installed are left out, loudly
        missing = branch_spec(env_id).missing() if env_id.startswith("branchgym/") else []
        if missing:
            print(f"branching bench: {env_id} skipped (needs extra {', '.join(missing)})")
            del envs[env_id]
    ex = _RestoreTimes()  # one env pool for the whole study
    for env_id, kwargs in envs.items():  # build the instances before anything is timed
        _grow(env_id, kwargs, policy, "group", "-", [0], teacher, ex)
    rows, data = [], {}
    jobs = [
        (e, s, k)
        for e in envs
        for s, k in [
            ("bpo", "snapshot"),
            ("bpo", "replay"),
            ("branch_opd", "snapshot"),
            ("group", "-"),
        ]
    ]
    for env_id, setup, keep in tqdm(jobs, desc="branching bench"):
        ex.seconds.clear()
        st = _grow(env_id, envs[env_id], policy, setup, keep, seeds, teacher, ex)
        restores = list(ex.seconds)
        rollout_s = st.generate_s + st.env_s
        key = f"{env_id}|{setup}|{keep}"
        data[key] = st.as_dict()
        data[key]["restore_median_s"] = float(np.median(restores)) if restores else None
        data[key]["restores"] = len(restores)
        src_o = SOURCE_OVERHEAD.get(env_id)
        src_t = SOURCE_TOKENS_SAVED.get(env_id)
        rows.append(
            [
                env_id.split("/")[-1],
                {"bpo": "BPO M=2 K=4", "branch_opd": "BranchOPD B=3 k=2", "group": "7 independent"}[
                    setup
                ],
                keep,
                st.rollouts,
                st.env_steps,
                st.generated_tokens,
                st.independent_tokens,
                f"{100 * st.tokens_saved:.1f} %",
                f"{1000 * st.snapshot_s / n_trees:.2f}",
                f"{1000 * st.restore_s / n_trees:.2f}",
                (
                    f"{1000 * np.median(restores):.2f} / {1000 * np.mean(restores):.2f} "
                    f"({len(restores)})"
                )
                if restores
                else "-",
                f"{rollout_s / n_trees:.2f}",
                f"{100 * st.branching_overhead:.3f} %",
                f"{st.peak_live_snapshots} / {st.peak_live_bytes}",
                (f"{100 * src_o:.1f} %" if src_o else "")
                + (f", {100 * src_t:.0f} % saved" if src_t else ""),
            ]
        )
    if live_snapshots().count:
        print(f"warning: {live_snapshots().count} snapshots still alive")
    report = Report(args.out, "branching", "branchgym bench branching")
    report.add(
        f"## Overhead and tokens saved\n\nPolicy: {args.model} model through LLMPolicy "
        f"(max {args.max_new_tokens} new tokens per action), the same for every env. "
        f"{n_trees} trees (task seeds) per row; times are per tree, except the median and mean of "
        "single restores (each into a free pool instance, as a sibling restores; n: how "
        "many). Overhead = "
        "(snapshot + restore) / (generation + env steps). Tokens saved = 1 - generated / "
        "what independent rollouts to the same leaves generate. *keep*: how candidate "
        "states wait for the schedule (snapshot every step vs replay to the chosen). "
        "Source: the BPO source's overhead (Table 4) and BranchOPD's tokens saved."
    )
    print(
        report.table(
            [
                "env",
                "setup",
                "keep",
                "rollouts",
                "env steps",
                "gen tokens",
                "indep tokens",
                "tokens saved",
                "snapshot ms",
                "restore ms",
                "restore median / mean ms (n)",
                "rollout s",
                "overhead",
                "peak live / bytes",
                "source",
            ],
            rows,
        )
    )
    report.data.update(data)
    _state_keeping(report, envs, 10 if args.quick else 50, ex)
    ex.shutdown()
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, max(3.2, 1.2 + 0.26 * len(rows))), sharey=True)
    labels = [f"{r[0]}: {r[1]}" + (f" ({r[2]})" if r[2] not in ("", "-") else "") for r in rows]
    y = np.arange(len(rows))
    envs_of_rows = [str(r[0]) for r in rows]
    palette = {e: f"C{i}" for i, e in enumerate(dict.fromkeys(envs_of_rows))}
    colors = [palette[e] for e in envs_of_rows]
    axes[0].barh(y, [100 * d["branching_overhead"] for d in data.values()], color=colors)
    marked = [(i, 100 * SOURCE_OVERHEAD[f"branchgym/{e}"]) for i, e in enumerate(envs_of_rows)
              if f"branchgym/{e}" in SOURCE_OVERHEAD]  # fmt: skip
    if marked:
        axes[0].plot([v for _, v in marked], [i for i, _ in marked], "k|", markersize=9,
                     label="source's overhead")  # fmt: skip
        axes[0].legend(fontsize=7)
    axes[0].set_yticks(y, labels, fontsize=7)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("branching overhead, % of rollout time")
    axes[1].barh(y, [100 * d["tokens_saved"] for d in data.values()], color=colors)
    axes[1].axvspan(19, 31, color="0.85", zorder=0, label="source 19-31 %")
    axes[1].tick_params(labelleft=False)
    axes[1].set_xlabel("tokens saved vs independent, %")
    axes[1].legend(fontsize=7)
    report.figure(fig, "overview", "Branching overhead and tokens saved per env and setup")
    path = report.save()
    print(f"\nreport: {path}")
    return 0
