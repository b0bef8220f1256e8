"""ALFWorld's planner expert: fast-downward replans from the current state, the agent follows.

This is alfworld's ``AlfredExpert(expert_type="planner")``: at every state the expert's
action is the first command of the plan textworld's ``replan`` finds from that state (a
greedy search over action counts, so plans are shortest). It recovers from any detour,
which makes it usable for DAgger-style data and as a reference policy for branching.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import gymnasium as gym

__all__ = ["PlannerExpert", "ExpertResult", "solve"]


class PlannerExpert:
    """Next action of the planner's plan from the current state of an ALFWorld env."""

    def __init__(self, env: gym.Env) -> None:
        """Act in ``env`` (a ``branchgym/ALFWorld-v0`` stack or an ``ALFWorldEnv``)."""
        from branchgym.envs.alfworld.env import ALFWorldEnv

        base = env.unwrapped
        if not isinstance(base, ALFWorldEnv):
            raise TypeError(
                f"PlannerExpert plays ALFWorld envs, got {type(base).__name__}; make one with "
                "gym.make('branchgym/ALFWorld-v0')."
            )
        self.env = base

    def plan(self) -> list[str]:
        """The whole plan from the current state (empty when the goal holds or is unreachable)."""
        return self.env.expert_plan()

    def __call__(self, obs: Any = None, info: dict[str, Any] | None = None) -> str:
        """The expert's action (``obs`` and ``info`` are accepted to look like a policy)."""
        plan = self.plan()
        if not plan:
            raise RuntimeError(
                "the planner has no plan from this state (the goal already holds, or the "
                "episode is over); reset the env."
            )
        return plan[0]


@dataclasses.dataclass(frozen=True)
class ExpertResult:
    """One expert episode."""

    problem: str
    won: bool
    steps: int
    actions: tuple[str, ...]
    plan_length: int


def solve(env: gym.Env, problem: int | str, *, max_steps: int = 100) -> ExpertResult:
    """Play ``problem`` with the :class:`PlannerExpert` until it wins or ``max_steps`` pass."""
    _, info = env.reset(options={"problem": problem})
    expert = PlannerExpert(env)
    plan_length = len(expert.plan())
    actions: list[str] = []
    won = False
    for _ in range(max_steps):
        plan = expert.plan()
        if not plan:
            break
        _, _, terminated, truncated, info = env.step(plan[0])
        actions.append(plan[0])
        won = bool(info["won"])
        if terminated or truncated:
            break
    return ExpertResult(info["problem"], won, len(actions), tuple(actions), plan_length)
