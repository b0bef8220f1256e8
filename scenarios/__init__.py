"""Injected-nondeterminism scenarios (imported as ``branchgym.scenarios``).

Each scenario models one real snapshot-fidelity bug (its docstring says which) as a
wrapper over a freshly made base env, so it applies to every env in
:data:`SCENARIO_ENVS` where it makes sense, and declares its expected verdict:

* ``must-detect``: the property suite (:func:`branchgym.fidelity.suite.check_snapshot_fidelity`)
  must flag it within its default budget;
* ``benign``: correct behaviour that looks suspicious (randomness, timings, caches); no
  check may flag it.

``branchgym scenarios`` runs every scenario on every env against the three checks
(``FidelityCheck`` digest and shadow modes, and the property suite) and prints the
detection matrix. Usage from Python::

    from branchgym.scenarios import SCENARIOS
    make = SCENARIOS["aliased_history"].factory("branchgym/TextTreeMDP-v0")
    env = make()            # a gym.Env with .snapshot()/.restore(), bug included
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import gymnasium as gym

from branchgym.core import SnapshotAPI, SnapshottableEnv
from branchgym.error import UnknownEnvError
from branchgym.scenarios import faults
from branchgym.scenarios._base import can_slip

__all__ = [
    "Scenario",
    "ScenarioEnv",
    "SCENARIOS",
    "SCENARIO_ENVS",
    "MUST_DETECT",
    "BENIGN",
    "scenario",
    "faults",
]

MUST_DETECT = "must-detect"
BENIGN = "benign"


@dataclasses.dataclass(frozen=True)
class ScenarioEnv:
    """An env the scenarios run on.

    Attributes:
        id: Registered env id.
        kwargs: ``gym.make`` kwargs (a data path, a small task set).
        stochastic: Whether transitions draw from the env's ``np_random``; the scenarios
            about RNGs left out of snapshots only apply to such envs.
    """

    id: str
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    stochastic: bool = True


#: The envs scenarios apply to: one line per env. Rows of an env that is not registered
#: here (or whose extra is missing) print as n/a.
SCENARIO_ENVS: list[ScenarioEnv] = [
    ScenarioEnv("branchgym/TreeMDP-v0"),
    ScenarioEnv("branchgym/TextTreeMDP-v0"),
    ScenarioEnv("branchgym/WebShop-v0", stochastic=False),  # np_random only draws the goal
]


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A fault, the real bug it models, and the verdict the checks must reach.

    Attributes:
        name: Short id (``aliased_history``).
        verdict: :data:`MUST_DETECT` or :data:`BENIGN`.
        build: Wraps a freshly made base env with the fault.
        needs: What the base env must offer: ``slip`` (actions can be replaced by other
            valid ones), ``snapshottable`` (a ``SnapshottableEnv`` base), ``stochastic``
            (transitions draw from ``np_random``).
    """

    name: str
    verdict: str
    build: Callable[[gym.Env], gym.Env]
    needs: tuple[str, ...] = ()

    @property
    def doc(self) -> str:
        """The docstring of the scenario: the bug it models."""
        return inspect.getdoc(self.build) or ""

    @property
    def summary(self) -> str:
        """First line of :attr:`doc`."""
        return self.doc.splitlines()[0] if self.doc else self.name

    def factory(self, env_id: str, **kwargs: Any) -> Callable[[], gym.Env]:
        """Zero-argument factory of ``env_id`` with this fault (``.snapshot()`` included)."""

        def make() -> gym.Env:
            return SnapshotAPI(self.build(gym.make(env_id, **kwargs)))

        make.__qualname__ = make.__name__ = f"{self.name}@{env_id}"
        return make

    def why_not(self, target: ScenarioEnv) -> str | None:
        """``None`` when the scenario applies to ``target``, else the reason it does not."""
        if target.id not in gym.registry:
            return "not registered"
        from branchgym.registration import branch_spec

        try:
            missing = branch_spec(target.id).missing()
        except UnknownEnvError:
            missing = []
        if missing:
            return f"needs extra {', '.join(missing)}"
        if "stochastic" in self.needs and not target.stochastic:
            return "transitions do not use the env's RNG"
        if "slip" in self.needs or "snapshottable" in self.needs:
            env = gym.make(target.id, **target.kwargs)
            try:
                _, info = env.reset(seed=0)
                if "slip" in self.needs and not can_slip(env.action_space, info):
                    return "actions cannot be replaced by other valid ones"
                if "snapshottable" in self.needs and not isinstance(
                    env.unwrapped, SnapshottableEnv
                ):
                    return "base env is not a SnapshottableEnv"
            finally:
                env.close()
        return None


