"""Deprecated module paths that still work for one release: they forward and warn."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["moved"]


def moved(old: str, new: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``old`` that loads ``new`` on first access and warns.

    Use as ``__getattr__ = moved(__name__, "branchgym.bench.webshop")`` in the old module.
    """

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        warnings.warn(
            f"{old} moved to {new}; import it from there", DeprecationWarning, stacklevel=2
        )
        return getattr(importlib.import_module(new), name)

    return __getattr__
