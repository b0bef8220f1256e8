"""Deprecated alias: the stack identity is computed in :mod:`branchgym.core`.

:func:`branchgym.core.stack_identity` is now the one definition (beside
:func:`branchgym.core.spec_identity` and :func:`branchgym.core.open_snapshot`); this
module re-exports it for code that imported it from here.
"""

from branchgym.core import stack_identity

__all__ = ["stack_identity"]
