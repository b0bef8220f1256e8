"""Batched generation and batched trees on the tiny model: the same samples as one at a time."""

import gymnasium as gym
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import branchgym  # noqa: E402
from branchgym.agents.engines.hf import HFEngine  # noqa: E402
from branchgym.agents.policies.models import load_model, tiny_qwen2  # noqa: E402
from branchgym.agents.policies.policy import LLMPolicy  # noqa: E402
from branchgym.agents.train import train  # noqa: E402
from branchgym.error import EngineError  # noqa: E402
from branchgym.rollout.batch import BatchStats, grow_trees_batched  # noqa: E402
from branchgym.rollout.grow import grow_tree, spec_of  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return tiny_qwen2()


def engine(tiny, **kw):
    model, tok = tiny
    # every 9th token stops a reply, so rows end at different steps and leave the batch
    stops = list(range(0, len(tok), 9))
    return HFEngine(model, tok, max_new_tokens=10, stop_token_ids=stops, **kw)


def test_batched_decoding_matches_one_prompt_at_a_time(tiny):
    eng = engine(tiny)
    rng = np.random.default_rng(0)
    vocab = len(tiny[1])
    prompts = [rng.integers(10, vocab - 10, size=n).tolist() for n in (5, 23, 9, 14)]
    counts, prefixes, seeds = [2, 1, 3, 0], [[], [33, 44], [], [7]], [11, 12, 13, 14]
    batched = eng.generate(prompts, counts, prefixes=prefixes, seeds=seeds)
    eng.clear_cache()
    alone = [
        eng.generate([p], k, prefixes=[f], seeds=[s])[0]
        for p, k, f, s in zip(prompts, counts, prefixes, seeds, strict=True)
    ]
    serial = eng.generate(prompts, counts, prefixes=prefixes, seeds=seeds, batch_prompts=False)
    lengths = set()
    for b, a, s in zip(batched, alone, serial, strict=True):
        assert len(b) == len(a) == len(s)
        for x, y, z in zip(b, a, s, strict=True):
            assert x.token_ids.tolist() == y.token_ids.tolist() == z.token_ids.tolist()
            assert x.finish_reason == y.finish_reason and x.prefix_len == y.prefix_len
            for field in ("logprobs", "entropies", "entropies_top20"):
                np.testing.assert_allclose(getattr(x, field), getattr(y, field), atol=1e-5)
                np.testing.assert_allclose(getattr(y, field), getattr(z, field), atol=1e-5)
            lengths.add(len(x.token_ids) - x.prefix_len)
    assert len(lengths) > 1, "rows should stop at different steps"
    # batched prefill from the prefix LRU: partly cached, fully cached and new prompts
    ext = [p + [21, 22, 23][: i + 1] for i, p in enumerate(prompts)]
    ext[2] = prompts[2]
    ext.append(rng.integers(10, vocab - 10, size=11).tolist())
    counts, prefixes, seeds = [2, 1, 3, 1, 2], [[], [33, 44], [5, 6], [], [9]], [1, 2, 3, 4, 5]
    eng.generate(prompts, 1, seeds=seeds[:4])  # the LRU holds every prompt
    warm = eng.generate(ext, counts, prefixes=prefixes, seeds=seeds)
    assert eng.stats["cached_tokens"] > 0
    cold = engine(tiny, prefix_cache_entries=0).generate(
        ext, counts, prefixes=prefixes, seeds=seeds, batch_prompts=False
    )
    for b, c in zip(warm, cold, strict=True):
        for x, y in zip(b, c, strict=True):
            assert x.token_ids.tolist() == y.token_ids.tolist()
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
            np.testing.assert_allclose(x.entropies, y.entropies, atol=1e-5)
    with pytest.raises(EngineError, match="one each"):
        eng.generate(prompts, 1, seeds=[1])


def test_a_dialogue_turn_prefills_only_what_its_last_reply_did_not_compute(tiny):
    # a one-sample reply's KV cache goes to the prefix cache: the next turn (prompt,
    # reply, new message) prefills the reply's last token and the message only, whether
    # the reply left the batch when it stopped, stayed in it, or ran to the token limit
    rng = np.random.default_rng(2)
    vocab = len(tiny[1])
    prompts = [rng.integers(10, vocab - 10, size=n).tolist() for n in (6, 30, 12, 8, 17, 3)]
    for batched in (True, False):
        eng = engine(tiny)
        first = eng.generate(prompts, 1, seeds=range(6), batch_prompts=batched)
        reasons = {g[0].finish_reason for g in first}
        assert reasons == {"stop", "length"}, reasons
        assert len({len(g[0].token_ids) for g in first}) > 2
        news = [rng.integers(10, vocab - 10, size=n).tolist() for n in (4, 9, 2, 5, 1, 7)]
        nxt = [
            p + g[0].token_ids.tolist() + m for p, g, m in zip(prompts, first, news, strict=True)
        ]
        for p, (g,) in zip(prompts, first, strict=True):  # the prompt's entry: views, kept once
            own = eng._cache[tuple(p)][0].layers[0].keys
            reply = eng._cache[tuple(p + g.token_ids.tolist()[:-1])][0].layers[0].keys
            assert own.untyped_storage().data_ptr() == reply.untyped_storage().data_ptr()
        before = dict(eng.stats)
        warm = eng.generate(nxt, 1, seeds=range(10, 16), batch_prompts=batched)
        assert eng.stats["prefill_tokens"] - before["prefill_tokens"] == sum(
            1 + len(m) for m in news
        )
        cold = engine(tiny, prefix_cache_entries=0).generate(
            nxt, 1, seeds=range(10, 16), batch_prompts=False
        )
        for (x,), (y,) in zip(warm, cold, strict=True):
            assert x.token_ids.tolist() == y.token_ids.tolist()
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
            np.testing.assert_allclose(x.entropies, y.entropies, atol=1e-5)


