"""Each executor grows the same tree; a crashing or hanging sibling is recorded, not fatal."""

import os
import sys
import time

import cloudpickle
import gymnasium as gym
import pytest

import branchgym
from branchgym.agents.policies.policy import TextPolicy
from branchgym.envs.toy.text_tree_mdp import TextTreeMDP
from branchgym.error import ExecutorError
from branchgym.rollout.executor_base import EnvRecipe
from branchgym.rollout.executors import (
    InProcessExecutor,
    ThreadExecutor,
    make_executor,
)
from branchgym.rollout.grow import group_rollouts, grow_tree
from branchgym.rollout.process import ProcessExecutor

# Workers (spawned processes, Ray actors) get this module's classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS = {"gap_unit": "steps"}
TEXT = EnvRecipe("branchgym/TextTreeMDP-v0")


class Crashy(TextTreeMDP):
    """A maze whose sandbox fails on 'go south', but only in restored copies (siblings)."""

    default_env_id = "test/Crashy-v0"

    def __init__(self, mode="raise", **kwargs):
        super().__init__(**kwargs)
        self.mode = mode
        self.armed = False

    def _set_state(self, state):
        self.armed = True  # restored: this instance plays a sibling
        return super()._set_state(state)

    def step(self, action):
        if self.armed and action == "go south":
            if self.mode == "raise":
                raise RuntimeError("sandbox crashed")
            if self.mode == "exit":
                os._exit(7)
            if self.mode == "hang":
                time.sleep(2.0)
        return super().step(action)


def crashy(mode):
    def make():
        env = gym.wrappers.TimeLimit(Crashy(mode=mode), 20)
        return branchgym.core.SnapshotAPI(env)

    return EnvRecipe(f"crashy-{mode}", factory=make)


def grow(spec, executor, **kw):
    kw = {"m": 2, "k": 4, "seed": 0, "rng": 3, "schedule_options": STEPS, **kw}
    return grow_tree(spec, TextPolicy(), "entropy", executor=executor, **kw)


def summary(tree):
    return [(n.parent, n.step, n.action, n.observation, n.reward, n.done, n.error) for n in tree]


@pytest.fixture(scope="module")
def procs():
    ex = ProcessExecutor(n_workers=2, sessions_per_worker=3)  # capacity 6: every sibling
    yield ex
    ex.shutdown()


def nodes(tree):
    """Every node with its id, its parent's id and where it hangs: the node list rows follow."""
    return [(n.id, n.rollout, n.sibling, *s) for n, s in zip(tree, summary(tree), strict=True)]


def test_every_executor_grows_the_same_tree_with_the_same_node_ids(procs):
    # Same seeds give the same node list, ids included, on every executor and whatever
    # its capacity (sessions at once): ids follow the schedule, not the order lines finish.
    ref = grow(TEXT, None)
    assert len({n.rollout for n in ref}) == 7  # the backbone and 2 x 3 siblings
    with ProcessExecutor(n_workers=1) as single, ProcessExecutor(n_workers=2) as pair:
        for ex in (
            InProcessExecutor(),
            InProcessExecutor(max_instances=1),
            ThreadExecutor(3),
            ThreadExecutor(2, max_instances=2),
            procs,
            single,
            pair,
        ):
            tree = grow(TEXT, ex)
            assert nodes(tree) == nodes(ref), (ex.name, ex.capacity)
            assert ex.live_snapshots().count == 0
    assert branchgym.live_snapshots().count == 0


def test_node_ids_do_not_depend_on_capacity_with_failed_siblings_and_groups():
    for spec in (TEXT, crashy("raise")):
        trees = [grow(spec, InProcessExecutor(max_instances=c)) for c in (None, 1, 2)]
        assert nodes(trees[1]) == nodes(trees[0]) == nodes(trees[2])
    assert any(n.error for n in trees[0])  # the crashy tree recorded its failed siblings
    groups = [
        group_rollouts(
            TEXT, TextPolicy(), 5, seed=0, rng=1, executor=InProcessExecutor(max_instances=c)
        )
        for c in (None, 1, 3)
    ]
    assert nodes(groups[1]) == nodes(groups[0]) == nodes(groups[2])


def test_process_executor_moves_portable_snapshots_between_workers(procs):
    tree = grow(TEXT, procs, k=6)
    assert tree.stats.rollouts == 11 and tree.stats.snapshot_s > 0 and tree.stats.restore_s > 0
    assert procs.live_snapshots() == branchgym.live_snapshots()  # nothing left in workers


@pytest.mark.parametrize("make", [InProcessExecutor, lambda: ThreadExecutor(2)])
def test_a_crashing_sibling_is_recorded_and_the_tree_completes(make):
    with make() as ex:
        tree = grow(crashy("raise"), ex)
    failed = [n for n in tree if n.error]
    assert failed and all("sandbox crashed" in n.error for n in failed)
    assert all(n.action == "go south" and n.truncated and n.sibling != 1 for n in failed)
    assert tree.stats.rollouts == 7 and tree.stats.errors == len(failed)
    ok = [tree[p[-1]] for p in tree.paths() if not tree[p[-1]].error]
    assert ok and all(n.terminated for n in ok)  # the other rollouts finished normally
    assert tree.paths()[0] == tree.backbone and not any(tree[i].error for i in tree.backbone)
    assert branchgym.live_snapshots().count == 0


