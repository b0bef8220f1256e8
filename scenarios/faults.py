"""Fault wrappers: each injects one kind of snapshot-fidelity bug into any env.

The scenario catalogue (:mod:`branchgym.scenarios`) combines them with expected
verdicts; ``branchgym bench erosion`` uses :class:`RestoreFault` at controlled rates.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import os
import shutil
import tempfile
import threading
import time
import weakref
from typing import Any

import gymnasium as gym
import numpy as np

from branchgym.core import SnapshottableEnv
from branchgym.digest import stable_hash
from branchgym.error import FidelitySetupError
from branchgym.scenarios._base import StatefulLayer, other_action

__all__ = [
    "ActionSlip",
    "RestoreFault",
    "WallClock",
    "GlobalCounter",
    "AliasedHistory",
    "FileOutsideSnapshot",
    "BackgroundTicker",
    "LatencyOrdering",
    "PartialRestore",
    "UndeclaredStepBudget",
    "StaleObsCache",
    "ReseedOnRestore",
    "StepTimer",
    "KeyedObsCache",
    "exclude_rng",
]


class ActionSlip(StatefulLayer):
    """With probability ``rate`` per step, a different valid action is executed.

    Args:
        env: The env to wrap.
        rate: Probability of a slip per step.
        seeding: ``"reset"``: the slip RNG is seeded by ``reset(seed)`` (correct);
            ``"unseeded"``: seeded from OS entropy once, never by ``reset`` (the bug).
        snapshot_rng: Whether snapshots capture the slip RNG.
    """

    def __init__(
        self, env: gym.Env, rate: float, *, seeding: str = "reset", snapshot_rng: bool = True
    ) -> None:
        """Wrap ``env``."""
        super().__init__(env)
        if seeding not in ("reset", "unseeded"):
            raise FidelitySetupError(f"seeding must be 'reset' or 'unseeded', got {seeding!r}")
        self.rate = float(rate)
        self.seeding = seeding
        self.snapshot_rng = snapshot_rng
        self.rng = np.random.default_rng()  # OS entropy until a seeded reset

    def on_reset(self, seed: int | None) -> None:
        """Seed the slip RNG from the reset seed (unless this is the unseeded bug)."""
        if self.seeding == "reset" and seed is not None:
            self.rng = np.random.default_rng([int(seed), 0x511])

    def act(self, action: Any) -> Any:
        """Replace the action with probability ``rate``."""
        if self.rng.random() < self.rate:
            return other_action(self.env.action_space, action, self.last_info, self.rng)
        return action

    def layer_state(self) -> Any:
        """The RNG state, when snapshots capture it."""
        return copy.deepcopy(self.rng.bit_generator.state) if self.snapshot_rng else None

    def load_layer_state(self, state: Any) -> None:
        """Restore the RNG state (nothing when it was left out)."""
        if state is not None:
            self.rng.bit_generator.state = copy.deepcopy(state)


class RestoreFault(StatefulLayer):
    """A restore that is subtly wrong: the fault appears only in restored branches.

    Args:
        env: The env to wrap.
        rate: ``kind="slip"``: probability per step, after a restore and until the next
            reset, that a different valid action is executed; ``kind="rng"``: probability
            per restore that the base env's RNG is left as it was (not restored).
        kind: ``"slip"`` or ``"rng"``.
        seed: Seed of the fault's own RNG (``None``: OS entropy, as a real fault).
    """

    def __init__(self, env: gym.Env, rate: float, kind: str = "slip", seed: int | None = None):
        """Wrap ``env``."""
        super().__init__(env)
        if kind not in ("slip", "rng"):
            raise FidelitySetupError(f"RestoreFault kind must be 'slip' or 'rng', got {kind!r}")
        if kind == "rng" and not isinstance(env.unwrapped, SnapshottableEnv):
            raise FidelitySetupError("RestoreFault(kind='rng') needs a SnapshottableEnv base")
        self.rate, self.kind = float(rate), kind
        self.fault_rng = np.random.default_rng(seed)
        self.drifting = False
        self.faulty_restores = 0

    def on_reset(self, seed: int | None) -> None:
        """A fresh episode is not a restored branch."""
        self.drifting = False

    def act(self, action: Any) -> Any:
        """Slip in restored branches."""
        if self.kind == "slip" and self.drifting and self.fault_rng.random() < self.rate:
            return other_action(self.env.action_space, action, self.last_info, self.fault_rng)
        return action

    def restore(self, snap: Any) -> tuple[Any, dict[str, Any]]:
        """Restore, then (maybe) inject the fault."""
        base = self.env.unwrapped
        before = copy.deepcopy(base.np_random.bit_generator.state) if self.kind == "rng" else None
        obs, info = super().restore(snap)
        if self.kind == "slip":
            self.drifting = True
        elif self.fault_rng.random() < self.rate:
            base.np_random.bit_generator.state = before
            self.faulty_restores += 1
        return obs, info


class WallClock(StatefulLayer):
    """Stamps the wall-clock time into the observation (text) or ``info["clock"]``."""

    def decorate(self, obs: Any, info: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """Add the current time, to the microsecond."""
        if isinstance(obs, str):
            return f"[{datetime.datetime.now().strftime('%H:%M:%S.%f')}] {obs}", info
        info["clock"] = time.time()
        return obs, info


#: Process-wide request counter of :class:`GlobalCounter` (the hidden module-level state).
_REQUESTS = itertools.count()


class GlobalCounter(StatefulLayer):
    """Every ``every``-th request of the *process* is throttled: the action is replaced.

    The counter is a module global shared by every instance, outside any snapshot.
    """

    def __init__(self, env: gym.Env, every: int = 5) -> None:
        """Wrap ``env``."""
        super().__init__(env)
        self.every = int(every)

    def act(self, action: Any) -> Any:
        """Replace the action when the global counter says so."""
        n = next(_REQUESTS)
        if n % self.every == self.every - 1:
            rng = np.random.default_rng(n)
            return other_action(self.env.action_space, action, self.last_info, rng)
        return action


class AliasedHistory(StatefulLayer):
    """Keeps the actions taken in ``info["history"]``; the snapshot aliases the live list."""

    def __init__(self, env: gym.Env) -> None:
        """Wrap ``env``."""
        super().__init__(env)
        self.history: list[Any] = []

    def on_reset(self, seed: int | None) -> None:
        """A new episode, a new history."""
        self.history = []

    def act(self, action: Any) -> Any:
        """Log the action."""
        self.history.append(copy.deepcopy(action))
        return action

    def layer_state(self) -> Any:
        """The bug: the live list itself, not a copy."""
        return self.history

    def load_layer_state(self, state: Any) -> None:
        """The bug again: the snapshot's list becomes the live list."""
        self.history = state

    def digest_state(self) -> Any:
        """The history as it is now."""
        return tuple(self.history)

    def decorate(self, obs: Any, info: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """Show the history."""
        info["history"] = list(self.history)
        return obs, info


class FileOutsideSnapshot(StatefulLayer):
    """Appends each action to a log file that snapshots do not capture.

    ``info["log_lines"]`` reports the file's length. The file lives in a private temporary
    directory removed on ``close()`` (or when the env is garbage-collected).
    """

    def __init__(self, env: gym.Env) -> None:
        """Wrap ``env`` and create the scratch directory."""
        super().__init__(env)
        self.dir = tempfile.mkdtemp(prefix="branchgym-scenario-")
        self.path = os.path.join(self.dir, "actions.log")
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)

    def on_reset(self, seed: int | None) -> None:
        """Truncate the log."""
        with open(self.path, "w"):
            pass

    def act(self, action: Any) -> Any:
        """Append the action to the log."""
        with open(self.path, "a") as f:
            f.write(f"{action!r}\n")
        return action

    def decorate(self, obs: Any, info: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """Report the log length."""
        try:
            with open(self.path) as f:
                info["log_lines"] = sum(1 for _ in f)
        except FileNotFoundError:
            info["log_lines"] = 0
        return obs, info

    def close(self) -> None:
        """Remove the scratch directory."""
        super().close()
        self._cleanup()


class BackgroundTicker(StatefulLayer):
    """A heartbeat thread advances ``ticks`` every ``period`` seconds; info shows it.

    ``ticks`` is part of the snapshot, but the thread keeps changing it between calls.
    """

    def __init__(self, env: gym.Env, period: float = 0.0005) -> None:
        """Wrap ``env``; the thread starts at the first reset."""
        super().__init__(env)
        self.period = float(period)
        self.cell = [0]  # shared with the thread (it must not hold the env alive)
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self._stopper = weakref.finalize(self, self.stop.set)

    @staticmethod
    def _run(cell: list[int], stop: threading.Event, period: float) -> None:
        while not stop.wait(period):
            cell[0] += 1

    def on_reset(self, seed: int | None) -> None:
        """Zero the ticks and make sure the thread runs."""
        self.cell[0] = 0
        if self.thread is None:
            self.thread = threading.Thread(
                target=self._run, args=(self.cell, self.stop, self.period), daemon=True
            )
            self.thread.start()

    def layer_state(self) -> Any:
        """The tick count (captured; the thread is the problem)."""
        return self.cell[0]

    def load_layer_state(self, state: Any) -> None:
        """Set the tick count back."""
        self.cell[0] = int(state)

    def decorate(self, obs: Any, info: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """Show the ticks."""
        info["ticks"] = self.cell[0]
        return obs, info

    def close(self) -> None:
        """Stop the thread."""
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=1.0)
        super().close()


class LatencyOrdering(StatefulLayer):
    """Results arrive from ``backends`` servers in order of (jittered) network latency.

    Discrete envs: the agent's action ``k`` picks the ``k``-th result *to arrive*, so the
    executed action depends on latency. Text envs: ``info["admissible_actions"]`` is listed
    in arrival order. Base latencies are 1.0, 1.15, 1.30, ... ms; jitter is Gaussian with
    sd ``jitter`` ms, drawn from the network (OS entropy), not from any seed.
    """

    def __init__(self, env: gym.Env, jitter: float = 0.1) -> None:
        """Wrap ``env``."""
        super().__init__(env)
        self.jitter = float(jitter)
        self.net = np.random.default_rng()

    def _arrival(self, n: int) -> np.ndarray:
        latency = 1.0 + 0.15 * np.arange(n) + self.net.normal(0.0, self.jitter, n)
        return np.argsort(latency, kind="stable")

    def act(self, action: Any) -> Any:
        """Map the action through the arrival order (discrete spaces)."""
        space = self.env.action_space
        if isinstance(space, gym.spaces.Discrete):
            k = int(action) - int(space.start)
            if 0 <= k < int(space.n):
                return int(space.start) + int(self._arrival(int(space.n))[k])
        return action

    def decorate(self, obs: Any, info: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """List the admissible actions in arrival order."""
        admissible = info.get("admissible_actions")
        if admissible:
            order = self._arrival(len(admissible))
            info["admissible_actions"] = [admissible[i] for i in order]
        return obs, info


class PartialRestore(StatefulLayer):
    """Tracks ``moves`` and ``score`` in info; restore forgets to bring ``moves`` back."""

    def __init__(self, env: gym.Env) -> None:
        """Wrap ``env``."""
        super().__init__(env)
        self.moves, self.score = 0, 0.0

    def on_reset(self, seed: int | None) -> None:
        """Zero the counters."""
        self.moves, self.score = 0, 0.0

    def after_step(self, obs: Any, reward: float, info: dict[str, Any]) -> None:
        """Count the move and the reward."""
        self.moves += 1
        self.score += reward

    def layer_state(self) -> Any:
        """Both fields are captured..."""
        return (self.moves, self.score)

    def load_layer_state(self, state: Any) -> None:
        """...but only the score comes back (the field added later was forgotten here)."""
        self.score = state[1]

    def decorate(self, obs: Any, info: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """Show both counters."""
        info["moves"], info["score"] = self.moves, self.score
        return obs, info


class UndeclaredStepBudget(gym.Wrapper):
    """Truncates the episode after ``budget`` steps, like ``TimeLimit``; declared stateless.

    ``branchgym_state_attrs = ()`` tells branchgym the wrapper holds no state, so its step
    counter is never snapshotted.
    """

    branchgym_state_attrs = ()  # the bug: ``_elapsed`` is state

    def __init__(self, env: gym.Env, budget: int = 3) -> None:
        """Wrap ``env``."""
        super().__init__(env)
        self.budget = int(budget)
        self._elapsed = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Reset the counter."""
        self._elapsed = 0
        return self.env.reset(seed=seed, options=options)

    def step(self, action: Any):
        """Count, and truncate at the budget."""
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._elapsed += 1
        return obs, reward, terminated, truncated or self._elapsed >= self.budget, info


class StaleObsCache(StatefulLayer):
    """Caches rendered observations by step number; restore does not invalidate the cache.

    Within one branch every step number is new, so the cache never hits; after a restore,
    the next step number was rendered in the *other* branch and the stale observation is
    served.
    """

    def __init__(self, env: gym.Env) -> None:
        """Wrap ``env``."""
        super().__init__(env)
        self.t = 0
        self.cache: dict[int, Any] = {}

    def on_reset(self, seed: int | None) -> None:
        """A new episode empties the cache."""
        self.t, self.cache = 0, {}

    def step(self, action: Any):
        """Serve the cached rendering of this step number when there is one."""
        obs, reward, terminated, truncated, info = super().step(action)
        self.t += 1
        if self.t in self.cache:
            obs = copy.deepcopy(self.cache[self.t])
        else:
            self.cache[self.t] = copy.deepcopy(obs)
        return obs, reward, terminated, truncated, info

    def layer_state(self) -> Any:
        """The step number (the cache is treated as 'not state': the bug)."""
        return self.t

    def load_layer_state(self, state: Any) -> None:
        """Restore the step number only."""
        self.t = int(state)


def exclude_rng(env: gym.Env) -> gym.Env:
    """Declare that ``env``'s snapshots leave its RNG out (ALE ``cloneState`` semantics)."""
    base = env.unwrapped
    if not isinstance(base, SnapshottableEnv):
        raise FidelitySetupError("exclude_rng needs a branchgym.SnapshottableEnv base env")
    base.snapshot_includes_rng = False  # instance attribute: this env only
    return env


class ReseedOnRestore(StatefulLayer):
    """Restore re-seeds the base env's RNG with a constant (``self.seed(0)`` in ``load``).

    Applied over an env whose snapshots leave the RNG out by design; every restored branch
    then draws the *same* random numbers.
    """

    def restore(self, snap: Any) -> tuple[Any, dict[str, Any]]:
        """Restore, then re-seed."""
        obs, info = super().restore(snap)
        self.env.unwrapped.np_random = np.random.default_rng(0)
        return obs, info


class StepTimer(StatefulLayer):
    """Reports the wall time of each step in ``info["step_ms"]``, declared volatile."""

    volatile_info_keys = ("step_ms",)

    def step(self, action: Any):
        """Time the inner step."""
        t0 = time.perf_counter()
        obs, reward, terminated, truncated, info = super().step(action)
        info["step_ms"] = (time.perf_counter() - t0) * 1000.0
        return obs, reward, terminated, truncated, info

    def decorate(self, obs: Any, info: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """Reset and restore report no step time."""
        info["step_ms"] = 0.0
        return obs, info


class KeyedObsCache(StatefulLayer):
    """Caches rendered observations keyed by the observation they render (correct)."""

    def __init__(self, env: gym.Env) -> None:
        """Wrap ``env``."""
        super().__init__(env)
        self.cache: dict[str, Any] = {}
        self.hits = 0

    def decorate(self, obs: Any, info: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """Serve the cached rendering of this exact observation."""
        try:
            key = stable_hash(obs)
        except TypeError:
            return obs, info
        if key in self.cache:
            self.hits += 1
            return copy.deepcopy(self.cache[key]), info
        self.cache[key] = copy.deepcopy(obs)
        return obs, info
