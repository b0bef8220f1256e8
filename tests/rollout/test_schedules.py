"""Every branch schedule, and BranchOPD's fork-score math."""

import collections
import math

import gymnasium as gym
import numpy as np
import pytest

from branchgym.agents.policies.policy import TabularPolicy
from branchgym.envs.toy.tree_mdp import TreeStructure
from branchgym.error import ScheduleError
from branchgym.rollout.grow import grow_tree
from branchgym.rollout.schedules import (
    SCHEDULES,
    ForkPoint,
    fork_score_schedule,
    fork_scores,
    get_schedule,
    rank_normalize,
    register_schedule,
    select_token_forks,
    select_turn_forks,
    topk_entropy,
    window_disagreement,
)
from branchgym.rollout.tree import ROOT, RolloutTree


def backbone(per_node_entropies, tokens=None):
    """A one-path tree whose node t has the given per-token entropies."""
    t = RolloutTree()
    parent = ROOT
    for i, ents in enumerate(per_node_entropies):
        ents = np.atleast_1d(np.asarray(ents, dtype=float))
        n = len(ents) if tokens is None else tokens
        ents = np.resize(ents, n)
        done = i == len(per_node_entropies) - 1
        parent = t.add(
            parent,
            token_ids=np.arange(n),
            logprobs=np.full(n, -1.0),
            entropies=ents,
            terminated=done,
        ).id
    return t, t.backbone


def steps(points):
    return [p.step for p in points]


RNG = np.random.default_rng


def test_entropy_top_m_with_token_gap():
    # 40 tokens per action: positions 0, 40, 80, 120, 160
    t, bb = backbone([0.1, 0.9, 0.8, 0.2, 0.7], tokens=40)
    assert steps(SCHEDULES["entropy"](t, bb, 2, RNG(0))) == [1, 4]  # 0.8 is 40 < 64 from 0.9
    assert steps(SCHEDULES["entropy"](t, bb, 2, RNG(0), min_gap=32)) == [1, 2]
    # only two points are 64 apart from each other among the top three
    assert steps(SCHEDULES["entropy"](t, bb, 3, RNG(0))) == [1, 4]
    assert steps(SCHEDULES["entropy"](t, bb, 3, RNG(0), fill=True)) == [1, 2, 4]


def test_entropy_reductions_change_the_choice():
    # action 0: one confident token then a very uncertain one (mean .5, first 0, sum 1)
    # action 1: three medium tokens (mean .4, first .4, sum 1.2)
    # action 2: one token of .45
    t, bb = backbone([[0.0, 1.0], [0.4, 0.4, 0.4], [0.45]])

    def pick(r):
        return steps(SCHEDULES["entropy"](t, bb, 1, RNG(0), reduce=r, gap_unit="steps"))

    assert pick("mean") == [0]
    assert pick("first") == [2]
    assert pick("sum") == [1]
    with pytest.raises(ScheduleError, match="reduction"):
        pick("median")


def test_steps_gap_for_envs_without_tokens():
    t, bb = backbone([0.3, 0.9, 0.8, 0.1])  # one token per action: gap is 1 step
    assert steps(SCHEDULES["entropy"](t, bb, 2, RNG(0))) == [1, 2]
    assert steps(SCHEDULES["entropy"](t, bb, 2, RNG(0), min_gap=2)) == [1, 3]
    assert steps(SCHEDULES["lowest_entropy"](t, bb, 2, RNG(0))) == [0, 3]
    assert SCHEDULES["entropy"](t, bb, 0, RNG(0)) == []
    assert steps(SCHEDULES["entropy"](t, bb, 9, RNG(0))) == [0, 1, 2, 3]  # M capped at T
    with pytest.raises(ScheduleError, match="M must be"):
        SCHEDULES["entropy"](t, bb, -1, RNG(0))


def test_ties_break_at_random_not_by_step():
    t, bb = backbone([0.5] * 6)
    firsts = {tuple(steps(SCHEDULES["entropy"](t, bb, 1, RNG(s)))) for s in range(30)}
    assert len(firsts) > 3


