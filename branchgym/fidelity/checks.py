"""``check_env``: Gymnasium's API checks plus the snapshot checks every sandbox must pass.

Each check is a small ``check_*`` function over an env factory; :func:`check_env` runs
them all and returns a :class:`CheckReport`. The reference for "behaves exactly like" is
always a *model*: a fresh instance reset with the same seed and replayed through the same
action prefix, compared with the one data-equivalence comparator
(:func:`branchgym.compare.first_difference`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pickle
import time
import warnings
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from branchgym.compare import first_difference
from branchgym.core import live_snapshots, restore, snapshot, state_digest
from branchgym.error import (
    SnapshotError,
    SnapshotMismatchError,
    SnapshotNotPicklableError,
    SnapshotReleasedError,
)

__all__ = [
    "CheckResult",
    "CheckReport",
    "check_env",
    "ActionChooser",
    "run_actions",
    "rollout_actions",
    "volatile_keys",
    "CHECKS",
]

EnvFactory = Callable[[], gym.Env]


@dataclasses.dataclass
class CheckResult:
    """Outcome of one check."""

    name: str
    passed: bool
    detail: str = ""
    seconds: float = 0.0
    skipped: bool = False


@dataclasses.dataclass
class CheckReport:
    """All checks of one env; ``ok`` is False if any check failed."""

    env: str
    results: list[CheckResult]

    @property
    def ok(self) -> bool:
        """True when no check failed (skipped checks do not fail)."""
        return all(r.passed or r.skipped for r in self.results)

    def __str__(self) -> str:
        width = max(len(r.name) for r in self.results) if self.results else 10
        lines = [f"check_env: {self.env}"]
        for r in self.results:
            mark = "SKIP" if r.skipped else ("PASS" if r.passed else "FAIL")
            detail = f"  {r.detail}" if r.detail else ""
            lines.append(f"  [{mark}] {r.name:<{width}} {r.seconds * 1000:8.1f} ms{detail}")
        failed = sum(not (r.passed or r.skipped) for r in self.results)
        lines.append("  OK" if self.ok else f"  {failed} check(s) FAILED")
        return "\n".join(lines)


# ------------------------------------------------------------------ action choice


class ActionChooser:
    """Seeded actions: from ``info["admissible_actions"]`` when the env lists them, else sampled."""

    def __init__(self, env: gym.Env, seed: int) -> None:
        """Seed a generator and the env's action space."""
        self.rng = np.random.default_rng(seed)
        self.space = env.action_space
        self.space.seed(int(seed))

    def __call__(self, info: dict[str, Any]) -> Any:
        """Pick an action for the state whose info is ``info``."""
        admissible = info.get("admissible_actions") if isinstance(info, dict) else None
        if admissible:
            return admissible[int(self.rng.integers(len(admissible)))]
        return self.space.sample()


def volatile_keys(env: gym.Env) -> tuple[str, ...]:
    """The info keys an env declares volatile (differ between runs by design).

    The base env and every wrapper above it may declare ``volatile_info_keys``: a wrapper
    that adds a timing field to ``info`` declares it where it adds it.
    """
    keys: list[str] = []
    e: Any = env
    while True:
        for k in getattr(e, "volatile_info_keys", ()):
            if k not in keys:
                keys.append(k)
        if not isinstance(e, gym.Wrapper):
            return tuple(keys)
        e = e.env


def strip_volatile(info: dict[str, Any], volatile: tuple[str, ...]) -> dict[str, Any]:
    """``info`` without the ``volatile`` keys (and without ``episode["t"]``, a wall clock).

    What is left is what two runs of a deterministic env must agree on.
    """
    out = {k: v for k, v in info.items() if k not in volatile}
    ep = out.get("episode")
    if isinstance(ep, dict) and "t" in ep:  # RecordEpisodeStatistics' wall-clock time
        out["episode"] = {k: v for k, v in ep.items() if k != "t"}
    return out


def run_actions(env: gym.Env, actions: list[Any]) -> list[tuple[Any, ...]]:
    """Step ``actions`` (stopping at episode end); returns comparable step tuples."""
    volatile = volatile_keys(env)
    out = []
    for a in actions:
        obs, reward, terminated, truncated, info = env.step(a)
        out.append(
            (obs, float(reward), bool(terminated), bool(truncated), strip_volatile(info, volatile))
        )
        if terminated or truncated:
            break
    return out


def rollout_actions(
    env: gym.Env, info: dict[str, Any], chooser: ActionChooser, n: int
) -> list[Any]:
    """Choose and take up to ``n`` actions on ``env`` from ``info``; returns those taken.

    Stops early at episode end. Used by the checks here and the fidelity suite
    (:mod:`branchgym.fidelity.suite`) to pick a future on a model copy of the env.
    """
    actions = []
    for _ in range(n):
        a = chooser(info)
        actions.append(a)
        _, _, terminated, truncated, info = env.step(a)
        if terminated or truncated:
            break
    return actions


