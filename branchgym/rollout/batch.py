"""Batched rollouts: many trees (or groups) grown in lockstep, one policy call per turn.

:func:`~branchgym.rollout.grow.grow_tree` already batches inside a tree: siblings advance in
lockstep and a branch point's K-1 siblings share one request. Across the prompts of a
training step, though, trees grow one after another, so an LLM engine decodes one
tree's few lines at a time. :func:`run_batched` runs several rollout jobs (each a
``grow_tree`` or ``group_rollouts`` call) together:

* every job runs the unchanged engine code in its own thread, but only one thread runs
  at a time (a baton passes from job to job in a fixed order), so nothing in the
  engine, a schedule or a teacher hook runs concurrently with anything else;
* when a job asks the policy for actions or the executor to reset, step, snapshot or
  restore, it hands the baton back and waits. Once every live job waits, the driver
  merges the waiting requests into ONE ``policy.act`` call (all prompts' backbones of a
  turn, every branch point's siblings) and one executor call per kind (so a thread or
  process executor steps all environments concurrently), then hands each job its part.

Same trees as one at a time: the baton order is fixed and every rollout draws from its
own random stream (keyed by seed, branch point and sibling), so a policy that samples
each request from its rollout's stream (every policy in ``branchgym.agents.policies.policy``;
``HFEngine`` through its per-prompt ``seeds``) gives the same trees batched as serially:
identical for tabular and text policies; for an LLM the same tokens, with log-probs
equal to float tolerance (the padded batch changes summation order, and a sampled
token could in principle flip at an exact tie). A policy call whose requests lack their
own streams is not merged (that job's call runs alone, with its own ``rng``).

Per-tree timings (``stats.generate_s``, the wall clock, ``tree_timeout``) include the
time a job waits for the others: the batch's cost is shared, not divided.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from branchgym.error import ExecutorError, OptionError
from branchgym.rollout.executor_base import EnvRecipe, Executor, Outcome, SnapshotRef
from branchgym.rollout.executors import InProcessExecutor, make_executor
from branchgym.rollout.grow import group_rollouts, grow_tree
from branchgym.rollout.policy import ActionSample, ActRequest, Policy
from branchgym.rollout.tree import RolloutTree

__all__ = ["run_batched", "grow_trees_batched", "group_rollouts_batched", "BatchStats"]

#: A rollout job: ``job(policy, executor=executor)`` returns its result (a tree).
Job = Callable[..., Any]


@dataclasses.dataclass
class BatchStats:
    """What the batched driver did (``run_batched(..., stats=BatchStats())`` fills it).

    Attributes:
        policy_calls: Merged ``policy.act`` calls.
        requests: Requests in them (a request: one context, n samples).
        env_calls: Merged executor calls (reset, step, snapshot, restore).
        env_ops: Sessions in them.
        policy_s: Seconds inside ``policy.act``.
        env_s: Seconds inside the merged executor calls.
    """

    policy_calls: int = 0
    requests: int = 0
    env_calls: int = 0
    env_ops: int = 0
    policy_s: float = 0.0
    env_s: float = 0.0


@dataclasses.dataclass
class _Op:
    kind: str  # act | reset | step | snapshot | restore
    args: tuple
    kwargs: dict[str, Any]


class _Raise:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _Job:
    def __init__(self, index: int, job: Job) -> None:
        self.index, self.job = index, job
        self.go = threading.Semaphore(0)
        self.op: _Op | None = None
        self.reply: Any = None
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = False


class _Driver:
    """The baton and the merged calls."""

    def __init__(self, policy: Policy, ex: Executor, stats: BatchStats) -> None:
        self.policy, self.ex, self.stats = policy, ex, stats
        self.back = threading.Semaphore(0)
        self.local = threading.local()

    # -- inside a job's thread ---------------------------------------------------------
    def wait(self, kind: str, *args: Any, **kwargs: Any) -> Any:
        job: _Job | None = getattr(self.local, "job", None)
        if job is None:
            raise ExecutorError(
                "a batched rollout's policy or executor was called from outside its job; "
                "call grow_tree/group_rollouts inside the job, with the policy and executor "
                "it is given"
            )
        job.op = _Op(kind, args, kwargs)
        self.back.release()  # hand the baton back
        job.go.acquire()  # until the merged call has answered
        reply, job.reply, job.op = job.reply, None, None
        if isinstance(reply, _Raise):
            raise reply.exc
        return reply

    def body(self, job: _Job, policy: Policy, ex: Executor) -> None:
        job.go.acquire()
        self.local.job = job
        try:
            job.value = job.job(policy, executor=ex)
        except BaseException as exc:  # handed to the caller once every job is done
            job.error = exc
        finally:
            job.done = True
            self.back.release()

    # -- in the driver -----------------------------------------------------------------
    def run(self, job: _Job) -> None:
        """Let one job run until it waits on a merged call or ends."""
        job.go.release()
        self.back.acquire()

    def dispatch(self, waiting: Sequence[_Job]) -> None:
        """Answer every waiting job: one policy call, one executor call per kind."""
        by_kind: dict[str, list[_Job]] = {}
        for job in waiting:
            by_kind.setdefault(job.op.kind, []).append(job)  # type: ignore[union-attr]
        for kind in ("reset", "restore", "snapshot", "act", "step"):
            jobs = by_kind.get(kind, [])
            if not jobs:
                continue
            groups = self._act_groups(jobs) if kind == "act" else self._env_groups(kind, jobs)
            for group in groups:
                try:
                    replies = getattr(self, f"_{kind}")(group)
                except Exception as exc:  # every job of the failed call sees the error
                    replies = [_Raise(exc)] * len(group)
                for job, reply in zip(group, replies, strict=True):
                    job.reply = reply

    @staticmethod
    def _act_groups(jobs: Sequence[_Job]) -> list[list[_Job]]:
        """Jobs whose every request carries its own streams merge; the others run alone."""
        merged, alone = [], []
        for job in jobs:
            requests = job.op.args[0]  # type: ignore[union-attr]
            own = all(len(r.rngs) >= r.n for r in requests)
            (merged if own else alone).append(job)
        return ([merged] if merged else []) + [[j] for j in alone]

    @staticmethod
    def _env_groups(kind: str, jobs: Sequence[_Job]) -> list[list[_Job]]:
        """Jobs with equal reset options merge (one call has one ``options``)."""
        if kind != "reset":
            return [list(jobs)]
        groups: list[tuple[Any, list[_Job]]] = []
        for job in jobs:
            opts = job.op.kwargs.get("options")  # type: ignore[union-attr]
            for key, members in groups:
                if key == opts:
                    members.append(job)
                    break
            else:
                groups.append((opts, [job]))
        return [members for _, members in groups]

    def _timed_env(self, fn: Callable[..., list[Outcome]], n: int, *args: Any, **kw: Any):
        import time

        t0 = time.perf_counter()
        out = fn(*args, **kw)
        self.stats.env_s += time.perf_counter() - t0
        self.stats.env_calls += 1
        self.stats.env_ops += n
        return out

    @staticmethod
    def _split(flat: Sequence[Any], sizes: Sequence[int]) -> list[list[Any]]:
        out, at = [], 0
        for n in sizes:
            out.append(list(flat[at : at + n]))
            at += n
        return out

    def _act(self, jobs: Sequence[_Job]) -> list[list[list[ActionSample]]]:
        import time

        requests: list[ActRequest] = []
        sizes = []
        for job in jobs:
            reqs = list(job.op.args[0])  # type: ignore[union-attr]
            requests.extend(reqs)
            sizes.append(len(reqs))
        rng = jobs[0].op.args[1]  # type: ignore[union-attr]
        t0 = time.perf_counter()
        batches = self.policy.act(requests, rng)
        self.stats.policy_s += time.perf_counter() - t0
        self.stats.policy_calls += 1
        self.stats.requests += len(requests)
        return self._split(batches, sizes)

    def _gather(self, jobs: Sequence[_Job], names: Sequence[str]) -> tuple[list[list], list[int]]:
        """Concatenate each positional/keyword list argument across jobs."""
        cols: list[list] = [[] for _ in names]
        sizes = []
        for job in jobs:
            op = job.op
            n = len(op.args[0])  # type: ignore[union-attr]
            sizes.append(n)
            for c, name in enumerate(names):
                if c < len(op.args):  # type: ignore[union-attr]
                    val = op.args[c]  # type: ignore[union-attr]
                else:
                    val = op.kwargs.get(name)  # type: ignore[union-attr]
                cols[c].extend(val if val is not None else [None] * n)
        return cols, sizes

    def _reset(self, jobs: Sequence[_Job]) -> list[list[Outcome]]:
        (specs, seeds, reseeds), sizes = self._gather(jobs, ("specs", "seeds", "reseeds"))
        opts = jobs[0].op.kwargs.get("options")  # type: ignore[union-attr]
        out = self._timed_env(
            self.ex.reset, len(specs), specs, seeds, options=opts, reseeds=reseeds
        )
        return self._split(out, sizes)

    def _step(self, jobs: Sequence[_Job]) -> list[list[Outcome]]:
        (sessions, actions), sizes = self._gather(jobs, ("sessions", "actions"))
        return self._split(self._timed_env(self.ex.step, len(sessions), sessions, actions), sizes)

    def _snapshot(self, jobs: Sequence[_Job]) -> list[list[Outcome]]:
        (sessions,), sizes = self._gather(jobs, ("sessions",))
        return self._split(self._timed_env(self.ex.snapshot, len(sessions), sessions), sizes)

    def _restore(self, jobs: Sequence[_Job]) -> list[list[Outcome]]:
        names = ("specs", "refs", "reseeds", "prefer")
        (specs, refs, reseeds, prefer), sizes = self._gather(jobs, names)
        out = self._timed_env(
            self.ex.restore, len(specs), specs, refs, reseeds=reseeds, prefer=prefer
        )
        return self._split(out, sizes)


class _BatchPolicy:
    """What a job sees as its policy: each call waits for the merged one."""

    def __init__(self, driver: _Driver) -> None:
        self.driver = driver

    def act(
        self, requests: Sequence[ActRequest], rng: np.random.Generator
    ) -> list[list[ActionSample]]:
        """This job's share of the turn's merged ``policy.act`` call."""
        return self.driver.wait("act", list(requests), rng)


class _BatchExecutor(Executor):
    """What a job sees as its executor: env calls merged across jobs, the rest passed on."""

    name = "batched"

    def __init__(self, driver: _Driver, inner: Executor, capacity: int | None) -> None:
        super().__init__(inner.timeout)
        self.driver, self.inner, self._capacity = driver, inner, capacity
        self.remote = inner.remote

    def _run(self, calls: list) -> list[dict[str, Any]]:  # pragma: no cover - never used
        raise ExecutorError("a batched executor forwards whole calls; it runs none itself")

    @property
    def parallelism(self) -> int:
        """The wrapped executor's."""
        return self.inner.parallelism

    @property
    def capacity(self) -> int | None:
        """This job's share of the wrapped executor's sessions."""
        return self._capacity

    def reset(self, specs, seeds, *, options=None, reseeds=None) -> list[Outcome]:  # noqa: D102
        return self.driver.wait("reset", list(specs), list(seeds), options=options, reseeds=reseeds)

    def step(self, sessions, actions) -> list[Outcome]:  # noqa: D102
        return self.driver.wait("step", list(sessions), list(actions))

    def snapshot(self, sessions) -> list[Outcome]:  # noqa: D102
        return self.driver.wait("snapshot", list(sessions))

    def restore(self, specs, refs, *, reseeds=None, prefer=None) -> list[Outcome]:  # noqa: D102
        return self.driver.wait("restore", list(specs), list(refs), reseeds=reseeds, prefer=prefer)

    def close(self, sessions) -> None:  # noqa: D102 - runs while this job holds the baton
        self.inner.close(sessions)

    def release(self, ref: SnapshotRef) -> None:  # noqa: D102
        self.inner.release(ref)

    def live_snapshots(self) -> Any:  # noqa: D102
        return self.inner.live_snapshots()

    def shutdown(self) -> None:
        """Nothing: the wrapped executor belongs to the caller of :func:`run_batched`."""


