"""The snapshot protocol: handles, errors, wrapper stacks."""

import pickle

import gymnasium as gym
import numpy as np
import pytest

import branchgym
from branchgym.core import StackSnapshot
from branchgym.error import (
    ResetNeededError,
    SnapshotCorruptError,
    SnapshotMismatchError,
    SnapshotNotPicklableError,
    SnapshotNotSupportedError,
    SnapshotReleasedError,
    UnsnapshottableWrapperError,
    WrapperStateError,
)
from branchgym.wrappers import PickleSnapshot


def walk(env, actions):
    return [env.step(a)[:4] for a in actions]


def test_snapshot_metadata_and_round_trip(tree_env):
    obs, _ = tree_env.reset(seed=3)
    tree_env.step(1)
    snap = tree_env.snapshot()
    assert isinstance(snap, StackSnapshot)
    assert snap.env_id == "branchgym/TreeMDP-v0"
    assert snap.step == 1 and snap.kind == "state" and snap.picklable
    assert snap.nbytes > 0 and len(snap.spec_hash) == 32
    after = walk(tree_env, [0, 2, 1])
    tree_env.restore(snap)
    assert walk(tree_env, [0, 2, 1]) == after
    snap.release()


def test_release_context_manager_and_live_count(tree_env):
    tree_env.reset(seed=0)
    base = branchgym.live_snapshots().count
    with tree_env.snapshot() as snap:
        assert branchgym.live_snapshots().count == base + 1
        # the live count is the env's own snapshots; this view adds the wrapper states
        assert 0 < branchgym.live_snapshots().nbytes <= snap.nbytes
    assert snap.released
    assert branchgym.live_snapshots().count == base
    with pytest.raises(SnapshotReleasedError, match="take a new snapshot"):
        tree_env.restore(snap)
    with pytest.raises(SnapshotReleasedError):
        pickle.dumps(snap)
    snap.release()  # idempotent


def test_on_release_runs_once_and_on_gc():
    calls = []
    snap = branchgym.Snapshot(
        env_id="x",
        spec_hash="h",
        step=0,
        kind="overlay",
        payload="dir",
        picklable=False,
        on_release=calls.append,
    )
    snap.release()
    snap.release()
    assert calls == ["dir"]
    snap2 = branchgym.Snapshot(
        env_id="x",
        spec_hash="h",
        step=0,
        kind="overlay",
        payload="dir2",
        picklable=False,
        on_release=calls.append,
    )
    del snap2
    import gc

    gc.collect()
    assert calls == ["dir", "dir2"], "a dropped snapshot must still free its resources"


def test_not_picklable_snapshot_refuses_clearly():
    snap = branchgym.Snapshot(
        env_id="x", spec_hash="h", step=0, kind="container", payload=object(), picklable=False
    )
    with pytest.raises(SnapshotNotPicklableError, match="portable"):
        pickle.dumps(snap)
    snap.release()


def test_mismatched_spec_is_rejected():
    a = gym.make("branchgym/TreeMDP-v0", depth=3)
    b = gym.make("branchgym/TreeMDP-v0", depth=4)
    c = gym.make("branchgym/TextTreeMDP-v0", depth=3)
    a.reset(seed=0)
    b.reset(seed=0)
    c.reset(seed=0)
    with a.snapshot() as snap:
        with pytest.raises(SnapshotMismatchError, match="spec kwargs differ"):
            b.restore(snap)
        with pytest.raises(SnapshotMismatchError, match="env id differ"):
            c.restore(snap)
        with pytest.raises(SnapshotMismatchError, match="wrapper stack"):
            a.unwrapped.restore(snap)
    with pytest.raises(SnapshotMismatchError, match="takes a branchgym Snapshot"):
        a.restore("not a snapshot")


