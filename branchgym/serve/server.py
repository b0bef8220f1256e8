"""``branchgym serve``: any registered env behind OpenEnv's server stack, plus snapshot and fork.

The app is OpenEnv's: the env is wrapped as an ``openenv`` :class:`Environment`
(:class:`BranchgymEnvironment`) and ``HTTPEnvServer`` registers its routes (``/health``,
``/schema``, ``/metadata``, the stateless ``/reset``, ``/step``, ``/state``). The session
WebSocket ``/ws`` is branchgym's: it speaks OpenEnv's messages (``reset``, ``step``,
``state``, ``close``, validated with OpenEnv's own message models, answered with its
response shapes), so a stock ``openenv`` client works unchanged, and adds:

* ``snapshot`` -> a snapshot id held by the server (no bytes cross the wire; with
  ``{"portable": true}`` a picklable snapshot comes back as its signed bytes instead),
* ``restore`` (an id or signed bytes, into the addressed session), ``fork`` (into a new
  session), ``release``, ``digest``, ``reseed``, ``info``, ``stats``, and ``batch``
  (several calls on distinct sessions, run concurrently).

Every message may name a ``"session"``; without one it addresses the connection's own
session, as in OpenEnv. Snapshots belong to the connection that took it, are valid on
this server only (ids carry the server's id), and are released, with every session of
the connection, when it disconnects. Limits (:class:`ServeLimits`): sessions, live
snapshots per session, idle seconds, message bytes. Bad input gets
``{"type": "error", "data": {"code", "message", "error_type"}}`` and the server goes on.
See docs/serving.md.

Why this module is over 600 lines: the session table, the snapshot store, the message
handlers and the WebSocket loop share one lock and the rule that a connection owns its
sessions and snapshots (released when it goes, counted against its limits); one class
keeps those invariants in one place. The OpenEnv ``Environment`` adapter is
:mod:`branchgym.serve.environment`.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import dataclasses
import hmac
import itertools
import json
import os
import secrets
import socket
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import gymnasium as gym

from branchgym.core import Snapshot, live_snapshots, reseed, state_digest
from branchgym.error import (
    DependencyMissingError,
    Error,
    OptionError,
)
from branchgym.serve.environment import (
    BranchgymAction,
    BranchgymEnvironment,
    BranchgymObservation,
    BranchgymState,
    Refusal,
)
from branchgym.serve.wire import PROTOCOL_VERSION, encode, encode_space

try:
    from fastapi import FastAPI, WebSocket
    from fastapi.responses import JSONResponse
    from openenv.core.env_server.http_server import HTTPEnvServer
    from openenv.core.env_server.serialization import deserialize_action, serialize_observation
    from openenv.core.env_server.types import (
        WSCloseMessage,
        WSErrorResponse,
        WSObservationResponse,
        WSResetMessage,
        WSStateMessage,
        WSStateResponse,
        WSStepMessage,
    )
    from pydantic import ValidationError
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra("branchgym serve", "serve", "openenv") from exc

__all__ = [
    "ServeLimits",
    "BranchgymAction",
    "BranchgymObservation",
    "BranchgymState",
    "BranchgymEnvironment",
    "BranchgymServer",
    "run_server",
    "TOKEN_ENV",
]

#: Environment variable holding the server's token when ``--token`` is not given.
TOKEN_ENV = "BRANCHGYM_SERVE_TOKEN"


@dataclasses.dataclass(frozen=True)
class ServeLimits:
    """What one server allows.

    Attributes:
        max_sessions: Sessions (env instances in use) across every connection.
        max_snapshots_per_session: Live snapshots taken from one session.
        idle_timeout: Seconds a connection may stay silent before it is closed and its
            sessions and snapshots released.
        max_message_bytes: Largest message accepted; a larger one gets
            ``MESSAGE_TOO_LARGE`` (past 4x this the transport closes with code 1009).
    """

    max_sessions: int = 64
    max_snapshots_per_session: int = 1024
    idle_timeout: float = 600.0
    max_message_bytes: int = 16 * 2**20

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_snapshots_per_session", "max_message_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise OptionError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not self.idle_timeout > 0:
            raise OptionError(f"idle_timeout must be positive seconds, got {self.idle_timeout!r}")


# ------------------------------------------------------------------------ the server


@dataclasses.dataclass
class _Session:
    sid: str
    env: BranchgymEnvironment
    conn: _Conn
    taken: int = 0  # live snapshots taken from it
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


@dataclasses.dataclass
class _Held:
    snap: Snapshot
    owner: _Conn
    session: str
    done: bool
    steps: int


@dataclasses.dataclass(eq=False)
class _Conn:
    cid: int
    sessions: dict[str, _Session] = dataclasses.field(default_factory=dict)
    snaps: set[str] = dataclasses.field(default_factory=set)
    primary: str | None = None


_CLOSE = object()


def _rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class BranchgymServer:
    """One served env: its sessions, snapshots, limits and the FastAPI app.

    Args:
        env_id: A registered id (``branchgym/TextTreeMDP-v0``).
        env_kwargs: Keyword arguments of ``branchgym.make``.
        token: Clients must send ``Authorization: Bearer <token>`` (or ``?token=``);
            None: no authentication (loopback use only).
        limits: See :class:`ServeLimits`.
        env_factory: Build instances with this instead of ``branchgym.make``.
    """

    def __init__(
        self,
        env_id: str,
        env_kwargs: dict[str, Any] | None = None,
        *,
        token: str | None = None,
        limits: ServeLimits | None = None,
        env_factory: Callable[[], gym.Env] | None = None,
    ) -> None:
        """Build one instance (to describe the env) and the app."""
        import branchgym

        self.env_id = env_id
        self.env_kwargs = dict(env_kwargs or {})
        self.token = token or None
        self.limits = limits or ServeLimits()
        self._make_env = env_factory or (lambda: branchgym.make(env_id, **self.env_kwargs))
        self.server_id = secrets.token_hex(6)
        self.sessions: dict[str, _Session] = {}
        self.snaps: dict[str, _Held] = {}
        self.free: list[BranchgymEnvironment] = []
        self.conns: set[_Conn] = set()
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pool = ThreadPoolExecutor(
            max_workers=min(32, self.limits.max_sessions + 2), thread_name_prefix="bg-serve"
        )
        probe = self._new_instance()
        self._describe = self._description(probe.env)
        self.free.append(probe)
        self.app = self._build_app()

    # -- instances -----------------------------------------------------------------
    def _new_instance(self) -> BranchgymEnvironment:
        return BranchgymEnvironment(self._make_env, self.env_id)

    def _description(self, env: gym.Env) -> dict[str, Any]:
        from branchgym.core import declares_rng_excluded
        from branchgym.fidelity.checks import volatile_keys

        return {
            "protocol": PROTOCOL_VERSION,
            "server_id": self.server_id,
            "env_id": self.env_id,
            "env_kwargs": encode(self.env_kwargs),
            "observation_space": encode_space(env.observation_space),
            "action_space": encode_space(env.action_space),
            "snapshot_includes_rng": not declares_rng_excluded(env),
            "volatile_info_keys": list(volatile_keys(env)),
            "max_episode_steps": getattr(env.spec, "max_episode_steps", None),
            "limits": dataclasses.asdict(self.limits),
        }

    def _open_session(self, conn: _Conn) -> _Session:
        with self._lock:
            if len(self.sessions) >= self.limits.max_sessions:
                raise Refusal(
                    "CAPACITY_REACHED",
                    f"the server holds its limit of {self.limits.max_sessions} sessions; close "
                    "a session, or start the server with a larger --max-sessions",
                )
            sid = f"{self.server_id}-s{next(self._ids)}"
            env = self.free.pop() if self.free else None
            # reserve the slot before building, outside the lock
            placeholder = _Session(sid, env, conn)  # type: ignore[arg-type]
            self.sessions[sid] = placeholder
            conn.sessions[sid] = placeholder
        if env is None:
            try:
                placeholder.env = self._new_instance()
            except Exception as exc:
                with self._lock:
                    self.sessions.pop(sid, None)
                    conn.sessions.pop(sid, None)
                raise Refusal(
                    "FACTORY_ERROR", f"building {self.env_id} failed: {type(exc).__name__}: {exc}"
                ) from exc
        return placeholder

    def _close_session(self, session: _Session) -> None:
        with self._lock:
            self.sessions.pop(session.sid, None)
            session.conn.sessions.pop(session.sid, None)
            if session.conn.primary == session.sid:
                session.conn.primary = None
            self.free.append(session.env)  # reset or restore overwrites its state

    def _session(self, conn: _Conn, sid: Any, *, create: bool = True) -> _Session:
        if sid is None:
            if conn.primary is None:
                if not create:
                    raise Refusal("UNKNOWN_SESSION", "this connection has no session yet; reset")
                conn.primary = self._open_session(conn).sid
            return conn.sessions[conn.primary]
        if sid == "new":
            return self._open_session(conn)
        if not isinstance(sid, str):
            raise Refusal("VALIDATION_ERROR", f"session must be a string id, got {sid!r}")
        session = conn.sessions.get(sid)
        if session is None:
            where = "another connection" if sid in self.sessions else "no session"
            raise Refusal(
                "UNKNOWN_SESSION",
                f"session {sid!r} is not open on this connection ({where} holds it); use an id "
                "this connection's reset or fork returned",
            )
        return session

    # -- snapshots -------------------------------------------------------------------
    def _lookup(self, snapshot_id: Any) -> _Held:
        if not isinstance(snapshot_id, str):
            raise Refusal(
                "VALIDATION_ERROR",
                f"snapshot_id must be a string, got {type(snapshot_id).__name__}",
            )
        server = snapshot_id.split(":", 1)[0]
        if server != self.server_id:
            raise Refusal(
                "FOREIGN_SNAPSHOT",
                f"snapshot {snapshot_id!r} was taken on server {server!r}, this is server "
                f"{self.server_id!r}: restore it through a connection to the server that "
                "took it, or take portable snapshots (RemoteEnv(portable=True))",
                "ForeignSnapshotError",
            )
        held = self.snaps.get(snapshot_id)
        if held is None:
            raise Refusal(
                "UNKNOWN_SNAPSHOT",
                f"snapshot {snapshot_id!r} is not held by this server: it was released, or the "
                "connection that took it disconnected",
                "ForeignSnapshotError",
            )
        return held

    def _release(self, snapshot_id: str) -> bool:
        with self._lock:
            held = self.snaps.pop(snapshot_id, None)
            if held is None:
                return False
            held.owner.snaps.discard(snapshot_id)
            taker = self.sessions.get(held.session)
            if taker is not None:
                taker.taken -= 1
        held.snap.release()
        return True

    # -- operations (run on the thread pool) -------------------------------------------
    def handle(self, conn: _Conn, msg: Any) -> Any:
        """Answer one decoded message (``_CLOSE`` ends the connection)."""
        if not isinstance(msg, dict):
            raise Refusal("VALIDATION_ERROR", 'a message is a JSON object {"type", "data"}')
        kind = msg.get("type", "")
        op = getattr(self, f"_op_{kind}", None) if isinstance(kind, str) else None
        if op is None or kind == "batch":
            raise Refusal(
                "UNKNOWN_TYPE",
                f"unknown message type {kind!r}; the types are {', '.join(self.message_types())}",
            )
        data = msg.get("data", {})
        if not isinstance(data, dict):
            raise Refusal("VALIDATION_ERROR", "a message's data must be a JSON object")
        self._count(kind)
        return op(conn, msg.get("session"), data, msg)

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    @classmethod
    def message_types(cls) -> list[str]:
        """Every message type this server answers."""
        return sorted(n[4:] for n in dir(cls) if n.startswith("_op_")) + ["batch"]

    @staticmethod
    def _openenv(msg: dict) -> dict:
        """The message without branchgym's ``session`` key, for OpenEnv's own models."""
        return {k: v for k, v in msg.items() if k != "session"}

    def _observation(self, obs: BranchgymObservation, session: _Session) -> dict:
        out = WSObservationResponse(data=serialize_observation(obs)).model_dump()
        out["session"] = session.sid
        return out

    def _locked(self, session: _Session, fn: Callable[[], Any]) -> Any:
        if not session.lock.acquire(blocking=False):
            raise Refusal("SESSION_ERROR", f"session {session.sid} is busy with another call")
        try:
            return fn()
        finally:
            session.lock.release()

    def _op_info(self, conn, sid, data, msg):
        return {"type": "info", "data": self._describe}

    def _op_stats(self, conn, sid, data, msg):
        return {"type": "stats", "data": self.stats()}

    def _op_reset(self, conn, sid, data, msg):
        m = WSResetMessage(**self._openenv(msg))
        session = self._session(conn, sid)
        kwargs = {k: m.data[k] for k in ("seed", "episode_id", "options", "reseed") if k in m.data}
        return self._observation(
            self._locked(session, lambda: session.env.reset(**kwargs)), session
        )

    def _op_step(self, conn, sid, data, msg):
        m = WSStepMessage(**self._openenv(msg))
        action = deserialize_action(m.data, BranchgymAction)
        session = self._session(conn, sid, create=False)
        return self._observation(self._locked(session, lambda: session.env.step(action)), session)

    def _op_state(self, conn, sid, data, msg):
        WSStateMessage(**self._openenv(msg))
        session = self._session(conn, sid)
        return WSStateResponse(data=session.env.state.model_dump()).model_dump()

    def _op_close(self, conn, sid, data, msg):
        if sid is None:
            WSCloseMessage(**self._openenv(msg))
            return _CLOSE
        session = self._session(conn, sid, create=False)
        self._locked(session, lambda: self._close_session(session))
        return {"type": "closed", "session": sid}

    def _op_snapshot(self, conn, sid, data, msg):
        session = self._session(conn, sid, create=False)
        portable = bool(data.get("portable", False))
        if not portable and session.taken >= self.limits.max_snapshots_per_session:
            raise Refusal(
                "SNAPSHOT_LIMIT",
                f"session {session.sid} holds {session.taken} live snapshots, the server's limit; "
                "release some (or raise --max-snapshots)",
            )
        snap = self._locked(session, session.env.snapshot)
        head = {
            "env_id": snap.env_id, "spec_hash": snap.spec_hash, "step": snap.step,
            "kind": snap.kind, "picklable": snap.picklable, "done": session.env.done,
            "steps": session.env.step_count,
        }  # fmt: skip
        if portable and snap.picklable:
            try:
                blob = snap.to_bytes()
            finally:
                snap.release()
            head["blob"] = base64.b64encode(blob).decode("ascii")
            head["nbytes"] = len(blob)
            return {"type": "snapshot", "data": head, "session": session.sid}
        snapshot_id = f"{self.server_id}:{next(self._ids)}"
        with self._lock:
            self.snaps[snapshot_id] = _Held(
                snap, conn, session.sid, session.env.done, session.env.step_count
            )
            conn.snaps.add(snapshot_id)
            session.taken += 1
        head.update(snapshot_id=snapshot_id, nbytes=snap.nbytes)
        return {"type": "snapshot", "data": head, "session": session.sid}

    def _restore_into(self, session: _Session, data: dict) -> BranchgymObservation:
        rs = data.get("reseed")
        if rs is not None and not isinstance(rs, int):
            raise Refusal("VALIDATION_ERROR", f"reseed must be an integer, got {rs!r}")
        if "blob" in data:
            try:
                blob = base64.b64decode(data["blob"], validate=True)
            except (TypeError, ValueError) as exc:
                raise Refusal("VALIDATION_ERROR", f"blob is not base64: {exc}") from exc
            snap = Snapshot.from_bytes(blob)  # signature checked with this server's key
            with snap:
                return session.env.restore(
                    snap, bool(data.get("done", False)), int(data.get("steps", snap.step)), rs
                )
        held = self._lookup(data.get("snapshot_id"))
        return session.env.restore(held.snap, held.done, held.steps, rs)

    def _op_restore(self, conn, sid, data, msg):
        session = self._session(conn, sid)
        obs = self._locked(session, lambda: self._restore_into(session, data))
        return self._observation(obs, session)

    def _op_fork(self, conn, sid, data, msg):
        if "blob" not in data:
            self._lookup(data.get("snapshot_id"))  # refuse before opening a session
        session = self._open_session(conn)
        try:
            obs = self._locked(session, lambda: self._restore_into(session, data))
        except BaseException:
            self._close_session(session)
            raise
        return self._observation(obs, session)

    def _op_release(self, conn, sid, data, msg):
        ids = data.get("snapshot_ids", [data["snapshot_id"]] if "snapshot_id" in data else [])
        if not isinstance(ids, list):
            raise Refusal("VALIDATION_ERROR", "snapshot_ids must be a list of ids")
        for i in ids:
            if isinstance(i, str) and i.split(":", 1)[0] != self.server_id:
                self._lookup(i)  # raises FOREIGN_SNAPSHOT
        released = [i for i in ids if isinstance(i, str) and self._release(i)]
        return {"type": "released", "data": {"released": len(released)}}

    def _op_digest(self, conn, sid, data, msg):
        session = self._session(conn, sid)
        digest = self._locked(session, lambda: state_digest(session.env.env))
        return {"type": "digest", "data": {"digest": digest}, "session": session.sid}

    def _op_reseed(self, conn, sid, data, msg):
        session = self._session(conn, sid)
        seed = data.get("seed")
        if seed is not None and not isinstance(seed, int):
            raise Refusal("VALIDATION_ERROR", f"seed must be an integer or null, got {seed!r}")
        self._locked(session, lambda: reseed(session.env.env, seed))
        return {"type": "reseeded", "session": session.sid}

    def _op_resources(self, conn, sid, data, msg):
        session = self._session(conn, sid)
        fn = getattr(session.env.env.unwrapped, "live_resources", None)
        res = dict(fn()) if callable(fn) else {}
        res["snapshots"] = len(conn.snaps)
        return {"type": "resources", "data": encode(res), "session": session.sid}

    # -- connections -------------------------------------------------------------------
    def _new_conn(self) -> _Conn:
        conn = _Conn(next(self._ids))
        with self._lock:
            self.conns.add(conn)
        return conn

    def drop_connection(self, conn: _Conn) -> None:
        """Release every snapshot and session of ``conn`` (it disconnected)."""
        for snapshot_id in list(conn.snaps):
            self._release(snapshot_id)
        for session in list(conn.sessions.values()):
            self._close_session(session)
        with self._lock:
            self.conns.discard(conn)

    def stats(self) -> dict[str, Any]:
        """Connections, sessions, snapshots and memory of this server."""
        with self._lock:
            nbytes = sum(h.snap.nbytes for h in self.snaps.values())
            return {
                "server_id": self.server_id,
                "env_id": self.env_id,
                "connections": len(self.conns),
                "sessions": len(self.sessions),
                "snapshots": len(self.snaps),
                "snapshot_bytes": nbytes,
                "instances": len(self.sessions) + len(self.free),
                "live_snapshot_objects": live_snapshots().count,
                "rss_bytes": _rss_bytes(),
                "messages": dict(self.counts),
            }

    def shutdown(self) -> None:
        """Release everything and close every instance."""
        for conn in list(self.conns):
            self.drop_connection(conn)
        with self._lock:
            free, self.free = self.free, []
        for env in free:
            try:
                env.close()
            except Exception:  # a broken instance may fail to close; it is gone either way
                pass
        self._pool.shutdown(wait=False)

    # -- the app --------------------------------------------------------------------------
    def _error(self, exc: BaseException) -> dict:
        if isinstance(exc, Refusal):
            data = {"message": str(exc), "code": exc.code}
            if exc.error_type:
                data["error_type"] = exc.error_type
        elif isinstance(exc, ValidationError):
            data = {
                "message": f"invalid message: {exc.error_count()} validation error(s)",
                "code": "VALIDATION_ERROR",
                "errors": json.loads(exc.json()),
            }
        else:
            data = {
                "message": f"{type(exc).__name__}: {exc}",
                "code": "EXECUTION_ERROR",
                "error_type": type(exc).__name__ if isinstance(exc, Error) else None,
            }
        self._count("errors")
        return WSErrorResponse(data=data).model_dump()

    async def _answer(self, conn: _Conn, msg: Any) -> Any:
        loop = asyncio.get_running_loop()
        if isinstance(msg, dict) and msg.get("type") == "batch":
            calls = (msg.get("data") or {}).get("calls")
            if not isinstance(calls, list):
                return self._error(Refusal("VALIDATION_ERROR", "batch data needs a calls list"))
            self._count("batch")
            results = await asyncio.gather(*(self._answer(conn, c) for c in calls))
            results = [{"type": "closed"} if r is _CLOSE else r for r in results]
            return {"type": "batch", "data": {"results": results}}
        try:
            return await loop.run_in_executor(self._pool, self.handle, conn, msg)
        except Exception as exc:  # every failure is an answer; the server goes on
            return self._error(exc)

    def _authorized(self, headers: dict[bytes, bytes], query: bytes) -> bool:
        if self.token is None:
            return True
        auth = headers.get(b"authorization", b"").decode("latin-1")
        given = auth[7:] if auth.lower().startswith("bearer ") else ""
        if not given:
            from urllib.parse import parse_qs

            given = (parse_qs(query.decode("latin-1")).get("token") or [""])[0]
        return hmac.compare_digest(given.encode(), self.token.encode())

    async def _ws(self, websocket: WebSocket) -> None:
        await websocket.accept()
        if not self._authorized(dict(websocket.scope["headers"]), websocket.scope["query_string"]):
            self._count("unauthorized")
            err = Refusal(
                "UNAUTHORIZED",
                "missing or wrong token: send the header 'Authorization: Bearer <token>' "
                f"(the server's --token or ${TOKEN_ENV})",
                "RemoteAuthError",
            )
            await websocket.send_text(json.dumps(self._error(err)))
            await websocket.close(code=1008)
            return
        conn = self._new_conn()
        limit = self.limits.max_message_bytes
        try:
            while True:
                try:
                    event = await asyncio.wait_for(websocket.receive(), self.limits.idle_timeout)
                except asyncio.TimeoutError:
                    err = Refusal(
                        "IDLE_TIMEOUT",
                        f"no message for {self.limits.idle_timeout} s: the connection is closed "
                        "and its sessions and snapshots released",
                    )
                    await websocket.send_text(json.dumps(self._error(err)))
                    break
                if event["type"] == "websocket.disconnect":
                    break
                raw = event.get("text")
                if raw is None:
                    raw = (event.get("bytes") or b"").decode("utf-8", "replace")
                if len(raw) > limit:
                    err = Refusal(
                        "MESSAGE_TOO_LARGE",
                        f"message of {len(raw)} bytes is over the server's limit of {limit}; "
                        "send less (no snapshot bytes need cross the wire: use snapshot ids)",
                    )
                    await websocket.send_text(json.dumps(self._error(err)))
                    continue
                try:
                    msg = json.loads(raw)
                except json.JSONDecodeError as exc:
                    err = Refusal("INVALID_JSON", f"invalid JSON: {exc}")
                    await websocket.send_text(json.dumps(self._error(err)))
                    continue
                answer = await self._answer(conn, msg)
                if answer is _CLOSE:
                    break
                await websocket.send_text(json.dumps(answer))
        except Exception:  # a broken socket: fall through to the release
            pass
        finally:
            await asyncio.get_running_loop().run_in_executor(self._pool, self.drop_connection, conn)
            try:
                await websocket.close()
            except Exception:  # already closed by the peer
                pass

    def _build_app(self) -> FastAPI:
        app = FastAPI(title=f"branchgym serve {self.env_id}", docs_url="/docs")
        # Registered before OpenEnv's routes, so this session WebSocket answers /ws.
        app.add_api_websocket_route("/ws", self._ws)

        @app.get("/branchgym/stats")
        def stats() -> dict[str, Any]:
            return self.stats()

        @app.get("/branchgym/info")
        def info() -> dict[str, Any]:
            return self._describe

        HTTPEnvServer(
            self._new_instance,
            BranchgymAction,
            BranchgymObservation,
            max_concurrent_envs=1,  # its own session table is unused: /ws is ours
            env_name=self.env_id.replace("/", "_"),
            state_cls=BranchgymState,
        ).register_routes(app)
        app.router.on_shutdown.append(self.shutdown)
        server = self

        class TokenGate:
            """Refuse HTTP requests without the token (``/health`` stays open)."""

            def __init__(self, inner: Any) -> None:
                self.inner = inner

            async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
                if scope["type"] == "http" and scope["path"] != "/health":
                    if not server._authorized(dict(scope["headers"]), scope["query_string"]):
                        body = server._error(
                            Refusal("UNAUTHORIZED", "missing or wrong token", "RemoteAuthError")
                        )
                        await JSONResponse(body, status_code=401)(scope, receive, send)
                        return
                await self.inner(scope, receive, send)

        app.add_middleware(TokenGate)
        return app


def run_server(
    server: BranchgymServer, host: str = "127.0.0.1", port: int = 0, *, announce: bool = True
) -> None:
    """Serve until interrupted; prints ``serving ENV on ws://HOST:PORT/ws`` once listening."""
    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(256)
    bound = sock.getsockname()[1]
    config = uvicorn.Config(
        server.app,
        log_level=os.environ.get("BRANCHGYM_SERVE_LOG", "warning"),
        ws_max_size=4 * server.limits.max_message_bytes,
        lifespan="on",
    )
    if announce:
        where = f"[{host}]" if ":" in host else host
        print(f"serving {server.env_id} on ws://{where}:{bound}/ws", flush=True)
        sys.stdout.flush()
    uvicorn.Server(config).run(sockets=[sock])
