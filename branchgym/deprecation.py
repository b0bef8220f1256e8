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
        target = importlib.import_module(new)
        if not hasattr(target, name):  # probes (pytest's ``pytestmark``, hasattr) stay quiet
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(
            f"{old} moved to {new}; import it from there", DeprecationWarning, stacklevel=2
        )
        return getattr(target, name)

    return __getattr__
