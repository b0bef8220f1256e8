"""RolloutTree bookkeeping on hand-built trees."""

import numpy as np
import pytest

from branchgym.rollout.tree import ROOT, RolloutTree, TreeStats, action_entropy


def node(tokens, reward=0.0, done=False, prefix_len=0, ent=None):
    n = len(tokens)
    return dict(
        token_ids=tokens,
        logprobs=np.full(n, -0.5),
        entropies=np.asarray(ent if ent is not None else np.linspace(0.1, 1.0, n)),
        reward=reward,
        terminated=done,
        prefix_len=prefix_len,
    )


@pytest.fixture
def tree():
    """root -> a0 -> a1 -> a2 (backbone); b, c fork at step 1; d forks at step 0."""
    t = RolloutTree("toy", seed=3)
    a0, a1, a2 = t.add_path(ROOT, [node([1, 2, 3]), node([4, 5]), node([6], 1.0, True)])
    b1, b2 = t.add_path(a0.id, [node([7, 8, 9], prefix_len=1), node([10], 0.0, True)])
    c1, c2 = t.add_path(a0.id, [node([11]), node([12, 13], 0.5, True)])
    d0, d1, d2 = t.add_path(ROOT, [node([14]), node([15]), node([16, 17], 0.2, True)])
    t.ids = dict(
        a0=a0.id,
        a1=a1.id,
        a2=a2.id,
        b1=b1.id,
        b2=b2.id,
        c1=c1.id,
        c2=c2.id,
        d0=d0.id,
        d1=d1.id,
        d2=d2.id,
    )
    return t


def test_paths_and_leaves(tree):
    i = tree.ids
    assert tree.leaves() == [i["a2"], i["b2"], i["c2"], i["d2"]]
    assert tree.paths() == [
        [i["a0"], i["a1"], i["a2"]],
        [i["a0"], i["b1"], i["b2"]],
        [i["a0"], i["c1"], i["c2"]],
        [i["d0"], i["d1"], i["d2"]],
    ]
    assert tree.backbone == [i["a0"], i["a1"], i["a2"]]
    assert [tree[n].step for n in tree.paths()[1]] == [0, 1, 2]


def test_returns_to_go_follow_each_nodes_own_line(tree):
    i = tree.ids
    rtg = tree.returns_to_go()
    assert rtg[i["a0"]] == 1.0 and rtg[i["a1"]] == 1.0 and rtg[i["a2"]] == 1.0
    assert rtg[i["b1"]] == 0.0 and rtg[i["c1"]] == 0.5 and rtg[i["d0"]] == pytest.approx(0.2)
    np.testing.assert_allclose(tree.returns(), [1.0, 0.0, 0.5, 0.2])


def test_discounted_returns():
    t = RolloutTree(gamma=0.5)
    t.add_path(ROOT, [node([1], 1.0), node([2], 0.0), node([3], 4.0, True)])
    np.testing.assert_allclose(t.path_returns_to_go([0, 1, 2]), [2.0, 2.0, 4.0])
    np.testing.assert_allclose(t.returns_to_go(), [2.0, 2.0, 4.0])


def test_branch_points_list_backbone_sibling_first_with_returns(tree):
    i = tree.ids
    bps = tree.branch_points()
    assert [(b.parent, b.step, b.k) for b in bps] == [(ROOT, 0, 2), (i["a0"], 1, 3)]
    assert bps[0].siblings == (i["a0"], i["d0"])
    assert bps[0].returns == pytest.approx((1.0, 0.2))
    assert bps[1].siblings == (i["a1"], i["b1"], i["c1"])
    assert bps[1].returns == (1.0, 0.0, 0.5)
    assert tree.sibling_index(i["c1"]) == 3 and tree.sibling_index(i["a1"]) == 1
    assert tree.sibling_index(i["a2"]) == 0


def test_owning_path_gives_branch_steps_at_or_after_the_node(tree):
    i = tree.ids
    op = tree.owning_path(i["a0"])
    assert op.leaf == i["a2"] and op.position == 0
    assert op.branch_steps == (0, 1) and op.siblings == (1, 1) and op.branch_index == (0, 1)
    op = tree.owning_path(i["b1"])
    assert op.nodes == (i["a0"], i["b1"], i["b2"]) and op.position == 1
    assert op.branch_steps == (1,) and op.siblings == (2,) and op.branch_index == (1,)
    op = tree.owning_path(i["c2"])  # a sibling's tail: no branch point at or after it
    assert op.branch_steps == () and op.leaf == i["c2"]
    op = tree.owning_path(i["d0"])
    assert op.branch_steps == (0,) and op.siblings == (2,)
    owned = tree.owned_nodes()
    assert sorted(n for ns in owned.values() for n in ns) == list(range(len(tree)))
    assert owned[i["b2"]] == [i["b1"], i["b2"]]


