"""The distribution phase of the fidelity suite, for envs whose snapshots leave the RNG out.

At seeded snapshot states, :func:`distribution_phase` draws continuations from the
snapshot restored into instances with independent random streams and from the original
state (fresh instances reset with other seeds and replayed through the same prefix), and
compares them with :func:`branchgym.fidelity.permutation.permutation_test` at a Bonferroni level.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from branchgym.compare import first_difference, first_step_difference
from branchgym.core import restore, snapshot
from branchgym.fidelity.checks import (
    ActionChooser,
    rollout_actions,
    run_actions,
    strip_volatile,
    volatile_keys,
)
from branchgym.fidelity.machine import (
    Detected,
    EnvFactory,
    FidelityStats,
    digest_or_none,
    literal,
)
from branchgym.fidelity.permutation import PermutationResult, permutation_test
from branchgym.fidelity.violation import Violation

__all__ = [
    "DistributionResult",
    "distribution_phase",
]


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


def distribution_phase(
    env_fn: EnvFactory,
    *,
    seed: int,
    points: int,
    samples: int,
    permutations: int,
    alpha: float,
    horizon: int,
    max_prefix: int,
    stats: FidelityStats,
    header: Sequence[str],
) -> tuple[list[DistributionResult], Violation | None, str | None]:
    """Test restored continuations against the original state's at ``points`` states.

    Returns:
        One :class:`DistributionResult` per point, and the first violation (with its
        pasteable program) or ``(None, None)``; counters go into ``stats``.
    """
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
            digest = digest_or_none(env)
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
                if digest is not None and digest_or_none(f_env) != digest:
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
                lines += [f"env.step({literal(a)})" for a in prefix]
                lines += [
                    "snap = branchgym.snapshot(env)",
                    f"# continue with {[literal(a) for a in actions]} from:",
                    f"#   {samples} instances reset with seeds {s + 1}.. and restored from snap",
                    f"#   vs {len(reference)} instances reset with other seeds that reach the "
                    "same state by replay",
                ]
                text = "\n".join(lines)
                stats.record(Detected(f"snapshot fidelity violated: {v}", v, text, []))
                return results, v, text
        finally:
            for e in (env, model, r_env, f_env):
                e.close()
    return results, None, None
