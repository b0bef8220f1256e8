"""The training run every learner shares, and the one import for learner files.

A learner file (``grpo.py``, ``bpo.py``, ``bellman_po.py``, ``branch_opd.py``, ``sft.py``)
is an ``Args`` dataclass and a loop that reads like its paper. :class:`Run` holds what is
the same for all of them: model, engine, optimiser, scheduler, reference model, metrics
(JSONL, namespaced keys), evaluation, checkpoints in safetensors with exact resume, and
the training loop's progress bar.

The data path it drives lives in modules of one concern each, in the order data flows
(env -> snapshot -> tree are :mod:`branchgym.rollout.grow` and :mod:`branchgym.rollout.tree`):

* :mod:`~branchgym.agents.options`: :class:`TrainArgs` and CLI/JSON type coercion;
* :mod:`~branchgym.agents.lr_schedules`: :data:`LR_SCHEDULES`;
* :mod:`~branchgym.agents.rows`: trees -> :class:`Decision`, :class:`Row`,
  :class:`Batch`, :class:`Chunk` (token rows and masks), :data:`WEIGHTS`;
* :mod:`~branchgym.agents.forward`: packed forward passes with 4-D masks;
* :mod:`~branchgym.agents.policy_kinds`: :data:`POLICIES` (``generate``, ``scoring``):
  how the model acts and rescores its actions with gradients;
* :mod:`~branchgym.agents.metrics`: logged diagnostics;
* :mod:`~branchgym.agents.evaluation`: :func:`success_of`, :func:`evaluate`;
* :mod:`~branchgym.agents.checkpoints`: checkpoint format and optimizer state;
* :mod:`~branchgym.agents.plots`: :func:`plot_curves`.

Every public name of those modules that learners use is re-exported here, so
learner files need one import: ``from branchgym.agents.run import Batch, Run, TrainArgs, ...``.
The math is not here: losses and advantages come from :mod:`branchgym.agents.losses`.

The module is over 600 lines because :class:`Run` is one object by design (set-up,
rescoring, the update, the loop with its stop and crash checkpoints, save and resume all
read and write the same model, optimiser and step); its re-export list is a third of it.

Checkpoints verify (:mod:`~branchgym.agents.checkpoints`): a SHA-256 per file in
``trainer_state.json`` checked on load, finite weights and optimiser state on save and
load, fsync and an atomic swap that never deletes the previous checkpoint first, a
checkpoint at the step boundary after SIGINT/SIGTERM (a second signal stops at once), a
``checkpoint-NNNNNN-crash`` when a step raises, and a resumed run continues its own
``metrics.jsonl`` without logging a step twice.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from branchgym.agents.checkpoints import (
    CHECKPOINT_VERSION,
    check_finite,
    file_digests,
    json_default,
    load_adapters,
    load_checkpoint_state,
    optimizer_state,
    optimizer_tensors,
    save_weights,
    stop_on_signals,
    truncate_metrics,
    write_atomically,
)
from branchgym.agents.distributed import (
    DataParallel,
    data_parallel,
    load_sharded,
    reduce_metrics,
    save_sharded,
)
from branchgym.agents.evaluation import SUCCESS_KEYS, EvalResult, evaluate, success_of
from branchgym.agents.flat_forward import flat_supported
from branchgym.agents.forward import (
    FORWARD_TOKENS,
    Pack,
    backbone,
    bucketed_forward,
    length_buckets,
    pack_trees,
    packed_forward,
    packing_exact,
    pair_cost,
    plan_packs,
)
from branchgym.agents.level_forward import levels_supported
from branchgym.agents.lr_schedules import LR_SCHEDULES
from branchgym.agents.memory import MasterWeights, token_chunks, training_mode
from branchgym.agents.metrics import (
    RunningStats,
    advantage_metrics,
    ratio_spread,
    rollout_metrics,
)
from branchgym.agents.options import (
    TrainArgs,
    args_from_dict,
    field_docs,
    require,
    require_one_of,
)
from branchgym.agents.plots import plot_curves
from branchgym.agents.policy_kinds import POLICIES, GenerateKind, PolicyKind, ScoringKind
from branchgym.agents.rows import (
    WEIGHTS,
    Batch,
    Chunk,
    Decision,
    Row,
    path_decisions,
    row_weight,
    token_weight,
)
from branchgym.agents.sinks import Sinks, open_sinks
from branchgym.error import CheckpointError, DependencyMissingError, TrainingConfigError
from branchgym.rollout.batch import run_batched
from branchgym.rollout.executors import EnvRecipe, make_executor

try:
    import torch
    from torch import Tensor
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra("branchgym.agents.run", "llm", "torch") from exc

__all__ = [
    "CHECKPOINT_VERSION",
    "FORWARD_TOKENS",
    "LR_SCHEDULES",
    "POLICIES",
    "SUCCESS_KEYS",
    "WEIGHTS",
    "Batch",
    "Chunk",
    "Decision",
    "EvalResult",
    "GenerateKind",
    "Pack",
    "PolicyKind",
    "Row",
    "Run",
    "RunningStats",
    "ScoringKind",
    "TrainArgs",
    "TrainResult",
    "advantage_metrics",
    "args_from_dict",
    "bucketed_forward",
    "evaluate",
    "field_docs",
    "length_buckets",
    "load_checkpoint_state",
    "packed_forward",
    "path_decisions",
    "plot_curves",
    "ratio_spread",
    "require",
    "require_one_of",
    "rollout_metrics",
    "row_weight",
    "success_of",
    "token_weight",
]


@dataclasses.dataclass
class TrainResult:
    """What a training run produced.

    Attributes:
        out_dir: The run folder.
        checkpoint: The last checkpoint written.
        history: Every logged metrics line.
        eval_start: Evaluation before training (None when ``eval_episodes == 0``).
        eval_end: Evaluation after training.
    """

    out_dir: Path
    checkpoint: Path | None
    history: list[dict[str, float]]
    eval_start: EvalResult | None = None
    eval_end: EvalResult | None = None


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No transformers progress bars while loading and saving (the run has its own)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


class _Autocast:
    """A policy wrapper that samples under the run's autocast context (bf16 on CUDA)."""

    def __init__(self, policy: Any, ctx: Callable[[], Any]) -> None:
        self.policy, self.ctx = policy, ctx

    def act(self, requests: Any, rng: np.random.Generator) -> Any:
        with self.ctx():
            return self.policy.act(requests, rng)


