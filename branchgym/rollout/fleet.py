"""The fleet executor: sandboxes on several ``branchgym serve`` servers, trees grown across them.

:class:`FleetExecutor` is an :class:`~branchgym.rollout.executor_base.Executor` whose workers are
servers. Each server holds its sessions and its snapshots (by id, nothing crosses the
wire), so a sibling is restored on the server that holds its snapshot, and new rollouts
go to the least-loaded live server. All calls for one server in a step of the engine
travel as one ``batch`` message and run there concurrently; the servers run in parallel.

A server that dies, or does not answer within ``timeout``, is dropped: the calls in
flight there, and every later call on its sessions and snapshots, come back as errors
with the reason (the tree records them as error leaves, as with a dead worker process),
and new rollouts go to the servers still alive. A dropped server (or one unreachable at
the start) is dialled again at most every ``reconnect_interval`` seconds when a new
rollout is placed; once it answers, new rollouts go to it again (what it held before is
gone: a restarted server starts empty).

``FleetExecutor(["ws://a:8000", "ws://b:8000"], token=...)`` from a list of URLs, or
:meth:`FleetExecutor.on_ray` to start the servers as Ray actors on a cluster.
"""

from __future__ import annotations

import collections
import itertools
import os
import pickle
import socket
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from typing import Any

from branchgym.core import LiveSnapshots, Snapshot, live_snapshots
from branchgym.error import DependencyMissingError, ExecutorError, RemoteError
from branchgym.remote import Connection, ws_url
from branchgym.rollout.executor_base import DEFAULT_TIMEOUT, Executor
from branchgym.serve.wire import decode, encode

__all__ = ["FleetExecutor"]


