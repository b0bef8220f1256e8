"""RayExecutor: sandboxes in Ray actors (``pip install 'branchgym[ray]'``), past one machine.

Each actor runs an :class:`~branchgym.rollout.executor_base.EnvWorker` behind one method; the
dispatch, timeouts and lost-worker bookkeeping are
:class:`~branchgym.rollout.executor_base.WorkerExecutor`'s. Ray itself is imported only when
an executor starts.
"""

from __future__ import annotations

import os
from typing import Any

from branchgym.error import DependencyMissingError
from branchgym.rollout.executor_base import (
    DEFAULT_TIMEOUT,
    Call,
    EnvWorker,
    WorkerExecutor,
)

__all__ = ["RayExecutor"]


class RayExecutor(WorkerExecutor):
    """Instances in ``n_workers`` Ray actors (``pip install 'branchgym[ray]'``).

    Call ``ray.init(...)`` first to pick the cluster (``ray.init(num_cpus=2)`` locally);
    without it the executor starts a local one and stops it again at :meth:`shutdown`
    (a runtime the caller started stays up). A dead actor or a call past ``timeout`` is
    reported on that session, and the actor is replaced.

    Args:
        n_workers: Actors.
        max_instances: Instances per spec in each actor.
        timeout: Per-call limit in seconds.
        actor_options: Passed to ``.options()`` (``num_cpus``, ``resources``, ...).
        sessions_per_worker: Sessions an actor hosts at once.
    """

    name = "ray"

    def __init__(
        self,
        n_workers: int = 2,
        max_instances: int | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        actor_options: dict[str, Any] | None = None,
        sessions_per_worker: int = 1,
    ) -> None:
        """Start the actors."""
        try:
            import ray
        except ImportError as exc:
            raise DependencyMissingError.for_extra("RayExecutor", "ray", "ray") from exc
        super().__init__(n_workers, max_instances, timeout, sessions_per_worker)
        self._ray = ray
        # a Ray runtime this executor starts is this executor's to stop (at shutdown);
        # one the caller started stays up for the caller
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(num_cpus=max(1, os.cpu_count() or 1), include_dashboard=False)
        self._actor_cls = ray.remote(_RayWorker)
        self._actor_options = {"num_cpus": 0, **(actor_options or {})}
        self._actors: list[Any] = [None] * n_workers
        self._pending: dict[Any, tuple[int, int]] = {}
        for w in range(n_workers):
            self._actors[w] = self._actor_cls.options(**self._actor_options).remote(max_instances)
        # wait for the actors to be up, so per-call timeouts do not count their start-up
        ray.get([a.call.remote("live", -1, ()) for a in self._actors])

    def _send(self, worker: int, call_id: int, call: Call) -> None:
        ref = self._actors[worker].call.remote(call.op, call.session, call.args)
        self._pending[ref] = (worker, call_id)

    def _ready(self, timeout: float | None) -> list[tuple[int, int | None, Any]]:
        ray = self._ray
        if not self._pending:
            return []
        done, _ = ray.wait(list(self._pending), num_returns=1, timeout=timeout)
        out = []
        for ref in done:
            worker, call_id = self._pending.pop(ref)
            try:
                out.append((worker, call_id, ray.get(ref)))
            except ray.exceptions.RayError as exc:
                out.append((worker, None, f"{type(exc).__name__}: {str(exc)[:300]}"))
        return out

    def _restart(self, worker: int) -> None:
        ray = self._ray
        for ref, (w, _) in list(self._pending.items()):
            if w == worker:
                self._pending.pop(ref)
        try:
            ray.kill(self._actors[worker], no_restart=True)
        except Exception:  # already dead
            pass
        self._actors[worker] = self._actor_cls.options(**self._actor_options).remote(
            self.max_instances
        )

    def shutdown(self) -> None:
        """Stop the actors (their instances close). Idempotent."""
        if self._closed:
            return
        try:
            self._run([Call("shutdown", -1, (), w) for w in range(self.n_workers)])
        finally:
            for actor in self._actors:
                try:
                    self._ray.kill(actor, no_restart=True)
                except Exception:  # pragma: no cover
                    pass
            super().shutdown()
            if self._owns_ray:
                self._ray.shutdown()


class _RayWorker:
    """The Ray actor: an :class:`EnvWorker` behind one method."""

    def __init__(self, max_instances: int | None) -> None:
        self.worker = EnvWorker(max_instances, remote=True)

    def call(self, op: str, session: int, args: tuple) -> dict[str, Any]:
        return self.worker.call(op, session, args)
