"""``branchgym eval attribute RUN``: attribution over a run's episodes, and its report.

:func:`attribute_run` rebuilds the run's agent (:func:`agent_from_run`), checks that the
env's forks can be trusted, attributes each chosen episode
(:func:`~branchgym.evaluation.attribution.attribute_episode`) and writes
``attribution.jsonl``, ``attribution.md`` (where episodes are lost, by step and by kind of
action), ``attribution.png`` (value curves) and ``attribution/<episode>.json.gz`` (each
episode with its forks, for ``branchgym view``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from branchgym.error import OptionError
from branchgym.evaluation.attribution import Attribution, attribute_episode, check_forks

__all__ = ["agent_from_run", "attribute_run", "fork_executor"]


def agent_from_run(run_doc: dict[str, Any]) -> Any:
    """The run's own agent, rebuilt from its ``run.json``.

    Raises:
        OptionError: The run graded predictions (there is no agent to fork).
    """
    from branchgym.evaluation.agents import make_agent

    spec, config = run_doc["agent"]["spec"], run_doc["agent"]["config"]
    env_id = run_doc["protocol"]["env_id"]
    kind = config.get("kind")
    if kind in ("predictions", "gold"):
        raise OptionError(
            "this run graded a predictions file: there is no agent to fork; attribute a run "
            "of an agent (random, expert, a model, an endpoint, module:attr)"
        )
    if kind == "model":  # as the run played it (runs before --policy generated)
        return make_agent(
            config["model"], env_id, max_new_tokens=config["max_new_tokens"],
            policy=config.get("policy", "generate"), dtype=config.get("dtype", "float32"),
        )  # fmt: skip
    if kind == "endpoint":
        return make_agent(config["base_url"], env_id, model=config["model"],
                          sampling=config.get("sampling"))  # fmt: skip
    return make_agent(spec, env_id)


def fork_executor(name: str | None, options: dict[str, Any] | None, *agents: Any) -> Any:
    """The executor the forks' envs run in (None: in this process beside the agents).

    Raises:
        OptionError: An agent reads its live env (a scripted expert): its forks cannot run
            in an executor's sessions.
    """
    if name is None:
        return None
    from branchgym.rollout.executors import make_executor

    expert = next((a for a in agents if a.policy is None), None)
    if expert is not None:
        raise OptionError(
            f"the {expert.spec!r} agent reads its live env, so its forks run in-process; "
            "drop --executor"
        )
    return make_executor(name, **(options or {}))


def attribute_run(
    run_dir: str | Path,
    *,
    forks: int = 8,
    episodes: str = "failed",
    mode: str = "bisect",
    max_episodes: int | None = None,
    seed: int = 0,
    alpha: float = 0.05,
    agent: Any = None,
    make_env: Callable[[], Any] | None = None,
    progress: bool = True,
    executor: str | None = None,
    executor_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Attribute a ``branchgym eval`` run's episodes; writes ``attribution.jsonl`` and ``.md``.

    Args:
        run_dir: The run folder.
        forks: K forks per state.
        episodes: ``failed`` or ``all``.
        mode: ``bisect`` or ``all`` (:func:`attribute_episode`).
        max_episodes: Attribute at most this many (in the run's order).
        seed: Seeds the forks.
        alpha: Level of the decisive-step test.
        agent: The agent to fork (default: the run's own, rebuilt from ``run.json``).
        make_env: Builds the env (default: the run's protocol's env).
        progress: Show a progress bar.
        executor: Where the forks' envs run (``thread``, ``process``, ``ray``, ``fleet``,
            ``inprocess``: :func:`~branchgym.rollout.executors.make_executor`); None keeps
            them in this process beside the agent (the only way for scripted experts).
        executor_options: The executor's keyword arguments.

    Returns:
        The report: per episode, and where episodes are lost by step and by kind of action.
    """
    from tqdm import tqdm

    from branchgym.evaluation.protocols import Task
    from branchgym.evaluation.runner import read_episodes
    from branchgym.rollout.executor_base import EnvRecipe
    from branchgym.tree_format import load_trees

    if episodes not in ("failed", "all"):
        raise OptionError(f"episodes must be 'failed' or 'all', got {episodes!r}")
    run_dir = Path(run_dir)
    if not (run_dir / "run.json").exists():
        raise OptionError(f"{run_dir} is not a branchgym eval run folder (no run.json)")
    run_doc = json.loads((run_dir / "run.json").read_text())
    proto = run_doc["protocol"]
    tasks = {tid: Task(tid, seed_, opts) for tid, seed_, opts in proto["task_specs"]}
    agent = agent if agent is not None else agent_from_run(run_doc)
    recipe = EnvRecipe(proto["env_id"], dict(proto["env_kwargs"]))
    if make_env is None:
        make_env = recipe.make
    check_forks(make_env, seed=seed)
    chosen = [
        r
        for r in read_episodes(run_dir / "episodes.jsonl").values()
        if r["outcome"] not in ("infra_error", "agent_error") and r.get("tree")
        and (episodes == "all" or not r["success"])
    ]  # fmt: skip
    chosen.sort(key=lambda r: (proto["task_ids"].index(r["task"]), r["attempt"]))
    if max_episodes is not None:
        chosen = chosen[:max_episodes]
    results = []
    pool = fork_executor(executor, executor_options, agent)
    bar = tqdm(chosen, desc="attribute", unit="episode", disable=not progress)
    try:
        for rec in bar:
            (tree,) = load_trees(run_dir / rec["tree"])
            task = tasks[rec["task"]]
            res = attribute_episode(
                tree, agent, make_env, options=task.options or None,
                max_steps=proto["max_steps"], forks=forks, mode=mode, seed=seed, alpha=alpha,
                task=rec["task"], attempt=rec["attempt"], executor=pool,
                recipe=recipe if pool is not None else None,
            )  # fmt: skip
            results.append(res)
            bar.set_postfix_str("no step" if res.decisive is None else f"step {res.decisive}")
    finally:
        if pool is not None:
            pool.shutdown()
    report = _run_report(run_doc, results, forks=forks, mode=mode, alpha=alpha)
    from branchgym.tree_format import save_trees

    with open(run_dir / "attribution.jsonl", "w") as fh:
        for res in results:
            fh.write(json.dumps(res.to_dict(), default=str) + "\n")
            if res.tree is not None:
                name = Path(next(r["tree"] for r in chosen if r["task"] == res.task
                                 and r["attempt"] == res.attempt)).name  # fmt: skip
                save_trees(run_dir / "attribution" / name, [res.tree],
                           algo="attribution", task=res.task, attempt=res.attempt)  # fmt: skip
    (run_dir / "attribution.md").write_text(_markdown(report, results))
    if results:
        _plot(results, run_dir / "attribution.png", proto["env_id"])
    return report