def run_batched(
    jobs: Sequence[Job],
    policy: Policy,
    executor: Executor | str | None = None,
    *,
    executor_options: dict[str, Any] | None = None,
    stats: BatchStats | None = None,
) -> list[Any]:
    """Run rollout jobs in lockstep: one merged policy call and env call per turn.

    Args:
        jobs: Callables ``job(policy, executor=executor)``, each one tree or group
            (``functools.partial(grow_tree, recipe, schedule=..., seed=s, rng=r)``). Build
            envs from a recipe (:class:`EnvRecipe` or id), not an env instance: the jobs'
            sessions live in the executor at the same time.
        policy: The policy every job samples from (called once per turn for all).
        executor: Where the envs run (an :class:`Executor` or a name; default in-process).
            A named one is shut down at the end.
        executor_options: Keyword arguments of a named executor.
        stats: Filled with what the driver merged (:class:`BatchStats`).

    Returns:
        Each job's result, in order. If jobs raised, the first error is raised once
        every job has ended (each released its snapshots on the way out).

    Jobs live at once: all of them, or the executor's ``capacity`` when it has one
    (the others start as jobs end); each then gets an equal share of that capacity.
    """
    stats = stats if stats is not None else BatchStats()
    owned = not isinstance(executor, Executor)
    ex = (
        InProcessExecutor()
        if executor is None
        else make_executor(executor, **(executor_options or {}))
    )
    cap = ex.capacity
    live_max = len(jobs) if cap is None else max(1, min(len(jobs), cap))
    share = None if cap is None else max(1, cap // max(live_max, 1))
    driver = _Driver(policy, ex, stats)
    bpolicy, bex = _BatchPolicy(driver), _BatchExecutor(driver, ex, share)
    states = [_Job(i, j) for i, j in enumerate(jobs)]
    todo = list(reversed(states))
    live: list[_Job] = []
    try:
        while todo or live:
            runnable = []
            while todo and len(live) < live_max:
                job = todo.pop()
                threading.Thread(
                    target=driver.body,
                    args=(job, bpolicy, bex),
                    name=f"branchgym-rollout-{job.index}",
                    daemon=True,
                ).start()
                live.append(job)
                runnable.append(job)
            runnable += [j for j in live if j.op is not None and j not in runnable]
            for job in sorted(runnable, key=lambda j: j.index):
                driver.run(job)
            live = [j for j in live if not j.done]
            waiting = [j for j in live if j.op is not None]
            if waiting and len(live) == len(waiting):
                driver.dispatch(waiting)
    finally:
        if owned:
            ex.shutdown()
    for job in states:
        if job.error is not None:
            raise job.error
    return [job.value for job in states]


def _recipe(env: EnvRecipe | str | Any) -> EnvRecipe | str:
    if isinstance(env, EnvRecipe | str):
        return env
    raise OptionError(
        "batched rollouts need an EnvRecipe or a registered id, not an env instance (the "
        "trees' sessions live side by side); pass branchgym.rollout.grow.spec_of(env)."
    )


def grow_trees_batched(
    env: EnvRecipe | str,
    policy: Policy,
    seeds: Sequence[int],
    schedule: str | Callable[..., Any] = "entropy",
    *,
    rngs: Sequence[np.random.Generator | int | None] | None = None,
    executor: Executor | str | None = None,
    executor_options: dict[str, Any] | None = None,
    stats: BatchStats | None = None,
    **kwargs: Any,
) -> list[RolloutTree]:
    """:func:`~branchgym.rollout.grow.grow_tree` for each seed, all trees in lockstep.

    ``rngs[i]`` is tree i's ``rng`` (default: its seed); other keyword arguments go to
    every ``grow_tree`` call. Tree i equals ``grow_tree(env, policy, schedule,
    seed=seeds[i], rng=rngs[i], **kwargs)`` (see the module notes for LLM engines).
    """
    env = _recipe(env)
    rngs = list(rngs) if rngs is not None else list(seeds)
    if len(rngs) != len(seeds):
        raise OptionError(f"{len(seeds)} seeds but {len(rngs)} rngs; give one rng per seed")
    jobs = [
        functools.partial(grow_tree, env, schedule=schedule, seed=s, rng=r, **kwargs)
        for s, r in zip(seeds, rngs, strict=True)
    ]
    return run_batched(jobs, policy, executor, executor_options=executor_options, stats=stats)


def group_rollouts_batched(
    env: EnvRecipe | str,
    policy: Policy,
    seeds: Sequence[int],
    n: int,
    *,
    rngs: Sequence[np.random.Generator | int | None] | None = None,
    executor: Executor | str | None = None,
    executor_options: dict[str, Any] | None = None,
    stats: BatchStats | None = None,
    **kwargs: Any,
) -> list[RolloutTree]:
    """:func:`~branchgym.rollout.grow.group_rollouts` (n rollouts) for each seed, in lockstep."""
    env = _recipe(env)
    rngs = list(rngs) if rngs is not None else list(seeds)
    if len(rngs) != len(seeds):
        raise OptionError(f"{len(seeds)} seeds but {len(rngs)} rngs; give one rng per seed")
    jobs = [
        functools.partial(group_rollouts, env, n=n, seed=s, rng=r, **kwargs)
        for s, r in zip(seeds, rngs, strict=True)
    ]
    return run_batched(jobs, policy, executor, executor_options=executor_options, stats=stats)
