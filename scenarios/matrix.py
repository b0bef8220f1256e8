"""The detection matrix: every scenario x every env x the three fidelity checks.

Checks:

* ``digest``: ``FidelityCheck(mode="digest")`` during a branching workload;
* ``shadow``: ``FidelityCheck(mode="shadow")`` (replay twin) during the same workload;
* ``property``: :func:`branchgym.fidelity.suite.check_snapshot_fidelity` at its default budget.

The workload is what a branching learner does: seeded episodes, up to two snapshots per
backbone at random steps, three sibling rollouts from each (algorithms.md §1, M = 2,
K = 4). A cell reports the detection rate over seeds and the median number of env steps
taken before the first detection. A row passes when a must-detect scenario is caught by
the property suite on every seed and a benign one is flagged by no check on any seed.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from branchgym.fidelity.checks import ActionChooser
from branchgym.scenarios import BENIGN, MUST_DETECT, SCENARIO_ENVS, SCENARIOS, ScenarioEnv

__all__ = ["CHECKS", "Cell", "Row", "run_matrix", "render_matrix", "branching_workload"]

CHECKS = ("digest", "shadow", "property")


@dataclasses.dataclass
class Cell:
    """One check on one scenario and env, over seeds."""

    runs: int = 0
    detected: int = 0
    steps: list[int] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        if not self.runs:
            return "n/a"
        if not self.detected:
            return f"0/{self.runs}"
        return f"{self.detected}/{self.runs} @{statistics.median(self.steps):g}"


@dataclasses.dataclass
class Row:
    """A scenario on an env: one cell per check, and the verdict."""

    scenario: str
    env: str
    expected: str
    mode: str = ""
    cells: dict[str, Cell] = dataclasses.field(default_factory=dict)
    skipped: str = ""

    @property
    def outcome(self) -> str:
        """``ok``, ``MISSED``, ``FALSE POSITIVE`` or ``n/a``.

        ``MISSED``: a must-detect scenario the property suite did not catch on every seed;
        ``FALSE POSITIVE``: a benign scenario some check flagged.
        """
        if self.skipped:
            return "n/a"
        if self.expected == MUST_DETECT:
            prop = self.cells["property"]
            return "ok" if prop.runs and prop.detected == prop.runs else "MISSED"
        return "FALSE POSITIVE" if any(c.detected for c in self.cells.values()) else "ok"


def branching_workload(env: Any, *, seed: int, steps: int) -> int | None:
    """Drive ``env`` (a ``FidelityCheck`` with ``on_violation="record"``) like a learner.

    Returns the env steps taken before its first violation (or crash), ``None`` if none.
    """
    chooser = ActionChooser(env, seed)
    rng = np.random.default_rng(seed)
    taken, episode = 0, 0

    def flagged() -> bool:
        return bool(env.violations)

    try:
        while taken < steps:
            _, info = env.reset(seed=1000 * seed + episode)
            episode += 1
            branch_points = []
            done = False
            while not done and taken < steps:
                if len(branch_points) < 2 and rng.random() < 0.5:
                    branch_points.append(env.snapshot())
                _, _, term, trunc, info = env.step(chooser(info))
                taken += 1
                done = term or trunc
                if flagged():
                    return taken
            for snap in branch_points:
                for _ in range(3):  # K - 1 siblings
                    _, info = env.restore(snap)
                    if flagged():
                        return taken
                    done = False
                    while not done and taken < steps:
                        _, _, term, trunc, info = env.step(chooser(info))
                        taken += 1
                        done = term or trunc
                        if flagged():
                            return taken
                snap.release()
    except Exception:  # a crash is a loud detection, not a silent one
        return taken
    return None


def _run_wrapper_check(make: Any, mode: str, *, seed: int, steps: int) -> tuple[int | None, str]:
    from branchgym.wrappers import FidelityCheck

    env = FidelityCheck(make(), mode=mode, on_violation="record", env_fn=make)
    try:
        at = branching_workload(env, seed=seed, steps=steps)
        note = str(env.violations[0]) if env.violations else ""
        return at, note
    finally:
        env.close()


def run_matrix(
    scenarios: Sequence[str] | None = None,
    envs: Sequence[ScenarioEnv] | None = None,
    *,
    seeds: Sequence[int] = (0, 1, 2),
    workload_steps: int = 300,
    max_examples: int | None = None,
    benign_max_examples: int | None = None,
    progress: bool = True,
) -> list[Row]:
    """Run the matrix.

    Args:
        scenarios: Scenario names (default: all of :data:`SCENARIOS`).
        envs: Envs (default: :data:`SCENARIO_ENVS`).
        seeds: Seeds; each check runs once per seed.
        workload_steps: Env steps of the branching workload for digest and shadow.
        max_examples: Property-suite budget (default: its own default budget).
        benign_max_examples: Budget for benign rows (default: ``max_examples``); a smaller
            one keeps ``--quick`` fast, since passing rows run to the end of their budget.
        progress: Show a tqdm progress bar.
    """
    from tqdm import tqdm

    from branchgym.fidelity.suite import DEFAULT_MAX_EXAMPLES, check_snapshot_fidelity

    names = list(scenarios) if scenarios else list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise KeyError(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    targets = list(envs) if envs is not None else list(SCENARIO_ENVS)
    budget = max_examples or DEFAULT_MAX_EXAMPLES
    rows: list[Row] = []
    jobs = [(SCENARIOS[n], t) for n in names for t in targets]
    bar = tqdm(total=len(jobs) * len(seeds), desc="scenarios", unit="run", disable=not progress)
    for sc, target in jobs:
        row = Row(sc.name, target.id, sc.verdict)
        rows.append(row)
        why = sc.why_not(target)
        if why:
            row.skipped = why
            bar.update(len(seeds))
            continue
        row.cells = {c: Cell() for c in CHECKS}
        make = sc.factory(target.id, **target.kwargs)
        for seed in seeds:
            bar.set_postfix_str(f"{sc.name} @ {target.id}")
            for mode in ("digest", "shadow"):
                at, note = _run_wrapper_check(make, mode, seed=seed, steps=workload_steps)
                cell = row.cells[mode]
                cell.runs += 1
                if at is not None:
                    cell.detected += 1
                    cell.steps.append(at)
                    cell.notes.append(note)
            n = benign_max_examples if sc.verdict == BENIGN and benign_max_examples else budget
            report = check_snapshot_fidelity(
                make, max_examples=n, seed=seed, shrink_seconds=0, reproduce=0
            )
            row.mode = report.mode
            cell = row.cells["property"]
            cell.runs += 1
            if not report.ok:
                cell.detected += 1
                cell.steps.append(report.first_detection_steps or 0)
                cell.notes.append(str(report.violations[0]))
            bar.update(1)
    bar.close()
    return rows


def render_matrix(rows: Sequence[Row]) -> str:
    """The matrix as a markdown table with a summary line."""
    from branchgym.tables import markdown_table

    table = markdown_table(
        ["scenario", "env", "expected", "mode", *CHECKS, "outcome"],
        [
            [
                r.scenario,
                r.env,
                r.expected,
                r.mode or "-",
                *(str(r.cells[c]) if r.cells else "n/a" for c in CHECKS),
                r.outcome if not r.skipped else f"n/a ({r.skipped})",
            ]
            for r in rows
        ],
    )
    must = [r for r in rows if r.expected == MUST_DETECT and not r.skipped]
    benign = [r for r in rows if r.expected == BENIGN and not r.skipped]
    caught = sum(r.outcome == "ok" for r in must)
    flagged = sum(r.outcome != "ok" for r in benign)
    legend = (
        "Cells: seeds detected / seeds run @ median env steps before the first detection. "
        "digest/shadow: FidelityCheck during a branching workload (M=2 branch points, "
        "K=4 siblings); property: check_snapshot_fidelity at its default budget."
    )
    summary = (
        f"must-detect caught by the property suite on every seed: {caught}/{len(must)}; "
        f"benign flagged by any check: {flagged}/{len(benign)}"
    )
    return f"{table}\n\n{legend}\n\n{summary}"
