"""A branchgym env as an OpenEnv ``Environment``: its action, observation and state models.

:class:`BranchgymEnvironment` wraps one ``gym.make`` stack; the server
(:mod:`branchgym.serve.server`) holds one per session, and OpenEnv's own ``HTTPEnvServer``
builds them for its stateless HTTP routes.
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Callable
from typing import Any

import gymnasium as gym

from branchgym.core import Snapshot, reseed, restore, snapshot
from branchgym.error import DependencyMissingError, ResetNeededError
from branchgym.serve.wire import decode, encode


def _import_openenv_server() -> None:
    """Import OpenEnv's server package without its Gradio web UI.

    ``openenv.core.env_server``'s ``__init__`` imports its Gradio web interface when gradio
    is installed (6-13 s on a 2-core machine, most of a server's start-up); the branchgym
    server never mounts that UI, and OpenEnv's ``__init__`` falls back to ``None`` when the
    module is missing. The block lasts for this one import only: a later explicit import of
    ``openenv.core.env_server.web_interface`` loads it as usual.
    """
    name = "openenv.core.env_server.web_interface"
    if "openenv.core.env_server" in sys.modules or name in sys.modules:
        return
    sys.modules[name] = None  # type: ignore[assignment]  # makes the import raise
    try:
        import openenv.core.env_server  # noqa: F401
    finally:
        if sys.modules.get(name, 0) is None:
            del sys.modules[name]


try:
    _import_openenv_server()
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import Field
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra("branchgym serve", "serve", "openenv") from exc

__all__ = [
    "BranchgymAction",
    "BranchgymObservation",
    "BranchgymState",
    "BranchgymEnvironment",
    "Refusal",
]


class BranchgymAction(Action):
    """An action for a served env: ``{"action": ...}`` (encoded by ``branchgym.serve.wire``)."""

    action: Any = Field(..., description="the env's action: a string for text envs")


class BranchgymObservation(Observation):
    """A served env's observation with Gymnasium's ``info``, ``terminated`` and ``truncated``."""

    observation: Any = Field(default=None, description="the env's observation (wire-encoded)")
    info: dict[str, Any] = Field(default_factory=dict, description="the env's info dict")
    terminated: bool = Field(default=False, description="the episode ended in the MDP")
    truncated: bool = Field(default=False, description="the episode was cut (time limit)")


class BranchgymState(State):
    """OpenEnv's state plus the env id and whether the episode is over."""

    env_id: str = Field(default="", description="the served env's registered id")
    done: bool = Field(default=False, description="terminated or truncated")


class Refusal(Exception):
    """A request the protocol refuses: carries its error code and the branchgym error type.

    Attributes:
        code: One of :data:`branchgym.serve.wire.ERROR_CODES`.
        error_type: The ``branchgym.error`` class a client should raise, if any.
    """

    def __init__(self, code: str, message: str, error_type: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.error_type = error_type


class BranchgymEnvironment(Environment[BranchgymAction, BranchgymObservation, BranchgymState]):
    """A branchgym env (a ``gym.make`` stack) as an OpenEnv ``Environment``.

    Steps after the episode ended are refused (``EPISODE_DONE``) until a reset or a
    restore: Gymnasium leaves them undefined, and a remote caller should hear about it.
    """

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, make_env: Callable[[], gym.Env], env_id: str = "") -> None:
        """Build one env instance with ``make_env``."""
        super().__init__()
        self.env = make_env()
        self.env_id = env_id
        self.done = False
        self.step_count = 0
        self.episode_id: str | None = None

    @staticmethod
    def _observation(obs: Any, info: dict, reward: Any = None, term=False, trunc=False):
        return BranchgymObservation(
            observation=encode(obs),
            info=encode(dict(info)),
            reward=None if reward is None else float(reward),
            done=bool(term or trunc),
            terminated=bool(term),
            truncated=bool(trunc),
        )

    def reset(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        options: dict[str, Any] | None = None,
        reseed: int | None = None,
        **kwargs: Any,
    ) -> BranchgymObservation:
        """Reset the env; ``reseed`` then gives it a fresh RNG (a branching sibling)."""
        obs, info = self.env.reset(seed=seed, options=decode(options) if options else None)
        self._reseed(reseed)
        self.done, self.step_count = False, 0
        self.episode_id = episode_id or secrets.token_hex(8)
        return self._observation(obs, info)

    def step(
        self, action: BranchgymAction, timeout_s: float | None = None, **kwargs: Any
    ) -> BranchgymObservation:
        """Step the env with the decoded action."""
        if self.done:
            raise Refusal(
                "EPISODE_DONE",
                "the episode is over (terminated or truncated); reset, or restore a snapshot, "
                "before stepping again",
                ResetNeededError.__name__,
            )
        value = decode(action.action) if isinstance(action, BranchgymAction) else action
        obs, reward, term, trunc, info = self.env.step(value)
        self.done = bool(term or trunc)
        self.step_count += 1
        return self._observation(obs, info, reward, term, trunc)

    @property
    def state(self) -> BranchgymState:
        """Episode id, steps taken and whether the episode is over."""
        return BranchgymState(
            episode_id=self.episode_id, step_count=self.step_count, env_id=self.env_id,
            done=self.done,
        )  # fmt: skip

    def snapshot(self) -> Snapshot:
        """Snapshot the whole stack."""
        return snapshot(self.env)

    def restore(self, snap: Snapshot, done: bool, steps: int, reseed: int | None = None):
        """Restore ``snap`` (taken when the episode was ``done`` after ``steps`` steps)."""
        obs, info = restore(self.env, snap)
        self._reseed(reseed)
        self.done, self.step_count = done, steps
        return self._observation(obs, info)

    def _reseed(self, seed: int | None) -> None:
        if seed is not None:
            reseed(self.env, int(seed))

    def close(self) -> None:
        """Close the env."""
        self.env.close()
