"""The snapshot protocol: :class:`Snapshot`, :class:`SnapshottableEnv` and the wrapper stack.

Two operators carry every guarantee of the branching learners (docs/algorithms.md,
section 0): ``snap: S -> Sigma`` and ``rest: Sigma -> S``, with ``rest(snap(s))``
behaving exactly like ``s``. This module defines them for Gymnasium:

* :class:`Snapshot` is the opaque handle. It knows which env spec took it, at which step,
  how (``kind``), how big it is and whether it pickles; it is released explicitly or by
  context manager, and a released snapshot cannot be restored.
* :class:`SnapshottableEnv` is the environment side. Implement ``_get_state`` and
  ``_set_state`` (or override ``snapshot``/``restore`` for external resources).
* :func:`snapshot`, :func:`restore` and :func:`state_digest` work on a whole wrapper stack
  as ``gym.make`` returns it: the state of Gymnasium's stateful wrappers (TimeLimit's step
  counter, OrderEnforcing, RecordEpisodeStatistics, ...) is part of the snapshot, and a
  wrapper whose state is unknown makes ``snapshot`` fail loudly.
* :class:`SnapshotAPI` is the outermost wrapper branchgym's registrations add, so that
  ``env.snapshot()`` works directly on what ``gym.make`` returns.

What each wrapper holds (the wrapper-state declarations and Gymnasium's table) is
:mod:`branchgym.wrapper_state`; the stack operations here read it.

Why this module is over 600 lines: the snapshot handle, the env protocol, the identity
checks and the wrapper-stack operations share :class:`Snapshot`/:class:`StackSnapshot`,
and together are the protocol the rest builds on; kept together, its invariants
(release, identity, layer order) read in one place. The sections are marked.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import threading
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

import gymnasium as gym
import numpy as np

from branchgym import serialization
from branchgym.digest import stable_hash
from branchgym.error import (
    SnapshotCorruptError,
    SnapshotMismatchError,
    SnapshotNotPicklableError,
    SnapshotNotSupportedError,
    SnapshotReleasedError,
    SnapshotUntrustedError,
)
from branchgym.sizes import owned_sizeof
from branchgym.wrapper_state import (
    capture_wrapper_state,
    class_path,
    declare_stateless,
    read_wrapper_state,
    walk_wrappers,
    wrapper_state_handler,
)

__all__ = [
    "Snapshot",
    "StackSnapshot",
    "SnapshottableEnv",
    "SnapshotWrapper",
    "SnapshotAPI",
    "snapshot",
    "restore",
    "state_digest",
    "reseed",
    "spec_identity",
    "stack_identity",
    "open_snapshot",
    "declares_rng_excluded",
    "live_snapshots",
    "LiveSnapshots",
    "SNAPSHOT_KINDS",
]

ObsType = TypeVar("ObsType")
ActType = TypeVar("ActType")

#: Known snapshot kinds, cheapest restore first. ``replay`` costs grow with depth.
SNAPSHOT_KINDS = ("state", "pickle", "overlay", "git", "container", "pddl", "replay")


# --------------------------------------------------------------------------- snapshots

_LIVE: weakref.WeakSet[Snapshot] = weakref.WeakSet()


@dataclasses.dataclass(frozen=True)
class LiveSnapshots:
    """How many snapshots are alive (not released, not garbage-collected) and their bytes."""

    count: int
    nbytes: int


def live_snapshots() -> LiveSnapshots:
    """Count the unreleased snapshots of this process (stack views are not double-counted)."""
    snaps = [s for s in list(_LIVE) if not s.released]
    return LiveSnapshots(len(snaps), sum(s.nbytes for s in snaps))


def _run_release(callback: Callable[[Any], None] | None, payload: Any) -> None:
    if callback is not None:
        callback(payload)


def _verify_bytes(blob: bytes, tag: bytes | None, key: bytes | None = None) -> Any:
    """Load a payload that crossed a process boundary: signature first, then allowed types."""
    if tag is not None and not serialization.verify(blob, tag, key):
        raise SnapshotUntrustedError(
            "snapshot payload failed its signature: the bytes were changed after the snapshot "
            "was taken, or were signed with another run's key. Take a new snapshot; to move "
            f"snapshots between runs or hosts, give both the same ${serialization.KEY_ENV}."
        )
    try:
        with serialization.signing_key(key):  # nested snapshots carry the same key
            return serialization.safe_loads(blob)
    except SnapshotUntrustedError:
        raise
    except Exception as exc:
        raise SnapshotCorruptError(f"snapshot payload cannot be loaded ({exc}).") from exc


class Snapshot(serialization.SnapshotHandle):
    """An opaque handle on a saved environment state.

    Attributes:
        env_id: Id of the env spec that took it (``branchgym/TreeMDP-v0``).
        spec_hash: Stable hash of the spec's kwargs; restore checks it.
        step: Steps taken in the episode when the snapshot was taken.
        kind: How the state is held: ``state`` (an in-memory copy of a small state
            object), ``pickle``, ``replay`` (reset + actions, cost grows with depth),
            ``overlay``, ``git``, ``container``, ``pddl``; envs may qualify it
            (``state+fast``).
        picklable: Whether ``pickle.dumps`` works and the result restores in any
            instance built from the same spec, in any process.
        foreign: The snapshot was rebuilt from bytes (another process, ``from_bytes``):
            its payload loads through the restricted unpickler.

    Use it as a context manager, or call :meth:`release` as soon as its siblings are done:
    a snapshot may own external resources (overlay dirs, images, containers).
    """

    _counted: ClassVar[bool] = True

    def __init__(
        self,
        *,
        env_id: str,
        spec_hash: str,
        step: int,
        kind: str,
        payload: Any,
        picklable: bool,
        nbytes: int | Callable[[], int] | None = None,
        on_release: Callable[[Any], None] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        """Create a handle; env implementations call this, users never need to."""
        self.env_id = env_id
        self.spec_hash = spec_hash
        self.step = int(step)
        self.kind = kind
        self.picklable = bool(picklable)
        self.meta: dict[str, Any] = dict(meta or {})
        self.foreign = False
        self._payload = payload
        # (bytes, signature or None once verified, key) of a payload that crossed a process
        # boundary: loaded lazily, at first use of .payload.
        self._blob: tuple[bytes, bytes | None, bytes | None] | None = None
        self._nbytes = nbytes
        self._released = False
        self._lock = threading.Lock()
        self._finalizer = (
            weakref.finalize(self, _run_release, on_release, payload) if on_release else None
        )
        if self._counted:
            _LIVE.add(self)

    # -- lifecycle ----------------------------------------------------------------
    @property
    def released(self) -> bool:
        """True once :meth:`release` ran."""
        return self._released

    def release(self) -> None:
        """Free the snapshot and any resource it owns. Idempotent."""
        with self._lock:
            if self._released:
                return
            self._released = True
            self._payload = None
            self._blob = None
        if self._finalizer is not None:
            self._finalizer()  # runs on_release exactly once
        _LIVE.discard(self)

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # -- payload --------------------------------------------------------------------
    @property
    def payload(self) -> Any:
        """The env-specific saved state. Raises if released or damaged."""
        if self._released:
            raise SnapshotReleasedError(
                f"this {self.kind!r} snapshot of {self.env_id} (step {self.step}) was released; "
                "take a new snapshot, or release snapshots only after their last restore."
            )
        if self._blob is not None:
            blob, tag, key = self._blob
            self._payload = _verify_bytes(blob, tag, key)
            self._blob = None
        return self._payload

    @property
    def nbytes(self) -> int:
        """Memory this snapshot keeps alive, in bytes, measured once at first access.

        Unless the env states its own figure (SWE-bench: the sandbox layer on disk), this
        is :func:`~branchgym.sizes.owned_sizeof` of the handle and its payload: every
        object only the snapshot references, headers included, so what releasing it
        frees (80-95 % of what ``tracemalloc`` measures on the built-in envs; the rest is
        allocator overhead). Objects shared with
        the live env or other snapshots are not counted. The pickled size is
        :attr:`wire_nbytes`.
        """
        if self._released:
            return 0
        if callable(self._nbytes):
            self._nbytes = int(self._nbytes())
        if self._nbytes is None:
            self._nbytes = owned_sizeof(self)
        return int(self._nbytes)

    @property
    def wire_nbytes(self) -> int:
        """Size of the payload's bytes when it crosses a process boundary (pickle 5)."""
        if self._released:
            return 0
        if self._blob is not None:
            return len(self._blob[0])
        try:
            return len(pickle.dumps(self._payload, protocol=5))
        except Exception:  # noqa: BLE001 - an unpicklable payload never crosses
            return 0

    # -- pickling -----------------------------------------------------------------
    def __reduce__(self):
        if self._released:
            raise SnapshotReleasedError(
                f"cannot pickle a released snapshot of {self.env_id}; pickle it before release()."
            )
        if not self.picklable:
            raise SnapshotNotPicklableError(
                f"a {self.kind!r} snapshot of {self.env_id} owns live resources and cannot be "
                "pickled; restore it in this process, or use the env's portable snapshot mode."
            )
        if self._blob is not None:  # its signature was checked when it was rebuilt
            blob = self._blob[0]
        else:
            blob = pickle.dumps(self._payload, protocol=5)
        header = (self.env_id, self.spec_hash, self.step, self.kind, self.meta)
        # The payload is signed with the key in force (the run's): whoever loads it checks.
        return (_rebuild_snapshot, (type(self), header, blob, serialization.sign(blob)))

    def to_bytes(self) -> bytes:
        """Serialise (picklable snapshots only): signed with the run's key.

        The bytes load only where the same key is in force (this run, its workers, or any
        process given the same ``$BRANCHGYM_SNAPSHOT_KEY``), and only through the
        restricted unpickler of :mod:`branchgym.serialization`.
        """
        body = pickle.dumps(self, protocol=5)
        return _MAGIC + serialization.sign(body) + body

    @staticmethod
    def from_bytes(data: bytes, *, key: bytes | None = None) -> Snapshot:
        """Inverse of :meth:`to_bytes`. Nothing in the bytes runs.

        Args:
            data: The exact output of :meth:`to_bytes`.
            key: The signing key of the run that made them (default: this run's).

        Raises:
            SnapshotCorruptError: not snapshot bytes, or damaged.
            SnapshotUntrustedError: signed with another key, modified, or referencing a
                type that is not allowed (see :func:`branchgym.register_snapshot_types`).
        """
        if not isinstance(data, bytes | bytearray | memoryview):
            raise SnapshotCorruptError(
                f"expected the bytes from Snapshot.to_bytes(), got {type(data).__name__}"
            )
        data = bytes(data)
        if data.startswith(_MAGIC_V1):
            raise SnapshotUntrustedError(
                "these snapshot bytes are in the unsigned format of an older branchgym, which "
                "could run code when loaded; take the snapshot again with this version."
            )
        if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + 32:
            raise SnapshotCorruptError(
                "these bytes are not a branchgym snapshot (bad header); pass the exact output "
                "of Snapshot.to_bytes()."
            )
        tag, body = data[len(_MAGIC) : len(_MAGIC) + 32], data[len(_MAGIC) + 32 :]
        snap = _verify_bytes(body, tag, key)
        if not isinstance(snap, Snapshot):
            raise SnapshotCorruptError(f"bytes hold a {type(snap).__name__}, not a Snapshot")
        return snap

    def __repr__(self) -> str:
        state = "released" if self._released else f"{self.nbytes} B"
        return f"<Snapshot {self.env_id} step={self.step} kind={self.kind} {state}>"