class Run:
    """One training run: everything a learner's loop needs, set up from its Args.

    Args:
        args: The learner's Args (already checked).
        algo: The learner's name (``bpo``, ``grpo``, ...), recorded in checkpoints.
        needs_ref: Keep a frozen copy of the initial model as ``pi_ref`` (KL term).
    """

    def __init__(self, args: TrainArgs, algo: str, *, needs_ref: bool = False) -> None:
        """Load the model (or the checkpoint), build engine, optimizer, scheduler and logs.

        The steps run in this order, each a method below: the order is part of the
        behaviour (``torch.manual_seed`` before the model loads and LoRA draws its
        initial weights, the checkpoint loaded once the optimizer and output folder exist).
        """
        args.check()
        self.algo = algo
        self.args = args
        self._place(args)
        resume = self._read_checkpoint(args, algo)
        self._pick_device(args)
        self._build_model(args, sharded=bool(resume and resume.get("sharded")))
        self._build_policy(args)
        self._build_envs(args)
        self._build_optimizer(args)
        self._build_reference(args, needs_ref=needs_ref)
        self._start_progress()
        self._open_out_dir(args, algo, resumed=resume is not None)
        if resume is not None:
            self._load(Path(args.resume), resume)
        self._open_sinks(args, algo)

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
        from branchgym.agents.models import add_lora, load_model

        with _quiet_transformers():
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
            from branchgym.agents.vllm_training import start_worker

            self.engine = start_worker(self)

    def _build_policy(self, args: TrainArgs) -> None:
        """``kind``, ``policy`` and ``behaviour`` (the policy under autocast).

        Tree packing is turned off where it would change log-probs.
        """
        why = packing_exact(self.model) if args.pack_trees else None
        if why:  # packing would change log-probs here: rows are read one by one
            warnings.warn(f"pack_trees is off: {why}.", stacklevel=3)
            args.pack_trees = False
        name = args.policy
        if name == "auto":
            name = "scoring" if args.model == "tiny" else "generate"
        self.kind = POLICIES[name]
        self.policy = self.kind.make(self.engine, args)
        self.behaviour = _Autocast(self.policy, self.autocast) if self.bf16 else self.policy

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
            # metrics.jsonl, and TensorBoard / W&B as args.log asks (agents/sinks.py)
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
        from branchgym.agents.models import load_model

        with _quiet_transformers():
            model, tok = load_model(name)
        if tok.get_vocab() != self.tokenizer.get_vocab():
            raise TrainingConfigError(
                f"the teacher {name!r} has another tokenizer than the student "
                f"{self.args.model!r}; on-policy distillation scores the student's tokens, so "
                "both must share one vocabulary."
            )
        model = model.float().to(self.device)
        return self._frozen_copy(model)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """bfloat16 autocast on CUDA (``precision='auto'``), nothing on CPU."""
        if self.bf16:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                yield
        else:
            yield

    # ---------------------------------------------------------------- randomness
    def rng(self, *key: int) -> np.random.Generator:
        """A generator derived from ``(seed, step, *key)``: steps replay exactly on resume.

        Learners key a prompt's randomness by its index ``i`` in :meth:`prompt_seeds`
        (``rng(i)``, ``rng(i, j)``). Data parallel, that list is this rank's share, so the
        first key is shifted to the prompt's global index: each rank draws distinct
        streams, and every prompt draws what it would in one process.
        """
        if key and self.dp.active:
            key = (key[0] + self.dp.share(self.args.prompts_per_step).start, *key[1:])
        return np.random.default_rng([self.args.seed, self.step, *key])

    def prompt_seeds(self) -> list[int]:
        """This step's task instances (reset seeds); data parallel, this rank's share."""
        rng = np.random.default_rng([self.args.seed, self.step, 0x5EED])
        seeds = [int(s) for s in rng.integers(0, 2**31 - 1, size=self.args.prompts_per_step)]
        share = self.dp.share(len(seeds))
        return seeds[share.start : share.stop]

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the block's wall-clock seconds to this step's ``time/<phase>_s``.

        The learners' phases: ``generation`` (rollouts: policy sampling and env steps),
        ``reference`` (the frozen ``pi_ref`` forward of the KL term), ``teacher`` (the
        OPD teacher's forward) and ``update`` (the policy's forward, backward and
        optimizer steps). Logged beside ``time/step_s``, this rank's own clock.
        """
        start = time.perf_counter()
        try:
            yield
        finally:
            self._times[phase] = self._times.get(phase, 0.0) + time.perf_counter() - start

    def rollouts(self, jobs: Sequence[Callable[..., Any]]) -> list[Any]:
        """Run this step's rollout jobs with the behaviour policy and the run's executor.

        A job is ``job(policy, executor=executor)`` (a ``functools.partial`` of
        ``grow_tree`` or ``group_rollouts`` without its policy). With ``batch_rollouts``
        the jobs grow in lockstep (:func:`branchgym.rollout.batch.run_batched`: one policy
        call per turn for all of them); otherwise one after another. Same trees either way.
        Timed as ``time/generation_s``.
        """
        with self.timed("generation"):
            if self.args.batch_rollouts and len(jobs) > 1:
                return run_batched(list(jobs), self.behaviour, self.executor)
            return [job(self.behaviour, executor=self.executor) for job in jobs]

    # ---------------------------------------------------------------- log-probs
    def logprobs(
        self,
        model: Any,
        rows: Sequence[Row],
        *,
        logit_positions: Sequence[Sequence[int]] | None = None,
    ) -> tuple[list[list[Tensor]], list[Tensor]]:
        """Per row and decision, ``model``'s log-prob of each token (grad unless no_grad)."""
        with self.autocast():
            return self.kind.logprobs(
                self.policy,
                model,
                rows,
                self.device,
                logit_positions=logit_positions,
                pack_trees=self.args.pack_trees,
            )

    @torch.no_grad()
    def frozen_logprobs(self, model: Any, batch: Batch, field: str) -> None:
        """Fill ``decision.<field>`` (``ref_logp``, ``teacher_logp``) with ``model``'s log-probs.

        Timed as ``time/reference_s`` (``ref_logp``) or ``time/teacher_s``.
        """
        with self.timed("reference" if field == "ref_logp" else "teacher"):
            self._frozen_logprobs(model, batch, field)

    def _frozen_logprobs(self, model: Any, batch: Batch, field: str) -> None:
        if self.args.micro_batch_tokens:  # the update's token-budget chunks (groups may split)
            scored = [i for i, r in enumerate(batch.rows) if r.decisions]
            parts = [[batch.rows[i] for i in c] for c in self.chunks(batch, scored)]
        else:
            rows = [r for r in batch.rows if r.decisions]
            step = max(1, self.args.micro_batch_rows or len(rows))
            parts = [rows[i : i + step] for i in range(0, len(rows), step)]
        base = self.args.lora_rank and model is self.ref
        for part in parts:
            with self.model.disable_adapter() if base else contextlib.nullcontext():
                lps, _ = self.logprobs(model, part)
            for row, per in zip(part, lps, strict=True):
                for d, lp in zip(row.decisions, per, strict=True):
                    setattr(d, field, lp.float().cpu().numpy())

    # ---------------------------------------------------------------- updates
    def row_tokens(self, rows: Sequence[Row]) -> list[int]:
        """Tokens each row adds to a forward pass.

        With ``pack_trees``, the tokens beyond the prefix it shares with the row before it
        of the same tree.
        """
        seqs = []
        for row in rows:
            packs, _ = self.kind.packs(self.policy, self.kind.runs(self.policy, row))
            seqs.append([t for p in packs for t in p.tokens])
        costs = []
        for i, (row, seq) in enumerate(zip(rows, seqs, strict=True)):
            shared = 0
            if self.args.pack_trees and i and rows[i - 1].tree == row.tree:
                prev = seqs[i - 1]
                while shared < min(len(seq), len(prev)) and seq[shared] == prev[shared]:
                    shared += 1
            costs.append(len(seq) - shared)
        return costs

    def chunks(
        self, batch: Batch, rows: Sequence[int], *, whole_groups: bool = False
    ) -> list[list[int]]:
        """Split rows for gradient accumulation.

        ``micro_batch_tokens``: by token budget (groups may split, unless
        ``whole_groups``); ``micro_batch_rows``: by rows, groups whole.
        """
        if self.args.micro_batch_tokens:
            costs = self.row_tokens([batch.rows[r] for r in rows])
            groups = [batch.rows[r].group for r in rows]
            cut = token_chunks(
                costs, groups, self.args.micro_batch_tokens, whole_groups=whole_groups
            )
            return [[rows[i] for i in c] for c in cut]
        size = self.args.micro_batch_rows
        if not size:
            return [list(rows)]
        out: list[list[int]] = [[]]
        last_group = None
        for r in rows:
            g = batch.rows[r].group
            if len(out[-1]) >= size and g != last_group:
                out.append([])
            out[-1].append(r)
            last_group = g
        return [c for c in out if c]

    def update(
        self,
        batch: Batch,
        rows: Sequence[int],
        loss_fn: Callable[[Chunk], tuple[Tensor, dict[str, float]]],
        *,
        weight: Callable[[Batch, list[int]], float] | None = None,
        logit_positions: Callable[[Row], list[int]] | None = None,
        whole_groups: bool = False,
    ) -> dict[str, float]:
        """One optimizer update on ``rows``: loss, backward (accumulated over chunks), step.

        Args:
            batch: The rollout batch.
            rows: Rows of this mini-batch.
            loss_fn: ``chunk -> (loss, metrics)``, the learner's loss on some rows.
            weight: How much of the full loss a chunk carries (its share of the loss's
                normaliser: counted tokens for a token mean, the default); it makes
                gradient accumulation equal to one pass over all rows.
            logit_positions: Row sequence positions whose full logits the loss needs.
            whole_groups: The loss reads whole groups (Bellman PO): token-budget chunks
                cut only between groups.

        Returns:
            The loss metrics (share-weighted over chunks) and ``grad/*``.
        """
        weight = weight or token_weight
        chunks = self.chunks(batch, rows, whole_groups=whole_groups)
        weights = [float(weight(batch, c)) for c in chunks]
        # data parallel: shares of the normaliser over every rank's rows (distributed.py)
        total = self.dp.all_sum([sum(weights)])[0]
        self.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, float] = {}
        if total <= 0:
            return {"update/skipped": 1.0}
        for c, w in zip(chunks, weights, strict=True):
            if w <= 0:
                continue
            share = w / total
            rws = [batch.rows[r] for r in c]
            positions = [logit_positions(r) for r in rws] if logit_positions else None
            with training_mode(self.model, self.args.gradient_checkpointing):
                lps, logits = self.logprobs(self.model, rws, logit_positions=positions)
                ch = batch.chunk(c, lps, self.device)
                if positions is not None:
                    ch.logits = torch.cat(logits) if logits else None
                loss, m = loss_fn(ch)
                (loss * share).backward()
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + share * float(v)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.dp.active:  # one process's gradient and loss on the whole batch
            self.dp.sum_gradients(params)
            keys = sorted(set().union(*self.dp.gather(sorted(metrics))))
            summed = self.dp.all_sum([metrics.get(k, 0.0) for k in keys])
            metrics = dict(zip(keys, summed, strict=True))
        if self.masters is not None:  # bf16 gradients onto the float32 masters
            self.masters.grads_to_masters()
            params = self.masters.params
        max_norm = self.args.grad_clip if self.args.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        self.optimizer.step()
        if self.masters is not None:
            self.masters.masters_to_params()
        # the engine's prefix KV cache holds activations of the old weights
        self.engine.clear_cache()
        self.grad_norm.add(norm)
        metrics.update(
            {
                "grad/norm": norm,
                "grad/norm_mean": self.grad_norm.mean,
                "grad/norm_var": self.grad_norm.var,
                "update/skipped": 0.0,
            }
        )
        return metrics

    def updates(
        self,
        batch: Batch,
        loss_fn: Callable[[Chunk], tuple[Tensor, dict[str, float]]],
        **kwargs: Any,
    ) -> dict[str, float]:
        """``updates_per_batch`` updates over the batch's mini-batches; metrics averaged.

        Timed as ``time/update_s``; with vLLM sampling, the trainer's forward that
        recomputes the behaviour log-probs first, as ``time/old_policy_s``. The token
        counts after them are bookkeeping, not timed.
        """
        if self.args.engine == "vllm":  # vLLM's log-probs -> the trainer's (vllm_training)
            from branchgym.agents.vllm_training import behaviour_correction

            with self.timed("old_policy"):
                self.log(behaviour_correction(self, batch))
        with self.timed("update"):
            merged = self._updates(batch, loss_fn, **kwargs)
        merged.update(self.token_counts(batch))
        return merged

    def _updates(
        self,
        batch: Batch,
        loss_fn: Callable[[Chunk], tuple[Tensor, dict[str, float]]],
        **kwargs: Any,
    ) -> dict[str, float]:
        self._step_batch = batch  # its trees and advantages, for save_trees_every
        out: dict[str, list[float]] = {}
        for rows in batch.minibatches(self.args.updates_per_batch):
            for k, v in self.update(batch, rows, loss_fn, **kwargs).items():
                out.setdefault(k, []).append(v)
        merged = {k: float(np.mean(v)) for k, v in out.items()}
        for key in ("grad/norm_mean", "grad/norm_var"):  # running statistics: the last value
            if key in out:
                merged[key] = out[key][-1]
        merged["update/count"] = float(len(batch.minibatches(self.args.updates_per_batch)))
        return merged

    def token_counts(self, batch: Batch) -> dict[str, float]:
        """Tokens one pass of the policy over the batch reads, against its distinct tokens.

        ``tokens/learner``: the tokens the forward passes read, chunked as the update
        chunks them; ``tokens/unique``: each mini-batch's rows in one token trie, each
        shared prefix once (within a tree, and across trees: a prompt or system prompt
        that several trees share). They are equal when tree packing is on, the model is
        read flat (``flat_forward.flat_supported``) and no chunk or forward budget splits
        a mini-batch.
        """

        def packs(rows: Sequence[Row]) -> tuple[list[Pack], list[int]]:
            pieces = [(r, s) for r in rows if r.decisions for s in self.kind.runs(self.policy, r)]
            out, _ = self.kind.packs(self.policy, [s for _, s in pieces])
            return out, [r.tree for r, _ in pieces]

        pair, learner, unique = pair_cost(self.model), 0, 0
        # the update's plan: a flat or key/value-cache read of merged packs unless
        # checkpointing
        base = backbone(self.model)[0]
        levels = levels_supported(self.model, base) and not self.args.gradient_checkpointing
        flat = flat_supported(self.model, base) and not self.args.gradient_checkpointing
        for mb in {tuple(m) for m in batch.minibatches(self.args.updates_per_batch)}:
            for c in self.chunks(batch, list(mb)):
                ps, keys = packs([batch.rows[r] for r in c])
                read, _ = plan_packs(
                    ps, keys if self.args.pack_trees else None, pair=pair, levels=levels, flat=flat
                )
                learner += sum(len(p.tokens) for p in read)
            ps, _ = packs([batch.rows[r] for r in mb])
            unique += sum(len(p.tokens) for p in pack_trees(ps, [0] * len(ps))[0]) if ps else 0
        return {"tokens/learner": float(learner), "tokens/unique": float(unique)}

    # ---------------------------------------------------------------- the loop
    def loop(self) -> Iterator[int]:
        """Yield each step to run; after each, log, evaluate and checkpoint as configured."""
        from tqdm import tqdm

        a = self.args
        if a.eval_episodes and self.step == 0:
            self.eval_start = self.evaluate()
            self.log_line({"step": 0, **self.eval_start.metrics()})
        bar = tqdm(
            total=a.steps,
            initial=self.step,
            desc=self.algo,
            disable=not a.progress or not self.dp.is_main,
            leave=False,
        )
        stop: dict[str, str] = {}
        restore_handlers = stop_on_signals(stop)
        try:
            while self.step < a.steps:
                self._pending = {}
                self._step_batch = None
                self._times = {}
                self._t0 = time.perf_counter()
                yield self.step
                with warnings.catch_warnings():
                    # a step whose batch had nothing to learn skips optimizer.step(); the
                    # schedule still counts it, which torch would warn about
                    warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
                    self.scheduler.step()
                self.step += 1
                line = {"step": self.step, "charts/lr": self.optimizer.param_groups[0]["lr"]}
                line.update(reduce_metrics(self.dp, self._pending))
                line["time/step_s"] = time.perf_counter() - self._t0
                line.update({f"time/{k}_s": v for k, v in self._times.items()})
                if a.eval_episodes and a.eval_every and self.step % a.eval_every == 0:
                    line.update(self.evaluate().metrics())
                self.log_line(line)
                if a.save_trees_every and self.step % a.save_trees_every == 0:
                    self.save_trees()
                bar.update(1)
                bar.set_postfix(
                    {k.split("/")[-1]: f"{line[k]:.3f}" for k in _BAR_KEYS if k in line}
                )
                if a.checkpoint_every and self.step % a.checkpoint_every == 0:
                    self.save()
                if self.dp.active and self.dp.any(bool(stop)):  # every rank stops here
                    stop.setdefault("signal", "a signal to another rank")
                if stop:  # SIGINT/SIGTERM: stop at this step boundary, with a checkpoint
                    path = self._save_once()
                    raise KeyboardInterrupt(
                        f"{stop['signal']}: stopped after step {self.step}; resume with "
                        f"resume={path}"
                    )
        except KeyboardInterrupt:
            raise
        except BaseException:
            # Whatever failed, keep what was learned: a checkpoint of the last completed
            # step (named -crash: the failed step's update may be in it), unless the model
            # diverged (check_finite refuses it) or one was just written.
            done = self.last_checkpoint is not None and self.last_checkpoint.name == (
                f"checkpoint-{self.step:06d}"
            )
            if self.step and not done and not self.dp.active:  # collective: not alone
                try:
                    self.save(self.out_dir / f"checkpoint-{self.step:06d}-crash")
                except Exception as save_exc:  # noqa: BLE001 - the original error matters
                    warnings.warn(f"no crash checkpoint: {save_exc}", stacklevel=2)
            raise
        finally:
            restore_handlers()
            bar.close()
        if a.eval_episodes:
            self.eval_end = self.evaluate()
            self.log_line({"step": self.step, **self.eval_end.metrics()})
        if self.last_checkpoint is None or not self.last_checkpoint.name.endswith(
            f"{self.step:06d}"
        ):
            self.save()

    def save_trees(self) -> Path | None:
        """Write the last update's trees with their advantages (``trees/step_NNNNNN.json.gz``).

        Every rank writes its own share (``_rankR`` in the name when data parallel). None
        when the step made no update (nothing to save).
        """
        from branchgym.tree_format import save_trees

        batch = self._step_batch
        if batch is None:
            return None
        advantages: list[dict[int, float]] = [{} for _ in batch.trees]
        for d in batch.decisions():
            advantages[d.tree][d.node] = d.advantage
        rank = f"_rank{self.dp.rank}" if self.dp.active else ""
        return save_trees(
            self.out_dir / "trees" / f"step_{self.step:06d}{rank}.json.gz",
            batch.trees,
            advantages,
            step=self.step,
            algo=self.algo,
            env_id=self.args.env_id,
            run_seed=self.args.seed,
            groups=list(batch.groups),
        )

    def _save_once(self) -> Path:
        """The checkpoint of the current step (written now unless it already is)."""
        name = f"checkpoint-{self.step:06d}"
        if self.last_checkpoint is None or self.last_checkpoint.name != name:
            return self.save()
        return self.last_checkpoint

    def log(self, metrics: dict[str, float]) -> None:
        """Add metrics to the current step's line."""
        self._pending.update({k: float(v) for k, v in metrics.items()})

    def log_line(self, line: dict[str, float]) -> None:
        """Write one JSONL line (and keep it in :attr:`history`)."""
        clean = {k: (float(v) if k != "step" else int(v)) for k, v in line.items()}
        self.history.append(clean)
        if self._metrics is not None:  # rank 0 only
            self._metrics.write(clean)

    def evaluate(self) -> EvalResult:
        """Success on the fixed evaluation set (and the exact value where computable)."""
        return evaluate(
            self.spec,
            self.behaviour,
            episodes=self.args.eval_episodes,
            seed=self.args.eval_seed,
            executor=self.executor,
            max_steps=self.args.max_episode_steps,
            success_threshold=self.args.success_threshold,
        )

    # ---------------------------------------------------------------- checkpoints
    def save(self, folder: str | Path | None = None) -> Path:
        """Write a checkpoint: HF model folder + optimizer (safetensors) + trainer state."""
        from safetensors.torch import save_file, save_model

        out = Path(folder) if folder else self.out_dir / f"checkpoint-{self.step:06d}"
        # Never write a diverged model: it would be resumed, and saved again, as if sound.
        check_finite(f"cannot save step {self.step}", self.model.named_parameters())
        if self.dp.active:
            return self._save_sharded(out)
        tmp = out.with_name(out.name + ".partial")
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        with _quiet_transformers():
            save_weights(self.model, tmp)  # adapters only with LoRA; sharded otherwise
            self.tokenizer.save_pretrained(tmp)
        opt_meta = None
        if self.args.save_optimizer:
            tensors, opt_meta = optimizer_tensors(self.optimizer)
            check_finite(f"cannot save step {self.step}: optimizer state", tensors)
            save_file(tensors, str(tmp / "optimizer.safetensors"))
        if self.masters is not None and self.masters.pairs:
            save_file(self.masters.state_dict(), str(tmp / "masters.safetensors"))
        if self.ref is not None and not self.args.lora_rank:  # LoRA: the ref is the base
            save_model(self.ref, str(tmp / "ref.safetensors"))
        state = {
            "version": CHECKPOINT_VERSION,
            "algo": self.algo,
            "step": self.step,
            "args": dataclasses.asdict(self.args),
            "optimizer": opt_meta,
            "scheduler": self.scheduler.state_dict(),
            "grad_norm": dataclasses.asdict(self.grad_norm),
            "torch_rng": torch.get_rng_state().tolist(),
            "policy": self.kind.name,
            "files": file_digests(tmp),  # checked on load: damage is refused, not resumed
        }
        (tmp / "trainer_state.json").write_text(json.dumps(state, default=json_default))
        # fsync, then swap: a crash never leaves a half-written checkpoint under the
        # final name, and never deletes the previous one before the new one is whole.
        write_atomically(tmp, out)
        self.last_checkpoint = out
        return out

    def _save_sharded(self, out: Path) -> Path:
        """A data parallel checkpoint: DCP shards from every rank, the rest from rank 0."""
        tmp = out.with_name(out.name + ".partial")
        if self.dp.is_main:
            if tmp.exists():
                import shutil

                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self.dp.barrier()
        modules = {"model": self.model, **({"ref": self.ref} if self.ref is not None else {})}
        save_sharded(tmp, modules, self.optimizer)
        rng_states = self.dp.gather(torch.get_rng_state().tolist())
        self.dp.barrier()
        if self.dp.is_main:
            with _quiet_transformers():
                self.model.config.save_pretrained(tmp)
                self.tokenizer.save_pretrained(tmp)
            state = {
                "version": CHECKPOINT_VERSION,
                "algo": self.algo,
                "step": self.step,
                "args": dataclasses.asdict(self.args),
                "sharded": True,
                "world_size": self.dp.world,
                "scheduler": self.scheduler.state_dict(),
                "grad_norm": dataclasses.asdict(self.grad_norm),
                "torch_rng_ranks": rng_states,
                "policy": self.kind.name,
                "files": file_digests(tmp),
            }
            (tmp / "trainer_state.json").write_text(json.dumps(state, default=json_default))
            write_atomically(tmp, out)
        self.dp.barrier()
        self.last_checkpoint = out
        return out

    def _load(self, folder: Path, state: dict[str, Any]) -> None:
        from safetensors.torch import load_file, load_model

        if state.get("sharded"):
            modules = {"model": self.model, **({"ref": self.ref} if self.ref is not None else {})}
            if self.ref is not None and not any(k.startswith("ref.") for k in _dcp_keys(folder)):
                raise CheckpointError(
                    f"{folder} holds no KL reference, but this run has a KL term; resume "
                    "with the options the checkpoint was made with."
                )
            load_sharded(folder, modules, self.optimizer)
            self.scheduler.load_state_dict(state["scheduler"])
            if state.get("policy") not in (None, self.kind.name):
                raise CheckpointError(
                    f"{folder} was trained with policy={state['policy']!r}; resume with the same."
                )
            check_finite(f"cannot resume from {folder}", self.model.named_parameters())
            self.step = int(state["step"])
            self.grad_norm = RunningStats(**state["grad_norm"])
            rng = state["torch_rng_ranks"][self.dp.rank]
            torch.set_rng_state(torch.tensor(rng, dtype=torch.uint8))
            if self.dp.is_main:
                self._continue_metrics(self.step)
            self.dp.barrier()
            if not self.dp.is_main:  # rank 0 rewrote the log; the others only read it
                self.history = read_metrics(self.out_dir / "metrics.jsonl")
            return
        try:
            if self.args.lora_rank:
                load_adapters(self.model, folder)
            if self.masters is not None and self.masters.pairs:
                self.masters.load_state_dict(load_file(str(folder / "masters.safetensors")))
            tensors = {}
            if state.get("optimizer") is not None:
                tensors = load_file(str(folder / "optimizer.safetensors"))
                self.optimizer.load_state_dict(optimizer_state(tensors, state["optimizer"]))
            else:
                warnings.warn(
                    f"{folder} was saved without optimizer state (save_optimizer=false): "
                    "AdamW starts again from zero moments, so the run does not resume exactly.",
                    stacklevel=2,
                )
            self.scheduler.load_state_dict(state["scheduler"])
            if self.ref is not None and not self.args.lora_rank:
                ref_file = folder / "ref.safetensors"
                if not ref_file.is_file():
                    raise CheckpointError(
                        f"{folder} has no ref.safetensors, but this run has a KL term; resume "
                        "with the options the checkpoint was made with."
                    )
                load_model(self.ref, str(ref_file), device=str(self.device))
        except (OSError, KeyError, ValueError, RuntimeError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(
                f"cannot resume from {folder}: {type(exc).__name__}: {exc}. The checkpoint is "
                "damaged or was written for another model or optimizer."
            ) from exc
        if state.get("policy") not in (None, self.kind.name):
            raise CheckpointError(
                f"{folder} was trained with policy={state['policy']!r}; resume with the same."
            )
        check_finite(f"cannot resume from {folder}", self.model.named_parameters())
        check_finite(f"cannot resume from {folder}: optimizer state", tensors)
        self.step = int(state["step"])
        self.grad_norm = RunningStats(**state["grad_norm"])
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        self._continue_metrics(self.step)

    def _continue_metrics(self, step: int) -> None:
        """Resuming into the run's own folder: its log keeps lines up to ``step`` only."""
        self.history = truncate_metrics(self.out_dir / "metrics.jsonl", step)
        self._drop_trees_after(step)

    def _drop_trees_after(self, step: int) -> None:
        """Saved trees of steps after ``step`` belong to a run that is being replaced."""
        for path in (self.out_dir / "trees").glob("step_*.json*"):
            digits = path.name[len("step_") :].split("_")[0].split(".")[0]
            if digits.isdigit() and int(digits) > step:
                path.unlink(missing_ok=True)

    def close(self) -> TrainResult:
        """Close the logs, draw the curves, shut the executor down; the run's result."""
        if self._metrics is not None:
            self._metrics.close()
        self.executor.shutdown()
        if self.args.engine == "vllm":
            from branchgym.agents.vllm_training import stop_worker

            stop_worker(self.engine)
        if self.dp.is_main:
            plot_curves(self.history, self.out_dir / "curves.png", title=self.algo)
        self.dp.close()
        return TrainResult(
            self.out_dir, self.last_checkpoint, self.history, self.eval_start, self.eval_end
        )


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The lines of a ``metrics.jsonl`` (a line cut by a crash is skipped)."""
    out = []
    for raw in path.read_text().splitlines() if path.is_file() else []:
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(raw))
    return out


def _dcp_keys(folder: Path) -> list[str]:
    """The state-dict keys a torch.distributed.checkpoint folder holds."""
    import torch.distributed.checkpoint as dcp

    return list(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


_BAR_KEYS = ("charts/success", "charts/return", "losses/policy_loss", "eval/success")
