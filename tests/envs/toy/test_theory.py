"""The theory of docs/algorithms.md, checked exactly on TreeMDP.

Exact values come from branchgym.envs.toy.theory (backward induction, no sampling).
Measured values come from Monte Carlo rollouts whose siblings are made with the env's
own snapshot()/restore(), and the advantages from branchgym.agents.estimators.losses.

Statistics: every check of a measured value against an exact one allows Z = 4 standard
errors (a two-sided miss probability of about 6e-5 for a normal statistic), with the
standard error estimated from the same sample: iid per-group statistics where groups
are the independent unit, and a cluster-robust ratio estimate where the units are the
siblings inside groups. Seeds are fixed, so the tests are deterministic; the tolerance
says how unlikely a failure is for a correct implementation under another seed.
"""

import math

import numpy as np
import pytest
import torch

from branchgym.agents.estimators import advantages as A
from branchgym.agents.estimators import losses as L
from branchgym.envs.toy import TreeMDP, TreeStructure
from branchgym.envs.toy import theory as th

Z = 4.0


def mean_se(x):
    x = np.asarray(x, dtype=np.float64)
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size))


def ratio_mean_se(sums, counts):
    """Mean over siblings pooled across groups, with a cluster-robust (per-group) SE."""
    sums, counts = np.asarray(sums, float), np.asarray(counts, float)
    est = sums.sum() / counts.sum()
    resid = sums - est * counts
    n = sums.size
    return float(est), float(math.sqrt(n / (n - 1) * (resid**2).sum()) / counts.sum())


def random_policy(env, seed, concentration=2.0):
    rng = np.random.default_rng(seed)
    return rng.dirichlet(np.full(env.tree.n_actions, concentration), size=env.tree.n_nodes)


def loo_variance(returns):
    """Var(A) of the leave-one-out advantage (its mean is 0): per-group mean of A^2."""
    adv = A.rloo_advantages(torch.as_tensor(returns)).advantages.numpy()
    return mean_se((adv**2).mean(axis=1))


# Tree for Theorem 2 / Corollary 1: every depth carries a good share of the variance
# (sigma^2 / nu^2 at t = 0, 1, 2: 0.125/0, 0.100/0.026, 0.064/0.062).
def theorem_env():
    env = TreeMDP(
        depth=3, n_actions=2, n_outcomes=2, transition_noise=0.4, reward_noise=0.2, structure_seed=2
    )
    return env, random_policy(env, 2)


# ------------------------------------------------------------- exact helpers


def test_law_of_total_variance_holds_exactly_at_every_depth():
    for seed in range(4):
        env = TreeMDP(depth=4, n_actions=3, n_outcomes=2, transition_noise=0.3, structure_seed=seed)
        policy = random_policy(env, seed)
        total = env.return_variance(0, policy)
        parts = th.decomposition_by_depth(env, policy)
        assert [d.depth for d in parts] == [0, 1, 2, 3]
        assert parts[0].nu2 == pytest.approx(0.0, abs=1e-15)
        for d in parts:
            assert d.total == pytest.approx(total)
            assert d.sigma2 + d.nu2 == pytest.approx(total, rel=1e-12)
            assert np.isclose(th.frontier_distribution(env, policy, d.depth).sum(), 1.0)
        # Corollary 1, exactly: nu^2 never falls and sigma^2 never rises with depth
        nu2 = [d.nu2 for d in parts]
        assert all(b >= a - 1e-15 for a, b in zip(nu2, nu2[1:], strict=False))
        assert nu2[-1] > nu2[1] > 0


