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
ratio of their episodes per hour is measured under the same load. Reported: wall
seconds, episodes per hour, env steps, generated tokens, and the engine's prefilled and
prefix-cached tokens of each, and the speed-up.
This study measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--out", default="results", help="report folder")


def _engine_stats(agent) -> dict[str, int]:
    """The agent's engine counters (prefilled, cached tokens, decode steps), if it has one."""
    return dict(getattr(getattr(agent.policy, "engine", None), "stats", None) or {})


def _counted(agent, before: dict[str, int], run: dict[str, float]) -> dict[str, float]:
    """``run`` with the engine counters it added."""
    after = _engine_stats(agent)
    return {**run, **{k: after[k] - before.get(k, 0) for k in after}}


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
    warm = get_protocol(args.protocol).resolve(tasks=1, max_steps=args.max_steps)
    _plain_loop(warm, agent, seed=99)  # loads kernels and caches for both runs
    before = _engine_stats(agent)
    plain = _counted(agent, before, _plain_loop(protocol, agent, seed=0))
    before = _engine_stats(agent)
    with tempfile.TemporaryDirectory(prefix="bench_eval_") as tmp:
        t0 = time.perf_counter()
        summary = run_eval(protocol, agent, Path(tmp) / "run",
                           EvalOptions(max_envs=args.max_envs, progress=False))  # fmt: skip
        seconds = time.perf_counter() - t0
    batched = {
        "seconds": seconds,
        "env_steps": summary["cost"]["env_steps"],
        "tokens": summary["cost"]["generated_tokens"],
    }
    batched = _counted(agent, before, batched)
    n = len(protocol.tasks)
    rows = []
    for label, m in (("plain loop, one episode at a time", plain),
                     (f"branchgym eval, {args.max_envs} envs, lockstep", batched)):  # fmt: skip
        rows.append([label, n, f"{m['seconds']:.1f}", f"{3600 * n / m['seconds']:.0f}",
                     m["env_steps"], m["tokens"], f"{m['tokens'] / m['seconds']:.1f}",
                     m.get("prefill_tokens", "-"), m.get("cached_tokens", "-")])  # fmt: skip
    speedup = plain["seconds"] / batched["seconds"]
    report = Report(args.out, "eval", "branchgym bench eval")
    report.add(
        f"Agent {args.model} (HFEngine, {args.dtype}, {args.max_new_tokens} tokens per action, "
        f"temperature 1) on {protocol.name} ({n} tasks, step cap {protocol.max_steps}); the "
        "same tasks and seeds both ways, after one warm-up episode."
    )
    print(report.table(["run", "episodes", "seconds", "episodes/hour", "env steps",
                        "generated tokens", "tokens/s", "prefilled tokens",
                        "cached tokens"], rows))  # fmt: skip
    line = f"speed-up of branchgym eval over the plain loop: {speedup:.2f}x episodes per hour"
    print(line)
    report.add(line)
    report.data = {"args": vars(args), "plain": plain, "batched": batched, "speedup": speedup}
    print(f"report: {report.save()}")
    return 0
