"""The executor protocol: what every executor and its workers share.

The branching engine sends environment work -- reset, step, snapshot, restore -- to an
:class:`Executor` (the kinds, and the registry :data:`~branchgym.rollout.executors.EXECUTORS`
that names them, are :mod:`branchgym.rollout.executors`). Every env instance comes from a
pool keyed by :class:`EnvRecipe`; a *session* is one instance playing one rollout.

This module holds what the executors share: the recipe, the outcome, the
:class:`EnvWorker` every executor drives (in this process, in a worker process, in a Ray
actor, in a ``branchgym serve`` server), the :class:`Executor` base and
:class:`WorkerExecutor`, the base of those whose instances live in workers. It sits
under every kind of executor, so that each kind's module builds on it and the registry
above them all imports each kind.

Snapshots that pickle are portable: remote executors bring them to the driver, and a
sibling restores into any free instance on any worker. Snapshots that do not pickle
stay where they were taken, and their siblings run on that worker.

A crash (an exception in the sandbox, a dead worker process or actor) or a timeout in
one call is reported in that call's :class:`Outcome` and ends only that session; the
executor replaces a lost worker and goes on.

Why this module is over 600 lines: every executor (in-process, threads, processes, Ray,
fleet) drives the same :class:`EnvWorker` through its ``op_*`` calls, and the worker and
the executors' shared dispatch (:class:`Executor`, :class:`WorkerExecutor`) must agree
call by call; this module keeps that protocol in one place, and each kind of executor
lives in a module above it.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import itertools
import pickle
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from branchgym.core import LiveSnapshots, Snapshot, live_snapshots, reseed, restore, snapshot
from branchgym.digest import stable_hash
from branchgym.error import ExecutorError, SnapshotNotSupportedError

__all__ = [
    "EnvRecipe",
    "Outcome",
    "SnapshotRef",
    "Executor",
    "WorkerExecutor",
    "Call",
    "CallTimeout",
    "EnvWorker",
    "DEFAULT_TIMEOUT",
]


@dataclasses.dataclass(frozen=True)
class EnvRecipe:
    """How to build an env instance; instances from one spec are interchangeable.

    Attributes:
        id: A registered env id (``branchgym/TextTreeMDP-v0``), or a name for ``factory``.
        kwargs: Keyword arguments of ``gym.make`` (part of the pool key).
        factory: A picklable zero-argument callable returning the env, instead of
            ``gym.make(id, **kwargs)``.
    """

    id: str
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    factory: Callable[[], gym.Env] | None = None

    @property
    def key(self) -> str:
        """Pool key: instances with the same key are interchangeable."""
        return stable_hash(self.id, self.kwargs, repr(self.factory))

    def make(self) -> gym.Env:
        """Build one instance."""
        if self.factory is not None:
            return self.factory()
        import branchgym

        return branchgym.make(self.id, **self.kwargs)


@dataclasses.dataclass
class Outcome:
    """The result of one call on a session.

    ``error`` is set (and the session is gone) when the sandbox raised, its worker died,
    or the call ran past the executor's timeout.
    """

    session: int = -1
    observation: Any = None
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None
    snapshot: SnapshotRef | None = None


@dataclasses.dataclass
class SnapshotRef:
    """A snapshot as the driver holds it.

    Either the :class:`~branchgym.Snapshot` itself (in-process executors, and portable
    snapshots of remote ones, which travel as their checksummed bytes), or a handle on
    a snapshot that cannot leave its worker.
    """

    snapshot: Snapshot | None = None
    worker: int | None = None
    remote_id: int | None = None
    nbytes: int = 0
    step: int = 0

    @property
    def portable(self) -> bool:
        """True when any worker can restore it."""
        return self.snapshot is not None and (self.worker is None or self.snapshot.picklable)


def _describe(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"


#: Seconds one sandbox call may take on the thread, process and Ray executors unless told
#: otherwise (a hung sandbox never hangs training). Pass ``timeout=None`` for no limit.
DEFAULT_TIMEOUT = 600.0


class CallTimeout(BaseException):
    """Raised by SIGALRM inside an in-process call (BaseException: sandboxes catch Exception).

    :class:`EnvWorker` reports it as the call's timeout; the in-process executor raises it.
    """


# ----------------------------------------------------------------------- the worker


class EnvWorker:
    """Env pools, sessions and snapshots of one process (the driver, a worker, an actor).

    Every method returns an :class:`Outcome`-like dict and never raises for sandbox
    failures: they become the outcome's ``error`` and the session's instance is dropped
    (its state is unknown), never returned to the pool.
    """

    def __init__(self, max_instances: int | None = None, *, remote: bool = False) -> None:
        """Empty pools.

        Args:
            max_instances: Cap on instances per spec (None: no cap).
            remote: This worker runs in another process than the driver: snapshots it
                receives are copies, released right after their restore.
        """
        self.max_instances = max_instances
        self.remote = remote
        self.free: dict[str, list[gym.Env]] = collections.defaultdict(list)
        self.count: dict[str, int] = collections.defaultdict(int)
        self.sessions: dict[int, tuple[EnvRecipe, gym.Env]] = {}
        self.snaps: dict[int, Snapshot] = {}
        # Lost instances that still own snapshots other sessions may restore (a SWE-bench
        # env releases its snapshots when closed): closed once they own none, or at
        # shutdown.
        self.retired: list[gym.Env] = []
        self._ids = itertools.count()
        self.lock = threading.Lock()

    def adopt(self, spec: EnvRecipe, env: gym.Env) -> None:
        """Put an existing instance in the pool of ``spec`` (``grow_tree(env, ...)``)."""
        with self.lock:
            self.free[spec.key].append(env)
            self.count[spec.key] += 1

    def _acquire(self, spec: EnvRecipe, session: int) -> gym.Env:
        with self.lock:
            pool = self.free[spec.key]
            if pool:
                env = pool.pop()
            elif self.max_instances is not None and self.count[spec.key] >= self.max_instances:
                raise ExecutorError(
                    f"all {self.max_instances} instances of {spec.id} are busy; close a "
                    "session first or raise max_instances."
                )
            else:
                self.count[spec.key] += 1
                env = None
        if env is None:
            try:
                env = spec.make()
            except BaseException:
                with self.lock:
                    self.count[spec.key] -= 1
                raise
        self.sessions[session] = (spec, env)
        return env

    def _drop(self, session: int) -> None:
        """Forget a session whose instance is in an unknown state (never reused)."""
        spec, env = self.sessions.pop(session, (None, None))
        if env is None:
            return
        with self.lock:
            self.count[spec.key] -= 1
            self.retired.append(env)
        self._close_retired()

    def _close_retired(self, everything: bool = False) -> None:
        with self.lock:
            keep, close = [], []
            for env in self.retired:
                (close if everything or not _owns_snapshots(env) else keep).append(env)
            self.retired = keep
        for env in close:
            try:
                env.close()
            except Exception:  # a broken sandbox may fail to close; it is gone either way
                pass

    @staticmethod
    def _reseed(env: gym.Env, seed: int | None) -> None:
        # Siblings restored from one snapshot share the env's RNG state; a fresh stream
        # makes their transitions independent draws (algorithms.md §0: same distribution).
        if seed is None:
            return
        try:
            reseed(env, seed)  # through the stack, so ReplaySnapshot records it
        except SnapshotNotSupportedError:  # a plain env in group rollouts: no snapshots
            env.unwrapped.np_random = np.random.default_rng(seed)

    def call(self, op: str, session: int, args: tuple) -> dict[str, Any]:
        """Run one operation; failures come back as ``{"error": ...}``."""
        t0 = time.perf_counter()
        try:
            out = getattr(self, f"op_{op}")(session, *args)
        except CallTimeout:
            self._drop(session)
            return {"error": "timeout: the sandbox call ran past the executor's timeout"}
        except Exception as exc:
            if op in ("reset", "step", "restore"):
                self._drop(session)
            return {"error": _describe(exc), "seconds": time.perf_counter() - t0}
        out.setdefault("seconds", time.perf_counter() - t0)
        return out

    # -- operations ---------------------------------------------------------------
    def op_reset(self, session: int, spec: EnvRecipe, seed: Any, options: Any, reseed: Any):
        """Acquire an instance for ``session`` and reset it."""
        env = self._acquire(spec, session)
        t0 = time.perf_counter()
        obs, info = env.reset(seed=seed, options=options)
        self._reseed(env, reseed)
        return {"observation": obs, "info": info, "seconds": time.perf_counter() - t0}

    def op_step(self, session: int, action: Any):
        """Step the session's instance."""
        if session not in self.sessions:
            raise ExecutorError(f"session {session} is closed or was lost")
        env = self.sessions[session][1]
        t0 = time.perf_counter()
        obs, reward, terminated, truncated, info = env.step(action)
        return {
            "observation": obs,
            "reward": float(reward),
            "terminated": bool(terminated),
            "truncated": bool(truncated),
            "info": info,
            "seconds": time.perf_counter() - t0,
        }

    def op_snapshot(self, session: int, export: bool):
        """Snapshot the session's stack (exported as bytes for remote executors)."""
        env = self.sessions[session][1]
        t0 = time.perf_counter()
        snap = snapshot(env)
        secs = time.perf_counter() - t0
        if export and snap.picklable:
            blob = pickle.dumps(snap, protocol=5)
            snap.release()
            return {"blob": blob, "nbytes": len(blob), "step": snap.step, "seconds": secs}
        if export:
            sid = next(self._ids)
            self.snaps[sid] = snap
            return {"remote_id": sid, "nbytes": snap.nbytes, "step": snap.step, "seconds": secs}
        return {"snap": snap, "nbytes": snap.nbytes, "step": snap.step, "seconds": secs}

    def op_restore(
        self, session: int, spec: EnvRecipe, snap: Any, remote_id: Any, reseed: Any, prefer: Any
    ):
        """Restore a snapshot into a free instance (or ``prefer``'s: the fast path)."""
        env = None
        if prefer is not None and prefer in self.sessions:  # fast path: the same instance
            self.sessions[session] = self.sessions.pop(prefer)
            env = self.sessions[session][1]
        if env is None:
            env = self._acquire(spec, session)
        transient = remote_id is None and self.remote
        if remote_id is not None:
            snap = self.snaps[remote_id]
        t0 = time.perf_counter()
        try:
            obs, info = restore(env, snap)
        finally:
            if transient:  # a copy that travelled here for this one restore
                snap.release()
        secs = time.perf_counter() - t0
        self._reseed(env, reseed)
        return {"observation": obs, "info": info, "seconds": secs}

    def op_close(self, session: int):
        """Return the session's instance to its pool."""
        item = self.sessions.pop(session, None)
        if item is not None:
            spec, env = item
            with self.lock:
                self.free[spec.key].append(env)
        return {}

    def op_release(self, session: int, remote_id: int):
        """Release a snapshot held by this worker."""
        snap = self.snaps.pop(remote_id, None)
        if snap is not None:
            snap.release()
        return {}

    def op_live(self, session: int):
        """This process's unreleased snapshots."""
        live = live_snapshots()
        return {"count": live.count, "nbytes": live.nbytes}

    def op_shutdown(self, session: int):
        """Close every instance and release every snapshot."""
        for sid in list(self.sessions):
            self._drop(sid)
        self._close_retired(everything=True)
        for snap in self.snaps.values():
            snap.release()
        self.snaps.clear()
        for pool in self.free.values():
            for env in pool:
                env.close()
        self.free.clear()
        return {}


