"""The advantage estimators: the tensor functions by hand, and the registry pinned to the study.

The study (``branchgym.envs.toy.estimators``) samples trajectories straight from the TreeMDP's
arrays, vectorised over many draws, and computes each estimator's credit in numpy. Here
the registry's entries run on real ``RolloutTree``s grown by the engine (``grow_tree`` /
``group_rollouts`` with a tabular policy) on the same TreeMDP and policy, and their
gradients ``sum_pairs A / N * grad log pi`` must have the study's mean.

Why means and not draw by draw: the two paths consume their random numbers differently
(the study draws every rollout of thousands of repeats in one vectorised call; the engine
draws per env step, per sibling, after snapshot restores), so no seed gives both the same
trajectories. So each estimator's first two moments are compared: the mean within noise
and ``tr Cov`` within 15%. A wrong weighting (the spec's ``lambda`` credit in place of
``value_diff`` with ``depth_weight``) moves the mean by many standard errors, which
:func:`test_the_pin_tells_estimators_apart` checks; two unbiased credits (``root``,
``value_diff``) share their mean and differ only in variance, by about 15% on this tree,
so the covariance check is what tells them apart, and only roughly.
"""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from branchgym.agents.estimators import advantages  # noqa: E402
from branchgym.agents.policies.policy import TabularPolicy  # noqa: E402
from branchgym.envs.toy import TreeStructure  # noqa: E402
from branchgym.envs.toy import estimators as est  # noqa: E402
from branchgym.error import LossInputError, TrainingConfigError  # noqa: E402
from branchgym.rollout.executor_base import EnvRecipe  # noqa: E402
from branchgym.rollout.grow import group_rollouts, grow_tree  # noqa: E402

#: A fixed-length TreeMDP (every episode has 3 decisions), small enough for a CPU test.
TREE = {"depth": 3, "n_actions": 2, "transition_noise": 0.4, "reward_kind": "bernoulli"}
STRUCTURE_SEED = 4


def _tree_mdp():
    arr = est.TreeArrays.of(TreeStructure.random(**TREE, seed=STRUCTURE_SEED))
    pi = est.softmax(np.random.default_rng(6).normal(size=(arr.n_nodes, arr.n_actions)))
    recipe = EnvRecipe("branchgym/TreeMDP-v0", {**TREE, "structure_seed": STRUCTURE_SEED})
    return arr, pi, recipe


def _registry_draws(name, options, prompts, seed, *, n=None, g=1):
    """One tabular gradient per prompt from the registry's advantages on grown trees."""
    arr, pi, recipe = _tree_mdp()
    policy = TabularPolicy(pi)
    rng = np.random.default_rng(seed)
    eye = np.eye(arr.n_actions)
    fn = advantages.advantage(name)
    rollouts = n if n is not None else g * (1 + options.m * (options.k - 1))
    schedule = {"schedule_options": {"depths": options.branch_depths}}
    gs = []
    for _ in range(prompts):
        if n is not None:
            trees = [group_rollouts(recipe, policy, n, seed=int(rng.integers(2**31)), rng=rng)]
        else:
            trees = [
                grow_tree(recipe, policy, _depths, m=options.m, k=options.k,
                          seed=int(rng.integers(2**31)), rng=rng, **schedule)
                for _ in range(g)
            ]  # fmt: skip
        out = fn(trees, options)
        grad = np.zeros_like(pi)
        for t, adv in zip(trees, out.nodes, strict=True):
            for node in t.nodes:
                s = 0 if node.parent < 0 else int(t[node.parent].observation)
                grad[s] += adv[node.id] * (eye[int(node.action)] - pi[s]) / rollouts
        gs.append(grad)
    return np.array(gs)


def _depths(tree, backbone, m, rng, *, depths=()):
    """The fixed depths schedule (the study's ``fixed``), as agents/learners/bpo.py's ``depths``."""
    from branchgym.agents.learners.bpo import depths_schedule

    return depths_schedule(tree, backbone, m, rng, depths=depths)


def _compare(gs, design, seed=9):
    """``(z, covariance ratio)`` of the registry's draws against the study's moments.

    ``z``: squared distance of the two means over its expectation when they agree (about
    1). The ratio: the draws' ``tr Cov`` over the study's (about 1 for the same estimator).
    """
    arr, pi, _ = _tree_mdp()
    mean = gs.mean(axis=0)
    cov = float(((gs - mean) ** 2).sum(axis=(1, 2)).mean())
    m = est.measure(arr, design, pi, 50_000, np.random.default_rng(seed))
    study_cov = m.sq - float(np.sum(m.mean**2))
    z = float(np.sum((mean - m.mean) ** 2)) / (cov / len(gs) + study_cov / m.repeats)
    return z, cov / study_cov