def test_random_schedule_is_uniform_and_reproducible():
    t, bb = backbone([0.5, 0.1, 0.9, 0.3, 0.2])
    assert SCHEDULES["random"](t, bb, 2, RNG(7)) == SCHEDULES["random"](t, bb, 2, RNG(7))
    counts = collections.Counter()
    for s in range(2000):
        pts = SCHEDULES["random"](t, bb, 2, RNG(s))
        assert len(set(steps(pts))) == 2
        counts.update(steps(pts))
    freq = np.array([counts[i] for i in range(5)]) / 4000
    np.testing.assert_allclose(freq, 0.2, atol=0.03)  # 2000 draws: sd of each freq ~0.006


def test_even_schedule():
    t, bb = backbone([0.1] * 9)
    assert steps(SCHEDULES["even"](t, bb, 2, RNG(0))) == [3, 6]
    assert steps(SCHEDULES["even"](t, bb, 3, RNG(0))) == [2, 4, 7]
    t, bb = backbone([0.1] * 3)
    assert steps(SCHEDULES["even"](t, bb, 5, RNG(0))) == [0, 1, 2]


def _oracle_env():
    def leaf(m):
        return {"reward": m}

    # Root: two actions with the same value (no advantage spread at step 0). Step 1: a
    # good and a bad action (large spread). Step 2: both actions equal again.
    def sub(good, bad):
        return {
            "actions": [
                [(1.0, {"actions": [[(1.0, leaf(good))], [(1.0, leaf(good))]]})],
                [(1.0, {"actions": [[(1.0, leaf(bad))], [(1.0, leaf(bad))]]})],
            ]
        }

    tree = {"actions": [[(1.0, sub(1.0, 0.0))], [(1.0, sub(1.0, 0.0))]]}
    return gym.make("branchgym/TreeMDP-v0", structure=TreeStructure.from_nested(tree))


def test_oracle_picks_the_step_with_the_largest_exact_advantage_spread():
    env = _oracle_env()
    pol = TabularPolicy.uniform(env)
    tr = grow_tree(
        env, pol, "oracle", m=1, k=2, seed=0, rng=0, schedule_options={"env": env, "policy": pol}
    )
    assert [f["step"] for f in tr.meta["forks"]] == [1]
    assert tr.meta["forks"][0]["score"] == pytest.approx(0.25)  # Var of Q in {1, 0}
    with pytest.raises(ScheduleError, match="exact values"):
        grow_tree(env, pol, "oracle", m=1, k=2, seed=0)


def test_registry_and_unknown_names():
    assert set(SCHEDULES) >= {"entropy", "lowest_entropy", "random", "even", "oracle", "fork_score"}
    with pytest.raises(ScheduleError, match="Did you mean 'entropy'"):
        get_schedule("entropi")
    register_schedule("first", lambda tree, bb, m, rng: [ForkPoint(0)])
    try:
        assert get_schedule("first")(None, [], 1, None) == [ForkPoint(0)]
    finally:
        SCHEDULES.pop("first")


# ------------------------------------------------------------------ BranchOPD math


def test_topk_entropy():
    assert topk_entropy(np.log(np.full(20, 1 / 20))) == pytest.approx(math.log(20))
    # renormalised: top-2 of (0.5, 0.25, 0.25) -> (2/3, 1/3)
    lp = np.log([0.5, 0.25])
    h = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))
    assert topk_entropy(lp) == pytest.approx(h)
    assert topk_entropy(lp, renormalize=False) == pytest.approx(-(0.5 * lp[0] + 0.25 * lp[1]))


def test_rank_normalize():
    np.testing.assert_allclose(rank_normalize([3.0, 1.0, 2.0]), [1.0, 0.0, 0.5])
    np.testing.assert_allclose(rank_normalize([1.0, 1.0, 5.0]), [0.25, 0.25, 1.0])
    np.testing.assert_allclose(rank_normalize([7.0]), [0.5])