def _owns_snapshots(env: gym.Env) -> bool:
    """Whether closing ``env`` would release snapshots it took (``live_resources()``)."""
    resources = getattr(env.unwrapped, "live_resources", None)
    if resources is None:
        return False
    try:
        return bool(resources().get("snapshots", 0))
    except Exception:
        return False


def _outcome(session: int, d: dict[str, Any]) -> Outcome:
    return Outcome(
        session=session,
        observation=d.get("observation"),
        reward=float(d.get("reward", 0.0)),
        terminated=bool(d.get("terminated", False)),
        truncated=bool(d.get("truncated", False)),
        info=d.get("info") or {},
        seconds=float(d.get("seconds", 0.0)),
        error=d.get("error"),
    )


# --------------------------------------------------------------------- the executors


@dataclasses.dataclass
class Call:
    """One call of a session: the :class:`EnvWorker` op, its arguments, the worker."""

    op: str
    session: int
    args: tuple
    worker: int = 0


class Executor(abc.ABC):
    """Runs environment calls for the branching engine, in parallel across sessions.

    Args:
        timeout: Seconds one call may take before its session is declared lost (None:
            no limit).
    """

    #: Name in :data:`~branchgym.rollout.executors.EXECUTORS`.
    name: str = ""
    #: Whether snapshots leave the process that took them (pickled to the driver).
    remote: bool = False

    def __init__(self, timeout: float | None = None) -> None:
        """Set the per-call timeout."""
        if timeout is not None and timeout <= 0:
            raise ExecutorError(f"timeout must be positive seconds or None, got {timeout}")
        self.timeout = timeout
        self._sessions = itertools.count()
        self._where: dict[int, int] = {}
        self._lost: dict[int, str] = {}  # session -> why (its worker died or was killed)
        self._closed = False

    # -- what subclasses provide ----------------------------------------------------
    @abc.abstractmethod
    def _run(self, calls: list[Call]) -> list[dict[str, Any]]:
        """Run calls (at most one per session) and return their result dicts in order."""

    def _place(self, ref: SnapshotRef | None) -> int:
        return 0

    @property
    def parallelism(self) -> int:
        """How many calls run at once."""
        return 1

    @property
    def capacity(self) -> int | None:
        """Most sessions open at once (None: no limit); the engine never exceeds it."""
        return None

    # -- the API the engine uses ------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ExecutorError("this executor was shut down; create a new one")

    def reset(
        self,
        specs: Sequence[EnvRecipe],
        seeds: Sequence[Any],
        *,
        options: Any = None,
        reseeds: Sequence[int | None] | None = None,
    ) -> list[Outcome]:
        """Open one session per spec and reset it with its seed."""
        self._check_open()
        reseeds = reseeds or [None] * len(specs)
        calls = []
        for spec, seed, rs in zip(specs, seeds, reseeds, strict=True):
            sid = next(self._sessions)
            w = self._place(None)
            self._where[sid] = w
            calls.append(Call("reset", sid, (spec, seed, options, rs), w))
        return self._outcomes(calls)

    def step(self, sessions: Sequence[int], actions: Sequence[Any]) -> list[Outcome]:
        """Step each session with its action, in parallel."""
        self._check_open()
        calls = [
            Call("step", s, (a,), self._where.get(s, 0))
            for s, a in zip(sessions, actions, strict=True)
        ]
        return self._outcomes(calls)

    def snapshot(self, sessions: Sequence[int]) -> list[Outcome]:
        """Snapshot each session; ``Outcome.snapshot`` holds the :class:`SnapshotRef`."""
        self._check_open()
        calls = [Call("snapshot", s, (self.remote,), self._where.get(s, 0)) for s in sessions]
        out = []
        for call, d in zip(calls, self._run(calls), strict=True):
            o = _outcome(call.session, d)
            if o.error is None:
                if "snap" in d:
                    ref = SnapshotRef(d["snap"], None, None, d["nbytes"], d["step"])
                elif "blob" in d:
                    snap = pickle.loads(d["blob"])  # stays bytes until a worker opens it
                    ref = SnapshotRef(snap, None, None, d["nbytes"], d["step"])
                else:
                    ref = SnapshotRef(None, call.worker, d["remote_id"], d["nbytes"], d["step"])
                o.snapshot = ref
            out.append(o)
        return out

    def restore(
        self,
        specs: Sequence[EnvRecipe],
        refs: Sequence[SnapshotRef],
        *,
        reseeds: Sequence[int | None] | None = None,
        prefer: Sequence[int | None] | None = None,
    ) -> list[Outcome]:
        """Open one session per snapshot: a free instance restores it.

        Args:
            specs: The spec of each snapshot's env.
            refs: The snapshots.
            reseeds: A fresh seed for each session's env RNG (None: keep the snapshot's).
            prefer: A session whose instance to reuse (fast path; it is closed into the
                new session), when it lives where the snapshot can be restored.
        """
        self._check_open()
        reseeds = reseeds or [None] * len(refs)
        prefer = prefer or [None] * len(refs)
        calls = []
        for spec, ref, rs, pf in zip(specs, refs, reseeds, prefer, strict=True):
            sid = next(self._sessions)
            if ref.worker is not None and ref.remote_id is not None:
                w = ref.worker
            elif pf is not None and pf in self._where:
                w = self._where[pf]
            else:
                w = self._place(ref)
            if pf is not None and self._where.get(pf) != w:
                pf = None
            self._where[sid] = w
            if pf is not None:
                self._where.pop(pf, None)
            snap = ref.snapshot if ref.remote_id is None else None
            calls.append(Call("restore", sid, (spec, snap, ref.remote_id, rs, pf), w))
        return self._outcomes(calls)

    def close(self, sessions: Sequence[int]) -> None:
        """Return the sessions' instances to their pools."""
        if self._closed:
            return
        calls = [Call("close", s, (), self._where.pop(s)) for s in sessions if s in self._where]
        if calls:
            self._run(calls)

    def release(self, ref: SnapshotRef) -> None:
        """Free a snapshot wherever it lives."""
        if ref.snapshot is not None:
            ref.snapshot.release()
        elif ref.remote_id is not None and not self._closed:
            self._run([Call("release", -1, (ref.remote_id,), ref.worker or 0)])
            ref.remote_id = None

    def live_snapshots(self) -> LiveSnapshots:
        """Unreleased snapshots in this process and in every worker."""
        return live_snapshots()

    def shutdown(self) -> None:
        """Close every instance and stop workers. Idempotent."""
        self._closed = True

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _outcomes(self, calls: list[Call]) -> list[Outcome]:
        live = [c for c in calls if c.session not in self._lost]
        done = dict(zip((id(c) for c in live), self._run(live) if live else [], strict=True))
        results = [
            done[id(c)]
            if id(c) in done
            else {"error": f"session lost with its worker ({self._lost.pop(c.session)})"}
            for c in calls
        ]
        out = []
        for call, d in zip(calls, results, strict=True):
            o = _outcome(call.session, d)
            if o.error is not None:
                self._where.pop(call.session, None)
            out.append(o)
        return out


