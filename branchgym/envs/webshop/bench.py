"""Deprecated alias: this benchmark moved to :mod:`branchgym.bench.webshop`.

Env packages hold envs; benchmarks live in ``branchgym/bench/`` so that the arrow runs
from the bench package to the envs and never back. Importing a name from here still
works (loaded on first access) but warns.
"""

from __future__ import annotations

import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    from branchgym.bench import webshop as moved

    warnings.warn(
        "branchgym.envs.webshop.bench moved to branchgym.bench.webshop; import it from there",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(moved, name)
