"""Variable episode lengths: the mazes' exact machinery, and which branching designs stay unbiased.

docs/estimators.md ("Variable episode lengths"): the ``last`` schedule reads where the
backbone ended and ``depth_count="realised"`` divides by a random count, so the
documented tail design is biased once episodes end at different lengths; branching at
depths fixed in advance (where the line is alive) with per-backbone weights is not.
"""

import itertools

import numpy as np
import pytest

from branchgym.envs.toy import TreeMDP, TreeStructure
from branchgym.envs.toy import estimators as est
from branchgym.envs.toy import theory as th

#: The two kinds of variable length: an action that ends the episode, and the env ending
#: it with probability 0.3 whatever the action.
LENGTHS = {"end_action": {"end_actions": 1}, "stop_0.3": {"termination_prob": 0.3}}
MAZE = {"depth": 6, "n_actions": 3, "transition_noise": 0.3, "reward_noise": 0.05, "seed": 2}

#: The documented tail design (last decision, realised per-depth counts) and the
#: recommended one (the horizon's last decision if the line is alive, per-backbone weights).
TAIL_OLD = est.Design(g=5, m=1, k=4, schedule="last", credit="value_diff", norm="depth")
TAIL_NEW = est.Design(
    g=5, m=1, k=4, schedule="fixed", depths=(5,), credit="value_diff", norm="backbone"
)


RLOO = est.Design("rloo", n=7)


def _arr(kind, **over):
    return est.TreeArrays.of(TreeStructure.random(**{**MAZE, **over}, **LENGTHS[kind]))


@pytest.fixture(scope="module", params=sorted(LENGTHS))
def maze(request):
    arr = _arr(request.param)
    return request.param, arr, est.policy_snapshots(arr, fractions=(0.5, 0.9))


def _paths(tree, pi, node=0, p=1.0):
    """Every (leaf, probability) by brute-force enumeration of actions and outcomes."""
    if tree.children[node, 0, 0] < 0:
        yield node, p
        return
    for a, o in itertools.product(range(tree.n_actions), range(tree.children.shape[2])):
        q = p * pi[node, a] * tree.probs[node, a, o]
        if q > 0:
            yield from _paths(tree, pi, int(tree.children[node, a, o]), q)


@pytest.mark.parametrize("kind", sorted(LENGTHS))
def test_variable_length_trees_are_well_formed(kind):
    t = TreeStructure.random(**{**MAZE, "depth": 4}, **LENGTHS[kind])
    leaf = t.children[:, 0, 0] < 0
    assert set(np.unique(t.depth[leaf])) == {1, 2, 3, 4}  # episodes end at every length
    inner = np.flatnonzero(~leaf)
    assert np.allclose(t.probs[inner].sum(axis=-1), 1.0)
    assert np.all(t.parent[t.children[inner]] == inner[:, None, None])
    assert np.all(t.depth[t.children[inner]] == t.depth[inner][:, None, None] + 1)
    assert np.all((t.reward_mean > 0) == leaf)
    kids = t.children[inner]
    if kind == "end_action":  # the last action ends the episode, the others never do
        assert leaf[kids[:, -1, :]].all()
        assert not leaf[kids[t.depth[inner] < 3][:, :-1, :]].any()
    else:  # one outcome of every action is the end, with probability 0.3
        assert leaf[kids[:, :, -1]].all() and np.allclose(t.probs[inner][:, :, -1], 0.3)
    with pytest.raises(ValueError, match="end_actions"):
        TreeStructure.random(depth=3, n_actions=2, end_actions=2)
    with pytest.raises(ValueError, match="termination_prob"):
        TreeStructure.random(depth=3, termination_prob=1.0)


