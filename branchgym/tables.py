"""Tables as text: the markdown tables of reports and command output.

The engine's commands, the env CLIs, the scenario matrix and the ``branchgym bench``
studies all print the same tables; this module sits in the engine so that none of them
imports the bench package (the top layer) for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = ["markdown_table"]


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats get 3 significant decimals."""

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            if np.isnan(v):
                return "n/a"
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