def test_a_sibling_that_kills_its_worker_process():
    with ProcessExecutor(n_workers=2) as procs:  # one session per worker: nothing else lost
        tree = grow(crashy("exit"), procs)
        again = summary(grow(TEXT, procs))
    failed = [n for n in tree if n.error]
    assert failed and all("worker died" in n.error and "exit code 7" in n.error for n in failed)
    assert tree.stats.rollouts == 7
    ok = [tree[p[-1]] for p in tree.paths() if not tree[p[-1]].error]
    assert ok and all(n.terminated for n in ok)
    # the dead worker was replaced: the executor still works
    assert again == summary(grow(TEXT, InProcessExecutor(max_instances=2)))


def test_sessions_sharing_a_dead_worker_are_reported_lost(procs):
    tree = grow(crashy("exit"), procs)  # 3 sessions per worker
    errors = [n.error for n in tree if n.error]
    assert any("exit code 7" in e for e in errors)
    assert all("exit code 7" in e for e in errors)  # the others say they died with it
    assert tree.stats.rollouts == 7


@pytest.mark.parametrize(
    "make",
    [
        lambda: InProcessExecutor(timeout=0.3),
        lambda: ThreadExecutor(2, timeout=0.3),
        lambda: ProcessExecutor(1, timeout=0.5),
    ],
)
def test_a_hanging_sibling_times_out(make):
    with make() as ex:
        tree = grow(crashy("hang"), ex)
    failed = [n for n in tree if n.error]
    assert failed and all(n.error.startswith("timeout") for n in failed)
    assert tree.stats.rollouts == 7


class Pinned(TextTreeMDP):
    """A maze whose snapshots may not leave their process (like live containers)."""

    default_env_id = "test/Pinned-v0"
    snapshot_picklable = False


def test_unpicklable_snapshots_stay_on_their_worker():
    spec = EnvRecipe("pinned", factory=lambda: branchgym.core.SnapshotAPI(Pinned()))
    with ProcessExecutor(n_workers=2) as ex:
        tree = grow(spec, ex)
        assert tree.stats.rollouts == 7 and tree.stats.errors == 0
        assert ex.live_snapshots().count == 0  # released inside the worker
    assert summary(tree) == summary(grow(spec, InProcessExecutor(max_instances=2)))


def test_executor_arguments():
    with pytest.raises(ExecutorError, match="no executor named"):
        make_executor("gpu-farm")
    with pytest.raises(ExecutorError, match="n_workers"):
        ThreadExecutor(0)
    with pytest.raises(ExecutorError, match="timeout"):
        InProcessExecutor(timeout=0)
    ex = InProcessExecutor()
    ex.shutdown()
    with pytest.raises(ExecutorError, match="shut down"):
        ex.reset([TEXT], [0])


def test_pool_cap_is_enforced():
    ex = InProcessExecutor(max_instances=1)
    (a,) = ex.reset([TEXT], [0])
    (b,) = ex.reset([TEXT], [0])
    assert a.error is None and "busy" in b.error
    ex.close([a.session])
    (c,) = ex.reset([TEXT], [0])
    assert c.error is None
    ex.shutdown()


@pytest.mark.slow
def test_ray_executor_with_a_crashing_actor():
    ray = pytest.importorskip("ray")
    from branchgym.rollout.ray import RayExecutor

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's own cloudpickle
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with RayExecutor(n_workers=2) as ex:  # capacity 2: node ids as with room for all
            assert nodes(grow(TEXT, ex)) == nodes(grow(TEXT, None))
            tree = grow(crashy("exit"), ex)
            failed = [n for n in tree if n.error]
            assert failed and all("worker died" in n.error for n in failed)
            assert tree.stats.rollouts == 7
            assert ex.live_snapshots().count == 0
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_ray_executor_stops_the_ray_runtime_it_started_and_only_that():
    """A runtime left up by one executor made the next test's ``ray.init`` fail in CI."""
    ray = pytest.importorskip("ray")
    from branchgym.rollout.ray import RayExecutor

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    assert not ray.is_initialized()
    with RayExecutor(n_workers=1) as ex:  # starts a local runtime of its own
        assert ray.is_initialized()
        assert nodes(grow(TEXT, ex)) == nodes(grow(TEXT, None))
    assert not ray.is_initialized()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with RayExecutor(n_workers=1) as ex:
            assert nodes(grow(TEXT, ex)) == nodes(grow(TEXT, None))
        assert ray.is_initialized()  # the caller's runtime is the caller's to stop
    finally:
        ray.shutdown()
