"""Wrappers (imported as ``branchgym.wrappers``): snapshot strategies and fidelity checks.

* :class:`PickleSnapshot` makes any Gymnasium env snapshottable by copying its state.
* :class:`ReplaySnapshot` does it by resetting with the recorded seed and replaying actions.
* :class:`FidelityCheck` verifies, while the env runs, that restores are faithful
  (``digest`` and ``shadow`` modes).
"""

from branchgym.fidelity.violation import Violation
from branchgym.wrappers.fidelity import FidelityCheck
from branchgym.wrappers.pickle_snapshot import PickleSnapshot
from branchgym.wrappers.replay_snapshot import ReplaySnapshot

__all__ = ["FidelityCheck", "PickleSnapshot", "ReplaySnapshot", "Violation"]
