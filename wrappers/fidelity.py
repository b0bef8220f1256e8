"""FidelityCheck: verify snapshot fidelity while an env runs, in digest or shadow mode.

Assumption 1 of docs/algorithms.md (section 0) says ``rest(snap(s))`` behaves like ``s``.
Its violations are silent: nothing crashes, sibling comparisons are just biased. This
wrapper checks it online, during training or an evaluation run:

* ``mode="digest"``: every snapshot taken through the wrapper records the stack's
  ``state_digest()`` (and the observation and info); right after each restore the wrapper
  recomputes them and compares. Catches snapshots that alias live state and restores
  that miss a field the digest covers. It costs one digest per snapshot and per restore
  and nothing per step (``branchgym bench fidelity`` measures it).
* ``mode="shadow"``: after each restore the wrapper builds a *twin* that reached the same
  state by another route (a fresh instance reset with the recorded seed and replayed
  through the recorded actions, or a fresh instance restored from a pickled copy of the
  snapshot), and steps it in lockstep with the live env, comparing observation, reward,
  terminated, truncated and info (minus the keys the stack declares volatile). Catches
  state outside the snapshot: RNGs, caches, files, module globals, wrapper counters.
* ``mode="both"``: the two together.

A violation is recorded as a :class:`~branchgym.fidelity.violation.Violation` (the check, the first
diverging step, the field and both values); ``on_violation`` says whether it then raises
:class:`~branchgym.error.FidelityViolation`, warns with
:class:`~branchgym.error.FidelityWarning`, or is only recorded in :attr:`FidelityCheck.violations`.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import gymnasium as gym

from branchgym.compare import first_step_difference
from branchgym.core import (
    Snapshot,
    SnapshotWrapper,
    declares_rng_excluded,
    restore,
    snapshot,
    state_digest,
)
from branchgym.error import (
    FidelitySetupError,
    FidelityViolation,
    FidelityWarning,
    ResetNeededError,
)
from branchgym.fidelity.checks import strip_volatile, volatile_keys
from branchgym.fidelity.violation import Violation

__all__ = ["FidelityCheck", "META_KEY"]

#: Key of the bookkeeping a FidelityCheck stores in ``Snapshot.meta``.
META_KEY = "branchgym.fidelity"

_MODES = {"digest": ("digest",), "shadow": ("shadow",), "both": ("digest", "shadow")}
_ON_VIOLATION = ("raise", "warn", "record")
_TWINS = ("auto", "replay", "pickle")


def _spec_factory(env: gym.Env) -> Callable[[], gym.Env] | None:
    spec = env.spec
    if spec is None:
        return None
    return lambda: gym.make(spec)


def _contains_fidelity_check(env: gym.Env) -> bool:
    e: Any = env
    while isinstance(e, gym.Wrapper):
        if isinstance(e, FidelityCheck):
            return True
        e = e.env
    return False


@dataclasses.dataclass
class _Twin:
    env: gym.Env
    route: str
    restored_at: int  # episode step of the restore
    steps_left: int | None


class FidelityCheck(SnapshotWrapper, gym.utils.RecordConstructorArgs):
    """Check snapshot fidelity online; owns ``snapshot()``/``restore()`` of its inner stack.

    Args:
        env: The env to watch (``gym.make(...)`` output or any snapshottable stack).
        mode: ``"digest"``, ``"shadow"`` or ``"both"`` (see the module docstring).
        on_violation: ``"raise"`` :class:`~branchgym.error.FidelityViolation`, ``"warn"``
            (:class:`~branchgym.error.FidelityWarning`) or only ``"record"``; every
            violation is appended to :attr:`violations` in all three cases.
        twin: How shadow mode builds its twin: ``"replay"`` (fresh instance, reset with the
            recorded seed, replay of the recorded actions), ``"pickle"`` (fresh instance
            restored from a pickled copy of the snapshot), or ``"auto"``: replay when the
            episode's reset seed is known, else pickle when the snapshot pickles, else skip
            (counted in ``stats["twins_skipped"]``).
        env_fn: Zero-argument factory of fresh instances of ``env`` *without* this wrapper
            (shadow mode only). Default: ``gym.make(env.spec)``.
        shadow_steps: Steps the twin follows after each restore (default: to the end of the
            episode or the next restore/reset).
        sample_rate: Fraction of snapshots that are recorded and verified (digest mode);
            1.0 checks every one. Lower it to bound the cost during long training runs.

    Attributes:
        violations: Every :class:`~branchgym.fidelity.violation.Violation` seen so far.
        stats: Counters: ``snapshots``, ``recorded``, ``restores``, ``verified``,
            ``unverified`` (snapshots not taken through a FidelityCheck), ``twins``,
            ``twins_skipped``, ``shadowed_steps``.
    """

    def __init__(
        self,
        env: gym.Env,
        mode: str = "digest",
        on_violation: str = "raise",
        *,
        twin: str = "auto",
        env_fn: Callable[[], gym.Env] | None = None,
        shadow_steps: int | None = None,
        sample_rate: float = 1.0,
    ) -> None:
        """Wrap ``env``; see the class docstring for the arguments."""
        if mode not in _MODES:
            raise FidelitySetupError(
                f"FidelityCheck mode={mode!r} is not one of {sorted(_MODES)}; use 'digest' "
                "(cheap, checks each restore), 'shadow' (twin in lockstep) or 'both'."
            )
        if on_violation not in _ON_VIOLATION:
            raise FidelitySetupError(
                f"on_violation={on_violation!r} is not one of {_ON_VIOLATION}."
            )
        if twin not in _TWINS:
            raise FidelitySetupError(f"twin={twin!r} is not one of {_TWINS}.")
        if not 0.0 < sample_rate <= 1.0:
            raise FidelitySetupError(f"sample_rate must be in (0, 1], got {sample_rate!r}.")
        if shadow_steps is not None and shadow_steps < 1:
            raise FidelitySetupError(f"shadow_steps must be >= 1 or None, got {shadow_steps!r}.")
        gym.utils.RecordConstructorArgs.__init__(
            self, mode=mode, on_violation=on_violation, twin=twin, sample_rate=sample_rate
        )
        gym.Wrapper.__init__(self, env)
        self.mode = mode
        self.checks = _MODES[mode]
        self._shadow = "shadow" in self.checks
        self.on_violation = on_violation
        self.twin = twin
        self.shadow_steps = shadow_steps
        self.sample_rate = float(sample_rate)
        self._env_fn = env_fn
        if "shadow" in self.checks:
            self._env_fn = env_fn or _spec_factory(env)
            if self._env_fn is None:
                raise FidelitySetupError(
                    "shadow mode builds a twin from fresh instances, and this env has no spec: "
                    "pass env_fn=<zero-argument factory of the env without FidelityCheck>."
                )
        self._volatile = volatile_keys(env)
        self._rng_excluded = declares_rng_excluded(env)
        self.violations: list[Violation] = []
        self.stats: dict[str, int] = dict.fromkeys(
            (
                "snapshots",
                "recorded",
                "restores",
                "verified",
                "unverified",
                "twins",
                "twins_skipped",
                "shadowed_steps",
            ),
            0,
        )
        self._seed: int | None = None
        self._options: dict[str, Any] | None = None
        self._actions: list[Any] = []
        self._step = 0
        self._last: tuple[Any, dict[str, Any]] | None = None
        self._twin: _Twin | None = None
        self._twin_env: gym.Env | None = None
        self._sampled = 0.0

    # ------------------------------------------------------------------ gym API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Reset; the seed and options are recorded so a twin can replay the episode."""
        self._close_twin()
        obs, info = self.env.reset(seed=seed, options=options)
        self._seed = None if seed is None else int(seed)
        self._options = copy.deepcopy(options)
        self._actions = []
        self._step = 0
        self._last = (obs, info)
        return obs, info

    def step(self, action: Any):
        """Step the env (and the twin, in shadow mode) and compare."""
        if self._shadow:  # only a replay twin needs the action prefix
            self._actions.append(copy.deepcopy(action))
        out = self.env.step(action)
        self._step += 1
        self._last = (out[0], out[4])
        if self._twin is not None:
            self._shadow_step(action, out)
        return out

    def close(self) -> None:
        """Close the twin and the env."""
        self._close_twin()
        self._discard_twin_env()
        super().close()

    # ------------------------------------------------------------------ snapshots
    def snapshot(self) -> Snapshot:
        """Snapshot the inner stack and record what restore must bring back."""
        if self._last is None:
            raise ResetNeededError("Cannot snapshot before reset(); call env.reset() first.")
        snap = snapshot(self.env)
        self.stats["snapshots"] += 1
        if not self._take_sample():
            return snap
        obs, info = self._last
        snap.meta[META_KEY] = {
            "digest": self._digest() if "digest" in self.checks else None,
            "obs": copy.deepcopy(obs),
            "info": copy.deepcopy(strip_volatile(info, self._volatile)),
            "step": self._step,
            "seed": self._seed,
            "options": copy.deepcopy(self._options),
            "actions": tuple(self._actions) if "shadow" in self.checks else None,
        }
        self.stats["recorded"] += 1
        return snap

    def restore(self, snapshot: Snapshot) -> tuple[Any, dict[str, Any]]:
        """Restore the inner stack, then verify it (digest) and start a twin (shadow).

        The env is restored before any check runs: with ``on_violation="raise"`` the
        exception leaves the env in the restored state.
        """
        self._close_twin()
        obs, info = restore(self.env, snapshot)
        self.stats["restores"] += 1
        self._last = (obs, info)
        rec = snapshot.meta.get(META_KEY) if isinstance(snapshot, Snapshot) else None
        if rec is None:
            self.stats["unverified"] += 1
            self._step = snapshot.step
            self._actions, self._seed = [], None  # unknown prefix: no replay twin
            return obs, info
        self._step = int(rec["step"])
        self._seed = rec["seed"]
        self._options = copy.deepcopy(rec["options"])
        self._actions = list(rec["actions"] or ())
        self.stats["verified"] += 1
        if "digest" in self.checks:
            self._verify_restored(rec, obs, info)
        if "shadow" in self.checks:
            self._start_twin(rec, snapshot, obs, info)
        return obs, info

    def state_digest(self) -> str:
        """Digest of the inner stack (this wrapper's bookkeeping is not behaviour)."""
        return state_digest(self.env)

    # ------------------------------------------------------------------ reporting
    def summary(self) -> str:
        """One paragraph: what was checked and what was found."""
        s = self.stats
        lines = [
            f"FidelityCheck({self.mode}): {s['snapshots']} snapshots ({s['recorded']} recorded), "
            f"{s['restores']} restores ({s['verified']} verified, {s['unverified']} unverified), "
            f"{s['twins']} twins ({s['twins_skipped']} skipped), "
            f"{s['shadowed_steps']} shadowed steps: {len(self.violations)} violation(s)"
        ]
        lines += [f"  {v}" for v in self.violations[:10]]
        if len(self.violations) > 10:
            lines.append(f"  ... and {len(self.violations) - 10} more")
        return "\n".join(lines)

    # ------------------------------------------------------------------ internals
    def _take_sample(self) -> bool:
        # Deterministic stride: exactly round(n * rate) of the first n snapshots are recorded.
        before = self._sampled
        self._sampled += self.sample_rate
        return int(self._sampled + 1e-9) > int(before + 1e-9)

    def _digest(self) -> str | None:
        try:
            return state_digest(self.env)
        except TypeError:  # state without a canonical encoding: the obs checks still run
            return None

    def _verify_restored(self, rec: dict[str, Any], obs: Any, info: dict[str, Any]) -> None:
        d = first_step_difference(
            (obs, strip_volatile(info, self._volatile)),
            (rec["obs"], rec["info"]),
            fields=("obs", "info"),
            ignore=self._volatile,
        )
        if d is not None:
            self._violate(
                Violation(
                    "digest",
                    d.path,
                    d.left,
                    d.right,
                    rec["step"],
                    0,
                    "restore() returned another observation than the snapshotted state had",
                )
            )
            return
        if rec["digest"] is not None:
            now = self._digest()
            if now != rec["digest"]:
                self._violate(
                    Violation(
                        "digest",
                        "state_digest",
                        now,
                        rec["digest"],
                        rec["step"],
                        0,
                        "the state changed between snapshot and restore: the snapshot "
                        "aliases live state, or restore misses a field",
                    )
                )

    def _start_twin(
        self, rec: dict[str, Any], snap: Snapshot, obs: Any, info: dict[str, Any]
    ) -> None:
        route = self.twin
        if route == "auto":
            route = "replay" if rec["seed"] is not None else "pickle" if snap.picklable else ""
        if route == "replay" and rec["seed"] is None:
            route = ""  # reset(seed=None): the episode cannot be replayed
        if route == "pickle" and not snap.picklable:
            route = ""
        if not route:
            self.stats["twins_skipped"] += 1
            return
        twin = self._twin_env
        if twin is None:
            if self._env_fn is None:  # set in __init__ whenever shadow is on
                return
            # One twin instance per wrapper, reset for every restore: building an env can
            # cost far more than replaying a prefix.
            twin = self._env_fn()
            if _contains_fidelity_check(twin):
                twin.close()
                raise FidelitySetupError(
                    "env_fn builds an env that contains a FidelityCheck; the twin must be the "
                    "plain env (FidelityCheck(make(), env_fn=make), not env_fn=lambda: "
                    "FidelityCheck(make()))."
                )
            self._twin_env = twin
        try:
            if route == "replay":
                t_obs, t_info = twin.reset(seed=rec["seed"], options=copy.deepcopy(rec["options"]))
                for i, a in enumerate(rec["actions"]):
                    t_obs, _, term, trunc, t_info = twin.step(copy.deepcopy(a))
                    if (term or trunc) and i != len(rec["actions"]) - 1:
                        self._violate(
                            Violation(
                                "shadow",
                                "episode end",
                                f"live episode went on past step {i + 1}",
                                f"replay ended at step {i + 1}",
                                rec["step"],
                                0,
                                "replaying the recorded actions from reset does not reach the "
                                "snapshotted state: the env is not deterministic given its seed",
                            )
                        )
                        return
            else:
                twin.reset(seed=0 if rec["seed"] is None else rec["seed"] + 1)
                t_obs, t_info = restore(twin, pickle.loads(pickle.dumps(snap)))
        except Exception:
            self._discard_twin_env()
            raise
        self.stats["twins"] += 1
        d = first_step_difference(
            (obs, strip_volatile(info, self._volatile)),
            (t_obs, strip_volatile(t_info, self._volatile)),
            fields=("obs", "info"),
            ignore=self._volatile,
        )
        if d is not None:
            self._violate(
                Violation(
                    "shadow",
                    d.path,
                    d.left,
                    d.right,
                    rec["step"],
                    0,
                    f"the restored state differs from a twin built by {route}",
                )
            )
            return
        if self._rng_excluded:
            # The stack declares its RNG outside the snapshot: continuations agree only in
            # distribution (branchgym.fidelity.suite's distributional mode tests that).
            return
        self._twin = _Twin(twin, route, rec["step"], self.shadow_steps)

    def _shadow_step(self, action: Any, out: tuple[Any, ...]) -> None:
        tw = self._twin
        if tw is None:
            return
        try:
            t_out = tw.env.step(copy.deepcopy(action))
        except Exception as exc:  # a twin that crashes where the live env did not
            self._close_twin()
            self._discard_twin_env()
            self._violate(
                Violation(
                    "shadow",
                    "exception",
                    "step succeeded",
                    f"{type(exc).__name__}: {exc}",
                    self._step,
                    self._step - tw.restored_at,
                    f"the {tw.route} twin raised on the same action",
                )
            )
            return
        self.stats["shadowed_steps"] += 1
        live = (
            out[0],
            float(out[1]),
            bool(out[2]),
            bool(out[3]),
            strip_volatile(out[4], self._volatile),
        )
        ref = (
            t_out[0],
            float(t_out[1]),
            bool(t_out[2]),
            bool(t_out[3]),
            strip_volatile(t_out[4], self._volatile),
        )
        d = first_step_difference(live, ref, ignore=self._volatile)
        since = self._step - tw.restored_at
        if d is not None:
            route = tw.route
            self._close_twin()
            self._violate(
                Violation(
                    "shadow",
                    d.path,
                    d.left,
                    d.right,
                    self._step,
                    since,
                    f"the restored env and a twin built by {route} diverged",
                )
            )
            return
        if tw.steps_left is not None:
            tw.steps_left -= 1
        if live[2] or live[3] or tw.steps_left == 0:
            self._close_twin()

    def _close_twin(self) -> None:
        """Stop following (the twin instance is kept for the next restore)."""
        self._twin = None

    def _discard_twin_env(self) -> None:
        if self._twin_env is not None:
            env, self._twin_env = self._twin_env, None
            try:
                env.close()
            except Exception:  # a twin that cannot close is not worth masking the cause
                pass

    def _violate(self, v: Violation) -> None:
        self.violations.append(v)
        if self.on_violation == "raise":
            raise FidelityViolation(f"snapshot fidelity violated: {v}", violation=v)
        if self.on_violation == "warn":
            warnings.warn(f"snapshot fidelity violated: {v}", FidelityWarning, stacklevel=3)
