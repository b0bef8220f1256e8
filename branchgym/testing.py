"""The snapshot-fidelity property suite: point it at any sandbox before training on it.

``check_snapshot_fidelity(env_fn)`` runs a Hypothesis ``RuleBasedStateMachine`` against
fresh instances from ``env_fn``. Its rules reset, step (actions drawn from the action
space, or from ``info["admissible_actions"]`` plus arbitrary strings for text envs), take
snapshots into a ``Bundle``, restore one (into the live env, into a fresh instance, or
through a pickle round trip) and release one. The *model* is the recorded action prefix
replayed on a fresh instance reset with the recorded seed; every step of the live env is
compared with the model's with :func:`branchgym.compare.first_step_difference`. A
failure shrinks to a short program that :class:`FidelityReport` prints ready to paste.

Modes:

* ``exact`` (the default for any env whose snapshots include its RNG): after a restore,
  every step must equal the model's step exactly.
* ``distributional``, for envs that declare ``snapshot_includes_rng = False`` (ALE's
  ``cloneState`` semantics: the state is restored, the random stream is not). Restores
  must still bring back the exact observation, info and ``state_digest``; continuations
  must agree *in distribution*. At ``points`` seeded snapshot states the suite draws
  ``samples`` continuations from the snapshot restored into instances with independent
  random streams, and ``samples`` continuations of the original state: fresh instances
  reset with other seeds and replayed through the same prefix, kept when they reach the
  same observation, info and digest (so their futures are independent draws from the
  true transition distribution). The statistical test is a two-sample *permutation test*
  whose statistic is the largest distance over continuation features (total variation
  for discrete features, Kolmogorov-Smirnov for float features). A permutation p-value is
  super-uniform under the null hypothesis, ``P(p <= a) <= a``, and each of the
  ``points`` tests is run at level ``alpha / points`` (Bonferroni), so a faithful env is
  flagged by one ``check_snapshot_fidelity`` call with probability at most ``alpha``
  (default 0.01).
* ``auto`` picks ``distributional`` when a layer of the stack declares
  ``snapshot_includes_rng = False``, else ``exact``.

Three entry points for sandbox authors: :func:`check_snapshot_fidelity` (returns a
:class:`FidelityReport`), ``branchgym check module:attr`` (prints it, exit 1 on failure),
and pytest: the ``snapshot_fidelity`` fixture and the ``branchgym_fidelity`` ini option of
the plugin :mod:`branchgym.pytest_plugin`, or ``test_fidelity = fidelity_test(MyEnv)``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import pickle
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from branchgym.checker import (
    ActionChooser,
    as_factory,
    rollout_actions,
    run_actions,
    strip_volatile,
    volatile_keys,
)
from branchgym.compare import first_difference, first_step_difference
from branchgym.core import restore, snapshot, state_digest
from branchgym.digest import stable_hash
from branchgym.error import (
    FidelitySetupError,
    FidelityViolation,
    SnapshotNotPicklableError,
    SnapshotReleasedError,
)
from branchgym.wrappers.fidelity import Violation, declares_rng_excluded

__all__ = [
    "FidelityReport",
    "DistributionResult",
    "PermutationResult",
    "check_snapshot_fidelity",
    "fidelity_machine",
    "fidelity_test",
    "permutation_test",
    "resolve_mode",
    "DEFAULT_MAX_EXAMPLES",
    "DEFAULT_STEPS",
]

EnvFactory = Callable[[], gym.Env]

#: Programs Hypothesis generates per check. Sized so that a fault on 1 % of steps is
#: caught (``branchgym scenarios``: ``rare_nondeterminism``) in a few seconds on toy envs.
DEFAULT_MAX_EXAMPLES = 100
#: Rules per program (Hypothesis' ``stateful_step_count``).
DEFAULT_STEPS = 30

_MODES = ("auto", "exact", "distributional")


# ------------------------------------------------------------------- bookkeeping


@dataclasses.dataclass
class _Stats:
    """Counters shared by every program of one check (Hypothesis builds many machines)."""

    examples: int = 0
    steps: int = 0
    snapshots: int = 0
    restores: int = 0
    fresh_restores: int = 0
    pickled: int = 0
    releases: int = 0
    failures: list[_Detected] = dataclasses.field(default_factory=list)
    first_detection_steps: int | None = None

    def record(self, exc: _Detected) -> None:
        if self.first_detection_steps is None:
            self.first_detection_steps = self.steps
        if len(self.failures) < 64:
            self.failures.append(exc)


@dataclasses.dataclass
class _Rec:
    """A snapshot in the Bundle, with what the model needs to reach its state again."""

    name: str  # name in the run that took it (what ops refer to)
    label: str  # name printed in this run's program
    snap: Any
    seed: int | None
    prefix: tuple[Any, ...]
    obs: Any
    info: dict[str, Any]
    digest: str | None
    done: bool
    released: bool = False

    def __repr__(self) -> str:  # Hypothesis prints bundle values; keep it short
        return self.name


class _Detected(FidelityViolation):
    """A violation raised inside the state machine, with the program that led to it."""

    def __init__(
        self, message: str, violation: Violation, program: str, ops: list[tuple[Any, ...]]
    ) -> None:
        super().__init__(message, violation=violation)
        self.program = program
        self.ops = ops


class _Invalid(Exception):
    """An operation does not apply in the current state (only when replaying a program)."""


def _literal(v: Any) -> str:
    """A Python expression for ``v`` that can be pasted into a test."""
    if isinstance(v, np.ndarray):
        return f"np.array({v.tolist()!r}, dtype=np.{v.dtype})"
    if isinstance(v, np.generic):
        return repr(v.item())
    return repr(v)


def _make_header(target: Any) -> list[str]:
    """Import lines and a ``make`` that builds the env, for the pasteable program."""
    head = ["import pickle", "import branchgym", "import numpy as np"]
    if isinstance(target, str):
        if ":" in target and "/" not in target.split(":", 1)[1]:
            module, attr = target.split(":", 1)
            return [*head, f"from {module} import {attr} as make"]
        return [*head, "import gymnasium as gym", f"make = lambda: gym.make({target!r})"]
    module = getattr(target, "__module__", None)
    qual = getattr(target, "__qualname__", "")
    if module and qual and "<" not in qual and "." not in qual:
        return [*head, f"from {module} import {qual} as make"]
    return [*head, f"make = ...  # the env factory you passed: {target!r:.80}"]


def _digest(env: gym.Env) -> str | None:
    try:
        return state_digest(env)
    except Exception:  # no canonical encoding of the state: the other checks still run
        return None


def resolve_mode(mode: str, env: gym.Env) -> str:
    """``exact`` or ``distributional`` for ``env``; ``auto`` reads the stack's declaration."""
    if mode not in _MODES:
        raise FidelitySetupError(
            f"mode={mode!r} is not one of {_MODES}; 'exact' compares continuations step by "
            "step, 'distributional' tests their distribution (envs whose snapshots leave "
            "the RNG out), 'auto' picks from snapshot_includes_rng."
        )
    if mode != "auto":
        return mode
    return "distributional" if declares_rng_excluded(env) else "exact"


