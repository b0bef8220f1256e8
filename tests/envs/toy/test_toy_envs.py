"""TreeMDP and TextTreeMDP: exact values, API conformance, text feedback."""

import gymnasium as gym
import numpy as np
import pytest

from branchgym.envs.toy import TextTreeMDP, TreeMDP, TreeStructure
from branchgym.error import InvalidActionError, ResetNeededError


def mc_return(env, policy, n, seed):
    rng = np.random.default_rng(seed)
    rets = []
    for i in range(n):
        s, _ = env.reset(seed=seed + i)
        g, done = 0.0, False
        while not done:
            a = int(rng.choice(env.action_space.n, p=policy[s]))
            s, r, done, _, _ = env.step(a)
            g += r
        rets.append(g)
    return np.array(rets)


def test_exact_value_matches_monte_carlo():
    env = TreeMDP(depth=3, n_actions=2, n_outcomes=2, transition_noise=0.5, reward_noise=0.3)
    rng = np.random.default_rng(0)
    policy = rng.dirichlet(np.ones(2), size=env.tree.n_nodes)
    rets = mc_return(env, policy, 6000, 0)
    v, var = env.value(0, policy), env.return_variance(0, policy)
    se = np.sqrt(var / len(rets))
    assert abs(rets.mean() - v) < 4 * se
    assert abs(rets.var() - var) < 0.1 * var
    q = [env.q_value(0, a, policy) for a in range(2)]
    assert np.isclose(policy[0] @ q, v)


def test_bernoulli_rewards_are_successes():
    env = TreeMDP(depth=2, reward_kind="bernoulli")
    rets = mc_return(env, np.full((env.tree.n_nodes, 3), 1 / 3), 300, 1)
    assert set(np.unique(rets)) <= {0.0, 1.0}


def test_worked_example_of_theorem_2():
    leaf = lambda m: {"reward": m, "std": 0.05**0.5}  # noqa: E731
    tree = TreeStructure.from_nested(
        {
            "actions": [
                [(0.5, {"actions": [[(1.0, leaf(0.8))]]}), (0.5, {"actions": [[(1.0, leaf(0.2))]]})]
            ]
        }
    )
    env = TreeMDP(structure=tree)
    v, v2, _, _ = tree.moments()
    assert np.isclose(v[1], 0.8) and np.isclose(v[2], 0.2)
    sigma2 = 0.5 * (env.return_variance(1) + env.return_variance(2))
    nu2 = np.var([v[1], v[2]])
    k = 4
    assert np.isclose(k / (k - 1) * (sigma2 + nu2), 0.18667, atol=1e-4)
    assert np.isclose(k / (k - 1) * sigma2, 0.06667, atol=1e-4)
    assert np.isclose(env.return_variance(0), sigma2 + nu2)


def test_optimal_policy_beats_every_other_deterministic_choice():
    env = TreeMDP(depth=3, n_actions=3, transition_noise=0.3)
    pi = env.optimal_policy()
    v_star = env.value(0, pi)
    _, _, q, _ = env.tree.moments(pi)
    for s in range(env.tree.n_nodes):
        if not env.tree.is_terminal(s):
            assert np.isclose(q[s].max(), q[s] @ pi[s])
    assert v_star >= env.value(0) - 1e-12


def test_from_nested_validates_probabilities():
    with pytest.raises(ValueError, match="sum to"):
        TreeStructure.from_nested({"actions": [[(0.4, {"reward": 1.0})]]})


def test_gymnasium_and_sb3_checkers_pass():
    from gymnasium.utils.env_checker import check_env

    check_env(TreeMDP(), skip_render_check=True)
    check_env(TextTreeMDP(), skip_render_check=True)
    sb3 = pytest.importorskip("stable_baselines3.common.env_checker")
    sb3.check_env(TreeMDP(), warn=True)


def test_discrete_bad_actions_are_typed_errors():
    env = TreeMDP()
    env.reset(seed=0)
    for bad in (5, -1, "0", 1.5, True):
        with pytest.raises(InvalidActionError, match=r"integers in \[0, 3\)"):
            env.step(bad)


def test_episode_end_needs_reset():
    env = TreeMDP(depth=1)
    env.reset(seed=0)
    _, _, done, _, _ = env.step(0)
    assert done
    with pytest.raises(ResetNeededError, match="reset"):
        env.step(0)


def test_text_env_invalid_action_feedback_changes_nothing(text_env):
    obs, info = text_env.reset(seed=0)
    assert info["admissible_actions"] == ["go north", "go east", "go south"]
    before = text_env.state_digest()
    for bad in ("fly", "", "go  west", 3, None):
        obs, r, term, trunc, info = text_env.step(bad)
        assert obs.startswith("Invalid action") and "Valid" not in obs[:7]
        assert "Exits: go north, go east, go south." in obs
        assert (r, term, trunc, info["invalid_action"]) == (0.0, False, False, True)
        assert info["node"] == 0
    # the dynamics state is unchanged (only the displayed message differs)
    obs, *_ = text_env.step("  Go   North ")
    assert obs.startswith("You go north")
    assert before != text_env.state_digest()


def test_text_env_matches_discrete_dynamics():
    d, t = TreeMDP(transition_noise=0.5), TextTreeMDP(transition_noise=0.5)
    d.reset(seed=4)
    t.reset(seed=4)
    names = t.action_names()
    for a in [0, 2, 1, 1]:
        sd, rd, dd, _, _ = d.step(a)
        _, rt, dt, _, it = t.step(names[a])
        assert (sd, rd, dd) == (it["node"], rt, dt)


def test_registered_ids_make():
    for env_id in ("branchgym/TreeMDP-v0", "branchgym/TextTreeMDP-v0"):
        env = gym.make(env_id)
        env.reset(seed=0)
        env.close()


def test_invalid_text_echo_stays_in_the_observation_space(text_env):
    text_env.reset(seed=0)
    obs, *_ = text_env.step("gö nörth ✓")  # LLM output outside the charset
    assert "Invalid action" in obs and text_env.observation_space.contains(obs)