@pytest.fixture(autouse=True)
def _float64():  # exact comparisons; restored afterwards
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


# ------------------------------------------------------------------ group advantages


def test_grpo_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv, degenerate = advantages.grpo_advantages(r, eps=0.0)
    # mean 0.5, Bessel std sqrt(1/3): +-0.5 / 0.57735
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 / math.sqrt(1 / 3))
    assert not degenerate
    pop = advantages.grpo_advantages(r, eps=0.0, unbiased=False).advantages
    assert torch.allclose(pop, torch.tensor([1.0, -1.0, -1.0, 1.0]))


def test_degenerate_groups_are_zero_and_counted():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.1, 0.1, 0.1], [0.3, 0.3, 0.3]])
    out = advantages.grpo_advantages(r)
    assert out.degenerate.tolist() == [True, False, True, True]
    assert out.n_degenerate == 3 and out.n_groups == 4
    # exactly zero even where the mean of equal floats is not exactly the value
    assert torch.equal(out.advantages[[0, 2, 3]], torch.zeros(3, 3))
    assert (out.advantages[1] != 0).all()
    rl = advantages.rloo_advantages(r)
    assert rl.n_degenerate == 3 and torch.equal(rl.advantages[[0, 2, 3]], torch.zeros(3, 3))
    assert advantages.degenerate_groups(r).tolist() == [True, False, True, True]


def test_rloo_is_leave_one_out_mean():
    r = torch.tensor([1.0, 2.0, 3.0, 6.0])
    adv = advantages.rloo_advantages(r).advantages
    expect = torch.tensor([r[i] - (r.sum() - r[i]) / 3 for i in range(4)])
    assert torch.allclose(adv, expect)
    assert torch.allclose(adv, 4 / 3 * (r - r.mean()))
    assert torch.allclose(adv.sum(), torch.tensor(0.0))


def test_sibling_advantages_eq4_and_batching():
    g = torch.tensor([[0.2, 0.9, 0.4], [1.0, 0.0, 0.5]])
    a = advantages.sibling_advantages(g)
    for b in range(2):
        for k in range(3):
            others = [g[b, j] for j in range(3) if j != k]
            assert torch.isclose(a[b, k], g[b, k] - sum(others) / 2)
    assert torch.equal(a, advantages.rloo_advantages(g).advantages)


def test_masked_members_leave_the_statistics():
    r = torch.tensor([[1.0, 0.0, 5.0, 1.0], [2.0, 9.0, 9.0, 9.0]])
    m = torch.tensor([[True, True, False, True], [True, False, False, False]])
    adv = advantages.sibling_advantages(r, mask=m)
    assert torch.allclose(adv[0], torch.tensor([0.5, -1.0, 0.0, 0.5]))
    assert torch.equal(adv[1], torch.zeros(4))  # one valid member: degenerate
    g = advantages.grpo_advantages(r, mask=m)
    assert g.degenerate.tolist() == [False, True] and g.advantages[0, 2] == 0
    # a NaN reward is fine where it is masked out, an error where it counts
    bad = torch.tensor([1.0, float("nan"), 0.0])
    advantages.rloo_advantages(bad, mask=torch.tensor([True, False, True]))
    with pytest.raises(LossInputError, match="NaN"):
        advantages.rloo_advantages(bad)


