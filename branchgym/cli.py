"""The ``branchgym`` command: list, check, play and bench.

branchgym list                         registered envs, snapshot kind, picklable
branchgym check ENV_ID|module:attr     snapshot checks + fidelity suite; exit 1 on failure
branchgym play ENV_ID                  play by hand, fork with :snap / :restore N
branchgym bench STUDY [...]            benchmarks (branchgym bench --help)
branchgym scenarios                    injected faults x fidelity checks: detection matrix
branchgym train --algo ALGO [...]      train a reference learner (branchgym train --help)
branchgym eval ENV_ID --agent SPEC     score an agent on a pinned protocol; eval compare A B
branchgym view PATH [--out FILE]       a tree file or a run folder's trees as one HTML page
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import branchgym
from branchgym.agents import train as train_cli
from branchgym.bench.common import positive_int, seed_int
from branchgym.envs.alfworld import cli as alfworld_cli
from branchgym.error import Error
from branchgym.evaluation import command as eval_cli

__all__ = ["main", "COMMANDS"]


# ------------------------------------------------------------------------ list


def cmd_list(args: argparse.Namespace) -> int:
    """Print every registered env with its snapshot support."""
    from branchgym.tables import markdown_table

    rows = []
    for s in branchgym.branch_specs():
        missing = s.missing()
        status = f"needs: pip install 'branchgym[{','.join(missing)}]'" if missing else "ready"
        rows.append(
            [s.id, s.snapshot, s.kind, "yes" if s.picklable else "no", status, s.description]
        )
    print(markdown_table(["id", "strategy", "kind", "picklable", "status", "description"], rows))
    return 0


# ----------------------------------------------------------------------- check


def configure_check(p: argparse.ArgumentParser) -> None:
    """Options of ``branchgym check``."""
    p.add_argument("target", nargs="?", help="registered env id, or module:attr (class or factory)")
    p.add_argument(
        "--all", action="store_true", help="check every registered env that can be built"
    )
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument(
        "--max-examples",
        type=positive_int,
        default=None,
        help="programs the fidelity property suite generates (default: its default budget)",
    )
    p.add_argument(
        "--fidelity-mode",
        choices=("auto", "exact", "distributional"),
        default="auto",
        help="exact step comparison, or distribution tests for envs whose snapshots leave "
        "the RNG out (auto: read snapshot_includes_rng)",
    )
    p.add_argument(
        "--no-fidelity", action="store_true", help="run check_env only, not the property suite"
    )


def _fidelity_report(target: str, args: argparse.Namespace) -> bool:
    """Print the property suite's report for ``target``; True when it passed."""
    from branchgym.fidelity.suite import DEFAULT_MAX_EXAMPLES, check_snapshot_fidelity

    try:
        report = check_snapshot_fidelity(
            target,
            seed=args.seed,
            max_examples=args.max_examples or DEFAULT_MAX_EXAMPLES,
            mode=args.fidelity_mode,
        )
    except Error:
        raise
    except Exception as exc:  # the env cannot even be built: report, do not trace back
        print(f"check_snapshot_fidelity: {target}\n  FAILED: {type(exc).__name__}: {exc}")
        return False
    print(report)
    return report.ok


def cmd_check(args: argparse.Namespace) -> int:
    """Run the snapshot checks and the fidelity property suite; exit 1 when any fails."""
    from branchgym.fidelity.checks import check_env

    if args.all:
        targets = [s.id for s in branchgym.branch_specs() if not s.missing()]
    elif args.target:
        targets = [args.target]
    else:
        print("branchgym check: give an env id or module:attr, or --all", file=sys.stderr)
        return 2
    ok = True
    for target in targets:
        report = check_env(target, seed=args.seed)
        print(report)
        ok = ok and report.ok
        if not args.no_fidelity:
            ok = _fidelity_report(target, args) and ok
    return 0 if ok else 1


# ------------------------------------------------------------------------ play

PLAY_HELP = """commands:
  :snap            take a snapshot (numbered from 0)
  :restore N       restore snapshot N (fork from there)
  :history         actions since reset, and the snapshots
  :actions         admissible actions, when the env lists them
  :reset [SEED]    start a new episode
  :help            this text
  :quit            leave
anything else is an action (integers for discrete action spaces)"""


def _parse_action(env: Any, text: str) -> Any:
    import gymnasium as gym

    space = env.action_space
    if isinstance(space, gym.spaces.Discrete):
        try:
            return int(text)
        except ValueError as exc:
            raise ValueError(
                f"this env takes integer actions in [0, {space.n}); got {text!r}"
            ) from exc
    return text