#: name -> scenario, in catalogue order.
SCENARIOS: dict[str, Scenario] = {}


def scenario(
    name: str, verdict: str, needs: tuple[str, ...] = ()
) -> Callable[[Callable[[gym.Env], gym.Env]], Callable[[gym.Env], gym.Env]]:
    """Register ``build`` as scenario ``name`` (its docstring names the real bug)."""
    if verdict not in (MUST_DETECT, BENIGN):
        raise ValueError(f"verdict must be {MUST_DETECT!r} or {BENIGN!r}")

    def register(build: Callable[[gym.Env], gym.Env]) -> Callable[[gym.Env], gym.Env]:
        SCENARIOS[name] = Scenario(name, verdict, build, tuple(needs))
        return build

    return register


# ------------------------------------------------------------------ must-detect


@scenario("unseeded_rng", MUST_DETECT, needs=("slip",))
def unseeded_rng(env: gym.Env) -> gym.Env:
    """Transitions drawn from an unseeded RNG (25 % of actions slip).

    Real bug: ``step`` calls ``random.random()`` or ``np.random.default_rng()`` (no seed)
    instead of ``self.np_random``, so ``reset(seed)`` does not determine the episode and no
    snapshot can capture the randomness.
    """
    return faults.ActionSlip(env, 0.25, seeding="unseeded")


@scenario("rng_not_snapshotted", MUST_DETECT, needs=("slip",))
def rng_not_snapshotted(env: gym.Env) -> gym.Env:
    """RNG state left out of the snapshot (25 % of actions slip, seeded by reset).

    Real bug: the env keeps its own ``random.Random(seed)`` for noisy transitions but
    ``get_state`` forgets it, so a restored branch continues the live random stream
    (undeclared: the env claims exact snapshots).
    """
    return faults.ActionSlip(env, 0.25, seeding="reset", snapshot_rng=False)


@scenario("wall_clock", MUST_DETECT)
def wall_clock(env: gym.Env) -> gym.Env:
    """An observation that reads the wall clock (text: a timestamp; else ``info["clock"]``).

    Real bug: a shell prompt, log line or page footer with ``datetime.now()`` in the
    observation; two identical states render differently.
    """
    return faults.WallClock(env)


@scenario("hidden_global_counter", MUST_DETECT, needs=("slip",))
def hidden_global_counter(env: gym.Env) -> gym.Env:
    """A hidden module-level counter (every 5th request of the process is throttled).

    Real bug: a rate limiter, A/B bucket or request id kept in a module global
    (``itertools.count()``) shared by every instance and outside every snapshot.
    """
    return faults.GlobalCounter(env, every=5)


@scenario("aliased_history", MUST_DETECT)
def aliased_history(env: gym.Env) -> gym.Env:
    """A snapshot that aliases a mutable list of the live state (``info["history"]``).

    Real bug: ``get_state`` returns ``self.history`` instead of ``list(self.history)``;
    the live env's later appends land in the snapshot.
    """
    return faults.AliasedHistory(env)


@scenario("file_outside_snapshot", MUST_DETECT)
def file_outside_snapshot(env: gym.Env) -> gym.Env:
    """A file written outside the captured state (an action log; ``info["log_lines"]``).

    Real bug: the sandbox writes to ``/tmp`` or the home directory while the snapshot
    captures only the workspace overlay; restored branches see the other branches' writes.
    """
    return faults.FileOutsideSnapshot(env)


@scenario("background_thread", MUST_DETECT)
def background_thread(env: gym.Env) -> gym.Env:
    """A background thread mutating state (a heartbeat advancing ``info["ticks"]``).

    Real bug: a poller, heartbeat or simulated clock running in a thread; the state a
    snapshot captured keeps moving after restore, at a speed set by the scheduler.
    """
    return faults.BackgroundTicker(env)


@scenario("latency_ordering", MUST_DETECT)
def latency_ordering(env: gym.Env) -> gym.Env:
    """Network-latency-dependent ordering of results.

    Real bug: results of concurrent requests merged as they arrive
    (``asyncio.as_completed``); the order, and so the effect of "pick result k",
    depends on network latency that no seed controls.
    """
    return faults.LatencyOrdering(env)