# ---------------------------------------------------------------- action choice


def _draw_action(data: Any, space: gym.Space, info: dict[str, Any], text_noise: float) -> Any:
    """Draw an action: admissible actions when listed, else from the action space."""
    from hypothesis import strategies as st

    admissible = info.get("admissible_actions") if isinstance(info, dict) else None
    if admissible:
        if isinstance(space, gym.spaces.Text) and text_noise > 0:
            # Arbitrary strings exercise the invalid-action path; 1 in round(1/text_noise).
            if data.draw(st.integers(0, max(1, round(1 / text_noise)) - 1)) == 1:
                return data.draw(_text_strategy(space, 12))
        return data.draw(st.sampled_from(list(admissible)))
    if isinstance(space, gym.spaces.Discrete):
        start = int(space.start)
        return data.draw(st.integers(start, start + int(space.n) - 1))
    if isinstance(space, gym.spaces.Text):
        return data.draw(_text_strategy(space, 20))
    # Any other space: sample it with a drawn seed (shrinks towards seed 0), on a copy so
    # the env's own action-space RNG is left alone.
    seed = data.draw(st.integers(0, 2**31 - 1))
    sp = copy.deepcopy(space)
    sp.seed(seed)
    return sp.sample()


def _text_strategy(space: gym.spaces.Text, max_size: int) -> Any:
    from hypothesis import strategies as st

    chars = sorted(space.character_set)
    return st.text(
        alphabet=st.sampled_from(chars),
        min_size=int(space.min_length),
        max_size=max(int(space.min_length), min(int(space.max_length), max_size)),
    )


# ------------------------------------------------------------------ the machine


