"""An evaluation run: every task of a pinned protocol, K attempts each, saved as it goes.

A run folder holds:

* ``run.json``: the pinned protocol, the agent's configuration, K, the seed and the
  provenance, written before the first episode (``--resume`` checks it);
* ``episodes.jsonl``: one line per episode, appended (and synced) as each ends, so a
  crash loses only the episodes that were running;
* ``trees/<task>__a<attempt>.json.gz``: each episode as a tree file, which
  ``branchgym view`` draws as a transcript;
* ``summary.json`` and ``report.md``: written (atomically) when every episode has ended;
  a folder without them is an unfinished run, never a complete one.

Episodes of a policy agent advance in lockstep batches: one merged policy call per turn
for every live episode (one batched generation of a model, or concurrent requests to an
endpoint) and the envs through an executor
(:func:`branchgym.rollout.batch.run_batched`), with at most ``max_envs`` envs alive.
An env agent (the scripted experts) plays each episode in-process beside its env, on
``max_envs`` threads where it is thread-safe. A SWE-bench predictions file (the harness's
``instance_id``, ``model_name_or_path``, ``model_patch``) is graded task by task by the
env's own grader, defences on.

Each episode ends in exactly one outcome (:data:`OUTCOMES`): ``success``, ``failure``,
``step_limit`` (the protocol's cap cut it), ``token_limit`` (the episode's actions reached
``--max-episode-tokens``), ``time_limit`` (``--episode-timeout``),
``agent_error`` (the agent raised), or ``infra_error`` (the sandbox or the endpoint
failed). Infrastructure errors are retried up to ``retries`` times, and ``--resume``
tries them again; they count apart from the agent's failures and are left out of the
scores' denominators (the report says how many). An unparseable reply is no error: the
env answers it with its invalid-action feedback, and the episode counts its invalid
actions.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from branchgym.error import OptionError
from branchgym.evaluation.agents import Agent
from branchgym.evaluation.protocols import PinnedProtocol, Task
from branchgym.evaluation.summary import report_markdown, summarise
from branchgym.rollout.executor_base import EnvRecipe
from branchgym.rollout.tree import ROOT, RolloutTree, success_of

__all__ = ["EvalOptions", "episode_record", "read_episodes", "run_eval"]

#: Packages whose versions go into the provenance.
_PACKAGES = ("numpy", "scipy", "gymnasium", "torch", "transformers", "openai", "vllm")


@dataclasses.dataclass
class EvalOptions:
    """How to run (none of it changes what is measured, except ``episodes_per_task``).

    Attributes:
        episodes_per_task: K attempts per task.
        seed: Seeds every attempt's agent randomness (``[seed, task, attempt]``).
        max_envs: Envs alive at once (live episodes).
        executor: Where policy agents' envs run: ``thread``, ``inprocess``, ``process``,
            ``ray`` or ``fleet`` (:mod:`branchgym.rollout.executors`).
        executor_options: Keyword arguments of the executor.
        episode_timeout_s: Seconds per episode (None: no limit).
        max_episode_tokens: Generated tokens per episode: a policy agent's episode is cut
            after the action at which its actions' tokens reach this (None: no limit).
        retries: Retries of an episode that ended in an infrastructure error.
        resume: Finish the run already in the folder.
        progress: Show a progress bar.
    """

    episodes_per_task: int = 1
    seed: int = 0
    max_envs: int = 8
    executor: str = "thread"
    executor_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    episode_timeout_s: float | None = None
    max_episode_tokens: int | None = None
    retries: int = 2
    resume: bool = False
    progress: bool = True

    def check(self) -> None:
        """Refuse values that cannot work, naming the fix."""
        if self.episodes_per_task < 1:
            raise OptionError(f"--episodes-per-task must be >= 1; got {self.episodes_per_task}")
        if self.max_envs < 1:
            raise OptionError(f"--max-envs must be >= 1; got {self.max_envs}")
        if self.retries < 0:
            raise OptionError(f"--retries must be >= 0; got {self.retries}")
        if self.max_episode_tokens is not None and self.max_episode_tokens < 1:
            raise OptionError(
                f"--max-episode-tokens must be >= 1; got {self.max_episode_tokens}"
            )
        if self.episode_timeout_s is not None and not self.episode_timeout_s > 0:
            raise OptionError(f"--episode-timeout must be > 0 s; got {self.episode_timeout_s}")


# ---------------------------------------------------------------- provenance
def _git() -> dict[str, Any]:
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(dirty)}


def provenance() -> dict[str, Any]:
    """The version and commit of branchgym, Python, the platform and the packages that matter."""
    import branchgym

    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {
        "branchgym": branchgym.__version__,
        "git": _git(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": versions,
    }


def engine_facts(agent: Agent) -> dict[str, Any] | None:
    """How a model agent's engine computes: class, device, dtype, torch threads, linear kernels.

    Provenance, not configuration: none of it enters the agent's config hash (the same
    float32 arithmetic on other kernels or thread counts differs in summation order only).
    None for agents without an engine.
    """
    engine = getattr(agent.policy, "engine", None)
    if engine is None:
        return None
    facts: dict[str, Any] = {"class": type(engine).__name__}
    model = getattr(engine, "model", None)
    param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    if param is not None:
        facts.update(device=str(param.device), dtype=str(param.dtype).removeprefix("torch."))
    if hasattr(engine, "onednn_linear"):
        import torch

        from branchgym.agents.engines.linear import onednn_applies

        onednn = facts.get("dtype") == "float32" and onednn_applies(model, engine.onednn_linear)
        facts["linear"] = "onednn" if onednn else "torch default"
        facts["torch_threads"] = torch.get_num_threads()
    return facts


# ---------------------------------------------------------------- files
def _write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def read_episodes(path: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """``{(task, attempt): record}`` from ``episodes.jsonl``; the last line of an episode wins.

    A line cut by a crash (not valid JSON, or no final newline) is dropped and the file
    truncated before it, so appending continues from a clean line.
    """
    out: dict[tuple[str, int], dict[str, Any]] = {}
    if not path.exists():
        return out
    raw = path.read_bytes()
    good = 0
    for line in raw.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            break
        out[(str(rec["task"]), int(rec["attempt"]))] = rec
        good += len(line)
    if good < len(raw):
        with open(path, "r+b") as fh:
            fh.truncate(good)
    return out


def _byte_policy(nodes: list[Any]) -> bool:
    """Scripted experts record text without tokens; they generate none."""
    return all(n.text == str(n.action) for n in nodes)


def _tree_name(task: str, attempt: int) -> str:
    return re.sub(r"[^\w.-]", "_", task) + f"__a{attempt}.json.gz"


# ---------------------------------------------------------------- one episode's record
def episode_record(
    tree: RolloutTree,
    task: Task,
    attempt: int,
    protocol: PinnedProtocol,
    *,
    seconds: float,
    retries: int = 0,
    error: str | None = None,
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """The line ``episodes.jsonl`` keeps for one episode (its tree has one rollout)."""
    paths = tree.paths()
    path = paths[0] if paths else []
    nodes = [tree[i] for i in path]
    node_error = next((n.error for n in nodes if n.error), None)
    reward = float(sum(n.reward for n in nodes))
    tokens = int(sum(n.token_ids.size for n in nodes))
    success = bool(path) and success_of(tree, path)
    if error is not None:
        outcome = "agent_error" if error.startswith("agent:") else "infra_error"
    elif node_error is not None and "tree timeout" in node_error:
        outcome, error = "time_limit", node_error
    elif node_error is not None:
        outcome, error = "infra_error", node_error
    elif success:
        outcome = "success"
    elif nodes and nodes[-1].truncated and len(nodes) >= protocol.max_steps:
        outcome = "step_limit"
    elif nodes and nodes[-1].truncated and max_tokens is not None and tokens >= max_tokens:
        outcome = "token_limit"
    else:
        outcome = "failure"
    invalid = sum(
        1 for n in nodes if n.parse_error or bool((n.info or {}).get("invalid_action", False))
    )
    rec: dict[str, Any] = {
        "task": task.id,
        "attempt": attempt,
        "seed": task.seed,
        "outcome": outcome,
        "success": success and outcome == "success",
        "reward": reward,
        "steps": len(nodes),
        "invalid_actions": invalid,
        # an endpoint returns text, not token ids: its tokens are counted run-wide
        # (summary cost.endpoint_usage), never guessed per episode
        "generated_tokens": (
            None
            if any(n.text for n in nodes) and not any(n.token_ids.size for n in nodes)
            and not _byte_policy(nodes)
            else tokens
        ),
        "seconds": round(seconds, 3),
        "retries": retries,
        "error": error,
        "tree": f"trees/{_tree_name(task.id, attempt)}",
        "actions": [str(n.action)[:200] for n in nodes],
    }
    if protocol.category_key:
        rec["category"] = str(tree.info.get(protocol.category_key, "unknown"))
    if protocol.env_id == "branchgym/SWEBench-v0":
        last = nodes[-1].info if nodes else {}
        submitted = "resolved" in last
        rec["swebench"] = {
            "submitted": submitted,
            "empty_patch": submitted and not str(last.get("patch", "")).strip(),
            "rejected": str(last.get("rejected") or "") if submitted else "",
        }
    return rec


# ---------------------------------------------------------------- running episodes
class _Writer:
    """Appends records (and tree files) as episodes end, from any thread."""

    def __init__(self, out: Path, protocol: PinnedProtocol, bar: Any) -> None:
        self.out, self.protocol, self.bar = out, protocol, bar
        self.lock = threading.Lock()
        self.fh = open(out / "episodes.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    def write(self, tree: RolloutTree, rec: dict[str, Any]) -> None:
        from branchgym.tree_format import save_trees

        if tree.nodes:
            save_trees(self.out / rec["tree"], [tree], task=rec["task"], attempt=rec["attempt"],
                       outcome=rec["outcome"], protocol=self.protocol.name)  # fmt: skip
        else:
            rec["tree"] = None
        with self.lock:
            self.fh.write(json.dumps(rec, default=str) + "\n")
            self.fh.flush()
            os.fsync(self.fh.fileno())
            if self.bar is not None:
                self.bar.update(1)
                self.bar.set_postfix_str(rec["outcome"])

    def close(self) -> None:
        self.fh.close()


#: ``on_done(tree, task, attempt, seconds, error)``: each episode runner reports an episode
#: as it ends (``error``: why it could not be played, ``infra: ...`` or ``agent: ...``).
EpisodeDone = Callable[[RolloutTree, Task, int, float, str | None], None]


def _rng(seed: int, index: int, attempt: int) -> np.random.Generator:
    return np.random.default_rng([seed, index, attempt])


def _policy_episodes(
    todo: list[tuple[int, Task, int]],
    protocol: PinnedProtocol,
    agent: Agent,
    opts: EvalOptions,
    on_done: EpisodeDone,
) -> None:
    """Every ``(index, task, attempt)`` of ``todo`` through the engine, in lockstep."""
    from branchgym.rollout.batch import run_batched
    from branchgym.rollout.executors import make_executor
    from branchgym.rollout.grow import group_rollouts

    recipe = EnvRecipe(protocol.env_id, dict(protocol.env_kwargs))

    def job(index: int, task: Task, attempt: int, policy: Any, executor: Any = None) -> None:
        t0 = time.perf_counter()
        try:
            tree = group_rollouts(
                recipe, policy, 1, seed=task.seed, options=task.options or None,
                executor=executor, max_steps=protocol.max_steps,
                rng=_rng(opts.seed, index, attempt), tree_timeout=opts.episode_timeout_s,
                max_tokens=opts.max_episode_tokens,
            )  # fmt: skip
            on_done(tree, task, attempt, time.perf_counter() - t0, None)
        except Exception as exc:  # noqa: BLE001 - recorded per episode, retried when infra
            empty = RolloutTree(protocol.env_id, task.seed)
            on_done(empty, task, attempt, time.perf_counter() - t0, _error_text(exc))

    options = dict(opts.executor_options)
    if opts.executor in ("thread", "inprocess"):
        options.setdefault("max_instances", opts.max_envs)
    if opts.executor == "thread":
        options.setdefault("n_workers", min(opts.max_envs, 8))
    executor = make_executor(opts.executor, **options)
    try:  # run_batched keeps the executor's capacity (max_envs) of episodes alive
        run_batched([functools.partial(job, i, t, a) for i, t, a in todo], agent.policy, executor)
    finally:
        executor.shutdown()


def _error_text(exc: BaseException) -> str:
    from branchgym.error import Error

    kind = "infra" if isinstance(exc, Error | OSError | TimeoutError) else "agent"
    return f"{kind}: {type(exc).__name__}: {exc}"


def _expert_episodes(
    todo: list[tuple[int, Task, int]],
    protocol: PinnedProtocol,
    agent: Agent,
    opts: EvalOptions,
    on_done: EpisodeDone,
) -> None:
    """Every episode of an env agent, in-process, on ``max_envs`` threads (one env each).

    An expert that is not thread-safe (:data:`~branchgym.agents.policies.experts.THREAD_SAFE`:
    ALFWorld's planner) plays one episode at a time.
    """
    from branchgym.agents.policies.experts import THREAD_SAFE

    workers = opts.max_envs if agent.config.get("expert") in THREAD_SAFE else 1
    recipe = EnvRecipe(protocol.env_id, dict(protocol.env_kwargs))
    local = threading.local()
    made: list[Any] = []

    def play(index: int, task: Task, attempt: int) -> None:
        t0 = time.perf_counter()
        tree = RolloutTree(protocol.env_id, task.seed)
        try:
            env = getattr(local, "env", None)
            if env is None:
                env = local.env = recipe.make()
                made.append(env)
            rng = _rng(opts.seed, index, attempt)
            obs, info = env.reset(seed=task.seed, options=task.options or None)
            tree.observation, tree.info = obs, dict(info)
            act = agent.expert(env, rng)
            parent, done = ROOT, False
            for step in range(protocol.max_steps):
                deadline = opts.episode_timeout_s
                if deadline is not None and time.perf_counter() - t0 > deadline:
                    tree.add(parent, truncated=True,
                             error=f"tree timeout: the episode ran past its {deadline:g} s")
                    break  # fmt: skip
                action = act(obs, info)
                obs, reward, term, trunc, info = env.step(action)
                cut = bool(trunc) or step + 1 >= protocol.max_steps
                node = tree.add(parent, action=action, text=str(action),
                                observation=obs, reward=float(reward), terminated=bool(term),
                                truncated=cut and not term, info=dict(info))  # fmt: skip
                parent, done = node.id, bool(term or trunc)
                if done:
                    break
            on_done(tree, task, attempt, time.perf_counter() - t0, None)
        except Exception as exc:  # noqa: BLE001 - recorded per episode
            on_done(tree, task, attempt, time.perf_counter() - t0, _error_text(exc))

    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for fut in [pool.submit(play, i, t, a) for i, t, a in todo]:
                fut.result()
    finally:
        for env in made:
            env.close()


def _prediction_episodes(
    todo: list[tuple[int, Task, int]],
    protocol: PinnedProtocol,
    agent: Agent,
    opts: EvalOptions,
    on_done: EpisodeDone,
) -> None:
    """Grade each task's predicted patch with the env's grader (its defences as configured).

    A task without a prediction is an episode with no step: not submitted, not resolved.
    """
    recipe = EnvRecipe(protocol.env_id, dict(protocol.env_kwargs))
    env = recipe.make()
    try:
        for _, task, attempt in todo:
            t0 = time.perf_counter()
            tree = RolloutTree(protocol.env_id, task.seed)
            patch = (agent.predictions or {}).get(task.id)
            if patch is None:
                on_done(tree, task, attempt, 0.0, None)
                continue
            try:
                obs, info = env.reset(seed=task.seed, options=task.options or None)
                tree.observation, tree.info = obs, dict(info)
                report = env.unwrapped.grade(patch)
            except Exception as exc:  # noqa: BLE001 - the sandbox failed: infra, retried
                on_done(tree, task, attempt, time.perf_counter() - t0, _error_text(exc))
                continue
            info = {"resolved": bool(report.resolved), "rejected": report.rejected,
                    "patch": patch}  # fmt: skip
            tree.add(ROOT, action="submit", text=patch, observation=report.summary(),
                     reward=float(report.resolved), terminated=True, info=info)  # fmt: skip
            on_done(tree, task, attempt, time.perf_counter() - t0, None)
    finally:
        env.close()


# ---------------------------------------------------------------- the run
def _check_resume(out: Path, run_doc: dict[str, Any]) -> None:
    old = json.loads((out / "run.json").read_text())
    changed = [
        what
        for what, key in (
            ("protocol", ("protocol", "hash")),
            ("agent configuration", ("agent", "config_hash")),
            ("episodes per task", ("episodes_per_task",)),
            ("seed", ("seed",)),
            ("token limit", ("limits", "max_episode_tokens")),
        )
        if functools.reduce(lambda d, k: d.get(k) if isinstance(d, dict) else None, key, old)
        != functools.reduce(lambda d, k: d.get(k) if isinstance(d, dict) else None, key, run_doc)
    ]
    if changed:
        raise OptionError(
            f"cannot resume {out}: its {', '.join(changed)} differ from this command's; "
            "rerun with the run's own settings (see its run.json) or start a new --out"
        )


def run_eval(
    protocol: PinnedProtocol,
    agent: Agent,
    out: str | os.PathLike[str],
    options: EvalOptions | None = None,
) -> dict[str, Any]:
    """Run (or finish, with ``options.resume``) an evaluation; returns the summary.

    Raises:
        OptionError: The folder holds another run (or none to resume), or the resumed
            run's protocol, agent, K or seed differ.
    """
    from tqdm import tqdm

    opts = options or EvalOptions()
    opts.check()
    if agent.policy is None and agent.expert is None and agent.predictions is None:
        raise OptionError(f"agent {agent.spec!r} has no policy, expert or predictions")
    out = Path(out)
    run_doc = {
        "protocol": protocol.to_dict(),
        "agent": {"spec": agent.spec, "kind": agent.kind, "config": agent.config,
                  "config_hash": agent.config_hash},  # fmt: skip
        "episodes_per_task": opts.episodes_per_task,
        "seed": opts.seed,
        "limits": {"max_steps": protocol.max_steps, "episode_timeout_s": opts.episode_timeout_s,
                   "max_episode_tokens": opts.max_episode_tokens},  # fmt: skip
        "concurrency": {"max_envs": opts.max_envs, "executor": opts.executor},
        "provenance": {**provenance(), "engine": engine_facts(agent)},
        "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if (out / "run.json").exists():
        if not opts.resume:
            raise OptionError(
                f"{out} already holds a run; pass --resume to finish it, or another --out"
            )
        _check_resume(out, run_doc)
        run_doc = json.loads((out / "run.json").read_text())  # keep the first provenance
    elif opts.resume:
        raise OptionError(f"nothing to resume in {out} (no run.json); drop --resume")
    else:
        out.mkdir(parents=True, exist_ok=True)
        _write_json(out / "run.json", run_doc)
    for stale in ("summary.json", "report.md"):
        (out / stale).unlink(missing_ok=True)  # rewritten when the run is complete

    tries: dict[tuple[str, int], int] = {}
    bar = None
    for round_ in range(opts.retries + 1):
        done = read_episodes(out / "episodes.jsonl")
        todo = [
            (i, task, a)
            for i, task in enumerate(protocol.tasks)
            for a in range(opts.episodes_per_task)
            if (task.id, a) not in done or done[(task.id, a)]["outcome"] == "infra_error"
        ]
        if round_ > 0:
            todo = [x for x in todo if (x[1].id, x[2]) in tries]
        if not todo:
            break
        if bar is None and opts.progress:
            bar = tqdm(total=len(todo), desc=f"eval {protocol.name}", unit="episode")
        elif bar is not None:
            bar.total += len(todo)
            bar.refresh()
        writer = _Writer(out, protocol, bar)

        def on_done(tree: RolloutTree, task: Task, attempt: int, seconds: float,
                    error: str | None, _w: _Writer = writer) -> None:  # fmt: skip
            key = (task.id, attempt)
            rec = episode_record(tree, task, attempt, protocol, seconds=seconds,
                                 retries=tries.get(key, 0), error=error,
                                 max_tokens=opts.max_episode_tokens)  # fmt: skip
            if rec["outcome"] == "infra_error":
                tries[key] = tries.get(key, 0) + 1
            _w.write(tree, rec)

        try:
            if agent.predictions is not None:
                _prediction_episodes(todo, protocol, agent, opts, on_done)
            elif agent.policy is None:
                _expert_episodes(todo, protocol, agent, opts, on_done)
            else:
                _policy_episodes(todo, protocol, agent, opts, on_done)
        finally:
            writer.close()
        for key in [key for key, n in tries.items() if n > opts.retries]:
            del tries[key]  # out of retries: its infra_error line stands
        if not tries:
            break
    if bar is not None:
        bar.close()
    episodes = read_episodes(out / "episodes.jsonl")
    summary = summarise(run_doc, list(episodes.values()))
    usage = getattr(agent.policy, "usage", None)
    if isinstance(usage, dict) and usage.get("requests"):
        # this session's requests (a resumed run's earlier sessions are not in it)
        summary["cost"]["endpoint_usage"] = dict(usage)
    _write_json(out / "summary.json", summary)
    (out / "report.md").write_text(report_markdown(summary))
    return summary
