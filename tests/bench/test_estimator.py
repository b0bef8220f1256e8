"""The estimator study's math: exact gradient, sampler, unbiasedness claims, the CLI."""

import json

import numpy as np
import pytest

from branchgym.bench.estimator import ESTIMATORS
from branchgym.envs.toy import TreeStructure
from branchgym.envs.toy import estimators as est

STUDY = {"depth": 4, "n_actions": 3, "reward_kind": "bernoulli", "seed": 2}
LONG = {"depth": 7, "n_actions": 3, "transition_noise": 0.6, "reward_kind": "bernoulli", "seed": 2}


@pytest.fixture(scope="module")
def study():
    arr = est.TreeArrays.of(TreeStructure.random(**STUDY))
    pi = est.softmax(np.random.default_rng(5).normal(size=(arr.n_nodes, arr.n_actions)))
    return arr, pi


@pytest.fixture(scope="module")
def long_maze():
    arr = est.TreeArrays.of(TreeStructure.random(**LONG))
    return arr, est.policy_snapshots(arr, fractions=(0.5,))["mid"]


def _random_tree_node_by_node(depth, n_actions, n_outcomes, transition_noise, seed):
    """TreeStructure.random's definition, one node and edge at a time (the reference)."""
    rng = np.random.default_rng(seed)
    b = n_actions * n_outcomes
    n = sum(b**d for d in range(depth + 1))
    quality = rng.normal(size=(n, n_actions))
    node_depth, parent = np.zeros(n, int), np.full(n, -1)
    children, probs = np.full((n, n_actions, n_outcomes), -1), np.zeros((n, n_actions, n_outcomes))
    path_q, nxt = np.zeros(n), 1
    for node in range(n):
        if node_depth[node] == depth:
            continue
        for a in range(n_actions):
            p = np.full(n_outcomes, transition_noise / n_outcomes)
            p[0] += 1.0 - transition_noise
            for o in range(n_outcomes):
                children[node, a, o], probs[node, a, o] = nxt, p[o]
                node_depth[nxt], parent[nxt] = node_depth[node] + 1, node
                path_q[nxt] = path_q[node] + quality[node, a]
                nxt += 1
    mean = np.where(node_depth == depth, 1 / (1 + np.exp(-2 * path_q / np.sqrt(depth))), 0.0)
    std = np.where(node_depth == depth, 0.1, 0.0)  # the default Gaussian reward noise
    return {"depth": node_depth, "parent": parent, "children": children, "probs": probs,
            "reward_mean": mean, "reward_std": std}  # fmt: skip


def test_the_level_by_level_builder_matches_the_node_by_node_definition():
    kw = {"depth": 3, "n_actions": 3, "n_outcomes": 2, "transition_noise": 0.4, "seed": 7}
    a, ref = TreeStructure.random(**kw), _random_tree_node_by_node(**kw)
    for f, want in ref.items():
        assert np.allclose(getattr(a, f), want), f
    ones = TreeStructure.random(**kw, depth_weights=np.ones(3))
    assert np.allclose(ones.reward_mean, a.reward_mean)  # all-ones weights change nothing
    with pytest.raises(ValueError, match="one weight per depth"):
        TreeStructure.random(**kw, depth_weights=[1.0, 2.0])


def test_exact_values_match_backward_induction(study):
    arr, pi = study
    e = est.exact(arr, pi)
    v, v2, q, _ = arr.tree.moments(pi)
    inner = arr.tree.depth < arr.depth
    assert np.allclose(e.v[inner], v[inner]) and np.allclose(e.q[inner], q[inner])
    assert e.var[0] == pytest.approx(v2[0] - v[0] ** 2)
    assert est.exact_j(arr, pi[None])[0] == pytest.approx(e.j)
    # visitation sums to 1 at every depth
    for level in arr.levels:
        assert e.reach[level].sum() == pytest.approx(1.0)


def test_exact_gradient_matches_finite_differences(study):
    arr, _ = study
    theta = np.random.default_rng(1).normal(size=(arr.n_nodes, arr.n_actions))
    g = est.exact_gradient(arr, est.softmax(theta))
    rng = np.random.default_rng(2)
    inner = np.flatnonzero(arr.tree.depth < arr.depth)
    for s in [0, *rng.choice(inner, 6, replace=False)]:
        for a in range(arr.n_actions):
            h = 1e-6
            up, down = theta.copy(), theta.copy()
            up[s, a] += h
            down[s, a] -= h
            j = est.exact_j(arr, np.stack([est.softmax(up), est.softmax(down)]))
            assert g[s, a] == pytest.approx((j[0] - j[1]) / (2 * h), abs=1e-8)