@scenario("partial_restore", MUST_DETECT)
def partial_restore(env: gym.Env) -> gym.Env:
    """Partial restore: one field (a move counter) is not brought back.

    Real bug: a field added to the env later, captured by ``get_state`` but forgotten in
    ``set_state``; the restored env reports the live branch's move count.
    """
    return faults.PartialRestore(env)


@scenario("wrapper_counter_not_restored", MUST_DETECT)
def wrapper_counter_not_restored(env: gym.Env) -> gym.Env:
    """A wrapper's counter not restored (a step budget that truncates after 3 steps).

    Real bug: a ``TimeLimit``-like wrapper declared stateless
    (``branchgym_state_attrs = ()``); after a restore it truncates at the wrong step.
    """
    return faults.UndeclaredStepBudget(env, budget=3)


@scenario("stale_obs_cache", MUST_DETECT)
def stale_obs_cache(env: gym.Env) -> gym.Env:
    """A stale observation cache (renderings keyed by step number, kept across restore).

    Real bug: an expensive page/screen render memoised by step index or URL rather than
    by state, and not invalidated by restore; a restored branch sees the other branch.
    """
    return faults.StaleObsCache(env)


@scenario("rare_nondeterminism", MUST_DETECT, needs=("slip",))
def rare_nondeterminism(env: gym.Env) -> gym.Env:
    """Rare nondeterminism: 1 % of steps execute another action (unseeded).

    Real bug: a race or a flaky retry that changes the outcome once in a hundred steps;
    too rare to notice by eye, enough to bias thousands of sibling comparisons.
    """
    return faults.ActionSlip(env, 0.01, seeding="unseeded")


@scenario("restore_drift", MUST_DETECT, needs=("slip",))
def restore_drift(env: gym.Env) -> gym.Env:
    """Nondeterminism only in restored branches (5 % of their steps slip).

    Real bug: a restored container with cold caches or a re-established connection that
    behaves slightly differently from the original; backbone and siblings then differ
    (``branchgym bench erosion`` measures the bias this causes).
    """
    return faults.RestoreFault(env, 0.05, kind="slip")


@scenario("rng_reseeded_on_restore", MUST_DETECT, needs=("snapshottable", "stochastic"))
def rng_reseeded_on_restore(env: gym.Env) -> gym.Env:
    """RNG declared outside the snapshot, and restore re-seeds it with a constant.

    Real bug: an ALE-style env (``cloneState`` without the RNG, declared) whose
    ``set_state`` calls ``self.seed(0)``: every restored branch draws the same numbers,
    so siblings are not independent. Judged in distributional mode.
    """
    return faults.ReseedOnRestore(faults.exclude_rng(env))


# ----------------------------------------------------------------------- benign


@scenario("seeded_stochastic", BENIGN, needs=("slip",))
def seeded_stochastic(env: gym.Env) -> gym.Env:
    """A correctly seeded stochastic env (25 % of actions slip; RNG seeded and snapshotted).

    Randomness is not a fidelity bug when ``reset(seed)`` seeds it and snapshots carry it.
    """
    return faults.ActionSlip(env, 0.25, seeding="reset", snapshot_rng=True)


@scenario("declared_timing", BENIGN)
def declared_timing(env: gym.Env) -> gym.Env:
    """Volatile info fields the env declares (``info["step_ms"]``, a wall-clock timing).

    Timings differ between any two runs; declared in ``volatile_info_keys``, they are not
    compared.
    """
    return faults.StepTimer(env)


@scenario("keyed_cache", BENIGN)
def keyed_cache(env: gym.Env) -> gym.Env:
    """A render cache keyed by the observation it renders (cannot go stale).

    Caches are not bugs in themselves: only caches keyed by something other than the
    state are.
    """
    return faults.KeyedObsCache(env)


@scenario("rng_excluded_declared", BENIGN, needs=("snapshottable", "stochastic"))
def rng_excluded_declared(env: gym.Env) -> gym.Env:
    """Snapshots leave the RNG out, declared (``snapshot_includes_rng = False``).

    ALE's ``cloneState`` semantics: exact comparisons do not apply, continuations agree in
    distribution. Judged in distributional mode; it must pass.
    """
    return faults.exclude_rng(env)