def test_restore_does_not_change_env_on_mismatch():
    a = gym.make("branchgym/TreeMDP-v0", depth=3)
    b = gym.make("branchgym/TreeMDP-v0", depth=4)
    a.reset(seed=0)
    b.reset(seed=1)
    b.step(0)
    before = b.state_digest()
    with a.snapshot() as snap, pytest.raises(SnapshotMismatchError):
        b.restore(snap)
    assert b.state_digest() == before


def test_bytes_round_trip_and_corruption(tree_env):
    tree_env.reset(seed=1)
    tree_env.step(2)
    with tree_env.snapshot() as snap:
        data = snap.to_bytes()
    copy = branchgym.Snapshot.from_bytes(data)
    other = gym.make("branchgym/TreeMDP-v0")
    other.reset(seed=9)
    other.restore(copy)
    assert other.state_digest() == tree_env.state_digest()
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF
    with pytest.raises(SnapshotCorruptError, match="signature"):
        branchgym.Snapshot.from_bytes(bytes(flipped))
    with pytest.raises(SnapshotCorruptError, match="not a branchgym snapshot"):
        branchgym.Snapshot.from_bytes(b"garbage")
    with pytest.raises(SnapshotCorruptError):
        branchgym.Snapshot.from_bytes(data[:40])


def test_corrupt_pickled_payload_raises_on_restore(tree_env):
    tree_env.reset(seed=1)
    snap = tree_env.unwrapped.snapshot()
    raw = pickle.dumps(snap)
    state_repr = pickle.dumps(snap.payload, protocol=5)
    # flip one byte inside the embedded payload blob
    i = raw.find(state_repr[20:40])
    assert i > 0
    bad = bytearray(raw)
    bad[i + 5] ^= 0x01
    # Refused when the bytes are loaded: the payload's signature no longer matches.
    with pytest.raises(SnapshotCorruptError, match="signature"):
        tree_env.unwrapped.restore(pickle.loads(bytes(bad)))


def test_malformed_payload_is_corrupt(tree_env):
    tree_env.reset(seed=0)
    base = tree_env.unwrapped
    ident = base.snapshot_identity()
    fake = branchgym.Snapshot(
        env_id=ident[0],
        spec_hash=ident[1],
        step=0,
        kind="state",
        payload=((10**9, 0, 0.0), None),
        picklable=True,
    )
    with pytest.raises(SnapshotCorruptError, match="malformed"):
        base.restore(fake)


def test_time_limit_truncates_at_the_right_step_after_restore():
    env = gym.make("branchgym/TextTreeMDP-v0", depth=8, n_outcomes=1, max_episode_steps=5)
    env.reset(seed=0)
    for _ in range(2):
        env.step("go north")
    snap = env.snapshot()
    for _ in range(3):
        *_, truncated, _ = env.step("go east")
    assert truncated
    env.restore(snap)
    truncs = [env.step("go south")[3] for _ in range(3)]
    assert truncs == [False, False, True], "TimeLimit's counter must be part of the snapshot"
    # restoring into a fresh instance restores the counter too
    other = gym.make("branchgym/TextTreeMDP-v0", depth=8, n_outcomes=1, max_episode_steps=5)
    other.restore(snap)
    assert [other.step("go south")[3] for _ in range(3)] == [False, False, True]


def test_order_enforcing_state_travels_with_snapshot():
    env = gym.make("branchgym/TreeMDP-v0")
    env.reset(seed=0)
    snap = env.snapshot()
    fresh = gym.make("branchgym/TreeMDP-v0")
    with pytest.raises(gym.error.ResetNeeded):
        fresh.step(0)
    fresh.restore(snap)
    fresh.step(0)  # restored a reset env: stepping is allowed


def test_record_episode_statistics_is_part_of_the_state():
    env = gym.wrappers.RecordEpisodeStatistics(gym.make("branchgym/TreeMDP-v0", depth=3))
    env.reset(seed=0)
    env.step(0)
    snap = branchgym.snapshot(env)
    for _ in range(2):
        *_, info = env.step(1)
    ep1 = info["episode"]
    branchgym.restore(env, snap)
    assert env.episode_lengths == 1
    for _ in range(2):
        *_, info = env.step(1)
    assert info["episode"]["l"] == ep1["l"] == 3
    assert info["episode"]["r"] == ep1["r"]
    assert len(env.return_queue) == 1, "the queue of finished episodes is restored too"


