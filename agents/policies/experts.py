"""Scripted experts: each env's own expert as ``(env, rng) -> act(observation, info)``.

An expert reads the live env (WebShop's page, ALFWorld's planner state, TextTreeMDP's
exact values), so it acts in-process beside its env rather than through the policy
protocol: SFT collects its episodes (:mod:`branchgym.agents.learners.sft`) and
``branchgym eval --agent expert`` scores it.

* ``treemdp``: TextTreeMDP's optimal policy (greedy in Q*, by backward induction);
* ``webshop``: the scripted shopper (:mod:`branchgym.envs.webshop.expert`);
* ``alfworld``: the planner expert (:mod:`branchgym.envs.alfworld.expert`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "AUTO_EXPERTS",
    "THREAD_SAFE",
    "EXPERTS",
    "Expert",
    "alfworld_expert",
    "treemdp_expert",
    "webshop_expert",
]

Expert = Callable[[Any, dict[str, Any]], str]


def treemdp_expert(env: Any, rng: np.random.Generator) -> Expert:
    """TextTreeMDP: the exact optimal policy (greedy in Q*, backward induction)."""
    base = env.unwrapped
    table = base.optimal_policy()

    def act(obs: Any, info: dict[str, Any]) -> str:
        return base.actions[int(np.argmax(table[int(info["node"])]))]

    return act


def webshop_expert(env: Any, rng: np.random.Generator) -> Expert:
    """WebShop: the scripted shopper (search with the instruction, best match, options, buy)."""
    from branchgym.envs.webshop.expert import ScriptedExpert

    shopper = ScriptedExpert()
    shopper.reset()
    return lambda obs, info: shopper.act(env.unwrapped.page, info["instruction"])


def alfworld_expert(env: Any, rng: np.random.Generator) -> Expert:
    """ALFWorld: the planner expert (replans from the current state)."""
    from branchgym.envs.alfworld.expert import PlannerExpert

    planner = PlannerExpert(env)
    return lambda obs, info: planner()


#: expert name -> ``(env, rng) -> act(obs, info)``, built fresh per episode.
EXPERTS: dict[str, Callable[[Any, np.random.Generator], Expert]] = {
    "treemdp": treemdp_expert,
    "webshop": webshop_expert,
    "alfworld": alfworld_expert,
}

#: env id -> its expert, for ``expert="auto"``.
AUTO_EXPERTS = {
    "branchgym/TextTreeMDP-v0": "treemdp",
    "branchgym/WebShop-v0": "webshop",
    "branchgym/ALFWorld-v0": "alfworld",
}

#: Experts whose episodes may run on several threads at once. ALFWorld's planner is not
#: thread-safe: concurrent plans fail inside its PDDL parser and search, so its episodes
#: run one at a time.
THREAD_SAFE = frozenset({"treemdp", "webshop"})
