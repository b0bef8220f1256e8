"""The source papers' headline figures, in one place: what our studies compare against.

Every study that prints "vs source" reads its figure from here; none writes it as a
literal. The papers are named in docs/algorithms.md ("The source papers' headline
figures"). Env keys are our env ids.
"""

from __future__ import annotations

__all__ = [
    "SNAPSHOT_MS",
    "BRANCHING_OVERHEAD",
    "TOKENS_SAVED",
    "GRAD_NORM_VARIANCE_RATIO",
    "UPDATES_SAVED",
]

#: Milliseconds per snapshot the Branching PO paper reports (its Table 4).
SNAPSHOT_MS = {
    "branchgym/WebShop-v0": 42.0,
    "branchgym/ALFWorld-v0": 138.0,
    "branchgym/SWEBench-v0": 1920.0,
}

#: Branching overhead (a fraction of rollout time) the Branching PO paper reports.
BRANCHING_OVERHEAD = {
    "branchgym/WebShop-v0": 0.006,
    "branchgym/ALFWorld-v0": 0.024,
    "branchgym/SWEBench-v0": 0.042,
}

#: Student tokens saved by Branching OPD against 7 independent rollouts, as reported.
TOKENS_SAVED = {"branchgym/WebShop-v0": 0.312, "branchgym/ALFWorld-v0": 0.191}

#: Gradient-norm variance of Branching PO over GRPO, early and late in training.
GRAD_NORM_VARIANCE_RATIO = {"early": 0.42, "late": 0.58}

#: Fewer updates Branching PO needs to reach GRPO's final success (a fraction).
UPDATES_SAVED = 0.38