def test_prefill_passes_pad_least_and_keep_every_row():
    from itertools import combinations

    from branchgym.agents.engines.hf import _prefill_passes

    def cost(lengths, passes, per_pass):
        return sum(len(p) * max(lengths[i] for i in p) + per_pass for p in passes)

    assert _prefill_passes([140, 138, 141]) == [[1, 0, 2]]  # close lengths: one pass
    assert _prefill_passes([12, 400, 10, 390]) == [[2, 0], [3, 1]]
    rng = np.random.default_rng(0)
    for _ in range(200):
        lengths = rng.integers(1, 300, size=int(rng.integers(1, 8))).tolist()
        per_pass = int(rng.integers(0, 64))
        passes = _prefill_passes(lengths, per_pass)
        assert sorted(i for p in passes for i in p) == list(range(len(lengths)))
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        best = min(  # every split of the sorted rows into contiguous runs
            cost(
                lengths,
                [order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)), strict=True)],
                per_pass,
            )
            for k in range(len(order))
            for cuts in combinations(range(1, len(order)), k)
        )
        assert cost(lengths, passes, per_pass) == best


@pytest.mark.slow
def test_batched_llm_trees_match_serial_trees(tiny):
    env = gym.make("branchgym/TextTreeMDP-v0", max_episode_steps=2)
    recipe = spec_of(env)
    kw = {"m": 1, "k": 3, "schedule_options": {"min_gap": 4}}
    seeds = [0, 1, 2]
    serial = [
        grow_tree(recipe, LLMPolicy(engine(tiny), max_new_tokens=6), "entropy", seed=s, rng=s, **kw)
        for s in seeds
    ]
    stats = BatchStats()
    pol = LLMPolicy(engine(tiny), max_new_tokens=6)
    batched = grow_trees_batched(recipe, pol, seeds, "entropy", stats=stats, **kw)
    assert branchgym.live_snapshots().count == 0
    for a, b in zip(serial, batched, strict=True):
        assert [(n.parent, n.sibling, n.action, n.reward) for n in a] == [
            (n.parent, n.sibling, n.action, n.reward) for n in b
        ]
        for x, y in zip(a, b, strict=True):
            assert x.token_ids.tolist() == y.token_ids.tolist()
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)
            np.testing.assert_allclose(x.entropies, y.entropies, atol=1e-4)
    assert stats.requests > stats.policy_calls  # the trees' requests shared engine calls


def test_overlapped_llm_trees_match_backbone_first_trees(tiny):
    # a planned schedule's siblings decode in the backbone's engine calls: same tokens
    env = gym.make("branchgym/TextTreeMDP-v0", max_episode_steps=3)
    recipe = spec_of(env)
    kw = {"m": 2, "k": 3, "schedule_options": {"depths": (0, 1)}}
    seeds = [0, 1]

    def trees(**extra):
        pol, stats = LLMPolicy(engine(tiny), max_new_tokens=6), BatchStats()
        out = grow_trees_batched(recipe, pol, seeds, "depths", stats=stats, **kw, **extra)
        return out, stats

    first, first_stats = trees(overlap=False)
    overlapped, stats = trees()
    assert branchgym.live_snapshots().count == 0
    for a, b in zip(first, overlapped, strict=True):
        assert [(n.id, n.parent, n.sibling, n.action, n.reward) for n in a] == [
            (n.id, n.parent, n.sibling, n.action, n.reward) for n in b
        ]
        for x, y in zip(a, b, strict=True):
            assert x.token_ids.tolist() == y.token_ids.tolist()
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)
            np.testing.assert_allclose(x.entropies, y.entropies, atol=1e-4)
    assert stats.requests == first_stats.requests
    assert stats.policy_calls < first_stats.policy_calls


@pytest.mark.slow
def test_training_with_batched_rollouts_equals_serial(tmp_path):
    ci = {
        "env_kwargs": {"depth": 3, "n_actions": 3, "reward_kind": "bernoulli"},
        "model": "tiny",
        "policy": "scoring",
        "prompts_per_step": 3,
        "steps": 2,
        "lr": 1e-4,
        "threads": 1,
        "progress": False,
        "eval_episodes": 0,
    }
    serial = train("bpo", out_dir=str(tmp_path / "a"), batch_rollouts=False, **ci)
    batched = train(
        "bpo",
        out_dir=str(tmp_path / "b"),
        batch_rollouts=True,
        executor="thread",
        executor_workers=2,
        **ci,
    )
    keys = ("charts/return", "charts/rollouts", "losses/policy_loss", "tokens/generated")
    for h1, h2 in zip(serial.history, batched.history, strict=True):
        assert {k: h1.get(k) for k in keys} == {k: h2.get(k) for k in keys}
    a, _ = load_model(serial.checkpoint)
    b, _ = load_model(batched.checkpoint)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