def test_sampled_leaves_follow_the_exact_visitation(study):
    arr, pi = study
    e = est.exact(arr, pi)
    m = est.measure(arr, est.Design("rloo", n=2), pi, 1, np.random.default_rng(0))
    assert m.steps == 2 * arr.depth
    # the sampler's leaf frequencies against d(leaf)
    n = 200_000
    st = np.zeros((n, arr.depth + 1), dtype=np.int64)
    pol = np.zeros(n, dtype=np.int64)
    st, _, ret = est._rollouts(arr, pi[None], pol, st, pol, np.random.default_rng(3))
    leaves = arr.levels[arr.depth]
    freq = np.bincount(st[:, -1], minlength=arr.n_nodes)[leaves] / n
    p = e.reach[leaves]
    z = (freq - p) / np.sqrt(p * (1 - p) / n + 1e-12)
    assert np.abs(z).max() < 5.0
    assert ret.mean() == pytest.approx(e.j, abs=5 * ret.std() / np.sqrt(n))


def test_sampler_agrees_with_the_env_through_snapshot_restore(study):
    """Sibling returns branched with the env's snapshot()/restore() match the direct sampler."""
    from branchgym.envs.toy import TreeMDP
    from branchgym.envs.toy import theory as th

    arr, pi = study
    env = TreeMDP(structure=arr.tree)
    rng = np.random.default_rng(4)
    via_env = th.branched_groups(env, pi, 2, 4, 300, rng).reshape(-1)
    n = 20_000
    st = np.zeros((n, arr.depth + 1), dtype=np.int64)
    pol = np.zeros(n, dtype=np.int64)
    _, _, direct = est._rollouts(arr, pi[None], pol, st, pol, rng)
    se = np.hypot(via_env.std() / np.sqrt(via_env.size / 4), direct.std() / np.sqrt(n))
    assert abs(via_env.mean() - direct.mean()) < 4 * se


def _bias_ratio(arr, design, pi, repeats, seed):
    """|mean - g*|^2 over its expectation tr Cov / R for an unbiased estimator (about 1)."""
    m = est.measure(arr, design, pi, repeats, np.random.default_rng(seed))
    cov = m.sq - float(np.sum(m.mean**2))
    return float(np.sum((m.mean - m.truth) ** 2)) / (cov / repeats)


UNBIASED = ["rloo", "bpo_root", "bpo_vd", "bpo_g2_vd", "bpo_tail_vd"]


@pytest.mark.parametrize("name", UNBIASED)
def test_claimed_unbiased_estimators_match_the_exact_gradient(study, name):
    arr, pi = study
    assert _bias_ratio(arr, ESTIMATORS[name][0], pi, 20_000, 11) < 3.0


@pytest.mark.parametrize(
    "design",
    [
        est.Design(schedule="random", credit="value_diff", norm="depth", g=2, m=2, k=3),
        est.Design(schedule="even", credit="root", norm="depth", g=3, m=2, k=2),
        est.Design(schedule="fixed", depths=(1, 3), credit="value_diff", norm="depth"),
    ],
)
def test_trajectory_independent_schedules_with_depth_norm_are_unbiased(study, design):
    arr, pi = study
    assert _bias_ratio(arr, design, pi, 20_000, 12) < 3.0


def test_spec_bpo_bias_is_detected_on_the_long_noisy_maze(long_maze):
    """The measurement is not vacuous: spec BPO fails the same check by a wide margin."""
    arr, pi = long_maze
    assert _bias_ratio(arr, ESTIMATORS["bpo"][0], pi, 5000, 13) > 10.0
    assert _bias_ratio(arr, ESTIMATORS["bpo_lam0"][0], pi, 5000, 14) > 10.0


@pytest.mark.parametrize("name", ["bpo_vd", "bpo_tail_vd"])
def test_variants_are_unbiased_on_the_long_noisy_maze(long_maze, name):
    arr, pi = long_maze
    assert _bias_ratio(arr, ESTIMATORS[name][0], pi, 5000, 15) < 3.0


def test_estimate_gives_one_gradient_per_policy(study):
    arr, pi = study
    pis = np.stack([pi, pi, pi])
    rep, s, rows, steps = est.estimate(arr, ESTIMATORS["bpo_vd"][0], pis, np.random.default_rng(0))
    assert set(rep) == {0, 1, 2} and steps.shape == (3,)
    assert (
        len(set(zip(rep.tolist(), s.tolist(), strict=True))) == rep.size
    )  # each (policy, state) once
    assert np.allclose(rows.sum(axis=-1), 0.0)  # softmax score rows sum to zero


def test_design_validation():
    with pytest.raises(ValueError, match="g >= 2"):
        est.Design(credit="root")
    with pytest.raises(ValueError, match="m depths"):
        est.Design(schedule="fixed", depths=(1,))
    with pytest.raises(ValueError, match="unknown"):
        est.Design(norm="tokens")
    assert est.Design().rollouts == 7 and ESTIMATORS["bpo_tail_vd"][0].rollouts == 20
    assert est.schedule_depths(est.Design(schedule="even"), 4) == [1, 3]
    assert est.schedule_depths(est.Design(schedule="root_even"), 7) == [0, 4]


