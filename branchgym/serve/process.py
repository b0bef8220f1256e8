"""Start ``branchgym serve`` in a child process and learn its URL (tests, benches, fleets)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from branchgym.error import RemoteError

__all__ = ["ServerProcess"]


class ServerProcess:
    """A ``branchgym serve`` child process on an ephemeral port.

    Args:
        env_id: The env to serve.
        env_kwargs: ``--env-kwargs``.
        host: Interface (default loopback).
        token: ``--token``.
        options: More flags, e.g. ``{"max_sessions": 4, "idle_timeout": 2}``.
        startup_timeout: Seconds to wait for the server to listen.

    Use it as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(
        self,
        env_id: str,
        env_kwargs: dict[str, Any] | None = None,
        *,
        host: str = "127.0.0.1",
        token: str | None = None,
        options: dict[str, Any] | None = None,
        startup_timeout: float = 180.0,
    ) -> None:
        """Describe the server; nothing starts until :meth:`start`."""
        self.argv = [sys.executable, "-m", "branchgym.cli", "serve", env_id, "--host", host]
        self.argv += ["--port", "0", "--env-kwargs", json.dumps(env_kwargs or {})]
        for name, value in (options or {}).items():
            self.argv += [f"--{name.replace('_', '-')}", str(value)]
        self.token = token
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self._lines: queue.Queue[str | None] = queue.Queue()

    def start(self) -> ServerProcess:
        """Launch without waiting; :meth:`wait_ready` returns the URL."""
        env = dict(os.environ)
        if self.token:
            env["BRANCHGYM_SERVE_TOKEN"] = self.token
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def wait_ready(self) -> str:
        """Wait until the server listens; its ``ws://`` URL."""
        if self.url:
            return self.url
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise RemoteError(
                    f"`{' '.join(self.argv[2:])}` did not listen within {self.startup_timeout} s",
                    "CONNECTION_FAILED",
                ) from None
            if line is None:
                err = self.proc.stderr.read() if self.proc and self.proc.stderr else ""
                raise RemoteError(
                    f"`{' '.join(self.argv[2:])}` exited before listening:\n{err[-2000:]}",
                    "CONNECTION_FAILED",
                )
            if line.startswith("serving ") and " on " in line:
                self.url = line.rsplit(" on ", 1)[1].strip()
                return self.url

    @property
    def pid(self) -> int:
        """The server's process id."""
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL the server (a crash: nothing is cleaned up)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 20 s. Idempotent."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> ServerProcess:
        self.start().wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
