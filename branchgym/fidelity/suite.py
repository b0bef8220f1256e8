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
the plugin :mod:`branchgym.fidelity.pytest_plugin`, or ``test_fidelity = fidelity_test(MyEnv)``.

The suite is split by concern: the state machine (:mod:`branchgym.fidelity.machine`), the
permutation test (:mod:`branchgym.fidelity.permutation`), the distribution phase
(:mod:`branchgym.fidelity.distributional`) and the report (:mod:`branchgym.fidelity.report`);
this module holds the entry points and re-exports their public names.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import gymnasium as gym
import numpy as np

from branchgym.core import declares_rng_excluded
from branchgym.error import FidelitySetupError
from branchgym.fidelity.checks import as_factory
from branchgym.fidelity.distributional import DistributionResult, distribution_phase
from branchgym.fidelity.machine import (
    Detected,
    EnvFactory,
    FidelityStats,
    fidelity_machine,
    program_header,
    replay_program,
    shrink_program,
)
from branchgym.fidelity.permutation import PermutationResult, permutation_test
from branchgym.fidelity.report import FidelityReport
from branchgym.fidelity.violation import Violation

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


#: Programs Hypothesis generates per check. Sized so that a fault on 1 % of steps is
#: caught (``branchgym scenarios``: ``rare_nondeterminism``) in a few seconds on toy envs.
DEFAULT_MAX_EXAMPLES = 100
#: Rules per program (Hypothesis' ``stateful_step_count``).
DEFAULT_STEPS = 30

_MODES = ("auto", "exact", "distributional")

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
    header = program_header(env_fn)
    t0 = time.perf_counter()
    probe = factory()
    try:
        resolved = resolve_mode(mode, probe)
    finally:
        probe.close()
    stats = FidelityStats()
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
    found: Detected | None = None
    with _shrink_budget(shrink_seconds / 2):
        try:
            run_state_machine_as_test(machine, settings=config)
        except Detected as exc:
            found = exc
        except Flaky:
            # Hypothesis saw a failure that vanished on replay; keep the shortest one seen.
            found = min(stats.failures, key=lambda f: len(f.ops))
    if found is not None:
        args = machine.program_args
        best, again = found, True
        if shrink_seconds > 0:
            best, again = shrink_program(args, found, time.perf_counter() + shrink_seconds / 2)
        # How reproducible is the final program? Nondeterministic envs fail only sometimes.
        outcomes = [replay_program(args, best.ops) for _ in range(reproduce)]
        failed = sum(isinstance(o, Detected) for o in outcomes)
        replays = (failed, reproduce)
        reproduced = (again and failed == reproduce) if reproduce else None
        violations, program = [best.violation], best.program
    distribution: list[DistributionResult] = []
    if resolved == "distributional" and not violations:
        distribution, v, dist_program = distribution_phase(
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

        test_snapshot_fidelity = branchgym.fidelity.suite.fidelity_test(MySandbox)

    The test fails with the report (and its pasteable program) as the message.
    """

    def test_snapshot_fidelity() -> None:
        __tracebackhide__ = True
        report = check_snapshot_fidelity(env_fn, **kwargs)
        if not report.ok:
            raise AssertionError(str(report))

    test_snapshot_fidelity.__doc__ = f"Snapshot fidelity of {env_fn!r:.60}"
    return test_snapshot_fidelity
