"""One sequence of a packed forward pass: a row's dialogue plus the branches it carries.

:class:`Pack` is what every packed read takes (:mod:`~branchgym.agents.forward.packed`'s
padded and tree-packed passes, :mod:`~branchgym.agents.forward.flat`'s unpadded one and
:mod:`~branchgym.agents.forward.levels`' cached one); it lives here, below all three, so
they share it without importing each other.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Pack"]


@dataclasses.dataclass
class Pack:
    """One sequence of a packed forward pass.

    Attributes:
        tokens: The row's dialogue, then any extra segments.
        segments: ``(start, end, attach)``: tokens ``[start, end)`` are a side branch that
            continues token ``attach - 1``: it sees what that token sees, that token, and
            itself (causally), at the positions after that token's. For ``attach`` inside
            the dialogue (before the first segment) that is ``tokens[:attach]`` at positions
            ``attach, attach + 1, ...``: how other candidates of a decision are scored
            without repeating the dialogue. A segment may also continue a token of an
            earlier segment (a tree of branches, :func:`pack_trees`); ``attach = 0`` sees
            only itself. Segments come in order: ``attach <= start``.
        targets: ``(predictor, token)``: score ``token`` under the distribution at index
            ``predictor``.
    """

    tokens: list[int]
    segments: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    targets: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def positions(self) -> list[int]:
        """Position id of every token (side branches continue their attach point)."""
        pos = list(range(len(self.tokens)))
        for start, end, attach in self.segments:
            first = pos[attach - 1] + 1 if attach > 0 else 0
            pos[start:end] = range(first, first + end - start)
        return pos