def test_window_disagreement():
    dlogp = -np.array([1.0, 2.0, 3.0, 4.0])  # -dlogp = 1, 2, 3, 4
    np.testing.assert_allclose(window_disagreement(dlogp, window=2), [1.5, 2.5, 3.5, 4.0])
    np.testing.assert_allclose(window_disagreement(dlogp, window=2, reduce="sum"), [3, 5, 7, 4])
    np.testing.assert_allclose(
        window_disagreement(dlogp, window=2, mode="backward"), [1.0, 1.5, 2.5, 3.5]
    )
    np.testing.assert_allclose(
        window_disagreement(dlogp, window=3, mode="centered"), [1.5, 2.0, 3.0, 3.5]
    )
    with pytest.raises(ScheduleError):
        window_disagreement(dlogp, mode="sideways")


def test_fork_scores_mix_ranks_with_alpha():
    u = np.array([0.1, 0.5, 0.9])
    d = np.array([0.0, -1.0, 0.0])  # teacher dislikes token 1 -> large D around it
    np.testing.assert_allclose(fork_scores(u, d, alpha=1.0, window=1), [0.0, 0.5, 1.0])
    np.testing.assert_allclose(fork_scores(u, d, alpha=0.0, window=1), [0.25, 1.0, 0.25])
    np.testing.assert_allclose(fork_scores(u, d, window=1), [0.125, 0.75, 0.625])


def test_select_token_forks_respects_eligibility_and_budget():
    v = np.array([0.9, 0.8, 0.7, 0.6, 0.5])
    ent = np.array([0.4, 0.6, 0.7, 0.1, 0.9])
    assert select_token_forks(v, ent, b=3) == [1, 2, 4]  # position 0 has entropy < 0.5
    assert select_token_forks(v, ent, b=1) == [1]


def test_select_turn_forks():
    # 5 turns of 5 positions; turn scores from position scores
    turn_of = np.repeat(np.arange(5), 5)
    v = np.zeros(25)
    v[turn_of == 1] = 0.9
    v[turn_of == 2] = 0.8  # adjacent to turn 1: skipped with min distance 2
    v[turn_of == 3] = 0.7
    v[turn_of == 4] = 0.1
    v[turn_of == 0] = 0.2
    v[[5, 6, 7]] = [0.95, 0.94, 0.93]  # turn 1's three best positions
    ent = np.ones(25)
    picks = select_turn_forks(v, ent, turn_of, RNG(0))
    assert [t for t, _ in picks] == [1, 3]  # turns 2 and 4 and 0 are too close to a chosen one
    # max 3 turns at least 2 apart among 5: 1 and 3 only (0/2/4 blocked by them)
    seen = collections.Counter(select_turn_forks(v, ent, turn_of, RNG(s))[0][1] for s in range(300))
    assert set(seen) == {5, 6, 7}  # uniformly among the turn's 3 best positions
    assert min(seen.values()) > 60
    # a turn without an eligible position is never chosen
    ent2 = ent.copy()
    ent2[turn_of == 1] = 0.2
    assert [t for t, _ in select_turn_forks(v, ent2, turn_of, RNG(0))] == [0, 2, 4]
    picks = select_turn_forks(v, ent, turn_of, RNG(0), min_turn_distance=1)
    assert [t for t, _ in picks] == [1, 2, 3]


def test_fork_score_schedule_needs_a_teacher_and_returns_token_offsets():
    t, bb = backbone([[0.9, 0.9, 0.9, 0.9]] * 3)
    with pytest.raises(ScheduleError, match="teacher"):
        fork_score_schedule(t, bb, 3, RNG(0))
    for i, nid in enumerate(bb):
        # the teacher strongly dislikes the third token of turn 1
        tl = np.full(4, -1.0)
        if i == 1:
            tl[2] = -9.0
        t[nid].teacher_logprobs = tl
    pts = fork_score_schedule(t, bb, 1, RNG(0), mode="tokens", window=1)
    assert pts == [ForkPoint(1, 2, pts[0].score)]
    # turns: turn 1 scores highest; turns 0 and 2 are adjacent to it, so only turn 1
    offsets = collections.Counter()
    for s in range(60):
        pts = fork_score_schedule(t, bb, 3, RNG(s), window=1)
        assert [p.step for p in pts] == [1]
        offsets[pts[0].token_offset] += 1
    assert offsets[2] > 0 and len(offsets) == 3  # one of the turn's 3 best positions
