"""grow_tree and group_rollouts: topology, stats, state keeping, snapshot release."""

import gymnasium as gym
import numpy as np
import pytest

import branchgym
from branchgym.agents.policies.policy import ScriptedPolicy, TabularPolicy, TextPolicy
from branchgym.rollout.executor_base import EnvRecipe
from branchgym.rollout.executors import InProcessExecutor
from branchgym.rollout.grow import group_rollouts, grow_tree
from branchgym.rollout.schedules import ForkPoint

TEXT = "branchgym/TextTreeMDP-v0"
STEPS = {"gap_unit": "steps"}


def summary(tree):
    return [(n.parent, n.step, n.action, n.observation, n.reward, n.done) for n in tree]


def test_tree_topology_and_no_live_snapshots():
    before = branchgym.live_snapshots().count
    tree = grow_tree(TEXT, TextPolicy(), "entropy", m=2, k=4, seed=0, rng=0, schedule_options=STEPS)
    assert branchgym.live_snapshots().count == before
    assert len(tree.paths()) == 1 + 2 * 3 == tree.stats.rollouts
    bps = tree.branch_points()
    assert len(bps) == 2 and all(b.k == 4 for b in bps)
    backbone = tree.backbone
    for b in bps:
        assert b.siblings[0] == backbone[b.step]  # the backbone's own action is k = 1
        assert tree[b.siblings[0]].sibling == 1
        assert [tree[s].sibling for s in b.siblings[1:]] == [2, 3, 4]
        assert all(tree[s].step == b.step for s in b.siblings)
    # every rollout ends the episode (depth 4 maze) and the backbone came first
    assert all(tree[p[-1]].terminated for p in tree.paths())
    assert tree.paths()[0] == backbone
    s = tree.stats
    assert s.env_steps == len(tree) and s.errors == 0
    assert s.snapshots_taken == len(backbone)  # keep="snapshot": one per backbone decision
    assert s.peak_live_snapshots == len(backbone) and s.peak_live_bytes > 0
    assert s.generated_tokens == tree.generated_tokens() < s.independent_tokens
    assert 0 < s.tokens_saved < 1


def test_siblings_start_from_the_restored_state():
    env = gym.make(TEXT, transition_noise=0.0, reward_noise=0.0)  # deterministic env
    tree = grow_tree(env, TextPolicy(), "entropy", m=2, k=6, seed=3, rng=1, schedule_options=STEPS)
    for b in tree.branch_points():
        first = tree[b.siblings[0]]
        for s in b.siblings[1:]:
            if tree[s].action == first.action:  # same action from the same state
                assert tree[s].observation == first.observation


def test_keep_replay_reproduces_keep_snapshot():
    kw = dict(m=2, k=3, seed=5, schedule_options=STEPS)
    a = grow_tree(TEXT, TextPolicy(), "entropy", keep="snapshot", rng=11, **kw)
    b = grow_tree(TEXT, TextPolicy(), "entropy", keep="replay", rng=11, **kw)
    assert summary(a) == summary(b)
    assert b.stats.snapshots_taken == 2 and b.stats.replay_steps > 0
    assert b.stats.peak_live_snapshots <= 2 < a.stats.peak_live_snapshots
    assert "replay_errors" not in b.meta


def test_env_noise_fresh_makes_siblings_independent_draws():
    spec = EnvRecipe("branchgym/TreeMDP-v0", {"transition_noise": 1.0, "n_outcomes": 4})
    pol = ScriptedPolicy([0])  # every sibling takes the same actions

    def sibling_obs(noise):
        t = grow_tree(spec, pol, "even", m=1, k=8, seed=0, rng=0, env_noise=noise)
        (b,) = t.branch_points()
        return {t[s].observation for s in b.siblings}

    assert len(sibling_obs("shared")) == 1  # common random numbers: identical outcomes
    assert len(sibling_obs("fresh")) > 1


def test_group_rollouts_are_a_root_branch_point():
    before = branchgym.live_snapshots().count
    g = group_rollouts(TEXT, TextPolicy(), 7, seed=0, rng=0)
    assert g.stats.rollouts == 7 and g.stats.snapshots_taken == 0
    (b,) = g.branch_points()
    assert b.parent == -1 and b.k == 7
    assert g.stats.tokens_saved == 0.0 and g.stats.generated_tokens == g.stats.independent_tokens
    assert branchgym.live_snapshots().count == before
    assert len({tuple(g[i].action for i in p) for p in g.paths()}) > 1


