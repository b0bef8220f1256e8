"""How a training run is set up: model, engine, policy, envs, optimiser, output folder.

:class:`RunSetup` holds the set-up steps of :class:`~branchgym.agents.training.run.Run`,
each a method that sets the attributes it documents; ``Run.__init__`` calls them in order
(the order is part of the behaviour: ``torch.manual_seed`` before the model loads and
LoRA draws its initial weights, the checkpoint loaded once the optimizer and output
folder exist). Also :func:`quiet_transformers` and :class:`Autocast`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from branchgym.agents.forward.packed import (
    packing_exact,
)
from branchgym.agents.forward.rows import (
    Batch,
)
from branchgym.agents.training.checkpoints import (
    load_checkpoint_state,
)
from branchgym.agents.training.distributed import (
    DataParallel,
    data_parallel,
)
from branchgym.agents.training.evaluation import EvalResult
from branchgym.agents.training.lr_schedules import LR_SCHEDULES
from branchgym.agents.training.memory import MasterWeights
from branchgym.agents.training.metrics import (
    RunningStats,
)
from branchgym.agents.training.options import (
    TrainArgs,
)
from branchgym.agents.training.policy_kinds import POLICIES, resolve_policy
from branchgym.agents.training.sinks import Sinks, open_sinks
from branchgym.error import CheckpointError, DependencyMissingError, TrainingConfigError
from branchgym.rollout.executor_base import EnvRecipe
from branchgym.rollout.executors import make_executor

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra(
        "branchgym.agents.training.setup", "llm", "torch"
    ) from exc


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """No transformers progress bars while loading and saving (the run has its own)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


class Autocast:
    """A policy wrapper that samples under the run's autocast context (bf16 on CUDA)."""

    def __init__(self, policy: Any, ctx: Callable[[], Any]) -> None:
        self.policy, self.ctx = policy, ctx

    def act(self, requests: Any, rng: np.random.Generator) -> Any:
        """The wrapped policy's ``act``, under the autocast context."""
        with self.ctx():
            return self.policy.act(requests, rng)