def _run_report(run_doc: dict[str, Any], results: list[Attribution], **how: Any) -> dict[str, Any]:
    by_kind: dict[str, int] = {}
    by_step: dict[int, int] = {}
    for r in results:
        if r.decisive is not None and r.action is not None:
            by_kind[r.action["kind"]] = by_kind.get(r.action["kind"], 0) + 1
            by_step[r.decisive] = by_step.get(r.decisive, 0) + 1
    return {
        "run": run_doc["agent"]["spec"],
        "protocol": run_doc["protocol"]["name"],
        **how,
        "episodes": len(results),
        "decisive": sum(1 for r in results if r.decisive is not None),
        "by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "by_step": dict(sorted(by_step.items())),
        "cost": {k: sum(r.cost[k] for r in results) for k in ("forks", "env_steps", "tokens")},
        "naive_cost": {k: sum(r.naive_cost.get(k, 0) for r in results)
                       for k in ("forks", "env_steps")},  # fmt: skip
    }


def _markdown(report: dict[str, Any], results: list[Attribution]) -> str:
    lines = [
        f"# Where {report['run']}'s episodes were lost ({report['protocol']})",
        "",
        f"{report['episodes']} episodes, {report['forks']} forks per state, mode "
        f"{report['mode']}; a decisive step in {report['decisive']}.",
        f"Cost: {report['cost']['forks']} forks, {report['cost']['env_steps']} env steps, "
        f"{report['cost']['tokens']} generated tokens; forking at every step: "
        f"{report['naive_cost']['forks']} forks, about {report['naive_cost']['env_steps']} "
        "env steps.",
        "",
        "| kind of the decisive action | episodes |",
        "|---|---|",
        *[f"| {k} | {n} |" for k, n in report["by_kind"].items()],
        "",
        "| decisive step | episodes |",
        "|---|---|",
        *[f"| {k} | {n} |" for k, n in report["by_step"].items()],
        "",
        "| task | attempt | steps | V along the episode | finding |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        curve = ", ".join(f"{v.step}: {v.value:.2f}" for v in r.values)
        lines.append(f"| {r.task} | {r.attempt} | {r.length} | {curve} | {r.statement} |")
    return "\n".join(lines) + "\n"


def _plot(results: list[Attribution], path: Path, env_id: str, most: int = 12) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = results[:most]
    cols = min(4, len(shown))
    rows = (len(shown) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.4 * rows), squeeze=False)
    for ax, r in zip(axes.flat, shown, strict=False):
        steps = [v.step for v in r.values]
        ax.plot(steps, [v.value for v in r.values], marker="o", color="tab:blue")
        ax.fill_between(steps, [v.low for v in r.values], [v.high for v in r.values],
                        color="tab:blue", alpha=0.2)  # fmt: skip
        if r.decisive is not None:
            ax.axvspan(r.decisive, r.decisive + 1, color="tab:red", alpha=0.2)
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(f"{r.task} #{r.attempt}", fontsize=8)
        ax.set_xlabel("step", fontsize=7)
        ax.set_ylabel("V(s_t)", fontsize=7)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    fig.suptitle(f"{env_id}: value along each episode (95 % exact intervals), decisive step red",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
