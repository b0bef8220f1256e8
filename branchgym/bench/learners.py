"""Deprecated alias: this module is now :mod:`branchgym.bench.all_learners` (a name that says what it holds).

Importing a name from here still works for one release (loaded on first access) but warns.
"""

from __future__ import annotations

from branchgym.deprecation import moved

__getattr__ = moved(__name__, "branchgym.bench.all_learners")
