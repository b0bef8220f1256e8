"""Where a run's metrics go: ``metrics.jsonl``, TensorBoard and Weights & Biases.

:func:`open_sinks` builds the one sink a :class:`~branchgym.agents.training.run.Run` writes every
metrics line to (``--log jsonl,tensorboard,wandb``):

* ``jsonl``: ``<out_dir>/metrics.jsonl``, one JSON object per line. Always written
  (resuming reads it), whether named or not.
* ``tensorboard``: event files in ``<out_dir>/tensorboard`` (torch's ``SummaryWriter``),
  one scalar per key at the line's step, and the run's options as TensorBoard hparams
  and as a text table (extra ``logging``).
* ``wandb``: a W&B run in ``<out_dir>/wandb`` with the options as its config. It runs
  offline unless the user chose a mode (``WANDB_MODE``), so nothing leaves the machine
  by default; ``wandb sync`` uploads it later (extra ``logging``).

Keys keep their namespaces (``losses/``, ``charts/``, ``branching/`` ...) in every sink.
A sink whose package is missing is a :class:`~branchgym.error.DependencyMissingError`
naming the extra, raised before training starts.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from branchgym.error import DependencyMissingError, TrainingConfigError

__all__ = ["LOG_SINKS", "JsonlSink", "Sinks", "TensorBoardSink", "WandbSink", "open_sinks"]


class JsonlSink:
    """``metrics.jsonl``: each line appended and flushed (a crash loses at most one line)."""

    def __init__(self, path: Path) -> None:
        """Open ``path`` for appending."""
        self.path = Path(path)
        self._file = self.path.open("a")

    def write(self, line: dict[str, Any]) -> None:
        """Append one metrics line."""
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def _scalars(line: dict[str, Any]) -> tuple[int, dict[str, float]]:
    step = int(line.get("step", 0))
    values = {k: float(v) for k, v in line.items() if k != "step"}
    return step, {k: v for k, v in values.items() if math.isfinite(v)}


def _flat_hparams(hparams: dict[str, Any]) -> dict[str, Any]:
    """Options as TensorBoard's hparams plugin takes them (numbers, strings, booleans)."""
    out: dict[str, Any] = {}
    for k, v in hparams.items():
        if isinstance(v, bool | int | float | str):
            out[k] = v
        else:
            out[k] = json.dumps(v, default=str)
    return out


class TensorBoardSink:
    """TensorBoard event files: one scalar per key, the options as hparams and text.

    Args:
        folder: Where the event files go.
        hparams: The run's options (recorded once).
        start_step: The step a resumed run continues from: TensorBoard drops the earlier
            run's events after it (a crash may have logged steps past its checkpoint).
    """

    def __init__(self, folder: Path, hparams: dict[str, Any], start_step: int = 0) -> None:
        """Open a ``SummaryWriter`` in ``folder`` and record the options."""
        try:
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams as hparams_summary
        except ImportError as exc:
            raise DependencyMissingError.for_extra(
                "--log tensorboard", "logging", "tensorboard"
            ) from exc
        self.folder = Path(folder)
        purge = start_step + 1 if start_step else None
        self.writer = SummaryWriter(log_dir=str(self.folder), purge_step=purge)
        flat = _flat_hparams(hparams)
        rows = "\n".join(f"| {k} | {flat[k]} |" for k in sorted(flat))
        self.writer.add_text("hparams", "| option | value |\n|---|---|\n" + rows, 0)
        # the hparams plugin's three summaries, in this run's own event file (add_hparams
        # would open a second run folder for them)
        for summary in hparams_summary(flat, {}):
            self.writer.file_writer.add_summary(summary)
        self.writer.flush()

    def write(self, line: dict[str, Any]) -> None:
        """One scalar per key at the line's step."""
        step, values = _scalars(line)
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


class WandbSink:
    """A Weights & Biases run, offline unless ``WANDB_MODE`` says otherwise.

    Args:
        folder: The run folder (W&B writes ``<folder>/wandb``).
        hparams: The run's options (the W&B config).
        name: The W&B run name.
        project: The W&B project (``WANDB_PROJECT`` if set, else ``branchgym``).
    """

    def __init__(
        self, folder: Path, hparams: dict[str, Any], *, name: str, project: str | None = None
    ) -> None:
        """Start the W&B run."""
        try:
            import wandb
        except ImportError as exc:
            raise DependencyMissingError.for_extra("--log wandb", "logging", "wandb") from exc
        self.folder = Path(folder)
        mode = os.environ.get("WANDB_MODE") or "offline"  # never the network by default
        self.run = wandb.init(
            project=project or os.environ.get("WANDB_PROJECT") or "branchgym",
            name=name,
            dir=str(self.folder),
            mode=mode,
            config=json.loads(json.dumps(hparams, default=str)),
            settings=wandb.Settings(console="off", silent=True),
        )
        self._last = -1

    def write(self, line: dict[str, Any]) -> None:
        """Log the line at its step (W&B's steps only grow: an earlier one joins the last)."""
        step, values = _scalars(line)
        self._last = max(self._last, step)
        self.run.log(values, step=self._last)

    def close(self) -> None:
        """Finish the run (offline: its files stay in the folder for ``wandb sync``)."""
        self.run.finish()


#: ``--log`` names: the sinks a run can write to.
LOG_SINKS = ("jsonl", "tensorboard", "wandb")


class Sinks:
    """Every sink of a run behind one ``write``/``close``."""

    def __init__(self, sinks: Sequence[Any]) -> None:
        """Hold ``sinks`` (written in order)."""
        self.sinks = list(sinks)

    def write(self, line: dict[str, Any]) -> None:
        """Write one metrics line to every sink."""
        for s in self.sinks:
            s.write(line)

    def close(self) -> None:
        """Close every sink (all of them, even when one fails)."""
        with contextlib.ExitStack() as stack:
            for s in self.sinks:
                stack.callback(s.close)


def check_log(names: Sequence[str]) -> None:
    """Raise :class:`TrainingConfigError` for a ``--log`` name that is not a sink."""
    for n in names:
        if n not in LOG_SINKS:
            raise TrainingConfigError(
                f"log names sinks, comma-separated, from {', '.join(LOG_SINKS)}; got {n!r}."
            )


def open_sinks(
    names: Sequence[str],
    out_dir: Path,
    hparams: dict[str, Any],
    *,
    name: str,
    start_step: int = 0,
) -> Sinks:
    """The sinks named in ``names`` for the run in ``out_dir`` (``metrics.jsonl`` always).

    Args:
        names: ``--log`` names (``jsonl``, ``tensorboard``, ``wandb``).
        out_dir: The run folder.
        hparams: The run's options, recorded by TensorBoard and W&B.
        name: The run's name (W&B).
        start_step: The step a resumed run continues from (0 for a new run).
    """
    check_log(names)
    out_dir = Path(out_dir)
    sinks: list[Any] = [JsonlSink(out_dir / "metrics.jsonl")]
    try:
        if "tensorboard" in names:
            sinks.append(TensorBoardSink(out_dir / "tensorboard", hparams, start_step))
        if "wandb" in names:
            sinks.append(WandbSink(out_dir, hparams, name=name))
    except BaseException:
        Sinks(sinks).close()
        raise
    return Sinks(sinks)
