"""What the fidelity suite reports: :class:`FidelityReport`, with a hint per violation kind."""

from __future__ import annotations

import dataclasses

from branchgym.fidelity.distributional import DistributionResult
from branchgym.fidelity.violation import Violation

__all__ = [
    "FidelityReport",
]


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
