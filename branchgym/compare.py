"""The one data-equivalence comparator shared by the checkers, wrappers and tests.

``first_difference(a, b)`` walks two values (observations, infos, step tuples) and
returns where they first differ, or ``None`` when they are equal. Floats are compared
exactly by default: a restored state must behave *exactly* like the original.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["Difference", "first_difference", "equivalent", "first_step_difference", "STEP_FIELDS"]


@dataclasses.dataclass(frozen=True)
class Difference:
    """Where two values differ: a path like ``info['admissible_actions'][3]``."""

    path: str
    left: Any
    right: Any

    def __str__(self) -> str:
        return f"{self.path or '<value>'}: {_short(self.left)} != {_short(self.right)}"


def _short(v: Any, limit: int = 120) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def equivalent(a: Any, b: Any, *, atol: float = 0.0, ignore: tuple[str, ...] = ()) -> bool:
    """True when :func:`first_difference` finds nothing."""
    return first_difference(a, b, atol=atol, ignore=ignore) is None


def first_difference(  # noqa: C901 - a flat type switch
    a: Any, b: Any, *, atol: float = 0.0, ignore: tuple[str, ...] = (), path: str = ""
) -> Difference | None:
    """Return the first place where ``a`` and ``b`` differ.

    Args:
        a: Left value.
        b: Right value.
        atol: Absolute tolerance for floats and float arrays (0 = exact).
        ignore: Mapping keys to skip at any depth (volatile info fields such as timings).
        path: Prefix for the reported path.
    """
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        keys_a = {k for k in a if k not in ignore}
        keys_b = {k for k in b if k not in ignore}
        if keys_a != keys_b:
            missing = sorted(map(repr, keys_a ^ keys_b))
            return Difference(f"{path}.keys()", sorted(map(repr, keys_a)), f"differs in {missing}")
        for k in sorted(keys_a, key=repr):
            d = first_difference(a[k], b[k], atol=atol, ignore=ignore, path=f"{path}[{k!r}]")
            if d is not None:
                return d
        return None
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        aa, bb = np.asarray(a), np.asarray(b)
        if aa.shape != bb.shape or aa.dtype != bb.dtype:
            return Difference(path, f"{aa.dtype}{aa.shape}", f"{bb.dtype}{bb.shape}")
        if aa.dtype == object:
            for i, (x, y) in enumerate(zip(aa.ravel(), bb.ravel(), strict=True)):
                d = first_difference(x, y, atol=atol, ignore=ignore, path=f"{path}.flat[{i}]")
                if d is not None:
                    return d
            return None
        if np.issubdtype(aa.dtype, np.floating) and atol > 0:
            bad = ~np.isclose(aa, bb, rtol=0.0, atol=atol, equal_nan=True)
        elif np.issubdtype(aa.dtype, np.floating):
            bad = ~((aa == bb) | (np.isnan(aa) & np.isnan(bb)))
        else:
            bad = aa != bb
        if np.any(bad):
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            return Difference(f"{path}{list(idx)}", aa[idx].item(), bb[idx].item())
        return None
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if type(a) is not type(b) and not (_is_plain_seq(a) and _is_plain_seq(b)):
            return Difference(path, type(a).__name__, type(b).__name__)
        if len(a) != len(b):
            return Difference(f"len({path or '<value>'})", len(a), len(b))
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = first_difference(x, y, atol=atol, ignore=ignore, path=f"{path}[{i}]")
            if d is not None:
                return d
        return None
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
        if type(a) is not type(b):
            return Difference(path, type(a).__name__, type(b).__name__)
        return first_difference(
            dataclasses.asdict(a), dataclasses.asdict(b), atol=atol, ignore=ignore, path=path
        )
    if _is_number(a) and _is_number(b):
        fa, fb = float(a), float(b)
        if math.isnan(fa) and math.isnan(fb):
            return None
        if (abs(fa - fb) <= atol) if atol > 0 else (a == b):
            return None
        return Difference(path, a, b)
    if type(a) is not type(b) and not (isinstance(a, str) and isinstance(b, str)):
        return Difference(path, a, b) if a != b else None
    try:
        same = a == b
        if isinstance(same, np.ndarray):
            same = bool(same.all())
    except Exception:  # incomparable objects count as different
        same = False
    return None if same else Difference(path, a, b)


def _is_plain_seq(x: Any) -> bool:
    return type(x) in (list, tuple)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool)


#: Names of the fields of a Gymnasium step tuple, as violation reports print them.
STEP_FIELDS = ("obs", "reward", "terminated", "truncated", "info")


def first_step_difference(
    a: Sequence[Any],
    b: Sequence[Any],
    *,
    fields: Sequence[str] = STEP_FIELDS,
    atol: float = 0.0,
    ignore: tuple[str, ...] = (),
) -> Difference | None:
    """:func:`first_difference` over step tuples, with named fields in the path.

    ``(obs, reward, terminated, truncated, info)`` tuples differ at ``obs``, ``reward`` or
    ``info['admissible_actions'][2]`` rather than at ``[0]``; pass
    ``fields=("obs", "info")`` for the ``(obs, info)`` pairs of ``reset``/``restore``.
    """
    if len(a) != len(fields) or len(b) != len(fields):
        return Difference("len(step)", len(a), len(b))
    for name, x, y in zip(fields, a, b, strict=True):
        d = first_difference(x, y, atol=atol, ignore=ignore, path=name)
        if d is not None:
            return d
    return None
