"""FidelityCheck: digest and shadow modes, violation records, raise/warn/record."""

import pickle
import warnings

import gymnasium as gym
import pytest

import branchgym
from branchgym.envs.toy import TreeMDP
from branchgym.error import (
    FidelitySetupError,
    FidelityViolation,
    FidelityWarning,
    ResetNeededError,
)
from branchgym.scenarios import SCENARIOS
from branchgym.scenarios.matrix import branching_workload
from branchgym.wrappers import FidelityCheck, Violation
from branchgym.wrappers.fidelity import META_KEY

TEXT = "branchgym/TextTreeMDP-v0"
TREE = "branchgym/TreeMDP-v0"


def scenario(name, env_id=TEXT):
    return SCENARIOS[name].factory(env_id)


def checked(make, mode, on_violation="record", **kw):
    return FidelityCheck(make(), mode=mode, on_violation=on_violation, env_fn=make, **kw)


@pytest.mark.parametrize("mode", ["digest", "shadow", "both"])
@pytest.mark.parametrize("env_id", [TREE, TEXT])
def test_correct_env_has_no_violations_in_any_mode(mode, env_id):
    env = FidelityCheck(gym.make(env_id), mode=mode)  # on_violation="raise"
    assert branching_workload(env, seed=3, steps=150) is None
    assert env.violations == []
    s = env.stats
    assert s["restores"] > 10 and s["verified"] == s["restores"] and s["unverified"] == 0
    if "shadow" in env.checks:
        assert s["twins"] == s["restores"] and s["shadowed_steps"] > 10
    env.close()


def test_digest_catches_aliasing_with_field_step_and_both_values():
    env = checked(scenario("aliased_history"), "digest")
    env.reset(seed=0)
    env.step("go north")
    snap = env.snapshot()
    env.step("go east")
    env.step("go west")
    env.restore(snap)
    (v,) = env.violations
    assert isinstance(v, Violation) and v.check == "digest"
    assert v.field == "len(info['history'])" and (v.live, v.reference) == (3, 1)
    assert v.step == 1 and v.since_restore == 0
    assert "step 1" in str(v) and "right after restore" in str(v)


def test_digest_catches_a_field_only_the_digest_sees():
    class HiddenAlias(TreeMDP):  # the aliased list is not in obs or info
        def reset(self, **kw):
            self.hidden = []
            return super().reset(**kw)

        def step(self, a):
            self.hidden.append(int(a))
            return super().step(a)

        def _get_state(self):
            return (super()._get_state(), self.hidden)

        def _set_state(self, s):
            self.hidden = s[1]
            return super()._set_state(s[0])

    env = FidelityCheck(HiddenAlias(), on_violation="record")
    env.reset(seed=1)
    snap = env.snapshot()
    env.step(0)
    env.restore(snap)
    (v,) = env.violations
    assert v.field == "state_digest" and v.live != v.reference and "aliases" in v.detail


def test_raise_warn_and_record():
    make = scenario("partial_restore")

    def provoke(env):
        env.reset(seed=0)
        env.step("go north")
        snap = env.snapshot()
        env.step("go east")
        env.restore(snap)

    env = checked(make, "digest", "raise")
    with pytest.raises(FidelityViolation, match=r"info\['moves'\]") as exc:
        provoke(env)
    assert exc.value.violation.field == "info['moves']"
    assert env.unwrapped.node is not None  # the env was restored before the check raised
    env = checked(make, "digest", "warn")
    with pytest.warns(FidelityWarning, match="moves"):
        provoke(env)
    env = checked(make, "digest", "record")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        provoke(env)
    assert len(env.violations) == 1


def test_shadow_catches_rng_left_out_that_digest_misses():
    make = scenario("rng_not_snapshotted", TREE)
    for mode, caught in (("digest", False), ("shadow", True)):
        env = checked(make, mode)
        at = branching_workload(env, seed=0, steps=300)
        assert (at is not None) is caught, env.summary()
    v = env.violations[0]
    assert v.check == "shadow" and v.since_restore >= 1 and v.live != v.reference
    assert "replay" in v.detail


def test_shadow_pickle_twin_and_auto_fallback_without_seed():
    make = scenario("stale_obs_cache", TREE)
    env = checked(make, "shadow", twin="pickle")
    assert branching_workload(env, seed=1, steps=300) is not None
    assert "pickle" in env.violations[0].detail
    # reset(seed=None): the episode cannot be replayed, auto falls back to the pickle route
    env = FidelityCheck(gym.make(TREE), mode="shadow", twin="auto")
    env.reset()
    env.step(0)
    with env.snapshot() as snap:
        env.restore(snap)
        env.step(1)
    assert env.stats["twins"] == 1 and env.violations == []