class CounterWrapper(gym.Wrapper):
    def __init__(self, env):
        super().__init__(env)
        self.count = 0

    def step(self, action):
        self.count += 1
        return super().step(action)


class DeclaredCounter(CounterWrapper):
    branchgym_state_attrs = ("count",)


def test_unknown_wrapper_fails_loudly_and_declaration_fixes_it():
    env = CounterWrapper(gym.make("branchgym/TreeMDP-v0"))
    env.reset(seed=0)
    with pytest.raises(UnsnapshottableWrapperError, match="CounterWrapper"):
        branchgym.snapshot(env)
    env2 = DeclaredCounter(gym.make("branchgym/TreeMDP-v0"))
    env2.reset(seed=0)
    env2.step(0)
    snap = branchgym.snapshot(env2)
    env2.step(0)
    branchgym.restore(env2, snap)
    assert env2.count == 1


def wrapper_of(env, cls):
    while not isinstance(env, cls):
        env = env.env
    return env


def test_wrapper_missing_a_declared_attribute_names_wrapper_and_attribute():
    """Another Gymnasium version, simulated: a wrapper without a private name the table has."""

    def stack_without(cls, name, pickled):
        env = gym.make("branchgym/TreeMDP-v0", max_episode_steps=50)
        env = PickleSnapshot(env) if pickled else env
        env.reset(seed=0)
        delattr(wrapper_of(env, cls), name)
        return env

    for pickled in (False, True):
        env = stack_without(gym.wrappers.PassiveEnvChecker, "checked_data_reuse", pickled)
        want = r"PassiveEnvChecker has no attribute 'checked_data_reuse'"
        with pytest.raises(WrapperStateError, match=want) as exc:
            branchgym.snapshot(env)
        assert "register_wrapper_state(PassiveEnvChecker" in str(exc.value)
        assert isinstance(exc.value, UnsnapshottableWrapperError)
        if not pickled:  # digests skip volatile attributes, and PassiveEnvChecker's all are
            branchgym.state_digest(env)
        env = stack_without(gym.wrappers.TimeLimit, "_elapsed_steps", pickled)
        with pytest.raises(WrapperStateError, match=r"TimeLimit has no attribute '_elapsed_"):
            branchgym.state_digest(env)


def test_stateless_declaration():
    class Tag(gym.Wrapper):
        pass

    env = Tag(gym.make("branchgym/TreeMDP-v0"))
    env.reset(seed=0)
    with pytest.raises(UnsnapshottableWrapperError):
        branchgym.snapshot(env)
    branchgym.declare_stateless(Tag)
    branchgym.snapshot(env).release()


def test_observation_wrappers_transform_restored_observation():
    base = gym.make("branchgym/TreeMDP-v0")
    env = gym.wrappers.TransformObservation(base, lambda o: o * 10, base.observation_space)
    env = gym.wrappers.FrameStackObservation(env, 3)
    obs0, _ = env.reset(seed=0)
    obs1, *_ = env.step(1)
    snap = branchgym.snapshot(env)
    env.step(2)
    obs, _ = branchgym.restore(env, snap)
    np.testing.assert_array_equal(obs, obs1)
    assert obs1[-1] % 10 == 0


def test_plain_env_needs_a_strategy():
    env = gym.make("FrozenLake-v1")
    env.reset(seed=0)
    with pytest.raises(SnapshotNotSupportedError, match="PickleSnapshot"):
        branchgym.snapshot(env)


def test_rng_is_part_of_the_state():
    env = gym.make("branchgym/TreeMDP-v0", transition_noise=1.0, reward_noise=0.5)
    env.reset(seed=0)
    snap = env.snapshot()
    runs = []
    for _ in range(3):
        env.restore(snap)
        runs.append([env.step(0)[0] for _ in range(4)])
    assert runs[0] == runs[1] == runs[2]


