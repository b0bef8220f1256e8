"""The training run every learner shares, and the one import for learner files.

A learner file (``grpo.py``, ``bpo.py``, ``bellman_po.py``, ``branch_opd.py``, ``sft.py``)
is an ``Args`` dataclass and a loop that reads like its paper. :class:`Run` holds what is
the same for all of them: model, engine, optimiser, scheduler, reference model, metrics
(JSONL, namespaced keys), evaluation, checkpoints in safetensors with exact resume, and
the training loop's progress bar.

The data path it drives lives in modules of one concern each, in the order data flows
(env -> snapshot -> tree are :mod:`branchgym.rollout.grow` and :mod:`branchgym.rollout.tree`):

* :mod:`~branchgym.agents.training.options`: :class:`TrainArgs` and CLI/JSON type coercion;
* :mod:`~branchgym.agents.training.lr_schedules`: :data:`LR_SCHEDULES`;
* :mod:`~branchgym.agents.forward.rows`: trees -> :class:`Decision`, :class:`Row`,
  :class:`Batch`, :class:`Chunk` (token rows and masks), :data:`WEIGHTS`;
* :mod:`~branchgym.agents.forward.packed`: packed forward passes with 4-D masks;
* :mod:`~branchgym.agents.training.policy_kinds`: :data:`POLICIES` (``generate``, ``scoring``):
  how the model acts and rescores its actions with gradients;
* :mod:`~branchgym.agents.training.metrics`: logged diagnostics;
* :mod:`~branchgym.agents.training.evaluation`: :func:`evaluate`; :func:`success_of` is
  :mod:`branchgym.rollout.tree`'s;
* :mod:`~branchgym.agents.training.checkpoints`: checkpoint format and optimizer state;
* :mod:`~branchgym.agents.training.plots`: :func:`plot_curves`.

Every public name of those modules that learners use is re-exported here, so
learner files need one import:
``from branchgym.agents.training.run import Batch, Run, TrainArgs, ...``.
The math is not here: losses and advantages come from :mod:`branchgym.agents.estimators.losses`.

The module is over 600 lines because :class:`Run` is one object by design (set-up,
rescoring, the update, the loop with its stop and crash checkpoints, save and resume all
read and write the same model, optimiser and step); its re-export list is a third of it.

Checkpoints verify (:mod:`~branchgym.agents.training.checkpoints`): a SHA-256 per file in
``trainer_state.json`` checked on load, finite weights and optimiser state on save and
load, fsync and an atomic swap that never deletes the previous checkpoint first, a
checkpoint at the step boundary after SIGINT/SIGTERM (a second signal stops at once), a
``checkpoint-NNNNNN-crash`` when a step raises, and a resumed run continues its own
``metrics.jsonl`` without logging a step twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from branchgym.agents.forward.packed import (
    FORWARD_TOKENS,
    Pack,
    bucketed_forward,
    length_buckets,
    packed_forward,
)
from branchgym.agents.forward.rows import (
    WEIGHTS,
    Batch,
    Chunk,
    Decision,
    Row,
    path_decisions,
    row_weight,
    token_weight,
)
from branchgym.agents.training.checkpoints import (
    CHECKPOINT_VERSION,
    load_checkpoint_state,
    stop_on_signals,
)
from branchgym.agents.training.distributed import (
    reduce_metrics,
)
from branchgym.agents.training.evaluation import EvalResult, evaluate
from branchgym.agents.training.lr_schedules import LR_SCHEDULES
from branchgym.agents.training.metrics import (
    RunningStats,
    advantage_metrics,
    ratio_spread,
    rollout_metrics,
)
from branchgym.agents.training.options import (
    TrainArgs,
    args_from_dict,
    field_docs,
    require,
    require_one_of,
)
from branchgym.agents.training.plots import plot_curves
from branchgym.agents.training.policy_kinds import POLICIES, GenerateKind, PolicyKind, ScoringKind
from branchgym.agents.training.saving import RunSaving
from branchgym.agents.training.setup import RunSetup
from branchgym.agents.training.update import RunUpdate
from branchgym.error import DependencyMissingError
from branchgym.rollout.batch import run_batched
from branchgym.rollout.tree import SUCCESS_KEYS, success_of

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra("branchgym.agents.training.run", "llm", "torch") from exc

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


class Run(RunSetup, RunUpdate, RunSaving):
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
            while self.step < a.steps and not self.env_budget_spent():
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


    def env_steps(self) -> int:
        """Environment steps of the run so far.

        Those up to the checkpoint it resumed from (:attr:`env_base`) plus ``env/steps`` of
        the steps logged after it.
        """
        step, before = self.env_base
        after = (line.get("env/steps", 0.0) for line in self.history if line["step"] > step)
        return before + int(sum(after))

    def env_budget_spent(self) -> bool:
        """Whether ``max_env_steps`` is set and the run has taken that many env steps."""
        return bool(self.args.max_env_steps) and self.env_steps() >= self.args.max_env_steps

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






    def close(self) -> TrainResult:
        """Close the logs, draw the curves, shut the executor down; the run's result."""
        if self._metrics is not None:
            self._metrics.close()
        self.executor.shutdown()
        if self.args.engine == "vllm":
            from branchgym.agents.training.vllm_training import stop_worker

            stop_worker(self.engine)
        if self.dp.is_main:
            plot_curves(self.history, self.out_dir / "curves.png", title=self.algo)
        self.dp.close()
        return TrainResult(
            self.out_dir, self.last_checkpoint, self.history, self.eval_start, self.eval_end
        )




_BAR_KEYS = ("charts/success", "charts/return", "losses/policy_loss", "eval/success")
