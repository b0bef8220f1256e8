"""Building blocks of the fault wrappers: a layer that owns its snapshot, and action slips.

A scenario's bug lives in a wrapper over any registered env, so the same fault applies
to the toy envs and to the adapters as they land. Most faults need a layer that owns the
snapshot of everything below it plus some state of its own (that is where snapshot bugs
are written: a list not copied, a field not restored); :class:`StatefulLayer` is that
layer, with hooks the faults override.
"""

from __future__ import annotations

import copy
from typing import Any

import gymnasium as gym
import numpy as np

from branchgym.core import Snapshot, SnapshotWrapper, restore, snapshot, state_digest
from branchgym.digest import stable_hash
from branchgym.error import SnapshotMismatchError

__all__ = ["LayerSnapshot", "StatefulLayer", "other_action"]


class LayerSnapshot(Snapshot):
    """A layer's own state over the snapshot of the stack below it.

    Its metadata are the inner snapshot's; releasing it releases the inner one. The layer
    state is held as given, *not* copied: whether it aliases live state is up to the layer
    (which is the point of the aliasing fault).
    """

    _counted = False  # the inner snapshot is the one counted as live

    def __init__(self, inner: Snapshot, state: Any, layer: str) -> None:
        """Hold ``state`` of layer class ``layer`` over ``inner``."""
        super().__init__(
            env_id=inner.env_id,
            spec_hash=inner.spec_hash,
            step=inner.step,
            kind=inner.kind,
            payload=(layer, state, inner),
            picklable=inner.picklable,
            nbytes=lambda: inner.nbytes,
            meta=inner.meta,
        )

    def release(self) -> None:
        """Release this view and the inner snapshot."""
        inner = None if self.released else self.payload[2]
        super().release()
        if inner is not None:
            inner.release()


class StatefulLayer(SnapshotWrapper):
    """A wrapper with state of its own that owns the snapshot of its inner stack.

    Subclasses override the hooks:

    * ``layer_state()`` / ``load_layer_state(state)``: what the snapshot captures and how
      restore brings it back (default: nothing);
    * ``digest_state()``: what ``state_digest`` covers (default: ``layer_state()``);
    * ``on_reset(seed)``, ``act(action) -> action``, ``after_step(obs, reward, info)``;
    * ``decorate(obs, info) -> (obs, info)``: the layer's view of an observation, applied
      after reset, step and restore alike.
    """

    #: Info keys this layer adds that legitimately differ between runs.
    volatile_info_keys: tuple[str, ...] = ()

    def __init__(self, env: gym.Env) -> None:
        """Wrap ``env``."""
        gym.Wrapper.__init__(self, env)
        self.last_info: dict[str, Any] = {}

    # -- hooks -----------------------------------------------------------------
    def layer_state(self) -> Any:
        """The state a snapshot captures."""
        return None

    def load_layer_state(self, state: Any) -> None:
        """Bring back the state a snapshot captured."""

    def digest_state(self) -> Any:
        """The state ``state_digest`` covers."""
        return self.layer_state()

    def on_reset(self, seed: int | None) -> None:
        """Reset the layer's state."""

    def act(self, action: Any) -> Any:
        """The action actually sent to the inner env."""
        return action

    def after_step(self, obs: Any, reward: float, info: dict[str, Any]) -> None:
        """Update the layer's state after a step."""

    def decorate(self, obs: Any, info: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The layer's view of an observation and info."""
        return obs, info

    # -- gym API ------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Reset the inner stack and the layer."""
        obs, info = self.env.reset(seed=seed, options=options)
        self.on_reset(seed)
        self.last_info = info
        return self.decorate(obs, dict(info))

    def step(self, action: Any):
        """Step with the layer's action; update and decorate."""
        obs, reward, terminated, truncated, info = self.env.step(self.act(action))
        self.after_step(obs, float(reward), info)
        self.last_info = info
        obs, info = self.decorate(obs, dict(info))
        return obs, reward, terminated, truncated, info

    # -- snapshots ------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """The layer state over a snapshot of the inner stack."""
        return LayerSnapshot(snapshot(self.env), self.layer_state(), type(self).__qualname__)

    def restore(self, snap: Snapshot) -> tuple[Any, dict[str, Any]]:
        """Restore the inner stack, then the layer state."""
        if not isinstance(snap, LayerSnapshot) or snap.payload[0] != type(self).__qualname__:
            raise SnapshotMismatchError(
                f"{type(self).__name__}.restore() takes a snapshot this layer took; got "
                f"{snap!r:.80}. Restore into a stack built the same way."
            )
        _, state, inner = snap.payload
        obs, info = restore(self.env, inner)
        self.load_layer_state(state)
        self.last_info = info
        return self.decorate(obs, dict(info))

    def state_digest(self) -> str:
        """Digest of the layer's declared state and the inner stack."""
        return stable_hash(type(self).__qualname__, self.digest_state(), state_digest(self.env))


def other_action(
    space: gym.Space, action: Any, info: dict[str, Any], rng: np.random.Generator
) -> Any:
    """A valid action different from ``action``, drawn with ``rng`` (``action`` if none).

    Text envs pick among ``info["admissible_actions"]``; discrete spaces among the other
    indices; ``Box`` and ``MultiDiscrete`` draw a fresh element.
    """
    admissible = info.get("admissible_actions") if isinstance(info, dict) else None
    if admissible:
        choices = [a for a in admissible if a != action]
        return choices[int(rng.integers(len(choices)))] if choices else action
    if isinstance(space, gym.spaces.Discrete):
        n, start = int(space.n), int(space.start)
        if n < 2:
            return action
        k = int(rng.integers(n - 1))
        a = start + k
        return a + 1 if a >= int(action) else a
    if isinstance(space, gym.spaces.Box):
        low = np.where(np.isfinite(space.low), space.low, -1.0)
        high = np.where(np.isfinite(space.high), space.high, 1.0)
        return rng.uniform(low, high).astype(space.dtype)
    if isinstance(space, gym.spaces.MultiDiscrete):
        return (space.start + rng.integers(space.nvec)).astype(space.dtype)
    return copy.deepcopy(action)


def can_slip(space: gym.Space, info: dict[str, Any]) -> bool:
    """Whether :func:`other_action` can change actions of this env."""
    if isinstance(info, dict) and info.get("admissible_actions"):
        return True
    return isinstance(space, gym.spaces.Discrete | gym.spaces.Box | gym.spaces.MultiDiscrete)
