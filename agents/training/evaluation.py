"""Evaluation during training: the fixed-seed evaluation set and exact values.

* :func:`evaluate`: success and return of a policy over fixed reset seeds, paired across
  checkpoints (:class:`EvalResult`).
* :func:`exact_value`: exact evaluation of a scoring policy on TextTreeMDP, no
  sampling noise at all (below).

In a tree MDP every state has a unique history, so the dialogue a policy sees in a state
is a function of the state alone, and a policy over the admissible actions is a table
``pi[node, action]``. :func:`exact_value` builds that table by asking the policy for its
distribution in every reachable non-terminal state, then computes the expected return
``V^pi(s_0)`` by backward induction (:meth:`TreeStructure.moments`). With Bernoulli
rewards that is the success probability itself, so "did training improve success" is
answered exactly instead of by a noisy estimate.

The dialogues come from the env itself, through its public snapshot interface: from a
snapshot of each state, every action is taken after restoring and reseeding until each
of its possible next states has been seen (their list is known from the tree), so the
observations are exactly the env's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

import branchgym
from branchgym.error import TrainingConfigError
from branchgym.rollout.executor_base import EnvRecipe, Executor
from branchgym.rollout.grow import group_rollouts
from branchgym.rollout.policy import Context, Turn
from branchgym.rollout.tree import success_of

__all__ = [
    "EvalResult",
    "ExactValue",
    "evaluate",
    "exact_value",
    "supports_exact",
]

#: restores per wanted next state before giving up (a child of probability 1e-3 needs ~1e3)
MAX_TRIES = 20_000


@dataclasses.dataclass(frozen=True)
class ExactValue:
    """The exact expected return of a policy and the table it was computed from.

    Attributes:
        value: ``V^pi(s_0)`` (the success probability for Bernoulli rewards).
        table: ``(n_nodes, n_actions)`` the policy's action probabilities (uniform rows
            for states it never reaches or that are terminal).
        states: Non-terminal states visited.
    """

    value: float
    table: np.ndarray
    states: int


def supports_exact(spec: EnvRecipe, policy: Any) -> bool:
    """Whether :func:`exact_value` applies: a TextTreeMDP env and a scoring policy."""
    from branchgym.agents.policies.scoring import ScoringPolicy

    inner = getattr(policy, "policy", policy)  # the run's autocast wrapper
    return isinstance(inner, ScoringPolicy) and spec.id == "branchgym/TextTreeMDP-v0"


def exact_value(spec: EnvRecipe, policy: Any, *, max_states: int = 5_000) -> ExactValue:
    """``V^pi(s_0)`` of a scoring policy (:mod:`~branchgym.agents.policies.scoring`), TextTreeMDP.

    Args:
        spec: The TextTreeMDP spec (``EnvRecipe("branchgym/TextTreeMDP-v0", kwargs)``).
        policy: A scoring policy (its ``distribution(context)`` gives ``pi(.|s)``).
        max_states: Refuse mazes with more non-terminal states than this.

    Returns:
        :class:`ExactValue`.
    """
    inner = getattr(policy, "policy", policy)
    if not supports_exact(spec, policy):
        raise TrainingConfigError(
            "exact evaluation needs branchgym/TextTreeMDP-v0 and the scoring policy (a "
            "distribution over the admissible actions); use the sampled evaluation otherwise."
        )
    env = spec.make()
    stack: list[tuple[Any, Context]] = []
    try:
        base = env.unwrapped
        tree = base.tree
        inner_states = int(sum(not tree.is_terminal(s) for s in range(tree.n_nodes)))
        if inner_states > max_states:
            raise TrainingConfigError(
                f"the maze has {inner_states} non-terminal states (> max_states={max_states}); "
                "evaluate it by sampling."
            )
        index = {a: i for i, a in enumerate(base.actions)}
        table = np.full((tree.n_nodes, tree.n_actions), 1.0 / tree.n_actions)
        obs, info = env.reset(seed=0)
        stack.append((branchgym.snapshot(env), Context(spec.id, obs, dict(info))))
        reseed = 0
        visited = 0
        while stack:
            snap, ctx = stack.pop()
            node = int(ctx.current_info["node"])
            cands, p = inner.distribution(ctx)
            table[node] = 0.0
            for a, prob in zip(cands.actions, p, strict=True):
                table[node, index[a]] = prob
            visited += 1
            for ci, a in enumerate(cands.actions):
                ai = index[a]
                want = {
                    int(c)
                    for c, q in zip(tree.children[node, ai], tree.probs[node, ai], strict=True)
                    if c >= 0 and q > 0 and not tree.is_terminal(int(c))
                }
                tries = 0
                while want:
                    branchgym.restore(env, snap)
                    branchgym.reseed(env, reseed)
                    reseed += 1
                    obs, _, terminated, truncated, info = env.step(a)
                    child = int(info["node"])
                    if child in want and not (terminated or truncated):
                        want.discard(child)
                        turn = Turn(cands.texts[ci], cands.token_ids[ci], a, obs, dict(info))
                        stack.append((branchgym.snapshot(env), ctx.extend(turn)))
                    tries += 1
                    if tries > MAX_TRIES:
                        raise TrainingConfigError(
                            f"state {node}, action {a!r}: next states {sorted(want)} never "
                            f"appeared in {MAX_TRIES} restores; the env's transitions do not "
                            "match its tree (a fidelity bug?)."
                        )
            snap.release()
        value = float(tree.moments(table)[0][0])
        return ExactValue(value, table, visited)
    finally:
        for snap, _ in stack:  # left over after an error
            snap.release()
        env.close()


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Success and return over the fixed evaluation set (standard errors across episodes).

    Attributes:
        episodes: Episodes run.
        success: Share that succeeded.
        success_se: Its standard error.
        ret: Mean return.
        ret_se: Its standard error.
        invalid_frac: Share of decisions whose reply was not a valid action.
        exact: The exact expected return, where computable (TextTreeMDP + scoring).
    """

    episodes: int
    success: float
    success_se: float
    ret: float
    ret_se: float
    invalid_frac: float = 0.0
    exact: float | None = None

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """Namespaced floats."""
        out = {
            f"{prefix}success": self.success,
            f"{prefix}success_se": self.success_se,
            f"{prefix}return": self.ret,
            f"{prefix}return_se": self.ret_se,
            f"{prefix}invalid_frac": self.invalid_frac,
        }
        if self.exact is not None:
            out[f"{prefix}exact_value"] = self.exact
        return out


