"""On-policy distillation baselines of Branching OPD (algorithms.md §2 and §4).

Both run :func:`branchgym.agents.branch_opd.main` (same teacher scoring, same clipped
teacher-minus-student advantage, same token-mean PPO-clip and PBR); they differ only in
the rollouts:

* vanilla OPD (``opd``): one trajectory per input, the student's own;
* multi-rollout OPD (``opd_multi``): n = 7 independent trajectories per input, the
  compute-matched comparison for Branching OPD's 1 + B k = 7.
"""

from __future__ import annotations

import dataclasses

from branchgym.agents import branch_opd
from branchgym.agents.run import TrainResult

__all__ = ["Args", "MultiArgs", "main", "main_multi"]


@dataclasses.dataclass
class Args(branch_opd.Args):
    """Vanilla OPD: Branching OPD's options with one trajectory per input."""

    rollouts: str = "single"
    """``single``: the main trajectory alone (vanilla on-policy distillation)."""


@dataclasses.dataclass
class MultiArgs(branch_opd.Args):
    """Multi-rollout OPD: n independent trajectories per input."""

    rollouts: str = "multi"
    """``multi``: n independent trajectories."""
    n: int = 7
    """Trajectories per input (7 = Branching OPD's 1 + B k at B = 3, k = 2)."""


def main(args: Args, algo: str = "opd") -> TrainResult:
    """Train with vanilla on-policy distillation."""
    return branch_opd.main(args, algo)


def main_multi(args: MultiArgs, algo: str = "opd_multi") -> TrainResult:
    """Train with multi-rollout on-policy distillation."""
    return branch_opd.main(args, algo)