def test_cli_quick_writes_report_plots_and_json(tmp_path, capsys):
    from branchgym.cli import main

    assert main(["bench", "estimator", "--quick", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "estimator.md").exists()
    assert (tmp_path / "estimator_nsr.png").exists()
    assert (tmp_path / "estimator_training.png").exists()
    data = json.loads((tmp_path / "estimator.json").read_text())
    assert data["best_variant"] in ESTIMATORS
    assert set(data["measure"]) >= {"study", "early", "late"}
    assert "Best variant" in capsys.readouterr().out


# ------------------------------------------------------------- the bpo learner's options


def _learner_gradient_ratio(prompts, seed, **options):
    """The learner's own advantages (grow_tree + the advantages registry) as a tabular gradient."""
    from branchgym.agents.estimators import advantages
    from branchgym.agents.learners import bpo
    from branchgym.agents.policies.policy import TabularPolicy
    from branchgym.rollout.executor_base import EnvRecipe
    from branchgym.rollout.grow import grow_tree

    kw = {"depth": 3, "n_actions": 3, "reward_kind": "bernoulli", "structure_seed": 2}
    arr = est.TreeArrays.of(
        TreeStructure.random(depth=3, n_actions=3, reward_kind="bernoulli", seed=2)
    )
    pi = est.softmax(np.random.default_rng(5).normal(size=(arr.n_nodes, arr.n_actions)))
    truth = est.exact_gradient(arr, pi)
    args = bpo.Args(**options)
    args.check()
    recipe = EnvRecipe("branchgym/TreeMDP-v0", kw)
    schedule = bpo.LOCAL_SCHEDULES.get(args.schedule, args.schedule)
    rng = np.random.default_rng(seed)
    eye = np.eye(arr.n_actions)
    gs = []
    for _ in range(prompts):
        trees = [
            grow_tree(
                recipe,
                TabularPolicy(pi),
                schedule,
                m=args.m,
                k=args.k,
                seed=int(rng.integers(2**31)),
                rng=rng,
            )
            for _ in range(args.backbones)
        ]
        n = sum(len(t.leaves()) for t in trees)
        g = np.zeros_like(pi)
        estimate = advantages.advantage(advantages.CREDITS[args.credit])
        per_tree = estimate(trees, advantages.AdvantageOptions.of(args)).nodes
        for t, adv in zip(trees, per_tree, strict=True):
            for node in t.nodes:
                s = 0 if node.parent < 0 else int(t[node.parent].observation)
                g[s] += adv[node.id] * (eye[int(node.action)] - pi[s]) / n
        gs.append(g)
    gs = np.array(gs)
    mean = gs.mean(axis=0)
    cov = float(((gs - mean) ** 2).sum(axis=(1, 2)).mean())
    return float(((mean - truth) ** 2).sum()) / (cov / prompts)


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        {"credit": "value_diff", "backbones": 2, "schedule": "last", "m": 1},
        {"credit": "value_diff", "schedule": "root_even", "m": 2},
    ],
)
def test_learner_variant_advantages_give_the_exact_gradient_in_mean(options):
    ratio = _learner_gradient_ratio(250, 21, depth_weight=True, **options)
    assert ratio < 3.0


def test_learner_options_validate():
    from branchgym.agents.learners import bpo
    from branchgym.error import TrainingConfigError as ConfigError

    bpo.Args().check()  # the spec's defaults
    assert (bpo.Args().credit, bpo.Args().backbones, bpo.Args().depth_weight) == (
        "lambda",
        1,
        False,
    )
    for bad, match in [
        ({"credit": "root"}, "backbones >= 2"),
        ({"credit": "value_diff", "schedule": "even"}, "backbones >= 2"),
        ({"credit": "value_diff", "backbones": 2}, "fixed before"),
        ({"backbone_credit": "drop"}, "backbone_credit"),
        ({"backbones": 0}, "backbones"),
    ]:
        with pytest.raises(ConfigError, match=match):
            bpo.Args(**bad).check()
    steps = [f.step for f in bpo.last_schedule(None, list(range(7)), 2, None)]
    assert steps == [5, 6]
    assert [f.step for f in bpo.root_even_schedule(None, list(range(7)), 2, None)] == [0, 4]


@pytest.mark.slow
def test_bpo_learner_trains_with_the_tail_variant(tmp_path):
    pytest.importorskip("transformers")
    from branchgym.agents.train import train

    kw = {"depth": 3, "n_actions": 3, "reward_kind": "bernoulli", "structure_seed": 2}
    options = {"schedule": "last", "m": 1, "backbones": 2, "credit": "value_diff"}
    result = train(
        "bpo",
        out_dir=str(tmp_path),
        env_kwargs=kw,
        model="tiny",
        policy="scoring",
        prompts_per_step=2,
        steps=2,
        threads=1,
        progress=False,
        depth_weight=True,
        **options,
    )
    steps = [h for h in result.history if "charts/rollouts" in h]
    assert [h["charts/rollouts"] for h in steps] == [16, 16]  # 2 prompts x 2 x (1 + 3)