def test_declared_volatile_info_is_not_a_violation():
    env = checked(scenario("declared_timing"), "both", "raise")
    assert branching_workload(env, seed=0, steps=120) is None


def test_rng_excluded_stack_compares_restored_state_only():
    env = checked(scenario("rng_excluded_declared", TREE), "shadow", "raise")
    assert branching_workload(env, seed=0, steps=200) is None
    assert env.stats["twins"] > 0 and env.stats["shadowed_steps"] == 0


def test_sample_rate_and_unverified_restores():
    env = FidelityCheck(gym.make(TREE), sample_rate=0.5)
    env.reset(seed=0)
    snaps = [env.snapshot() for _ in range(10)]
    assert env.stats["recorded"] == 5
    assert sum(META_KEY in s.meta for s in snaps) == 5
    foreign = branchgym.snapshot(env.env)  # not taken through the wrapper
    env.restore(foreign)
    assert env.stats["unverified"] == 1 and env.violations == []


def test_snapshot_travels_through_pickle_and_outer_wrappers():
    env = gym.wrappers.TimeLimit(FidelityCheck(gym.make(TEXT)), max_episode_steps=50)
    env.reset(seed=0)
    env.step("go north")
    snap = branchgym.snapshot(env)  # FidelityCheck owns the inner stack
    other = gym.wrappers.TimeLimit(FidelityCheck(gym.make(TEXT)), max_episode_steps=50)
    other.reset(seed=5)
    branchgym.restore(other, pickle.loads(pickle.dumps(snap)))
    assert other.env.stats["verified"] == 1 and other.env.violations == []
    assert other._elapsed_steps == 1


def test_setup_errors_say_the_fix():
    env = gym.make(TREE)
    for kw, match in [
        ({"mode": "exact"}, "digest"),
        ({"on_violation": "ignore"}, "on_violation"),
        ({"twin": "fork"}, "twin"),
        ({"sample_rate": 0.0}, "sample_rate"),
        ({"shadow_steps": 0}, "shadow_steps"),
    ]:
        with pytest.raises(FidelitySetupError, match=match):
            FidelityCheck(env, **kw)
    with pytest.raises(FidelitySetupError, match="env_fn"):
        FidelityCheck(TreeMDP(), mode="shadow")
    wrapped = FidelityCheck(
        gym.make(TREE), mode="shadow", env_fn=lambda: FidelityCheck(gym.make(TREE))
    )
    wrapped.reset(seed=0)
    with wrapped.snapshot() as snap, pytest.raises(FidelitySetupError, match="plain env"):
        wrapped.restore(snap)
    with pytest.raises(ResetNeededError):
        FidelityCheck(gym.make(TREE)).snapshot()


def test_shadow_steps_limits_the_twin():
    env = FidelityCheck(gym.make(TEXT), mode="shadow", shadow_steps=1)
    env.reset(seed=0)
    with env.snapshot() as snap:
        env.restore(snap)
        env.step("go north")
        env.step("go north")
    assert env.stats["shadowed_steps"] == 1


def _trace(env, seed):
    """Every output of a seeded branching run (the same program for any env)."""
    from branchgym.fidelity.checks import ActionChooser

    out, chooser = [], ActionChooser(env, seed)
    for ep in range(5):
        obs, info = env.reset(seed=ep)
        out.append((obs, info))
        with env.snapshot() as snap:
            for _ in range(3):
                out.append(env.restore(snap))
                done = False
                while not done:
                    step = env.step(chooser(info))
                    out.append(step)
                    info, done = step[4], step[2] or step[3]
    return out


@pytest.mark.parametrize("mode", ["digest", "shadow", "both"])
def test_fidelity_check_is_transparent(mode):
    """Agreement: the same program on the wrapped and the unwrapped env gives the same."""
    from branchgym.compare import first_difference

    plain = _trace(gym.make(TEXT), 0)
    wrapped = _trace(FidelityCheck(gym.make(TEXT), mode=mode), 0)
    assert first_difference(wrapped, plain) is None


def test_snapshots_through_the_wrapper_pass_the_property_suite():
    from branchgym.fidelity.suite import check_snapshot_fidelity

    report = check_snapshot_fidelity(
        lambda: FidelityCheck(gym.make(TREE), mode="both"), max_examples=20
    )
    assert report.ok, str(report)


def test_branchgym_restore_on_an_outermost_delegating_wrapper():
    """Regression: core.restore() used to unwrap the wrapper's own StackSnapshot."""
    env = FidelityCheck(gym.make(TREE))
    env.reset(seed=0)
    env.step(1)
    snap = branchgym.snapshot(env)  # FidelityCheck's snapshot of the stack below it
    before = branchgym.state_digest(env)
    env.step(0)
    branchgym.restore(env, snap)
    assert branchgym.state_digest(env) == before and env.stats["verified"] == 1