@pytest.mark.parametrize("kind", sorted(LENGTHS))
def test_exact_values_and_gradient_on_variable_lengths(kind):
    arr = _arr(kind, depth=3)
    t = arr.tree
    theta = np.random.default_rng(1).normal(size=(arr.n_nodes, arr.n_actions))
    pi = est.softmax(theta)
    e = est.exact(arr, pi)
    # J and the leaf distribution by enumerating every path
    leaves = dict.fromkeys(np.flatnonzero(arr.leaf), 0.0)
    for node, p in _paths(t, pi):
        leaves[node] += p
    assert e.j == pytest.approx(sum(p * t.reward_mean[s] for s, p in leaves.items()), abs=1e-12)
    assert np.allclose([e.reach[s] for s in leaves], list(leaves.values()))
    v, v2, q, _ = t.moments(pi)  # the env's own backward induction
    assert np.allclose(e.v[~arr.leaf], v[~arr.leaf]) and np.allclose(e.q[~arr.leaf], q[~arr.leaf])
    assert e.var[0] == pytest.approx(v2[0] - v[0] ** 2)
    frontier = th.frontier_distribution(t, pi, 2)  # mass at depth 2 plus ended episodes
    assert np.allclose(frontier[arr.inner[2]], e.reach[arr.inner[2]])
    # g* against central finite differences of the exact J
    g = est.exact_gradient(arr, pi)
    rng = np.random.default_rng(2)
    for s in [0, *rng.choice(np.flatnonzero(~arr.leaf), 5, replace=False)]:
        for a in range(arr.n_actions):
            up, down = theta.copy(), theta.copy()
            up[s, a] += 1e-6
            down[s, a] -= 1e-6
            j = est.exact_j(arr, np.stack([est.softmax(up), est.softmax(down)]))
            assert g[s, a] == pytest.approx((j[0] - j[1]) / 2e-6, abs=1e-8)


@pytest.mark.parametrize("kind", sorted(LENGTHS))
def test_sampler_and_env_end_episodes_where_the_tree_does(kind):
    import branchgym

    arr = _arr(kind, depth=4)
    pi = est.softmax(np.random.default_rng(5).normal(size=(arr.n_nodes, arr.n_actions)))
    n = 100_000
    st = np.zeros((n, arr.depth + 1), dtype=np.int64)
    pol = np.zeros(n, dtype=np.int64)
    st, ac, _ = est._rollouts(arr, pi[None], pol, st, pol, np.random.default_rng(3))
    e = est.exact(arr, pi)
    leaves = np.flatnonzero(arr.leaf)
    freq = np.bincount(st[:, -1], minlength=arr.n_nodes)[leaves] / n
    p = e.reach[leaves]
    big = p * n >= 30  # the normal approximation of a count
    assert np.abs((freq - p) / np.sqrt(p * (1 - p) / n))[big].max() < 5.0
    by_len = np.bincount(arr.tree.depth[leaves], weights=freq) - np.bincount(
        arr.tree.depth[leaves], weights=p
    )
    assert np.abs(by_len).max() < 0.01  # the distribution of episode lengths
    lengths = (ac >= 0).sum(axis=1)
    assert np.array_equal(lengths, arr.tree.depth[st[:, -1]])  # decisions = leaf depth
    # the registered env takes the same options and ends where the tree does
    kw = {**{k: v for k, v in MAZE.items() if k != "seed"}, "depth": 4, "structure_seed": 2}
    env = branchgym.make("branchgym/TreeMDP-v0", **kw, **LENGTHS[kind])
    assert isinstance(env.unwrapped, TreeMDP)
    assert env.unwrapped.tree.fingerprint() == arr.tree.fingerprint()
    ends = []
    for seed in range(40):
        env.reset(seed=seed)
        done, steps = False, 0
        while not done:
            _, _, done, _, info = env.step(steps % arr.n_actions)
            steps += 1
        ends.append(steps)
    assert min(ends) < 4 and max(ends) <= 4


def _bias_se(arr, design, pi, repeats, seed):
    """|mean - g*| over the standard error of the mean (about 1 for an unbiased estimator)."""
    m = est.measure(arr, design, pi, repeats, np.random.default_rng(seed))
    cov = m.sq - float(np.sum(m.mean**2))
    return float(np.linalg.norm(m.mean - m.truth)) / np.sqrt(cov / repeats)


def test_the_documented_tail_design_is_biased_on_variable_lengths(maze):
    """``last`` + realised per-depth counts: its mean misses g* by many standard errors."""
    _, arr, snaps = maze
    assert _bias_se(arr, TAIL_OLD, snaps["uniform"], 20_000, 31) > 8.0


@pytest.mark.parametrize(
    "design",
    [
        TAIL_NEW,
        est.Design(g=3, m=2, k=4, schedule="fixed", depths=(1, 3), credit="value_diff",
                   norm="backbone"),
        est.Design(g=2, m=2, k=3, schedule="fixed", depths=(0, 2), credit="root", norm="backbone"),
        RLOO,
    ],
    ids=["tail_new", "vd_1_3", "root_0_2", "rloo"],
)  # fmt: skip
def test_fixed_depth_branching_with_backbone_weights_is_unbiased(maze, design):
    """|bias|/SE within what noise gives (about 1; the recommended design at every stage)."""
    _, arr, snaps = maze
    stages = ("uniform", "mid", "late") if design in (TAIL_NEW, RLOO) else ("mid",)
    for i, stage in enumerate(stages):
        assert _bias_se(arr, design, snaps[stage], 10_000, 40 + i) < 4.0, stage


