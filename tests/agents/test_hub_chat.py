"""Hub ids from a local Hugging Face cache (offline) and prompts from the tokenizer's template."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from branchgym.agents.engines.hf import HFEngine  # noqa: E402
from branchgym.agents.policies.chat_format import CHATML, chat_format  # noqa: E402
from branchgym.agents.policies.hub import hub_cache_dir, is_hub_id, resolve_hub_id  # noqa: E402
from branchgym.agents.policies.models import load_model, save_tiny_qwen2, tiny_tokenizer  # noqa: E402
from branchgym.agents.policies.policy import Context, LLMPolicy, Turn  # noqa: E402
from branchgym.error import DataError, ModelNotCachedError  # noqa: E402

#: A non-ChatML template (Zephyr-like markers in plain text, the reply closed by eos).
TEMPLATE = (
    "{% for m in messages %}"
    "{{ '### ' + m['role'] + ':\n' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ '<|im_end|>' }}{% endif %}{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant:\n' }}{% endif %}"
)
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A Hub cache laid out as huggingface_hub writes it, holding acme/tiny-chat."""
    root = tmp_path_factory.mktemp("hf") / "hub"
    repo = root / "models--acme--tiny-chat"
    snap = save_tiny_qwen2(repo / "snapshots" / COMMIT)
    _, tok = load_model(snap)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "blobs").mkdir()
    return root


def test_hub_ids_resolve_from_the_cache_offline(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_cache_dir() == hub
    snap = hub / "models--acme--tiny-chat" / "snapshots" / COMMIT
    assert resolve_hub_id("acme/tiny-chat") == snap
    assert resolve_hub_id(f"acme/tiny-chat@{COMMIT}") == snap
    assert is_hub_id("Qwen/Qwen2.5-7B-Instruct") and not is_hub_id("tiny")
    model, tok = load_model("acme/tiny-chat")
    ref, _ = load_model(snap)
    for (name, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert tok.chat_template == TEMPLATE


def test_missing_hub_models_name_the_cache_and_the_fix(hub, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    with pytest.raises(ModelNotCachedError) as err:
        load_model("Qwen/Qwen2.5-7B-Instruct")
    msg = str(err.value)
    assert str(tmp_path / "home" / "hub") in msg and "models--Qwen--Qwen2.5-7B-Instruct" in msg
    assert "huggingface-cli download Qwen/Qwen2.5-7B-Instruct" in msg and "HF_HUB_CACHE" in msg
    assert isinstance(err.value, DataError)
    with pytest.raises(ModelNotCachedError, match="cached refs: main"):
        resolve_hub_id("acme/tiny-chat@v2", cache=hub)
    # a snapshot without weights (an interrupted download) is refused, not half-loaded
    broken = tmp_path / "hub2" / "models--acme--broken"
    (broken / "snapshots" / "abc").mkdir(parents=True)
    (broken / "snapshots" / "abc" / "config.json").write_text("{}")
    (broken / "refs").mkdir()
    (broken / "refs" / "main").write_text("abc")
    with pytest.raises(ModelNotCachedError, match="no weights"):
        resolve_hub_id("acme/broken", cache=tmp_path / "hub2")


def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=False)


def test_prompts_follow_the_tokenizers_chat_template(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    model, tok = load_model("acme/tiny-chat")
    engine = HFEngine(model, tok, max_new_tokens=6)
    pol = LLMPolicy(engine, max_new_tokens=6)
    assert pol.chat.source == "template"
    assert (pol.chat.stop_text, pol.chat.after_stop) == ("<|im_end|>", "\n")
    ctx = Context("branchgym/TextTreeMDP-v0", "room 0", {"admissible_actions": ["go north"]})
    builder = pol.builder(ctx)
    msgs = [
        {"role": "system", "content": builder.system_prompt()},
        {"role": "user", "content": builder.task_message("room 0", ctx.info)},
    ]
    assert _decode(tok, pol.prompt_ids(ctx)) == tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )
    # one reply that stopped (ends with eos), one cut at max_new_tokens: both closed once
    stopped = tuple(engine.encode("Action: go north<|im_end|>"))
    cut = tuple(engine.encode("Action: go east"))
    ctx = ctx.extend(Turn("Action: go north", stopped, "go north", "room 1", {}))
    ctx = ctx.extend(Turn("Action: go east", cut, "go east", "room 2", {}))
    for reply, obs in (("Action: go north", "room 1"), ("Action: go east", "room 2")):
        msgs.append({"role": "assistant", "content": reply})
        msgs.append({"role": "user", "content": builder.observation_message(obs, {})})
    expected = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>" not in expected
    assert _decode(tok, pol.prompt_ids(ctx)) == expected


def test_chatml_tokenizers_keep_their_exact_prompt_ids():
    from branchgym.agents.policies.models import tiny_qwen2

    model, tok = tiny_qwen2()
    engine = HFEngine(model, tok, max_new_tokens=6)
    pol = LLMPolicy(engine, max_new_tokens=6)
    enc = engine.encode
    ctx = Context("branchgym/TextTreeMDP-v0", "room 0", {"admissible_actions": ["go north"]})
    b = pol.builder(ctx)
    system, task = b.system_prompt(), b.task_message("room 0", ctx.info)
    stopped = tuple(enc("Action: go north<|im_end|>"))
    cut = tuple(enc("Action: go east"))
    ctx = ctx.extend(Turn("a", stopped, "go north", "room 1", {}))
    ctx = ctx.extend(Turn("b", cut, "go east", "room 2", {}))
    # the ids the hard-coded ChatML prompt gave before templates were read
    old = enc(
        f"<|im_start|>system\n{system}<|im_end|>\n"
        f"<|im_start|>user\n{task}<|im_end|>\n<|im_start|>assistant\n"
    )
    for reply, obs, closed in ((stopped, "room 1", True), (cut, "room 2", False)):
        old += list(reply) + ([] if closed else enc("<|im_end|>"))
        msg = b.observation_message(obs, {})
        old += enc(f"\n<|im_start|>user\n{msg}<|im_end|>\n<|im_start|>assistant\n")
    assert pol.prompt_ids(ctx) == old


def test_formats_without_a_usable_template_fall_back_to_chatml():
    tok = tiny_tokenizer()
    tok.chat_template = None
    assert chat_format(tok) is CHATML
    # a template that rewrites earlier turns cannot grow a prompt turn by turn
    tok.chat_template = (
        "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert chat_format(tok) is CHATML
    assert any("ChatML" in str(w.message) for w in caught)
    assert CHATML.head("S", "T").endswith("<|im_start|>assistant\n")
