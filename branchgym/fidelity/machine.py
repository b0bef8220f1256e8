"""The snapshot-fidelity state machine: live env vs a replayed model, one operation at a time.

:func:`fidelity_machine` builds the Hypothesis ``RuleBasedStateMachine`` that
:func:`branchgym.fidelity.suite.check_snapshot_fidelity` runs: its rules reset, step, snapshot,
restore (live, fresh instance, pickle round trip) and release, each recorded as an
operation of a :class:`_Program` so a failure replays (:func:`replay_program`) and
shrinks (:func:`shrink_program`) to a short program a :class:`Detected` violation
carries, printed ready to paste.

Why this module is over 600 lines: the program's ``op_*`` methods, the rules that record
them and the replay that re-executes them must agree operation by operation; split
apart, a new rule would have to be added in three places.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import time
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from branchgym.compare import first_step_difference
from branchgym.core import restore, snapshot, state_digest
from branchgym.error import (
    FidelitySetupError,
    FidelityViolation,
    SnapshotNotPicklableError,
    SnapshotReleasedError,
)
from branchgym.fidelity.checks import (
    run_actions,
    strip_volatile,
    volatile_keys,
)
from branchgym.fidelity.violation import Violation

__all__ = [
    "EnvFactory",
    "Detected",
    "FidelityStats",
    "digest_or_none",
    "fidelity_machine",
    "literal",
    "program_header",
    "replay_program",
    "shrink_program",
]

EnvFactory = Callable[[], gym.Env]


# ------------------------------------------------------------------- bookkeeping


@dataclasses.dataclass
class FidelityStats:
    """Counters shared by every program of one check (Hypothesis builds many machines)."""

    examples: int = 0
    steps: int = 0
    snapshots: int = 0
    restores: int = 0
    fresh_restores: int = 0
    pickled: int = 0
    releases: int = 0
    failures: list[Detected] = dataclasses.field(default_factory=list)
    first_detection_steps: int | None = None

    def record(self, exc: Detected) -> None:
        """Count a detection (keeping the first 64)."""
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


class Detected(FidelityViolation):
    """A violation raised inside the state machine, with the program that led to it."""

    def __init__(
        self, message: str, violation: Violation, program: str, ops: list[tuple[Any, ...]]
    ) -> None:
        super().__init__(message, violation=violation)
        self.program = program
        self.ops = ops


class _Invalid(Exception):
    """An operation does not apply in the current state (only when replaying a program)."""


def literal(v: Any) -> str:
    """A Python expression for ``v`` that can be pasted into a test."""
    if isinstance(v, np.ndarray):
        return f"np.array({v.tolist()!r}, dtype=np.{v.dtype})"
    if isinstance(v, np.generic):
        return repr(v.item())
    return repr(v)


def program_header(target: Any) -> list[str]:
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


def digest_or_none(env: gym.Env) -> str | None:
    """``state_digest(env)``, or None when the state has no canonical encoding."""
    try:
        return state_digest(env)
    except Exception:  # no canonical encoding of the state: the other checks still run
        return None


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
        stats: FidelityStats,
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
        exc = Detected(f"snapshot fidelity violated: {v}", v, self.render(v), list(self.ops))
        self.stats.record(exc)
        raise exc

    def call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (Detected, _Invalid):
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
            now = digest_or_none(self.live)
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
        self.lines.append(f"env.step({literal(action)})")
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
            digest_or_none(self.live),
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
        before = digest_or_none(self.live)
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
        after = digest_or_none(self.live)
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
        """Execute recorded operations (raises ``Detected`` or ``_Invalid``)."""
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
    stats: FidelityStats | None = None,
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
    counters = stats if stats is not None else FidelityStats()
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

    SnapshotFidelityMachine.program_args = {  # what shrink_program needs to replay programs
        "env_fn": env_fn,
        "exact": mode == "exact",
        "model": model,
        "header": list(header),
    }
    return SnapshotFidelityMachine


def replay_program(args: dict[str, Any], ops: Sequence[tuple[Any, ...]]) -> Detected | None | str:
    """Replay ``ops`` on fresh instances: the failure, ``None`` (passed) or ``"invalid"``."""
    p = _Program(
        args["env_fn"],
        exact=args["exact"],
        model=args["model"],
        header=args["header"],
        stats=FidelityStats(),
    )
    try:
        p.run(ops)
    except Detected as exc:
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


def shrink_program(args: dict[str, Any], found: Detected, deadline: float) -> tuple[Detected, bool]:
    """Greedy deletion of operations (chunks of 8, 4, 2, 1) while the program still fails.

    Hypothesis has shrunk the program already; this pass is cheap insurance for slow envs,
    where Hypothesis' shrinker runs out of time first. Returns the smallest failure and
    whether ``found`` itself failed again when replayed.
    """
    first = replay_program(args, found.ops)
    if not isinstance(first, Detected):
        return found, False
    best = first
    changed = True
    while changed and time.perf_counter() < deadline:
        changed = False
        for size in (8, 4, 2, 1):
            i = 0
            while i < len(best.ops) and time.perf_counter() < deadline:
                cand = _prune(best.ops[:i] + best.ops[i + size :])
                res = replay_program(args, cand) if len(cand) < len(best.ops) else None
                if isinstance(res, Detected):
                    best, changed = res, True
                else:
                    i += 1
    return best, True
