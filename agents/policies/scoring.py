"""A policy for tiny models: score the admissible actions instead of generating freely.

A random or barely trained model almost never writes a valid action, so a reinforcement
signal never appears. :class:`ScoringPolicy` asks the model for the log-probability of
every admissible action's reply (``"Action: go north"`` and the end-of-turn token) in
the dialogue so far and samples from the softmax over those sequence log-probs::

    pi(a | s) = exp(log p_LM(reply(a) | s)) / sum_b exp(log p_LM(reply(b) | s))

The sampled reply enters the dialogue as its token ids, exactly as a generated reply
does, so :class:`~branchgym.agents.policies.policy.LLMPolicy` and this policy build the same
prompts and a model trained with one can be run with the other.

What the rollout tree records stays consistent with the engine's bookkeeping: a
distribution over whole token sequences induces, at each token, a next-token
distribution (the mass of the candidates that continue with it), so the node's
per-token log-probs are those exact conditionals (they sum to ``log pi(a | s)``) and
its per-token entropies are their entropies
(:func:`~branchgym.agents.policies.policy.sequence_distribution`). By the chain rule of entropy
the expected sum of those per-token entropies is the decision entropy ``H(pi(.|s))``
(algorithms.md eq. 3); it is exact when the candidates differ at one token only, as TextTreeMDP's
exits do (``go north`` / ``go east``). Forced prefixes (BranchOPD's forks inside a
turn) restrict the candidates to those that start with the prefix.

:func:`candidate_logprobs` is the differentiable counterpart the learners call to
recompute ``log pi_theta`` of the recorded tokens with gradients (and the reference's
and teacher's without).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from branchgym.agents.policies.policy import LLMPolicy, sequence_distribution
from branchgym.error import DependencyMissingError, TrainingConfigError
from branchgym.rollout.policy import (
    ActionSample,
    ActRequest,
    Context,
    admissible_actions,
    sample_rng,
)

try:
    import torch
    from torch import Tensor
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra(
        "branchgym.agents.policies.scoring", "llm", "torch"
    ) from exc

__all__ = ["DEFAULT_TEMPLATE", "Candidates", "ScoringPolicy", "trie_logprobs"]

#: How an admissible action is written as a reply (the ReAct format the prompts ask for).
DEFAULT_TEMPLATE = "Action: {action}"


@dataclasses.dataclass(frozen=True)
class Candidates:
    """The admissible replies in one state, as token sequences.

    Attributes:
        actions: The env actions, deduplicated, in the env's order.
        texts: The reply text of each.
        token_ids: The reply's tokens, each ending with the stop token.
    """

    actions: tuple[str, ...]
    texts: tuple[str, ...]
    token_ids: tuple[tuple[int, ...], ...]

    def index(self, token_ids: Sequence[int]) -> int:
        """Which candidate ``token_ids`` is (a :class:`TrainingConfigError` if none)."""
        key = tuple(int(t) for t in token_ids)
        try:
            return self.token_ids.index(key)
        except ValueError:
            raise TrainingConfigError(
                f"tokens {list(key)} are none of the admissible replies {list(self.texts)}; "
                "a tree grown with policy='generate' cannot be rescored with policy='scoring'."
            ) from None


class ScoringPolicy(LLMPolicy):
    """Sample among the admissible actions by their sequence log-probs under the LLM.

    Args:
        engine: An engine with ``score``, ``encode``, ``decode`` and ``stop_token_ids``
            (:class:`~branchgym.agents.engines.hf.HFEngine`); its prefix cache makes the
            shared prompt cost one prefill per state.
        prompt: A prompt builder (default: the one registered for the env id).
        template: Reply text of an action; ``{action}`` is replaced by it.
        max_candidates: Refuse states with more admissible actions than this (a typed
            error, instead of a silent slow-down).
    """

    def __init__(
        self,
        engine: Any,
        prompt: Any = None,
        *,
        template: str = DEFAULT_TEMPLATE,
        max_candidates: int = 256,
    ) -> None:
        """Bind the engine and the reply template."""
        super().__init__(engine, prompt)
        if "{action}" not in template:
            raise TrainingConfigError(
                f"the scoring template {template!r} has no '{{action}}' field; e.g. 'Action: "
                "{action}'."
            )
        if not engine.stop_token_ids:
            raise TrainingConfigError(
                "the scoring policy ends every reply with a stop token, but the engine has "
                "none; give HFEngine(..., stop_token_ids=[...])."
            )
        self.template = template
        self.max_candidates = int(max_candidates)
        self._encoded: dict[str, tuple[int, ...]] = {}

    def candidates(self, context: Context) -> Candidates:
        """The admissible replies of the state ``context`` ends in."""
        acts = admissible_actions(context.current_info)
        if not acts:
            raise TrainingConfigError(
                f"{context.env_id} lists no admissible actions at step {context.step}, so "
                "the scoring policy has nothing to score; use policy='generate' for envs "
                "without info['admissible_actions']."
            )
        acts = list(dict.fromkeys(acts))
        if len(acts) > self.max_candidates:
            raise TrainingConfigError(
                f"{len(acts)} admissible actions exceed max_candidates={self.max_candidates}; "
                "raise it or use policy='generate'."
            )
        stop = int(self.engine.stop_token_ids[0])
        texts, ids = [], []
        for a in acts:
            text = self.template.format(action=a)
            if text not in self._encoded:
                if len(self._encoded) > 100_000:  # WebShop's ever new product pages
                    self._encoded.clear()
                self._encoded[text] = (*self.engine.encode(text), stop)
            texts.append(text)
            ids.append(self._encoded[text])
        if len(set(ids)) != len(ids):
            raise TrainingConfigError(
                f"two admissible actions of {context.env_id} encode to the same tokens "
                f"({acts}); the template must keep them apart."
            )
        return Candidates(tuple(acts), tuple(texts), tuple(ids))

    def distribution(self, context: Context) -> tuple[Candidates, np.ndarray]:
        """The candidates and ``pi(a | s)`` over them (float64, sums to 1)."""
        cands = self.candidates(context)
        scored = self.engine.score(self.prompt_ids(context), list(cands.token_ids))
        seq = np.array([float(np.sum(lp, dtype=np.float64)) for lp, _ in scored])
        p = np.exp(seq - seq.max())
        return cands, p / p.sum()

    def act(
        self, requests: Sequence[ActRequest], rng: np.random.Generator
    ) -> list[list[ActionSample]]:
        """Sample ``n`` admissible replies per request from the softmax over candidates."""
        out = []
        for req in requests:
            cands, p = self.distribution(req.context)
            prefix = tuple(int(t) for t in req.prefix_token_ids)
            ok = np.array([s[: len(prefix)] == prefix for s in cands.token_ids])
            if not ok.any():
                raise TrainingConfigError(
                    f"no admissible reply starts with the forced prefix {list(prefix)}"
                )
            cond = np.where(ok, p, 0.0)
            cond = cond / cond.sum()
            samples = []
            for j in range(req.n):
                i = int(sample_rng(req, j, rng).choice(len(cond), p=cond))
                lp, ent = sequence_distribution(cands.token_ids, p, i, prefix_len=len(prefix))
                samples.append(
                    ActionSample(
                        action=cands.actions[i],
                        text=cands.texts[i],
                        token_ids=np.asarray(cands.token_ids[i], dtype=np.int64),
                        logprobs=lp,
                        entropies=ent,
                        entropies_top20=ent,
                        prefix_len=len(prefix),
                    )
                )
            out.append(samples)
        return out


def trie_logprobs(log_pi: Tensor, candidates: Sequence[Sequence[int]], chosen: int) -> Tensor:
    """Per-token conditional log-probs of candidate ``chosen`` under ``pi`` (differentiable).

    At token ``j`` the conditional is ``log P(prefix_{j+1}) - log P(prefix_j)``, where
    ``P(prefix)`` sums ``pi`` over the candidates that start with it; the sum over the
    tokens is ``log pi(chosen)``. This is
    :func:`~branchgym.agents.policies.policy.sequence_distribution`
    in torch.

    Args:
        log_pi: ``(C,)`` log-probabilities of the candidates (a log-softmax).
        candidates: Token sequences of the C candidates.
        chosen: Index of the sequence to score.

    Returns:
        ``(len(candidates[chosen]),)`` tensor.
    """
    target = tuple(candidates[chosen])
    n = len(target)
    # alive[j, c]: candidate c starts with target[:j]
    alive = torch.tensor(
        [[tuple(c[:j]) == target[:j] for c in candidates] for j in range(n + 1)],
        device=log_pi.device,
    )
    mass = torch.logsumexp(log_pi.unsqueeze(0).masked_fill(~alive, float("-inf")), dim=-1)
    return mass[1:] - mass[:-1]