@dataclasses.dataclass
class _Setup:
    env: gym.Env
    seed: int
    prefix: list[Any]
    future: list[Any]
    obs: Any
    info: dict[str, Any]


def _prepare(factory: EnvFactory, seed: int, prefix_len: int, future_len: int) -> _Setup:
    """Reset with ``seed``, take a random prefix, and choose future actions on a model copy."""
    env = factory()
    obs, info = env.reset(seed=seed)
    chooser = ActionChooser(env, seed + 1)
    prefix = []
    for _ in range(prefix_len):
        a = chooser(info)
        obs, _, terminated, truncated, info = env.step(a)
        prefix.append(a)
        if terminated or truncated:  # start over: a prefix must end in a live state
            obs, info = env.reset(seed=seed)
            prefix = []
    model, model_info = _model(factory, seed, prefix)
    future = rollout_actions(model, model_info, chooser, future_len)
    model.close()
    return _Setup(env, seed, prefix, future, obs, info)


def _model(factory: EnvFactory, seed: int, prefix: list[Any]) -> tuple[gym.Env, dict[str, Any]]:
    """A fresh instance reset with ``seed`` and replayed through ``prefix``: the reference."""
    env = factory()
    _, info = env.reset(seed=seed)
    for a in prefix:
        _, _, _, _, info = env.step(a)
    return env, info


def _expected(factory: EnvFactory, s: _Setup) -> list[tuple[Any, ...]]:
    model, _ = _model(factory, s.seed, s.prefix)
    try:
        return run_actions(model, s.future)
    finally:
        model.close()


def _compare(what: str, got: Any, want: Any, volatile: tuple[str, ...] = ()) -> str | None:
    d = first_difference(got, want, ignore=volatile)
    return None if d is None else f"{what}: {d}"


# ------------------------------------------------------------------------ checks


def check_gymnasium_api(factory: EnvFactory, seed: int) -> str | None:
    """Gymnasium's own ``check_env`` on the base env (spaces, reset/step signatures, seeding)."""
    from gymnasium.utils.env_checker import check_env as gym_check_env

    env = factory()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gym_check_env(env.unwrapped, skip_render_check=True)
    finally:
        env.close()
    return None


def check_round_trip(factory: EnvFactory, seed: int) -> str | None:
    """Restore right after snapshot: same digest, same observation, same continuation."""
    s = _prepare(factory, seed, 3, 6)
    try:
        before = state_digest(s.env)
        with snapshot(s.env) as snap:
            obs, info = restore(s.env, snap)
        if state_digest(s.env) != before:
            return "state_digest() changed across snapshot + restore"
        err = _compare("restored observation", obs, s.obs) or _compare(
            "restored info",
            strip_volatile(info, volatile_keys(s.env)),
            strip_volatile(s.info, volatile_keys(s.env)),
        )
        if err:
            return err
        return _compare("continuation", run_actions(s.env, s.future), _expected(factory, s))
    finally:
        s.env.close()


def check_independence(factory: EnvFactory, seed: int) -> str | None:
    """Stepping the live env after a snapshot must not change the snapshot (no aliasing)."""
    s = _prepare(factory, seed, 3, 6)
    try:
        before = state_digest(s.env)
        with snapshot(s.env) as snap:
            run_actions(s.env, s.future)  # mutate the live state
            restore(s.env, snap)
        if state_digest(s.env) != before:
            return "the snapshot changed when the live env stepped on (it aliases live state)"
        return _compare(
            "continuation after restore", run_actions(s.env, s.future), _expected(factory, s)
        )
    finally:
        s.env.close()


def check_restore_twice(factory: EnvFactory, seed: int) -> str | None:
    """One snapshot restored twice gives the same continuation both times."""
    s = _prepare(factory, seed, 3, 6)
    try:
        with snapshot(s.env) as snap:
            restore(s.env, snap)
            first = run_actions(s.env, s.future)
            restore(s.env, snap)
            second = run_actions(s.env, s.future)
        return _compare("second restore vs first", second, first)
    finally:
        s.env.close()


def check_portability(factory: EnvFactory, seed: int) -> str | None:
    """A snapshot restores into a fresh instance built from the same spec."""
    s = _prepare(factory, seed, 3, 6)
    other = factory()
    try:
        other.reset(seed=seed + 1000)
        with snapshot(s.env) as snap:
            restore(other, snap)
        if state_digest(other) != state_digest(s.env):
            return "a fresh instance's digest differs after restoring the snapshot"
        return _compare(
            "continuation in a fresh instance", run_actions(other, s.future), _expected(factory, s)
        )
    finally:
        other.close()
        s.env.close()