def test_decomposition_on_an_unbalanced_tree_freezes_finished_episodes():
    leaf = lambda m, sd=0.1: {"reward": m, "std": sd}  # noqa: E731
    tree = TreeStructure.from_nested(
        {
            "actions": [
                [(1.0, leaf(0.9, 0.3))],  # ends at depth 1
                [(0.5, {"actions": [[(1.0, leaf(0.1))], [(1.0, leaf(0.5))]]}), (0.5, leaf(0.4))],
            ]
        }
    )
    policy = np.full((tree.n_nodes, 2), 0.5)
    d1 = th.variance_decomposition(tree, policy, 1)
    v, v2, _, _ = tree.moments(policy)
    assert d1.sigma2 + d1.nu2 == pytest.approx(v2[0] - v[0] ** 2)
    p = th.frontier_distribution(tree, policy, 1)
    assert p.sum() == pytest.approx(1.0) and p[0] == 0
    with pytest.raises(ValueError, match="decision depth"):
        th.variance_decomposition(tree, policy, 2)
    # there is nothing to branch at where an episode may already have ended
    with pytest.raises(ValueError, match="every episode reaches"):
        th.advantage_variances(tree, policy, 1, 4)
    env = TreeMDP(structure=tree)
    with pytest.raises(ValueError, match="every episode reaches"):
        th.branched_groups(env, policy, 1, 4, 50, np.random.default_rng(0))


def test_worked_example_exact_figures():
    tree = worked_example_tree()
    av = th.advantage_variances(tree, None, 1, 4)
    assert round(av.grpo, 3) == 0.187 and round(av.bpo, 3) == 0.067
    assert av.difference == pytest.approx(4 / 3 * 0.09)  # nu^2 = Var(0.8, 0.2) = 0.09
    assert round(av.reduction, 2) == 0.64  # "64 % lower"
    with pytest.raises(ValueError, match="k must be"):
        th.advantage_variances(tree, None, 1, 1)


# ----------------------------------------------------- unbiasedness of eq. 4


def test_sibling_advantage_is_unbiased_at_a_branch_point():
    env = TreeMDP(
        depth=3, n_actions=3, n_outcomes=2, transition_noise=0.3, reward_noise=0.2, structure_seed=1
    )
    policy = random_policy(env, 1)
    k, n = 4, 3000
    rng = np.random.default_rng(7)
    env.reset(seed=0)
    env.step(0)
    state = int(env.node)
    returns = np.empty((n, k))
    actions = np.empty((n, k), dtype=int)
    with env.snapshot() as snap:
        for i in range(n):
            returns[i], actions[i] = th.branch_siblings(env, snap, policy, k, rng)
    loo = A.sibling_advantages(torch.as_tensor(returns)).numpy()
    centred = returns - returns.mean(axis=1, keepdims=True)  # baseline includes itself

    # E[A_local(t, k) | s_t] = 0, for a fixed sibling slot (the backbone's, k = 1)
    m, se = mean_se(loo[:, 0])
    assert abs(m) < Z * se, (m, se)

    # E[A_local | s_t, a] = Q(s_t, a) - V(s_t): unbiased per action
    worst = max(range(3), key=lambda a: abs(th.sibling_advantage_mean(env, policy, state, a, k)))
    for a in range(3):
        exact = th.sibling_advantage_mean(env, policy, state, a, k, baseline="loo")
        assert exact == pytest.approx(env.q_value(state, a, policy) - env.value(state, policy))
        hit = actions == a
        m, se = ratio_mean_se((loo * hit).sum(1), hit.sum(1))
        assert abs(m - exact) < Z * se, (a, m, exact, se)
        # the self-including baseline matches the leave-one-out scaling (K-1)/K instead
        scaled = th.sibling_advantage_mean(env, policy, state, a, k, baseline="mean")
        m2, se2 = ratio_mean_se((centred * hit).sum(1), hit.sum(1))
        assert abs(m2 - scaled) < Z * se2, (a, m2, scaled, se2)
        if a == worst:  # and the test can tell the two apart
            assert abs(m2 - exact) > Z * se2


# ----------------------------------------------------------- Theorem 2


def test_theorem_2_measured_variance_gap_matches_exact():
    env, policy = theorem_env()
    k, depth, n = 4, 2, 1500
    rng = np.random.default_rng(11)
    exact = th.advantage_variances(env, policy, depth, k)
    dec = th.variance_decomposition(env, policy, depth)
    assert exact.difference == pytest.approx(k / (k - 1) * dec.nu2)
    var_grpo, se_grpo = loo_variance(th.independent_groups(env, policy, k, n, rng))
    var_bpo, se_bpo = loo_variance(th.branched_groups(env, policy, depth, k, n, rng))
    assert abs(var_grpo - exact.grpo) < Z * se_grpo, (var_grpo, exact.grpo, se_grpo)
    assert abs(var_bpo - exact.bpo) < Z * se_bpo, (var_bpo, exact.bpo, se_bpo)
    gap, se_gap = var_grpo - var_bpo, math.hypot(se_grpo, se_bpo)
    assert abs(gap - exact.difference) < Z * se_gap, (gap, exact.difference, se_gap)
    assert gap > Z * se_gap  # branching measurably reduces the variance


