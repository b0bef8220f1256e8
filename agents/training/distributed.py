"""Data parallel training on torch.distributed: rollouts split across ranks, one update.

Launch any learner with ``torchrun`` (gloo on CPU, NCCL on CUDA)::

    torchrun --nproc-per-node 2 -m branchgym.agents.train --algo grpo --model tiny ...

and :class:`~branchgym.agents.training.run.Run` runs data parallel (``distributed="auto"``, the
default, turns it on whenever ``WORLD_SIZE > 1``). What each piece does:

* **Rollouts.** A step's ``prompts_per_step`` prompts are split into contiguous shares
  (:meth:`DataParallel.share`); each rank grows only its share's trees. A prompt draws
  from the generator keyed by its *global* index (``Run.rng``), so every rank samples a
  distinct stream and the union of the ranks' trees is exactly the batch one process
  would grow.
* **Loss normalisation.** An update's loss is the sum over micro-batches of
  ``share * loss`` where ``share`` is the micro-batch's part of the *global* normaliser
  (:meth:`DataParallel.all_sum` of every rank's counted weight). Gradients are then
  summed over ranks (:meth:`DataParallel.sum_gradients`), so ``N`` ranks take the same
  optimizer step as one process on the same batch, to float rounding.
* **Why not the ``DistributedDataParallel`` wrapper.** DDP all-reduces inside every
  backward, so every rank must run the same number of backward passes; a rank's share of
  a tree batch has its own number of rows and micro-batches (and may have nothing to
  learn from), and DDP would wait forever. Here the local gradients are accumulated
  first and reduced once per update, in flat buckets: DDP's arithmetic, without the
  lockstep. All ranks hold the same weights (broadcast from rank 0 at start-up) and take
  identical optimizer steps.
* **FSDP2** (``torch.distributed.fsdp.fully_shard``) runs forward and backward on gloo
  with torch 2.13, but it is not offered here: a sharded model all-gathers its weights
  inside every forward call, and generation on split rollouts makes a different number of
  forward calls per rank, which deadlocks. It needs generation outside the trained
  module (a vLLM engine with weight sync).
* **Metrics** are reduced over ranks at the end of each step
  (:func:`reduce_metrics`: counts summed, maxima maxed, the rest averaged; update losses
  are already global) and written by rank 0 only.
* **Checkpoints** are sharded with ``torch.distributed.checkpoint`` (:func:`save_sharded`,
  :func:`load_sharded`): every rank writes its part of the model, the optimizer state and
  the KL reference into ``__<rank>_0.distcp`` files of one folder; rank 0 adds the model
  config, the tokenizer and ``trainer_state.json`` (``"sharded": true``, every rank's torch
  RNG state). Resuming needs the same world size and a folder every rank can read.

SFT has no prompts to split (its batch comes from a fixed expert set) and evaluation runs
the fixed evaluation set: every rank does the whole of both, which keeps them exact but
gains no speed. Averaged metrics are exact when ``prompts_per_step`` divides by the
number of ranks. A run whose ranks crash apart cannot checkpoint collectively, so data
parallel runs write no ``-crash`` checkpoint; SIGINT/SIGTERM stop every rank at the same
step boundary.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from branchgym.error import CheckpointError, DependencyMissingError, TrainingConfigError

try:
    import torch
    import torch.distributed as dist
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra(
        "branchgym.agents.training.distributed", "llm", "torch"
    ) from exc

__all__ = [
    "METRIC_REDUCTIONS",
    "STRATEGIES",
    "DataParallel",
    "data_parallel",
    "load_sharded",
    "reduce_metrics",
    "save_sharded",
]

#: ``TrainArgs.distributed`` values.
STRATEGIES = ("auto", "off", "ddp")

#: How a logged metric combines over ranks (``sum`` for counts, ``max`` for maxima);
#: every other key is averaged (its ranks' shares are equal up to one prompt).
METRIC_REDUCTIONS: dict[str, str] = {
    "charts/rollouts": "sum",
    "env/steps": "sum",
    "env/errors": "sum",
    "groups/invalid_rollouts": "sum",
    "groups/total": "sum",
    "groups/skipped": "sum",
    "tokens/generated": "sum",
    "tokens/independent": "sum",
    "tokens/per_second": "sum",
    "tokens/student": "sum",
    "branching/snapshots": "sum",
    "branching/branch_points": "sum",
    "branching/degenerate_points": "sum",
    "opd/forks": "sum",
    "branching/peak_live": "max",
    "ratio/max": "max",
    "omega/max": "max",
}

#: Gradient elements per all-reduce call (64 Mi float32: 256 MiB).
BUCKET_ELEMENTS = 64 * 2**20


@dataclasses.dataclass
class DataParallel:
    """This process's place in a data parallel run (rank 0 of 1 when not distributed).

    Attributes:
        rank: This process's rank.
        world: Number of processes.
        owns_group: Whether :func:`data_parallel` started the process group (and
            :meth:`close` ends it).
    """

    rank: int = 0
    world: int = 1
    owns_group: bool = False

    @property
    def active(self) -> bool:
        """More than one process."""
        return self.world > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that logs and writes the run's files."""
        return self.rank == 0

    def share(self, n: int) -> range:
        """This rank's contiguous share of ``n`` items (sizes differ by at most one)."""
        start = n * self.rank // self.world
        return range(start, n * (self.rank + 1) // self.world)

    def all_sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks (float64)."""
        if not self.active:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return [float(v) for v in t.tolist()]

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank."""
        return self.all_sum([1.0 if flag else 0.0])[0] > 0

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.active:
            dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast_parameters(self, module: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers on every rank (one start for all)."""
        if not self.active:
            return
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                buf = t.detach().cpu().clone() if _needs_cpu(t) else t.data
                dist.broadcast(buf, src=0)
                if buf is not t.data:
                    t.data.copy_(buf)

    def sum_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over ranks (a missing gradient counts as zero)."""
        if not self.active:
            return
        params = [p for p in params if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket: list[torch.nn.Parameter] = []
        size = 0
        for p in params:
            bucket.append(p)
            size += p.numel()
            if size >= BUCKET_ELEMENTS:
                _reduce_bucket(bucket)
                bucket, size = [], 0
        if bucket:
            _reduce_bucket(bucket)

    def close(self) -> None:
        """End the process group if this object started it."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False


def _needs_cpu(t: torch.Tensor) -> bool:
    """Whether ``t`` must go through the CPU (gloo reduces CPU tensors only)."""
    return t.device.type != "cpu" and dist.get_backend() == "gloo"


def _reduce_bucket(params: list[torch.nn.Parameter]) -> None:
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    on_cpu = _needs_cpu(flat)
    work = flat.cpu() if on_cpu else flat
    dist.all_reduce(work, op=dist.ReduceOp.SUM)
    if on_cpu:
        flat = work.to(flat.device)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def data_parallel(strategy: str, device: str) -> DataParallel:
    """Join (or start) the process group that ``torchrun`` describes in the environment.

    Args:
        strategy: ``auto`` (data parallel when ``WORLD_SIZE > 1``), ``off`` or ``ddp``
            (data parallel; an error when not launched by torchrun).
        device: The run's ``device`` option (NCCL for CUDA, gloo otherwise).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if strategy == "off":
        return DataParallel()
    if strategy == "ddp" and world < 2 and not dist.is_initialized():
        raise TrainingConfigError(
            "distributed='ddp' needs several processes; launch with "
            "`torchrun --nproc-per-node N -m branchgym.agents.train ...` (or set "
            "distributed=auto to train in one process)."
        )
    if dist.is_initialized():
        return DataParallel(dist.get_rank(), dist.get_world_size(), owns_group=False)
    if world < 2:
        return DataParallel()
    if not dist.is_available():  # pragma: no cover - torch builds without distributed
        raise TrainingConfigError("this torch build has no torch.distributed; use one process.")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    return DataParallel(dist.get_rank(), dist.get_world_size(), owns_group=True)


def reduce_metrics(dp: DataParallel, metrics: dict[str, float]) -> dict[str, float]:
    """One step's metrics over all ranks (:data:`METRIC_REDUCTIONS`; the rest averaged).

    A key some ranks did not log is combined over the ranks that did.
    """
    if not dp.active:
        return dict(metrics)
    out: dict[str, float] = {}
    every = dp.gather({k: float(v) for k, v in metrics.items()})
    for key in sorted({k for m in every for k in m}):
        values = [m[key] for m in every if key in m]
        how = METRIC_REDUCTIONS.get(key, "mean")
        if how == "sum":
            out[key] = float(sum(values))
        elif how == "max":
            out[key] = float(max(values))
        else:
            out[key] = float(sum(values) / len(values))
    return out


# ------------------------------------------------------------------------ checkpoints


def _state(modules: dict[str, torch.nn.Module], optimizer: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = modules["model"]
    state: dict[str, Any] = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }
    for name, module in modules.items():
        if name != "model":
            state[name] = get_model_state_dict(module)
    return state


def save_sharded(
    folder: Path, modules: dict[str, torch.nn.Module], optimizer: torch.optim.Optimizer
) -> None:
    """Every rank writes its shards of ``modules`` (``model`` first) and the optimizer.

    Collective: all ranks call it with the same ``folder``, which must exist.
    """
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(modules, optimizer), checkpoint_id=str(folder))


def load_sharded(
    folder: Path, modules: dict[str, torch.nn.Module], optimizer: torch.optim.Optimizer
) -> None:
    """Read what :func:`save_sharded` wrote into ``modules`` and ``optimizer`` (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if not (folder / ".metadata").is_file():
        raise CheckpointError(
            f"{folder} has no torch.distributed.checkpoint metadata (.metadata); resume a "
            "data parallel run from a checkpoint it wrote."
        )
    state = _state(modules, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(folder))
    except Exception as exc:  # noqa: BLE001 - DCP raises several kinds; one message
        raise CheckpointError(
            f"cannot resume from the sharded checkpoint {folder}: {type(exc).__name__}: "
            f"{exc}. It was written for another model, optimizer or world size."
        ) from exc
    model = modules["model"]
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    for name, module in modules.items():
        if name != "model":
            set_model_state_dict(module, state[name])
