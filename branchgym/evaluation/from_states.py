"""Two agents compared from identical states: snapshots along one run's episodes.

Independent runs of two agents differ by the tasks' luck as well as by the agents; forks
of both from the same snapshots face exactly the same situations, so their paired
difference over states has a narrower interval at the same env steps
(``branchgym bench eval-states`` measures by how much). ``branchgym eval compare A B
--from-states`` runs :func:`compare_from_states`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from branchgym.error import OptionError
from branchgym.evaluation.attribution import Episode, check_forks, forks_from
from branchgym.evaluation.attribution_run import agent_from_run, fork_executor

__all__ = ["compare_from_states"]


def compare_from_states(
    run_a: str | Path,
    run_b: str | Path,
    *,
    depths: tuple[float, ...] = (0.0, 0.5),
    forks: int = 8,
    max_episodes: int | None = None,
    seed: int = 0,
    agents: tuple[Any, Any] | None = None,
    make_env: Callable[[], Any] | None = None,
    progress: bool = True,
    executor: str | None = None,
    executor_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Both runs' agents from the same snapshots, taken along run A's episodes.

    At each chosen depth of each of A's episodes (a fraction of its length: 0 is the
    reset state, 0.5 halfway), the state is restored ``forks`` times for each agent, so
    both face exactly the same situations; the paired difference of their success rates
    over those states has its interval (:func:`~branchgym.evaluation.stats.paired_difference`).
    The report also gives each agent's env steps, to compare at equal cost with two
    independent runs.

    With ``executor`` (``thread``, ``process``, ``ray``, ``fleet``:
    :func:`~branchgym.rollout.executors.make_executor`, with ``executor_options``), each of
    A's episodes is replayed once in one of its sessions with a snapshot per step and both
    agents' forks restore there, as ``eval attribute --executor`` does; the forks draw the
    same seeds in the same order, so the result equals the in-process one.

    Raises:
        OptionError: The runs are of different envs, a run graded predictions, or an
            executor was asked for an agent that reads its live env (a scripted expert).
        FidelityViolation: The env's snapshots are not faithful.
    """
    from tqdm import tqdm

    from branchgym.evaluation.attribution import ExecutorStates
    from branchgym.evaluation.protocols import Task
    from branchgym.evaluation.runner import read_episodes
    from branchgym.evaluation.stats import mean_interval, paired_difference
    from branchgym.rollout.executor_base import EnvRecipe
    from branchgym.tree_format import load_trees

    docs = [json.loads((Path(r) / "run.json").read_text()) for r in (run_a, run_b)]
    env_ids = {d["protocol"]["env_id"] for d in docs}
    if len(env_ids) != 1:
        raise OptionError(f"the runs play different envs ({', '.join(sorted(env_ids))})")
    if any(not 0.0 <= d < 1.0 for d in depths):
        raise OptionError(f"depths are fractions of an episode in [0, 1); got {depths}")
    proto = docs[0]["protocol"]
    agent_a, agent_b = agents if agents is not None else tuple(agent_from_run(d) for d in docs)
    recipe = EnvRecipe(proto["env_id"], dict(proto["env_kwargs"]))
    if make_env is None:
        make_env = recipe.make
    check_forks(make_env, seed=seed)
    pool = fork_executor(executor, executor_options, agent_a, agent_b)
    tasks = {tid: Task(tid, s, o) for tid, s, o in proto["task_specs"]}
    recs = [r for r in read_episodes(Path(run_a) / "episodes.jsonl").values()
            if r.get("tree") and r["outcome"] not in ("infra_error", "agent_error")]  # fmt: skip
    recs.sort(key=lambda r: (proto["task_ids"].index(r["task"]), r["attempt"]))
    if max_episodes is not None:
        recs = recs[:max_episodes]
    rng = np.random.default_rng([seed, 0xC0])
    va: dict[str, float] = {}
    vb: dict[str, float] = {}
    steps = {"a": 0, "b": 0}
    envs: list[Any] = []
    try:
        for rec in tqdm(recs, desc="from states", unit="episode", disable=not progress):
            (tree,) = load_trees(Path(run_a) / rec["tree"])
            task = tasks[rec["task"]]
            ep = Episode(tree, make_env, task.options or None)
            states = None
            try:
                if pool is not None:
                    states = ExecutorStates(ep, pool, recipe)
                chosen = sorted({int(d * len(ep.nodes)) for d in depths})
                for t in chosen:
                    if t >= len(ep.nodes):
                        continue
                    key = f"{rec['task']}#{rec['attempt']}@{t}"
                    for name, agent, out in (("a", agent_a, va), ("b", agent_b, vb)):
                        s, n_steps, _, _ = forks_from(ep, t, forks, agent, make_env, envs,
                                               proto["max_steps"], rng, states)  # fmt: skip
                        out[key] = s / forks
                        steps[name] += n_steps
            finally:
                if states is not None:
                    states.close()
                ep.close()
    finally:
        for env in envs:
            env.close()
        if pool is not None:
            pool.shutdown()
    if not va:
        raise OptionError("no state to compare from: run A has no recorded episode")
    diff = paired_difference(va, vb)
    return {
        "a": docs[0]["agent"]["spec"],
        "b": docs[1]["agent"]["spec"],
        "protocol": proto["name"],
        "states": len(va),
        "forks": forks,
        "depths": list(depths),
        "a_from_states": mean_interval(va, rate=True).to_dict(),
        "b_from_states": mean_interval(vb, rate=True).to_dict(),
        "a_minus_b": diff.to_dict(),
        "env_steps": steps,
    }
