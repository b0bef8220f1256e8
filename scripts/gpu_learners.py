#!/usr/bin/env python
"""Every reference learner for a few steps on a randomly initialised Qwen2-shaped model.

The GPU check of issue #8: no weights can be downloaded on the GPU machine, so the
model is built from a config (Qwen2.5-0.5B's shape: 24 layers, hidden 896, 14 heads, 2
KV heads, MLP 4864, vocabulary 151,936, tied embeddings; about 494 M parameters) with
random weights, saved once to a temporary folder, and every learner trains it through
``branchgym.agents.train.train`` on TextTreeMDP with free generation. For each learner
it reports the time per step, generated tokens per second, tokens per step and peak
memory (CUDA: ``torch.cuda.max_memory_allocated``; CPU: the process's peak RSS).

::

    python scripts/gpu_learners.py                       # CUDA, the 0.5 B model
    python scripts/gpu_learners.py --device cpu --tiny   # the same run, tiny, on CPU

Results go to ``--out`` (JSON and a markdown table) and stdout.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ALGOS = ("sft", "grpo", "rloo", "bpo", "bellman_po", "branch_opd", "opd", "opd_multi")

#: Qwen2.5-0.5B's shape (random weights: nothing is downloaded).
QWEN2_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "layers": 24,
    "heads": 14,
    "kv_heads": 2,
    "vocab_size": 151_936,
}


def build_model(folder: Path, *, tiny: bool, seed: int) -> int:
    """Save a random Qwen2 (0.5 B shape, or the tiny one) with the tiny tokenizer; params."""
    import torch
    from branchgym.agents.models import save_tiny_qwen2, tiny_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if tiny:
        save_tiny_qwen2(folder, seed=seed)
        from branchgym.agents.models import load_model

        model, _ = load_model(folder)
        return sum(p.numel() for p in model.parameters())
    tok = tiny_tokenizer()
    shape = QWEN2_05B
    config = Qwen2Config(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=32_768,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def peak_memory_gb(device: str) -> float:
    """Peak memory of this learner (CUDA allocator) or of the process so far (CPU RSS)."""
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def run_one(algo: str, args: argparse.Namespace, student: Path, teacher: Path, out: Path) -> dict:
    """Train ``algo`` for ``args.steps`` steps; its timing and memory figures."""
    import torch
    from branchgym.agents.train import train

    options: dict[str, Any] = {
        "env_id": "branchgym/TextTreeMDP-v0",
        "env_kwargs": {"depth": 3, "reward_kind": "bernoulli", "structure_seed": 2},
        "model": str(student),
        "policy": "generate",
        "steps": args.steps,
        "prompts_per_step": args.prompts,
        "lr": 1e-6,
        "max_new_tokens": args.max_new_tokens,
        "max_episode_steps": 4,
        "device": args.device,
        "out_dir": str(out / algo),
        "progress": False,
        "threads": args.threads,
    }
    if algo == "bpo":
        options.update(gap_unit="steps")
    if algo in ("branch_opd", "opd", "opd_multi"):
        options.update(teacher=str(teacher))
    if algo == "sft":
        options.update(episodes=args.prompts * 4, batch_episodes=args.prompts)
    if algo == "bellman_po":
        options.update(g=4, updates_per_batch=2)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = train(algo, **options)
    wall = time.perf_counter() - t0
    steps = [h for h in result.history if "time/step_s" in h]
    timed = steps[1:] or steps  # the first step includes warm-up (kernels, caches)
    step_s = sum(h["time/step_s"] for h in timed) / len(timed)
    tokens = sum(h.get("tokens/generated", 0.0) for h in timed) / len(timed)
    gen_tps = [h["tokens/per_second"] for h in timed if h.get("tokens/per_second")]
    return {
        "algo": algo,
        "steps": len(steps),
        "step_s": step_s,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_s if step_s else 0.0,
        "generate_tokens_per_s": sum(gen_tps) / len(gen_tps) if gen_tps else 0.0,
        "peak_memory_gb": peak_memory_gb(args.device),
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


def main(argv: list[str] | None = None) -> int:
    """Build the model, run every learner, print and write the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="the tiny Qwen2 instead of the 0.5 B shape")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--algos", nargs="*", default=list(ALGOS), choices=ALGOS)
    p.add_argument("--out", default="results/gpu_learners", help="folder for the JSON and table")
    args = p.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_learners: no CUDA device; run with --device cpu --tiny", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_learners_") as tmp:
        student, teacher = Path(tmp) / "student", Path(tmp) / "teacher"
        n_params = build_model(student, tiny=args.tiny, seed=0)
        build_model(teacher, tiny=args.tiny, seed=1)
        device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        print(f"model: {n_params / 1e6:.1f} M parameters, device: {device_name}", flush=True)
        for algo in args.algos:
            row = run_one(algo, args, student, teacher, Path(tmp) / "runs")
            rows.append(row)
            print(json.dumps(row), flush=True)
    header = "| algo | step s | tokens/step | tokens/s | generate tok/s | peak GB |"
    lines = [header, "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['algo']} | {r['step_s']:.2f} | {r['tokens_per_step']:.0f} | "
            f"{r['tokens_per_s']:.0f} | {r['generate_tokens_per_s']:.0f} | "
            f"{r['peak_memory_gb']:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    meta = {
        "device": device_name,
        "params": n_params,
        "tiny": args.tiny,
        "steps": args.steps,
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
    }
    (out / "gpu_learners.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (out / "gpu_learners.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
