"""``branchgym bench snapshot``: what a snapshot costs, per env and strategy, against replay.

Sections (each a function ``section(report, args)``; adapters add their own scaling
studies to :data:`SECTIONS`):

* every registered env: median and p90 of snapshot and restore time, snapshot bytes, and
  the cost of reaching the same state by replay (reset + the action prefix), next to the
  figures the source documents report (42 / 138 / 1,920 ms);
* CartPole: ``PickleSnapshot`` against ``ReplaySnapshot`` at depths 10, 100 and 1,000.
"""

from __future__ import annotations

import argparse
import importlib
import time
from typing import Any

import gymnasium as gym
import numpy as np
from tqdm import tqdm

from branchgym.bench import source
from branchgym.bench.common import Report, Timing
from branchgym.core import restore, snapshot

__all__ = ["configure", "main", "SECTIONS", "SOURCE_MS", "measure_env", "selected_sections"]

#: Snapshot cost the BPO source reports (its Table 4), by our env id.
SOURCE_MS = source.SNAPSHOT_MS

#: Report sections, run in order: ``"module:function"`` taking ``(report, args)``, and
#: the env id the section studies (``None``: every registered env; the section filters
#: ``--envs`` itself). ``--envs`` runs a section only when its env id is named.
SECTIONS: list[tuple[str, str | None]] = [
    ("branchgym.bench.snapshot:section_registered", None),
    ("branchgym.bench.snapshot:section_cartpole", "CartPole-v1"),
    ("branchgym.bench.webshop:section_webshop", "branchgym/WebShop-v0"),
    ("branchgym.bench.alfworld:section_alfworld", "branchgym/ALFWorld-v0"),
    ("branchgym.bench.swebench:section_swebench", "branchgym/SWEBench-v0"),
]


