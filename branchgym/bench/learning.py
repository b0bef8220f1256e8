"""Deprecated alias of :mod:`branchgym.bench.bpo_vs_grpo` (its new name).

Importing a name from here still works for one release (loaded on first access) but warns.
"""

from __future__ import annotations

from branchgym.deprecation import moved

__getattr__ = moved(__name__, "branchgym.bench.bpo_vs_grpo")