def test_group_input_errors():
    with pytest.raises(LossInputError, match="K >= 2.*rloo_advantages"):
        advantages.sibling_advantages(torch.tensor([[1.0], [2.0]]))
    with pytest.raises(LossInputError, match="at least 2"):
        advantages.rloo_advantages(torch.tensor([1.0]))
    with pytest.raises(LossInputError, match="torch.Tensor"):
        advantages.grpo_advantages([1.0, 0.0])
    with pytest.raises(LossInputError, match="scalar"):
        advantages.grpo_advantages(torch.tensor(1.0))
    with pytest.raises(LossInputError, match="mask shape"):
        advantages.grpo_advantages(torch.zeros(2, 3), mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(LossInputError, match="empty groups"):
        advantages.grpo_advantages(torch.zeros(3, 0))
    adv, _ = advantages.rloo_advantages(torch.tensor([1, 0, 0]))  # integer rewards are fine
    assert adv.is_floating_point()


# ------------------------------------------------------------------------ eq. 5


def test_propagation_by_hand():
    lam = 0.5
    a1, a3 = 1.0, 2.0
    out = advantages.propagate_advantages(6, [1, 3], [a1, a3], lam=lam)
    expect = [lam * a1 + lam**3 * a3, a1 + lam**2 * a3, lam * a3, a3, a3, a3]
    assert torch.allclose(out, torch.tensor(expect))
    zero = advantages.propagate_advantages(6, [1, 3], [a1, a3], lam=lam, tail="zero")
    assert torch.allclose(zero, torch.tensor(expect[:4] + [0.0, 0.0]))


def test_propagation_edge_cases():
    # no branch point on the path: nothing to propagate, under either tail
    for tail in ("last", "zero"):
        assert torch.equal(advantages.propagate_advantages(4, [], [], tail=tail), torch.zeros(4))
    assert advantages.propagate_advantages(0, [], []).shape == (0,)
    # lam = 1 sums, lam = 0 keeps only the branch step itself
    assert torch.allclose(
        advantages.propagate_advantages(3, [0, 2], [1.0, 2.0], lam=1.0),
        torch.tensor([3.0, 2.0, 2.0]),
    )
    assert torch.allclose(
        advantages.propagate_advantages(4, [1, 2], [1.0, 2.0], lam=0.0),
        torch.tensor([0.0, 1.0, 2.0, 2.0]),
    )
    # a branch at the last step; a tensor in keeps its dtype
    out = advantages.propagate_advantages(
        3, torch.tensor([2]), torch.tensor([0.5], dtype=torch.float64)
    )
    assert out.dtype == torch.float64 and torch.allclose(
        out, torch.tensor([0.5 * 0.95**2, 0.5 * 0.95, 0.5], dtype=torch.float64)
    )


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((5, [3, 1], [1.0, 2.0]), {}, "strictly increasing"),
        ((5, [1, 1], [1.0, 2.0]), {}, "strictly increasing"),
        ((5, [5], [1.0]), {}, r"\[0, n_steps=5\)"),
        ((5, [-1], [1.0]), {}, r"\[0, n_steps=5\)"),
        ((5, [1, 2], [1.0]), {}, "one local advantage per branch step"),
        ((5, [1], [1.0]), {"tail": "first"}, "tail must be"),
        ((5, [1], [1.0]), {"lam": 1.5}, "lam must be"),
        ((-1, [], []), {}, "non-negative int"),
    ],
)
def test_propagation_errors(args, kwargs, match):
    with pytest.raises(LossInputError, match=match):
        advantages.propagate_advantages(*args, **kwargs)


# --------------------------------------------------------- token estimators


def test_bellman_weights_source_examples():
    # the source's two illustrations: 0.01 -> 0.02 barely moves omega, 0.8 -> 0.9 gives 1.5
    w = advantages.bellman_po_weights(torch.tensor([0.01, 0.8]), torch.tensor([0.02, 0.9]), eps=0.1)
    assert torch.allclose(w, torch.tensor([1.09 / 1.08, 1.5]))
    p = torch.linspace(0.0, 1.0, 11)
    for eps in (0.05, 0.1, 0.3):
        assert torch.equal(advantages.bellman_po_weights(p, p, eps), torch.ones(11))
    with pytest.raises(LossInputError, match="eps"):
        advantages.bellman_po_weights(p, p, -0.1)


def test_opd_advantages_clip_and_stop_gradient():
    t = torch.tensor([-1.0, -2.0, -0.1, -5.0])
    s = torch.tensor([-1.5, -0.5, -0.2, -0.1], requires_grad=True)
    a = advantages.opd_advantages(t, s, delta=1.0)
    assert torch.allclose(a, torch.tensor([0.5, -1.0, 0.1, -1.0]))
    assert not a.requires_grad
    with pytest.raises(LossInputError, match="delta"):
        advantages.opd_advantages(t, s, delta=0.0)


# ------------------------------------------------------------------------ the registry


def test_every_estimator_is_listed_with_one_signature():
    assert set(advantages.ADVANTAGES) == {"grpo", "rloo", "bpo", "root", "value_diff"}
    assert set(advantages.GROUP_ESTIMATORS) <= set(advantages.ADVANTAGES)
    assert set(advantages.CREDITS.values()) <= set(advantages.ADVANTAGES)
    assert set(advantages.TOKEN_ADVANTAGES) == {"bellman_po", "opd"}
    _, pi, recipe = _tree_mdp()
    group = [group_rollouts(recipe, TabularPolicy(pi), 4, seed=1, rng=1)]
    options = advantages.AdvantageOptions(m=1, k=2, branch_depths=(1,))
    trees = [
        grow_tree(recipe, TabularPolicy(pi), _depths, m=1, k=2, seed=s, rng=s,
                  schedule_options={"depths": (1,)})
        for s in (1, 2)
    ]  # fmt: skip
    for name, fn in advantages.ADVANTAGES.items():
        given = group if name in advantages.GROUP_ESTIMATORS else trees
        out = fn(given, options)
        assert isinstance(out, advantages.NodeAdvantages)
        assert len(out.nodes) == len(given)
        for t, adv in zip(given, out.nodes, strict=True):  # every decision has its credit
            assert set(adv) == {n.id for n in t.nodes}


