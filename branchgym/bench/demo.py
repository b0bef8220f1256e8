"""``branchgym demo``: the main job. Compact studies 1-4 and one summary table.

``make demo`` runs this on its embedded defaults: about ten minutes on a 2-core CPU.
It runs, each into ``<out>/``:

1. ``snapshot``: snapshot, restore and fork cost per env, against replay (quick mode);
2. ``branching``: branching overhead and tokens saved with the tiny LLM policy;
3. ``variance``: the source's diagnostic per env, exact ratio on TreeMDP;
4. ``learning``: Branching PO vs GRPO vs RLOO at matched rollouts (when the learners
   and their extra are installed);

then prints the headline figures next to the source documents' and says where the
reports and plots are. Every figure comes from this run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path
from typing import Any

from branchgym.bench import source
from branchgym.bench.common import Report

__all__ = ["configure", "main", "run_study", "STEPS"]

#: (study, arguments) run by the demo, in order; ``{out}`` is the results folder.
STEPS: list[tuple[str, list[str]]] = [
    ("snapshot", ["--quick"]),
    ("branching", ["--trees", "2", "--max-new-tokens", "16"]),
    ("variance", ["--prompts", "6"]),
    ("learning", ["--quick"]),
]

#: What the source documents report, for the summary table.
SOURCE = {
    "snapshot_ms": {k.split("/")[-1]: v for k, v in source.SNAPSHOT_MS.items()},
    "overhead": {k.split("/")[-1]: 100 * v for k, v in source.BRANCHING_OVERHEAD.items()},
}


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of ``branchgym demo``."""
    parser.add_argument("--out", default="results/demo", help="results folder")
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=[name for name, _ in STEPS],
        help="studies to leave out",
    )


def run_study(name: str, argv: list[str], out: str) -> tuple[int, float]:
    """Run ``branchgym bench <name> <argv> --out <out>``; (exit code, seconds)."""
    from branchgym.bench import STUDIES

    module = importlib.import_module(STUDIES[name][0])
    parser = argparse.ArgumentParser(prog=f"branchgym bench {name}")
    module.configure(parser)
    args = parser.parse_args([*argv, "--out", out])
    t0 = time.perf_counter()
    code = int(module.main(args) or 0)
    return code, time.perf_counter() - t0


def _load(out: Path, name: str) -> dict[str, Any]:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _summary_rows(out: Path) -> list[list[str]]:
    rows: list[list[str]] = []
    snap = _load(out, "snapshot").get("registered", {})
    for env_id, m in snap.items():
        name = env_id.split("/")[-1]
        both = m["snapshot"]["median_ms"] + m["restore"]["median_ms"]
        src = SOURCE["snapshot_ms"].get(name)
        rows.append(
            [
                "snapshot + restore (median)",
                name,
                f"{both:.3f} ms",
                f"{src:.0f} ms" if src else "",
                f"fork {m['fork']['median_ms']:.3f} ms, "
                f"replay {m['replay']['median_ms']:.2f} ms at depth {m['depth']}",
            ]
        )
    branching = _load(out, "branching")
    for key, st in branching.items():
        parts = key.split("|")
        if len(parts) != 3 or parts[1] != "bpo" or parts[2] != "snapshot":
            continue
        name = parts[0].split("/")[-1]
        src = SOURCE["overhead"].get(name)
        rows.append(
            [
                "branching overhead, BPO M=2 K=4",
                name,
                f"{100 * st['branching_overhead']:.3f} %",
                f"{src} %" if src else "",
                f"tokens saved vs independent {100 * st['tokens_saved']:.1f} %",
            ]
        )
    for d in _load(out, "variance").get("diagnostics", []):
        exact = d.get("exact_ratio")
        rows.append(
            [
                "Var(A^BPO)/Var(A^GRPO), midpoint diagnostic",
                d["env_id"].split("/")[-1],
                f"{d['ratio']:.3f} ± {d['ratio_se']:.3f}",
                "0.36 (64 % lower, worked example)",
                f"exact {exact:.3f}" if exact is not None else d["policy"],
            ]
        )
    learning = _load(out, "learning").get("summary", {})
    for metric, v in learning.items():
        rows.append(
            [metric, v.get("env", ""), v.get("ours", ""), v.get("source", ""), v.get("note", "")]
        )
    return rows


def main(args: argparse.Namespace) -> int:
    """Run the compact studies and print the summary."""
    from branchgym.bench import STUDIES

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timings, failed = [], []
    for name, argv in STEPS:
        if name in args.skip:
            continue
        if name not in STUDIES:
            print(f"demo: study {name!r} is not available in this install; skipped")
            continue
        print(
            f"\n=== demo {len(timings) + 1}/{len(STEPS)}: branchgym bench {name} {' '.join(argv)}"
        )
        try:
            code, secs = run_study(name, argv, str(out))
        except ImportError as exc:  # an optional extra is missing: say which, go on
            print(f"demo: {name} skipped ({exc})")
            continue
        timings.append((name, secs))
        if code:
            failed.append(name)
    report = Report(out, "summary", "branchgym demo: summary")
    rows = _summary_rows(out)
    report.add(
        "Headline figures of this run next to the source documents'. Each study's report "
        "(setup, seeds, budgets, every figure) is in the same folder."
    )
    table = report.table(["figure", "env", "branchgym (this run)", "source", "detail"], rows)
    report.add("Run time: " + ", ".join(f"{n} {s:.0f} s" for n, s in timings))
    plots = sorted(p.name for p in out.glob("*.png"))
    report.add("Plots: " + ", ".join(plots))
    path = report.save()
    print("\n" + "=" * 78 + "\nbranchgym demo: summary\n")
    print(table)
    print("\nreports: " + ", ".join(str(out / f"{n}.md") for n, _ in timings))
    print("plots:   " + ", ".join(str(out / p) for p in plots))
    print(f"summary: {path}")
    if failed:
        print(f"demo: studies that failed: {', '.join(failed)}")
        return 1
    return 0
