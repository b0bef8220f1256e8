"""The policy protocol: what the branching engine asks a policy and what it gets back.

The engine (:mod:`branchgym.rollout.grow`) asks a :class:`Policy` for actions in batches of
:class:`ActRequest` (a context, how many samples, and optionally token ids the action
must start with, for forks inside a turn) and gets :class:`ActionSample` objects back:
the env action, its text, token ids, the behaviour policy's per-token log-probs and
exact per-token entropies (algorithms.md eq. 3), and the top-20 estimate when the engine has it
(BranchOPD's ``U_t``).

This module is core: it imports nothing from ``branchgym.agents``. Concrete policies
(tabular, text, scripted, LLM) live in :mod:`branchgym.agents.policies.policy`, which re-exports
these names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "Turn",
    "Context",
    "ActRequest",
    "ActionSample",
    "Policy",
    "admissible_actions",
    "sample_rng",
]


def admissible_actions(info: dict[str, Any] | None) -> list[str] | None:
    """The env's list of valid actions, if it gives one (WebShop/TextTreeMDP or ALFWorld key)."""
    if not isinstance(info, dict):
        return None
    for key in ("admissible_actions", "admissible_commands"):
        acts = info.get(key)
        if acts is not None:
            return [str(a) for a in acts]
    return None


@dataclasses.dataclass(frozen=True)
class Turn:
    """One exchange of the dialogue: the agent's action and what the env answered."""

    text: str
    token_ids: tuple[int, ...]
    action: Any
    observation: Any
    info: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Context:
    """What a policy sees: the reset observation and every turn since.

    Attributes:
        env_id: The env (prompt builders are chosen by it).
        observation: The reset observation.
        info: The reset info.
        turns: The dialogue so far.
    """

    env_id: str
    observation: Any
    info: dict[str, Any]
    turns: tuple[Turn, ...] = ()

    @property
    def step(self) -> int:
        """Decisions taken so far (the index of the next one)."""
        return len(self.turns)

    @property
    def current_observation(self) -> Any:
        """The observation the next action answers."""
        return self.turns[-1].observation if self.turns else self.observation

    @property
    def current_info(self) -> dict[str, Any]:
        """The info of the current state (admissible actions live here)."""
        return self.turns[-1].info if self.turns else self.info

    def extend(self, turn: Turn) -> Context:
        """A new context with one more turn."""
        return dataclasses.replace(self, turns=(*self.turns, turn))


@dataclasses.dataclass(frozen=True)
class ActRequest:
    """Ask for ``n`` actions in ``context``, each starting with ``prefix_token_ids``.

    ``rngs``, when given, holds one generator per sample: the rollout's own random
    stream (the engine derives it from the seed, the branch point and the sibling), so a
    sample does not depend on which other requests share the batch. A policy draws the
    ``j``-th sample from ``rngs[j]`` (see :func:`sample_rng`).
    """

    context: Context
    n: int = 1
    prefix_token_ids: tuple[int, ...] = ()
    rngs: tuple[Any, ...] = ()


def sample_rng(req: ActRequest, j: int, rng: Any) -> Any:
    """The generator of sample ``j`` of ``req``: its own stream, else the batch's ``rng``."""
    return req.rngs[j] if j < len(req.rngs) else rng


@dataclasses.dataclass
class ActionSample:
    """One sampled action with what the loss needs.

    Attributes:
        action: What to pass to ``env.step``.
        text: The generated text (the action's surface form for non-LLM policies).
        token_ids: The action's tokens (a forced prefix included).
        logprobs: Behaviour log-prob of each token.
        entropies: Exact entropy of the behaviour distribution at each token.
        entropies_top20: Entropy from the top-20 probabilities, when available.
        prefix_len: Leading tokens that were forced (copied), not sampled.
        parse_error: Why ``text`` is not a valid action (it is still sent to the env,
            which answers with its invalid-action feedback).
    """

    action: Any
    text: str
    token_ids: np.ndarray
    logprobs: np.ndarray
    entropies: np.ndarray
    entropies_top20: np.ndarray | None = None
    prefix_len: int = 0
    parse_error: str | None = None


@runtime_checkable
class Policy(Protocol):
    """Anything that turns contexts into sampled actions.

    ``act`` must sample from the same distribution it reports log-probs for
    (temperature 1, no truncation), because the learners treat it as ``pi_old``.
    """

    def act(
        self, requests: Sequence[ActRequest], rng: np.random.Generator
    ) -> list[list[ActionSample]]:
        """Return ``request.n`` samples for each request, in order."""
        ...
