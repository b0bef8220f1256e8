"""The property suite: passes correct envs, fails faulty ones with a pasteable program."""

import re

import gymnasium as gym
import numpy as np
import pytest

from branchgym.envs.toy import TreeMDP
from branchgym.error import FidelitySetupError
from branchgym.fidelity.suite import (
    check_snapshot_fidelity,
    fidelity_machine,
    fidelity_test,
    permutation_test,
    resolve_mode,
)
from branchgym.scenarios import MUST_DETECT, SCENARIOS
from tests.fidelity.test_checks import AliasingTree

TEXT = "branchgym/TextTreeMDP-v0"
TREE = "branchgym/TreeMDP-v0"


@pytest.mark.parametrize("env_id", [TREE, TEXT])
def test_correct_envs_pass(env_id):
    report = check_snapshot_fidelity(env_id, max_examples=40)
    assert report.ok, str(report)
    assert report.mode == "exact" and report.program is None
    assert report.examples >= 40 and report.steps > 100 and report.restores > 20
    assert report.fresh_restores > 0 and report.pickled > 0 and report.releases > 0
    assert str(report).endswith("OK")


def test_failure_shrinks_to_a_short_pasteable_program():
    report = check_snapshot_fidelity(AliasingTree, shrink_seconds=6)
    assert not report.ok and report.reproduced and report.replays == (3, 3)
    (v,) = report.violations
    assert v.check == "digest" and v.field == "state_digest"
    body = [ln for ln in report.program.splitlines() if ln.startswith(("env", "s0", "branch"))]
    patterns = [
        r"env = make\(\)",
        r"env\.reset\(seed=\d+\)",
        r"s0 = branchgym\.snapshot\(env\)",
        r"env\.step\(\d\)",
        r"branchgym\.restore\(env, s0\)  # <- FAILS: state_digest",
    ]
    assert len(body) == len(patterns), report.program
    assert all(re.fullmatch(p, line) for p, line in zip(patterns, body, strict=True)), body
    assert "from tests.fidelity.test_checks import AliasingTree as make" in report.program
    exec(compile(report.program, "<program>", "exec"), {})  # it runs as printed
    text = str(report)
    assert "likely cause" in text and "aliases" in text and "failed 3 of 3 replays" in text


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [n for n, s in SCENARIOS.items() if s.verdict == MUST_DETECT and n != "wall_clock"]
)
def test_every_must_detect_scenario_fails_with_a_readable_report(name):
    make = SCENARIOS[name].factory(TEXT)
    report = check_snapshot_fidelity(make, shrink_seconds=1.0, reproduce=1)
    assert not report.ok, name
    text = str(report)
    assert "violation:" in text and "likely cause" in text and "program" in text
    assert "FAILS" in report.program or report.violations[0].check == "distribution"
    assert len(report.program.splitlines()) < 60


def test_wall_clock_is_caught_at_reset_as_nondeterminism():
    report = check_snapshot_fidelity(SCENARIOS["wall_clock"].factory(TEXT), shrink_seconds=1)
    (v,) = report.violations
    assert v.check == "determinism" and v.field == "obs" and v.step == 0
    assert "not deterministic" in str(report) or "reset(seed)" in str(report)


_FIRST_RESET = [7]


class FailsOnce(TreeMDP):
    """The first reset in the process sees a stale global: a failure that cannot recur."""

    def _info(self):
        info = super()._info()
        info["stale"] = _FIRST_RESET.pop() if _FIRST_RESET else 0
        return info


def test_a_failure_that_does_not_recur_is_reported_as_such():
    _FIRST_RESET[:] = [7]
    report = check_snapshot_fidelity(FailsOnce, max_examples=5, shrink_seconds=1)
    assert not report.ok and report.reproduced is False and report.replays == (0, 3)
    assert "does not fail every time" in str(report)


def test_distributional_mode_accepts_declared_rng_exclusion_and_exact_mode_does_not():
    make = SCENARIOS["rng_excluded_declared"].factory(TREE)
    assert resolve_mode("auto", make()) == "distributional"
    report = check_snapshot_fidelity(make, max_examples=20, points=3)
    assert report.ok and report.mode == "distributional", str(report)
    assert [r.verdict for r in report.distribution].count("same") >= 2
    assert all(r.reference >= 16 for r in report.distribution if r.verdict == "same")
    exact = check_snapshot_fidelity(make, mode="exact", max_examples=40, shrink_seconds=1)
    assert not exact.ok and exact.violations[0].check == "continuation"


def test_distributional_mode_catches_a_biased_restore():
    make = SCENARIOS["rng_reseeded_on_restore"].factory(TREE)
    report = check_snapshot_fidelity(make, max_examples=10, points=3)
    (v,) = report.violations
    assert v.check == "distribution" and "permutation p" in v.detail
    assert "1 distinct" in v.live or "48x" in v.live  # every restored branch drew the same
    assert "snap = branchgym.snapshot(env)" in report.program


def test_permutation_test_levels_and_power():
    rng = np.random.default_rng(0)

    def draws(mean, n):
        return [[(0, float(x), True, False, {})] for x in rng.normal(mean, 1.0, n)]

    # Under the null hypothesis p-values are (super-)uniform: about 5 % fall below 0.05.
    ps = [
        permutation_test(draws(0, 20), draws(0, 20), permutations=199, seed=i).p_value
        for i in range(200)
    ]
    assert 0.01 <= np.mean(np.array(ps) <= 0.05) <= 0.09
    shifted = permutation_test(draws(0, 40), draws(1.5, 40), permutations=499, seed=1)
    assert shifted.p_value <= 2 / 500 and shifted.feature == "step 1 reward"
    cats = permutation_test(
        [[("a", 0.0, True, False, {})]] * 30,
        [[("b", 0.0, True, False, {})]] * 30,
        permutations=199,
    )
    assert cats.p_value == pytest.approx(1 / 200) and cats.statistic == 1.0


def test_fidelity_test_builds_a_pytest_test():
    test = fidelity_test(AliasingTree, max_examples=20, shrink_seconds=1)
    with pytest.raises(AssertionError, match="branchgym.restore"):
        test()
    fidelity_test(TREE, max_examples=10)()  # passes silently


def test_machine_runs_under_plain_hypothesis():
    from hypothesis import settings

    machine = fidelity_machine(lambda: gym.make(TREE))
    settings(max_examples=5, stateful_step_count=10, deadline=None, database=None)(machine)
    machine.TestCase().runTest()


def test_bad_arguments_are_typed_errors():
    with pytest.raises(FidelitySetupError, match="mode"):
        check_snapshot_fidelity(TREE, mode="approximate")
    with pytest.raises(FidelitySetupError, match="permutations"):
        check_snapshot_fidelity(TREE, permutations=99, points=5, alpha=0.01)
    with pytest.raises(FidelitySetupError, match="max_examples"):
        check_snapshot_fidelity(TREE, max_examples=0)
