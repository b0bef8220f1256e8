"""What a run's episodes add up to: scores with intervals, pass@k, every denominator.

:func:`summarise` turns ``episodes.jsonl`` (and the run's ``run.json``) into
``summary.json``; :func:`report_markdown` writes it as ``report.md``. Scores leave out
infrastructure errors and say how many there were (:data:`OUTCOMES`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from branchgym.evaluation.stats import mean_interval, pass_at_k, pass_hat_k, task_means

__all__ = ["OUTCOMES", "report_markdown", "summarise"]

#: Every episode ends in one of these.
OUTCOMES = (
    "success",
    "failure",
    "step_limit",
    "token_limit",
    "time_limit",
    "agent_error",
    "infra_error",
)


def summarise(run_doc: dict[str, Any], episodes: list[dict[str, Any]]) -> dict[str, Any]:
    """Scores with intervals, pass@k, per-category tables and every denominator."""
    proto = run_doc["protocol"]
    k = int(run_doc["episodes_per_task"])
    expected = proto["tasks"] * k
    episodes = sorted(episodes, key=lambda r: (proto["task_ids"].index(r["task"])
                                               if r["task"] in proto["task_ids"] else -1,
                                               r["attempt"]))  # fmt: skip
    counts = {o: sum(1 for r in episodes if r["outcome"] == o) for o in OUTCOMES}
    scored = [r for r in episodes if r["outcome"] != "infra_error"]
    summary: dict[str, Any] = {
        "protocol": {k: proto[k] for k in proto if k not in ("task_ids", "task_specs")},
        "agent": run_doc["agent"],
        "episodes_per_task": k,
        "seed": run_doc["seed"],
        "limits": run_doc["limits"],
        "provenance": run_doc["provenance"],
        "started": run_doc["started"],
        "complete": len(episodes) == expected and counts["infra_error"] == 0,
        "counts": {
            "expected": expected,
            "episodes": len(episodes),
            "scored": len(scored),
            **counts,
            "retried": sum(1 for r in episodes if r.get("retries", 0)),
            "invalid_actions": sum(r["invalid_actions"] for r in episodes),
        },
        "cost": {
            "env_steps": sum(r["steps"] for r in episodes),
            "generated_tokens": sum(r["generated_tokens"] or 0 for r in episodes),
            "episode_seconds": round(sum(r["seconds"] for r in episodes), 1),
        },
        "metrics": {},
    }
    if not scored:
        return summary
    succ = task_means((r["task"], float(r["success"])) for r in scored)
    summary["metrics"]["success"] = mean_interval(succ, rate=True).to_dict()
    summary["metrics"]["return"] = mean_interval(
        task_means((r["task"], r["reward"]) for r in scored)
    ).to_dict()
    if proto["metric"] == "score":
        summary["metrics"]["score"] = mean_interval(
            task_means((r["task"], 100.0 * r["reward"]) for r in scored)
        ).to_dict()
    if k > 1:
        per_task: dict[str, list[bool]] = {}
        for r in scored:
            per_task.setdefault(r["task"], []).append(bool(r["success"]))
        full = {t: v for t, v in per_task.items() if len(v) == k}
        summary["pass_at_k"] = {
            str(j): float(np.mean([pass_at_k(k, sum(v), j) for v in full.values()]))
            for j in range(1, k + 1)
        }
        summary["pass_hat_k"] = {
            str(j): float(np.mean([pass_hat_k(k, sum(v), j) for v in full.values()]))
            for j in range(1, k + 1)
        }
    if proto.get("category_key"):
        cats: dict[str, dict[str, float]] = {}
        for r in scored:
            cats.setdefault(r.get("category", "unknown"), {})
        table = {}
        for cat in sorted(cats):
            sub = task_means((r["task"], float(r["success"])) for r in scored
                             if r.get("category", "unknown") == cat)  # fmt: skip
            table[cat] = mean_interval(sub, rate=True).to_dict()
        summary["categories"] = table
    if proto["env_id"] == "branchgym/SWEBench-v0":
        sw = [r for r in episodes if "swebench" in r]
        submitted = sum(1 for r in sw if r["swebench"]["submitted"])
        resolved = sum(1 for r in scored if r["success"])
        summary["swebench"] = {
            "total": expected,
            "submitted": submitted,
            "completed": submitted,
            "resolved": resolved,
            "unresolved": submitted - resolved,
            "empty_patch": sum(1 for r in sw if r["swebench"]["empty_patch"]),
            "error": counts["infra_error"],
        }
    return summary


def report_markdown(summary: dict[str, Any]) -> str:
    """A human-readable report of :func:`summarise`'s output."""
    p, c, m = summary["protocol"], summary["counts"], summary["metrics"]
    lines = [
        f"# {p['name']} v{p['version']}: {summary['agent']['spec']}",
        "",
        f"protocol hash `{p['hash']}`, {p['tasks']} tasks x {summary['episodes_per_task']} "
        f"attempts, step cap {p['max_steps']}, data `{p['data_digest'][:16]}`",
    ]
    if p["deviations"]:
        lines.append(f"**Not the shipped protocol**: {'; '.join(p['deviations'])}.")
    if not summary["complete"]:
        lines.append(
            f"**Incomplete**: {c['episodes']} of {c['expected']} episodes, "
            f"{c['infra_error']} with infrastructure errors (rerun with --resume)."
        )
    lines += ["", "| metric | mean [95 % interval] | standard error | tasks |", "|---|---|---|---|"]
    for name, iv in m.items():
        scale = 1.0
        lines.append(
            f"| {name} | {iv['mean'] * scale:.3f} [{iv['low'] * scale:.3f}, "
            f"{iv['high'] * scale:.3f}] | {iv['se']:.3f} | {iv['tasks']} |"
        )
    if "pass_at_k" in summary:
        ks = list(summary["pass_at_k"])
        lines += ["", "| k | " + " | ".join(ks) + " |", "|---|" + "---|" * len(ks)]
        lines.append("| pass@k | " + " | ".join(f"{v:.3f}" for v in summary["pass_at_k"].values())
                     + " |")  # fmt: skip
        hats = summary["pass_hat_k"].values()
        lines.append("| pass^k | " + " | ".join(f"{v:.3f}" for v in hats) + " |")
    if "categories" in summary:
        lines += ["", "| category | success [95 % interval] | tasks |", "|---|---|---|"]
        for cat, iv in summary["categories"].items():
            lines.append(f"| {cat} | {iv['mean']:.3f} [{iv['low']:.3f}, {iv['high']:.3f}] | "
                         f"{iv['tasks']} |")  # fmt: skip
    if "swebench" in summary:
        sw = summary["swebench"]
        lines += ["", "| " + " | ".join(sw) + " |", "|" + "---|" * len(sw)]
        lines.append("| " + " | ".join(str(v) for v in sw.values()) + " |")
    lines += [
        "",
        "Episodes by outcome: "
        + ", ".join(f"{o} {c[o]}" for o in OUTCOMES)
        + f"; {c['retried']} retried after an infrastructure error; {c['invalid_actions']} "
        "invalid actions. Scores leave out infrastructure errors.",
        f"Cost: {summary['cost']['env_steps']} env steps, "
        f"{summary['cost']['generated_tokens']} generated tokens"
        + (
            f" ({summary['cost']['endpoint_usage']['completion_tokens']:.0f} completion tokens "
            "by the endpoint's own count)."
            if "endpoint_usage" in summary["cost"]
            else "."
        ),
    ]
    return "\n".join(lines) + "\n"
