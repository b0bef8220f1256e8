"""Shared pieces of the ``branchgym bench`` studies: timing, reports, plots.

Reports format their tables with :func:`branchgym.tables.markdown_table`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import platform
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from branchgym.tables import markdown_table

__all__ = [
    "positive_int",
    "seed_int",
    "Timing",
    "time_calls",
    "Report",
    "machine_line",
]


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give e.g. 4") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{value} must be at least {low}")
    return value


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer of at least 1, else a usage error saying so."""
    return _int_at_least(text, 1)


def seed_int(text: str) -> int:
    """An argparse ``type``: a seed, an integer of at least 0 (numpy refuses negatives)."""
    return _int_at_least(text, 0)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Summary of repeated wall-clock measurements, in milliseconds."""

    median_ms: float
    p90_ms: float
    mean_ms: float
    n: int

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Timing:
        """Summarise raw durations in seconds."""
        ms = np.asarray(seconds, dtype=float) * 1000.0
        if ms.size == 0:
            return cls(float("nan"), float("nan"), float("nan"), 0)
        return cls(
            float(np.median(ms)), float(np.percentile(ms, 90)), float(ms.mean()), int(ms.size)
        )


def time_calls(fn: Callable[[], Any], n: int, *, warmup: int = 1) -> tuple[Timing, list[Any]]:
    """Call ``fn`` ``warmup + n`` times; time the last ``n`` calls; return their results too."""
    for _ in range(warmup):
        fn()
    out, secs = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        out.append(fn())
        secs.append(time.perf_counter() - t0)
    return Timing.of(secs), out


def machine_line() -> str:
    """One line naming the machine the figures come from."""
    import os

    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, {_dt.datetime.now().isoformat(timespec='seconds')}"
    )


class Report:
    """A markdown report plus PNG plots and raw JSON in one results folder."""

    def __init__(self, out_dir: str | Path, name: str, title: str) -> None:
        """Create ``out_dir`` and start ``<name>.md`` with ``title``."""
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.parts: list[str] = [f"# {title}", "", f"Machine: {machine_line()}", ""]
        self.data: dict[str, Any] = {}

    def add(self, text: str) -> None:
        """Append markdown."""
        self.parts.extend([text, ""])

    def table(self, headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
        """Append a table and return it (for printing)."""
        t = markdown_table(headers, rows)
        self.add(t)
        return t

    def figure(self, fig: Any, stem: str, caption: str) -> Path:
        """Save a matplotlib figure as PNG and link it."""
        path = self.dir / f"{self.name}_{stem}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        import matplotlib.pyplot as plt

        plt.close(fig)
        self.add(f"![{caption}]({path.name})\n\n*{caption}*")
        return path

    def save(self) -> Path:
        """Write ``<name>.md`` and ``<name>.json``; return the markdown path."""
        md = self.dir / f"{self.name}.md"
        md.write_text("\n".join(self.parts))
        (self.dir / f"{self.name}.json").write_text(json.dumps(self.data, indent=2, default=str))
        return md
