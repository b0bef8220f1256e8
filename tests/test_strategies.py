"""PickleSnapshot and ReplaySnapshot make plain Gymnasium envs snapshottable."""

import pickle

import gymnasium as gym
import pytest

import branchgym
from branchgym.compare import first_difference
from branchgym.error import SnapshotCorruptError, SnapshotMismatchError
from branchgym.fidelity.checks import check_env
from branchgym.wrappers import PickleSnapshot, ReplaySnapshot

ENVS = [
    ("CartPole-v1", {}),
    ("FrozenLake-v1", {"is_slippery": True}),  # the RNG decides every move
    ("Taxi-v4", {}),  # gymnasium 1.x retired Taxi-v3 for v4 (same dynamics, fixed rendering)
]


@pytest.mark.parametrize("wrapper", [PickleSnapshot, ReplaySnapshot])
@pytest.mark.parametrize("env_id,kwargs", ENVS)
def test_continuation_after_restore_is_identical(wrapper, env_id, kwargs):
    env = wrapper(gym.make(env_id, **kwargs))
    env.reset(seed=7)
    env.action_space.seed(7)
    for _ in range(3):
        env.step(env.action_space.sample())
    snap = env.snapshot()
    actions = [env.action_space.sample() for _ in range(15)]

    def run(e):
        out = []
        for a in actions:
            step = e.step(a)
            out.append(step[:4])
            if step[2] or step[3]:
                break
        return out

    first = run(env)
    env.restore(snap)
    assert first_difference(run(env), first) is None
    fresh = wrapper(gym.make(env_id, **kwargs))
    fresh.reset(seed=99)
    fresh.restore(pickle.loads(pickle.dumps(snap)))
    assert first_difference(run(fresh), first) is None
    snap.release()


@pytest.mark.parametrize("wrapper", [PickleSnapshot, ReplaySnapshot])
@pytest.mark.parametrize("env_id,kwargs", ENVS)
def test_strategies_pass_check_env(wrapper, env_id, kwargs):
    report = check_env(lambda: wrapper(gym.make(env_id, **kwargs)))
    assert report.ok, str(report)


def test_slippery_frozen_lake_really_depends_on_rng():
    # Without the RNG in the snapshot, continuations would differ: check they can.
    env = gym.make("FrozenLake-v1", is_slippery=True)
    outcomes = set()
    for seed in range(20):
        env.reset(seed=seed)
        outcomes.add(tuple(env.step(2)[0] for _ in range(3)))
    assert len(outcomes) > 1


def test_kinds_and_replay_depth():
    env = ReplaySnapshot(gym.make("CartPole-v1"))
    env.reset(seed=0)
    for _ in range(4):
        env.step(0)
    s = env.snapshot()
    assert s.kind == "replay" and s.meta["replay_depth"] == 4 and s.step == 4
    p = PickleSnapshot(gym.make("CartPole-v1"))
    p.reset(seed=0)
    assert p.snapshot().kind == "pickle"


def test_pickle_snapshot_detects_tampering():
    env = PickleSnapshot(gym.make("CartPole-v1"))
    env.reset(seed=0)
    snap = env.snapshot()
    blob, checksum = snap.payload
    snap._payload = (blob[:-3] + b"xyz", checksum)
    with pytest.raises(SnapshotCorruptError, match="checksum"):
        env.restore(snap)


def test_strategy_snapshots_refuse_other_envs():
    a = PickleSnapshot(gym.make("CartPole-v1"))
    b = PickleSnapshot(gym.make("FrozenLake-v1"))
    r = ReplaySnapshot(gym.make("CartPole-v1"))
    a.reset(seed=0)
    b.reset(seed=0)
    r.reset(seed=0)
    snap = a.snapshot()
    with pytest.raises(SnapshotMismatchError):
        b.restore(snap)
    with pytest.raises(SnapshotMismatchError):
        r.restore(snap)


def test_replay_reset_without_seed_is_reproducible_after_restore():
    env = ReplaySnapshot(gym.make("FrozenLake-v1"))
    env.reset(seed=1)
    snap = env.snapshot()
    first = env.reset()[0], [env.step(1)[0] for _ in range(3)]
    env.restore(snap)
    assert (env.reset()[0], [env.step(1)[0] for _ in range(3)]) == first


def test_register_with_strategy_adds_the_wrapper():
    branchgym.register(
        "branchgym-test/Lake-v0",
        "gymnasium.envs.toy_text:FrozenLakeEnv",
        snapshot="replay",
        kind="replay",
        max_episode_steps=50,
    )
    env = gym.make("branchgym-test/Lake-v0")
    assert "ReplaySnapshot" in repr(env)
    env.reset(seed=0)
    with env.snapshot() as s:
        assert s.kind == "replay"
    assert check_env("branchgym-test/Lake-v0").ok