_MAGIC_V1 = b"BGSNAP1\x00"
_MAGIC = b"BGSNAP2\x00"


def _rebuild_snapshot(cls: type[Snapshot], header: tuple, blob: bytes, tag: bytes) -> Snapshot:
    """Rebuild a snapshot that crossed a process boundary (its payload stays bytes)."""
    if not (isinstance(cls, type) and issubclass(cls, Snapshot)):
        raise SnapshotUntrustedError(f"snapshot bytes rebuild a {cls!r}, not a Snapshot class")
    if not isinstance(blob, bytes) or not isinstance(tag, bytes):
        raise SnapshotCorruptError("snapshot bytes have a malformed payload")
    try:
        env_id, spec_hash, step, kind, meta = header
    except (TypeError, ValueError) as exc:
        raise SnapshotCorruptError("snapshot bytes have a malformed header") from exc
    key = serialization.current_key()
    if not serialization.verify(blob, tag, key):
        raise SnapshotUntrustedError(
            "snapshot payload failed its signature: changed after it was taken, or signed "
            f"with another run's key (give both runs the same ${serialization.KEY_ENV})."
        )
    snap = cls.__new__(cls)
    Snapshot.__init__(
        snap,
        env_id=env_id,
        spec_hash=spec_hash,
        step=step,
        kind=kind,
        payload=None,
        picklable=True,
        meta=meta,
    )
    # Signature checked; loaded (restricted unpickler) at first use of .payload. The key
    # is kept for snapshots nested inside (a stack's inner snapshot).
    snap._blob = (blob, None, None if key == serialization.run_key() else key)
    snap.foreign = True
    return snap


