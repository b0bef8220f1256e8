"""Deprecated alias of :mod:`branchgym.agents.run` (a name that says what it holds).

Importing a name from here still works for one release (loaded on first access) but warns.
"""

from __future__ import annotations

from branchgym.deprecation import moved

__getattr__ = moved(__name__, "branchgym.agents.run")