def test_unknown_and_duplicate_names_are_refused_with_the_known_ones():
    with pytest.raises(TrainingConfigError, match="known: bpo, grpo, rloo, root, value_diff"):
        advantages.advantage("ppo")
    with pytest.raises(TrainingConfigError, match="already registered"):
        advantages.register_advantage("grpo", advantages.ADVANTAGES["rloo"])
    with pytest.raises(TrainingConfigError, match="tail"):
        advantages.AdvantageOptions(tail="first")


def test_options_take_a_learners_fields():
    from branchgym.agents.learners import bpo, grpo

    args = bpo.Args(lam=0.9, tail="zero", schedule="depths", branch_depths=[2], m=1)
    options = advantages.AdvantageOptions.of(args)
    assert (options.lam, options.tail, options.branch_depths, options.m) == (0.9, "zero", (2,), 1)
    # GRPO's eps is the PPO clip range, not the std's: it does not reach the estimator
    assert advantages.AdvantageOptions.of(grpo.Args(eps=0.3)).std_eps == 1e-6


def test_per_prompt_calls_the_estimator_on_each_prompts_trees():
    _, pi, recipe = _tree_mdp()
    trees = [
        grow_tree(recipe, TabularPolicy(pi), _depths, m=1, k=2, seed=s, rng=s,
                  schedule_options={"depths": (1,)})
        for s in range(4)
    ]  # fmt: skip
    options = advantages.AdvantageOptions(m=1, k=2, schedule="depths", branch_depths=(1,))
    per_tree, _, n_bp = advantages.per_prompt("root", trees, [0, 0, 1, 1], options)
    root = advantages.advantage("root")
    want = root(trees[:2], options).nodes + root(trees[2:], options).nodes
    assert per_tree == want
    assert n_bp == sum(len(t.branch_points()) for t in trees)


# --------------------------------------------------------- pinned to the estimator study

DEPTH1 = {"m": 1, "k": 3, "schedule": "depths", "branch_depths": (1,)}
FIXED1 = {"m": 1, "k": 3, "schedule": "fixed", "depths": (1,)}

PINNED = {
    "rloo": ("rloo", {}, {"n": 4}, est.Design(kind="rloo", n=4)),
    "grpo": ("grpo", {}, {"n": 4}, est.Design(kind="grpo", n=4)),
    "bpo": ("bpo", DEPTH1, {}, est.Design(**FIXED1)),
    "bpo_exclude": (
        "bpo", {**DEPTH1, "backbone_credit": "exclude"}, {},
        est.Design(**FIXED1, backbone="exclude"),
    ),
    "root": ("root", DEPTH1, {"g": 2}, est.Design(**FIXED1, g=2, credit="root")),
    "value_diff": ("value_diff", DEPTH1, {"g": 2}, est.Design(**FIXED1, g=2, credit="value_diff")),
    "value_diff_depth_backbone": (
        "value_diff", {**DEPTH1, "depth_weight": True}, {"g": 2},
        est.Design(**FIXED1, g=2, credit="value_diff", norm="backbone"),
    ),
    "root_depth_realised": (
        "root", {**DEPTH1, "depth_weight": True, "depth_count": "realised"}, {"g": 2},
        est.Design(**FIXED1, g=2, credit="root", norm="depth"),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(PINNED))
def test_the_registry_and_the_vectorised_study_estimate_the_same_mean(case):
    name, options, shape, design = PINNED[case]
    gs = _registry_draws(name, advantages.AdvantageOptions(**options), 200, 3, **shape)
    z, cov_ratio = _compare(gs, design)
    assert z < 4.0  # about 1 when both estimate the same mean
    assert abs(cov_ratio - 1.0) < 0.15  # 200 draws: the ratio's noise is a few percent


def test_the_pin_tells_estimators_apart():
    """The spec's credit against the value_diff design: a real difference is caught."""
    name, options, shape, _ = PINNED["bpo"]
    gs = _registry_draws(name, advantages.AdvantageOptions(**options), 200, 3, **shape)
    _, _, _, other = PINNED["value_diff_depth_backbone"]
    assert _compare(gs, other)[0] > 10.0