class _Program:
    """Live env vs model, one operation at a time; the Hypothesis rules drive it.

    Every operation is recorded as data (``self.ops``) and as a line of Python
    (``self.lines``), so a failing program can be replayed outside Hypothesis, shrunk
    further and printed.
    """

    def __init__(
        self,
        env_fn: EnvFactory,
        *,
        exact: bool,
        model: str,
        header: Sequence[str],
        stats: _Stats,
    ) -> None:
        self.env_fn = env_fn
        self.exact = exact
        self.model_kind = model
        self.header = list(header)
        self.stats = stats
        self.stats.examples += 1
        self.ops: list[tuple[Any, ...]] = []
        self.lines: list[str] = []
        self.envs: list[gym.Env] = []
        self.recs: dict[str, _Rec] = {}
        self.model: gym.Env | None = None
        self.reference: gym.Env | None = None
        self.seed: int | None = None
        self.prefix: list[Any] = []
        self.done = True
        self.obs: Any = None
        self.info: dict[str, Any] = {}
        self.restored_at: int | None = None  # episode step of the last restore
        self.lines.append("env = make()")
        self.live = self._fresh("make()")
        self.volatile = volatile_keys(self.live)

    # ------------------------------------------------------------------ helpers
    def render(self, failure: Violation | None = None) -> str:
        lines = self.header + self.lines
        if failure is not None:
            lines[-1] = f"{lines[-1]}  # <- FAILS: {failure.field}"
        return "\n".join(lines)

    def fail(self, v: Violation) -> None:
        exc = _Detected(f"snapshot fidelity violated: {v}", v, self.render(v), list(self.ops))
        self.stats.record(exc)
        raise exc

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (_Detected, _Invalid):
            raise
        except Exception as exc:
            self.fail(
                Violation(
                    "exception",
                    what,
                    f"{type(exc).__name__}: {exc}",
                    "no exception",
                    len(self.prefix),
                    self._since(),
                )
            )

    def _since(self) -> int | None:
        return None if self.restored_at is None else len(self.prefix) - self.restored_at

    def _fresh(self, what: str) -> gym.Env:
        env = self.call(what, self.env_fn)
        self.envs.append(env)
        return env

    def _close(self, env: gym.Env) -> None:
        if env in self.envs:
            self.envs.remove(env)
        try:
            env.close()
        except Exception:  # closing is best effort; a crash here is not a fidelity issue
            pass

    def _model_env(self) -> gym.Env:
        if self.model_kind == "reuse":
            if self.reference is None:
                self.reference = self._fresh("make() [model]")
            return self.reference
        if self.model is not None:
            self._close(self.model)
        return self._fresh("make() [model]")

    def _drop_model(self) -> None:
        if self.model is not None and self.model is not self.reference:
            self._close(self.model)
        self.model = None

    def _replay(self, seed: int, prefix: Sequence[Any]) -> tuple[gym.Env, Any, dict]:
        m = self._model_env()
        obs, info = self.call("model.reset", lambda: m.reset(seed=seed))
        for a in prefix:
            obs, *_, info = self.call("model.step", lambda a=a: m.step(copy.deepcopy(a)))
        return m, obs, strip_volatile(info, self.volatile)

    def _rec(self, name: str) -> _Rec:
        rec = self.recs.get(name)
        if rec is None or rec.released:
            raise _Invalid(name)
        return rec

    def _after_restore(self, rec: _Rec, obs: Any, info: dict[str, Any], how: str) -> None:
        self.stats.restores += 1
        info = strip_volatile(info, self.volatile)
        at = len(rec.prefix)
        d = first_step_difference(
            (obs, info), (rec.obs, rec.info), fields=("obs", "info"), ignore=self.volatile
        )
        if d is not None:
            self.fail(
                Violation(
                    "restore",
                    d.path,
                    d.left,
                    d.right,
                    at,
                    0,
                    f"{how} did not bring back the observation {rec.label} was taken at",
                )
            )
        if rec.digest is not None:
            now = _digest(self.live)
            if now is not None and now != rec.digest:
                self.fail(
                    Violation(
                        "digest",
                        "state_digest",
                        now,
                        rec.digest,
                        at,
                        0,
                        f"the state after {how} differs from the state {rec.label} was taken "
                        "at: the snapshot aliases live state, or restore misses a field",
                    )
                )
        self.seed, self.prefix, self.done = rec.seed, list(copy.deepcopy(rec.prefix)), rec.done
        self.obs, self.info, self.restored_at = obs, info, at
        if not self.exact or rec.seed is None:
            # Distributional mode: the restored random stream legitimately differs, so the
            # model stops until the next reset (the distribution phase tests this case).
            self._drop_model()
            return
        self.model, m_obs, m_info = self._replay(rec.seed, rec.prefix)
        d = first_step_difference(
            (m_obs, m_info), (rec.obs, rec.info), fields=("obs", "info"), ignore=self.volatile
        )
        if d is not None:
            self.fail(
                Violation(
                    "replay",
                    d.path,
                    d.right,
                    d.left,
                    at,
                    0,
                    f"a fresh instance reset with seed {rec.seed} and replayed through the "
                    f"{at} recorded action(s) does not reach the state {rec.label} was taken "
                    "at: the env is not deterministic given its seed and actions",
                )
            )

    # --------------------------------------------------------------- operations
    def op_reset(self, seed: int) -> None:
        self.ops.append(("reset", seed))
        self.lines.append(f"env.reset(seed={seed})")
        obs, info = self.call("env.reset", lambda: self.live.reset(seed=seed))
        info = strip_volatile(info, self.volatile)
        self.seed, self.prefix, self.done, self.restored_at = seed, [], False, None
        self.obs, self.info = obs, info
        self.model, m_obs, m_info = self._replay(seed, [])
        d = first_step_difference(
            (obs, info), (m_obs, m_info), fields=("obs", "info"), ignore=self.volatile
        )
        if d is not None:
            self.fail(
                Violation(
                    "determinism",
                    d.path,
                    d.left,
                    d.right,
                    0,
                    None,
                    f"a fresh instance reset with seed {seed} starts elsewhere: reset(seed) "
                    "does not determine the episode",
                )
            )

    def op_step(self, action: Any) -> None:
        if self.done:
            raise _Invalid("step after the episode ended")
        self.ops.append(("step", copy.deepcopy(action)))
        self.lines.append(f"env.step({_literal(action)})")
        out = self.call("env.step", lambda: run_actions(self.live, [action]))[0]
        self.stats.steps += 1
        self.prefix.append(copy.deepcopy(action))
        m = self.model
        if m is not None:
            ref = self.call("model.step", lambda: run_actions(m, [copy.deepcopy(action)]))[0]
            d = first_step_difference(out, ref, ignore=self.volatile)
            if d is not None:
                since = self._since()
                if since is None:
                    self.fail(
                        Violation(
                            "determinism",
                            d.path,
                            d.left,
                            d.right,
                            len(self.prefix),
                            None,
                            f"a fresh instance reset with seed {self.seed} and given the same "
                            "actions diverged with no snapshot involved: the env is not "
                            "deterministic given its seed and actions",
                        )
                    )
                self.fail(
                    Violation(
                        "continuation",
                        d.path,
                        d.left,
                        d.right,
                        len(self.prefix),
                        since,
                        f"the restored env diverged from a fresh instance reset with seed "
                        f"{self.seed} and replayed through the same {len(self.prefix) - 1} "
                        "action(s)",
                    )
                )
        self.obs, self.info = out[0], out[4]
        self.done = bool(out[2] or out[3])

    def op_snapshot(self, name: str | None = None) -> _Rec:
        label = f"s{len(self.recs)}"
        name = name or label
        self.ops.append(("snapshot", name))
        self.lines.append(f"{label} = branchgym.snapshot(env)")
        snap = self.call("branchgym.snapshot", lambda: snapshot(self.live))
        self.stats.snapshots += 1
        rec = _Rec(
            name,
            label,
            snap,
            self.seed,
            tuple(copy.deepcopy(self.prefix)),
            copy.deepcopy(self.obs),
            copy.deepcopy(self.info),
            _digest(self.live),
            self.done,
        )
        self.recs[name] = rec
        return rec

    def op_restore(self, name: str) -> None:
        rec = self._rec(name)
        self.ops.append(("restore", name))
        self.lines.append(f"branchgym.restore(env, {rec.label})")
        obs, info = self.call("branchgym.restore", lambda: restore(self.live, rec.snap))
        self._after_restore(rec, obs, info, "restore()")

    def op_restore_fresh(self, name: str, seed: int) -> None:
        rec = self._rec(name)
        self.ops.append(("restore_fresh", name, seed))
        self.lines.append("env = make()")
        new = self._fresh("make()")
        self.lines.append(f"env.reset(seed={seed})")
        self.call("env.reset", lambda: new.reset(seed=seed))
        self.lines.append(f"branchgym.restore(env, {rec.label})")
        self.live = new
        obs, info = self.call("branchgym.restore", lambda: restore(new, rec.snap))
        self.stats.fresh_restores += 1
        self._after_restore(rec, obs, info, "restore() into a fresh instance")

    def op_restore_pickled(self, name: str) -> None:
        rec = self._rec(name)
        self.ops.append(("restore_pickled", name))
        if not rec.snap.picklable:
            self.lines.append(f"pickle.dumps({rec.label})  # raises SnapshotNotPicklableError")
            try:
                pickle.dumps(rec.snap)
            except SnapshotNotPicklableError:
                return
            except Exception as exc:
                self.fail(
                    Violation(
                        "pickle",
                        "pickle.dumps",
                        f"{type(exc).__name__}: {exc}",
                        "SnapshotNotPicklableError",
                        len(rec.prefix),
                        None,
                        "a snapshot with picklable=False must refuse with the typed error",
                    )
                )
            self.fail(
                Violation(
                    "pickle",
                    "pickle.dumps",
                    "pickled",
                    "SnapshotNotPicklableError",
                    len(rec.prefix),
                    None,
                    "the snapshot says picklable=False but pickled",
                )
            )
        self.lines.append(f"branchgym.restore(env, pickle.loads(pickle.dumps({rec.label})))")
        clone = self.call("pickle round trip", lambda: pickle.loads(pickle.dumps(rec.snap)))
        try:
            obs, info = self.call("branchgym.restore", lambda: restore(self.live, clone))
        finally:
            clone.release()
        self.stats.pickled += 1
        self._after_restore(rec, obs, info, "restore() of a pickled copy")

    def op_release(self, name: str) -> None:
        rec = self._rec(name)
        self.ops.append(("release", name))
        self.lines.append(f"{rec.label}.release()")
        self.call(f"{rec.label}.release()", rec.snap.release)
        rec.released = True
        self.stats.releases += 1
        before = _digest(self.live)
        try:
            restore(self.live, rec.snap)
        except SnapshotReleasedError:
            pass
        except Exception as exc:
            self.lines.append(f"branchgym.restore(env, {rec.label})")
            self.fail(
                Violation(
                    "release",
                    "restore(released snapshot)",
                    f"{type(exc).__name__}: {exc}",
                    "SnapshotReleasedError",
                    len(self.prefix),
                    None,
                )
            )
        else:
            self.lines.append(f"branchgym.restore(env, {rec.label})")
            self.fail(
                Violation(
                    "release",
                    "restore(released snapshot)",
                    "restored",
                    "SnapshotReleasedError",
                    len(self.prefix),
                    None,
                    "a released snapshot must refuse to restore",
                )
            )
        after = _digest(self.live)
        if before is not None and after != before:
            self.fail(
                Violation(
                    "release",
                    "state_digest",
                    after,
                    before,
                    len(self.prefix),
                    None,
                    "a refused restore of a released snapshot changed the env",
                )
            )

    def close(self) -> None:
        for rec in self.recs.values():
            if not rec.released:
                try:
                    rec.snap.release()
                except Exception:  # the program is over; free what can be freed
                    pass
        for env in list(self.envs):
            self._close(env)

    def run(self, ops: Sequence[tuple[Any, ...]]) -> None:
        """Execute recorded operations (raises ``_Detected`` or ``_Invalid``)."""
        if not ops or ops[0][0] != "reset":
            raise _Invalid("a program starts with reset()")
        for kind, *args in ops:
            getattr(self, f"op_{kind}")(*args)


