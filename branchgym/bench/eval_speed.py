"""``branchgym bench eval``: episodes per hour of ``branchgym eval`` against a plain loop.

The same agent (SmolLM2-135M-Instruct by default, through
:class:`~branchgym.agents.engines.hf.HFEngine`) plays the same tasks of a protocol twice:

* **plain loop**: one episode at a time, each through
  :func:`~branchgym.rollout.grow.group_rollouts` with one rollout, the env in-process:
  what a script that evaluates one episode after another does;
* **branchgym eval**: :func:`~branchgym.evaluation.runner.run_eval` with ``--max-envs``
  episodes alive, one batched generation per turn for all of them and the envs on
  threads, episodes and tree files written as they end.

Both run after one warm-up episode, in the same process, one after the other, so the
ratio of their episodes per hour is measured under the same load. Each timed run starts
from an empty prefix cache (what the run before it left there would otherwise hand it
the same tasks' first prompts for free). ``--repeats R`` measures R pairs, the order
alternating (plain first, then batched first), so a drift in the machine's speed or an
order effect shows up as a spread of the R ratios rather than in one of them; the
report gives every pair's ratio and their median. Reported: wall seconds, episodes per
hour, env steps, generated tokens, and the engine's prefilled and prefix-cached tokens
of each run, and the speed-ups. ``--linear mkl`` runs both ways with PyTorch's default
float32 linear layers instead of the engine's oneDNN ones
(:mod:`branchgym.agents.engines.linear`), to see what that choice is worth on a machine.
This study measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from branchgym.bench.common import Report, positive_int

__all__ = ["configure", "main"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of ``branchgym bench eval``."""
    parser.add_argument("--model", default="smollm2", help="the agent (smollm2)")
    parser.add_argument("--protocol", default="webshop-test", help="the protocol (webshop-test)")
    parser.add_argument("--tasks", type=positive_int, default=16, help="tasks (16)")
    parser.add_argument(
        "--max-envs", type=positive_int, default=16, help="live episodes of the batched run (16)"
    )
    parser.add_argument(
        "--max-new-tokens", type=positive_int, default=32, help="tokens per action (32)"
    )
    parser.add_argument(
        "--max-steps", type=positive_int, default=None, help="step cap (the protocol's)"
    )
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32",
        help="the model's weight type (float32)",
    )  # fmt: skip
    parser.add_argument(
        "--linear", choices=("onednn", "mkl"), default="onednn",
        help="float32 linear layers on oneDNN (the engine's default) or MKL (PyTorch's)",
    )  # fmt: skip
    parser.add_argument(
        "--repeats", type=positive_int, default=1,
        help="pairs of runs, the order alternating; the report gives each ratio and the median (1)",
    )  # fmt: skip
    parser.add_argument("--out", default="results", help="report folder")


def _engine_stats(agent) -> dict[str, int]:
    """The agent's engine counters (prefilled, cached tokens, decode steps), if it has one."""
    return dict(getattr(getattr(agent.policy, "engine", None), "stats", None) or {})


def _counted(agent, before: dict[str, int], run: dict[str, float]) -> dict[str, float]:
    """``run`` with the engine counters it added."""
    after = _engine_stats(agent)
    return {**run, **{k: after[k] - before.get(k, 0) for k in after}}


def _cold(agent) -> dict[str, int]:
    """Empty the agent's prefix cache (if it has an engine); its counters before the run."""
    engine = getattr(agent.policy, "engine", None)
    if engine is not None and hasattr(engine, "clear_cache"):
        engine.clear_cache()
    return _engine_stats(agent)


def _plain_loop(protocol, agent, seed: int) -> dict[str, float]:
    import numpy as np

    from branchgym.rollout.executor_base import EnvRecipe
    from branchgym.rollout.grow import group_rollouts

    recipe = EnvRecipe(protocol.env_id, dict(protocol.env_kwargs))
    steps = tokens = 0
    t0 = time.perf_counter()
    for i, task in enumerate(protocol.tasks):
        tree = group_rollouts(
            recipe,
            agent.policy,
            1,
            seed=task.seed,
            options=task.options or None,
            max_steps=protocol.max_steps,
            rng=np.random.default_rng([seed, i, 0]),
        )
        steps += len(tree.nodes)
        tokens += int(sum(n.token_ids.size for n in tree.nodes))
    return {"seconds": time.perf_counter() - t0, "env_steps": steps, "tokens": tokens}