def worked_example_tree():
    """Two equally likely prefixes with V = 0.8 and 0.2, residual variance 0.05 each."""
    leaf = lambda m: {"reward": m, "std": 0.05**0.5}  # noqa: E731
    prefix = lambda m: {"actions": [[(1.0, leaf(m))]]}  # noqa: E731
    return TreeStructure.from_nested({"actions": [[(0.5, prefix(0.8)), (0.5, prefix(0.2))]]})


def test_theorem_2_worked_example_is_reproduced_by_sampling():
    env = TreeMDP(structure=worked_example_tree())
    policy = np.ones((env.tree.n_nodes, 1))
    k, n = 4, 3000
    rng = np.random.default_rng(3)
    var_grpo, se_grpo = loo_variance(th.independent_groups(env, policy, k, n, rng))
    var_bpo, se_bpo = loo_variance(th.branched_groups(env, policy, 1, k, n, rng))
    assert abs(var_grpo - 0.18667) < Z * se_grpo, (var_grpo, se_grpo)
    assert abs(var_bpo - 0.06667) < Z * se_bpo, (var_bpo, se_bpo)
    # the 64 % reduction, with its delta-method standard error
    ratio = var_bpo / var_grpo
    se_ratio = ratio * math.hypot(se_bpo / var_bpo, se_grpo / var_grpo)
    assert abs(ratio - 0.06667 / 0.18667) < Z * se_ratio


# ----------------------------------------------------------- Corollary 1


def test_corollary_1_deeper_branch_points_reduce_variance_more():
    env, policy = theorem_env()
    k, n = 4, 1200
    rng = np.random.default_rng(5)
    measured = [loo_variance(th.branched_groups(env, policy, t, k, n, rng)) for t in (1, 2)]
    exact = [th.advantage_variances(env, policy, t, k).bpo for t in (1, 2)]
    for (m, se), e in zip(measured, exact, strict=True):
        assert abs(m - e) < Z * se, (m, e, se)
    (v1, se1), (v2, se2) = measured
    drop, se_drop = v1 - v2, math.hypot(se1, se2)
    assert drop > Z * se_drop  # deeper is measurably better
    assert abs(drop - (exact[0] - exact[1])) < Z * se_drop


# --------------------------------------------------- Bellman PO's identity


def kl_bin(q, p):
    return q * torch.log(q / p) + (1 - q) * torch.log((1 - q) / (1 - p))


@pytest.mark.parametrize("q", [0.02, 0.3, 0.7, 0.98])
def test_bellman_gradient_identity_with_autograd(q):
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(7, dtype=torch.float64, generator=g, requires_grad=True)
    y = 3
    p = torch.softmax(theta, -1)[y]
    q = torch.tensor(q, dtype=torch.float64)
    (lhs,) = torch.autograd.grad(torch.log(p) + kl_bin(q, p), theta, retain_graph=True)
    (glogp,) = torch.autograd.grad(torch.log(p), theta)
    ratio = (1 - q) / (1 - p.detach())
    assert torch.allclose(lhs, ratio * glogp, rtol=1e-10, atol=1e-12)
    # eps = 0 turns bellman_po_weights into exactly this ratio
    assert torch.isclose(A.bellman_po_weights(q, p.detach(), eps=0.0), ratio)