def fidelity_machine(
    env_fn: EnvFactory,
    *,
    mode: str = "exact",
    model: str = "reuse",
    text_noise: float = 0.1,
    header: Sequence[str] = ("make = ...",),
    stats: _Stats | None = None,
) -> type:
    """Build the Hypothesis ``RuleBasedStateMachine`` class for ``env_fn``.

    Rules: ``reset(seed)``, ``step`` (1-8 drawn actions), ``take_snapshot`` into the
    ``snapshots`` Bundle, ``restore``, ``fork`` (restore, then 1-8 steps: a sibling
    rollout), ``restore_in_fresh_instance``, ``restore_pickled`` and ``release`` (which
    consumes the snapshot). Use it directly with Hypothesis
    (``TestMyEnv = fidelity_machine(MyEnv).TestCase``) or through
    :func:`check_snapshot_fidelity`, which also shrinks further and renders the report.

    Args:
        env_fn: Zero-argument factory of fresh env instances.
        mode: ``exact`` or ``distributional`` (see the module docstring).
        model: ``reuse`` (default): one reference instance per program, reset with the
            recorded seed and replayed for every comparison; ``fresh``: a new instance for
            every replay (slower; also catches state that survives ``reset``).
        text_noise: Share of text actions drawn as arbitrary strings instead of
            admissible actions.
        header: First lines of the rendered program (imports and ``make``).
        stats: Shared counters (created if not given).
    """
    from hypothesis import strategies as st
    from hypothesis.stateful import (
        Bundle,
        RuleBasedStateMachine,
        consumes,
        initialize,
        precondition,
        rule,
    )

    if mode not in ("exact", "distributional"):
        raise FidelitySetupError(f"fidelity_machine mode must be exact or distributional: {mode}")
    if model not in ("fresh", "reuse"):
        raise FidelitySetupError(f"model={model!r} must be 'fresh' or 'reuse'")
    counters = stats if stats is not None else _Stats()
    seeds = st.integers(0, 1000)

    class SnapshotFidelityMachine(RuleBasedStateMachine):
        """Live env vs a model replayed from the recorded seed and action prefix."""

        snapshots = Bundle("snapshots")
        stats = counters

        def __init__(self) -> None:
            super().__init__()
            self.p = _Program(
                env_fn, exact=mode == "exact", model=model, header=header, stats=self.stats
            )

        @initialize(seed=seeds)
        def start(self, seed: int) -> None:
            self.p.op_reset(seed)

        @rule(seed=seeds)
        def reset(self, seed: int) -> None:
            self.p.op_reset(seed)

        @precondition(lambda self: not self.p.done)
        @rule(data=st.data(), n=st.integers(1, 8))
        def step(self, data: Any, n: int) -> None:
            for _ in range(n):
                if self.p.done:
                    return
                self.p.op_step(
                    _draw_action(data, self.p.live.action_space, self.p.info, text_noise)
                )

        @rule(target=snapshots)
        def take_snapshot(self) -> _Rec:
            return self.p.op_snapshot()

        @rule(rec=snapshots)
        def restore(self, rec: _Rec) -> None:
            self.p.op_restore(rec.name)

        @rule(rec=snapshots, data=st.data(), n=st.integers(1, 8))
        def fork(self, rec: _Rec, data: Any, n: int) -> None:
            # A sibling rollout, the pattern branching learners use: restore, then step.
            self.p.op_restore(rec.name)
            self.step(data, n)

        @rule(rec=snapshots, seed=seeds)
        def restore_in_fresh_instance(self, rec: _Rec, seed: int) -> None:
            self.p.op_restore_fresh(rec.name, seed)

        @rule(rec=snapshots)
        def restore_pickled(self, rec: _Rec) -> None:
            self.p.op_restore_pickled(rec.name)

        @rule(rec=consumes(snapshots))
        def release(self, rec: _Rec) -> None:
            self.p.op_release(rec.name)

        def teardown(self) -> None:
            self.p.close()

    SnapshotFidelityMachine.program_args = {  # what _post_shrink needs to replay programs
        "env_fn": env_fn,
        "exact": mode == "exact",
        "model": model,
        "header": list(header),
    }
    return SnapshotFidelityMachine