def test_step_before_reset_is_a_typed_error():
    env = branchgym.envs.toy.TreeMDP()
    with pytest.raises(ResetNeededError, match="reset"):
        env.step(0)


def test_reseed_gives_siblings_independent_env_randomness():
    env = gym.make("branchgym/TreeMDP-v0", depth=6, n_outcomes=2, transition_noise=1.0)
    env.reset(seed=0)
    env.step(0)
    snap = env.snapshot()

    def sibling(seed):
        env.restore(snap)
        if seed is not None:
            branchgym.reseed(env, seed)
        return tuple(env.step(0)[0] for _ in range(5))

    shared = {sibling(None) for _ in range(4)}
    assert len(shared) == 1, "without reseed, siblings replay the snapshot's RNG"
    reseeded = {sibling(s) for s in range(8)}
    assert len(reseeded) > 1
    assert sibling(3) == sibling(3), "the same sibling seed reproduces"


@pytest.mark.parametrize("strategy", ["pickle", "replay"])
def test_reseed_through_strategy_wrappers(strategy):
    from branchgym.wrappers import PickleSnapshot, ReplaySnapshot

    wrap = PickleSnapshot if strategy == "pickle" else ReplaySnapshot
    env = wrap(gym.make("FrozenLake-v1", is_slippery=True))
    env.reset(seed=0)
    branchgym.reseed(env, 11)
    snap = env.snapshot()
    first = [env.step(1)[0] for _ in range(4)]
    env.restore(snap)
    assert [env.step(1)[0] for _ in range(4)] == first
    if strategy == "replay":
        assert snap.step == 0 and snap.meta["replay_depth"] == 0
        with pytest.raises(ValueError, match="explicit seed"):
            branchgym.reseed(env, None)


def test_stack_view_reports_release_of_its_inner_snapshot(tree_env):
    tree_env.reset(seed=0)
    snap = tree_env.snapshot()
    assert not snap.released
    snap.inner.release()  # as an env's close() does for the snapshots it owns
    assert snap.released
    with pytest.raises(SnapshotReleasedError):
        tree_env.restore(snap)


def test_one_identity_for_envs_and_strategy_wrappers(tree_env):
    """SnapshottableEnv and the stack wrappers compute the pair with one function."""
    from branchgym.core import spec_identity, stack_identity
    from branchgym.digest import stable_hash

    base = tree_env.unwrapped
    assert base.snapshot_identity() == spec_identity(base.spec.id, base._snapshot_config())
    cart = gym.make("CartPole-v1")
    assert stack_identity(cart) == ("CartPole-v1", stable_hash(dict(cart.unwrapped.spec.kwargs)))
    # Unhashable kwargs fall back on their repr, independent of keyword order.
    odd = object()
    assert spec_identity("x", {"a": 1, "b": odd}) == spec_identity("x", {"b": odd, "a": 1})
    assert spec_identity("x", {"a": 1}) != spec_identity("y", {"a": 1})


def test_strategy_wrappers_refuse_stack_snapshots_and_other_kinds():
    from branchgym.wrappers import PickleSnapshot, ReplaySnapshot

    pickled = PickleSnapshot(gym.make("CartPole-v1"))
    replayed = ReplaySnapshot(gym.make("CartPole-v1"))
    pickled.reset(seed=0)
    replayed.reset(seed=0)
    with pytest.raises(SnapshotMismatchError, match="'replay' snapshot"):
        pickled.restore(replayed.snapshot())
    with pytest.raises(SnapshotMismatchError, match="takes a branchgym Snapshot"):
        replayed.restore("not a snapshot")
    stacked = gym.wrappers.RecordEpisodeStatistics(gym.make("branchgym/TreeMDP-v0"))
    stacked.reset(seed=0)
    with branchgym.snapshot(stacked) as snap, pytest.raises(SnapshotMismatchError, match="stack"):
        pickled.restore(snap)