class FleetExecutor(Executor):
    """Sessions and snapshots on a fleet of ``branchgym serve`` servers.

    Args:
        urls: The servers (``ws://host:port``), all serving the env the tree uses.
        token: Their token (default: ``$BRANCHGYM_SERVE_TOKEN``).
        timeout: Seconds a server may take to answer one batch; past it the server is
            dropped and its sessions reported lost.
        portable: Snapshots of picklable envs travel as signed bytes (any server with
            the same ``$BRANCHGYM_SNAPSHOT_KEY`` restores them) instead of server ids.
        connect_timeout: Seconds to connect to each server.
        reconnect_interval: Seconds between attempts to reconnect to a dropped server
            (each attempt waits at most ``min(connect_timeout, 2)`` s); None: never.

    Attributes:
        reconnects: Servers brought back after they were dropped.
    """

    name = "fleet"
    remote = True

    def __init__(
        self,
        urls: Sequence[str],
        *,
        token: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        portable: bool = False,
        connect_timeout: float = 10.0,
        reconnect_interval: float | None = 5.0,
    ) -> None:
        """Connect to every server (unreachable ones are dropped; none reachable raises)."""
        super().__init__(timeout)
        if reconnect_interval is not None and not reconnect_interval > 0:
            raise ExecutorError(
                f"reconnect_interval must be positive seconds or None, got {reconnect_interval!r}"
            )
        self.reconnect_interval = reconnect_interval
        self.connect_timeout = connect_timeout
        self.reconnects = 0
        self._retry_at: dict[int, float] = {}
        if isinstance(urls, str) or not urls:
            raise ExecutorError(
                f"FleetExecutor takes a non-empty list of server URLs, got {urls!r}"
            )
        self.urls = [ws_url(u) for u in urls]
        self.token = token if token is not None else os.environ.get("BRANCHGYM_SERVE_TOKEN")
        self.portable = portable
        self._conns: list[Connection | None] = [None] * len(self.urls)
        self._info: list[dict[str, Any]] = [{} for _ in self.urls]
        self._dead: dict[int, str] = {}
        self._sids: dict[int, str] = {}  # engine session -> the server's session id
        self._snaps: dict[int, tuple[int, str]] = {}  # remote_id -> (server, snapshot id)
        self._orphans: dict[int, list[str]] = collections.defaultdict(list)
        self._snap_ids = itertools.count()
        self._lock = threading.Lock()
        self._actors: list[Any] = []
        self._owns_ray = False  # set by on_ray when it started the Ray runtime
        for w, url in enumerate(self.urls):
            try:
                self._conns[w], self._info[w] = self._dial(w, connect_timeout)
            except RemoteError as exc:
                self._dead[w] = f"server {url} unreachable: {exc.code}: {exc}"
                self._schedule_retry(w)
        if len(self._dead) == len(self.urls):
            raise ExecutorError(
                "no server of the fleet answered: "
                + "; ".join(f"{self.urls[w]}: {why}" for w, why in self._dead.items())
            )
        self._pool = futures.ThreadPoolExecutor(len(self.urls), thread_name_prefix="bg-fleet")

    # -- shape -----------------------------------------------------------------------
    @property
    def servers(self) -> list[str]:
        """URLs of the servers still in use."""
        return [u for w, u in enumerate(self.urls) if w not in self._dead]

    @property
    def parallelism(self) -> int:
        """Live servers (each also runs its own batch concurrently)."""
        return max(1, len(self.servers))

    @property
    def capacity(self) -> int | None:
        """Sessions the live servers allow together."""
        return (
            sum(
                int(self._info[w].get("limits", {}).get("max_sessions", 64))
                for w in range(len(self.urls))
                if w not in self._dead
            )
            or None
        )

    def _dial(self, w: int, connect_timeout: float) -> tuple[Connection, dict[str, Any]]:
        """A connection to server ``w`` and its info (raises :class:`RemoteError`)."""
        conn = Connection(
            self.urls[w], self.token, timeout=self.timeout, connect_timeout=connect_timeout
        )
        try:
            return conn, conn.request({"type": "info"})["data"]
        except BaseException:
            conn.close()
            raise

    def _schedule_retry(self, w: int) -> None:
        if self.reconnect_interval is not None:
            self._retry_at[w] = time.monotonic() + self.reconnect_interval

    def _revive(self) -> None:
        """Dial the dropped servers whose retry time has come; the ones that answer are back."""
        now = time.monotonic()
        for w in [w for w in self._dead if self._retry_at.get(w, float("inf")) <= now]:
            try:
                self._conns[w], self._info[w] = self._dial(w, min(self.connect_timeout, 2.0))
            except RemoteError:
                self._schedule_retry(w)
                continue
            self._orphans.pop(w, None)  # the sessions they named died with the old server
            del self._dead[w]
            self._retry_at.pop(w, None)
            self.reconnects += 1

    def _place(self, ref: Any) -> int:
        if self._dead and self._retry_at:
            self._revive()
        live = [w for w in range(len(self.urls)) if w not in self._dead]
        if not live:
            return 0  # every server is gone: the call reports why
        counts = collections.Counter(self._where.values())
        return min(live, key=lambda w: (counts.get(w, 0), w))

    # -- one call -> one message ----------------------------------------------------------
    def _message(self, w: int, call: Any) -> dict[str, Any] | dict[str, str]:
        """The protocol message for ``call``; ``{"error": ...}`` when it cannot be sent."""
        op, session, args = call.op, call.session, call.args
        served = self._info[w].get("env_id")
        if op in ("reset", "restore"):
            recipe = args[0]
            served_kwargs = decode(self._info[w].get("env_kwargs") or {})
            if recipe.id != served or (recipe.factory is None and recipe.kwargs != served_kwargs):
                return {
                    "error": f"server {self.urls[w]} serves {served} {served_kwargs}, not "
                    f"{recipe.id} {recipe.kwargs}: serve the tree's env with its kwargs"
                }
        if op == "reset":
            _, seed, options, rs = args
            data = {"seed": seed, "reseed": rs}
            if options:
                data["options"] = encode(options)
            return {"type": "reset", "session": "new", "data": data}
        if op == "restore":
            _, snap, remote_id, rs, prefer = args
            if remote_id is not None:
                where = self._snaps.get(remote_id)
                if where is None:
                    return {"error": "the snapshot was released, or its server was lost"}
                data: dict[str, Any] = {"snapshot_id": where[1]}
            else:
                data = self._portable_data(snap)
            data["reseed"] = rs
            if prefer is not None and prefer in self._sids:
                return {"type": "restore", "session": self._sids[prefer], "data": data}
            return {"type": "fork", "data": data}
        if op == "release":
            where = self._snaps.pop(args[0], None)
            if where is None:
                return {"skip": {}}
            return {"type": "release", "data": {"snapshot_ids": [where[1]]}}
        if op == "live":
            return {"type": "stats"}
        sid = self._sids.get(session)
        if sid is None:
            if op == "close":
                return {"skip": {}}
            return {"error": f"session {session} is closed or was lost"}
        if op == "step":
            return {"type": "step", "session": sid, "data": {"action": encode(args[0])}}
        if op == "snapshot":
            return {"type": "snapshot", "session": sid, "data": {"portable": self.portable}}
        if op == "close":
            return {"type": "close", "session": sid}
        return {"error": f"the fleet executor has no operation {op!r}"}

    @staticmethod
    def _portable_data(snap: Any) -> dict[str, Any]:
        import base64

        if not isinstance(snap, Snapshot) or not isinstance(snap.payload, bytes):
            raise ExecutorError("a portable fleet snapshot holds its signed bytes")
        return {
            "blob": base64.b64encode(snap.payload).decode("ascii"),
            "done": bool(snap.meta.get("done", False)),
            "steps": int(snap.meta.get("steps", snap.step)),
        }

    def _result(self, w: int, call: Any, msg: dict, answer: dict) -> dict[str, Any]:
        """The engine's result dict for one answer of server ``w``."""
        op = call.op
        if answer.get("type") == "error":
            data = answer.get("data") or {}
            if op in ("reset", "step", "restore"):  # the session's state is unknown: close it
                sid = self._sids.pop(call.session, None)
                if sid is not None:
                    self._orphans[w].append(sid)
            return {"error": f"{data.get('code')}: {data.get('message')} ({self.urls[w]})"}
        data = answer.get("data") or {}
        if op in ("reset", "restore"):
            if op == "restore" and msg["type"] == "restore":
                self._sids.pop(call.args[4], None)
            self._sids[call.session] = answer["session"]
            body = data.get("observation") or {}
            return {"observation": decode(body.get("observation")),
                    "info": decode(body.get("info") or {})}  # fmt: skip
        if op == "step":
            body = data.get("observation") or {}
            reward = data.get("reward")
            return {
                "observation": decode(body.get("observation")),
                "reward": 0.0 if reward is None else float(reward),
                "terminated": bool(body.get("terminated")),
                "truncated": bool(body.get("truncated")),
                "info": decode(body.get("info") or {}),
            }
        if op == "snapshot":
            if "blob" in data:
                import base64

                snap = Snapshot(
                    env_id=data["env_id"], spec_hash=data["spec_hash"], step=data["step"],
                    kind=data["kind"], payload=base64.b64decode(data["blob"]), picklable=True,
                    meta={"done": data["done"], "steps": data["steps"]},
                )  # fmt: skip
                blob = pickle.dumps(snap, protocol=5)
                snap.release()
                return {"blob": blob, "nbytes": data["nbytes"], "step": data["step"]}
            rid = next(self._snap_ids)
            self._snaps[rid] = (w, data["snapshot_id"])
            return {"remote_id": rid, "nbytes": int(data["nbytes"]), "step": data["step"]}
        if op == "close":
            self._sids.pop(call.session, None)
            return {}
        if op == "live":
            return {"count": data.get("snapshots", 0), "nbytes": data.get("snapshot_bytes", 0)}
        return {}

    # -- running a batch ---------------------------------------------------------------
    def _lose(self, w: int, why: str) -> None:
        """Drop server ``w``; ``why`` is what its calls report. Its sessions and snapshots go."""
        conn, self._conns[w] = self._conns[w], None
        self._dead.setdefault(w, why)
        self._schedule_retry(w)
        if conn is not None:
            conn.close()
        for sid, where in list(self._where.items()):
            if where == w:
                self._where.pop(sid)
                self._sids.pop(sid, None)
                self._lost[sid] = why
        for rid, (where, _) in list(self._snaps.items()):
            if where == w:
                self._snaps.pop(rid)

    def _send(self, w: int, messages: list[dict]) -> list[dict] | str:
        conn = self._conns[w]
        if conn is None:
            return self._dead.get(w) or f"server {self.urls[w]} lost"
        orphans, self._orphans[w] = self._orphans[w], []
        closes = [{"type": "close", "session": s} for s in orphans]
        try:
            answer = conn.request({"type": "batch", "data": {"calls": closes + messages}})
        except RemoteError as exc:
            return f"server {self.urls[w]} lost: {exc.code}: {exc}"
        results = (answer.get("data") or {}).get("results")
        if not isinstance(results, list) or len(results) != len(closes) + len(messages):
            return f"server {self.urls[w]} answered a batch of {len(messages)} calls malformed"
        return results[len(closes) :]

    def _run(self, calls: list[Any]) -> list[dict[str, Any]]:
        results: list[dict[str, Any] | None] = [None] * len(calls)
        batches: dict[int, list[tuple[int, dict]]] = collections.defaultdict(list)
        for i, call in enumerate(calls):
            w = call.worker
            if w in self._dead:
                results[i] = {"error": self._dead[w]}
                continue
            msg = self._message(w, call)
            if "error" in msg or "skip" in msg:
                results[i] = msg.get("skip", msg)
                continue
            batches[w].append((i, msg))
        pending = {
            self._pool.submit(self._send, w, [m for _, m in items]): w
            for w, items in batches.items()
        }
        for fut in futures.as_completed(pending):
            w = pending[fut]
            items = batches[w]
            answers = fut.result()
            if isinstance(answers, str):
                self._lose(w, answers)
                for i, _ in items:
                    results[i] = {"error": answers}
                continue
            for (i, msg), answer in zip(items, answers, strict=True):
                results[i] = self._result(w, calls[i], msg, answer)
        return results  # type: ignore[return-value]

    # -- the rest of the Executor API ----------------------------------------------------
    def live_snapshots(self) -> LiveSnapshots:
        """Unreleased snapshots in this process plus every live server."""
        mine = live_snapshots()
        count, nbytes = mine.count, mine.nbytes
        for w in range(len(self.urls)):
            conn = self._conns[w]
            if conn is None:
                continue
            try:
                stats = conn.request({"type": "stats"})["data"]
            except RemoteError as exc:
                self._lose(w, f"server {self.urls[w]} lost: {exc.code}: {exc}")
                continue
            count += int(stats.get("snapshots", 0))
            nbytes += int(stats.get("snapshot_bytes", 0))
        return LiveSnapshots(count, nbytes)

    def stats(self) -> list[dict[str, Any] | None]:
        """Each server's statistics (None for a lost one)."""
        out: list[dict[str, Any] | None] = []
        for conn in self._conns:
            try:
                out.append(conn.request({"type": "stats"})["data"] if conn else None)
            except RemoteError:
                out.append(None)
        return out

    def shutdown(self) -> None:
        """Close every connection: the servers release this executor's sessions and snapshots."""
        if self._closed:
            return
        for w, conn in enumerate(self._conns):
            if conn is not None:
                conn.close()
                self._conns[w] = None
        self._pool.shutdown(wait=False)
        for actor in self._actors:
            try:
                import ray

                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        super().shutdown()
        if self._owns_ray:
            import ray

            ray.shutdown()

    # -- Ray ---------------------------------------------------------------------------
    @classmethod
    def on_ray(
        cls,
        env_id: str,
        n_servers: int = 2,
        *,
        env_kwargs: dict[str, Any] | None = None,
        token: str | None = None,
        actor_options: dict[str, Any] | None = None,
        host: str | None = None,
        **kwargs: Any,
    ) -> FleetExecutor:
        """Start ``n_servers`` servers as Ray actors (``ray.init`` first) and connect to them.

        Each actor serves ``env_id`` on its node's address (or ``host``: ``127.0.0.1``
        for a one-machine cluster) and a free port, with ``token`` (a random one when not
        given: the servers may listen beyond loopback). The actors stop with
        :meth:`shutdown`; ``kwargs`` go to :class:`FleetExecutor`.
        """
        try:
            import ray
        except ImportError as exc:
            raise DependencyMissingError.for_extra("FleetExecutor.on_ray", "ray", "ray") from exc
        if n_servers < 1:
            raise ExecutorError(f"n_servers must be >= 1, got {n_servers}")
        owns_ray = not ray.is_initialized()  # then shutdown() stops it too
        if owns_ray:
            ray.init(num_cpus=max(1, os.cpu_count() or 1), include_dashboard=False)
        import secrets

        token = token or secrets.token_hex(16)
        actor = ray.remote(_RayServer).options(**{"num_cpus": 0, **(actor_options or {})})
        actors = [actor.remote(env_id, env_kwargs or {}, token, host) for _ in range(n_servers)]
        urls = ray.get([a.url.remote() for a in actors])
        fleet = cls(urls, token=token, **kwargs)
        fleet._actors = actors
        fleet._owns_ray = owns_ray
        return fleet


class _RayServer:
    """A Ray actor running one ``branchgym serve`` server on a background thread."""

    def __init__(
        self, env_id: str, env_kwargs: dict[str, Any], token: str, host: str | None
    ) -> None:
        from branchgym.serve.server import BranchgymServer, run_server

        if host is None:
            import ray

            host = ray.util.get_node_ip_address()
        probe = socket.socket()
        probe.bind((host, 0))
        port = probe.getsockname()[1]
        probe.close()
        server = BranchgymServer(env_id, env_kwargs, token=token)
        self._url = f"ws://{host}:{port}/ws"
        self._thread = threading.Thread(
            target=run_server, args=(server, host, port), kwargs={"announce": False}, daemon=True
        )
        self._thread.start()
        import time

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until it listens
            try:
                socket.create_connection((host, port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)

    def url(self) -> str:
        return self._url
