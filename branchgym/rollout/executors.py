"""Executors: where sandboxes live and how sibling steps run in parallel.

The branching engine keeps the policy in the driver (so an LLM engine batches the
siblings' generations and shares their prefix) and sends environment work -- reset,
step, snapshot, restore -- to an :class:`~branchgym.rollout.executor_base.Executor`.
Every env instance comes from a pool keyed by
:class:`~branchgym.rollout.executor_base.EnvRecipe`; a *session* is one instance playing
one rollout. What the executors share (the recipe, the outcome, the ``EnvWorker`` every
executor drives, the ``Executor`` and ``WorkerExecutor`` bases) is
:mod:`branchgym.rollout.executor_base`.

* :class:`InProcessExecutor`: instances in this process, calls one after another. With
  ``max_instances=1`` every sibling restores into the same instance (the fast path).
* :class:`ThreadExecutor`: instances in this process, calls on a thread pool (sandboxes
  that wait on I/O: containers, subprocesses, HTTP).
* :class:`~branchgym.rollout.process.ProcessExecutor` (:mod:`branchgym.rollout.process`):
  worker processes, each with its own pool (CPU-bound sandboxes; a crashing sandbox takes
  down only its worker).
* :class:`~branchgym.rollout.ray.RayExecutor` (:mod:`branchgym.rollout.ray`): Ray actors
  (``pip install 'branchgym[ray]'``), to scale sandboxes past one machine.
* :class:`~branchgym.rollout.fleet.FleetExecutor` (:mod:`branchgym.rollout.fleet`): the
  servers of ``branchgym serve``.

This module holds the two in-process kinds and the registry :data:`EXECUTORS` of every
kind, with :func:`make_executor`; it imports each kind's module, and none of them imports
it.
"""

from __future__ import annotations

import collections
import itertools
import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

from branchgym.error import ExecutorError
from branchgym.rollout.executor_base import (
    DEFAULT_TIMEOUT,
    Call,
    CallTimeout,
    EnvWorker,
    Executor,
)
from branchgym.rollout.fleet import FleetExecutor
from branchgym.rollout.process import ProcessExecutor
from branchgym.rollout.ray import RayExecutor

__all__ = [
    "InProcessExecutor",
    "ThreadExecutor",
    "EXECUTORS",
    "make_executor",
]


class InProcessExecutor(Executor):
    """Instances in this process; calls run one after another.

    Args:
        max_instances: Instances per spec (None: as many as sessions need). With 1,
            every sibling restores into the same instance: no extra memory, no pickling.
        timeout: Per-call limit (default :data:`DEFAULT_TIMEOUT`), enforced with
            ``SIGALRM`` when called from the main thread (a sandbox stuck in C code may not
            notice it).
    """

    name = "inprocess"

    def __init__(
        self, max_instances: int | None = None, timeout: float | None = DEFAULT_TIMEOUT
    ) -> None:
        """One :class:`EnvWorker` in this process."""
        super().__init__(timeout)
        self.worker = EnvWorker(max_instances)

    @property
    def max_instances(self) -> int | None:
        """Instances per spec."""
        return self.worker.max_instances

    @property
    def capacity(self) -> int | None:
        """``max_instances`` (sessions of one spec at once)."""
        return self.worker.max_instances

    def _call(self, call: Call) -> dict[str, Any]:
        if self.timeout is None or threading.current_thread() is not threading.main_thread():
            return self.worker.call(call.op, call.session, call.args)

        def on_alarm(signum: int, frame: Any) -> None:
            raise CallTimeout()

        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, self.timeout)
        try:
            return self.worker.call(call.op, call.session, call.args)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)

    def _run(self, calls: list[Call]) -> list[dict[str, Any]]:
        return [self._call(c) for c in calls]

    def shutdown(self) -> None:
        """Close every instance."""
        if not self._closed:
            self.worker.op_shutdown(-1)
        super().shutdown()


