"""The reference results' report: table, paired comparisons and learning curves.

``scripts/reference_results.py`` calls :func:`write_report` after its runs; it reads only
the copied result files under ``out`` (``train/<run>/metrics.jsonl``,
``eval/<name>/summary.json`` and ``episodes.jsonl``), so it can be rerun on a fresh clone::

    python scripts/reference_report.py reference/webshop-small

and writes ``out/README.md`` (the table, the comparisons, the cost), ``out/compare/*.json``
(``branchgym eval compare`` results) and ``out/curves.png``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

#: Display names of the rows.
NAMES = {
    "expert": "scripted shopper (the SFT data's expert)",
    "random": "uniform over admissible actions",
    "zero-shot": "SmolLM2-135M-Instruct, zero-shot",
    "sft": "SFT warm start",
    "grpo": "GRPO",
    "rloo": "RLOO",
    "bpo_rec": "Branching PO (recommended, unbiased)",
    "bellman_po": "Bellman PO",
}


def _metrics(path: Path) -> list[dict[str, float]]:
    """The training steps' lines of a ``metrics.jsonl`` (not its evaluation lines)."""
    from branchgym.agents.training.saving import read_metrics

    return [d for d in read_metrics(path) if "env/steps" in d or "losses/sft" in d]


def _learner_seed(name: str) -> tuple[str, str]:
    """``("grpo", "0")`` for the run ``grpo-s0``; ``(name, "")`` for the other rows."""
    m = re.fullmatch(r"(.+)-s(\d+)", name)
    return (m.group(1), m.group(2)) if m else (name, "")


def train_cost(folder: Path) -> dict[str, float]:
    """Steps, env steps, learner tokens and hours of one copied training run."""
    lines = _metrics(folder / "metrics.jsonl")
    args = json.loads((folder / "args.json").read_text()) if (folder / "args.json").exists() else {}
    threads = int(args.get("threads") or 1)
    hours = sum(d.get("time/step_s", 0.0) for d in lines) / 3600
    return {
        "steps": len(lines),
        "env_steps": sum(d.get("env/steps", 0.0) for d in lines),
        "learner_tokens": sum(d.get("tokens/learner", 0.0) for d in lines),
        "hours": hours,
        "cpu_hours": hours * threads,
    }


def eval_row(folder: Path) -> dict[str, Any]:
    """Score and success with their intervals, from a copied eval run."""
    m = json.loads((folder / "summary.json").read_text())["metrics"]
    return {"score": m["score"], "success": m["success"]}


def curve_points(out: Path, name: str) -> list[dict[str, Any]]:
    """Held-out points of run ``name``'s learning curve, by env steps.

    Its evaluated intermediate checkpoints (``eval/<name>@<step>``) and its final
    checkpoint (``eval/<name>``), each with the env steps and learner tokens spent to
    reach it.
    """
    tdir, ev = out / "train" / name, out / "eval"
    if not (tdir / "metrics.jsonl").exists():
        return []
    lines = _metrics(tdir / "metrics.jsonl")
    spent, env, tok = {}, 0.0, 0.0
    for i, d in enumerate(lines, 1):
        env += d.get("env/steps", 0.0)
        tok += d.get("tokens/learner", 0.0)
        spent[int(d.get("step", i))] = (env, tok)
    found = [(int(p.name.rpartition("@")[2]), p) for p in ev.glob(f"{name}@*")
             if p.name.rpartition("@")[2].isdigit() and (p / "summary.json").exists()]  # fmt: skip
    if (ev / name / "summary.json").exists() and spent:
        found.append((max(spent), ev / name))
    points = []
    for step, folder in sorted(found):
        if step not in spent:  # a checkpoint the copied metrics do not reach
            continue
        points.append({"step": step, "env_steps": spent[step][0],
                       "learner_tokens": spent[step][1], "folder": folder.name,
                       **eval_row(folder)})  # fmt: skip
    return points


def _iv(m: dict[str, Any], scale: float = 1.0, digits: int = 1) -> str:
    f = f"{{:.{digits}f}}"
    return (
        f"{f.format(m['mean'] * scale)} [{f.format(m['low'] * scale)}, "
        f"{f.format(m['high'] * scale)}]"
    )


