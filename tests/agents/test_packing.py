"""Tree packing in every learner's forward passes (agents/forward/packed.py, issue 29).

A group of independent rollouts is one tree whose root is the prompt, so the packed
sequences of ``pack_trees`` serve every learner. Each learner runs one real step with
its own loop; every update and every frozen pass (reference, teacher) is computed with
packing off (the rows one by one, causal) and on (the flat read of agents/forward/flat.py)
and must agree to float32 tolerance (log-probs and gradient), and the step reads each
distinct token once (``tokens/learner == tokens/unique``).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from branchgym.agents.forward.packed import (  # noqa: E402
    Pack,
    bucketed_forward,
    packing_exact,
    plan_packs,
)
from branchgym.agents.policies.models import tiny_qwen2  # noqa: E402
from branchgym.agents.train import train  # noqa: E402
from branchgym.agents.training.run import Run  # noqa: E402

ENV_KWARGS = {"depth": 3, "n_actions": 3, "reward_kind": "bernoulli", "structure_seed": 2}
ONE_STEP = {
    "env_kwargs": ENV_KWARGS,
    "model": "tiny",
    "prompts_per_step": 2,
    "steps": 1,
    "lr": 1e-4,
    "threads": 1,
    "progress": False,
}


def _grads(run: Run) -> list[torch.Tensor]:
    return [p.grad.clone() for p in run.model.parameters() if p.grad is not None]


@pytest.fixture
def checked(monkeypatch):
    """Run.update and Run.frozen_logprobs computed unpacked and packed, compared, then real."""
    seen = {"updates": 0, "frozen": 0, "plain_tokens": [], "fields": set()}
    update, frozen = Run.update, Run.frozen_logprobs

    def both_updates(self, batch, rows, loss_fn, **kw):
        real_step = self.optimizer.step
        self.optimizer.step = lambda *a, **k: None  # the weights stay for the second pass
        grads = []
        try:
            for pack in (False, True):
                self.args.pack_trees = pack
                update(self, batch, rows, loss_fn, **kw)
                grads.append(_grads(self))
            self.args.pack_trees = False
            seen["plain_tokens"].append(self.token_counts(batch)["tokens/learner"])
        finally:
            self.optimizer.step = real_step
            self.args.pack_trees = True
        plain, packed = grads
        assert len(plain) == len(packed)
        for a, b in zip(plain, packed, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
        seen["updates"] += bool(plain)
        return update(self, batch, rows, loss_fn, **kw)

    def both_frozen(self, model, batch, field):
        self.args.pack_trees = False
        frozen(self, model, batch, field)
        plain = [getattr(d, field).copy() for d in batch.decisions()]
        self.args.pack_trees = True
        frozen(self, model, batch, field)
        got = [getattr(d, field) for d in batch.decisions()]
        assert plain and len(plain) == len(got)
        for a, b in zip(plain, got, strict=True):
            np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5)
        seen["frozen"] += 1
        seen["fields"].add(field)

    monkeypatch.setattr(Run, "update", both_updates)
    monkeypatch.setattr(Run, "frozen_logprobs", both_frozen)
    return seen


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """Another random tiny model with the student's tokenizer: a frozen teacher."""
    out = tmp_path_factory.mktemp("teacher")
    model, tok = tiny_qwen2(seed=1)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


LEARNERS = [
    ("grpo", {"beta": 0.05}, "ref_logp"),
    ("rloo", {"beta": 0.05}, "ref_logp"),
    ("bellman_po", {"updates_per_batch": 2, "g": 4}, None),
    ("bpo", {"beta": 0.05, "gap_unit": "steps"}, "ref_logp"),
    ("opd", {}, "teacher_logp"),
    ("opd_multi", {"n": 4}, "teacher_logp"),
    ("branch_opd", {}, "teacher_logp"),
    # free generation: each row is the prompt plus the model's own multi-turn text
    (
        "grpo",
        {"beta": 0.05, "policy": "generate", "max_new_tokens": 6, "max_episode_steps": 2},
        "ref_logp",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "algo, extra, field",
    LEARNERS,
    ids=[f"{a}-{e.get('policy', 'scoring')}" for a, e, _ in LEARNERS],
)
def test_every_learner_trains_packed_equal_to_unpacked(
    algo, extra, field, checked, teacher, tmp_path
):
    opts = {**ONE_STEP, **extra}
    if "opd" in algo:
        opts["teacher"] = teacher
    result = train(algo, out_dir=str(tmp_path), **opts)
    assert checked["updates"] >= 1
    if field is not None:
        assert field in checked["fields"]
    line = next(h for h in result.history if "tokens/learner" in h)
    learner, unique = line["tokens/learner"], line["tokens/unique"]
    # packed (the default) and read flat: every distinct token of the step is read once,
    # each prompt once however many trees start from it
    assert learner == unique
    assert unique < checked["plain_tokens"][0]


def test_plan_packs_merges_a_tree_only_where_it_pays():
    shared = list(range(5, 65))
    rows = [shared + [100 + i, 200 + i] for i in range(4)]
    apart = [[300 + 10 * i + j for j in range(62)] for i in range(4)]  # nothing in common
    packs = [Pack(s, [], [(len(s) - 2, s[-1])]) for s in rows + apart]
    keys = [0] * 4 + [1] * 4
    out, where = plan_packs(packs, keys)
    assert len(out) == 1 + 4  # tree 0 merged, tree 1's rows as they were
    assert len(out[0].tokens) == 60 + 4 * 2
    assert all(not p.segments for p in out[1:])
    assert [w.pack for w in where] == [0, 0, 0, 0, 1, 2, 3, 4]
    # long branches: one merged pack's dense mask costs more than the prefix it saves,
    # two packs of two rows (the prefix read twice) cost least
    long = [list(range(5, 35)) + [400 + 30 * i + j for j in range(30)] for i in range(4)]
    packs += [Pack(s, [], [(len(s) - 2, s[-1])]) for s in long]
    keys += [2] * 4
    out, where = plan_packs(packs, keys, pair=1e-2)
    assert [len(p.tokens) for p in out[5:]] == [30 + 2 * 30, 30 + 2 * 30]
    assert [w.pack for w in where[8:]] == [5, 5, 6, 6]
    model, _ = tiny_qwen2()
    cpu = torch.device("cpu")
    with torch.no_grad():
        plain, _ = bucketed_forward(model, packs, cpu)
        auto, _ = bucketed_forward(model, packs, cpu, trees=keys)  # the model's pair cost
        split, _ = bucketed_forward(model, out, cpu)  # the pair = 1e-2 plan
    split = [split[w.pack][w.offset : w.offset + 1] for w in where]  # one target per row
    for a, b, c in zip(plain, auto, split, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


def test_packing_is_turned_off_where_a_4d_mask_is_not_honoured():
    model, _ = tiny_qwen2()
    assert packing_exact(model) is None
    model.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in packing_exact(model)
    model.config._attn_implementation = "sdpa"
    model.config.layer_types = ["sliding_attention", "full_attention"]
    assert "sliding-window" in packing_exact(model)
