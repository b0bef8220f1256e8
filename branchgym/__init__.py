"""branchgym: snapshottable Gymnasium sandboxes and branching rollouts for LLM agents.

``import branchgym`` registers every built-in env under the ``branchgym/`` namespace of
Gymnasium's registry; ``gym.make("branchgym:branchgym/TreeMDP-v0")`` does the import for
you. See :mod:`branchgym.core` for the snapshot protocol.
"""

from __future__ import annotations

from branchgym import error
from branchgym.core import (
    LiveSnapshots,
    Snapshot,
    SnapshottableEnv,
    live_snapshots,
    reseed,
    restore,
    snapshot,
    state_digest,
)
from branchgym.envs import register_builtin_envs
from branchgym.registration import BranchSpec, branch_spec, branch_specs, make, register
from branchgym.serialization import register_snapshot_types
from branchgym.wrapper_state import declare_stateless, register_wrapper_state

__version__ = "0.1.0"

__all__ = [
    "BranchSpec",
    "LiveSnapshots",
    "Snapshot",
    "SnapshottableEnv",
    "branch_spec",
    "branch_specs",
    "declare_stateless",
    "error",
    "live_snapshots",
    "make",
    "register",
    "register_snapshot_types",
    "register_wrapper_state",
    "reseed",
    "restore",
    "snapshot",
    "state_digest",
]

register_builtin_envs()
