"""Hugging Face Hub model ids (``Qwen/Qwen2.5-7B-Instruct``) from the local Hub cache, offline.

:func:`~branchgym.agents.policies.models.load_model` accepts a Hub id wherever it accepts a model
folder. The id is looked up in the cache that ``huggingface_hub`` fills
(``huggingface-cli download``, ``snapshot_download``, any ``from_pretrained`` run online),
laid out as::

    <cache>/models--Qwen--Qwen2.5-7B-Instruct/refs/main          (a commit hash)
    <cache>/models--Qwen--Qwen2.5-7B-Instruct/snapshots/<hash>/  (config.json, weights, ...)

with ``HF_HUB_OFFLINE`` semantics: nothing is ever downloaded. A missing model raises
:class:`~branchgym.error.ModelNotCachedError` naming the cache folder searched and the
command that fills it. ``org/name@revision`` picks a branch, tag (a file under ``refs/``)
or commit hash (a folder under ``snapshots/``); the default is ``main``.

The cache folder is read from the environment at call time, as ``huggingface_hub`` does
at import time: ``HF_HUB_CACHE``, else ``HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``,
else ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from branchgym.error import ModelNotCachedError

__all__ = ["hub_cache_dir", "is_hub_id", "resolve_hub_id"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*(@[\w.\-/]+)?$")


def hub_cache_dir() -> Path:
    """The Hugging Face Hub cache folder this process would use (see the module doc)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "huggingface" / "hub"


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as ``org/name`` (optionally ``@revision``) and is no local path."""
    text = str(name)
    return bool(_HUB_ID.match(text)) and not Path(text).expanduser().exists()


def resolve_hub_id(name: str, cache: str | os.PathLike[str] | None = None) -> Path:
    """The snapshot folder of Hub model ``name`` in the local cache (never downloads).

    Args:
        name: ``org/name`` or ``org/name@revision`` (branch, tag or commit hash).
        cache: The Hub cache folder (default: :func:`hub_cache_dir`).

    Raises:
        ModelNotCachedError: The model, the revision or its snapshot is not in the cache.
    """
    repo, _, revision = str(name).partition("@")
    revision = revision or "main"
    root = Path(cache) if cache is not None else hub_cache_dir()
    folder = root / ("models--" + repo.replace("/", "--"))
    fill = (
        f"fill the cache on a machine with network access: `huggingface-cli download {repo}` "
        f'(or `python -c "from huggingface_hub import snapshot_download; '
        f"snapshot_download('{repo}')\"`), then copy {folder.name} into {root} here, or point "
        "HF_HUB_CACHE (or HF_HOME) at the cache that holds it, or give a model folder path"
    )
    if not folder.is_dir():
        raise ModelNotCachedError(
            f"{name!r} is not in the Hugging Face cache {root} (no {folder.name}); branchgym "
            f"never downloads models: {fill}."
        )
    ref = folder / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = folder / "snapshots" / commit
    if not snapshot.is_dir():
        have = (
            sorted(p.name for p in (folder / "refs").glob("*"))
            if (folder / "refs").is_dir()
            else []
        )
        raise ModelNotCachedError(
            f"revision {revision!r} of {repo!r} is not in the Hugging Face cache {folder} "
            f"(cached refs: {', '.join(have) or 'none'}); {fill}."
        )
    weights = [*snapshot.glob("*.safetensors"), *snapshot.glob("*.bin")]
    if not (snapshot / "config.json").is_file() or not weights:
        missing = "config.json" if not (snapshot / "config.json").is_file() else "weights"
        raise ModelNotCachedError(
            f"{snapshot} has no {missing}: the cached snapshot of {repo!r} is incomplete "
            f"(an interrupted or partial download); {fill}."
        )
    return snapshot
