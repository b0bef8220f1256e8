"""Batched rollouts: trees grown in lockstep equal the trees grown one after another."""

import gymnasium as gym
import numpy as np
import pytest

import branchgym
from branchgym.agents.policies.policy import ActRequest, Context, TextPolicy
from branchgym.error import OptionError
from branchgym.rollout.batch import (
    BatchStats,
    group_rollouts_batched,
    grow_trees_batched,
    run_batched,
)
from branchgym.rollout.executors import InProcessExecutor
from branchgym.rollout.grow import group_rollouts, grow_tree

TEXT = "branchgym/TextTreeMDP-v0"
KW = {"m": 2, "k": 3, "schedule_options": {"gap_unit": "steps"}}


def summary(tree):
    return [
        (n.parent, n.step, n.action, n.observation, n.reward, n.done, n.sibling, n.rollout)
        + (n.token_ids.tolist(), n.logprobs.tolist(), n.entropies.tolist())
        for n in tree
    ]


class Counting:
    """A policy that counts its calls and the requests in them."""

    def __init__(self, policy):
        self.policy, self.calls, self.requests = policy, 0, []

    def act(self, requests, rng):
        self.calls += 1
        self.requests.append(len(requests))
        return self.policy.act(requests, rng)


@pytest.mark.parametrize("executor", ["inprocess", "thread"])
def test_batched_trees_equal_serial_trees(executor):
    seeds = [0, 1, 2, 3]
    serial_policy = Counting(TextPolicy())
    serial = [grow_tree(TEXT, serial_policy, "entropy", seed=s, rng=10 + s, **KW) for s in seeds]
    before = branchgym.live_snapshots().count
    policy, stats = Counting(TextPolicy()), BatchStats()
    batched = grow_trees_batched(
        TEXT, policy, seeds, "entropy", rngs=[10 + s for s in seeds], executor=executor,
        stats=stats, **KW,
    )  # fmt: skip
    assert [summary(t) for t in batched] == [summary(t) for t in serial]
    assert branchgym.live_snapshots().count == before
    # one merged call per turn: far fewer calls, each with several trees' requests
    assert policy.calls == stats.policy_calls < serial_policy.calls
    assert max(policy.requests) >= len(seeds) and sum(policy.requests) == stats.requests
    assert stats.env_ops > stats.env_calls  # env calls merged across trees too


def test_batched_groups_equal_serial_groups():
    seeds = [3, 4, 5]
    serial = [group_rollouts(TEXT, TextPolicy(), 4, seed=s, rng=s) for s in seeds]
    policy = Counting(TextPolicy())
    batched = group_rollouts_batched(TEXT, policy, seeds, 4)
    assert [summary(t) for t in batched] == [summary(t) for t in serial]
    longest = max(max(n.step for n in t) for t in serial) + 1
    assert policy.calls == longest  # every turn of all 12 rollouts: one call


def test_executor_capacity_limits_the_live_trees():
    seeds = [0, 1, 2]
    # a tree is reproducible at a given capacity: compare with one session per tree
    one = InProcessExecutor(max_instances=1)
    serial = [
        grow_tree(TEXT, TextPolicy(), "entropy", seed=s, rng=s, executor=one, **KW) for s in seeds
    ]
    one.shutdown()
    ex = InProcessExecutor(max_instances=2)
    try:  # two trees at a time, one session each; the third starts when one ends
        batched = grow_trees_batched(TEXT, TextPolicy(), seeds, "entropy", executor=ex, **KW)
    finally:
        ex.shutdown()
    assert [summary(t) for t in batched] == [summary(t) for t in serial]


def test_a_failing_job_raises_after_the_others_release_their_snapshots():
    before = branchgym.live_snapshots().count

    def bad(policy, executor):
        grow_tree(TEXT, policy, "entropy", seed=0, rng=0, executor=executor, max_steps=1, **KW)
        raise RuntimeError("job failed")

    good = [
        lambda policy, executor, s=s: grow_tree(
            TEXT, policy, "entropy", seed=s, rng=s, executor=executor, **KW
        )
        for s in (1, 2)
    ]
    with pytest.raises(RuntimeError, match="job failed"):
        run_batched([good[0], bad, good[1]], TextPolicy())
    assert branchgym.live_snapshots().count == before


def test_requests_without_their_own_streams_are_not_merged():
    ctx = Context(TEXT, "start", {"admissible_actions": ["go north", "go east"]})
    policy = Counting(TextPolicy())

    def job(policy, executor, own):
        rngs = (np.random.default_rng(0),) if own else ()
        return policy.act([ActRequest(ctx, 1, (), rngs)], np.random.default_rng(1))

    out = run_batched([lambda p, executor, o=o: job(p, executor, o) for o in (1, 1, 0)], policy)
    assert len(out) == 3 and all(len(b) == 1 for b in out)
    assert policy.requests == [2, 1]  # the two with streams together, the other alone


def test_env_instances_are_refused():
    env = gym.make(TEXT)
    with pytest.raises(OptionError, match="EnvRecipe"):
        grow_trees_batched(env, TextPolicy(), [0, 1])
    with pytest.raises(OptionError, match="one rng per seed"):
        grow_trees_batched(TEXT, TextPolicy(), [0, 1], rngs=[0])