# ------------------------------------------------------------------ remote executors


class WorkerExecutor(Executor):
    """Shared logic of executors whose instances live in workers (processes, actors)."""

    remote = True

    def __init__(
        self,
        n_workers: int,
        max_instances: int | None,
        timeout: float | None,
        sessions_per_worker: int = 1,
    ) -> None:
        super().__init__(timeout)
        if n_workers < 1 or sessions_per_worker < 1:
            raise ExecutorError(
                f"n_workers and sessions_per_worker must be >= 1, got {n_workers} and "
                f"{sessions_per_worker}"
            )
        self.n_workers = n_workers
        self.max_instances = max_instances
        self.sessions_per_worker = sessions_per_worker

    @property
    def capacity(self) -> int:
        """Most sessions at once: ``n_workers * sessions_per_worker``.

        With one session per worker (the default), a sandbox that kills its worker
        loses nothing but its own session.
        """
        return self.n_workers * self.sessions_per_worker

    @property
    def parallelism(self) -> int:
        """Workers."""
        return self.n_workers

    def _place(self, ref: SnapshotRef | None) -> int:
        counts = collections.Counter(self._where.values())
        return min(range(self.n_workers), key=lambda w: (counts.get(w, 0), w))

    @abc.abstractmethod
    def _send(self, worker: int, call_id: int, call: Call) -> None:
        """Queue a call on a worker (workers run their calls in order)."""

    @abc.abstractmethod
    def _ready(self, timeout: float | None) -> list[tuple[int, int | None, Any]]:
        """Finished calls as ``(worker, call_id, result)``.

        A dead worker gives ``(worker, None, error message)``.
        """

    @abc.abstractmethod
    def _restart(self, worker: int) -> None:
        """Kill (if alive) and replace a worker."""

    def _lose_worker(
        self, w: int, why: str, queues: dict[int, collections.deque], results: list
    ) -> None:
        self._restart(w)
        first = True
        for call_id in queues[w]:
            results[call_id] = {"error": why if first else f"worker lost ({why})"}
            first = False
        queues[w].clear()
        for sid, where in list(self._where.items()):  # every session there is gone
            if where == w:
                self._where.pop(sid)
                self._lost[sid] = why

    def _run(self, calls: list[Call]) -> list[dict[str, Any]]:
        results: list[Any] = [None] * len(calls)
        queues: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        head_start: dict[int, float] = {}
        for i, call in enumerate(calls):
            queues[call.worker].append(i)
            self._send(call.worker, i, call)
        now = time.monotonic()
        for w in queues:
            head_start[w] = now
        while any(queues.values()):
            wait = None
            if self.timeout is not None:
                deadline = min(head_start[w] + self.timeout for w, q in queues.items() if q)
                wait = max(0.0, deadline - time.monotonic())
            for w, call_id, res in self._ready(wait):
                if not queues[w]:
                    continue
                if call_id is None:
                    self._lose_worker(w, f"sandbox worker died: {res}", queues, results)
                    continue
                if call_id in queues[w]:
                    queues[w].remove(call_id)
                    results[call_id] = res
                    head_start[w] = time.monotonic()
            if self.timeout is not None:
                now = time.monotonic()
                for w, q in queues.items():
                    if q and now - head_start[w] > self.timeout:
                        self._lose_worker(
                            w,
                            f"timeout: the sandbox call ran past {self.timeout} s "
                            "(worker killed and replaced)",
                            queues,
                            results,
                        )
        return results

    def live_snapshots(self) -> LiveSnapshots:
        """Unreleased snapshots in the driver plus every worker."""
        mine = live_snapshots()
        res = self._run([Call("live", -1, (), w) for w in range(self.n_workers)])
        count = mine.count + sum(r.get("count", 0) for r in res)
        nbytes = mine.nbytes + sum(r.get("nbytes", 0) for r in res)
        return LiveSnapshots(count, nbytes)
