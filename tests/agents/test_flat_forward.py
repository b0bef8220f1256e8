"""The flat read of packed trees (agents/forward/flat.py, issue 29).

``flat_forward`` lays packs end to end in one unpadded row and lets only attention know
the tree. Every token must get the log-prob and gradient it has in its own row, for
any tree shape (nested branches, side branches inside the dialogue, branches that see
only themselves, several packs in one row); the planner must put trees that share a
prompt into one trie (the prompt read once) within the forward budget; and a model or
a call the read does not cover must be refused with a typed error.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from branchgym.agents.forward import packed as forward  # noqa: E402
from branchgym.agents.forward.flat import (  # noqa: E402
    flat_forward,
    flat_supported,
    plan,
    tree_attention,
)
from branchgym.agents.forward.levels import pieces  # noqa: E402
from branchgym.agents.forward.packed import (  # noqa: E402
    FLAT,
    Pack,
    backbone,
    pack_trees,
    packed_forward,
    plan_packs,
)
from branchgym.agents.policies.models import tiny_qwen2  # noqa: E402
from branchgym.error import TrainingConfigError  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    m, _ = tiny_qwen2()
    return m.float()


def _trees(rng: np.random.Generator, vocab: int) -> tuple[list[Pack], list[int]]:
    """Three trees: two start from one prompt, rows nest (share more than the prompt)."""
    packs, keys = [], []
    prompt = [int(t) for t in rng.integers(5, vocab, 12)]
    other = [int(t) for t in rng.integers(5, vocab, 7)]
    for tree, (shared, n) in enumerate([(prompt, 5), (prompt, 4), (other, 3)]):
        seqs: list[list[int]] = []
        for r in range(n):
            own = [int(t) for t in rng.integers(5, vocab, int(rng.integers(2, 10)))]
            if r >= 2 and r % 2 == 0:
                own = seqs[r - 1][len(shared) : len(shared) + 2] + own
            seqs.append(shared + own)
        for s in seqs:
            packs.append(Pack(s, [], [(i - 1, t) for i, t in enumerate(s) if i >= len(shared)]))
            keys.append(tree)
    return packs, keys


def _scores_and_grads(model, packs, **kw):
    model.zero_grad(set_to_none=True)
    lps, extra = packed_forward(model, packs, CPU, **kw)
    (torch.cat(lps).sum() + sum(e.sum() * 1e-3 for e in extra)).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return [t.detach() for t in lps], [e.detach() for e in extra], grads


def test_the_plan_reads_every_token_once_and_each_piece_sees_its_context():
    packs, keys = _trees(np.random.default_rng(0), 200)
    merged, _ = pack_trees(packs, [0] * len(packs))
    merged.append(Pack([7, 8, 9, 10], [(2, 4, 0)], [(0, 8)]))  # a branch that sees itself
    tree = plan(merged)
    assert tree.tokens == sum(len(p.tokens) for p in merged)
    assert sorted(tree.back.tolist()) == list(range(tree.tokens))  # a permutation
    seen = torch.zeros(tree.tokens, tree.tokens, dtype=torch.bool)  # query x key
    for g in tree.groups:
        rows = g.q.reshape(-1)[g.take]
        vis = g.mask[:, 0].reshape(-1, g.mask.shape[-1])[g.take]
        keys_of = g.kv.repeat_interleave(g.q.shape[1], dim=0)[g.take]
        for r, v, k in zip(rows, vis, keys_of, strict=True):
            seen[r, k[v]] = True
    want = torch.zeros_like(seen)
    offset = 0
    for p in merged:
        for pc in pieces(len(p.tokens), p.segments):
            for j in range(pc.start, pc.end):
                cols = [offset + c for c in pc.context] + list(
                    range(offset + pc.start, offset + j + 1)
                )
                want[offset + j, cols] = True
        offset += len(p.tokens)
    assert torch.equal(seen, want)


def test_flat_equals_the_rows_in_logprobs_and_gradient(model):
    packs, keys = _trees(np.random.default_rng(1), model.config.vocab_size)
    merged, where = plan_packs(packs, keys, flat=True)
    assert len(merged) == 1  # three trees, one trie: the shared prompt read once
    plain, _, g_plain = _scores_and_grads(model, packs)
    got, _, g_got = _scores_and_grads(model, merged, cut=FLAT)
    assert len(merged[0].tokens) < sum(len(p.tokens) for p in packs)
    for w, p, ref in zip(where, packs, plain, strict=True):
        torch.testing.assert_close(
            got[w.pack][w.offset : w.offset + len(p.targets)], ref, atol=1e-5, rtol=1e-5
        )
    scale = max(float(g.abs().max()) for g in g_plain)
    assert len(g_plain) == len(g_got)
    for a, b in zip(g_plain, g_got, strict=True):
        torch.testing.assert_close(b, a, atol=5e-6 * scale, rtol=1e-4)


def test_side_branches_and_logit_positions_read_flat_as_dense(model):
    rng = np.random.default_rng(2)
    v = model.config.vocab_size
    dialogue = [int(t) for t in rng.integers(5, v, 20)]
    cand = [[int(t) for t in rng.integers(5, v, 3)] for _ in range(3)]
    tokens = dialogue + cand[0] + cand[1] + cand[2]
    segs = [(20, 23, 10), (23, 26, 21), (26, 29, 0)]  # inside, nested, on its own
    targets = [(9, dialogue[10]), (19, cand[0][0]), (21, cand[1][0]), (24, cand[1][2])]
    targets.append((27, cand[2][2]))
    packs = [Pack(tokens, segs, targets), Pack(dialogue[:8], [(5, 8, 3)], [(6, dialogue[7])])]
    positions = [[3, 22, 28], [5, 7]]
    d_scores, d_logits, d_grads = _scores_and_grads(model, packs, logit_positions=positions, cut=0)
    f_scores, f_logits, f_grads = _scores_and_grads(
        model, packs, logit_positions=positions, cut=FLAT
    )
    for a, b in zip(d_scores + d_logits, f_scores + f_logits, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    scale = max(float(g.abs().max()) for g in d_grads)
    for a, b in zip(d_grads, f_grads, strict=True):
        torch.testing.assert_close(b, a, atol=5e-6 * scale, rtol=1e-4)


def test_the_default_read_is_flat_and_trees_merge_within_the_forward_budget(model, monkeypatch):
    packs, keys = _trees(np.random.default_rng(3), model.config.vocab_size)
    base, _ = backbone(model)
    assert flat_supported(model, base)
    calls = []
    real = forward.flat_forward
    monkeypatch.setattr(forward, "flat_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        auto, _ = forward.bucketed_forward(model, packs, CPU, trees=keys)
        plain, _ = forward.bucketed_forward(model, packs, CPU)
    assert calls == [1]  # one flat call; the rows unpacked stay on the causal path
    for a, b in zip(plain, auto, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    # a budget the first two trees fill: the third starts a trie of its own
    sizes = []
    for t in range(3):
        own = [p for p, k in zip(packs, keys, strict=True) if k == t]
        sizes.append(len(pack_trees(own, [0] * len(own))[0][0].tokens))
    monkeypatch.setattr(forward, "FORWARD_TOKENS", sizes[0] + sizes[1])
    merged, where = plan_packs(packs, keys, flat=True)
    assert len(merged) == 2
    assert [w.pack for w in where] == [0 if k < 2 else 1 for k in keys]
    assert len(merged[0].tokens) < sizes[0] + sizes[1]  # the prompt once for two trees


def test_calls_the_flat_read_does_not_cover_are_refused(model, monkeypatch):
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(TrainingConfigError, match="only inside flat_forward"):
        tree_attention(None, q, q, q, None)
    base, _ = backbone(model)
    # a layer that bypasses the attention interface: fewer layers ran the tree attention
    monkeypatch.setattr(base.config, "num_hidden_layers", base.config.num_hidden_layers + 1)
    with pytest.raises(TrainingConfigError, match="attention interface"):
        flat_forward(base, [Pack([1, 2, 3], [(2, 3, 1)])], CPU)
    monkeypatch.undo()
    assert base.config._attn_implementation != "branchgym_tree"  # restored after a failure
    # gradient-checkpointed training recomputes layers outside the pass
    m, _ = tiny_qwen2()
    m.gradient_checkpointing_enable()
    m.train()
    assert not flat_supported(m, backbone(m)[0])
