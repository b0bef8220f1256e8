"""A served env as a local one: :class:`RemoteEnv` is a ``SnapshottableEnv`` over a WebSocket.

``RemoteEnv("ws://host:port", token=...)`` connects to ``branchgym serve`` and opens one
session there. ``reset``/``step`` go over the wire; ``snapshot()`` returns a
:class:`~branchgym.Snapshot` whose payload is an id the server holds (the state never
crosses the wire), ``restore`` sends the id back. So ``branchgym.check_env``, the fidelity
property suite, ``grow_tree`` and every executor run against a served env unchanged.

Snapshot ids are valid on their own server only: restoring one into a ``RemoteEnv`` of
another server raises :class:`~branchgym.error.ForeignSnapshotError`. With
``portable=True`` snapshots of picklable envs come back as their signed bytes instead
(they pickle, and restore on any server sharing ``$BRANCHGYM_SNAPSHOT_KEY``).

A released snapshot is released on the server (on the next call when released from a
garbage-collector callback); closing the env, or losing the connection, releases every
session and snapshot it had there. Errors the server reports come back typed: a
branchgym error raised by the env is raised as the same class, a refused request as
:class:`~branchgym.error.RemoteError` with the protocol's ``code``. See docs/serving.md.

``gym.make("branchgym.remote:branchgym/Remote-v0", url=..., token=...)`` builds one
through Gymnasium's registry.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import os
import threading
import weakref
from typing import Any

import gymnasium as gym

from branchgym import error as errors
from branchgym.core import Snapshot, SnapshottableEnv, StackSnapshot
from branchgym.error import (
    DependencyMissingError,
    ForeignSnapshotError,
    OptionError,
    RemoteAuthError,
    RemoteError,
    ResetNeededError,
    SnapshotMismatchError,
)
from branchgym.serve.wire import decode, decode_space, encode

__all__ = ["RemoteEnv", "RemoteSnapshotId", "Connection", "raise_remote_error", "URL_ENV"]

#: Environment variable read when ``RemoteEnv()`` is given no URL (``branchgym check``).
URL_ENV = "BRANCHGYM_REMOTE_URL"
_TOKEN_ENV = "BRANCHGYM_SERVE_TOKEN"


@dataclasses.dataclass(frozen=True)
class RemoteSnapshotId:
    """The payload of a snapshot held by a server: which server, and its id there."""

    server_id: str
    snapshot_id: str


def raise_remote_error(data: dict[str, Any]) -> None:
    """Raise the typed error an ``{"type": "error"}`` message describes."""
    code = str(data.get("code", "SESSION_ERROR"))
    message = str(data.get("message", "the server refused the request"))
    if code == "UNAUTHORIZED":
        raise RemoteAuthError(message, code)
    if code in ("FOREIGN_SNAPSHOT", "UNKNOWN_SNAPSHOT"):
        raise ForeignSnapshotError(message)
    if code == "EPISODE_DONE":
        raise ResetNeededError(message)
    name = data.get("error_type")
    cls = getattr(errors, name, None) if isinstance(name, str) else None
    if isinstance(cls, type) and issubclass(cls, errors.Error) and not issubclass(cls, RemoteError):
        try:
            exc = cls(message)
        except Exception:  # an error class with another signature: fall back below
            exc = None
        if exc is not None:
            raise exc
    raise RemoteError(f"{message} [{code}]", code)


def ws_url(url: str) -> str:
    """``ws://host:port/ws`` from ``http(s)://host:port``, ``ws(s)://host:port`` or with ``/ws``."""
    if not isinstance(url, str) or "://" not in url:
        raise OptionError(f"a server URL looks like ws://host:port, got {url!r}")
    scheme, rest = url.split("://", 1)
    scheme = {"http": "ws", "https": "wss"}.get(scheme, scheme)
    if scheme not in ("ws", "wss"):
        raise OptionError(f"a server URL starts with ws://, wss://, http:// or https://: {url!r}")
    rest = rest.rstrip("/")
    if not rest.endswith("/ws"):
        rest += "/ws"
    return f"{scheme}://{rest}"


