r"""``branchgym train``: run any reference learner from the command line or from Python.

::

    branchgym train --algo bpo --env branchgym/TextTreeMDP-v0 --model tiny \
        --env-kwargs '{"depth": 3, "reward_kind": "bernoulli"}' --steps 20 \
        --set prompts_per_step=4 lr=1e-4 gap_unit=steps
    branchgym train --algo bpo --options          # every option of a learner, with its doc
    branchgym train --algo bpo --model Qwen/Qwen2.5-7B-Instruct --dry-run \
        --set lora_rank=16 precision=bf16 gradient_checkpointing=true   # memory plan

``train(algo, **options)`` is the same from Python. :data:`LEARNERS` maps each
algorithm name to its module, its ``Args`` class and entry point, and the options it
fixes (``rloo`` is GRPO's loop with the leave-one-out baseline).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import json
import os
import sys
import typing
from typing import Any

from branchgym.error import CheckpointError, Error, TrainingConfigError

__all__ = ["LEARNERS", "Learner", "configure", "learner", "main", "make_args", "run", "train"]


@dataclasses.dataclass(frozen=True)
class Learner:
    """One ``--algo`` choice.

    Attributes:
        module: The learner's module.
        args: Name of its Args class.
        main: Name of its entry point ``main(args, algo)``.
        fixed: Options this algorithm name sets (e.g. ``advantage="rloo"``).
        summary: One line for ``--help``.
    """

    module: str
    args: str = "Args"
    main: str = "main"
    fixed: tuple[tuple[str, Any], ...] = ()
    summary: str = ""

    def load(self) -> tuple[type, Any]:
        """Import the module: ``(Args class, main function)``."""
        mod = importlib.import_module(self.module)
        return getattr(mod, self.args), getattr(mod, self.main)


#: ``--algo`` name -> learner.
LEARNERS: dict[str, Learner] = {
    "bpo": Learner("branchgym.agents.learners.bpo", summary="Branching PO (algorithms.md §1)"),
    "grpo": Learner(
        "branchgym.agents.learners.grpo",
        fixed=(("advantage", "grpo"),),
        summary="GRPO baseline (§4)",
    ),
    "rloo": Learner(
        "branchgym.agents.learners.grpo",
        fixed=(("advantage", "rloo"),),
        summary="RLOO baseline (§4)",
    ),
    "bellman_po": Learner("branchgym.agents.learners.bellman_po", summary="Bellman PO (§3)"),
    "branch_opd": Learner("branchgym.agents.learners.branch_opd", summary="Branching OPD (§2)"),
    "opd": Learner(
        "branchgym.agents.learners.branch_opd",
        args="OPDArgs",
        summary="vanilla on-policy distillation (§2)",
    ),
    "opd_multi": Learner(
        "branchgym.agents.learners.branch_opd",
        args="MultiOPDArgs",
        summary="multi-rollout OPD, n = 7 (§2)",
    ),
    "sft": Learner("branchgym.agents.learners.sft", summary="SFT warm start from scripted experts"),
}


def learner(algo: str) -> Learner:
    """The learner named ``algo`` (a :class:`TrainingConfigError` with the closest names)."""
    if algo not in LEARNERS:
        close = difflib.get_close_matches(str(algo), list(LEARNERS), n=2, cutoff=0.4)
        hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise TrainingConfigError(
            f"no learner is called {algo!r}.{hint} Choose one of: {', '.join(LEARNERS)}."
        )
    return LEARNERS[algo]


def make_args(algo: str, **options: Any) -> Any:
    """The learner's Args from keyword options (strings are converted, names checked)."""
    from branchgym.agents.training.run import args_from_dict

    spec = learner(algo)
    cls, _ = spec.load()
    fixed = dict(spec.fixed)
    for key, value in fixed.items():
        if key in options and options[key] != value:
            raise TrainingConfigError(
                f"--algo {algo} fixes {key}={value!r}; drop {key}={options[key]!r} or choose "
                "the other algorithm."
            )
    return args_from_dict(cls, {**options, **fixed})


def train(algo: str, **options: Any) -> Any:
    """Run learner ``algo`` with ``options`` (its Args fields); returns its ``TrainResult``.

    With ``resume=<checkpoint>``, the checkpoint's options are the defaults and the given
    ones override them.
    """
    from branchgym.agents.training.run import load_checkpoint_state

    if options.get("resume"):
        state = load_checkpoint_state(options["resume"])
        if state.get("algo") != algo:
            raise CheckpointError(
                f"{options['resume']} is a {state.get('algo')!r} checkpoint; resume it with "
                f"--algo {state.get('algo')} (or start {algo} from its weights with --model)."
            )
        saved = {k: v for k, v in state["args"].items() if k != "resume"}
        options = {**saved, **options}
    args = make_args(algo, **options)
    _, main = learner(algo).load()
    return main(args, algo)


# ------------------------------------------------------------------------ CLI