def check_pickle(factory: EnvFactory, seed: int) -> str | None:
    """Picklable snapshots survive a pickle round trip; others refuse to pickle, clearly."""
    s = _prepare(factory, seed, 3, 6)
    other = factory()
    try:
        other.reset(seed=seed + 1000)
        with snapshot(s.env) as snap:
            if not snap.picklable:
                try:
                    pickle.dumps(snap)
                except SnapshotNotPicklableError:
                    return None
                return "snapshot says picklable=False but pickled without SnapshotNotPicklableError"
            copy = pickle.loads(pickle.dumps(snap))
            with copy:
                restore(other, copy)
        return _compare(
            "continuation after pickle round trip",
            run_actions(other, s.future),
            _expected(factory, s),
        )
    finally:
        other.close()
        s.env.close()


def check_release(factory: EnvFactory, seed: int) -> str | None:
    """``release()`` frees the snapshot: live count drops, restoring it raises, resources go."""
    s = _prepare(factory, seed, 2, 0)
    try:
        base = live_snapshots().count
        resources = getattr(s.env.unwrapped, "live_resources", None)
        res_before = resources() if callable(resources) else None
        snap = snapshot(s.env)
        snap.release()
        snap.release()  # idempotent
        if live_snapshots().count > base:
            return "live_snapshots() still counts a released snapshot"
        if callable(resources) and resources() != res_before:
            return f"live_resources() went from {res_before} to {resources()} after release()"
        try:
            restore(s.env, snap)
        except SnapshotReleasedError:
            pass
        else:
            return "restoring a released snapshot did not raise SnapshotReleasedError"
        try:
            restore(s.env, object())  # type: ignore[arg-type]
        except SnapshotMismatchError:
            return None
        return "restoring a non-snapshot did not raise SnapshotMismatchError"
    finally:
        s.env.close()


#: Every check, in the order ``check_env`` runs them.
CHECKS: dict[str, Callable[[EnvFactory, int], str | None]] = {
    "gymnasium_api": check_gymnasium_api,
    "round_trip": check_round_trip,
    "independence": check_independence,
    "restore_twice": check_restore_twice,
    "portability": check_portability,
    "pickle": check_pickle,
    "release": check_release,
}


def check_env(
    env: gym.Env | EnvFactory | str,
    *,
    seed: int = 0,
    checks: tuple[str, ...] | None = None,
    skip_gymnasium: bool = False,
) -> CheckReport:
    """Run Gymnasium's checks and every snapshot check.

    Args:
        env: A registered id, a zero-argument env factory, or an env instance (then its
            spec is used to build the fresh instances the checks need).
        seed: Seed of resets and action choice.
        checks: Names from :data:`CHECKS` to run (default: all).
        skip_gymnasium: Skip Gymnasium's own API checker.
    """
    name, factory = as_factory(env)
    results = []
    for check_name, fn in CHECKS.items():
        if checks is not None and check_name not in checks:
            continue
        if skip_gymnasium and check_name == "gymnasium_api":
            continue
        t0 = time.perf_counter()
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                problem = fn(factory, seed)
            results.append(
                CheckResult(check_name, problem is None, problem or "", time.perf_counter() - t0)
            )
        except SnapshotError as exc:
            results.append(
                CheckResult(
                    check_name, False, f"{type(exc).__name__}: {exc}", time.perf_counter() - t0
                )
            )
        except Exception as exc:  # a crashing env is a failed check, reported, not raised
            results.append(
                CheckResult(
                    check_name, False, f"{type(exc).__name__}: {exc}", time.perf_counter() - t0
                )
            )
    return CheckReport(name, results)


def as_factory(env: gym.Env | EnvFactory | str) -> tuple[str, EnvFactory]:
    """``(env id, zero-argument factory)`` for a registered id, a factory or a ``gym.make`` env.

    Raises:
        TypeError: ``env`` is an instance built without ``gym.make`` (no spec to rebuild it).
    """
    if isinstance(env, str):
        from branchgym.registration import env_factory

        return env_factory(env)
    if isinstance(env, gym.Env):
        spec = env.spec
        if spec is None:
            raise TypeError(
                "check_env needs fresh instances: pass a registered id or a zero-argument "
                "factory (e.g. `lambda: MyEnv()`) instead of an env built without gym.make."
            )
        return spec.id, lambda: gym.make(spec)
    if callable(env):
        return getattr(env, "__name__", repr(env)), env
    raise TypeError(f"check_env takes an env id, a factory or an env; got {type(env).__name__}")