def test_token_masks_count_each_shared_prefix_once(tree):
    counts = {n.id: np.zeros(n.n_tokens) for n in tree}
    for path, masks in tree.token_masks():
        for nid, m in zip(path, masks, strict=True):
            counts[nid] += m
    for n in tree:
        expect = np.ones(n.n_tokens)
        expect[: n.prefix_len] = 0  # a fork inside a turn copies these tokens
        np.testing.assert_array_equal(counts[n.id], expect)
    path, masks = tree.token_masks()[1]
    assert masks[0].sum() == 0  # a0 belongs to the backbone, not to b's path
    np.testing.assert_array_equal(masks[1], [0, 1, 1])
    assert tree.generated_tokens() == 17 - 1
    # independent rollouts to the same 4 leaves regenerate every shared prefix
    assert tree.independent_tokens() == (3 + 2 + 1) + (3 + 3 + 1) + (3 + 1 + 2) + (1 + 1 + 2)


def test_bad_nodes_are_rejected(tree):
    with pytest.raises(ValueError, match="ended its episode"):
        tree.add(tree.ids["a2"], **node([1]))
    with pytest.raises(ValueError, match="not a node"):
        tree.add(99, **node([1]))
    with pytest.raises(ValueError, match="logprobs has 1 values for 2 tokens"):
        tree.add(ROOT, token_ids=[1, 2], logprobs=[0.0], entropies=[0.0, 0.0])
    with pytest.raises(ValueError, match="prefix_len"):
        tree.add(ROOT, **node([1], prefix_len=2))


def test_renumber_keeps_the_tree_and_changes_only_ids(tree):
    i = tree.ids
    tree.set_fork_offset(i["a0"], 1)
    before = {(n.text, tuple(n.token_ids)): n for n in tree}
    paths = [[tuple(tree[n].token_ids) for n in p] for p in tree.paths()]

    def forks():  # sibling order follows ids, so compare each branch point's returns as a set
        return sorted(
            (b.step, b.k, sorted(b.returns), b.token_offset) for b in tree.branch_points()
        )

    bps = forks()
    # the d line first, then the backbone, then b and c interleaved step by step
    order = [i[k] for k in ("d0", "d1", "d2", "a0", "a1", "a2", "c1", "b1", "c2", "b2")]
    tree.renumber(order)
    assert [n.id for n in tree] == list(range(len(tree)))
    assert [tuple(n.token_ids) for n in tree][:3] == [(14,), (15,), (16, 17)]
    assert {(n.text, tuple(n.token_ids)): n for n in tree} == before  # same Node objects
    new_paths = [[tuple(tree[n].token_ids) for n in p] for p in tree.paths()]
    assert sorted(new_paths) == sorted(paths)
    assert tree.backbone == [0, 1, 2]  # the first child of the root is now d0
    assert tree.children(3) == [4, 6, 7]  # a0's children in their new id order: a1, c1, b1
    assert forks() == bps
    with pytest.raises(ValueError, match="once"):
        tree.renumber([0, 0, 1, 2, 3, 4, 5, 6, 7, 8])
    with pytest.raises(ValueError, match="before its parent"):
        tree.renumber([1, 0, *range(2, 10)])


def test_action_entropy_reductions():
    e = np.array([0.2, 0.4, 0.9])
    assert action_entropy(e, "mean") == pytest.approx(0.5)
    assert action_entropy(e, "first") == pytest.approx(0.2)
    assert action_entropy(e, "sum") == pytest.approx(1.5)
    assert action_entropy(np.array([]), "mean") == 0.0
    with pytest.raises(ValueError, match="unknown"):
        action_entropy(e, "max")


def test_stats_ratios_and_sum():
    a = TreeStats(
        generated_tokens=70,
        independent_tokens=100,
        generate_s=9.0,
        env_s=1.0,
        snapshot_s=0.1,
        restore_s=0.1,
        peak_live_snapshots=3,
    )
    assert a.tokens_saved == pytest.approx(0.3)
    assert a.branching_overhead == pytest.approx(0.02)
    b = TreeStats(generated_tokens=30, independent_tokens=100, peak_live_snapshots=5)
    a += b
    assert a.generated_tokens == 100 and a.peak_live_snapshots == 5
    assert a.as_dict()["tokens_saved"] == pytest.approx(0.5)


def test_render_shows_forks_and_rewards(tree):
    text = tree.render()
    assert "4 rollouts" in text and "k=3" in text and "r=0.500" in text