class StackSnapshot(Snapshot):
    """A snapshot of a wrapper stack: wrapper states (outer to inner) over an inner snapshot.

    Its metadata are the inner snapshot's; releasing it releases the inner one.
    """

    _counted = False  # the inner snapshot is the one counted as live

    def __init__(self, inner: Snapshot, layers: tuple[tuple[str, Any], ...]) -> None:
        """Wrap ``inner`` with the captured ``layers`` (``(class path, state)`` pairs)."""
        super().__init__(
            env_id=inner.env_id,
            spec_hash=inner.spec_hash,
            step=inner.step,
            kind=inner.kind,
            payload=(layers, inner),
            picklable=inner.picklable,
            meta=inner.meta,
        )
        # This view and its wrapper states, plus what the inner snapshot holds by its own
        # measure (a weak reference: the handle must not keep itself alive).
        view = weakref.ref(self)
        self._nbytes = lambda: owned_sizeof(view(), exclude=(inner,)) + inner.nbytes

    @property
    def released(self) -> bool:
        """True once this view or its inner snapshot was released (e.g. by ``env.close()``)."""
        if self._released:
            return True
        payload = self._payload
        return payload is not None and payload[1].released

    @property
    def inner(self) -> Snapshot:
        """The snapshot of the innermost snapshot-capable layer."""
        return self.payload[1]

    @property
    def layers(self) -> tuple[tuple[str, Any], ...]:
        """``(wrapper class path, captured state)`` from outermost to innermost."""
        return self.payload[0]

    def release(self) -> None:
        """Release the stack view and its inner snapshot."""
        try:
            inner = None if self._released else self.payload[1]
        except SnapshotCorruptError:
            inner = None
        super().release()
        if inner is not None:
            inner.release()


