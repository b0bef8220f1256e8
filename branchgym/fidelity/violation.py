"""The record of one snapshot-fidelity violation, shared by every fidelity check.

The property suite (:mod:`branchgym.fidelity.suite`, :mod:`branchgym.fidelity.machine`), the
distributional mode (:mod:`branchgym.fidelity.distributional`), the report
(:mod:`branchgym.fidelity.report`) and the online wrapper
(:class:`branchgym.wrappers.FidelityCheck`) all describe what they caught with one
:class:`Violation`. It lives in the engine so the engine never imports the wrappers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Violation"]


@dataclasses.dataclass(frozen=True)
class Violation:
    """One fidelity violation: where the restored env first behaved differently.

    Attributes:
        check: What caught it: ``digest`` or ``shadow`` (the ``FidelityCheck`` wrapper); the
            property suite
            uses ``determinism``, ``restore``, ``continuation``, ``replay``, ``pickle``,
            ``release``, ``exception`` and ``distribution``.
        field: The first differing field: ``obs``, ``reward``, ``terminated``,
            ``truncated``, ``info['key'][i]``, ``state_digest``, ...
        live: The value the live (restored) env produced.
        reference: The value the reference produced (the state at snapshot time, the
            twin, or the model replay).
        step: Episode step at which the divergence showed (the first diverging step).
        since_restore: Steps taken since the restore (0: the restored state itself);
            ``None`` when no restore was involved.
        detail: One line of context (which route built the reference, ...).
    """

    check: str
    field: str
    live: Any
    reference: Any
    step: int | None = None
    since_restore: int | None = None
    detail: str = ""

    def __str__(self) -> str:
        where = []
        if self.step is not None:
            where.append(f"step {self.step}")
        if self.since_restore is not None:
            where.append(
                "right after restore"
                if self.since_restore == 0
                else f"{self.since_restore} step(s) after restore"
            )
        loc = f" ({', '.join(where)})" if where else ""
        text = f"{self.check}: {self.field}: {_short(self.live)} != {_short(self.reference)}{loc}"
        return f"{text}; {self.detail}" if self.detail else text


def _short(v: Any, limit: int = 160) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."