def test_matched_compute_tree_vs_group():
    tree = grow_tree(TEXT, TextPolicy(), "entropy", m=2, k=4, seed=1, rng=0, schedule_options=STEPS)
    group = group_rollouts(TEXT, TextPolicy(), 7, seed=1, rng=0)
    assert tree.stats.rollouts == group.stats.rollouts == 7
    assert tree.stats.env_steps < group.stats.env_steps  # shared prefixes are not re-run


def test_step_cap_truncates_invalid_loops():
    tree = grow_tree(
        TEXT,
        TextPolicy(["dance"]),
        "entropy",
        m=1,
        k=2,
        seed=0,
        max_steps=5,
        schedule_options=STEPS,
    )
    for p in tree.paths():
        assert len(p) == 5 and tree[p[-1]].truncated and not tree[p[-1]].terminated
        assert "Invalid action" in tree[p[-1]].observation


def test_fork_inside_a_turn_copies_the_prefix_tokens():
    def at_token_3(tree, backbone, m, rng):
        return [ForkPoint(1, token_offset=3)]

    tree = grow_tree(TEXT, TextPolicy(), at_token_3, m=1, k=3, seed=0, rng=2)
    (b,) = tree.branch_points()
    assert b.token_offset == 3
    main = tree[b.siblings[0]]
    for s in b.siblings[1:]:
        n = tree[s]
        assert n.prefix_len == 3 and list(n.token_ids[:3]) == list(main.token_ids[:3])
    masks = dict((tuple(p), m) for p, m in tree.token_masks())
    sib_path = tuple(tree.path_to(tree.owner(b.siblings[1])))
    assert masks[sib_path][1][:3].sum() == 0 and masks[sib_path][1][3:].all()


def test_teacher_hook_feeds_the_fork_score_schedule():
    def teacher(tree, backbone):
        for nid in backbone:
            n = tree[nid]
            n.teacher_logprobs = n.logprobs - np.linspace(0, 1, n.n_tokens)

    tree = grow_tree(
        TEXT,
        TextPolicy(),
        "fork_score",
        m=3,
        k=3,
        seed=0,
        rng=0,
        teacher=teacher,
        schedule_options={"min_entropy": 0.1},
    )
    assert tree.meta["forks"] and tree.stats.rollouts == 1 + 2 * len(tree.meta["forks"])


def test_env_instance_fast_path_uses_one_instance():
    made = []

    def factory():
        made.append(1)
        return gym.make(TEXT)

    spec = EnvRecipe("counted", factory=factory)
    grow_tree(
        spec,
        TextPolicy(),
        "entropy",
        m=2,
        k=4,
        seed=0,
        rng=0,
        schedule_options=STEPS,
        executor=InProcessExecutor(max_instances=1),
    )
    assert len(made) == 1
    made.clear()
    grow_tree(spec, TextPolicy(), "entropy", m=2, k=4, seed=0, rng=0, schedule_options=STEPS)
    assert len(made) == 6  # the siblings run side by side, one instance each


def test_snapshots_are_released_when_the_policy_fails():
    class Boom(TextPolicy):
        calls = 0

        def act(self, requests, rng):
            Boom.calls += 1
            if Boom.calls == 3:  # fails on the backbone, with 3 snapshots alive
                raise RuntimeError("policy server down")
            return super().act(requests, rng)

    before = branchgym.live_snapshots().count
    with pytest.raises(RuntimeError, match="server down"):
        grow_tree(TEXT, Boom(), "entropy", m=2, k=4, seed=0, rng=0, schedule_options=STEPS)
    assert branchgym.live_snapshots().count == before


def test_bad_arguments():
    with pytest.raises(ValueError, match="keep"):
        grow_tree(TEXT, TextPolicy(), keep="magic")
    with pytest.raises(branchgym.error.OptionError, match="k must be a whole number >= 1"):
        grow_tree(TEXT, TextPolicy(), k=0)
    with pytest.raises(branchgym.error.ScheduleError):
        grow_tree(TEXT, TextPolicy(), "nonsense")


def test_tabular_policy_on_tree_mdp():
    env = gym.make("branchgym/TreeMDP-v0")
    pol = TabularPolicy.uniform(env)
    tree = grow_tree(env, pol, "entropy", m=2, k=3, seed=0, rng=0)
    assert tree.stats.rollouts == 5 and tree.stats.generated_tokens == len(tree)
    assert all(isinstance(n.action, int) for n in tree)