# ------------------------------------------------------------------------ env protocol


# ------------------------------------------------------------------ snapshot identity
#
# A snapshot is stamped with ``(env_id, spec_hash)`` when it is taken and restores only
# where the same pair is computed. These three functions are the one place the pair is
# computed and checked: SnapshottableEnv, PickleSnapshot and ReplaySnapshot all use them.


def spec_identity(env_id: str, config: Any) -> tuple[str, str]:
    """``(env_id, spec_hash)``: ``config`` (spec kwargs) hashed with :func:`stable_hash`.

    A config holding values without a canonical encoding hashes its ``repr`` instead
    (a dict's items sorted by key, as :func:`stable_hash` orders mappings).
    """
    try:
        return env_id, stable_hash(config)
    except TypeError:
        if isinstance(config, dict):
            config = sorted(config.items(), key=lambda kv: kv[0])
        return env_id, stable_hash(repr(config))


def stack_identity(env: gym.Env) -> tuple[str, str]:
    """The identity of the base env below ``env``: its spec id and kwargs.

    Used by wrappers that snapshot a whole stack (``PickleSnapshot``, ``ReplaySnapshot``);
    a base env built without ``gym.make`` is named by its class.
    """
    base = env.unwrapped
    spec = base.spec
    if spec is not None:
        return spec_identity(spec.id, dict(spec.kwargs))
    return spec_identity(f"{type(base).__module__}:{type(base).__qualname__}", {})