def play(
    env_id: str, *, seed: int = 0, stdin: TextIO | None = None, stdout: TextIO | None = None
) -> int:
    """Interactive text play with snapshots, so a person can fork by hand."""
    stdin = stdin or sys.stdin
    out = stdout or sys.stdout
    env = branchgym.make(env_id)

    def say(*a: Any) -> None:
        print(*a, file=out, flush=True)

    obs, info = env.reset(seed=seed)
    history: list[Any] = []
    snaps: list[tuple[branchgym.Snapshot, list[Any], float]] = []
    say(f"{env_id} (seed {seed}). Type :help for commands.\n")
    say(obs)
    ret = 0.0
    try:
        while True:
            out.write("> ")
            out.flush()
            line = stdin.readline()
            if not line:
                break
            line = line.strip()
            if not line:
                continue
            if line in (":quit", ":q", ":exit"):
                break
            if line == ":help":
                say(PLAY_HELP)
            elif line == ":snap":
                snaps.append((branchgym.snapshot(env), list(history), ret))
                s = snaps[-1][0]
                say(
                    f"snapshot {len(snaps) - 1} at step {len(history)} ({s.kind}, {s.nbytes} bytes)"
                )
            elif line.startswith(":restore"):
                parts = line.split()
                try:
                    n = int(parts[1])
                    snap, hist, ret_then = snaps[n]
                except (IndexError, ValueError):
                    say(
                        f"usage: :restore N with N in 0..{len(snaps) - 1}"
                        if snaps
                        else "no snapshots yet; use :snap"
                    )
                    continue
                obs, info = branchgym.restore(env, snap)
                history, ret = list(hist), ret_then
                say(f"restored snapshot {n} (step {len(history)})")
                say(obs)
            elif line == ":history":
                say("actions: " + (" -> ".join(map(str, history)) or "(none)"))
                for i, (s, h, _) in enumerate(snaps):
                    say(f"  snapshot {i}: step {len(h)}, {s.kind}")
            elif line == ":actions":
                acts = info.get("admissible_actions") if isinstance(info, dict) else None
                say("\n".join(map(str, acts)) if acts else f"action space: {env.action_space}")
            elif line.startswith(":reset"):
                parts = line.split()
                seed = int(parts[1]) if len(parts) > 1 else seed + 1
                obs, info = env.reset(seed=seed)
                history, ret = [], 0.0
                say(obs)
            elif line.startswith(":"):
                say(f"unknown command {line!r}; :help lists them")
            else:
                try:
                    action = _parse_action(env, line)
                except ValueError as exc:
                    say(str(exc))
                    continue
                obs, reward, terminated, truncated, info = env.step(action)
                history.append(action)
                ret += float(reward)
                say(obs)
                if reward:
                    say(f"[reward {float(reward):.3f}]")
                if terminated or truncated:
                    end = "terminated" if terminated else "truncated"
                    say(
                        f"[episode {end}: return {ret:.3f}; "
                        ":restore N to fork, :reset to start over]"
                    )
    finally:
        for s, _, _ in snaps:
            s.release()
        env.close()
    return 0


def configure_play(p: argparse.ArgumentParser) -> None:
    """Options of ``branchgym play``."""
    p.add_argument("env_id")
    p.add_argument("--seed", type=seed_int, default=0)


def cmd_play(args: argparse.Namespace) -> int:
    """Play an env in the terminal."""
    return play(args.env_id, seed=args.seed)


# ----------------------------------------------------------------------- bench


def configure_bench(p: argparse.ArgumentParser) -> None:
    """One sub-command per study in :data:`branchgym.bench.STUDIES`."""
    from branchgym.bench import STUDIES

    sub = p.add_subparsers(dest="study", metavar="STUDY", required=True)
    for name, (module, help_) in STUDIES.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.set_defaults(_study_module=module)
        try:
            importlib.import_module(module).configure(sp)
        except ImportError as exc:  # a study whose extra is missing still shows up
            sp.set_defaults(_study_error=str(exc))
        sp.add_argument(
            "--log",
            dest="_train_log",
            default=None,
            metavar="SINKS",
            help="metrics sinks of the runs this study trains, comma-separated: "
            "jsonl,tensorboard,wandb (as branchgym train --log)",
        )


def cmd_bench(args: argparse.Namespace) -> int:
    """Run one study."""
    if getattr(args, "_study_error", None):
        print(f"branchgym bench {args.study}: {args._study_error}", file=sys.stderr)
        return 2
    from branchgym.bench.runs import training_options

    log = {"log": args._train_log} if getattr(args, "_train_log", None) else {}
    with training_options(**log):
        return int(importlib.import_module(args._study_module).main(args) or 0)


# ------------------------------------------------------------------- scenarios


