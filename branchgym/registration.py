"""Registration: branchgym envs live in Gymnasium's registry under the ``branchgym/`` namespace.

``branchgym.register`` is ``gymnasium.register`` plus a declaration of how the env
snapshots, so that ``gym.make`` returns a stack whose outermost layer offers
``snapshot()``/``restore()`` and ``branchgym list``/``check`` know what to expect.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Callable
from typing import Any

import gymnasium as gym
from gymnasium.envs.registration import WrapperSpec

from branchgym.error import RegistrationError, UnknownEnvError

__all__ = ["BranchSpec", "register", "make", "branch_specs", "branch_spec", "env_factory"]

_STRATEGY_WRAPPERS = {
    "pickle": "branchgym.wrappers.pickle_snapshot:PickleSnapshot",
    "replay": "branchgym.wrappers.replay_snapshot:ReplaySnapshot",
}


@dataclasses.dataclass(frozen=True)
class BranchSpec:
    """What branchgym knows about a registered env beyond Gymnasium's ``EnvSpec``.

    Attributes:
        id: The Gymnasium id (``branchgym/TreeMDP-v0``).
        snapshot: ``native`` (the env implements the protocol), ``pickle`` or ``replay``
            (a strategy wrapper adds it).
        kind: The snapshot kind users should expect (see ``branchgym.core.SNAPSHOT_KINDS``).
        picklable: Whether snapshots pickle and travel between processes.
        description: One line for ``branchgym list``.
        requires: Python modules the env needs, with the extra that installs them.
    """

    id: str
    snapshot: str
    kind: str
    picklable: bool
    description: str = ""
    requires: tuple[tuple[str, str], ...] = ()

    def missing(self) -> list[str]:
        """The ``pip install`` extras this env needs that are not importable here."""
        out = []
        for module, extra in self.requires:
            try:
                importlib.util.find_spec(module)
            except (ImportError, ValueError):
                out.append(extra)
                continue
            if importlib.util.find_spec(module) is None:
                out.append(extra)
        return sorted(set(out))


_SPECS: dict[str, BranchSpec] = {}


def register(
    id: str,
    entry_point: str | Callable[..., gym.Env],
    *,
    snapshot: str = "native",
    kind: str = "state",
    picklable: bool = True,
    description: str = "",
    requires: tuple[tuple[str, str], ...] = (),
    max_episode_steps: int | None = None,
    kwargs: dict[str, Any] | None = None,
    **gym_kwargs: Any,
) -> BranchSpec:
    """Register an env in Gymnasium's registry and declare its snapshot support.

    Args:
        id: Gymnasium id, e.g. ``myorg/Sandbox-v0``.
        entry_point: ``"module:Class"`` or a callable returning the env.
        snapshot: ``native`` if the env is a :class:`~branchgym.SnapshottableEnv`;
            ``pickle`` or ``replay`` to have ``gym.make`` add that strategy wrapper.
        kind: The snapshot kind it produces (``state``, ``pickle``, ``replay``, ...).
        picklable: Whether its snapshots pickle.
        description: One line shown by ``branchgym list``.
        requires: ``(module, extra)`` pairs: modules the env imports and the pip extra
            that provides each, so ``branchgym list`` can say what is missing.
        max_episode_steps: Adds Gymnasium's ``TimeLimit`` (its counter is snapshotted).
        kwargs: Default constructor kwargs.
        **gym_kwargs: Passed to ``gymnasium.register``.
    """
    if snapshot not in ("native", *_STRATEGY_WRAPPERS):
        raise RegistrationError(
            f"snapshot={snapshot!r} is not a strategy; use 'native' for a SnapshottableEnv, "
            "'pickle' (deep copy) or 'replay' (reset + replay) for any other gymnasium.Env."
        )
    if not isinstance(id, str) or not id:
        raise RegistrationError(
            f"env id must be a non-empty string like 'myorg/Env-v0', got {id!r}"
        )
    wrappers = []
    if snapshot in _STRATEGY_WRAPPERS:
        path = _STRATEGY_WRAPPERS[snapshot]
        wrappers.append(WrapperSpec(path.rsplit(":", 1)[1], path, {}))
    wrappers.append(WrapperSpec("SnapshotAPI", "branchgym.core:SnapshotAPI", {}))
    gym.register(
        id=id,
        entry_point=entry_point,
        max_episode_steps=max_episode_steps,
        kwargs=kwargs or {},
        additional_wrappers=tuple(wrappers),
        **gym_kwargs,
    )
    spec = BranchSpec(id, snapshot, kind, picklable, description, tuple(requires))
    _SPECS[id] = spec
    return spec


def unregister(env_id: str) -> None:
    """Remove an env :func:`register` added, from Gymnasium's registry and branchgym's.

    For envs a test or a notebook registers for a while: studies that walk every
    registered env (``branchgym bench snapshot``, ``branchgym list``) stop seeing it.

    Raises:
        UnknownEnvError: ``env_id`` was not registered through :func:`register`.
    """
    if env_id not in _SPECS:
        raise UnknownEnvError(_unknown_message(env_id))
    del _SPECS[env_id]
    gym.registry.pop(env_id, None)


def branch_specs() -> list[BranchSpec]:
    """Every env registered through :func:`register`, in registration order."""
    return list(_SPECS.values())


def branch_spec(env_id: str) -> BranchSpec:
    """The :class:`BranchSpec` of ``env_id`` (raises :class:`UnknownEnvError` with a suggestion)."""
    if env_id in _SPECS:
        return _SPECS[env_id]
    raise UnknownEnvError(_unknown_message(env_id))


def _unknown_message(env_id: str) -> str:
    ids = list(_SPECS) + [i for i in gym.registry if i not in _SPECS]
    close = difflib.get_close_matches(env_id, ids, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    return (
        f"no environment is registered as {env_id!r}.{hint} Run `branchgym list` for the ids "
        "branchgym registers, and import the module that registers yours."
    )


def make(env_id: str, **kwargs: Any) -> gym.Env:
    """``gymnasium.make`` with branchgym's error for unknown ids ("Did you mean ...")."""
    if env_id not in gym.registry and ":" not in env_id:
        raise UnknownEnvError(_unknown_message(env_id))
    return gym.make(env_id, **kwargs)


def env_factory(target: str) -> tuple[str, Callable[[], gym.Env]]:
    """Resolve what a user typed into ``(name, zero-argument factory)``.

    ``target`` is a registered id (``branchgym/TreeMDP-v0``), Gymnasium's
    ``module:id`` form, or ``module:attr`` naming an env class or zero-argument factory.
    """
    if ":" in target:
        module, attr = target.split(":", 1)
        if "/" in attr or "-v" in attr:
            return attr, lambda: gym.make(target)
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            raise UnknownEnvError(
                f"cannot import module {module!r} from {target!r} ({exc}); check the spelling "
                "and that the package is installed in this environment."
            ) from exc
        obj: Any = mod
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise UnknownEnvError(f"module {module!r} has no attribute {attr!r}")
            obj = getattr(obj, part)
        if not callable(obj):
            raise UnknownEnvError(f"{target} is not an env class or a factory function")
        return target, obj
    if target not in gym.registry:
        raise UnknownEnvError(_unknown_message(target))
    return target, lambda: gym.make(target)
