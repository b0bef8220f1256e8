"""Planned schedules: siblings start as the backbone reaches their point, same tree as after it."""

import gymnasium as gym
import numpy as np
import pytest

import branchgym
from branchgym.agents.policies.policy import TabularPolicy, TextPolicy
from branchgym.error import OptionError, ScheduleError
from branchgym.rollout.batch import BatchStats, grow_trees_batched
from branchgym.rollout.executor_base import EnvRecipe
from branchgym.rollout.executors import InProcessExecutor
from branchgym.rollout.grow import grow_tree
from branchgym.rollout.schedules import depths_schedule, get_schedule, planned_steps

TEXT = "branchgym/TextTreeMDP-v0"
DEPTHS = {"schedule_options": {"depths": (0, 2)}, "m": 2, "k": 4}


def summary(tree):
    return [
        (n.id, n.parent, n.step, n.action, n.observation, n.reward, n.done, n.sibling)
        + (n.rollout, n.error, n.token_ids.tolist(), n.logprobs.tolist())
        for n in tree
    ]


class Counting:
    """A policy that records how many lines each of its calls asked for."""

    def __init__(self, policy):
        self.policy, self.lines = policy, []

    def act(self, requests, rng):
        self.lines.append(sum(r.n for r in requests))
        return self.policy.act(requests, rng)


def test_only_planned_schedules_have_steps():
    assert planned_steps(get_schedule("depths"), 2, {"depths": (3, 1, 3)}) == [1, 3]
    assert planned_steps(get_schedule("entropy"), 2, {}) is None
    assert planned_steps(get_schedule("even"), 2) is None
    with pytest.raises(ScheduleError, match="whole numbers >= 0"):
        planned_steps(depths_schedule, 1, {"depths": (-1,)})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_overlapped_tree_equals_the_backbone_first_tree(seed):
    before = branchgym.live_snapshots().count
    first, overlapped = Counting(TextPolicy()), Counting(TextPolicy())
    a = grow_tree(TEXT, first, "depths", seed=seed, rng=seed, overlap=False, **DEPTHS)
    b = grow_tree(TEXT, overlapped, "depths", seed=seed, rng=seed, **DEPTHS)
    assert summary(b) == summary(a)
    assert b.meta["forks"] == a.meta["forks"] and len(b.branch_points()) == 2
    assert b.stats.rollouts == a.stats.rollouts == 7
    # the same lines asked for, in fewer and fuller calls: the maze is 4 decisions deep,
    # so the backbone-first order makes 4 calls, then 4 more for the siblings
    assert sum(overlapped.lines) == sum(first.lines)
    assert len(overlapped.lines) == 4 < len(first.lines) == 8
    assert max(overlapped.lines) == 7 > max(first.lines)
    # snapshots only at the planned points, all released
    assert b.stats.snapshots_taken == 2 < a.stats.snapshots_taken
    assert branchgym.live_snapshots().count == before


def test_a_backbone_that_ends_before_a_depth_does_not_branch_there():
    env = gym.make("branchgym/TreeMDP-v0")
    pol = TabularPolicy.uniform(env)
    kw = {"m": 2, "k": 3, "seed": 4, "rng": 4, "schedule_options": {"depths": (1, 40)}}
    a = grow_tree("branchgym/TreeMDP-v0", pol, "depths", overlap=False, **kw)
    b = grow_tree("branchgym/TreeMDP-v0", pol, "depths", **kw)
    assert summary(b) == summary(a)
    assert [f["step"] for f in b.meta["forks"]] == [1] and b.stats.rollouts == 3


@pytest.mark.parametrize("capacity", [1, 2, 3])
def test_the_executors_capacity_bounds_the_overlap(capacity):
    ref = grow_tree(TEXT, TextPolicy(), "depths", seed=3, rng=3, overlap=False, **DEPTHS)
    with InProcessExecutor(max_instances=capacity) as ex:
        tree = grow_tree(TEXT, TextPolicy(), "depths", seed=3, rng=3, executor=ex, **DEPTHS)
        assert ex.live_snapshots().count == 0
    assert summary(tree) == summary(ref)


def test_an_env_instance_grows_the_same_tree_in_one_session():
    made = []

    def factory():
        made.append(1)
        return gym.make(TEXT)

    spec = EnvRecipe("counted", factory=factory)
    one = InProcessExecutor(max_instances=1)
    tree = grow_tree(spec, TextPolicy(), "depths", seed=1, rng=1, executor=one, **DEPTHS)
    one.shutdown()
    assert len(made) == 1
    ref = grow_tree(TEXT, TextPolicy(), "depths", seed=1, rng=1, overlap=False, **DEPTHS)
    assert [n.observation for n in tree] == [n.observation for n in ref]


def test_batched_overlapped_trees_equal_serial_backbone_first_trees():
    seeds = [0, 1, 2, 3]
    serial = [
        grow_tree(TEXT, TextPolicy(), "depths", seed=s, rng=s, overlap=False, **DEPTHS)
        for s in seeds
    ]
    policy, stats = Counting(TextPolicy()), BatchStats()
    batched = grow_trees_batched(TEXT, policy, seeds, "depths", stats=stats, **DEPTHS)
    assert [summary(t) for t in batched] == [summary(t) for t in serial]
    # one merged call per turn of the deepest line: 4 trees x 7 lines in 4 calls
    assert len(policy.lines) == 4 and sum(policy.lines) == sum(len(t) for t in serial)
    assert policy.lines[0] == 4 * 4  # every backbone and its 3 root siblings at once


def test_overlap_needs_a_planned_schedule():
    with pytest.raises(OptionError, match="planned schedule"):
        grow_tree(TEXT, TextPolicy(), "entropy", m=2, k=3, seed=0, overlap=True)


def test_a_teacher_scores_the_finished_backbone():
    seen = []

    def teacher(tree, backbone):
        seen.append(len(backbone))
        for nid in backbone:
            tree[nid].teacher_logprobs = np.zeros(tree[nid].n_tokens)

    kw = {"seed": 2, "rng": 2, "teacher": teacher, **DEPTHS}
    a = grow_tree(TEXT, TextPolicy(), "depths", **kw)  # default: backbone first
    b = grow_tree(TEXT, TextPolicy(), "depths", overlap=True, **kw)
    assert summary(a) == summary(b) and seen == [4, 4]
    assert all(b[i].teacher_logprobs is not None for i in b.backbone)
