"""Snapshot bytes as data: a restricted unpickler, and signatures with a per-run key.

Snapshot bytes (``Snapshot.to_bytes()``, and every snapshot an executor ships to another
process) are pickles, but they are never loaded with :func:`pickle.loads`:

* **Only allowed types load.** :class:`SafeUnpickler` resolves a global only if it is in
  :data:`SAFE_GLOBALS` (plain containers, numpy arrays and generators, branchgym's own
  snapshot classes), is a snapshot handle class (a :class:`SnapshotHandle` subclass, as
  every :class:`~branchgym.core.Snapshot` is) or was registered by an env author with
  :func:`register_snapshot_types`. A crafted payload that names ``os.system``,
  ``builtins.eval``, ``subprocess.Popen`` or any other callable is refused with
  :class:`~branchgym.error.SnapshotUntrustedError` before anything runs.
* **Bytes are signed.** An HMAC-SHA256 with the run's key (:func:`run_key`) covers every
  byte; bytes that were changed, or signed with another key, are refused. The key comes
  from ``$BRANCHGYM_SNAPSHOT_KEY`` (hex, at least 32 bytes) or is drawn at random when
  branchgym is first imported and exported to that variable, so worker processes that
  this process starts share it. To load snapshot bytes in another run or on another
  host, give both the same secret key (``BRANCHGYM_SNAPSHOT_KEY=$(openssl rand -hex 32)``).

What is trusted: the code of the env and its registered state types, and whoever holds
the key. What is not: the bytes themselves (a file, a message from a worker, a snapshot
store). An env whose state holds functions (cloudpickled lambdas) needs code inside its
snapshots: such payloads load only through ``PickleSnapshot``'s allowance for its own
env's types (see :func:`globals_of`), and are as safe as the key that signed them.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import io
import os
import pickle
import secrets
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from branchgym.error import SnapshotUntrustedError

__all__ = [
    "SAFE_GLOBALS",
    "SnapshotHandle",
    "SafeUnpickler",
    "safe_loads",
    "register_snapshot_types",
    "globals_of",
    "run_key",
    "sign",
    "verify",
    "signing_key",
    "KEY_ENV",
]

#: The environment variable that holds the run's signing key (hex).
KEY_ENV = "BRANCHGYM_SNAPSHOT_KEY"

#: ``(module, qualified name)`` of every global a snapshot may reference by default.
SAFE_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        # plain data
        *(
            ("builtins", n)
            for n in (
                "set",
                "frozenset",
                "bytearray",
                "complex",
                "object",
                "list",
                "dict",
                "tuple",
                "int",
                "float",
                "str",
                "bool",
                "bytes",
            )
        ),  # fmt: skip
        ("collections", "OrderedDict"),
        ("collections", "deque"),
        ("collections", "defaultdict"),
        ("collections", "Counter"),
        ("copyreg", "_reconstructor"),
        ("datetime", "datetime"),
        ("datetime", "date"),
        ("datetime", "timedelta"),
        ("random", "Random"),
        # numpy arrays, scalars, dtypes and generators (numpy 1 and 2 module paths)
        *(
            (mod, name)
            for mod in ("numpy.core.multiarray", "numpy._core.multiarray")
            for name in ("_reconstruct", "scalar")
        ),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        *(
            ("numpy.random._pickle", n)
            for n in ("__generator_ctor", "__bit_generator_ctor", "__randomstate_ctor")
        ),
        *(("numpy.random", n) for n in ("Generator", "RandomState")),
        *(("numpy.random._pcg64", n) for n in ("PCG64", "PCG64DXSM")),
        ("numpy.random._mt19937", "MT19937"),
        ("numpy.random._philox", "Philox"),
        ("numpy.random._sfc64", "SFC64"),
        # branchgym's snapshot handles
        ("branchgym.core", "_rebuild_snapshot"),
        ("branchgym.core", "Snapshot"),
        ("branchgym.core", "StackSnapshot"),
    }
)

_REGISTERED: set[tuple[str, str]] = set()
_LOCK = threading.Lock()


class SnapshotHandle:
    """The base of every snapshot handle class: :class:`~branchgym.core.Snapshot` derives it.

    Subclasses of a module already imported load by name (see :class:`SafeUnpickler`).
    It lives here, under :mod:`branchgym.core`, so that this module never imports the
    snapshot protocol it serves. Subclass :class:`~branchgym.core.Snapshot`, never this.
    """

    __slots__ = ()


def register_snapshot_types(*objs: Any) -> None:
    """Allow classes (or functions) in snapshot bytes: an env author's state types.

    Register only plain data types (dataclasses, named tuples, enums): whatever is
    registered can be constructed from untrusted bytes with arguments an attacker picks.
    Never register a class whose constructor or ``__setstate__`` has effects outside the
    object (files, processes, network).
    """
    with _LOCK:
        for obj in objs:
            module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
            if not isinstance(module, str) or not isinstance(name, str) or "<" in name:
                raise TypeError(
                    f"register_snapshot_types takes module-level classes or functions, got {obj!r}"
                )
            _REGISTERED.add((module, name))


class SafeUnpickler(pickle.Unpickler):
    """An unpickler that resolves only allowed globals (see the module docstring)."""

    def __init__(self, file: Any, allowed: Iterable[tuple[str, str]] = ()) -> None:
        """Read from ``file``; ``allowed`` adds globals for this load only."""
        super().__init__(file)
        self.allowed = frozenset(allowed)

    def find_class(self, module: str, name: str) -> Any:
        """The global, if allowed; otherwise :class:`SnapshotUntrustedError`."""
        key = (module, name)
        if key in SAFE_GLOBALS or key in _REGISTERED or key in self.allowed:
            return super().find_class(module, name)
        if _is_snapshot_class(module, name):
            return super().find_class(module, name)
        raise SnapshotUntrustedError(
            f"snapshot bytes reference {module}.{name}, which is not an allowed snapshot "
            "type; nothing was run. If it is your env's state type, register it with "
            f"branchgym.register_snapshot_types({name.split('.')[-1]})."
        )

    def persistent_load(self, pid: Any) -> Any:
        """Persistent ids are never part of snapshot bytes."""
        raise SnapshotUntrustedError("snapshot bytes use a persistent id; refused")


def _is_snapshot_class(module: str, name: str) -> bool:
    """A :class:`SnapshotHandle` subclass (every Snapshot is one) of a module already imported.

    Snapshot handles of wrapper layers (an env author's ``Snapshot`` subclass) are
    rebuilt by ``_rebuild_snapshot``, which never calls their constructor. The module is
    looked up, never imported: naming a module must not run its import-time code.
    """
    mod = sys.modules.get(module)
    if mod is None or "." in name:
        return False
    obj = getattr(mod, name, None)
    return isinstance(obj, type) and issubclass(obj, SnapshotHandle)


def safe_loads(blob: bytes, allowed: Iterable[tuple[str, str]] = ()) -> Any:
    """:func:`pickle.loads` through :class:`SafeUnpickler`.

    Raises:
        SnapshotUntrustedError: the bytes reference a global that is not allowed.
        pickle.UnpicklingError, EOFError, ...: the bytes are not a pickle.
    """
    return SafeUnpickler(io.BytesIO(blob), allowed).load()


class _Recorder(pickle.Unpickler):
    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self.seen: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.seen.add((module, name))
        return super().find_class(module, name)


def globals_of(blob: bytes) -> frozenset[tuple[str, str]]:
    """The globals a pickle made *by this process* references (it is loaded to find them).

    Only for bytes this process just produced from its own objects: loading runs what
    they reference.
    """
    rec = _Recorder(io.BytesIO(blob))
    rec.load()
    return frozenset(rec.seen)


# ---------------------------------------------------------------------------- signing

_KEY: bytes | None = None


def run_key() -> bytes:
    """This run's signing key: ``$BRANCHGYM_SNAPSHOT_KEY``, or a random one exported there."""
    global _KEY
    with _LOCK:
        env = os.environ.get(KEY_ENV)
        if env:
            try:
                key = bytes.fromhex(env)
            except ValueError:
                key = b""
            if len(key) < 32:
                raise SnapshotUntrustedError(
                    f"${KEY_ENV} must be at least 32 bytes of hex (64 hex digits), e.g. "
                    "the output of `openssl rand -hex 32`"
                )
            _KEY = key
        elif _KEY is None:
            _KEY = secrets.token_bytes(32)
            os.environ[KEY_ENV] = _KEY.hex()  # workers started from here inherit it
        return _KEY


_OVERRIDE: contextvars.ContextVar[bytes | None] = contextvars.ContextVar(
    "branchgym_snapshot_key", default=None
)


@contextlib.contextmanager
def signing_key(key: bytes | None) -> Iterator[bytes]:
    """Use ``key`` (default: the run key) for signatures checked inside this block."""
    key = key if key is not None else current_key()
    token = _OVERRIDE.set(key)
    try:
        yield key
    finally:
        _OVERRIDE.reset(token)


def current_key() -> bytes:
    """The key in force: one set by :func:`signing_key`, else :func:`run_key`."""
    return _OVERRIDE.get() or run_key()


def sign(body: bytes, key: bytes | None = None) -> bytes:
    """HMAC-SHA256 of ``body`` (32 bytes)."""
    return hmac.new(key or current_key(), body, hashlib.sha256).digest()


def verify(body: bytes, tag: bytes, key: bytes | None = None) -> bool:
    """Whether ``tag`` is ``body``'s signature under ``key`` (constant time)."""
    return isinstance(tag, bytes) and hmac.compare_digest(sign(body, key), tag)


run_key()  # draw (or read) the key now, before any worker process is started