def _run_ops(args: dict[str, Any], ops: Sequence[tuple[Any, ...]]) -> _Detected | None | str:
    """Replay ``ops`` on fresh instances: the failure, ``None`` (passed) or ``"invalid"``."""
    p = _Program(
        args["env_fn"],
        exact=args["exact"],
        model=args["model"],
        header=args["header"],
        stats=_Stats(),
    )
    try:
        p.run(ops)
    except _Detected as exc:
        return exc
    except _Invalid:
        return "invalid"
    finally:
        p.close()
    return None


def _prune(ops: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Drop operations on snapshots whose ``snapshot`` operation was removed."""
    defined: set[str] = set()
    out = []
    for op in ops:
        if op[0] == "snapshot":
            defined.add(op[1])
        elif op[0] in ("restore", "restore_fresh", "restore_pickled", "release"):
            if op[1] not in defined:
                continue
        out.append(op)
    return out


def _post_shrink(args: dict[str, Any], found: _Detected, deadline: float) -> tuple[_Detected, bool]:
    """Greedy deletion of operations (chunks of 8, 4, 2, 1) while the program still fails.

    Hypothesis has shrunk the program already; this pass is cheap insurance for slow envs,
    where Hypothesis' shrinker runs out of time first. Returns the smallest failure and
    whether ``found`` itself failed again when replayed.
    """
    first = _run_ops(args, found.ops)
    if not isinstance(first, _Detected):
        return found, False
    best = first
    changed = True
    while changed and time.perf_counter() < deadline:
        changed = False
        for size in (8, 4, 2, 1):
            i = 0
            while i < len(best.ops) and time.perf_counter() < deadline:
                cand = _prune(best.ops[:i] + best.ops[i + size :])
                res = _run_ops(args, cand) if len(cand) < len(best.ops) else None
                if isinstance(res, _Detected):
                    best, changed = res, True
                else:
                    i += 1
    return best, True


# ------------------------------------------------------------ distribution phase


@dataclasses.dataclass(frozen=True)
class PermutationResult:
    """Outcome of :func:`permutation_test`."""

    p_value: float
    statistic: float
    feature: str
    summary_a: str
    summary_b: str


def _category(v: Any) -> str:
    try:
        return stable_hash(v)
    except TypeError:
        return repr(v)


def _features(samples: Sequence[Sequence[tuple[Any, ...]]]) -> list[tuple[str, str, list[Any]]]:
    """Per-step features of continuations: (name, 'num' | 'cat', one value per sample)."""
    horizon = max((len(s) for s in samples), default=0)
    out: list[tuple[str, str, list[Any]]] = []
    names = ("obs", "reward", "terminated", "truncated", "info")
    for j in range(horizon):
        for f, name in enumerate(names):
            vals = [s[j][f] if j < len(s) else _ENDED for s in samples]
            present = [v for v in vals if v is not _ENDED]
            label = f"step {j + 1} {name}"
            if present and all(isinstance(v, float | np.floating) for v in present):
                out.append((label, "num", vals))
            elif (
                present
                and all(isinstance(v, np.ndarray) for v in present)
                and np.issubdtype(np.asarray(present[0]).dtype, np.floating)
                and len({np.shape(v) for v in present}) == 1
                and np.size(present[0]) <= 16
            ):
                for c in range(int(np.size(present[0]))):
                    comp = [np.ravel(v)[c] if v is not _ENDED else _ENDED for v in vals]
                    out.append((f"{label}[{c}]", "num", comp))
            else:
                out.append((label, "cat", vals))
    return out


class _Ended:
    def __repr__(self) -> str:
        return "<episode ended>"


_ENDED = _Ended()


def _tv_distance(member: np.ndarray, codes: np.ndarray, na: int, nb: int) -> np.ndarray:
    onehot = np.zeros((codes.size, int(codes.max()) + 1))
    onehot[np.arange(codes.size), codes] = 1.0
    counts_a = member.astype(float) @ onehot
    counts_b = onehot.sum(axis=0) - counts_a
    return 0.5 * np.abs(counts_a / na - counts_b / nb).sum(axis=1)


def _ks_distance(member: np.ndarray, values: np.ndarray, na: int, nb: int) -> np.ndarray:
    order = np.argsort(values, kind="stable")
    v = values[order]
    last = np.flatnonzero(np.r_[v[1:] != v[:-1], True])  # ECDFs jump after each tie group
    cum_a = np.cumsum(member[:, order], axis=1)[:, last].astype(float)
    cum_b = (last + 1)[None, :] - cum_a
    return np.abs(cum_a / na - cum_b / nb).max(axis=1)


def _describe(kind: str, vals: Sequence[Any]) -> str:
    if kind == "num":
        x = np.array([v for v in vals if v is not _ENDED], dtype=float)
        ended = sum(v is _ENDED for v in vals)
        tail = f", {ended} ended" if ended else ""
        if x.size == 0:
            return f"all {ended} ended"
        return f"mean {x.mean():.4g}, sd {x.std():.3g}, {np.unique(x).size} distinct{tail}"
    counts: dict[str, tuple[int, Any]] = {}
    for v in vals:
        k = _category(v) if v is not _ENDED else "<ended>"
        n, rep = counts.get(k, (0, v))
        counts[k] = (n + 1, rep)
    top = sorted(counts.values(), key=lambda t: -t[0])[:3]
    parts = [f"{n}x {repr(rep)[:40]}" for n, rep in top]
    more = f" +{len(counts) - 3} more" if len(counts) > 3 else ""
    return f"{len(vals)} samples: " + ", ".join(parts) + more


def permutation_test(
    a: Sequence[Sequence[tuple[Any, ...]]],
    b: Sequence[Sequence[tuple[Any, ...]]],
    *,
    permutations: int = 1999,
    seed: int = 0,
) -> PermutationResult:
    """Two-sample permutation test that continuations ``a`` and ``b`` share one distribution.

    Each continuation is a list of step tuples (as :func:`branchgym.checker.run_actions`
    returns). Features are each step's observation, reward, terminated, truncated and
    info; the statistic is the largest distance over features: Kolmogorov-Smirnov for
    float features (episode end counts as -inf), total variation for the rest. Its null
    distribution comes from ``permutations`` random relabellings of the pooled samples,
    so ``p = (1 + #{permuted >= observed}) / (1 + permutations)`` satisfies
    ``P(p <= alpha) <= alpha`` for any alpha when both samples come from one distribution.
    """
    na, nb = len(a), len(b)
    if na == 0 or nb == 0:
        raise FidelitySetupError("permutation_test needs at least one sample on each side")
    n = na + nb
    rng = np.random.default_rng(seed)
    member = np.zeros((permutations + 1, n), dtype=bool)
    member[0, :na] = True
    perms = np.argsort(rng.random((permutations, n)), axis=1)[:, :na]
    member[np.arange(1, permutations + 1)[:, None], perms] = True
    stat = np.zeros(permutations + 1)
    best = ("", "cat", [])
    best_obs = -1.0
    for name, kind, vals in _features(list(a) + list(b)):
        if kind == "num":
            x = np.array([-np.inf if v is _ENDED else float(v) for v in vals])
            d = _ks_distance(member, x, na, nb)
        else:
            _, codes = np.unique(
                np.array([_category(v) if v is not _ENDED else "<ended>" for v in vals]),
                return_inverse=True,
            )
            d = _tv_distance(member, codes.ravel(), na, nb)
        stat = np.maximum(stat, d)
        if d[0] > best_obs:
            best_obs, best = float(d[0]), (name, kind, vals)
    p = float((1 + np.sum(stat[1:] >= stat[0] - 1e-12)) / (permutations + 1))
    name, kind, vals = best
    return PermutationResult(
        p,
        float(stat[0]),
        name,
        _describe(kind, vals[:na]) if vals else "",
        _describe(kind, vals[na:]) if vals else "",
    )


@dataclasses.dataclass(frozen=True)
class DistributionResult:
    """One snapshot state tested in distributional mode.

    Attributes:
        seed: Reset seed of the state's episode.
        prefix: Actions from reset to the state.
        verdict: ``exact`` (every restored continuation equals the replayed one: the RNG is
            in fact restored), ``same`` (p above the level), ``differs`` (a violation) or
            ``inconclusive`` (too few replays reached the state to build the reference).
        p_value: The permutation p-value (``None`` unless tested).
        level: The per-test level ``alpha / points``.
        restored: Continuations drawn from restores.
        reference: Continuations of the original state found by replay.
        tries: Replays attempted to build the reference.
        test: The permutation test's outcome.
    """

    seed: int
    prefix: tuple[Any, ...]
    verdict: str
    p_value: float | None
    level: float
    restored: int
    reference: int
    tries: int
    test: PermutationResult | None = None


def _walk_prefix(env_fn: EnvFactory, seed: int, length: int) -> list[Any]:
    """Seeded actions from reset that keep the episode running (the last live state)."""
    env = env_fn()
    try:
        _, info = env.reset(seed=seed)
        chooser = ActionChooser(env, seed)
        prefix: list[Any] = []
        for _ in range(length):
            a = chooser(info)
            _, _, term, trunc, info = env.step(a)
            if term or trunc:
                break
            prefix.append(a)
        return prefix
    finally:
        env.close()


def _replay_to(env: gym.Env, seed: int, prefix: Sequence[Any]) -> tuple[Any, dict, bool]:
    obs, info = env.reset(seed=seed)
    for a in prefix:
        obs, _, term, trunc, info = env.step(copy.deepcopy(a))
        if term or trunc:
            return obs, info, False
    return obs, info, True


def _distribution_phase(
    env_fn: EnvFactory,
    *,
    seed: int,
    points: int,
    samples: int,
    permutations: int,
    alpha: float,
    horizon: int,
    max_prefix: int,
    stats: _Stats,
    header: Sequence[str],
) -> tuple[list[DistributionResult], Violation | None, str | None]:
    level = alpha / max(1, points)
    results: list[DistributionResult] = []
    for i in range(points):
        s = 10_000 * seed + 101 * i
        prefix = _walk_prefix(env_fn, s, int(np.random.default_rng(s).integers(0, max_prefix + 1)))
        env, model, r_env, f_env = env_fn(), env_fn(), env_fn(), env_fn()
        try:
            volatile = volatile_keys(env)
            obs, info, _ = _replay_to(env, s, prefix)
            info = strip_volatile(info, volatile)
            digest = _digest(env)
            snap = snapshot(env)
            stats.snapshots += 1
            _, m_info, _ = _replay_to(model, s, prefix)
            actions = rollout_actions(model, m_info, ActionChooser(model, s + 1), horizon)
            _replay_to(model, s, prefix)
            exact = run_actions(model, actions)
            restored = []
            for j in range(samples):
                r_env.reset(seed=s + 1 + j)
                restore(r_env, snap)
                stats.restores += 1
                restored.append(run_actions(r_env, actions))
                stats.steps += len(restored[-1])
            snap.release()
            if all(first_difference(c, exact, ignore=volatile) is None for c in restored):
                results.append(
                    DistributionResult(s, tuple(prefix), "exact", None, level, samples, 0, 0)
                )
                continue
            reference, tries = [], 0
            while len(reference) < samples and tries < 20 * samples:
                tries += 1
                o, inf, alive = _replay_to(f_env, s + 100_000 + tries, prefix)
                if not alive or first_step_difference(
                    (o, strip_volatile(inf, volatile)),
                    (obs, info),
                    fields=("obs", "info"),
                    ignore=volatile,
                ):
                    continue
                if digest is not None and _digest(f_env) != digest:
                    continue
                reference.append(run_actions(f_env, actions))
            if len(reference) < min(samples, 16):
                results.append(
                    DistributionResult(
                        s,
                        tuple(prefix),
                        "inconclusive",
                        None,
                        level,
                        samples,
                        len(reference),
                        tries,
                    )
                )
                continue
            test = permutation_test(restored, reference, permutations=permutations, seed=s)
            verdict = "differs" if test.p_value <= level else "same"
            results.append(
                DistributionResult(
                    s,
                    tuple(prefix),
                    verdict,
                    test.p_value,
                    level,
                    samples,
                    len(reference),
                    tries,
                    test,
                )
            )
            if verdict == "differs":
                v = Violation(
                    "distribution",
                    test.feature,
                    test.summary_a,
                    test.summary_b,
                    len(prefix),
                    None,
                    f"continuations restored from the snapshot and continuations of the original "
                    f"state differ in distribution: permutation p = {test.p_value:.2g} <= "
                    f"{level:.2g} (= alpha {alpha} / {points} states)",
                )
                lines = list(header) + ["env = make()", f"env.reset(seed={s})"]
                lines += [f"env.step({_literal(a)})" for a in prefix]
                lines += [
                    "snap = branchgym.snapshot(env)",
                    f"# continue with {[_literal(a) for a in actions]} from:",
                    f"#   {samples} instances reset with seeds {s + 1}.. and restored from snap",
                    f"#   vs {len(reference)} instances reset with other seeds that reach the "
                    "same state by replay",
                ]
                text = "\n".join(lines)
                stats.record(_Detected(f"snapshot fidelity violated: {v}", v, text, []))
                return results, v, text
        finally:
            for e in (env, model, r_env, f_env):
                e.close()
    return results, None, None


_rollout = rollout_actions  # former private copy of checker.rollout_actions


# ------------------------------------------------------------------------ report


_HINTS = {
    "determinism": (
        "The env is not deterministic given reset(seed) and the actions: a fresh instance "
        "running the same program diverged with no snapshot involved. Look for unseeded "
        "RNGs (random, np.random without the env's np_random), wall-clock reads, background "
        "threads, network calls and module-level state shared between instances."
    ),
    "restore": (
        "restore() does not bring back the observation the snapshot was taken at: it misses "
        "part of the state, or the observation is computed from state outside the snapshot."
    ),
    "digest": (
        "The state changed between snapshot and restore: the snapshot shares mutable state "
        "with the live env (copy lists/dicts/arrays in _get_state), or restore misses a "
        "field the digest covers."
    ),
    "continuation": (
        "The restored env behaves differently from the original state although restore "
        "brought back the same observation: state outside the snapshot (an RNG not captured, "
        "a cache, a file, a wrapper counter, module globals, a thread)."
    ),
    "replay": (
        "Replaying the recorded actions from reset(seed) on a fresh instance does not reach "
        "the snapshotted state: the env is not deterministic given its seed and actions."
    ),
    "pickle": "Declare snapshot_picklable truthfully; non-picklable snapshots must refuse.",
    "release": "A released snapshot must raise SnapshotReleasedError and leave the env as is.",
    "exception": (
        "The env raised where the program expected a normal call: a restore left it in an "
        "inconsistent state, or it crashes on valid input."
    ),
    "distribution": (
        "Restored continuations do not follow the transition distribution of the original "
        "state: restore corrupts part of the state, or re-seeds the RNG to a fixed value."
    ),
}


@dataclasses.dataclass
class FidelityReport:
    """What :func:`check_snapshot_fidelity` found. ``ok`` is False on any violation.

    Attributes:
        env: The env checked (id, ``module:attr`` or factory name).
        mode: ``exact`` or ``distributional``.
        seed: Hypothesis seed.
        violations: The violation of the shrunk program (one: Hypothesis reports the
            smallest failing program), or of the distribution phase.
        program: The failing program as pasteable Python (``None`` when ok).
        reproduced: Whether the shrunk program fails every time it is replayed (``False``:
            the divergence depends on something outside the seed and the actions, such as
            unseeded randomness, the clock or threads); ``None`` when ok or not replayable.
        replays: ``(failed, run)``: replays of the final program and how many failed.
        examples: Programs run. ``steps``, ``snapshots``, ``restores`` (of which
            ``fresh_restores`` into new instances and ``pickled`` through pickle) and
            ``releases`` count the operations.
        first_detection_steps: Env steps taken before the first violation was seen.
        distribution: Per-state results of the distributional phase.
        seconds: Wall-clock time of the check.
    """

    env: str
    mode: str
    seed: int
    max_examples: int
    violations: list[Violation]
    program: str | None
    reproduced: bool | None
    examples: int
    steps: int
    snapshots: int
    restores: int
    fresh_restores: int
    pickled: int
    releases: int
    first_detection_steps: int | None
    replays: tuple[int, int]
    distribution: list[DistributionResult]
    seconds: float
    alpha: float = 0.01

    @property
    def ok(self) -> bool:
        """True when nothing diverged."""
        return not self.violations

    def __str__(self) -> str:
        head = f"check_snapshot_fidelity: {self.env} ({self.mode} mode, seed {self.seed})"
        ops = (
            f"  {self.examples} programs, {self.steps} steps, {self.snapshots} snapshots, "
            f"{self.restores} restores ({self.fresh_restores} into fresh instances, "
            f"{self.pickled} pickled), {self.releases} releases in {self.seconds:.1f} s"
        )
        lines = [head, ops]
        if self.distribution:
            counts: dict[str, int] = {}
            for r in self.distribution:
                counts[r.verdict] = counts.get(r.verdict, 0) + 1
            verdicts = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
            lines.append(
                f"  distribution: {len(self.distribution)} states ({verdicts}); permutation "
                f"test at level alpha/{len(self.distribution)}, family-wise false-positive "
                f"rate <= {self.alpha}"
            )
        if self.ok:
            lines.append("  OK")
            return "\n".join(lines)
        v = self.violations[0]
        lines.append(f"  FAILED after {self.first_detection_steps} steps")
        lines.append(f"  violation: {v}")
        hint = _HINTS.get(v.check)
        if hint:
            lines.append(f"  likely cause: {hint}")
        failed, run = self.replays
        if run:
            lines.append(f"  the program below failed {failed} of {run} replays")
        if self.reproduced is False:
            lines.append(
                "  it does not fail every time: the divergence comes from something outside "
                "the seed and the actions (unseeded randomness, the clock, threads, "
                "process-global state)"
            )
        if self.program:
            lines.append("  program (paste into a test; `make` builds the env):")
            lines += [f"    {line}" for line in self.program.splitlines()]
        return "\n".join(lines)


def check_snapshot_fidelity(
    env_fn: EnvFactory | str,
    *,
    max_examples: int = DEFAULT_MAX_EXAMPLES,
    seed: int = 0,
    mode: str = "auto",
    steps: int = DEFAULT_STEPS,
    model: str = "reuse",
    alpha: float = 0.01,
    points: int = 5,
    samples: int = 48,
    permutations: int = 1999,
    horizon: int = 50,
    max_prefix: int = 3,
    shrink_seconds: float = 10.0,
    reproduce: int = 3,
) -> FidelityReport:
    """Run the property suite on ``env_fn`` and report.

    Args:
        env_fn: Zero-argument factory (an env class, ``lambda: MyEnv(...)``), or a string:
            a registered id or ``module:attr``.
        max_examples: Programs Hypothesis generates (before shrinking a failure).
        seed: Seed of Hypothesis and of the distribution phase: same seed, same programs.
        mode: ``auto`` (default), ``exact`` or ``distributional`` (module docstring).
        steps: Rules per program.
        model: ``fresh`` or ``reuse`` (see :func:`fidelity_machine`).
        alpha: Family-wise false-positive rate of the distribution phase.
        points: Snapshot states tested in distributional mode.
        samples: Continuations drawn on each side per state.
        permutations: Permutations of the test (its smallest p-value is 1/(1+permutations)).
        horizon: Longest continuation compared in distributional mode.
        max_prefix: Longest action prefix before a distributional snapshot (replays must
            reach the same state by chance, which gets rarer with depth).
        shrink_seconds: Time spent shrinking a failure: half for Hypothesis' shrinker (its
            own default is 5 minutes), half for a greedy pass that deletes operations from
            the program; the report shows the smallest failing program found by then.
            0 turns shrinking off (detection only, as ``branchgym scenarios`` does).
        reproduce: Times the final program is replayed to tell a deterministic fault
            (fails every time) from nondeterminism (fails sometimes).

    Returns:
        A :class:`FidelityReport`; ``report.ok`` is the verdict, ``str(report)`` explains it.
    """
    from hypothesis import HealthCheck, Phase, Verbosity, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.errors import Flaky
    from hypothesis.stateful import run_state_machine_as_test

    if max_examples < 1 or steps < 1:
        raise FidelitySetupError("max_examples and steps must be >= 1")
    if points * alpha > 0 and permutations + 1 < points / alpha:
        raise FidelitySetupError(
            f"permutations={permutations} cannot reach p <= alpha/points = {alpha / points:.2g}; "
            f"use at least {int(np.ceil(points / alpha))} permutations"
        )
    name, factory = as_factory(env_fn)
    header = _make_header(env_fn)
    t0 = time.perf_counter()
    probe = factory()
    try:
        resolved = resolve_mode(mode, probe)
    finally:
        probe.close()
    stats = _Stats()
    machine = fidelity_machine(factory, mode=resolved, model=model, header=header, stats=stats)
    hypothesis_seed(seed)(machine)
    config = settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
        verbosity=Verbosity.quiet,
        print_blob=False,
        phases=(Phase.explicit, Phase.reuse, Phase.generate)
        + ((Phase.shrink,) if shrink_seconds > 0 else ()),
    )
    violations: list[Violation] = []
    program: str | None = None
    reproduced: bool | None = None
    replays = (0, 0)
    found: _Detected | None = None
    with _shrink_budget(shrink_seconds / 2):
        try:
            run_state_machine_as_test(machine, settings=config)
        except _Detected as exc:
            found = exc
        except Flaky:
            # Hypothesis saw a failure that vanished on replay; keep the shortest one seen.
            found = min(stats.failures, key=lambda f: len(f.ops))
    if found is not None:
        args = machine.program_args
        best, again = found, True
        if shrink_seconds > 0:
            best, again = _post_shrink(args, found, time.perf_counter() + shrink_seconds / 2)
        # How reproducible is the final program? Nondeterministic envs fail only sometimes.
        outcomes = [_run_ops(args, best.ops) for _ in range(reproduce)]
        failed = sum(isinstance(o, _Detected) for o in outcomes)
        replays = (failed, reproduce)
        reproduced = (again and failed == reproduce) if reproduce else None
        violations, program = [best.violation], best.program
    distribution: list[DistributionResult] = []
    if resolved == "distributional" and not violations:
        distribution, v, dist_program = _distribution_phase(
            factory,
            seed=seed,
            points=points,
            samples=samples,
            permutations=permutations,
            alpha=alpha,
            horizon=horizon,
            max_prefix=max_prefix,
            stats=stats,
            header=header,
        )
        if v is not None:
            violations, program, reproduced = [v], dist_program, None
    return FidelityReport(
        env=name,
        mode=resolved,
        seed=seed,
        max_examples=max_examples,
        violations=violations,
        program=program,
        reproduced=reproduced,
        examples=stats.examples,
        steps=stats.steps,
        snapshots=stats.snapshots,
        restores=stats.restores,
        fresh_restores=stats.fresh_restores,
        pickled=stats.pickled,
        releases=stats.releases,
        first_detection_steps=stats.first_detection_steps,
        replays=replays,
        distribution=distribution,
        seconds=time.perf_counter() - t0,
        alpha=alpha,
    )


@contextlib.contextmanager
def _shrink_budget(seconds: float) -> Iterator[None]:
    """Bound Hypothesis' shrinking time (the module constant it documents as patchable)."""
    from hypothesis.internal.conjecture import engine

    old = getattr(engine, "MAX_SHRINKING_SECONDS", None)
    if old is None:  # a Hypothesis without the knob: shrink with its own limit
        yield
        return
    engine.MAX_SHRINKING_SECONDS = seconds
    try:
        yield
    finally:
        engine.MAX_SHRINKING_SECONDS = old


def fidelity_test(env_fn: EnvFactory | str, **kwargs: Any) -> Callable[[], None]:
    """A pytest test function that runs :func:`check_snapshot_fidelity` on ``env_fn``.

    One line in a sandbox's test module::

        test_snapshot_fidelity = branchgym.testing.fidelity_test(MySandbox)

    The test fails with the report (and its pasteable program) as the message.
    """

    def test_snapshot_fidelity() -> None:
        __tracebackhide__ = True
        report = check_snapshot_fidelity(env_fn, **kwargs)
        if not report.ok:
            raise AssertionError(str(report))

    test_snapshot_fidelity.__doc__ = f"Snapshot fidelity of {env_fn!r:.60}"
    return test_snapshot_fidelity