def selected_sections(envs: list[str] | None) -> list[str]:
    """The sections ``--envs`` asks for (all of them when it names none)."""
    return [t for t, env_id in SECTIONS if not envs or env_id is None or env_id in envs]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add this study's options."""
    parser.add_argument("--out", default="results", help="results folder (default: results)")
    parser.add_argument("--repeats", type=int, default=30, help="timed repetitions per figure")
    parser.add_argument("--depth", type=int, default=5, help="steps taken before snapshotting")
    parser.add_argument(
        "--envs",
        nargs="*",
        default=None,
        help="env ids to measure, and the scaling sections to run: CartPole-v1, "
        "branchgym/WebShop-v0, branchgym/ALFWorld-v0, branchgym/SWEBench-v0 (default: all)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="fewer repeats and depths (CI)")
    parser.add_argument(
        "--swebench-tasks",
        default="generated",
        help="SWE-bench task set: generated (12 toys) or realistic (20 real-project tasks)",
    )


def _walk_to_depth(env: gym.Env, seed: int, depth: int) -> tuple[list[Any], float]:
    """Reset and take up to ``depth`` seeded random actions; returns (actions, seconds)."""
    from branchgym.fidelity.checks import ActionChooser

    chooser = ActionChooser(env, seed)
    t0 = time.perf_counter()
    _, info = env.reset(seed=seed)
    actions = []
    for _ in range(depth):
        a = chooser(info)
        _, _, terminated, truncated, info = env.step(a)
        actions.append(a)
        if terminated or truncated:
            _, info = env.reset(seed=seed)
            actions = []
    return actions, time.perf_counter() - t0


def measure_env(
    env: gym.Env, *, seed: int, depth: int, repeats: int, other: gym.Env | None = None
) -> dict[str, Any]:
    """Snapshot/restore timings and bytes at ``depth``, and replay to the same state.

    ``other``, a second instance of the same spec, measures a *fork*: restoring the
    snapshot into another instance (what a sibling on another sandbox does).
    """
    from branchgym.fidelity.checks import ActionChooser

    actions, _ = _walk_to_depth(env, seed, depth)
    chooser = ActionChooser(env, seed + 2)

    def move(e: gym.Env, info: dict[str, Any]) -> None:
        # One random step between timed operations: a restore must undo a real change,
        # as it does for a sibling (an unchanged state may make a restore free).
        e.step(chooser(info))

    fork_t = []
    if other is not None:
        other.reset(seed=seed + 1)
        with snapshot(env) as snap:
            for _ in range(max(3, repeats // 3) + 1):
                t0 = time.perf_counter()
                _, info = restore(other, snap)
                fork_t.append(time.perf_counter() - t0)
                move(other, info)
    snap_t, rest_t, nbytes = [], [], []
    with snapshot(env) as snap:
        _, info = restore(env, snap)
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        snap = snapshot(env)
        t1 = time.perf_counter()
        move(env, info)
        t2 = time.perf_counter()
        _, info = restore(env, snap)
        t3 = time.perf_counter()
        nbytes.append(snap.nbytes)
        kind, picklable = snap.kind, snap.picklable
        snap.release()
        snap_t.append(t1 - t0)
        rest_t.append(t3 - t2)
    replay_t = []
    for _ in range(max(3, repeats // 5)):
        t0 = time.perf_counter()
        env.reset(seed=seed)
        for a in actions:
            env.step(a)
        replay_t.append(time.perf_counter() - t0)
    step_t = []
    for _ in range(max(3, repeats // 5)):
        env.reset(seed=seed)
        for a in actions:
            t0 = time.perf_counter()
            env.step(a)
            step_t.append(time.perf_counter() - t0)
    return {
        "depth": len(actions),
        "kind": kind,
        "picklable": picklable,
        "snapshot": Timing.of(snap_t[1:]),
        "restore": Timing.of(rest_t[1:]),
        "fork": Timing.of(fork_t[1:]),
        "replay": Timing.of(replay_t),
        "step": Timing.of(step_t),
        "bytes": int(np.median(nbytes)),
    }


def _bench_kwargs(env_id: str, tasks: str = "generated") -> dict[str, Any]:
    """SWE-bench acts through shell commands: random text would change no file."""
    if env_id == "branchgym/SWEBench-v0":
        from branchgym.envs.swebench.env import PROBE_ACTIONS

        return {"suggested_actions": PROBE_ACTIONS, "tasks": tasks}
    return {}


def section_registered(report: Report, args: argparse.Namespace) -> None:
    """Every registered env that can be built here."""
    from branchgym.registration import branch_specs

    rows, data = [], {}
    specs = [s for s in branch_specs() if not args.envs or s.id in args.envs]
    for spec in tqdm(specs, desc="snapshot bench: envs", unit="env"):
        missing = spec.missing()
        if missing:
            rows.append(
                [spec.id, "-", "-", "-", "-", "-", "-", "-", f"needs extra {', '.join(missing)}"]
            )
            continue
        try:
            kw = _bench_kwargs(spec.id, getattr(args, "swebench_tasks", "generated"))
            env, other = gym.make(spec.id, **kw), gym.make(spec.id, **kw)
        except Exception as exc:  # report, never hide, an env that cannot be built
            rows.append([spec.id, "-", "-", "-", "-", "-", "-", "-", f"make failed: {exc}"[:80]])
            continue
        try:
            m = measure_env(
                env, seed=args.seed, depth=args.depth, repeats=args.repeats, other=other
            )
        finally:
            env.close()
            other.close()
        data[spec.id] = {k: (v.__dict__ if isinstance(v, Timing) else v) for k, v in m.items()}
        src = SOURCE_MS.get(spec.id)
        rows.append(
            [
                spec.id,
                m["kind"],
                f"{m['snapshot'].median_ms:.3f} / {m['snapshot'].p90_ms:.3f}",
                f"{m['restore'].median_ms:.3f} / {m['restore'].p90_ms:.3f}",
                f"{m['fork'].median_ms:.3f} / {m['fork'].p90_ms:.3f}",
                m["bytes"],
                f"{m['replay'].median_ms:.3f} (depth {m['depth']})",
                f"{m['step'].median_ms:.3f}",
                f"{src:.0f} ms" if src else "",
            ]
        )
    report.add(
        f"## Registered envs\n\nSnapshot taken after {args.depth} seeded random steps; "
        f"{args.repeats} timed snapshot+restore pairs each (median / p90, ms), with one "
        "random step between snapshot and restore so that the restore undoes a real change "
        "(SWE-bench steps are its probe commands, which write files). *Replay* is "
        "the cost of reaching the same state from reset by replaying the prefix, the "
        "alternative to a snapshot. *Fork* restores the snapshot into a second instance of "
        "the same spec (a sibling on another sandbox). *Source* is the snapshot cost the "
        "BPO source reports."
    )
    print(
        report.table(
            [
                "env",
                "kind",
                "snapshot ms",
                "restore ms",
                "fork ms",
                "bytes",
                "replay ms",
                "step ms",
                "source",
            ],
            rows,
        )
    )
    report.data["registered"] = data
    if data:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 0.5 + 0.45 * len(data)))
        names = list(data)
        snap = [data[n]["snapshot"]["median_ms"] + data[n]["restore"]["median_ms"] for n in names]
        fork = [data[n]["fork"]["median_ms"] for n in names]
        rep = [data[n]["replay"]["median_ms"] for n in names]
        y = np.arange(len(names))
        ax.barh(y - 0.27, snap, height=0.27, label="snapshot + restore")
        ax.barh(y, fork, height=0.27, label="fork (restore elsewhere)")
        ax.barh(y + 0.27, rep, height=0.27, label="replay to same state")
        for i, n in enumerate(names):
            if n in SOURCE_MS:
                ax.plot(SOURCE_MS[n], i, "k|", markersize=14)
        ax.set_yticks(y, names)
        ax.set_xscale("log")
        ax.set_xlabel("ms (log scale; | = source's snapshot cost)")
        ax.legend(loc="lower right", fontsize=8)
        report.figure(fig, "envs", "Snapshot + restore vs replay, per registered env (median)")


def _balance(obs: np.ndarray) -> int:
    """A PD controller that keeps CartPole up for thousands of steps."""
    x, x_dot, theta, theta_dot = obs
    return int(10 * theta + theta_dot + 0.01 * x + 0.1 * x_dot > 0)


def section_cartpole(report: Report, args: argparse.Namespace) -> None:
    """PickleSnapshot vs ReplaySnapshot on CartPole at growing depth."""
    from branchgym.wrappers import PickleSnapshot, ReplaySnapshot

    depths = [10, 100] if args.quick else [10, 100, 1000]
    rows, data = [], {}
    for wrapper in tqdm((PickleSnapshot, ReplaySnapshot), desc="snapshot bench: CartPole"):
        env = wrapper(gym.make("CartPole-v1", max_episode_steps=5000))
        for depth in depths:
            obs, _ = env.reset(seed=args.seed)
            for _ in range(depth):
                obs, *_ = env.step(_balance(obs))
            snap_t, rest_t, nb = [], [], []
            reps = max(5, args.repeats // (1 if depth < 1000 else 3))
            for _ in range(reps):
                t0 = time.perf_counter()
                s = env.snapshot()
                t1 = time.perf_counter()
                env.restore(s)
                t2 = time.perf_counter()
                nb.append(s.nbytes)
                s.release()
                snap_t.append(t1 - t0)
                rest_t.append(t2 - t1)
            st, rt = Timing.of(snap_t), Timing.of(rest_t)
            name = wrapper.__name__
            data.setdefault(name, {})[depth] = {
                "snapshot": st.__dict__,
                "restore": rt.__dict__,
                "bytes": int(np.median(nb)),
            }
            rows.append(
                [
                    name,
                    depth,
                    f"{st.median_ms:.3f} / {st.p90_ms:.3f}",
                    f"{rt.median_ms:.3f} / {rt.p90_ms:.3f}",
                    int(np.median(nb)),
                ]
            )
        env.close()
    report.add(
        "## CartPole: pickle vs replay by depth\n\nA balancing controller keeps the pole up, "
        "so depth is the number of steps since reset. Replay restores in time linear in "
        "depth; pickling is flat."
    )
    print(report.table(["strategy", "depth", "snapshot ms", "restore ms", "bytes"], rows))
    report.data["cartpole"] = data
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for name, by_depth in data.items():
        ds = sorted(by_depth)
        ax.plot(
            ds, [by_depth[d]["restore"]["median_ms"] for d in ds], "o-", label=f"{name} restore"
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("depth (steps since reset)")
    ax.set_ylabel("restore ms (median)")
    ax.legend(fontsize=8)
    report.figure(fig, "cartpole", "CartPole restore time by depth: pickle vs replay")


def main(args: argparse.Namespace) -> int:
    """Run every section and write ``<out>/snapshot.md``."""
    if args.quick:
        args.repeats = min(args.repeats, 10)
    report = Report(args.out, "snapshot", "branchgym bench snapshot")
    for target in selected_sections(args.envs):
        module, fn = target.split(":")
        getattr(importlib.import_module(module), fn)(report, args)
    path = report.save()
    print(f"\nreport: {path}")
    return 0
