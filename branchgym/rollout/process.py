"""ProcessExecutor: sandboxes in worker processes, each with its own pool.

For CPU-bound sandboxes: a crashing sandbox takes down only its worker, which the
executor replaces. Each worker runs an :class:`~branchgym.rollout.executor_base.EnvWorker`
behind a pipe (calls in, results out, in order); the dispatch, timeouts and lost-worker
bookkeeping are :class:`~branchgym.rollout.executor_base.WorkerExecutor`'s.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from typing import Any

from branchgym.error import ExecutorError
from branchgym.rollout.executor_base import (
    DEFAULT_TIMEOUT,
    Call,
    EnvWorker,
    WorkerExecutor,
)

__all__ = ["ProcessExecutor"]


def _watch_parent(period: float = 0.5) -> None:
    """Exit this worker when its driver is gone, even while a sandbox call is stuck.

    A daemon thread polls the parent pid: a driver killed with SIGKILL never closes the
    pipe's other end cleanly, and a worker stuck in a sandbox call would never read it.
    """
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(period)
            if os.getppid() != parent:  # re-parented: the driver died
                os._exit(70)

    threading.Thread(target=watch, name="branchgym-orphan-watch", daemon=True).start()


def _worker_main(conn: Any, max_instances: int | None) -> None:
    """Loop of a :class:`ProcessExecutor` worker: calls in, results out, in order."""
    import cloudpickle

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides when workers stop
    _watch_parent()
    worker = EnvWorker(max_instances, remote=True)
    conn.send_bytes(b"ready")  # timeouts count from here, not from the spawn
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            break
        call_id, op, session, args = cloudpickle.loads(msg)
        result = worker.call(op, session, args)
        try:
            payload = cloudpickle.dumps((call_id, result))
        except Exception as exc:  # an observation that does not pickle
            payload = cloudpickle.dumps((call_id, {"error": f"result does not pickle: {exc}"}))
        conn.send_bytes(payload)
        if op == "shutdown":
            break


class ProcessExecutor(WorkerExecutor):
    """Instances in ``n_workers`` worker processes (started with ``spawn``).

    Args:
        n_workers: Worker processes.
        max_instances: Instances per spec in each worker.
        timeout: Per-call limit; a worker past it is killed and replaced, and the
            sessions it held are reported lost.
        start_method: ``spawn`` (default, safe with torch and threads) or ``forkserver``.
        sessions_per_worker: Sessions a worker hosts at once (1: a crash loses only the
            crashing session).
    """

    name = "process"

    def __init__(
        self,
        n_workers: int = 2,
        max_instances: int | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        start_method: str = "spawn",
        sessions_per_worker: int = 1,
    ) -> None:
        """Start the workers."""
        super().__init__(n_workers, max_instances, timeout, sessions_per_worker)
        self._ctx = multiprocessing.get_context(start_method)
        self._procs: list[Any] = [None] * n_workers
        self._conns: list[Any] = [None] * n_workers
        for w in range(n_workers):
            self._start(w)

    def _start(self, w: int) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, args=(child, self.max_instances), daemon=True)
        proc.start()
        child.close()
        if not parent.poll(120) or parent.recv_bytes() != b"ready":
            proc.kill()
            raise ExecutorError(
                f"worker process {w} did not start within 120 s (exit code {proc.exitcode}); "
                "check that branchgym imports in a fresh interpreter."
            )
        self._procs[w], self._conns[w] = proc, parent

    @property
    def pids(self) -> list[int]:
        """Worker process ids."""
        return [p.pid for p in self._procs]

    def _send(self, worker: int, call_id: int, call: Call) -> None:
        import cloudpickle

        try:
            self._conns[worker].send_bytes(
                cloudpickle.dumps((call_id, call.op, call.session, call.args))
            )
        except (BrokenPipeError, OSError):
            pass  # the worker is dead; _ready reports it

    def _ready(self, timeout: float | None) -> list[tuple[int, int | None, Any]]:
        from multiprocessing.connection import wait

        import cloudpickle

        conns = {c: w for w, c in enumerate(self._conns)}
        out = []
        for conn in wait(list(conns), timeout):
            w = conns[conn]
            try:
                call_id, res = cloudpickle.loads(conn.recv_bytes())
                out.append((w, call_id, res))
            except (EOFError, OSError):
                self._procs[w].join(timeout=1)
                out.append((w, None, f"exit code {self._procs[w].exitcode}"))
        return out

    def _restart(self, worker: int) -> None:
        proc = self._procs[worker]
        if proc is not None and proc.is_alive():
            proc.kill()
        if proc is not None:
            proc.join(timeout=5)
        self._conns[worker].close()
        self._start(worker)

    def shutdown(self) -> None:
        """Stop every worker (their instances close). Idempotent."""
        if self._closed:
            return
        try:
            self._run([Call("shutdown", -1, (), w) for w in range(self.n_workers)])
        except Exception:  # pragma: no cover - best effort at exit
            pass
        for proc, conn in zip(self._procs, self._conns, strict=True):
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
            conn.close()
        super().shutdown()
