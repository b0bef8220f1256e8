"""Checkpoint I/O pieces: the trainer-state format, optimizer state in safetensors.

A checkpoint folder holds the model (safetensors), the optimizer's tensors
(:func:`optimizer_tensors`, safetensors) and ``trainer_state.json`` (version
:data:`CHECKPOINT_VERSION`, read back by :func:`load_checkpoint_state`). Writing and
loading a whole run is :meth:`branchgym.agents.training.run.Run.save` / ``resume``.

Only what resuming needs is written (:func:`save_weights`): with LoRA the adapters alone
(``adapter_model.safetensors``, megabytes; the base weights are the run's ``model``),
otherwise the weights as safetensors shards of at most :data:`SHARD_SIZE`; bfloat16
training adds its float32 master weights (``masters.safetensors``); the optimizer state
is optional (``save_optimizer``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from branchgym.error import CheckpointError, DependencyMissingError

try:
    import torch
    from torch import Tensor
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra(
        "branchgym.agents.training.checkpoints", "llm", "torch"
    ) from exc

__all__ = [
    "CHECKPOINT_VERSION",
    "json_default",
    "complete_checkpoints",
    "latest_checkpoint",
    "sha256_file",
    "load_checkpoint_state",
    "optimizer_state",
    "optimizer_tensors",
    "file_digests",
    "verify_files",
    "check_finite",
    "write_atomically",
    "fsync_tree",
    "stop_on_signals",
    "truncate_metrics",
    "SHARD_SIZE",
    "save_weights",
    "load_adapters",
]

#: Largest safetensors shard of a full-weights checkpoint (``save_pretrained``'s format).
SHARD_SIZE = "2GB"


CHECKPOINT_VERSION = 2
#: Versions this branchgym reads (1: no per-file digests, so no damage check).
READABLE_VERSIONS = (1, 2)


def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Split an optimizer's state dict into tensors (safetensors) and JSON."""
    sd = opt.state_dict()
    tensors: dict[str, Tensor] = {}
    plain: dict[str, dict[str, Any]] = {}
    for pid, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, Tensor):
                tensors[f"state.{pid}.{key}"] = value.detach().contiguous().cpu()
            else:
                plain.setdefault(str(pid), {})[key] = value
    return tensors, {"param_groups": sd["param_groups"], "plain": plain}


