"""``branchgym bench trl``: step time of TRL's trainer on branchgym trees vs branchgym's ``bpo``.

One run trains the same model (same initial weights) on the same env with the same tree
sizes twice, for ``--steps`` steps each:

* ``branchgym bpo``: branchgym's own learner (:mod:`branchgym.agents.bpo`, the
  ``generate`` policy on :class:`~branchgym.agents.engines.hf.HFEngine`);
* ``TRL BranchingGRPOTrainer``: :class:`branchgym.integrations.trl.BranchingGRPOTrainer`
  (TRL's ``GRPOTrainer`` with branchgym trees, ``loss_type="dapo"``: the ``token-mean``
  aggregation of ``bpo``).

Both grow ``--prompts`` trees per step with M branch points of K siblings (schedule
``even``), replies of at most ``--max-new-tokens`` tokens and episodes of at most
``--max-episode-steps`` decisions, no KL term and one optimizer update per step. A step's
time is wall clock from its start to the end of its optimizer step (TRL: a trainer
callback; bpo: its ``time/step_s``); the first step is a warm-up and left out of the
medians. The report also gives the tokens each step generated, so the two workloads can
be checked to match.

TRL is optional (the ``trl`` extra): without it the study says so and times ``bpo`` only.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from typing import Any

import numpy as np

from branchgym.bench.common import Report, positive_int

__all__ = ["configure", "main"]

ENV = "branchgym/TextTreeMDP-v0"
ENV_KWARGS = {"depth": 3, "n_actions": 3, "reward_kind": "bernoulli", "structure_seed": 2}


def configure(parser: argparse.ArgumentParser) -> None:
    """Add this study's options."""
    parser.add_argument("--out", default="results", help="results folder (default: results)")
    parser.add_argument("--model", default="tiny", help="tiny, smollm2 or a model folder")
    parser.add_argument("--steps", type=positive_int, default=5, help="steps per trainer (5)")
    parser.add_argument("--prompts", type=positive_int, default=2, help="trees per step (2)")
    parser.add_argument("--m", type=positive_int, default=2, help="branch points M (2)")
    parser.add_argument("--k", type=positive_int, default=4, help="siblings K (4)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=16, help="reply cap (16)")
    parser.add_argument(
        "--max-episode-steps", type=positive_int, default=3, help="decisions per episode (3)"
    )
    parser.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (1)")
    parser.add_argument("--quick", action="store_true", help="3 steps, 1 prompt")


def _bpo(args: argparse.Namespace, out: str) -> dict[str, Any]:
    """The bpo learner of branchgym: per-step seconds and generated tokens."""
    from branchgym.agents.train import train

    result = train(
        "bpo",
        model=args.model,
        policy="generate",
        env_id=ENV,
        env_kwargs=ENV_KWARGS,
        steps=args.steps,
        prompts_per_step=args.prompts,
        m=args.m,
        k=args.k,
        schedule="even",
        beta=0.0,
        aggregation="token-mean",
        max_new_tokens=args.max_new_tokens,
        max_episode_steps=args.max_episode_steps,
        lr=1e-5,
        threads=args.threads,
        progress=False,
        out_dir=out,
        eval_episodes=0,
    )
    lines = [h for h in result.history if "time/step_s" in h]
    return {
        "step_s": [h["time/step_s"] for h in lines],
        "tokens": [h.get("tokens/generated", float("nan")) for h in lines],
    }


def _trl(args: argparse.Namespace, out: str) -> dict[str, Any]:
    """BranchingGRPOTrainer with the same model, env and trees: per-step seconds and tokens."""
    import torch
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig

    from branchgym.agents.models import load_model
    from branchgym.integrations.trl import BranchingArgs, BranchingGRPOTrainer

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    starts: list[float] = []
    times: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a: Any, **kw: Any) -> None:
            starts.append(time.perf_counter())

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            times.append(time.perf_counter() - starts[-1])

    config = GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=2 * args.prompts,  # num_generations copies per prompt
        num_generations=2,
        max_steps=args.steps,
        learning_rate=1e-5,
        beta=0.0,
        loss_type="dapo",
        logging_steps=1,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        gradient_checkpointing=False,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = BranchingGRPOTrainer(
        model,
        ENV,
        env_kwargs=ENV_KWARGS,
        branching=BranchingArgs(
            m=args.m,
            k=args.k,
            schedule="even",
            max_new_tokens=args.max_new_tokens,
            max_episode_steps=args.max_episode_steps,
        ),
        args=config,
        processing_class=tok,
        prompts=max(8, args.steps * args.prompts),
        callbacks=[StepClock()],
    )
    trainer.remove_callback(PrinterCallback)  # the report has the figures; no log dicts
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {
        "step_s": times,
        "tokens": [h.get("tokens/generated", float("nan")) for h in logs],
    }


def _median(values: list[float]) -> float:
    rest = values[1:] if len(values) > 1 else values  # step 1 is a warm-up
    return float(np.median(rest)) if rest else float("nan")


def main(args: argparse.Namespace) -> int:
    """Run the study and write ``<out>/trl.md``."""
    if args.quick:
        args.steps, args.prompts = 3, 1
    report = Report(args.out, "trl", "branchgym bench trl")
    have_trl = importlib.util.find_spec("trl") is not None
    report.add(
        f"Model `{args.model}`, {ENV} {ENV_KWARGS}, {args.prompts} tree(s) per step, "
        f"M = {args.m}, K = {args.k} (schedule even), replies <= {args.max_new_tokens} "
        f"tokens, episodes <= {args.max_episode_steps} decisions, no KL, one update per "
        f"step, {args.steps} steps each, {args.threads} torch thread(s). Medians leave out "
        "step 1 (warm-up)."
    )
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        print("branchgym bpo ...", flush=True)
        runs["branchgym bpo"] = _bpo(args, f"{tmp}/bpo")
        if have_trl:
            print("TRL BranchingGRPOTrainer ...", flush=True)
            runs["TRL BranchingGRPOTrainer"] = _trl(args, f"{tmp}/trl")
        else:
            note = (
                "TRL is not installed (`pip install 'branchgym[trl]'`): only branchgym's "
                "bpo was timed."
            )
            report.add(note)
            print(note)
    rows = [
        [
            name,
            _median(r["step_s"]),
            float(np.mean(r["step_s"][1:] or r["step_s"])),
            _median(r["tokens"]),
            len(r["step_s"]),
        ]
        for name, r in runs.items()
    ]
    print(
        report.table(
            ["trainer", "median step s", "mean step s", "tokens generated / step", "steps"], rows
        )
    )
    if len(runs) == 2:
        ratio = rows[1][1] / rows[0][1]
        line = f"TRL / bpo median step time: {ratio:.2f}x"
        report.add(line)
        print(line)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, r in runs.items():
        ax.plot(range(1, len(r["step_s"]) + 1), r["step_s"], marker="o", label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (s)")
    ax.set_title("Same model, env and trees: step time per trainer")
    ax.legend()
    report.figure(fig, "step_time", "Step time of TRL's trainer on branchgym trees vs bpo")
    report.data = runs
    path = report.save()
    print(f"\nreport: {path}")
    return 0
