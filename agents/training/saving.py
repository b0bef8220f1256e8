"""Checkpoints of a training run, and exact resume.

:class:`RunSaving` holds :class:`~branchgym.agents.training.run.Run`'s checkpoint
methods: an HF model folder, optimiser state in safetensors and the trainer state with a
SHA-256 per file (:mod:`~branchgym.agents.training.checkpoints`), data parallel shards,
and loading it all back so a resumed run continues its own ``metrics.jsonl`` exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

from branchgym.agents.training.checkpoints import (
    CHECKPOINT_VERSION,
    check_finite,
    checkpoint_step,
    complete_checkpoints,
    file_digests,
    json_default,
    load_adapters,
    optimizer_state,
    optimizer_tensors,
    save_weights,
    truncate_metrics,
    write_atomically,
)
from branchgym.agents.training.distributed import (
    load_sharded,
    save_sharded,
)
from branchgym.agents.training.metrics import (
    RunningStats,
)
from branchgym.error import CheckpointError, DependencyMissingError

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra(
        "branchgym.agents.training.saving", "llm", "torch"
    ) from exc
from branchgym.agents.training.setup import quiet_transformers


class RunSaving:
    """Checkpoint save and resume of a :class:`~branchgym.agents.training.run.Run`."""

    def _save_once(self) -> Path:
        """The checkpoint of the current step (written now unless it already is)."""
        name = f"checkpoint-{self.step:06d}"
        if self.last_checkpoint is None or self.last_checkpoint.name != name:
            return self.save()
        return self.last_checkpoint

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
        with quiet_transformers():
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
            "env_steps": self.env_steps(),
            "files": file_digests(tmp),  # checked on load: damage is refused, not resumed
        }
        (tmp / "trainer_state.json").write_text(json.dumps(state, default=json_default))
        # fsync, then swap: a crash never leaves a half-written checkpoint under the
        # final name, and never deletes the previous one before the new one is whole.
        write_atomically(tmp, out)
        self.last_checkpoint = out
        self._prune_checkpoints()
        return out

    def _prune_checkpoints(self) -> None:
        """Delete regular checkpoints older than the newest ``keep_checkpoints`` (if set).

        Every ``keep_checkpoint_every``-th step's checkpoint stays (a learning-curve point).
        """
        keep = self.args.keep_checkpoints
        if keep <= 0:
            return
        import shutil

        every = self.args.keep_checkpoint_every
        for old in complete_checkpoints(self.out_dir)[:-keep]:
            if every > 0 and checkpoint_step(old) % every == 0:
                continue  # a learning-curve point
            shutil.rmtree(old)

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
            with quiet_transformers():
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
                "env_steps": self.env_steps(),
                "files": file_digests(tmp),
            }
            (tmp / "trainer_state.json").write_text(json.dumps(state, default=json_default))
            write_atomically(tmp, out)
            self._prune_checkpoints()
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
            self.env_base = (self.step, int(state.get("env_steps", 0)))
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
        self.env_base = (self.step, int(state.get("env_steps", 0)))
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