def optimizer_state(tensors: dict[str, Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict from what :func:`optimizer_tensors` split off."""
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        _, pid, key = name.split(".", 2)
        state.setdefault(int(pid), {})[key] = value
    for pid, values in meta.get("plain", {}).items():
        state.setdefault(int(pid), {}).update(values)
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    return {"state": state, "param_groups": groups}


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The complete ``checkpoint-NNNNNN`` folders of a run folder, oldest first.

    ``-crash`` and ``.partial`` folders are not complete checkpoints.
    """
    return sorted(
        p for p in Path(run_dir).glob("checkpoint-*")
        if p.is_dir() and p.name[len("checkpoint-") :].isdigit()
    )  # fmt: skip


def checkpoint_step(folder: str | Path) -> int:
    """The step of a complete ``checkpoint-NNNNNN`` folder (from its name)."""
    return int(Path(folder).name[len("checkpoint-") :])


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete ``checkpoint-NNNNNN`` of a run folder, or None."""
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def load_checkpoint_state(folder: str | Path, *, verify: bool = True) -> dict[str, Any]:
    """The ``trainer_state.json`` of a checkpoint (a :class:`CheckpointError` if absent).

    ``verify``: check every file against its recorded digest (resuming needs it; reading
    what the run was, e.g. its policy, does not).
    """
    path = Path(folder) / "trainer_state.json"
    if not path.is_file():
        raise CheckpointError(
            f"{folder} is not a training checkpoint (no trainer_state.json); give a "
            "checkpoint-NNNNNN folder written by branchgym train."
        )
    try:
        state = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is damaged ({exc}); use another checkpoint.") from exc
    if state.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{path} has checkpoint version {state.get('version')}, this branchgym reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}."
        )
    if verify:
        verify_files(Path(folder), state.get("files"))
    return state


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_digests(folder: Path) -> dict[str, str]:
    """SHA-256 of every file of a checkpoint folder except ``trainer_state.json``."""
    return {
        p.name: sha256_file(p)
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != "trainer_state.json"
    }


def verify_files(folder: Path, digests: dict[str, str] | None) -> None:
    """Every file recorded at save time is there, unchanged (a :class:`CheckpointError` if not)."""
    if digests is None:  # a version-1 checkpoint: nothing recorded to check against
        return
    fix = (
        "restore the folder from a copy, or resume from an earlier checkpoint-NNNNNN of the "
        "same run"
    )
    for name, digest in digests.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing from the checkpoint; {fix}.")
        if sha256_file(path) != digest:
            raise CheckpointError(
                f"{path} changed since the checkpoint was written (truncated, overwritten or "
                f"damaged: its SHA-256 differs from trainer_state.json's); {fix}."
            )


def check_finite(where: str, tensors: Any) -> None:
    """Raise :class:`CheckpointError` naming the first tensor with NaN or infinity."""
    items = tensors.items() if isinstance(tensors, dict) else tensors
    for name, t in items:
        if isinstance(t, Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(
                f"{where}: {name} holds NaN or infinity. The run diverged (lower the learning "
                "rate, clip gradients) or the checkpoint is damaged; resume from an earlier "
                "checkpoint."
            )


def fsync_tree(folder: Path) -> None:
    """Flush every file of ``folder`` and the folder itself to disk."""
    for p in folder.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(tmp: Path, out: Path) -> None:
    """Put the finished folder ``tmp`` at ``out`` without ever deleting a good one first.

    An old checkpoint of the same name is renamed aside, the new one renamed in, and only
    then the old one deleted: a crash at any point leaves a whole checkpoint on disk.
    """
    fsync_tree(tmp)
    old = out.with_name(out.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    fd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if old.exists():
        shutil.rmtree(old)


def json_default(x: Any) -> Any:
    """``json.dumps(default=...)`` for tensors, NumPy scalars and tuples in trainer state."""
    if isinstance(x, Tensor):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, tuple):
        return list(x)
    return str(x)


def stop_on_signals(stop: dict[str, str]) -> Callable[[], None]:
    """SIGINT/SIGTERM set ``stop``: the loop checkpoints at the next step boundary.

    A second signal interrupts at once. Returns the function that puts the old handlers
    back.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: Any) -> None:
        if stop:
            raise KeyboardInterrupt(f"{signal.Signals(signum).name} again: stopping now")
        stop["signal"] = signal.Signals(signum).name

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)

    return restore


def truncate_metrics(path: Path, step: int) -> list[dict[str, Any]]:
    """Keep the lines of a ``metrics.jsonl`` up to ``step``; return them.

    Resuming a run in its own folder: lines past the checkpoint's step were written after
    it and will be written again, so keeping them would log those steps twice. A line cut
    by a crash is dropped.
    """
    if not path.is_file():
        return []
    kept = []
    for raw in path.read_text().splitlines():
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if int(line.get("step", 0)) <= step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(x) + "\n" for x in kept))
    tmp.replace(path)
    return kept


def save_weights(model: Any, folder: Path) -> None:
    """What resuming needs of ``model``: LoRA adapters only, or sharded safetensors."""
    if hasattr(model, "peft_config"):
        model.save_pretrained(folder, safe_serialization=True)  # adapter_model.safetensors
    else:
        model.save_pretrained(folder, safe_serialization=True, max_shard_size=SHARD_SIZE)


def load_adapters(model: Any, folder: Path) -> None:
    """Load a checkpoint's LoRA adapters into ``model`` (a PEFT model of the same config)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        raise CheckpointError(
            f"{folder} holds no adapter_model.safetensors: it was saved without LoRA; resume "
            "it with lora_rank=0 (or start LoRA from its weights with model=<folder>)."
        )
    result = set_peft_model_state_dict(model, load_file(str(path)))
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise CheckpointError(
            f"{path} has adapters this model lacks ({unexpected[:3]}...); resume with the "
            "lora_rank and lora_targets it was saved with."
        )
