"""``branchgym eval compare RUN_A RUN_B``: two runs on the tasks both ran, paired.

Two agents scored on the same tasks share the tasks' difficulty; the paired difference
(:func:`~branchgym.evaluation.stats.paired_difference`) removes it, so its interval is
narrower than the difference of two independent intervals. The comparison reports:

* the mean per-task difference A - B of success (and of WebShop's score) with its 95 %
  interval, next to each run's own mean on the shared tasks;
* the exact McNemar test on success, over (task, attempt) pairs;
* the tasks that flipped: A succeeded where B failed, and the reverse;
* a refusal when the two runs' protocols differ (another task list, cap, data or prompt
  format, :attr:`~branchgym.evaluation.protocols.PinnedProtocol.hash`), unless ``force``
  is given, in which case the report says so at its top.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from branchgym.error import DataError, OptionError
from branchgym.evaluation.runner import read_episodes
from branchgym.evaluation.stats import mcnemar_exact, mean_interval, paired_difference, task_means

__all__ = ["compare_runs", "compare_markdown", "load_run"]


def load_run(folder: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(summary, episodes)`` of a finished run folder."""
    folder = Path(folder)
    summary_path = folder / "summary.json"
    if not summary_path.exists():
        hint = (
            "it is unfinished: finish it with branchgym eval ... --resume"
            if (folder / "run.json").exists()
            else "it is not a branchgym eval run folder"
        )
        raise DataError(f"no summary.json in {folder}: {hint}")
    summary = json.loads(summary_path.read_text())
    episodes = list(read_episodes(folder / "episodes.jsonl").values())
    return summary, [e for e in episodes if e["outcome"] != "infra_error"]


def compare_runs(run_a: str | Path, run_b: str | Path, *, force: bool = False) -> dict[str, Any]:
    """Paired comparison of two run folders (see the module notes).

    Raises:
        OptionError: The protocols differ and ``force`` is not set, or no task is shared.
    """
    sa, ea = load_run(run_a)
    sb, eb = load_run(run_b)
    pa, pb = sa["protocol"], sb["protocol"]
    warnings = []
    if pa["hash"] != pb["hash"]:
        diff = [
            k
            for k in ("name", "version", "env_id", "tasks", "max_steps", "data_digest", "prompt")
            if pa.get(k) != pb.get(k)
        ] or ["task list"]
        msg = (
            f"the runs used different protocols ({pa['name']} {pa['hash']} vs {pb['name']} "
            f"{pb['hash']}: {', '.join(diff)} differ)"
        )
        if not force:
            raise OptionError(msg + "; their scores are not comparable (pass --force to pair "
                              "them anyway on the tasks both ran)")  # fmt: skip
        warnings.append("NOT COMPARABLE: " + msg)
    for s, name in ((sa, "A"), (sb, "B")):
        if s["protocol"].get("deviations"):
            warnings.append(f"run {name} deviates from the shipped protocol: "
                            + "; ".join(s["protocol"]["deviations"]))  # fmt: skip
    shared = sorted({e["task"] for e in ea} & {e["task"] for e in eb})
    if not shared:
        raise OptionError("the two runs share no scored task: nothing to compare")
    keep = set(shared)
    ea = [e for e in ea if e["task"] in keep]
    eb = [e for e in eb if e["task"] in keep]
    out: dict[str, Any] = {
        "a": {"run": str(run_a), "agent": sa["agent"]["spec"], "protocol": pa["hash"]},
        "b": {"run": str(run_b), "agent": sb["agent"]["spec"], "protocol": pb["hash"]},
        "warnings": warnings,
        "shared_tasks": len(shared),
        "metrics": {},
    }
    metrics = ["success"] + (["score"] if pa["metric"] == pb["metric"] == "score" else [])
    for metric in metrics:
        def value(e: dict[str, Any], metric: str = metric) -> float:
            return float(e["success"]) if metric == "success" else 100.0 * e["reward"]

        ma = task_means((e["task"], value(e)) for e in ea)
        mb = task_means((e["task"], value(e)) for e in eb)
        out["metrics"][metric] = {
            "a": mean_interval(ma, rate=metric == "success").to_dict(),
            "b": mean_interval(mb, rate=metric == "success").to_dict(),
            "a_minus_b": paired_difference(ma, mb).to_dict(),
        }
    sa_map = {(e["task"], e["attempt"]): bool(e["success"]) for e in ea}
    sb_map = {(e["task"], e["attempt"]): bool(e["success"]) for e in eb}
    pairs = sorted(set(sa_map) & set(sb_map))
    only_a = [p for p in pairs if sa_map[p] and not sb_map[p]]
    only_b = [p for p in pairs if sb_map[p] and not sa_map[p]]
    out["mcnemar"] = {
        "pairs": len(pairs),
        "a_only": len(only_a),
        "b_only": len(only_b),
        "p_value": mcnemar_exact(len(only_a), len(only_b)),
    }
    out["flipped"] = {
        "a_succeeded_b_failed": [f"{t}#{a}" for t, a in only_a],
        "b_succeeded_a_failed": [f"{t}#{a}" for t, a in only_b],
    }
    return out


def compare_markdown(result: dict[str, Any]) -> str:
    """The comparison as a short markdown report."""
    a, b = result["a"], result["b"]
    lines = [f"# {a['agent']} (A) vs {b['agent']} (B)", ""]
    lines += [f"**{w}**" for w in result["warnings"]]
    lines += [
        f"{result['shared_tasks']} shared tasks.",
        "",
        "| metric | A | B | A - B, paired [95 % interval] |",
        "|---|---|---|---|",
    ]
    for name, m in result["metrics"].items():
        d = m["a_minus_b"]
        lines.append(
            f"| {name} | {m['a']['mean']:.3f} | {m['b']['mean']:.3f} | "
            f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] |"
        )
    mc = result["mcnemar"]
    lines += [
        "",
        f"Exact McNemar on success over {mc['pairs']} (task, attempt) pairs: A alone "
        f"succeeded {mc['a_only']}, B alone {mc['b_only']}, p = {mc['p_value']:.4g}.",
    ]
    flips = result["flipped"]
    for key, label in (("a_succeeded_b_failed", "A only"), ("b_succeeded_a_failed", "B only")):
        if flips[key]:
            shown = ", ".join(flips[key][:20]) + (" ..." if len(flips[key]) > 20 else "")
            lines.append(f"- {label} ({len(flips[key])}): {shown}")
    return "\n".join(lines) + "\n"
