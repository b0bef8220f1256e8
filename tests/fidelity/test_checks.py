"""check_env passes every registered env and catches broken snapshots."""

import gymnasium as gym
import pytest

import branchgym
from branchgym.envs.toy import TreeMDP
from branchgym.fidelity.checks import CHECKS, check_env


@pytest.mark.parametrize("spec", branchgym.branch_specs(), ids=lambda s: s.id)
def test_every_registered_env_passes(spec):
    if spec.missing():
        pytest.skip(f"extra not installed: {spec.missing()}")
    report = check_env(spec.id)
    assert report.ok, str(report)
    assert [r.name for r in report.results] == list(CHECKS)


class AliasingTree(TreeMDP):
    """Bug: the snapshot shares the live history list."""

    def reset(self, **kw):
        self.history = []
        return super().reset(**kw)

    def step(self, action):
        self.history.append(int(action))
        return super().step(action)

    def _get_state(self):
        return (super()._get_state(), self.history)

    def _set_state(self, state):
        self.history = state[1]
        return super()._set_state(state[0])


class RngLeftOut(TreeMDP):
    """Bug: transitions are random but the RNG is not part of the snapshot."""

    snapshot_includes_rng = False


def test_aliasing_is_caught():
    report = check_env(lambda: AliasingTree(), skip_gymnasium=True)
    assert not report.ok
    failed = {r.name for r in report.results if not r.passed}
    assert "independence" in failed
    assert "aliases" in str(report)


def test_missing_rng_is_caught():
    report = check_env(
        lambda: RngLeftOut(transition_noise=1.0, reward_noise=0.5), skip_gymnasium=True
    )
    assert not report.ok
    assert "continuation" in str(report)


def test_report_reads_well():
    report = check_env("branchgym/TreeMDP-v0", checks=("round_trip", "pickle"))
    text = str(report)
    assert "[PASS] round_trip" in text and text.endswith("OK")


def test_env_instance_without_spec_is_refused_with_fix():
    with pytest.raises(TypeError, match="zero-argument"):
        check_env(TreeMDP())


def test_instance_made_by_gym_make_is_accepted():
    assert check_env(gym.make("branchgym/TreeMDP-v0"), checks=("round_trip",)).ok
