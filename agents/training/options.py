"""Learner options: :class:`TrainArgs` and reading Args dataclasses from the CLI or JSON.

* :class:`TrainArgs`: the options every learner has (env, model, policy, optimiser,
  schedule, batch, checkpoints), each with a docstring; learners subclass it.
* :func:`args_from_dict`: build an Args dataclass from strings (CLI) or JSON values,
  converting each to its field's type; :func:`field_docs` reads the field docstrings
  (``--options``).
* :func:`require`, :func:`require_one_of`: argument checks that raise
  :class:`~branchgym.error.TrainingConfigError` with a message that says the fix.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import math
import textwrap
import types
import typing
from typing import Any

from branchgym.agents.training.lr_schedules import LR_SCHEDULES
from branchgym.agents.training.sinks import LOG_SINKS
from branchgym.error import TrainingConfigError

__all__ = ["POLICY_NAMES", "TrainArgs", "args_from_dict", "field_docs", "require", "require_one_of"]

#: The ``--policy`` kinds, as :data:`~branchgym.agents.training.policy_kinds.POLICIES`
#: registers them (named here, below the kinds, so options can be checked before a model
#: loads; a test keeps the two equal).
POLICY_NAMES = ("generate", "scoring")


@dataclasses.dataclass
class TrainArgs:
    """Options every learner shares. Learners subclass this with their own fields."""

    env_id: str = "branchgym/TextTreeMDP-v0"
    """Environment id. The sources train on WebShop, ALFWorld and SWE-bench; TextTreeMDP
    (a maze with exact values) is the CI-sized task."""
    env_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of ``gym.make`` (e.g. ``{"depth": 3, "reward_kind": "bernoulli"}``)."""
    model: str = "tiny"
    """``tiny`` (random Qwen2, offline), ``smollm2`` (SmolLM2-135M-Instruct), a Hugging Face
    Hub id read from the local Hub cache, never downloaded (``Qwen/Qwen2.5-7B-Instruct``,
    ``org/name@revision``), or a model folder (``save_pretrained``; an SFT checkpoint)."""
    policy: str = "auto"
    """``generate`` (free generation, parsed ReAct replies), ``scoring`` (softmax over the
    admissible actions' sequence log-probs, for tiny models) or ``auto`` (scoring for the
    ``tiny`` model, generate otherwise)."""
    seed: int = 0
    """Seed of prompts, sampling and the schedule; each step's randomness derives from
    ``(seed, step)``, which makes resuming exact."""
    steps: int = 100
    """Rollout batches (each followed by ``updates_per_batch`` optimizer updates)."""
    max_env_steps: int = 0
    """Stop after the step at which the run's environment steps (``env/steps`` summed over
    its steps, a resumed run's included) reach this budget (0: no budget, ``steps``
    decides): how learners with different rollout shapes are compared at matched env
    steps. ``steps`` still caps the run and sets the LR schedule's length."""
    prompts_per_step: int = 128
    """Prompts (task instances, reset seeds) per rollout batch (128 in the BPO source)."""
    lr: float = 2e-6
    """AdamW learning rate (BPO source: 2e-6; Bellman PO: 1e-6)."""
    lr_schedule: str = "cosine"
    """A key of :data:`LR_SCHEDULES`: ``cosine`` (BPO source), ``constant`` (Bellman PO),
    ``linear``."""
    warmup_steps: int = 0
    """Linear warm-up steps before the schedule."""
    weight_decay: float = 0.01
    """AdamW weight decay (torch's default; Bellman PO's source: 0.1)."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas (Bellman PO's source: (0.9, 0.98))."""
    grad_clip: float = 1.0
    """Clip the gradient's global norm to this (0: no clipping; Bellman PO: 1.0)."""
    updates_per_batch: int = 1
    """Optimizer updates per rollout batch: the rows are split into this many mini-batches
    (whole groups each), cycled when there are fewer groups than updates."""
    micro_batch_rows: int = 0
    """Rows per forward/backward pass inside an update (gradient accumulation; 0: all)."""
    max_new_tokens: int = 48
    """Tokens per generated action (``generate`` policy)."""
    scoring_template: str = "Action: {action}"
    """How the ``scoring`` policy writes an admissible action as a reply."""
    max_episode_steps: int | None = None
    """Truncate rollouts after this many decisions (default: the env's time limit, else 100)."""
    success_threshold: float = 1.0
    """A rollout succeeds when its env says so (``won``/``success``/``resolved`` in info), else
    when its return reaches this (WebShop's and SWE-bench's success is reward 1)."""
    eval_episodes: int = 0
    """Episodes of the fixed evaluation set, run before training, every ``eval_every``
    steps and at the end (0: no evaluation)."""
    eval_every: int = 0
    """Evaluate every this many steps (0: only at the start and the end)."""
    eval_seed: int = 1_000_000
    """First reset seed of the evaluation set (episode i uses eval_seed + i; the policy's
    sampling is seeded the same way, so evaluations are paired)."""
    out_dir: str | None = None
    """Where metrics.jsonl, checkpoints and curves.png go (default: runs/<algo>-<env>-<seed>)."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (0: only at the end)."""
    keep_checkpoints: int = 0
    """Keep only the newest this many ``checkpoint-NNNNNN`` folders, deleting older ones once
    a newer one is whole on disk (0: keep every one). A SmolLM2 checkpoint with optimizer,
    float32 masters and reference model is about 2.4 GB: a run that checkpoints every step
    fills a disk otherwise. Crash checkpoints are never deleted."""
    keep_checkpoint_every: int = 0
    """With ``keep_checkpoints``, also keep every checkpoint whose step is a multiple of
    this (0: none): the points of a learning curve, evaluated after the run (the curve
    stage of ``scripts/reference_results.py``)."""
    save_trees_every: int = 0
    """Save the step's rollout trees with the advantages the update used every this many
    steps, to ``trees/step_NNNNNN.json.gz`` next to metrics.jsonl (0: never); read them
    with ``branchgym view`` or :func:`branchgym.tree_format.load_trees`."""
    resume: str | None = None
    """A checkpoint folder to resume from, exactly (weights, optimizer, scheduler, step)."""
    overwrite: bool = False
    """Start a new run in an ``out_dir`` that already holds one (its metrics are replaced)."""
    device: str = "auto"
    """``auto`` (CUDA when present), ``cpu`` or ``cuda``."""
    precision: str = "auto"
    """``auto``: float32 weights, bfloat16 autocast on CUDA; ``fp32``: float32 everywhere;
    ``bf16``: bfloat16 weights and gradients, with float32 master weights and AdamW state
    for what trains (LoRA adapters stay float32) (docs/learners.md, Memory)."""
    lora_rank: int = 0
    """LoRA rank through ``peft`` (0: train every weight). With LoRA only the adapters
    train and are saved, and the KL reference is the base model with the adapters off."""
    lora_alpha: float = 32.0
    """LoRA scale numerator (the update is ``alpha / rank * B A``)."""
    lora_targets: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    """Module names that get LoRA adapters (comma-separated on the CLI)."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in backward instead of keeping them (the training
    forward runs in train mode with dropout off; sampling stays in eval mode)."""
    micro_batch_tokens: int = 0
    """Token budget of one forward/backward pass inside an update (0: ``micro_batch_rows``
    decides). Chunks may split a prompt group; the chunk weights keep the accumulated
    gradient equal to one pass (Bellman PO, whose loss reads whole groups, cuts at groups)."""
    pack_trees: bool = True
    """Tree packing: the rows of one rollout tree (a group's independent rollouts are one
    tree whose root is the prompt) go through one packed sequence, so the prefix they
    share is read once per forward pass (policy, reference, teacher), not once per row.
    Exact, so on by default; a tree whose rows share too little keeps its rows, and a
    model that ignores 4-D masks (flash attention, sliding windows) turns it off."""
    save_optimizer: bool = True
    """Save the optimizer state in checkpoints (needed to resume exactly; off: weights,
    or adapters, only)."""
    threads: int | None = None
    """torch CPU threads (one is fastest for tiny models on a shared CPU)."""
    executor: str = "inprocess"
    """Where sandboxes run: ``inprocess``, ``thread``, ``process`` or ``ray``."""
    executor_workers: int = 4
    """Threads (``thread``), worker processes (``process``) or actors (``ray``) of the
    executor: how many env calls of a merged batch run at once (``inprocess``: one)."""
    batch_rollouts: bool = True
    """Grow the step's trees (groups) in lockstep (:mod:`branchgym.rollout.batch`): one
    policy call per turn for every prompt's backbone and every branch point's siblings,
    and one executor call per kind for all their envs. False grows them one after another
    (the same trees; docs/engine.md, Batched rollouts)."""
    timeout: float = 600.0
    """Seconds one sandbox call (reset, step, snapshot, restore) may take; a call past it
    ends that rollout, recorded as an error (the executor's per-call timeout)."""
    progress: bool = True
    """Show a tqdm progress bar."""
    log: tuple[str, ...] = ("jsonl",)
    """Metrics sinks, comma-separated: ``jsonl`` (``metrics.jsonl``, always written),
    ``tensorboard`` (event files in ``out_dir/tensorboard``), ``wandb`` (a W&B run in
    ``out_dir/wandb``, offline unless ``WANDB_MODE`` is set); the options are recorded as
    hparams / config (agents/training/sinks.py; extra ``logging``)."""
    engine: str = "hf"
    """Generation engine: ``hf`` (transformers, in this process) or ``vllm`` (a vLLM worker
    process, prefix caching on, a branch point's siblings as one request; the weights are
    synced into it after every update; docs/engine.md, Training with vLLM)."""
    vllm_python: str | None = None
    """Python of the environment with vLLM for ``engine=vllm`` (default: this one when it
    imports vllm, else the project's ``.venv-vllm/bin/python``)."""
    vllm_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of ``vllm.LLM`` for ``engine=vllm`` (``max_model_len``,
    ``gpu_memory_utilization``, ``dtype``...)."""
    vllm_logprobs: str = "recompute"
    """With ``engine=vllm``: ``recompute`` (the trainer recomputes the behaviour log-probs
    of the sampled tokens; the PPO ratio starts at exactly 1) or ``tis`` (the same, and each
    token's advantage is weighted by the truncated importance weight ``min(pi_trainer /
    mu_vllm, tis_cap)``). Either way ``vllm/ratio_absdev`` logs the mismatch each step."""
    tis_cap: float = 2.0
    """Cap C of the truncated importance weight (``vllm_logprobs=tis``)."""
    distributed: str = "auto"
    """Data parallel over torch.distributed (:mod:`~branchgym.agents.training.distributed`):
    ``auto`` (on when launched by ``torchrun`` with ``WORLD_SIZE > 1``: each rank grows its
    share of a step's prompts, gradients are summed over ranks, checkpoints are sharded),
    ``ddp`` (the same, an error without torchrun) or ``off`` (every rank trains alone)."""

    def check(self) -> None:
        """Raise :class:`TrainingConfigError` for an option out of range (subclasses extend)."""
        positive = ("steps", "prompts_per_step", "updates_per_batch", "max_new_tokens")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TrainingConfigError(f"{name} must be an integer >= 1; got {value!r}.")
        for name in (
            "micro_batch_rows",
            "micro_batch_tokens",
            "lora_rank",
            "warmup_steps",
            "eval_episodes",
            "eval_every",
            "save_trees_every",
            "max_env_steps",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TrainingConfigError(f"{name} must be an integer >= 0; got {value!r}.")
        require(
            isinstance(self.executor_workers, int)
            and not isinstance(self.executor_workers, bool)
            and self.executor_workers >= 1,
            f"executor_workers must be an integer >= 1; got {self.executor_workers!r}.",
        )
        for name in ("lr", "timeout"):
            value = getattr(self, name)
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            require(
                ok and math.isfinite(value) and value > 0,
                f"{name} must be a finite number > 0; got {value!r}.",
            )
        require(
            isinstance(self.seed, int) and not isinstance(self.seed, bool) and self.seed >= 0,
            f"seed must be an integer >= 0; got {self.seed!r}.",
        )
        mes = self.max_episode_steps
        require(
            mes is None or (isinstance(mes, int) and not isinstance(mes, bool) and mes >= 1),
            f"max_episode_steps must be an integer >= 1 (or left out); got {mes!r}.",
        )
        require(
            isinstance(self.success_threshold, int | float)
            and math.isfinite(self.success_threshold),
            f"success_threshold must be a finite number; got {self.success_threshold!r}.",
        )
        require(self.weight_decay >= 0, f"weight_decay must be >= 0; got {self.weight_decay}.")
        require(self.grad_clip >= 0, f"grad_clip must be >= 0 (0: off); got {self.grad_clip}.")
        require(
            len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas),
            f"adam_betas must be two numbers in [0, 1); got {self.adam_betas}.",
        )
        require_one_of("policy", self.policy, ("auto", *POLICY_NAMES))
        require_one_of("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        require_one_of("device", self.device, ("auto", "cpu", "cuda"))
        require_one_of("precision", self.precision, ("auto", "fp32", "bf16"))
        require(
            not (self.micro_batch_rows and self.micro_batch_tokens),
            "set one of micro_batch_rows and micro_batch_tokens (the other 0).",
        )
        if self.lora_rank:
            require(self.lora_alpha > 0, f"lora_alpha must be > 0; got {self.lora_alpha}.")
            require(
                bool(self.lora_targets) and all(isinstance(t, str) for t in self.lora_targets),
                "lora_targets must name modules, e.g. q_proj,v_proj.",
            )
        if isinstance(self.log, str):  # from Python: "jsonl,tensorboard"
            self.log = tuple(x.strip() for x in self.log.split(",") if x.strip())
        for name in self.log:
            require_one_of("log", name, LOG_SINKS)
        require_one_of("distributed", self.distributed, ("auto", "off", "ddp"))
        require_one_of("engine", self.engine, ("hf", "vllm"))
        require_one_of("vllm_logprobs", self.vllm_logprobs, ("recompute", "tis"))
        require(
            isinstance(self.tis_cap, int | float)
            and math.isfinite(self.tis_cap)
            and self.tis_cap >= 1,
            f"tis_cap must be a finite number >= 1; got {self.tis_cap!r}.",
        )
        require(
            isinstance(self.vllm_options, dict),
            f"vllm_options must be a dict of vllm.LLM keywords; got {self.vllm_options!r}.",
        )
        if not isinstance(self.env_kwargs, dict):
            raise TrainingConfigError(
                f"env_kwargs must be a dict of gym.make keywords; got {self.env_kwargs!r}."
            )


def require(ok: bool, message: str) -> None:
    """Raise :class:`TrainingConfigError` with ``message`` unless ``ok`` (argument checks)."""
    if not ok:
        raise TrainingConfigError(message)


def require_one_of(name: str, value: Any, options: Any) -> None:
    """Raise :class:`TrainingConfigError` unless ``value`` is in ``options`` (names the closest)."""
    if value not in options:
        close = difflib.get_close_matches(str(value), [str(o) for o in options], n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise TrainingConfigError(
            f"{name} must be one of {', '.join(map(str, options))}; got {value!r}.{hint}"
        )


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each dataclass field (CleanRL style), through the class's bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # pragma: no cover - classes built at run time
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, nxt in zip(body, [*body[1:], None], strict=True):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _coerce(value: Any, hint: Any, name: str) -> Any:
    """Convert a CLI string (or a JSON value) to the field's type."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        non_none = [a for a in args if a is not type(None)]
        return _coerce(value, non_none[0], name)
    if not isinstance(value, str):
        if origin is tuple and isinstance(value, list):
            return tuple(value)
        return value
    try:
        if hint is bool:
            low = value.lower()
            if low not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return low in ("true", "1", "yes")
        if hint in (int, float, str):
            return hint(value)
        if origin in (dict, tuple, list):
            parsed = json.loads(value) if value.strip()[:1] in "[{" else value.split(",")
            if origin is tuple:
                inner = [a for a in args if a is not Ellipsis] or [str]
                return tuple(
                    _coerce(v, inner[min(i, len(inner) - 1)], name) for i, v in enumerate(parsed)
                )
            return parsed
    except (ValueError, json.JSONDecodeError) as exc:
        raise TrainingConfigError(
            f"option {name}: cannot read {value!r} as {getattr(hint, '__name__', hint)}."
        ) from exc
    return value


def args_from_dict(cls: type, values: dict[str, Any]) -> Any:
    """Build ``cls`` (an Args dataclass) from a dict, converting strings to the field types.

    Unknown names raise :class:`TrainingConfigError` with the closest option; the result
    has been :meth:`TrainArgs.check`-ed.
    """
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in names:
            close = difflib.get_close_matches(name, names, n=2)
            hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise TrainingConfigError(
                f"{cls.__module__.rsplit('.', 1)[-1]} has no option {key!r}.{hint} "
                "`branchgym train --algo ALGO --options` lists them."
            )
        kwargs[name] = _coerce(value, hints[name], name)
    try:
        args = cls(**kwargs)
    except TypeError as exc:  # pragma: no cover - guarded by the name check above
        raise TrainingConfigError(str(exc)) from exc
    args.check()
    return args