def open_snapshot(snapshot: Any, identity: tuple[str, str], *, kind: str | None = None) -> Any:
    """Check that ``snapshot`` was taken where ``identity`` holds and return its payload.

    Args:
        snapshot: What was passed to ``restore``.
        identity: ``(env_id, spec_hash)`` of the env restoring it.
        kind: When given, the snapshot's ``kind`` must be this one too.

    Raises:
        SnapshotMismatchError: not a :class:`Snapshot`, a :class:`StackSnapshot` (restore
            those with :func:`restore`), another env id or spec kwargs, or another kind.
        SnapshotCorruptError: the payload is released or corrupt.
    """
    if not isinstance(snapshot, Snapshot):
        raise SnapshotMismatchError(
            f"restore() takes a branchgym Snapshot, got {type(snapshot).__name__}; "
            "pass the object env.snapshot() returned (or Snapshot.from_bytes(data))."
        )
    if isinstance(snapshot, StackSnapshot):
        raise SnapshotMismatchError(
            f"this snapshot was taken over a wrapper stack "
            f"({', '.join(p.rsplit('.', 1)[-1] for p, _ in snapshot.layers)}); restore it "
            "with branchgym.restore(env, snap) on a stack built the same way, not on the "
            "bare env."
        )
    payload = snapshot.payload  # raises if released or corrupt
    env_id, spec_hash = identity
    if snapshot.env_id != env_id or snapshot.spec_hash != spec_hash:
        what = "env id" if snapshot.env_id != env_id else "spec kwargs"
        raise SnapshotMismatchError(
            f"snapshot of {snapshot.env_id} [{snapshot.spec_hash[:8]}] cannot restore into "
            f"{env_id} [{spec_hash[:8]}]: the {what} differ. Restore into an env made with "
            "the same id and kwargs."
        )
    if kind is not None and snapshot.kind != kind:
        raise SnapshotMismatchError(
            f"a {snapshot.kind!r} snapshot of {snapshot.env_id} cannot restore where "
            f"{kind!r} snapshots are taken; restore into an env made the same way."
        )
    return payload