def configure(p: argparse.ArgumentParser) -> None:
    """Options of ``branchgym train`` (learner-specific ones go through ``--set``)."""
    p.add_argument("--algo", required=True, help=f"learner: {', '.join(LEARNERS)}")
    p.add_argument("--env", dest="env_id", default=None, help="env id (TextTreeMDP by default)")
    p.add_argument("--env-kwargs", default=None, help="JSON dict of gym.make keywords")
    p.add_argument(
        "--model", default=None, help="tiny | smollm2 | a Hub id in the HF cache | a model folder"
    )
    p.add_argument("--policy", default=None, help="generate | scoring | auto")
    p.add_argument("--steps", type=int, default=None, help="rollout batches")
    p.add_argument("--prompts", dest="prompts_per_step", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--out", dest="out_dir", default=None, help="run folder (metrics, checkpoints)")
    p.add_argument("--resume", default=None, help="checkpoint folder to resume exactly")
    p.add_argument("--device", default=None, help="auto | cpu | cuda")
    p.add_argument("--teacher", default=None, help="OPD teacher model folder")
    p.add_argument(
        "--log",
        default=None,
        metavar="SINKS",
        help="metrics sinks, comma-separated: jsonl,tensorboard,wandb (metrics.jsonl is "
        "always written; W&B runs offline unless WANDB_MODE is set)",
    )
    p.add_argument(
        "--set",
        dest="options",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="any other option of the learner (see --options), e.g. --set lam=0.9 tail=zero",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the memory plan of these options (weights, reference, gradients, "
        "optimizer, activations) for the model's config, and exit without training",
    )
    p.add_argument(
        "--options",
        dest="list_options",
        action="store_true",
        help="list the learner's options, defaults and docs, and exit",
    )


def _options_table(algo: str) -> str:
    from branchgym.agents.training.run import field_docs

    cls, _ = learner(algo).load()
    docs = field_docs(cls)
    fixed = dict(learner(algo).fixed)
    hints = typing.get_type_hints(cls)
    lines = [f"options of {algo} ({cls.__module__}.{cls.__name__}):"]
    defaults = cls()
    for f in dataclasses.fields(cls):
        value = fixed.get(f.name, getattr(defaults, f.name))
        kind = getattr(hints[f.name], "__name__", str(hints[f.name]))
        lines.append(f"  {f.name} ({kind}) = {value!r}")
        if f.name in docs:
            lines.append(f"      {docs[f.name]}")
    return "\n".join(lines)


def run(ns: argparse.Namespace) -> int:
    """Entry point of ``branchgym train``."""
    algo = ns.algo
    learner(algo)  # a typed error before anything loads
    if ns.list_options:
        print(_options_table(algo))
        return 0
    options: dict[str, Any] = {}
    for name in (
        "env_id",
        "model",
        "policy",
        "steps",
        "prompts_per_step",
        "lr",
        "seed",
        "out_dir",
        "resume",
        "device",
        "teacher",
        "log",
    ):
        value = getattr(ns, name)
        if value is not None:
            options[name] = value
    if ns.env_kwargs is not None:
        try:
            options["env_kwargs"] = json.loads(ns.env_kwargs)
        except json.JSONDecodeError as exc:
            raise TrainingConfigError(
                f"--env-kwargs must be a JSON object, e.g. '{{\"depth\": 3}}'; got "
                f"{ns.env_kwargs!r} ({exc.msg})."
            ) from exc
    for item in ns.options:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise TrainingConfigError(f"--set takes KEY=VALUE pairs; got {item!r}.")
        options[key.strip().replace("-", "_")] = value
    if ns.no_progress:
        options["progress"] = False
    if getattr(ns, "dry_run", False):
        from branchgym.agents.training.memory import plan_for_args

        args = make_args(algo, **options)
        reference = float(getattr(args, "beta", 0) or 0) > 0
        print(plan_for_args(args, reference=reference).table())
        return 0
    result = train(algo, **options)
    if os.environ.get("RANK", "0") != "0":  # data parallel: rank 0 reports for the run
        return 0
    print(f"branchgym train {algo}: {result.out_dir}", file=sys.stderr)
    last = next((h for h in reversed(result.history) if "charts/success" in h), None)
    summary = {"out_dir": str(result.out_dir), "checkpoint": str(result.checkpoint)}
    if last is not None:
        summary.update({k: last[k] for k in ("step", "charts/success", "charts/return")})
    for name, ev in (("eval_start", result.eval_start), ("eval_end", result.eval_end)):
        if ev is not None:
            summary[name] = ev.metrics()
    print(json.dumps(summary, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m branchgym.agents.train ARGS`` (e.g. under torchrun): ``branchgym train ARGS``."""
    parser = argparse.ArgumentParser(
        prog="branchgym train", description="train a reference learner"
    )
    configure(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except Error as exc:  # as ``branchgym train`` reports it
        print(f"branchgym train: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