class RunSetup:
    """Set-up steps of :class:`~branchgym.agents.training.run.Run` (its ``__init__`` calls them)."""

    # ---------------------------------------------------------------- set-up steps
    def _place(self, args: TrainArgs) -> None:
        """This process's data parallel place, and the settings it rules out."""
        #: Data parallel place (rank 0 of 1 unless launched by torchrun; distributed.py).
        self.dp: DataParallel = data_parallel(args.distributed, args.device)
        if self.dp.active and args.precision == "bf16":
            raise TrainingConfigError(
                "precision=bf16 keeps float32 master weights outside the model, which the "
                "sharded checkpoints of data parallel runs do not hold yet; under torchrun use "
                "precision=auto (float32 weights, bf16 autocast on CUDA)."
            )
        if self.dp.active and args.prompts_per_step < self.dp.world:
            raise TrainingConfigError(
                f"prompts_per_step={args.prompts_per_step} leaves some of the {self.dp.world} "
                "data parallel ranks without a prompt; give at least one prompt per rank."
            )

    def _read_checkpoint(self, args: TrainArgs, algo: str) -> dict[str, Any] | None:
        """The state of the checkpoint ``args.resume`` names (None: a fresh run).

        Checked against this run's learner and data parallel world.
        """
        resume = load_checkpoint_state(args.resume) if args.resume else None
        sharded = bool(resume and resume.get("sharded"))
        if sharded and int(resume.get("world_size", 1)) != self.dp.world:
            raise CheckpointError(
                f"{args.resume} was written by {resume.get('world_size')} data parallel ranks; "
                f"resume it with torchrun --nproc-per-node {resume.get('world_size')}."
            )
        if resume is not None and resume.get("algo") != algo:
            raise CheckpointError(
                f"{args.resume} is a {resume.get('algo')!r} checkpoint; resume it with "
                f"--algo {resume.get('algo')} (or start {algo} from its weights with --model)."
            )
        return resume

    def _pick_device(self, args: TrainArgs) -> None:
        """``device`` and ``bf16`` (autocast), then torch's seed.

        Every weight drawn after the seed (LoRA's initial adapters) follows ``args.seed``.
        """
        if args.device == "cuda" and not torch.cuda.is_available():
            raise TrainingConfigError("device='cuda' but torch sees no GPU; use device='cpu'.")
        use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        self.device = torch.device("cuda" if use_cuda else "cpu")
        self.bf16 = self.device.type == "cuda" and args.precision == "auto"
        torch.manual_seed(args.seed)

    def _build_model(self, args: TrainArgs, *, sharded: bool) -> None:
        """``tokenizer``, ``engine`` and ``model``, with their precision, LoRA and engine.

        The weights at ``param_dtype``, with gradient checkpointing and LoRA as asked,
        sampling in a vLLM worker if asked.
        """
        from branchgym.agents.engines.hf import HFEngine
        from branchgym.agents.policies.models import add_lora, load_model

        with quiet_transformers():
            # a sharded checkpoint holds no model folder's weights: the base model's
            # architecture, then the shards (_load)
            # with LoRA a checkpoint holds the adapters only: the base model, then them (_load)
            base_only = sharded or bool(args.lora_rank)
            model, tok = load_model(args.model if base_only else (args.resume or args.model))
        # float32 weights (bf16 only as autocast on CUDA), or bf16 ones with float32
        # masters of what trains (precision=bf16, memory.MasterWeights)
        self.param_dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
        model = model.to(self.param_dtype)
        self.dp.broadcast_parameters(model)  # one start for every rank
        self.tokenizer = tok
        self.engine = HFEngine(
            model,
            tok,
            device=str(self.device),
            dtype=self.param_dtype,
            max_new_tokens=args.max_new_tokens,
            threads=args.threads,
        )
        self.model = self.engine.model
        if args.gradient_checkpointing:  # applies in train mode: update() switches to it
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        if args.lora_rank:  # injected into the engine's model too: it samples with them
            self.model = add_lora(
                self.model, rank=args.lora_rank, alpha=args.lora_alpha, targets=args.lora_targets
            )
        if args.engine == "vllm":  # sampling in a vLLM worker, synced after updates
            from branchgym.agents.training.vllm_training import start_worker

            self.engine = start_worker(self)

    def _build_policy(self, args: TrainArgs) -> None:
        """``kind``, ``policy`` and ``behaviour`` (the policy under autocast).

        Tree packing is turned off where it would change log-probs.
        """
        why = packing_exact(self.model) if args.pack_trees else None
        if why:  # packing would change log-probs here: rows are read one by one
            warnings.warn(f"pack_trees is off: {why}.", stacklevel=3)
            args.pack_trees = False
        self.kind = POLICIES[resolve_policy(args.policy, args.model)]
        self.policy = self.kind.make(self.engine, args)
        self.behaviour = Autocast(self.policy, self.autocast) if self.bf16 else self.policy

    def _build_envs(self, args: TrainArgs) -> None:
        """``spec`` (the env recipe, checked by making one env) and the ``executor``."""
        self.spec = EnvRecipe(args.env_id, self._env_kwargs(args.env_kwargs))
        self._check_env()
        sized = {} if args.executor == "inprocess" else {"n_workers": args.executor_workers}
        self.executor = make_executor(args.executor, timeout=args.timeout, **sized)

    def _build_optimizer(self, args: TrainArgs) -> None:
        """``masters`` (precision=bf16), the AdamW ``optimizer`` and its LR ``scheduler``."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.masters = MasterWeights(params) if args.precision == "bf16" else None
        if self.masters is not None:
            params = self.masters.params  # AdamW updates float32 masters
        # the fused kernel (one pass over each tensor, about 3x faster than the per-tensor
        # loop on CPU) where every parameter is a plain float tensor of one device type;
        # sharded (DTensor) parameters keep the default
        plain = all(type(p) is torch.nn.Parameter and p.is_floating_point() for p in params)
        kinds = {p.device.type for p in params}
        fused = plain and not self.dp.active and len(kinds) == 1 and kinds <= {"cpu", "cuda"}
        self.optimizer = torch.optim.AdamW(
            params,
            lr=args.lr,
            betas=tuple(args.adam_betas),
            weight_decay=args.weight_decay,
            fused=fused or None,
        )
        fn = LR_SCHEDULES[args.lr_schedule]
        warm, total = args.warmup_steps, args.steps

        def multiplier(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            return fn(step - warm, max(total - warm, 1))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, multiplier)

    def _build_reference(self, args: TrainArgs, *, needs_ref: bool) -> None:
        """``ref``: the frozen initial model a KL term compares to (None without one)."""
        self.ref = None
        if needs_ref:
            # with LoRA the reference is the base model, adapters off (frozen_logprobs)
            self.ref = self.model if args.lora_rank else self._frozen_copy(self.model)

    def _start_progress(self) -> None:
        """Step 0 and empty history: what a resumed checkpoint (_load) then overwrites."""
        self.step = 0
        self.grad_norm = RunningStats()
        self.history: list[dict[str, float]] = []
        # (step, env steps up to it) of the checkpoint this run resumed from: env steps
        # are counted from there, whichever folder the resumed run logs to
        self.env_base: tuple[int, int] = (0, 0)
        self.eval_start: EvalResult | None = None
        self.eval_end: EvalResult | None = None
        self.last_checkpoint: Path | None = None
        self._pending: dict[str, float] = {}
        self._step_batch: Batch | None = None  # the step's rollout batch (save_trees)
        self._t0 = time.perf_counter()
        self._times: dict[str, float] = {}  # this step's seconds per phase (timed)

    def _open_out_dir(self, args: TrainArgs, algo: str, *, resumed: bool) -> None:
        """``out_dir``, checked writable.

        A fresh run refuses (or, with overwrite, clears) a folder that already holds a
        run's metrics.
        """
        env_name = args.env_id.split("/")[-1]
        self.out_dir = Path(args.out_dir or f"runs/{algo}-{env_name}-{args.seed}")
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            probe = self.out_dir / f".write-test-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise TrainingConfigError(
                f"out_dir {str(self.out_dir)!r} is not a writable folder ({exc.strerror or exc}); "
                "give a folder path this user can write."
            ) from exc
        metrics_file = self.out_dir / "metrics.jsonl"
        if not resumed and metrics_file.is_file() and metrics_file.stat().st_size:
            if not args.overwrite:
                raise TrainingConfigError(
                    f"{self.out_dir} already holds a run (metrics.jsonl); choose another "
                    "out_dir, resume it (resume=<checkpoint>) or set overwrite=true."
                )
            if self.dp.is_main:
                metrics_file.unlink(missing_ok=True)
                self._drop_trees_after(0)
        self.dp.barrier()  # no rank reads the folder while rank 0 clears it

    def _open_sinks(self, args: TrainArgs, algo: str) -> None:
        """``args.json`` and the metric sinks, on rank 0 alone.

        The sinks start at ``self.step``: > 0 when resumed.
        """
        self._metrics: Sinks | None = None  # rank 0 alone writes the run's files
        if self.dp.is_main:
            hparams = {"algo": algo, **dataclasses.asdict(args)}
            (self.out_dir / "args.json").write_text(json.dumps(hparams, indent=2, default=str))
            # metrics.jsonl, and TensorBoard / W&B as args.log asks (agents/training/sinks.py)
            self._metrics = open_sinks(
                args.log,
                self.out_dir,
                hparams,
                name=f"{algo}-{self.out_dir.name}",
                start_step=self.step,  # > 0 when resumed
            )

    # ---------------------------------------------------------------- set-up helpers
    def _env_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        kw = dict(kwargs)
        if self.args.max_episode_steps is not None:
            kw.setdefault("max_episode_steps", int(self.args.max_episode_steps))
        return kw

    def _check_env(self) -> None:
        import gymnasium as gym

        import branchgym

        try:
            gym.spec(self.spec.id)
        except gym.error.Error:
            branchgym.make(self.spec.id)  # raises UnknownEnvError with "did you mean"
        try:
            env = self.spec.make()
        except TypeError as exc:  # an env kwarg the env does not take, or of a wrong type
            raise TrainingConfigError(
                f"env_kwargs {self.args.env_kwargs!r} do not fit {self.spec.id}: {exc}. Use "
                "the names and types of the env's constructor (its docstring lists them)."
            ) from exc
        try:
            if not isinstance(env.action_space, gym.spaces.Text):
                raise TrainingConfigError(
                    f"{self.spec.id} takes {type(env.action_space).__name__} actions; LLM "
                    "learners need text actions (use branchgym/TextTreeMDP-v0 for the maze)."
                )
        finally:
            env.close()

    def _frozen_copy(self, model: Any) -> Any:
        ref = copy.deepcopy(model)
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def load_frozen(self, name: str) -> Any:
        """A frozen model (a teacher) on this run's device; its tokenizer must match."""
        from branchgym.agents.policies.models import load_model

        with quiet_transformers():
            model, tok = load_model(name)
        if tok.get_vocab() != self.tokenizer.get_vocab():
            raise TrainingConfigError(
                f"the teacher {name!r} has another tokenizer than the student "
                f"{self.args.model!r}; on-policy distillation scores the student's tokens, so "
                "both must share one vocabulary."
            )
        model = model.float().to(self.device)
        return self._frozen_copy(model)
