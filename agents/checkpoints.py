"""Checkpoint I/O pieces: the trainer-state format, optimizer state in safetensors.

A checkpoint folder holds the model (safetensors), the optimizer's tensors
(:func:`optimizer_tensors`, safetensors) and ``trainer_state.json`` (version
:data:`CHECKPOINT_VERSION`, read back by :func:`load_checkpoint_state`). Writing and
loading a whole run is :meth:`branchgym.agents.training.Run.save` / ``resume``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from branchgym.error import CheckpointError, DependencyMissingError

try:
    import torch
    from torch import Tensor
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra("branchgym.agents.checkpoints", "llm", "torch") from exc

__all__ = [
    "CHECKPOINT_VERSION",
    "json_default",
    "load_checkpoint_state",
    "optimizer_state",
    "optimizer_tensors",
]


CHECKPOINT_VERSION = 1


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


def load_checkpoint_state(folder: str | Path) -> dict[str, Any]:
    """The ``trainer_state.json`` of a checkpoint (a :class:`CheckpointError` if absent)."""
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
    if state.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint version {state.get('version')}, this branchgym reads "
            f"{CHECKPOINT_VERSION}."
        )
    return state


def json_default(x: Any) -> Any:
    """``json.dumps(default=...)`` for tensors, NumPy scalars and tuples in trainer state."""
    if isinstance(x, Tensor):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, tuple):
        return list(x)
    return str(x)