def evaluate(
    spec: EnvRecipe,
    policy: Any,
    *,
    episodes: int,
    seed: int,
    executor: Executor | None = None,
    max_steps: int | None = None,
    success_threshold: float = 1.0,
    exact: bool = True,
) -> EvalResult:
    """Run ``policy`` once on each of ``episodes`` fixed reset seeds (``seed + i``).

    The policy's sampling for episode ``i`` is seeded with ``(seed, i)``, so two
    evaluations of different checkpoints are paired (common random numbers). On
    TextTreeMDP with the scoring policy the exact expected return is added
    (:func:`branchgym.agents.training.evaluation.exact_value`).
    """
    succ, rets, invalid = [], [], []
    for i in range(episodes):
        tree = group_rollouts(
            spec,
            policy,
            1,
            seed=seed + i,
            executor=executor,
            max_steps=max_steps,
            rng=np.random.default_rng([seed, i]),
        )
        path = tree.paths()[0] if tree.paths() else []
        rets.append(float(tree.path_returns_to_go(path)[0]) if path else 0.0)
        succ.append(float(success_of(tree, path, success_threshold)))
        invalid.extend(tree[n].parse_error is not None for n in path)
    value = None
    if exact and supports_exact(spec, policy):
        value = exact_value(spec, policy).value
    n = max(episodes, 1)

    def se(x: list[float]) -> float:
        return float(np.std(x, ddof=1) / math.sqrt(n)) if len(x) > 1 else 0.0

    return EvalResult(
        episodes,
        float(np.mean(succ)) if succ else 0.0,
        se(succ),
        float(np.mean(rets)) if rets else 0.0,
        se(rets),
        float(np.mean(invalid)) if invalid else 0.0,
        value,
    )
