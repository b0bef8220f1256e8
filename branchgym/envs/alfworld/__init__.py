"""ALFWorld on its real engine (alfworld 0.4.2, textworld 1.7.0, fast-downward), snapshottable.

``gym.make("branchgym/ALFWorld-v0")`` plays the shipped problems; see
:mod:`branchgym.envs.alfworld.env` for the env, :mod:`~branchgym.envs.alfworld.tasks` for
the problem format and the rooms, :mod:`~branchgym.envs.alfworld.problems` for the problem
sets and the generator, :mod:`~branchgym.envs.alfworld.engine` for how
the engine is isolated per instance and how its state is saved, and
:mod:`~branchgym.envs.alfworld.expert` for the planner expert.

Importing this package does not import the engine; making the env does.
"""

from __future__ import annotations

from branchgym.envs.alfworld.problems import (
    SPLITS,
    generate_problem,
    generate_problems,
    load_problem_set,
    load_problems,
)
from branchgym.envs.alfworld.tasks import LAYOUTS, TASK_TYPES, Layout, Problem

__all__ = [
    "LAYOUTS",
    "SPLITS",
    "TASK_TYPES",
    "Layout",
    "Problem",
    "generate_problem",
    "generate_problems",
    "load_problem_set",
    "load_problems",
]