def main(args: argparse.Namespace) -> int:
    """Run both ways and write ``eval.md``."""
    from branchgym.evaluation.agents import make_agent
    from branchgym.evaluation.protocols import get_protocol
    from branchgym.evaluation.runner import EvalOptions, run_eval

    protocol = get_protocol(args.protocol).resolve(tasks=args.tasks, max_steps=args.max_steps)
    agent = make_agent(args.model, protocol.env_id, max_new_tokens=args.max_new_tokens,
                       threads=args.threads, policy="generate",  # batched decoding
                       dtype=args.dtype)  # fmt: skip
    engine = getattr(agent.policy, "engine", None)
    if engine is not None and hasattr(engine, "onednn_linear"):
        engine.onednn_linear = args.linear == "onednn"
    warm = get_protocol(args.protocol).resolve(tasks=1, max_steps=args.max_steps)
    _plain_loop(warm, agent, seed=99)  # loads kernels and caches for both runs

    def plain_run() -> dict[str, float]:
        before = _cold(agent)
        return _counted(agent, before, _plain_loop(protocol, agent, seed=0))

    def batched_run() -> dict[str, float]:
        before = _cold(agent)
        with tempfile.TemporaryDirectory(prefix="bench_eval_") as tmp:
            t0 = time.perf_counter()
            summary = run_eval(protocol, agent, Path(tmp) / "run",
                               EvalOptions(max_envs=args.max_envs, progress=False))  # fmt: skip
            seconds = time.perf_counter() - t0
        run = {"seconds": seconds, "env_steps": summary["cost"]["env_steps"],
               "tokens": summary["cost"]["generated_tokens"]}  # fmt: skip
        return _counted(agent, before, run)

    pairs = []
    for i in range(args.repeats):  # plain first in even pairs, batched first in odd ones
        if i % 2 == 0:
            plain = plain_run()
            batched = batched_run()
        else:
            batched = batched_run()
            plain = plain_run()
        order = "batched first" if i % 2 else "plain first"
        ratio = plain["seconds"] / batched["seconds"]
        pairs.append({"plain": plain, "batched": batched, "order": order, "speedup": ratio})
    n = len(protocol.tasks)
    rows = []
    batched_label = f"branchgym eval, {args.max_envs} envs, lockstep"
    for i, pair in enumerate(pairs, 1):
        for label, m in (("plain loop, one episode at a time", pair["plain"]),
                         (batched_label, pair["batched"])):  # fmt: skip
            rows.append([f"{i} ({pair['order']})", label, n, f"{m['seconds']:.1f}",
                         f"{3600 * n / m['seconds']:.0f}", m["env_steps"], m["tokens"],
                         f"{m['tokens'] / m['seconds']:.1f}", m.get("prefill_tokens", "-"),
                         m.get("cached_tokens", "-")])  # fmt: skip
    ratios = [pair["speedup"] for pair in pairs]
    speedup = statistics.median(ratios)
    report = Report(args.out, "eval", "branchgym bench eval")
    report.add(
        f"Agent {args.model} (HFEngine, {args.dtype}, linear layers on {args.linear}, "
        f"{args.max_new_tokens} tokens per action, "
        f"temperature 1) on {protocol.name} ({n} tasks, step cap {protocol.max_steps}); the "
        "same tasks and seeds both ways, after one warm-up episode, each run from an empty "
        "prefix cache."
    )
    print(report.table(["pair", "run", "episodes", "seconds", "episodes/hour", "env steps",
                        "generated tokens", "tokens/s", "prefilled tokens",
                        "cached tokens"], rows))  # fmt: skip
    each = ", ".join(f"{r:.2f}x" for r in ratios)
    line = f"speed-up of branchgym eval over the plain loop: {speedup:.2f}x episodes per hour"
    if len(ratios) > 1:
        line += f" (median of {len(ratios)} pairs: {each})"
    print(line)
    report.add(line)
    report.data = {"args": vars(args), "pairs": pairs, "ratios": ratios, "speedup": speedup,
                   "plain": pairs[0]["plain"], "batched": pairs[0]["batched"]}  # fmt: skip
    print(f"report: {report.save()}")
    return 0
