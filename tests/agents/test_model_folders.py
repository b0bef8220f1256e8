"""A model folder written by save_tiny_qwen2 reloads with the exact same tokenizer."""

import pytest

pytest.importorskip("transformers")

from branchgym.agents.policies.models import load_model, save_tiny_qwen2, tiny_tokenizer  # noqa: E402


def test_saved_tiny_model_tokenizes_like_the_original(tmp_path):
    folder = save_tiny_qwen2(tmp_path / "tiny")
    _, tok = load_model(folder)
    text = "You go north and arrive in room 17 (depth 2 of 4). Exits: go north.<|im_end|>\n"
    original = tiny_tokenizer()(text, add_special_tokens=False).input_ids
    assert tok(text, add_special_tokens=False).input_ids == original
    assert tok.eos_token == "<|im_end|>" and tok.chat_template is not None
