"""Every branchgym env in skyrl-gym's registry, as a ``BaseTextEnv`` with snapshot and restore.

``register_skyrl_envs()`` registers each env of :func:`branchgym.branch_specs` under its
own id (``branchgym/TextTreeMDP-v0``), so SkyRL builds it the way it builds its own:

    import skyrl_gym
    from branchgym.integrations.skyrl import register_skyrl_envs

    register_skyrl_envs()
    env = skyrl_gym.make("branchgym/WebShop-v0", env_config={}, extras={"seed": 3})
    conversation, meta = env.init([{"role": "system", "content": "..."}])
    out = env.step("search[hoodie]")  # {observations, reward, done, metadata}

``env_config`` holds the keyword arguments of ``branchgym.make`` (or ``url``/``token``
to use a served env through :class:`branchgym.remote.RemoteEnv`); ``extras`` (a dataset
row's extra fields) may give the reset ``seed``, reset ``options`` and ``max_turns``.
``snapshot()`` and ``restore()`` pass through to the branchgym env (turn count included),
so a SkyRL rollout can fork. ``pip install 'branchgym[skyrl]'``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import gymnasium as gym

from branchgym.core import Snapshot, restore, snapshot
from branchgym.error import DependencyMissingError, InvalidActionError, OptionError

try:
    import skyrl_gym
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra("the skyrl-gym adapter", "skyrl", "skyrl_gym") from exc

__all__ = ["BranchgymTextEnv", "SkyRLSnapshot", "register_skyrl_envs", "DEFAULT_MAX_TURNS"]

#: Turns before ``done`` when neither ``extras`` nor the env's time limit says.
DEFAULT_MAX_TURNS = 50


@dataclasses.dataclass
class SkyRLSnapshot:
    """A branchgym snapshot of the env plus the adapter's turn count and return so far."""

    snapshot: Snapshot
    turns: int
    episode_return: float

    def release(self) -> None:
        """Release the branchgym snapshot."""
        self.snapshot.release()

    def __enter__(self) -> SkyRLSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _as_dict(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, Mapping) or hasattr(value, "items"):  # dict, OmegaConf DictConfig
        return {str(k): v for k, v in value.items()}
    raise OptionError(f"{what} must be a mapping, got {type(value).__name__}")


class BranchgymTextEnv(BaseTextEnv):
    """A branchgym env behind skyrl-gym's text interface.

    Args:
        env_config: ``branchgym.make`` keyword arguments, or ``{"url": ..., "token": ...}``
            for a served env.
        extras: ``seed`` and ``options`` of the reset, ``max_turns``.
        env_id: The registered branchgym id (set by :func:`register_skyrl_envs`).
    """

    def __init__(
        self, env_config: Any = None, extras: Any = None, *, env_id: str | None = None
    ) -> None:
        """Build the branchgym env."""
        super().__init__()
        config = _as_dict(env_config, "env_config")
        self.extras = _as_dict(extras, "extras")
        if "url" in config:
            from branchgym.remote import RemoteEnv

            self.env: gym.Env = RemoteEnv(config.pop("url"), token=config.pop("token", None))
        else:
            if not env_id:
                raise OptionError("BranchgymTextEnv needs env_id (or env_config['url'])")
            import branchgym

            self.env = branchgym.make(env_id, **config)
        limit = getattr(self.env.spec, "max_episode_steps", None) if self.env.spec else None
        self.max_turns = int(self.extras.get("max_turns") or limit or DEFAULT_MAX_TURNS)
        self.episode_return = 0.0
        self.last_info: dict[str, Any] = {}

    # -- rendering ---------------------------------------------------------------------
    @staticmethod
    def _message(obs: Any) -> list[dict[str, str]]:
        return [{"role": "user", "content": obs if isinstance(obs, str) else str(obs)}]

    def _action(self, action: str) -> Any:
        space = self.env.action_space
        if isinstance(space, gym.spaces.Text):
            return action
        if isinstance(space, gym.spaces.Discrete):
            try:
                value = int(str(action).strip())
            except ValueError:
                value = None
            if value is None or not space.contains(value):
                raise InvalidActionError(
                    f"this env's actions are integers {space.start}..{space.start + space.n - 1}; "
                    f"got {action!r}"
                )
            return value
        raise InvalidActionError(
            f"the skyrl-gym adapter drives text or discrete action spaces, not {space}"
        )

    # -- BaseTextEnv -------------------------------------------------------------------
    def init(self, prompt: list[dict[str, str]]) -> tuple[list[dict[str, str]], dict[str, Any]]:
        """Reset the env; the prompt followed by its first observation as a user message."""
        obs, info = self.env.reset(seed=self.extras.get("seed"), options=self.extras.get("options"))
        self.turns, self.episode_return, self.last_info = 0, 0.0, info
        return list(prompt or []) + self._message(obs), {"info": info}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """One turn: the action goes to the env; the next observation comes back."""
        obs, reward, terminated, truncated, info = self.env.step(self._action(action))
        self.turns += 1
        self.episode_return += float(reward)
        self.last_info = info
        done = bool(terminated or truncated or self.turns >= self.max_turns)
        return BaseTextEnvStepOutput(
            observations=[] if done else self._message(obs),
            reward=float(reward),
            done=done,
            metadata={"info": info, "terminated": bool(terminated), "truncated": bool(truncated)},
            postprocessed_action=None,
        )

    def get_metrics(self) -> dict[str, Any]:
        """Turns, return and (when the env reports it) whether the episode was won."""
        out: dict[str, Any] = {"turns": self.turns, "return": self.episode_return}
        if "won" in self.last_info:
            out["won"] = float(bool(self.last_info["won"]))
        return out

    def close(self) -> None:
        """Close the branchgym env."""
        self.env.close()

    # -- branching ---------------------------------------------------------------------
    def snapshot(self) -> SkyRLSnapshot:
        """Snapshot the env (its whole wrapper stack) and the adapter's turn count."""
        return SkyRLSnapshot(snapshot(self.env), self.turns, self.episode_return)

    def restore(self, snap: SkyRLSnapshot) -> list[dict[str, str]]:
        """Bring back a snapshot; returns the restored observation as a user message."""
        if not isinstance(snap, SkyRLSnapshot):
            from branchgym.error import SnapshotMismatchError

            raise SnapshotMismatchError(
                f"restore() takes what this env's snapshot() returned, got {type(snap).__name__}"
            )
        obs, info = restore(self.env, snap.snapshot)
        self.turns, self.episode_return, self.last_info = snap.turns, snap.episode_return, info
        return self._message(obs)


def register_skyrl_envs(ids: list[str] | None = None) -> list[str]:
    """Register branchgym envs in ``skyrl_gym``'s registry (all by default). Idempotent.

    Returns:
        The ids now registered by branchgym.
    """
    import branchgym

    wanted = ids if ids is not None else [s.id for s in branchgym.branch_specs()]
    entry = f"{__name__}:BranchgymTextEnv"
    done = []
    for env_id in wanted:
        branchgym.branch_spec(env_id)  # unknown ids raise UnknownEnvError with a suggestion
        existing = skyrl_gym.registry.get(env_id)
        if existing is None:
            skyrl_gym.register(id=env_id, entry_point=entry, kwargs={"env_id": env_id})
        elif existing.entry_point != entry:
            raise OptionError(
                f"skyrl_gym already has an env {env_id!r} from {existing.entry_point}; "
                "deregister it first"
            )
        done.append(env_id)
    return done