class SnapshottableEnv(gym.Env[ObsType, ActType], Generic[ObsType, ActType]):
    """A Gymnasium env whose state can be saved and restored.

    Implement either the two small hooks:

    * ``_get_state() -> state``: a value that shares nothing mutable with the live env,
    * ``_set_state(state) -> (obs, info)``: load it and return the observation and info
      of that state,

    and the base class does the rest (spec checks, the env's ``np_random`` state, the
    :class:`Snapshot` handle, a default ``state_digest``), or override :meth:`snapshot`
    and :meth:`restore` when the state lives outside Python (files, containers) using
    :meth:`_new_snapshot` and :meth:`_open_snapshot`.

    A snapshot restores into any instance built from the same spec, not only the one
    that took it.
    """

    #: How snapshots of this env are held; see :class:`Snapshot`.
    snapshot_kind: ClassVar[str] = "state"
    #: Whether snapshots pickle (and so travel between processes).
    snapshot_picklable: ClassVar[bool] = True
    #: Include ``np_random``'s bit-generator state in snapshots (exact mode).
    snapshot_includes_rng: ClassVar[bool] = True
    #: ``info`` keys whose values legitimately differ between runs (timings).
    volatile_info_keys: ClassVar[tuple[str, ...]] = ()
    #: Env id used when the env was built directly rather than through ``gym.make``.
    default_env_id: ClassVar[str | None] = None

    #: Steps taken in the current episode; envs increment it in ``step``.
    step_index: int = 0

    # -- hooks for implementers -----------------------------------------------------
    def _get_state(self) -> Any:
        raise SnapshotNotSupportedError(
            f"{type(self).__name__} does not implement snapshots: define _get_state() and "
            "_set_state(state), or override snapshot()/restore(); for envs you cannot change, "
            "wrap them in branchgym.wrappers.PickleSnapshot or ReplaySnapshot."
        )

    def _set_state(self, state: Any) -> tuple[ObsType, dict[str, Any]]:
        raise SnapshotNotSupportedError(
            f"{type(self).__name__} does not implement _set_state(state); see SnapshottableEnv."
        )

    def _snapshot_config(self) -> Any:
        """What makes two instances interchangeable for snapshots (default: spec kwargs)."""
        return dict(self.spec.kwargs) if self.spec is not None else {}

    # -- identity ---------------------------------------------------------------------
    def snapshot_identity(self) -> tuple[str, str]:
        """``(env_id, spec_hash)`` that a snapshot must match to restore here."""
        cached = self.__dict__.get("_bg_identity")
        spec = self.spec
        if cached is not None and cached[0] is spec:
            return cached[1]
        env_id = (
            spec.id
            if spec is not None
            else (self.default_env_id or f"{type(self).__module__}:{type(self).__qualname__}")
        )
        identity = spec_identity(env_id, self._snapshot_config())
        self.__dict__["_bg_identity"] = (spec, identity)
        return identity

    # -- the protocol -------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """Save the current state. The live env can go on stepping; the snapshot won't change."""
        state = self._get_state()
        rng = self._rng_state() if self.snapshot_includes_rng else None
        return self._new_snapshot((state, rng))

    def restore(self, snapshot: Snapshot) -> tuple[ObsType, dict[str, Any]]:
        """Bring back the state ``snapshot`` holds; returns its observation and info."""
        state, rng = self._open_snapshot(snapshot)
        obs, info = self._set_state(copy.deepcopy(state) if self._restore_copies else state)
        if rng is not None:
            self._set_rng_state(rng)
        return obs, info

    def state_digest(self) -> str:
        """A stable hash of everything that determines future behaviour."""
        rng = self._rng_state() if self.snapshot_includes_rng else None
        return stable_hash(type(self).__qualname__, self._get_state(), rng)

    #: Deep-copy the state on restore so the snapshot survives being restored into an env
    #: that then mutates it. Envs whose ``_set_state`` copies (or whose state is immutable)
    #: turn this off for speed.
    _restore_copies: ClassVar[bool] = True

    def reseed(self, seed: int | None) -> None:
        """Replace the env's RNG mid-episode (independent randomness for a restored sibling).

        A snapshot carries the RNG, so siblings restored from one snapshot would replay the
        same environment randomness; a branching engine reseeds each sibling after restore.
        """
        from gymnasium.utils import seeding

        self._np_random, self._np_random_seed = seeding.np_random(seed)

    # -- helpers for implementers -------------------------------------------------------
    def _new_snapshot(
        self,
        payload: Any,
        *,
        kind: str | None = None,
        picklable: bool | None = None,
        nbytes: int | Callable[[], int] | None = None,
        on_release: Callable[[Any], None] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Snapshot:
        """Wrap ``payload`` in a :class:`Snapshot` stamped with this env's identity."""
        env_id, spec_hash = self.snapshot_identity()
        return Snapshot(
            env_id=env_id,
            spec_hash=spec_hash,
            step=self.step_index,
            kind=kind or self.snapshot_kind,
            picklable=self.snapshot_picklable if picklable is None else picklable,
            payload=payload,
            nbytes=nbytes,
            on_release=on_release,
            meta=meta,
        )

    def _open_snapshot(self, snapshot: Any) -> Any:
        """Check that ``snapshot`` belongs here and return its payload (:func:`open_snapshot`)."""
        return open_snapshot(snapshot, self.snapshot_identity())

    def _rng_state(self) -> dict[str, Any] | None:
        rng = self.__dict__.get("_np_random")
        return copy.deepcopy(rng.bit_generator.state) if rng is not None else None

    def _set_rng_state(self, state: dict[str, Any]) -> None:
        rng = self.__dict__.get("_np_random")
        if rng is None or type(rng.bit_generator).__name__ != state.get("bit_generator"):
            bitgen = getattr(np.random, state["bit_generator"])()
            rng = np.random.Generator(bitgen)
            self._np_random = rng
        rng.bit_generator.state = copy.deepcopy(state)


# ----------------------------------------------------------------- stack operations


def _owns_snapshots(env: Any) -> bool:
    return isinstance(env, SnapshottableEnv | SnapshotWrapper)


def _walk(env: gym.Env) -> tuple[list[gym.Wrapper], Any]:
    """Split a stack into (wrappers to capture, outer to inner) and the snapshot owner."""
    wrappers: list[gym.Wrapper] = []
    e: Any = env
    while not _owns_snapshots(e):
        if isinstance(e, gym.Wrapper):
            wrappers.append(e)
            e = e.env
            continue
        raise SnapshotNotSupportedError(
            f"{type(e).__name__} does not implement branchgym's snapshot protocol. Make it a "
            "branchgym.SnapshottableEnv, or wrap it: branchgym.wrappers.PickleSnapshot(env) "
            "(deep copy, fast) or branchgym.wrappers.ReplaySnapshot(env) (reset + replay)."
        )
    return wrappers, e


def snapshot(env: gym.Env) -> Snapshot:
    """Snapshot a whole wrapper stack (``gym.make`` output, or any stack of wrappers).

    Raises:
        UnsnapshottableWrapperError: a wrapper with unknown state is in the stack.
        SnapshotNotSupportedError: nothing in the stack implements snapshots.
    """
    wrappers, owner = _walk(env)
    layers = tuple(
        (class_path(type(w)), capture_wrapper_state(w))
        for w in wrappers
        if wrapper_state_handler(w).attrs
    )
    inner = owner.snapshot()
    if not wrappers:
        return inner
    return StackSnapshot(inner, layers)


def declares_rng_excluded(env: gym.Env) -> bool:
    """True when a layer of the stack declares ``snapshot_includes_rng = False``.

    Such envs (ALE's ``cloneState`` semantics) restore the state but not the random
    stream, so continuations agree in distribution only; exact comparisons of steps
    after a restore do not apply to them.
    """
    e: Any = env
    while True:
        if getattr(e, "snapshot_includes_rng", True) is False:
            return True
        if not isinstance(e, gym.Wrapper):
            return False
        e = e.env


def restore(env: gym.Env, snap: Snapshot) -> tuple[Any, dict[str, Any]]:
    """Restore a snapshot taken by :func:`snapshot` on a stack built the same way.

    Returns:
        The observation and info of the restored state, as the outermost wrapper shows them.
    """
    if not isinstance(snap, Snapshot):
        raise SnapshotMismatchError(
            f"restore() takes a branchgym Snapshot, got {type(snap).__name__}; pass what "
            "branchgym.snapshot(env) returned."
        )
    wrappers, owner = _walk(env)
    for w in wrappers:
        wrapper_state_handler(w)  # unknown wrappers fail before anything changes
    stateful = [w for w in wrappers if wrapper_state_handler(w).attrs]
    # A SnapshotWrapper that is itself the outermost layer may return a StackSnapshot of
    # the stack *below* it (it delegates to snapshot(self.env)); snapshot() hands that
    # back unchanged, so restore() must hand it to the wrapper unchanged too.
    if isinstance(snap, StackSnapshot) and (wrappers or not isinstance(owner, SnapshotWrapper)):
        layers, inner = snap.layers, snap.inner
    else:
        layers, inner = (), snap
    want = [p for p, _ in layers]
    have = [class_path(type(w)) for w in stateful]
    if want != have:
        raise SnapshotMismatchError(
            f"snapshot was taken over wrappers {want or '[]'} but this stack has {have or '[]'}; "
            "restore into an env built the same way (same gym.make arguments and wrappers)."
        )
    obs, info = owner.restore(inner)
    for w, (_, state) in zip(stateful, layers, strict=True):
        for name, value in state.items():
            setattr(w, name, copy.deepcopy(value))
    for w in reversed(wrappers):  # inner to outer, as step() would transform
        observe = wrapper_state_handler(w).observe
        if observe is not None:
            obs = observe(w, obs)
    return obs, info


def state_digest(env: gym.Env) -> str:
    """Stable hash of the whole stack's behaviour-relevant state (wrappers included)."""
    wrappers, owner = _walk(env)
    parts = []
    for w in wrappers:
        parts.append((class_path(type(w)), read_wrapper_state(w, digest=True)))
    return stable_hash(parts, owner.state_digest())


def reseed(env: gym.Env, seed: int | None) -> None:
    """Give the env below ``env`` a fresh RNG seeded with ``seed`` without resetting it.

    Restoring a snapshot restores the environment's RNG too (exact mode), so K siblings
    restored from one snapshot would see the *same* environment randomness. Call this
    after ``restore`` for every sibling that must draw its own transitions (spec section
    1, step 4: siblings sample independently from ``s_t``). Deterministic sandboxes are
    unaffected.
    """
    _, owner = _walk(env)
    owner.reseed(seed)


# ------------------------------------------------------------------------- wrappers


class SnapshotWrapper(gym.Wrapper[ObsType, ActType, ObsType, ActType]):
    """Base of branchgym wrappers that own the snapshot of everything below them.

    Subclasses (``PickleSnapshot``, ``ReplaySnapshot``, ``FidelityCheck``) implement
    :meth:`snapshot`, :meth:`restore` and :meth:`state_digest` for their inner stack.
    """

    def snapshot(self) -> Snapshot:  # pragma: no cover - abstract
        """Snapshot this wrapper and everything it wraps."""
        raise NotImplementedError

    def restore(self, snapshot: Snapshot) -> tuple[ObsType, dict[str, Any]]:  # pragma: no cover
        """Restore this wrapper and everything it wraps."""
        raise NotImplementedError

    def state_digest(self) -> str:  # pragma: no cover - abstract
        """Stable hash of this wrapper's and its inner stack's state."""
        raise NotImplementedError

    def reseed(self, seed: int | None) -> None:
        """Give the base env a fresh RNG mid-episode (see :func:`branchgym.core.reseed`)."""
        from gymnasium.utils import seeding

        base = self.env.unwrapped
        base._np_random, base._np_random_seed = seeding.np_random(seed)

    # -- helpers for subclasses that snapshot the stack below them ---------------------
    #: The ``kind`` of the snapshots this wrapper takes (and accepts on restore); set by
    #: subclasses that use these helpers.
    snapshot_kind: ClassVar[str]

    def _new_snapshot(self, payload: Any, *, step: int, **fields: Any) -> Snapshot:
        """Wrap ``payload`` in a :class:`Snapshot` stamped with the stack's identity."""
        env_id, spec_hash = stack_identity(self.env)
        return Snapshot(
            env_id=env_id,
            spec_hash=spec_hash,
            step=step,
            kind=self.snapshot_kind,
            payload=payload,
            picklable=True,
            **fields,
        )

    def _open_snapshot(self, snapshot: Any) -> Any:
        """Check that ``snapshot`` was taken by this kind of wrapper over this stack."""
        return open_snapshot(snapshot, stack_identity(self.env), kind=self.snapshot_kind)

    def _capture_layers(self) -> tuple[dict[str, Any], ...]:
        """The state of every wrapper below this one, outer to inner."""
        return tuple(capture_wrapper_state(w) for w in walk_wrappers(self.env))

    def _restore_layers(self, layers: tuple[dict[str, Any], ...], *, copy_values: bool) -> None:
        """Put back what :meth:`_capture_layers` took, on a stack built the same way."""
        wrappers = walk_wrappers(self.env)
        if len(wrappers) != len(layers):
            raise SnapshotMismatchError(
                f"the wrapper stack below {type(self).__name__} differs from the one "
                "snapshotted; build the env with the same wrappers."
            )
        for w, state in zip(wrappers, layers, strict=True):
            for name, value in state.items():
                setattr(w, name, copy.deepcopy(value) if copy_values else value)


class SnapshotAPI(gym.Wrapper[ObsType, ActType, ObsType, ActType], gym.utils.RecordConstructorArgs):
    """Outermost wrapper added by branchgym registrations: ``env.snapshot()`` on ``gym.make``.

    It is stateless and forwards on purpose: ``snapshot()``, ``restore()`` and
    ``state_digest()`` act on the whole stack beneath it (TimeLimit included).
    """

    def __init__(self, env: gym.Env[ObsType, ActType]) -> None:
        """Wrap ``env``."""
        gym.utils.RecordConstructorArgs.__init__(self)
        gym.Wrapper.__init__(self, env)

    def snapshot(self) -> Snapshot:
        """Snapshot the whole stack."""
        return snapshot(self.env)

    def restore(self, snapshot: Snapshot) -> tuple[ObsType, dict[str, Any]]:
        """Restore the whole stack."""
        return restore(self.env, snapshot)

    def state_digest(self) -> str:
        """Digest of the whole stack."""
        return state_digest(self.env)


declare_stateless(SnapshotAPI)