class Connection:
    """One WebSocket to a server; requests and answers strictly in turn (thread-safe).

    Args:
        url: The server (``ws://host:port``).
        token: Sent as ``Authorization: Bearer <token>``.
        timeout: Seconds to wait for an answer; past it the connection is dropped (the
            server then releases what it held for it) and :class:`RemoteError` raised.
        connect_timeout: Seconds to open the connection.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float | None = 600.0,
        connect_timeout: float = 10.0,
    ) -> None:
        """Connect."""
        try:
            from websockets.sync.client import connect
        except ImportError as exc:
            raise DependencyMissingError.for_extra("RemoteEnv", "serve", "websockets") from exc
        self.url = ws_url(url)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._closed = False
        headers = {"Authorization": f"Bearer {token}"} if token else None
        try:
            self._ws = connect(
                self.url,
                additional_headers=headers,
                open_timeout=connect_timeout,
                max_size=None,
                proxy=None,
                legacy=True,  # a connection held across calls, not a context manager
                compression=None,
            )
        except Exception as exc:
            raise RemoteError(
                f"cannot connect to {self.url} ({type(exc).__name__}: {exc}); is `branchgym "
                "serve` running there?",
                "CONNECTION_FAILED",
            ) from exc

    @property
    def closed(self) -> bool:
        """True once closed, by :meth:`close` or by a lost connection."""
        return self._closed

    def _lost(self, exc: BaseException) -> RemoteError:
        self._closed = True
        try:
            self._ws.close()
        except Exception:  # already gone
            pass
        code = getattr(getattr(exc, "rcvd", None), "code", None)
        if code == 1008:
            return RemoteAuthError(f"the server refused the connection ({exc})", "UNAUTHORIZED")
        if code == 1009:
            return RemoteError(
                f"the server closed the connection: a message was over its size limit ({exc})",
                "MESSAGE_TOO_LARGE",
            )
        return RemoteError(f"connection to {self.url} lost ({type(exc).__name__}: {exc})",
                           "CONNECTION_LOST")  # fmt: skip

    def _exchange(self, text: str) -> dict[str, Any]:
        if self._closed:
            raise RemoteError(f"the connection to {self.url} is closed", "CONNECTION_LOST")
        try:
            try:
                self._ws.send(text)
            except Exception:
                # A refused connection (wrong token, idle timeout) sends its error, then
                # closes; if the close beat this send, the error is still queued: read it.
                pass
            raw = self._ws.recv(timeout=self.timeout)
        except TimeoutError as exc:
            self._lost(exc)
            raise RemoteError(
                f"no answer from {self.url} within {self.timeout} s; the connection was dropped",
                "TIMEOUT",
            ) from exc
        except Exception as exc:
            raise self._lost(exc) from exc
        try:
            return json.loads(raw)
        except (TypeError, ValueError) as exc:
            raise RemoteError(f"the server sent a non-JSON answer: {raw!r:.200}",
                              "INVALID_JSON") from exc  # fmt: skip

    def _flush(self) -> None:
        if self._pending and not self._closed:
            ids, self._pending = self._pending, []
            self._exchange(json.dumps({"type": "release", "data": {"snapshot_ids": ids}}))

    def send_raw(self, text: str) -> dict[str, Any]:
        """Send ``text`` as is and return the answer (tests of the protocol's error paths)."""
        with self._lock:
            self._flush()
            return self._exchange(text)

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one message; returns the answer, or raises the typed error it carries."""
        answer = self.send_raw(json.dumps(message))
        if answer.get("type") == "error":
            raise_remote_error(answer.get("data") or {})
        return answer

    def release_later(self, snapshot_id: str) -> None:
        """Queue a release; sent now unless a request is in flight (then with the next one)."""
        self._pending.append(snapshot_id)
        if self._lock.acquire(blocking=False):
            try:
                self._flush()
            except RemoteError:
                pass  # the connection is gone, and the server released everything with it
            finally:
                self._lock.release()

    def close(self) -> None:
        """Close the connection; the server releases its sessions and snapshots. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._ws.send(json.dumps({"type": "close"}))
        except Exception:  # already gone
            pass
        try:
            self._ws.close()
        except Exception:
            pass


def _release_id(conn_ref: weakref.ref, payload: RemoteSnapshotId) -> None:
    conn = conn_ref()
    if conn is not None and not conn.closed:
        conn.release_later(payload.snapshot_id)


def _observation(answer: dict[str, Any]) -> tuple[Any, float, bool, bool, dict[str, Any]]:
    data = answer.get("data") or {}
    body = data.get("observation") or {}
    reward = data.get("reward")
    return (
        decode(body.get("observation")),
        0.0 if reward is None else float(reward),
        bool(body.get("terminated", False)),
        bool(body.get("truncated", False)),
        decode(body.get("info") or {}),
    )


#: Error codes of a connection the server closed (or that broke), after which a fresh
#: request may reconnect (:meth:`RemoteEnv._fresh_request`).
_REOPEN_CODES = ("IDLE_TIMEOUT", "CONNECTION_LOST")


class RemoteEnv(SnapshottableEnv):
    """An env served by ``branchgym serve``, used as if it were local.

    Args:
        url: The server, ``ws://host:port`` (default: ``$BRANCHGYM_REMOTE_URL``).
        token: The server's token (default: ``$BRANCHGYM_SERVE_TOKEN``).
        portable: Snapshots of picklable envs come back as signed bytes (they pickle
            and restore on any server with the same key) instead of server-held ids.
        timeout: Seconds to wait for each answer.
        connect_timeout: Seconds to connect.

    Attributes:
        server_id: The server's id; its snapshot ids start with it.
        remote_env_id: The env id the server serves.
    """

    metadata = {"render_modes": []}  # noqa: RUF012 - Gymnasium's convention
    snapshot_kind = "remote"

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        portable: bool = False,
        timeout: float | None = 600.0,
        connect_timeout: float = 10.0,
    ) -> None:
        """Connect and read the served env's spaces."""
        super().__init__()
        url = url or os.environ.get(URL_ENV)
        if not url:
            raise OptionError(f"RemoteEnv needs the server's URL: pass url= or set ${URL_ENV}")
        token = token if token is not None else os.environ.get(_TOKEN_ENV)
        self._dial = functools.partial(
            Connection, url, token, timeout=timeout, connect_timeout=connect_timeout
        )
        self._closed_by_user = False
        self.reopened = 0
        info = self._connect()
        self.url = self._conn.url
        self.server_id: str = info["server_id"]
        self.remote_env_id: str = info["env_id"]
        self.default_env_id = info["env_id"]
        self.observation_space = decode_space(info["observation_space"])
        self.action_space = decode_space(info["action_space"])
        # The served env's declarations, read by the fidelity suite and check_env.
        self.snapshot_includes_rng = bool(info.get("snapshot_includes_rng", True))
        self.volatile_info_keys = tuple(info.get("volatile_info_keys", ()))
        self.max_episode_steps = info.get("max_episode_steps")
        self.portable = bool(portable)
        self.session: str | None = None
        self.step_index = 0

    # -- Gymnasium -------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset the served env (``seed`` and ``options`` as Gymnasium's)."""
        super().reset(seed=seed)
        data: dict[str, Any] = {"seed": None if seed is None else int(seed)}
        if options:
            data["options"] = encode(options)
        answer = self._fresh_request({"type": "reset", "data": data})
        self.session = answer.get("session")
        self.step_index = 0
        obs, _, _, _, info = _observation(answer)
        return obs, info

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """Step the served env."""
        answer = self._conn.request({"type": "step", "data": {"action": encode(action)}})
        self.step_index += 1
        return _observation(answer)

    def close(self) -> None:
        """Close the connection: the server releases this env's session and snapshots."""
        self._closed_by_user = True
        self._conn.close()

    def _fresh_request(self, message: dict[str, Any]) -> dict[str, Any]:
        """A request that starts a new episode state (reset, restoring portable bytes).

        It needs nothing the server held for this env, so when the server closed the
        connection in the meantime (its idle timeout, while an executor's pool kept this
        env for later) the env reconnects once and sends it again. Calls that need the
        session (step, snapshot, restoring a server-held id) keep raising: that state is
        gone with the connection.
        """
        if self._closed_by_user:
            raise RemoteError(f"this RemoteEnv of {self.url} was closed", "CONNECTION_LOST")
        if not self._conn.closed:
            try:
                return self._conn.request(message)
            except RemoteError as exc:
                if exc.code not in _REOPEN_CODES:
                    raise
        self._reopen()
        return self._conn.request(message)

    def _connect(self) -> dict[str, Any]:
        """Open the connection (closed when this env is collected); the server's info."""
        self._conn = self._dial()
        self._finalizer = weakref.finalize(self, self._conn.close)
        try:
            return self._conn.request({"type": "info"})["data"]
        except BaseException:
            self._conn.close()
            raise

    def _reopen(self) -> None:
        """A new connection to the same server URL (its snapshot ids may have changed)."""
        self._conn.close()
        self._finalizer.detach()
        info = self._connect()
        self.reopened += 1
        self.server_id = info["server_id"]  # a restarted server has a new one

    # -- snapshots -----------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """Snapshot the served env: an id the server holds (or signed bytes, ``portable``)."""
        d = self._conn.request({"type": "snapshot", "data": {"portable": self.portable}})["data"]
        head = {"env_id": d["env_id"], "spec_hash": d["spec_hash"], "step": d["step"]}
        meta = {"server": self.server_id, "done": d["done"], "steps": d["steps"]}
        if "blob" in d:
            return Snapshot(**head, kind=d["kind"], payload=base64.b64decode(d["blob"]),
                            picklable=True, meta=meta)  # fmt: skip
        ref = RemoteSnapshotId(self.server_id, d["snapshot_id"])
        return Snapshot(
            **head,
            kind=f"{d['kind']}+remote",
            payload=ref,
            picklable=False,
            nbytes=int(d.get("nbytes", 0)),
            on_release=functools.partial(_release_id, weakref.ref(self._conn)),
            meta=meta,
        )

    def restore(self, snapshot: Snapshot) -> tuple[Any, dict[str, Any]]:
        """Restore a snapshot of this server (its id) or a portable one (its bytes)."""
        if not isinstance(snapshot, Snapshot) or isinstance(snapshot, StackSnapshot):
            raise SnapshotMismatchError(
                f"restore() takes the Snapshot this env's snapshot() returned, got "
                f"{type(snapshot).__name__}; restore wrapper-stack snapshots with "
                "branchgym.restore(env, snap)."
            )
        payload = snapshot.payload  # raises SnapshotReleasedError once released
        if isinstance(payload, RemoteSnapshotId):
            if payload.server_id != self.server_id:
                raise ForeignSnapshotError(
                    f"snapshot {payload.snapshot_id!r} is held by server {payload.server_id!r}, "
                    f"but this env is served by {self.server_id!r} ({self.url}): a snapshot id "
                    "is valid on its own server only; restore it there, or take portable "
                    "snapshots (RemoteEnv(portable=True))."
                )
            data: dict[str, Any] = {"snapshot_id": payload.snapshot_id}
        elif isinstance(payload, bytes) and "steps" in snapshot.meta:
            data = {
                "blob": base64.b64encode(payload).decode("ascii"),
                "done": bool(snapshot.meta.get("done", False)),
                "steps": int(snapshot.meta["steps"]),
            }
        else:
            raise SnapshotMismatchError(
                f"a {snapshot.kind!r} snapshot of {snapshot.env_id} was not taken by a served "
                "env; restore it into the kind of env that took it."
            )
        message = {"type": "restore", "data": data}
        if "blob" in data:  # the bytes hold the state: no session needed
            answer = self._fresh_request(message)
        else:
            answer = self._conn.request(message)
        self.session = answer.get("session")
        self.step_index = snapshot.step
        obs, _, _, _, info = _observation(answer)
        return obs, info

    def state_digest(self) -> str:
        """The served stack's ``state_digest``."""
        return self._conn.request({"type": "digest"})["data"]["digest"]

    def reseed(self, seed: int | None) -> None:
        """Reseed the served env's RNG (see :func:`branchgym.core.reseed`)."""
        self._conn.request(
            {"type": "reseed", "data": {"seed": None if seed is None else int(seed)}}
        )

    def live_resources(self) -> dict[str, Any]:
        """The served env's ``live_resources()`` and this connection's live snapshots."""
        return decode(self._conn.request({"type": "resources"})["data"])

    def stats(self) -> dict[str, Any]:
        """The server's statistics (connections, sessions, snapshots, memory)."""
        return self._conn.request({"type": "stats"})["data"]

    @property
    def connection(self) -> Connection:
        """The WebSocket connection (raw protocol access)."""
        return self._conn


gym.register(id="branchgym/Remote-v0", entry_point="branchgym.remote:RemoteEnv")
