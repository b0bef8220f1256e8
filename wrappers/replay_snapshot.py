"""ReplaySnapshot: make any deterministic-given-seed Gymnasium env snapshottable by replay.

The snapshot is the reset seed, the reset options and the actions since; restoring
resets the stack with that seed and replays the actions. It works for any env whose
transitions depend only on its seed and actions (all of Gymnasium's toy-text and
classic-control envs), costs nothing to take and a full re-run of the prefix to restore
(``kind = "replay"``: cost grows linearly with depth).

``reset(seed=None)`` is made reproducible: the wrapper draws an explicit seed for the
inner env from its own generator (seeded by the first explicit seed, if any).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import gymnasium as gym
import numpy as np

from branchgym.core import Snapshot, SnapshotWrapper
from branchgym.digest import stable_hash
from branchgym.error import ResetNeededError, SnapshotCorruptError

__all__ = ["ReplaySnapshot"]


@dataclasses.dataclass(frozen=True)
class _Reseed:
    """A mid-episode reseed, recorded among the actions so replay reproduces it."""

    seed: int


class ReplaySnapshot(SnapshotWrapper, gym.utils.RecordConstructorArgs):
    """Snapshots by recording ``(seed, options, actions)``; restores by reset + replay."""

    snapshot_kind = "replay"

    def __init__(self, env: gym.Env) -> None:
        """Wrap ``env``."""
        gym.utils.RecordConstructorArgs.__init__(self)
        gym.Wrapper.__init__(self, env)
        self._seed_rng: np.random.Generator | None = None
        self._seed: int | None = None
        self._options: dict[str, Any] | None = None
        self._actions: list[Any] = []

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Reset with an explicit seed (drawn reproducibly if none is given)."""
        if seed is not None:
            self._seed_rng = np.random.default_rng(seed)
        elif self._seed_rng is None:
            self._seed_rng = np.random.default_rng()
        else:
            seed = int(self._seed_rng.integers(2**31 - 1))
        if seed is None:
            seed = int(self._seed_rng.integers(2**31 - 1))
        self._seed, self._options = int(seed), copy.deepcopy(options)
        self._actions = []
        return self.env.reset(seed=self._seed, options=options)

    def step(self, action: Any):
        """Step and record the action."""
        if self._seed is None:
            raise ResetNeededError("Cannot call step() before reset(); call env.reset() first.")
        self._actions.append(copy.deepcopy(action))
        return self.env.step(action)

    def reseed(self, seed: int | None) -> None:
        """Reseed the base env mid-episode; the reseed is recorded so replays stay exact."""
        if seed is None:
            raise ValueError("ReplaySnapshot.reseed needs an explicit seed to be replayable")
        super().reseed(seed)
        self._actions.append(_Reseed(int(seed)))

    def snapshot(self) -> Snapshot:
        """The recorded seed, options and actions (cheap to take, O(depth) to restore)."""
        if self._seed is None:
            raise ResetNeededError("Cannot snapshot before reset(); call env.reset() first.")
        layers = self._capture_layers()
        seed_rng = copy.deepcopy(self._seed_rng.bit_generator.state) if self._seed_rng else None
        payload = (self._seed, copy.deepcopy(self._options), tuple(self._actions), layers, seed_rng)
        depth = sum(not isinstance(a, _Reseed) for a in self._actions)
        return self._new_snapshot(payload, step=depth, meta={"replay_depth": depth})

    def restore(self, snapshot: Snapshot) -> tuple[Any, dict[str, Any]]:
        """Reset with the recorded seed and replay the recorded actions."""
        payload = self._open_snapshot(snapshot)
        try:
            seed, options, actions, layers, seed_rng = payload
            seed = int(seed)
        except (TypeError, ValueError) as exc:
            raise SnapshotCorruptError("ReplaySnapshot payload is malformed") from exc
        obs, info = self.env.reset(seed=seed, options=copy.deepcopy(options))
        for i, action in enumerate(actions):
            if isinstance(action, _Reseed):
                SnapshotWrapper.reseed(self, action.seed)
                continue
            obs, _, terminated, truncated, info = self.env.step(copy.deepcopy(action))
            if (terminated or truncated) and i != len(actions) - 1:
                raise SnapshotCorruptError(
                    f"replay ended the episode at action {i + 1} of {len(actions)}: the env is "
                    "not deterministic given its seed. Use PickleSnapshot for this env."
                )
        self._restore_layers(layers, copy_values=True)  # cross-episode wrapper state
        self._seed, self._options, self._actions = seed, copy.deepcopy(options), list(actions)
        if seed_rng is not None:
            self._seed_rng = np.random.default_rng()
            self._seed_rng.bit_generator.state = copy.deepcopy(seed_rng)
        return obs, info

    def state_digest(self) -> str:
        """Hash of the seed, options and action prefix (which fully determine the state)."""
        if self._seed is None:
            return stable_hash(None)
        try:
            return stable_hash(self._seed, self._options, self._actions, self._rng_state())
        except TypeError:
            return stable_hash(
                self._seed, repr(self._options), repr(self._actions), self._rng_state()
            )

    def _rng_state(self) -> Any:
        return self._seed_rng.bit_generator.state if self._seed_rng is not None else None