def test_each_fix_alone_is_not_enough(maze):
    """Fixed depths with realised counts, or ``last`` with per-backbone weights: biased."""
    _, arr, snaps = maze
    pi = snaps["uniform"]
    realised = dataclasses_replace(TAIL_NEW, depths=(2,), norm="depth")
    assert _bias_se(arr, realised, pi, 20_000, 50) > 5.0
    last_bb = dataclasses_replace(TAIL_OLD, norm="backbone")
    assert _bias_se(arr, last_bb, pi, 20_000, 51) > 5.0


def dataclasses_replace(design, **kw):
    import dataclasses

    return dataclasses.replace(design, **kw)


def test_on_fixed_lengths_the_new_weights_equal_the_old(maze):
    """Without variable lengths, backbone weights and realised counts give the same g."""
    arr = est.TreeArrays.of(TreeStructure.random(**MAZE))
    assert not arr.variable_length and maze[1].variable_length
    pi = est.policy_snapshots(arr, fractions=(0.5,))["mid"]
    a = est.measure(arr, TAIL_OLD, pi, 500, np.random.default_rng(7))
    b = est.measure(arr, dataclasses_replace(TAIL_OLD, norm="backbone"), pi, 500,
                    np.random.default_rng(7))  # fmt: skip
    assert np.allclose(a.mean, b.mean) and a.sq == pytest.approx(b.sq)
    c = est.measure(arr, TAIL_NEW, pi, 500, np.random.default_rng(7))  # depth 5 = last
    assert np.allclose(a.mean, c.mean)


# ------------------------------------------------------- learner path vs vectorised path


def _learner_draws(tree_kw, pi, prompts, seed, **options):
    """The bpo learner's own advantages (grow_tree + the advantages registry) as tabular gradients.

    Each decision's gradient weight is its advantage / N, N = G (1 + M (K - 1)) the planned
    rollouts (``depth_weight`` makes advantage / N = credit / n_t).
    """
    from branchgym.agents.estimators import advantages
    from branchgym.agents.learners import bpo
    from branchgym.agents.policies.policy import TabularPolicy
    from branchgym.rollout.executor_base import EnvRecipe
    from branchgym.rollout.grow import grow_tree

    args = bpo.Args(**options)
    args.check()
    recipe = EnvRecipe("branchgym/TreeMDP-v0", tree_kw)
    schedule = bpo.LOCAL_SCHEDULES.get(args.schedule, args.schedule)
    opts = {"depths": tuple(args.branch_depths)} if args.schedule == "depths" else {}
    rng = np.random.default_rng(seed)
    eye = np.eye(pi.shape[1])
    n = args.backbones * (1 + args.m * (args.k - 1))
    gs = []
    for _ in range(prompts):
        trees = [
            grow_tree(recipe, TabularPolicy(pi), schedule, m=args.m, k=args.k,
                      seed=int(rng.integers(2**31)), rng=rng, schedule_options=opts)
            for _ in range(args.backbones)
        ]  # fmt: skip
        g = np.zeros_like(pi)
        estimate = advantages.advantage(advantages.CREDITS[args.credit])
        per_tree = estimate(trees, advantages.AdvantageOptions.of(args)).nodes
        for t, adv in zip(trees, per_tree, strict=True):
            for node in t.nodes:
                s = 0 if node.parent < 0 else int(t[node.parent].observation)
                g[s] += adv[node.id] * (eye[int(node.action)] - pi[s]) / n
        gs.append(g)
    return np.array(gs)


