"""Spec identity shared by the strategy wrappers."""

from __future__ import annotations

import gymnasium as gym

from branchgym.digest import stable_hash


def stack_identity(env: gym.Env) -> tuple[str, str]:
    """``(env_id, spec_hash)`` of the env below a strategy wrapper."""
    base = env.unwrapped
    spec = base.spec
    if spec is not None:
        env_id, config = spec.id, dict(spec.kwargs)
    else:
        env_id, config = f"{type(base).__module__}:{type(base).__qualname__}", {}
    try:
        return env_id, stable_hash(config)
    except TypeError:
        return env_id, stable_hash(repr(sorted(config.items(), key=lambda kv: kv[0])))
