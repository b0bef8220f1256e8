"""Packed passes over a key/value cache (agents/forward/levels.py, issue 29).

``level_forward`` must give every token of a packed tree the log-prob and the gradient it
has in its own row, for any tree shape (nested branches, side branches inside the
dialogue, branches that see only themselves, several packs of different shapes in one
pass) and any ``cut``; the planner must read a tree as one pack where the cache read makes
that cheapest, and keep the dense mask where branches are short.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from branchgym.agents.forward.levels import (  # noqa: E402
    level_forward,
    level_pairs,
    level_rows,
    levels_supported,
    pieces,
)
from branchgym.agents.forward.packed import (  # noqa: E402
    Pack,
    backbone,
    best_cut,
    bucketed_forward,
    pack_cost,
    pack_trees,
    packed_forward,
    pair_cost,
    plan_packs,
)
from branchgym.agents.policies.models import tiny_qwen2  # noqa: E402
from branchgym.error import TrainingConfigError  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    m, _ = tiny_qwen2()
    return m.float()


def _rows(rng: np.random.Generator, vocab: int) -> tuple[list[Pack], list[int]]:
    """Two trees of rows whose tries nest (rows that share more than the prompt)."""
    packs, keys = [], []
    for tree, (prompt, n) in enumerate([(12, 6), (5, 4)]):
        shared = [int(t) for t in rng.integers(5, vocab, prompt)]
        seqs: list[list[int]] = []
        for r in range(n):
            own = [int(t) for t in rng.integers(5, vocab, int(rng.integers(3, 9)))]
            if r >= 2 and r % 2 == 0:  # continue an earlier row's first tokens: nesting
                base = seqs[r - 1]
                own = base[prompt : prompt + 2] + own
            seqs.append(shared + own)
        for s in seqs:
            packs.append(Pack(s, [], [(i - 1, t) for i, t in enumerate(s) if i >= prompt]))
            keys.append(tree)
    return packs, keys


def _scores_and_grads(model, packs, **kw):
    model.zero_grad(set_to_none=True)
    lps, _ = packed_forward(model, packs, CPU, **kw)
    torch.cat(lps).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return [t.detach() for t in lps], grads


def test_pieces_follow_the_trie():
    packs, keys = _rows(np.random.default_rng(0), 200)
    merged, _ = pack_trees(packs, keys)
    parts = pieces(len(merged[0].tokens), merged[0].segments)
    assert parts[0].level == 0 and parts[0].context == []
    assert max(p.level for p in parts) >= 2  # the trie nests
    for p in parts[1:]:
        parent = parts[p.parent]
        # a piece sees its parent's context, then the parent up to the attach point
        assert p.context[: len(parent.context)] == parent.context
        assert p.level == parent.level + 1
    # cut 1: one row per level-1 piece, its descendants in it; cut >= depth: a row each
    rows = level_rows(parts, 1)
    assert [call for call, _ in rows].count(0) == 1
    assert sum(len(m) for _, m in rows) == len(parts)
    assert len(level_rows(parts, 10)) == len(parts)
    with pytest.raises(TrainingConfigError, match="comes after"):
        pieces(10, [(4, 6, 8)])
    with pytest.raises(TrainingConfigError, match="cut >= 1"):  # cut 0 is the dense read
        level_forward(None, merged, CPU, cut=0)


@pytest.mark.parametrize("cut", [1, 2, 3])
def test_level_forward_equals_the_rows_in_logprobs_and_gradient(model, cut):
    packs, keys = _rows(np.random.default_rng(1), model.config.vocab_size)
    merged, where = pack_trees(packs, keys)
    plain, g_plain = _scores_and_grads(model, packs)
    got, g_got = _scores_and_grads(model, merged, cut=cut)
    dense, g_dense = _scores_and_grads(model, merged, cut=0)
    for w, p, ref in zip(where, packs, plain, strict=True):
        mine = got[w.pack][w.offset : w.offset + len(p.targets)]
        torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            dense[w.pack][w.offset : w.offset + len(p.targets)], ref, atol=1e-5, rtol=1e-5
        )
    # float32 rounding of sums in another order: relative to the gradient's own scale
    # (the dense mask's one-pass read differs from the rows as much)
    scale = max(float(g.abs().max()) for g in g_plain)
    assert len(g_plain) == len(g_got) == len(g_dense)
    for a, b, c in zip(g_plain, g_got, g_dense, strict=True):
        torch.testing.assert_close(b, a, atol=5e-6 * scale, rtol=1e-4)
        torch.testing.assert_close(c, a, atol=5e-6 * scale, rtol=1e-4)
    flat = torch.cat([(b - a).flatten() for a, b in zip(g_plain, g_got, strict=True)])
    assert float(flat.norm()) < 1e-5 * float(torch.cat([a.flatten() for a in g_plain]).norm())


def test_side_branches_and_logit_positions_go_through_the_cache(model):
    """Scoring candidates (segments inside the dialogue), a branch that sees only itself,
    and full logits at chosen positions: the same through the cache as dense."""
    rng = np.random.default_rng(2)
    v = model.config.vocab_size
    dialogue = [int(t) for t in rng.integers(5, v, 20)]
    cand = [[int(t) for t in rng.integers(5, v, 3)] for _ in range(3)]
    tokens = dialogue + cand[0] + cand[1] + cand[2]
    segs = [(20, 23, 10), (23, 26, 21), (26, 29, 0)]  # inside, nested, on its own
    targets = [(9, dialogue[10]), (19, cand[0][0]), (21, cand[1][0]), (24, cand[1][2])]
    targets.append((27, cand[2][2]))
    other = Pack(dialogue[:8], [], [(6, dialogue[7])])  # a plain pack in the same pass
    packs = [Pack(tokens, segs, targets), other]
    positions = [[3, 22, 28], [5]]
    with torch.no_grad():
        d_scores, d_logits = packed_forward(model, packs, CPU, logit_positions=positions, cut=0)
        c_scores, c_logits = packed_forward(model, packs, CPU, logit_positions=positions, cut=1)
    for a, b in zip(d_scores + d_logits, c_scores + c_logits, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_the_planner_reads_long_branches_as_one_pack_through_the_cache(model):
    """The multi-turn GRPO shape: a prompt, then 7 long rows. The dense plan splits the
    tree (one 4-D mask over every row costs more than the prompt it saves); through the
    cache one pack is cheapest, so every distinct token is read once."""
    rng = np.random.default_rng(3)
    v = model.config.vocab_size
    shared = [int(t) for t in rng.integers(5, v, 40)]
    packs = []
    for _ in range(7):
        s = shared + [int(t) for t in rng.integers(5, v, 60)]
        packs.append(Pack(s, [], [(len(s) - 2, s[-1])]))
    keys = [0] * 7
    pair = pair_cost(model)
    unique = len(pack_trees(packs, keys)[0][0].tokens)
    dense_plan, _ = plan_packs(packs, keys, pair=pair)
    cache_plan, _ = plan_packs(packs, keys, pair=pair, levels=True)
    assert sum(len(p.tokens) for p in dense_plan) > unique
    assert [len(p.tokens) for p in cache_plan] == [unique]
    assert best_cut(cache_plan, pair) >= 1
    assert pack_cost(cache_plan, pair, cut=1) < pack_cost(cache_plan, pair, cut=0)
    # short branches after a long prompt: the dense mask is the cheaper read
    short = [Pack(shared + [7 + i], [], [(40, 7 + i)]) for i in range(7)]
    merged, _ = pack_trees(short, keys)
    assert best_cut(merged, pair) == 0
    assert level_pairs(len(merged[0].tokens), merged[0].segments) < len(merged[0].tokens) ** 2
    # and bucketed_forward's own choice gives the rows' log-probs
    with torch.no_grad():
        plain, _ = bucketed_forward(model, packs, CPU)
        auto, _ = bucketed_forward(model, packs, CPU, trees=keys)
    for a, b in zip(plain, auto, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_gradient_checkpointed_training_keeps_the_dense_mask(model):
    base, _ = backbone(model)
    assert levels_supported(model, base)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        model.train()
        assert not levels_supported(model, base)  # a recomputed layer would append twice
        model.eval()
        assert levels_supported(model, base)  # no recomputation outside training
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    assert not levels_supported(model, None)