PIN = {"depth": 3, "n_actions": 2, "transition_noise": 0.4, "reward_kind": "bernoulli",
       "structure_seed": 4, "termination_prob": 0.3}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "design"),
    [
        (
            {"schedule": "last", "m": 1, "backbones": 2, "credit": "value_diff",
             "depth_count": "realised"},
            est.Design(g=2, m=1, k=4, schedule="last", credit="value_diff", norm="depth"),
        ),
        (
            {"schedule": "depths", "branch_depths": (1,), "m": 1, "backbones": 2,
             "credit": "value_diff"},
            est.Design(g=2, m=1, k=4, schedule="fixed", depths=(1,), credit="value_diff",
                       norm="backbone"),
        ),
    ],
    ids=["last_realised", "depths_backbone"],
)  # fmt: skip
def test_the_learner_and_the_vectorised_study_estimate_the_same_mean(options, design):
    """Pin the study to the learner: same tree, same design, means agree within noise."""
    kw = {k: v for k, v in PIN.items() if k != "structure_seed"}
    arr = est.TreeArrays.of(TreeStructure.random(**kw, seed=PIN["structure_seed"]))
    pi = est.softmax(np.random.default_rng(6).normal(size=(arr.n_nodes, arr.n_actions)))
    gs = _learner_draws(PIN, pi, 400, 8, depth_weight=True, **options)
    learner_mean = gs.mean(axis=0)
    learner_var = float(((gs - learner_mean) ** 2).sum(axis=(1, 2)).mean()) / len(gs)
    m = est.measure(arr, design, pi, 100_000, np.random.default_rng(9))
    study_var = (m.sq - float(np.sum(m.mean**2))) / m.repeats
    z = float(np.sum((learner_mean - m.mean) ** 2)) / (learner_var + study_var)
    assert z < 3.0  # E = 1 when both estimate the same mean


def test_token_costs_count_shared_prefixes_once_only_with_packing(tmp_path):
    """Cost model of the study: learner tokens re-read every line's path unless packed."""
    import json

    from branchgym.bench.estimator import TokenCosts
    from branchgym.error import OptionError

    arr = est.TreeArrays.of(TreeStructure.random(**MAZE))
    pi = est.policy_snapshots(arr, fractions=(0.5,))["mid"]
    tail = est.measure(arr, TAIL_NEW, pi, 200, np.random.default_rng(0)).summary()
    rloo = est.measure(arr, RLOO, pi, 200, np.random.default_rng(0)).summary()
    # full-length maze: 5 backbones of 6 decisions, 3 siblings of 1 decision each
    assert (tail["lines"], tail["decisions"], tail["path_decisions"]) == (20, 45, 120)
    assert (rloo["lines"], rloo["decisions"], rloo["path_decisions"]) == (7, 42, 42)
    costs = TokenCosts(prompt=100.0, generated=3.0, step=20.0)
    assert costs.costs(tail, 5) == (135.0, 20 * 100 + 120 * 20, 5 * 100 + 45 * 20)
    assert costs.costs(rloo, 1) == (126.0, 7 * 100 + 42 * 20, 100 + 42 * 20)
    data = {"maze": {}, "results": {"rloo": {"prompt_tokens_per_row": 150.0,
            "learner_tokens_per_batch": 7 * 150.0 + 42 * 30, "decisions_per_batch": 42.0,
            "rollouts_per_batch": 7.0, "tokens_per_batch": 126.0}}}  # fmt: skip
    (tmp_path / "gn.json").write_text(json.dumps(data))
    got = TokenCosts.from_gradient_noise(str(tmp_path / "gn.json"))
    assert (got.prompt, got.generated, got.step) == (150.0, 3.0, 30.0)
    (tmp_path / "old.json").write_text(json.dumps({"results": {"rloo": {"nsr": 1.0}}}))
    with pytest.raises(OptionError, match="rerun"):
        TokenCosts.from_gradient_noise(str(tmp_path / "old.json"))


def test_depths_schedule_and_its_options():
    from branchgym.agents.learners import bpo
    from branchgym.error import TrainingConfigError

    steps = [f.step for f in bpo.depths_schedule(None, list(range(4)), 2, None, depths=(3, 1))]
    assert steps == [1, 3]
    # a backbone that ended after 2 decisions does not branch at depth 3
    assert [f.step for f in bpo.depths_schedule(None, [0, 1], 2, None, depths=(1, 3))] == [1]
    ok = {"schedule": "depths", "branch_depths": (2,), "m": 1, "backbones": 2}
    bpo.Args(**ok, credit="value_diff", depth_weight=True).check()
    assert bpo.Args().depth_count == "backbone"
    for bad, match in [
        ({**ok, "m": 2}, "distinct branch_depths"),
        ({**ok, "branch_depths": (-1,)}, ">= 0"),
        ({**ok, "depth_count": "alive"}, "depth_count"),
    ]:
        with pytest.raises(TrainingConfigError, match=match):
            bpo.Args(**bad).check()
