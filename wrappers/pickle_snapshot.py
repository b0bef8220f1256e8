"""PickleSnapshot: make any Gymnasium env snapshottable by pickling its state.

The snapshot holds the base env's attributes (its ``np_random`` generator included, so
stochastic envs continue identically) and the state of every wrapper between this one
and the base env, pickled once at snapshot time. Restoring unpickles a fresh copy, so a
snapshot can be restored any number of times, into any instance made from the same
spec, in any process.
"""

from __future__ import annotations

import copy
import hashlib
import pickle
from typing import Any

import gymnasium as gym

from branchgym import serialization
from branchgym.core import Snapshot, SnapshotWrapper
from branchgym.digest import stable_hash
from branchgym.error import ResetNeededError, SnapshotCorruptError, SnapshotUntrustedError
from branchgym.wrapper_state import read_wrapper_state, walk_wrappers

__all__ = ["PickleSnapshot"]

#: Attributes of the base env that are configuration or rendering, not state.
DEFAULT_EXCLUDE = (
    "observation_space",
    "action_space",
    "spec",
    "metadata",
    "render_mode",
    "screen",
    "clock",
    "window",
    "viewer",
    "_bg_identity",
)


def _dumps(obj: Any) -> bytes:
    try:
        return pickle.dumps(obj, protocol=5)
    except (pickle.PicklingError, TypeError, AttributeError):
        import cloudpickle

        return cloudpickle.dumps(obj, protocol=5)


class PickleSnapshot(SnapshotWrapper, gym.utils.RecordConstructorArgs):
    """Snapshots by pickling the base env's ``__dict__`` and the wrappers below.

    Args:
        env: Any Gymnasium env (typically ``gym.make(...)`` output).
        exclude: Base-env attributes to leave out (configuration, render windows).
    """

    snapshot_kind = "pickle"

    def __init__(self, env: gym.Env, exclude: tuple[str, ...] = DEFAULT_EXCLUDE) -> None:
        """Wrap ``env``."""
        gym.utils.RecordConstructorArgs.__init__(self, exclude=exclude)
        gym.Wrapper.__init__(self, env)
        self._exclude = frozenset(exclude)
        self._last: tuple[Any, dict[str, Any]] | None = None
        self._steps = 0
        self._allowed: frozenset[tuple[str, str]] | None = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Reset and remember the observation (restore returns the snapshot's observation)."""
        obs, info = self.env.reset(seed=seed, options=options)
        self._last = (obs, info)
        self._steps = 0
        return obs, info

    def step(self, action: Any):
        """Step and remember the observation."""
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._last = (obs, info)
        self._steps += 1
        return obs, reward, terminated, truncated, info

    def _state(self) -> tuple[Any, ...]:
        layers = self._capture_layers()
        base = self.env.unwrapped
        base_state = {k: v for k, v in base.__dict__.items() if k not in self._exclude}
        return layers, base_state

    def snapshot(self) -> Snapshot:
        """Pickle the state of everything below this wrapper."""
        if self._last is None:
            raise ResetNeededError("Cannot snapshot before reset(); call env.reset() first.")
        layers, base_state = self._state()
        blob = _dumps((layers, base_state, self._last, self._steps))
        return self._new_snapshot(
            (blob, hashlib.sha256(blob).hexdigest()), step=self._steps, nbytes=len(blob)
        )

    def _load_foreign(self, blob: bytes) -> Any:
        """Load bytes that crossed a process boundary: only globals this env's own state uses.

        The allowance is what pickling this instance's current state references (its
        classes, its generators' constructors); learned once, and once more if a load needs
        a type the state did not hold then (a reset can add some).
        """
        for attempt in (0, 1):
            if self._allowed is None or attempt:
                if self._last is None:
                    self.env.reset()  # a state to learn the types from
                    self._last = None
                layers, base_state = self._state()
                own = _dumps((layers, base_state, self._last, self._steps))
                self._allowed = serialization.globals_of(own)
            try:
                return serialization.safe_loads(blob, self._allowed)
            except SnapshotUntrustedError:
                if attempt:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def restore(self, snapshot: Snapshot) -> tuple[Any, dict[str, Any]]:
        """Unpickle a fresh copy of the saved state into this stack."""
        payload = self._open_snapshot(snapshot)
        try:
            blob, checksum = payload
        except (TypeError, ValueError) as exc:
            raise SnapshotCorruptError("PickleSnapshot payload is malformed") from exc
        if hashlib.sha256(blob).hexdigest() != checksum:
            raise SnapshotCorruptError(
                "PickleSnapshot payload failed its checksum (the bytes were modified); take a "
                "new snapshot."
            )
        try:
            if snapshot.foreign:  # bytes from elsewhere: only the types this env holds load
                loaded = self._load_foreign(blob)
            else:  # the bytes this process pickled a moment ago
                loaded = pickle.loads(blob)
            layers, base_state, last, steps = loaded
        except SnapshotUntrustedError:
            raise
        except Exception as exc:
            raise SnapshotCorruptError(
                f"PickleSnapshot payload cannot be unpickled: {exc}"
            ) from exc
        self._restore_layers(layers, copy_values=False)  # fresh from pickle.loads
        self.env.unwrapped.__dict__.update(base_state)
        self._last = last
        self._steps = steps
        return copy.deepcopy(last[0]), copy.deepcopy(last[1])

    def state_digest(self) -> str:
        """Digest of the base env's state and the wrappers' non-volatile state."""
        wrappers = walk_wrappers(self.env)
        parts = [read_wrapper_state(w, digest=True) for w in wrappers]
        _, base_state = self._state()
        try:
            base_digest = stable_hash(base_state)
        except TypeError:  # arbitrary objects: fall back on their pickled bytes
            base_digest = hashlib.sha256(_dumps(base_state)).hexdigest()
        return stable_hash(parts, base_digest, self._steps)