class _DaemonPool:
    """``n`` daemon threads running submitted calls.

    A thread stuck past its call's deadline is abandoned and replaced, so capacity stays
    ``n``, and being daemons they never block the interpreter's exit.
    """

    def __init__(self, n: int, prefix: str) -> None:
        self.n, self.prefix = n, prefix
        self.queue: collections.deque[tuple[futures.Future, Callable[[], Any]]] = (
            collections.deque()
        )
        self.cond = threading.Condition()
        self.idle = 0
        self.threads = 0
        self.closed = False
        self._ids = itertools.count()

    def submit(self, fn: Callable[[], Any]) -> futures.Future:
        fut: futures.Future = futures.Future()
        with self.cond:
            if self.closed:
                raise ExecutorError("this executor was shut down; create a new one")
            self.queue.append((fut, fn))
            if self.idle == 0 and self.threads < self.n:
                self._spawn()
            self.cond.notify()
        return fut

    def _spawn(self) -> None:
        self.threads += 1
        t = threading.Thread(
            target=self._loop, name=f"{self.prefix}-{next(self._ids)}", daemon=True
        )
        t.start()

    def abandon(self) -> None:
        """A thread is stuck in a timed-out call: stop counting it, start a replacement."""
        with self.cond:
            self.threads -= 1
            if self.queue and self.idle == 0 and self.threads < self.n and not self.closed:
                self._spawn()

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            with self.cond:
                self.idle += 1
                while not self.queue and not self.closed:
                    self.cond.wait()
                self.idle -= 1
                if self.closed and not self.queue:
                    self.threads -= 1
                    return
                fut, fn = self.queue.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            me.branchgym_future = fut  # type: ignore[attr-defined]
            try:
                fut.set_result(fn())
            except BaseException as exc:  # reported in the call's outcome
                fut.set_exception(exc)
            if getattr(fut, "abandoned", False):
                return  # timed out: a replacement thread took this one's place

    def shutdown(self) -> None:
        with self.cond:
            self.closed = True
            for fut, _ in self.queue:
                fut.cancel()
            self.queue.clear()
            self.cond.notify_all()


class ThreadExecutor(InProcessExecutor):
    """Instances in this process; calls on ``n_workers`` threads.

    For sandboxes that release the GIL (containers, subprocesses, network). A call's
    timeout counts from when it is queued, so it fires even when every thread is stuck.
    A timed-out call is reported and its session abandoned: Python cannot stop the
    thread, so its instance is never reused (and no longer counted against
    ``max_instances``), and a fresh thread takes its place. Threads are daemons: a stuck
    sandbox never blocks the interpreter's exit.
    """

    name = "thread"

    def __init__(
        self,
        n_workers: int = 4,
        max_instances: int | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> None:
        """Start the thread pool."""
        super().__init__(max_instances, timeout)
        if n_workers < 1:
            raise ExecutorError(f"n_workers must be >= 1, got {n_workers}")
        self.n_workers = n_workers
        self.pool = _DaemonPool(n_workers, "branchgym-env")

    @property
    def parallelism(self) -> int:
        """Threads."""
        return self.n_workers

    def _run(self, calls: list[Call]) -> list[dict[str, Any]]:
        queued = time.monotonic()
        futs = {
            self.pool.submit(lambda c=c: self.worker.call(c.op, c.session, c.args)): i
            for i, c in enumerate(calls)
        }
        results: list[dict[str, Any] | None] = [None] * len(calls)
        pending = set(futs)
        while pending:
            wait = None
            if self.timeout is not None:
                wait = max(0.0, queued + self.timeout - time.monotonic())
            done, pending = futures.wait(pending, timeout=wait, return_when=futures.FIRST_COMPLETED)
            for f in done:
                results[futs[f]] = f.result()
            if self.timeout is not None and time.monotonic() >= queued + self.timeout:
                for f in pending:
                    i = futs[f]
                    if not f.cancel():  # running: its thread is stuck, replace it
                        f.abandoned = True  # type: ignore[attr-defined]
                        self.pool.abandon()
                    self._abandon_session(calls[i].session)
                    results[i] = {
                        "error": f"timeout: the sandbox call ran past {self.timeout} s "
                        "(counted from when it was queued)"
                    }
                pending = set()
        return results  # type: ignore[return-value]

    def _abandon_session(self, session: int) -> None:
        """Forget a timed-out session's instance for good, and free its slot in the pool."""
        w = self.worker
        spec, env = w.sessions.pop(session, (None, None))
        if spec is not None:
            with w.lock:
                w.count[spec.key] -= 1

    def shutdown(self) -> None:
        """Stop the threads and close every instance."""
        if not self._closed:
            self.pool.shutdown()
        super().shutdown()


#: name -> executor class, for ``grow_tree(executor="process")`` and the CLI.
EXECUTORS: dict[str, type[Executor]] = {
    "inprocess": InProcessExecutor,
    "thread": ThreadExecutor,
    "fleet": FleetExecutor,
    "process": ProcessExecutor,
    "ray": RayExecutor,
}


def make_executor(name: str | Executor, **kwargs: Any) -> Executor:
    """An executor by name (an instance passes through)."""
    if isinstance(name, Executor):
        return name
    if name not in EXECUTORS:
        raise ExecutorError(f"no executor named {name!r}; use one of {', '.join(EXECUTORS)}")
    return EXECUTORS[name](**kwargs)