def test_bellman_po_loss_realises_the_binary_kl_gradient():
    """With eps = 0, no cap and no mask, the loss's gradient is that of
    -A * [log pi + KL_bin(mu || pi)], token-mean then sequence-mean: the derivation."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 5, 6, dtype=torch.float64, generator=g, requires_grad=True)
    tokens = torch.randint(0, 6, (2, 3, 5), generator=g)
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    mu_logits = logits.detach() + 0.3 * torch.randn(2, 3, 5, 6, dtype=torch.float64, generator=g)
    old = torch.log_softmax(mu_logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    rewards = torch.tensor([[1.0, 0.0, 0.5], [0.2, 0.9, 0.9]], dtype=torch.float64)
    out = L.bellman_po_loss(
        logp, old, rewards, eps=0.0, cap=math.inf, eps_high=math.inf, eps_low=math.inf
    )
    (got,) = torch.autograd.grad(out.loss, logits, retain_graph=True)
    adv = A.grpo_advantages(rewards).advantages[..., None]
    p, q = logp.exp(), old.exp()
    reference = (-adv * (logp + kl_bin(q, p))).mean(-1).mean()
    (want,) = torch.autograd.grad(reference, logits)
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)


def test_bellman_po_on_policy_is_the_plain_policy_gradient():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 4, 3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    tokens = torch.randint(0, 5, (1, 4, 3), generator=g)
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    out = L.bellman_po_loss(logp, logp.detach(), rewards)  # pi = mu: omega = 1, M = 1
    assert out.omega_mean == pytest.approx(1.0) and out.mask_fraction == 0
    adv = A.grpo_advantages(rewards).advantages[..., None]
    (got,) = torch.autograd.grad(out.loss, logits, retain_graph=True)
    (want,) = torch.autograd.grad((-adv * logp).mean(-1).mean(), logits)
    assert torch.allclose(got, want)


@pytest.mark.parametrize(
    ("adv", "omega", "kept"),
    [
        (1.0, 1.5, False),  # A > 0, omega > 1 + eps_high: already pushed up enough
        (1.0, 1.28, True),  # on the threshold: the spec's inequality is strict
        (1.0, 1.1, True),
        (1.0, 0.5, True),  # A > 0 with a small omega keeps its gradient
        (-1.0, 0.7, False),  # A < 0, omega < 1 - eps_low: already pushed down enough
        (-1.0, 0.8, True),  # on the threshold
        (-1.0, 0.95, True),
        (-1.0, 2.0, True),  # A < 0 with a large omega keeps its gradient
        (0.0, 2.0, True),
        (0.0, 0.1, True),
    ],
)
def test_bellman_mask_cases(adv, omega, kept):
    m = L.bellman_po_mask(torch.tensor(adv), torch.tensor(omega), eps_high=0.28, eps_low=0.2)
    assert bool(m) is kept


def test_bellman_mask_and_cap_act_on_the_gradient():
    # one group of two responses, one token each; omega set through pi and mu
    pi = torch.tensor([[[0.9], [0.9]]], dtype=torch.float64)
    mu = torch.tensor([[[0.8], [0.1]]], dtype=torch.float64)
    logp = pi.log().requires_grad_(True)
    rewards = torch.tensor([[1.0, 0.0]], dtype=torch.float64)  # A = +-0.7071
    omega = A.bellman_po_weights(mu, pi, 0.1)  # 1.5 and 5.0
    assert torch.allclose(omega.flatten(), torch.tensor([1.5, 5.0], dtype=torch.float64))
    out = L.bellman_po_loss(logp, mu.log(), rewards, eps_high=0.28)
    (g,) = torch.autograd.grad(out.loss, logp)
    a = 1 / math.sqrt(0.5) / (1 + 1e-6 * math.sqrt(2))  # (1 - 0.5) / (std + 1e-6)
    # response 0: A > 0 and omega 1.5 > 1.28 -> masked; response 1: A < 0, omega capped at 3
    assert g[0, 0, 0] == 0
    assert g[0, 1, 0] == pytest.approx(0.5 * 0.5 * a * 3.0, rel=1e-5)
    assert out.mask_fraction == 0.5 and out.cap_fraction == 0.5
    # a wider eps_high lets response 0 through with weight 1.5
    (g2,) = torch.autograd.grad(L.bellman_po_loss(logp, mu.log(), rewards, eps_high=1.0).loss, logp)
    assert g2[0, 0, 0] == pytest.approx(-0.5 * 0.5 * a * 1.5, rel=1e-5)


# --------------------------------------------------- BranchOPD, Proposition 1


def test_proposition_1_coverage_formula():
    probs = np.array([0.6, 0.3, 0.1])
    tree = TreeStructure.random(depth=2, n_actions=3, n_outcomes=1, reward_noise=0.3, seed=4)
    env = TreeMDP(structure=tree)
    policy = np.tile(probs, (tree.n_nodes, 1))
    rng = np.random.default_rng(13)
    n, kmax = 3000, 3
    main = np.empty(n, dtype=int)
    branches = np.empty((n, kmax), dtype=int)
    env.reset(seed=0)
    with env.snapshot() as fork:  # s_b = the root
        for i in range(n):
            main[i] = th.sample_action(policy, 0, rng)
            branches[i] = th.branch_siblings(env, fork, policy, kmax, rng)[1]
    for k in (1, 2, 3):
        covered = (branches[:, :k] != main[:, None]).any(axis=1)
        for a0 in range(3):  # conditional on the main token: 1 - pi_old(a0 | s_b)^k
            sel = main == a0
            exact = float(th.coverage_probability(probs[a0], k))
            se = math.sqrt(exact * (1 - exact) / sel.sum())
            assert abs(covered[sel].mean() - exact) < Z * max(se, 1e-3), (k, a0)
        exact = th.expected_coverage(probs, k)  # averaged over a0 ~ pi_old
        se = math.sqrt(exact * (1 - exact) / n)
        assert abs(covered.mean() - exact) < Z * se
    # diminishing returns in k: the gain from k = 2 to 3 is below that from 1 to 2
    c = [th.expected_coverage(probs, k) for k in (1, 2, 3)]
    assert c[2] - c[1] < c[1] - c[0]
    with pytest.raises(ValueError):
        th.coverage_probability(1.5, 2)


def test_proposition_1_resampled_mean_is_unbiased_with_variance_over_k():
    env = TreeMDP(
        depth=3, n_actions=3, n_outcomes=2, transition_noise=0.3, reward_noise=0.2, structure_seed=6
    )
    policy = random_policy(env, 6)
    rng = np.random.default_rng(17)
    env.reset(seed=1)
    env.step(1)
    s_b = int(env.node)
    v, var = env.value(s_b, policy), env.return_variance(s_b, policy)
    n = 1200
    with env.snapshot() as fork:
        draws = np.array([th.branch_siblings(env, fork, policy, 4, rng)[0] for _ in range(n)])
    for k in (1, 2, 4):
        j_rs = draws[:, :k].mean(axis=1)  # the resampled mean of k branches
        m, se = mean_se(j_rs)
        assert abs(m - v) < Z * se  # unbiased for E[G | s_b]
        sq, se_sq = mean_se((j_rs - v) ** 2)  # its variance (the mean is known exactly)
        assert abs(sq - var / k) < Z * se_sq, (k, sq, var / k, se_sq)


def test_restore_without_reseeding_replays_the_same_randomness():
    """Why branch_siblings reseeds: the snapshot carries the env's RNG, so plain restores
    give every sibling that takes the same action the same outcome (common random numbers),
    which would break the independence Theorem 2 and Proposition 1 assume."""
    env = TreeMDP(depth=2, n_actions=1, n_outcomes=2, transition_noise=1.0, reward_noise=0.5)
    env.reset(seed=0)
    policy = np.ones((env.tree.n_nodes, 1))
    rng = np.random.default_rng(0)
    with env.snapshot() as snap:
        plain = []
        for _ in range(5):
            env.restore(snap)
            plain.append(th.rollout(env, policy, rng)[0])
        fresh = th.branch_siblings(env, snap, policy, 5, rng)[0]
    assert len(set(plain)) == 1 and len(set(fresh.tolist())) == 5


def test_bench_theory_writes_its_report(tmp_path, capsys):
    from branchgym.cli import main

    assert main(["bench", "theory", "--quick", "--groups", "60", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| Var(A) branched at t = 1 (BPO) | 0.067 | 0.0667 |" in out
    assert "measured, shared RNG" in out
    md = (tmp_path / "theory.md").read_text()
    assert "theory_depths.png" in md and (tmp_path / "theory_depths.png").stat().st_size > 0