def write_report(runs: Path, out: Path, *, learners: list[str], seeds: list[int]) -> Path:
    """Write ``out/README.md``, ``out/compare/*.json`` and ``out/curves.png``."""
    from branchgym.evaluation.compare import compare_runs

    del runs  # everything is read from the copied files
    ev = out / "eval"
    rows, lines = {}, []
    runs_ = [f"{n}-s{s}" for n in learners for s in seeds]
    for name in ["expert", "random", "zero-shot", "sft", *runs_]:
        if (ev / name / "summary.json").exists():
            rows[name] = eval_row(ev / name)
    timings: dict[str, dict[str, float]] = {}  # a stage run in several sittings: summed
    if (out / "timings.jsonl").exists():
        for line in (out / "timings.jsonl").read_text().splitlines():
            if line.strip():
                t = json.loads(line)
                acc = timings.setdefault(t["log"], {"minutes": 0.0, "cpu_minutes": 0.0})
                acc["minutes"] += t["minutes"]
                acc["cpu_minutes"] += t["minutes"] * t.get("threads", 1)
    lines += [
        "| model | seed | score x100 [95 % CI] | success [95 % CI] | env steps | learner "
        "tokens | train hours (CPU h) | eval hours (CPU h) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    total_cpu = 0.0
    for name, r in rows.items():
        base, seed = _learner_seed(name)
        label = NAMES.get(base, name)
        cost = {"env_steps": 0, "learner_tokens": 0, "hours": 0.0, "cpu_hours": 0.0}
        tdir = out / "train" / name
        if name not in ("expert", "random", "zero-shot") and tdir.exists():
            cost = train_cost(tdir)
        ev_t = timings.get(f"eval-{name}")
        ev_h = ev_t["minutes"] / 60 if ev_t else float("nan")
        ev_cpu = ev_t["cpu_minutes"] / 60 if ev_t else float("nan")
        total_cpu += cost["cpu_hours"] + (ev_cpu if ev_t else 0.0)
        lines.append(
            f"| {label} | {seed or '-'} | {_iv(r['score'])} | {_iv(r['success'], digits=3)} | "
            f"{cost['env_steps']:.0f} | {cost['learner_tokens']:.0f} | "
            f"{cost['hours']:.2f} ({cost['cpu_hours']:.2f}) | {ev_h:.2f} ({ev_cpu:.2f}) |"
        )
    for name in runs_:  # trained, not evaluated yet: the training row alone
        if name in rows or not (out / "train" / name / "metrics.jsonl").exists():
            continue
        base, seed = _learner_seed(name)
        cost = train_cost(out / "train" / name)
        total_cpu += cost["cpu_hours"]
        lines.append(
            f"| {NAMES.get(base, base)} | {seed} | not evaluated yet | not evaluated yet | "
            f"{cost['env_steps']:.0f} | {cost['learner_tokens']:.0f} | "
            f"{cost['hours']:.2f} ({cost['cpu_hours']:.2f}) | - |"
        )
    curve_lines = []
    for name in runs_:
        for pt in curve_points(out, name):
            if pt["folder"] == name:  # the final checkpoint: a row of the table above
                continue
            ev_t = timings.get(f"eval-{pt['folder']}")
            total_cpu += ev_t["cpu_minutes"] / 60 if ev_t else 0.0
            curve_lines.append(
                f"| {pt['folder']} | {pt['step']} | {pt['env_steps']:.0f} | "
                f"{pt['learner_tokens']:.0f} | {_iv(pt['score'])} | "
                f"{_iv(pt['success'], digits=3)} | "
                f"{ev_t['minutes'] / 60 if ev_t else float('nan'):.2f} "
                f"({ev_t['cpu_minutes'] / 60 if ev_t else float('nan'):.2f}) |"
            )
    if curve_lines:
        lines += ["", "Intermediate checkpoints (the learning curves' held-out points; "
                  "step 0 is the SFT model, the last step the row above):", "",
                  "| checkpoint | step | env steps | learner tokens | score x100 [95 % CI] | "
                  "success [95 % CI] | eval hours (CPU h) |", "|---|---|---|---|---|---|---|",
                  *curve_lines]  # fmt: skip
    sft_dir = out / "train" / "sft"
    if sft_dir.exists():
        c = train_cost(sft_dir)
        total_cpu += c["cpu_hours"] if "sft" not in rows else 0.0
        lines += ["", f"SFT warm start: {c['steps']} updates, {c['learner_tokens']:.0f} learner "
                  f"tokens, {c['hours']:.2f} h ({c['cpu_hours']:.2f} CPU h)."]  # fmt: skip
    lines += [f"CPU hours in this table (training and evaluation, threads x wall): "
              f"{total_cpu:.2f}."]  # fmt: skip
    cmp_dir = out / "compare"
    cmp_dir.mkdir(parents=True, exist_ok=True)
    pairs = [("sft", "zero-shot")]  # what the warm start did
    for n in learners:
        for s in seeds:
            pairs.append((f"{n}-s{s}", "sft"))
    for s in seeds:
        pairs.append((f"bpo_rec-s{s}", f"grpo-s{s}"))
    for s in seeds:  # the source's claim for Bellman PO is against GRPO too
        pairs.append((f"bellman_po-s{s}", f"grpo-s{s}"))
    lines += ["", "| A vs B (paired by goal) | score A - B [95 % CI] | success A - B [95 % CI] "
              "| McNemar p (success) |", "|---|---|---|---|"]  # fmt: skip
    for a, b in pairs:
        if a not in rows or b not in rows:
            continue
        res = compare_runs(ev / a, ev / b)
        (cmp_dir / f"{a}_vs_{b}.json").write_text(json.dumps(res, indent=2) + "\n")
        d = res["metrics"]
        mc = res.get("mcnemar") or {}
        lines.append(
            f"| {a} vs {b} | {_iv(d['score']['a_minus_b'])} | "
            f"{_iv(d['success']['a_minus_b'], digits=3)} | {mc.get('p_value', float('nan')):.3g} |"
        )
    plot_curves(out, learners, seeds, rows)
    text = "\n".join(lines) + "\n"
    (out / "README.md").write_text(
        "# Reference results: SmolLM2-135M-Instruct on WebShop (webshop-small)\n\n"
        "Written by `scripts/reference_report.py` from the files in this folder; how they "
        "were made and what they mean: docs/results.md, Reference results.\n\n" + text
    )
    print(text)
    return out / "README.md"


def plot_curves(out: Path, learners: list[str], seeds: list[int], rows: dict[str, Any]) -> None:
    """Learning curves against env steps (left) and learner tokens (right).

    The training return of each on-policy batch (top), and held-out success on the
    protocol's goals (bottom) at step 0 (the SFT model), every evaluated intermediate
    checkpoint and the final one, with 95 % intervals.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex="col")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    k = 0
    for n in learners:
        for s in seeds:
            name = f"{n}-s{s}"
            folder = out / "train" / name
            if not (folder / "metrics.jsonl").exists():
                continue
            color, k = colors[k % len(colors)], k + 1
            lines = _metrics(folder / "metrics.jsonl")
            env = np.cumsum([d.get("env/steps", 0.0) for d in lines])
            tok = np.cumsum([d.get("tokens/learner", 0.0) for d in lines]) / 1e3
            ret = [d.get("charts/return", np.nan) for d in lines]
            label = f"{NAMES.get(n, n)} s{s}"
            axes[0, 0].plot(env, ret, marker=".", color=color, label=label)
            axes[0, 1].plot(tok, ret, marker=".", color=color, label=label)
            pts = curve_points(out, name)
            if not pts or "sft" not in rows:
                continue
            held = [{"env_steps": 0.0, "learner_tokens": 0.0, **rows["sft"]}, *pts]
            sc = [p["success"] for p in held]
            y = np.array([m["mean"] for m in sc])
            err = np.array([y - [m["low"] for m in sc], [m["high"] for m in sc] - y])
            for ax, key, scale in ((axes[1, 0], "env_steps", 1.0),
                                   (axes[1, 1], "learner_tokens", 1e3)):  # fmt: skip
                x = np.array([p[key] / scale for p in held])
                ax.errorbar(x, y, yerr=err, marker="o", capsize=3, color=color, alpha=0.8,
                            label=label)  # fmt: skip
    axes[0, 0].set(ylabel="training return (on-policy batch)")
    axes[1, 0].set(xlabel="env steps", ylabel="held-out success (95 % CI)")
    axes[1, 1].set(xlabel="learner tokens (thousands)")
    axes[0, 0].set_title("against env steps", fontsize=10)
    axes[0, 1].set_title("against learner tokens", fontsize=10)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("Learning curves: training return (top), held-out success on the "
                 "protocol's goals (bottom; 0 = SFT model)", fontsize=10)  # fmt: skip
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "reference/webshop-small")
    runs = [_learner_seed(p.name) for p in (folder / "train").iterdir()]
    found_learners = sorted({base for base, seed in runs if seed})
    found_seeds = sorted({int(seed) for _, seed in runs if seed})
    write_report(folder, folder, learners=found_learners, seeds=found_seeds)
