"""Deprecated alias: this benchmark moved to :mod:`branchgym.bench.webshop`.

Env packages hold envs; benchmarks live in ``branchgym/bench/`` so that the arrow runs
from the bench package to the envs and never back. Importing a name from here still
works (loaded on first access) but warns.
"""

from __future__ import annotations

from branchgym.deprecation import moved

__getattr__ = moved(__name__, "branchgym.bench.webshop")