def configure_scenarios(p: argparse.ArgumentParser) -> None:
    """Options of ``branchgym scenarios``."""
    p.add_argument(
        "--seeds", type=positive_int, default=3, help="seeds per scenario and env (default 3)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="CI size: 1 seed, a 200-step workload, 30 programs for benign rows (must-detect "
        "rows keep the property suite's default budget)",
    )
    p.add_argument("--scenarios", nargs="*", default=None, help="scenario names (default: all)")
    p.add_argument(
        "--envs",
        nargs="*",
        default=None,
        help="env ids (default: branchgym.scenarios.SCENARIO_ENVS; any registered id works)",
    )
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument("--out", default=None, help="also write <out>/scenarios.md")


def cmd_scenarios(args: argparse.Namespace) -> int:
    """Print the detection matrix; exit 1 on a missed must-detect or a flagged benign row."""
    from pathlib import Path

    from branchgym.scenarios import SCENARIO_ENVS, SCENARIOS, ScenarioEnv
    from branchgym.scenarios.matrix import render_matrix, run_matrix
    from branchgym.tables import markdown_table

    if args.list:
        rows = [
            [s.name, s.verdict, ", ".join(s.needs) or "-", s.summary] for s in SCENARIOS.values()
        ]
        print(markdown_table(["scenario", "expected", "needs", "bug modelled"], rows))
        return 0
    known = {e.id: e for e in SCENARIO_ENVS}
    envs = [known.get(i, ScenarioEnv(i)) for i in args.envs] if args.envs else None
    seeds = range(1 if args.quick else args.seeds)
    rows = run_matrix(
        args.scenarios,
        envs,
        seeds=seeds,
        workload_steps=200 if args.quick else 300,
        benign_max_examples=30 if args.quick else None,
    )
    text = render_matrix(rows)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "scenarios.md").write_text(f"# branchgym scenarios\n\n{text}\n")
    bad = [r for r in rows if r.outcome in ("MISSED", "FALSE POSITIVE")]
    for r in bad:
        print(f"{r.outcome}: {r.scenario} on {r.env}", file=sys.stderr)
    return 1 if bad else 0


def _lazy(module: str, name: str) -> Callable[..., Any]:
    """A function that imports ``module`` only when the command runs (keeps start-up fast)."""

    def call(*args: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args)

    return call


#: command name -> (configure, run, help). Later features add theirs here.
COMMANDS: dict[
    str,
    tuple[
        Callable[[argparse.ArgumentParser], None] | None, Callable[[argparse.Namespace], int], str
    ],
] = {
    "list": (None, cmd_list, "list registered envs and their snapshot support"),
    "check": (configure_check, cmd_check, "run the snapshot checks on an env"),
    "play": (configure_play, cmd_play, "play an env in the terminal, forking with snapshots"),
    "bench": (configure_bench, cmd_bench, "run a benchmark study"),
    "serve": (
        _lazy("branchgym.serve.command", "configure"),
        _lazy("branchgym.serve.command", "run"),
        "serve an env over OpenEnv's protocol, with snapshot, restore and fork (extra: serve)",
    ),
    "alfworld": (
        alfworld_cli.configure,
        alfworld_cli.run,
        "ALFWorld problems: generate, rebuild the shipped sets, run the planner expert",
    ),
    "demo": (
        _lazy("branchgym.bench.demo", "configure"),
        _lazy("branchgym.bench.demo", "main"),
        "the main job: compact snapshot, branching, variance and learning studies + summary",
    ),
    "diagnose": (
        _lazy("branchgym.bench.diagnose", "configure_diagnose"),
        _lazy("branchgym.bench.diagnose", "cmd_diagnose"),
        "will branching pay on my task? the source's variance diagnostic, one answer",
    ),
    "scenarios": (
        configure_scenarios,
        cmd_scenarios,
        "injected fidelity faults x checks: detection matrix (exit 1 on a miss)",
    ),
    "view": (
        _lazy("branchgym.viewer", "configure"),
        _lazy("branchgym.viewer", "run"),
        "a rollout tree file or a run's saved trees as one self-contained HTML page",
    ),
    "eval": (
        eval_cli.configure,
        eval_cli.run,
        "score an agent on a pinned protocol (WebShop, ALFWorld, SWE-bench) with intervals; "
        "'eval compare A B' pairs two runs",
    ),
    "train": (
        train_cli.configure,
        train_cli.run,
        "train a reference learner (bpo, grpo, rloo, bellman_po, branch_opd, opd, opd_multi, "
        "sft); metrics as JSONL, safetensors checkpoints",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser."""
    parser = argparse.ArgumentParser(
        prog="branchgym",
        description="Snapshottable sandboxes and branching rollouts for LLM agents.",
    )
    parser.add_argument("--version", action="version", version=f"branchgym {branchgym.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (configure, run, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if configure is not None:
            configure(p)
        p.set_defaults(_run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``branchgym`` command."""
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except Error as exc:
        print(f"branchgym {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
