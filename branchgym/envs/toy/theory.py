"""Exact quantities behind the branching claims of ``docs/algorithms.md``, on a TreeMDP.

Everything here is computed from a :class:`~branchgym.envs.toy.TreeStructure` and a
tabular policy (``(n_nodes, n_actions)`` or ``(n_actions,)``; ``None`` = uniform), by
exact forward/backward passes; no sampling. Tests and benchmarks print these next to
Monte Carlo measurements.

* Theorem 2 (law of total variance): ``Var(G | s_0) = sigma_t^2 + nu_t^2`` with
  ``sigma_t^2 = E[Var(G | s_t)]`` and ``nu_t^2 = Var(V(s_t))`` at depth ``t``
  (:func:`variance_decomposition`); the leave-one-out advantage of K independent
  rollouts (GRPO/RLOO) has variance ``K/(K-1) (sigma_t^2 + nu_t^2)`` and that of K
  siblings branched at depth ``t`` has ``K/(K-1) sigma_t^2``
  (:func:`advantage_variances`).
* Corollary 1: ``nu_t^2`` never decreases with ``t`` (``V(s_t)`` is a martingale), so
  deeper branch points remove more variance (:func:`decomposition_by_depth`).
* Unbiasedness of eq. (4): ``E[A_local | s, a] = Q(s, a) - V(s)``
  (:func:`sibling_advantage_mean`).
* Proposition 1 of Branching OPD: coverage ``1 - pi_old(a_0 | s_b)^k``
  (:func:`coverage_probability`, :func:`expected_coverage`).

TreeMDP pays rewards only on arrival at a leaf, so the return-to-go from a decision
state equals the episode's return and ``E[G | s_t] = V(s_t)``. Hand-built trees may have
leaves above depth ``t``; an episode that ended there is "frozen" at its leaf (its
return is then its leaf reward), which keeps the decomposition exact.

The module also has the small Monte Carlo helpers the tests and benches share
(:func:`sample_action`, :func:`rollout`, :func:`branch_siblings`,
:func:`independent_groups`, :func:`branched_groups`): siblings are made with the env's
own ``snapshot()``/``restore()``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from branchgym.envs.toy.tree_mdp import TreeStructure

__all__ = [
    "AdvantageVariances",
    "VarianceDecomposition",
    "advantage_variances",
    "branch_siblings",
    "branched_groups",
    "coverage_probability",
    "decomposition_by_depth",
    "expected_coverage",
    "frontier_distribution",
    "independent_groups",
    "rollout",
    "sample_action",
    "sibling_advantage_mean",
    "variance_decomposition",
]


def _tree(tree_or_env: Any) -> TreeStructure:
    tree = getattr(getattr(tree_or_env, "unwrapped", tree_or_env), "tree", tree_or_env)
    if not isinstance(tree, TreeStructure):
        raise TypeError(
            f"expected a TreeStructure or a TreeMDP env; got {type(tree_or_env).__name__}."
        )
    return tree


def _check_depth(tree: TreeStructure, depth: int) -> int:
    if isinstance(depth, bool) or int(depth) != depth or not 0 <= depth < tree.max_depth:
        raise ValueError(
            f"depth must be an int in [0, {tree.max_depth}) (a decision depth; the leaves "
            f"at {tree.max_depth} take no action); got {depth!r}."
        )
    return int(depth)


def frontier_distribution(tree_or_env: Any, policy: Any, depth: int) -> np.ndarray:
    """Probability of each node being the state at time ``depth`` under ``policy``.

    Mass sits on nodes at ``depth`` and on leaves above it (episodes that already
    ended); it sums to 1.
    """
    tree = _tree(tree_or_env)
    depth = _check_depth(tree, depth)
    pi = tree._policy(policy)
    reach = np.zeros(tree.n_nodes)
    reach[0] = 1.0
    for s in np.argsort(tree.depth, kind="stable"):
        if tree.depth[s] >= depth or reach[s] == 0.0 or tree.is_terminal(s):
            continue
        ch = tree.children[s]
        flow = reach[s] * pi[s][:, None] * tree.probs[s]
        np.add.at(reach, ch[ch >= 0], flow[ch >= 0])
        reach[s] = 0.0  # the mass moved on to the children
    return reach


def _conditional_moments(tree: TreeStructure, policy: Any) -> tuple[np.ndarray, np.ndarray]:
    """``E[G | node]`` and ``Var(G | node)`` for every node, G the episode's return."""
    v, v2, _, _ = tree.moments(policy)
    r1, r2 = tree._leaf_moments()
    leaf = np.array([tree.is_terminal(s) for s in range(tree.n_nodes)])
    # At a leaf the reward is already paid on arrival: G = its reward.
    mean = np.where(leaf, r1, v)
    var = np.where(leaf, r2 - r1**2, v2 - v**2)
    return mean, np.maximum(var, 0.0)


@dataclasses.dataclass(frozen=True)
class VarianceDecomposition:
    """Theorem 2's law of total variance at one depth.

    Attributes:
        depth: The branch depth ``t``.
        total: ``Var(G | s_0)``.
        sigma2: ``sigma_t^2 = E[Var(G | s_t)]``, the variance siblings still see.
        nu2: ``nu_t^2 = Var(V(s_t))``, the variance a shared prefix removes.
    """

    depth: int
    total: float
    sigma2: float
    nu2: float


def variance_decomposition(tree_or_env: Any, policy: Any, depth: int) -> VarianceDecomposition:
    """``Var(G|s_0) = sigma_t^2 + nu_t^2`` at ``depth`` (Theorem 2), exactly."""
    tree = _tree(tree_or_env)
    p = frontier_distribution(tree, policy, depth)
    mean, var = _conditional_moments(tree, policy)
    sigma2 = float(p @ var)
    m = float(p @ mean)
    nu2 = float(p @ (mean - m) ** 2)
    return VarianceDecomposition(int(depth), float(var[0]), sigma2, nu2)


def decomposition_by_depth(tree_or_env: Any, policy: Any = None) -> list[VarianceDecomposition]:
    """:func:`variance_decomposition` at every decision depth ``0 .. max_depth - 1``."""
    tree = _tree(tree_or_env)
    return [variance_decomposition(tree, policy, t) for t in range(tree.max_depth)]


@dataclasses.dataclass(frozen=True)
class AdvantageVariances:
    """Exact variances of the leave-one-out advantage under the two rollout topologies.

    Attributes:
        k: Group size K (siblings per branch point, or independent rollouts).
        grpo: ``K/(K-1) (sigma_t^2 + nu_t^2)``: K independent rollouts from ``s_0``.
        bpo: ``K/(K-1) sigma_t^2``: K siblings branched at depth ``t``.
    """

    k: int
    depth: int
    grpo: float
    bpo: float

    @property
    def difference(self) -> float:
        """``grpo - bpo = K/(K-1) nu_t^2 >= 0``."""
        return self.grpo - self.bpo

    @property
    def ratio(self) -> float:
        """``bpo / grpo = sigma_t^2 / Var(G | s_0)``, the exact advantage-variance ratio."""
        return self.bpo / self.grpo if self.grpo > 0 else float("nan")

    @property
    def reduction(self) -> float:
        """``1 - ratio``: the share of the advantage variance branching removes."""
        return 1.0 - self.ratio


def advantage_variances(tree_or_env: Any, policy: Any, depth: int, k: int) -> AdvantageVariances:
    """Theorem 2: ``Var(A^GRPO)`` and ``Var(A^BPO)`` for groups of ``k`` at ``depth``.

    Both are variances of the unnormalised leave-one-out advantage (eq. 4 /
    :func:`branchgym.agents.estimators.advantages.rloo_advantages`), whose mean is 0 in both cases.
    Every episode must reach ``depth`` undone, so that there is a state to branch at.
    """
    if isinstance(k, bool) or int(k) != k or k < 2:
        raise ValueError(f"k must be an int >= 2 (a leave-one-out baseline); got {k!r}.")
    tree = _tree(tree_or_env)
    p = frontier_distribution(tree, policy, depth)
    ended = [s for s in np.flatnonzero(p) if tree.is_terminal(s)]
    if ended:
        raise ValueError(
            f"episodes can end before depth {depth} (at leaves {ended[:5]}); Theorem 2 "
            "branches at a decision state, so pick a depth every episode reaches."
        )
    d = variance_decomposition(tree, policy, depth)
    f = k / (k - 1)
    return AdvantageVariances(int(k), d.depth, f * (d.sigma2 + d.nu2), f * d.sigma2)


def sibling_advantage_mean(
    tree_or_env: Any, policy: Any, state: int, action: int, k: int, baseline: str = "loo"
) -> float:
    """Exact ``E[A(t, k) | s_t = state, a_k = action]`` of a sibling advantage.

    ``baseline="loo"`` (eq. 4, the mean of the other K-1 siblings): ``Q(s, a) - V(s)``,
    unbiased. ``baseline="mean"`` (the mean of all K, the sibling itself included):
    ``(K-1)/K (Q(s, a) - V(s))``, the leave-one-out scaling.
    """
    tree = _tree(tree_or_env)
    if tree.is_terminal(state):
        raise ValueError(f"state {state} is a leaf; sibling advantages need a decision state.")
    _, _, q, _ = tree.moments(policy)
    v = tree._policy(policy)[state] @ q[state]
    gap = float(q[state, action] - v)
    if baseline == "loo":
        return gap
    if baseline == "mean":
        return (k - 1) / k * gap
    raise ValueError(f"baseline must be 'loo' or 'mean'; got {baseline!r}.")


def coverage_probability(p_main: Any, k: int) -> Any:
    """Proposition 1: ``Pr(some of k branches differs from the main token) = 1 - p^k``.

    ``p_main`` is ``pi_old(a_0 | s_b)``, the main trajectory's own token (or action)
    probability at the fork; each branch is drawn independently from ``pi_old(.|s_b)``.
    """
    p = np.asarray(p_main, dtype=np.float64)
    if np.any((p < 0) | (p > 1)):
        raise ValueError("p_main must be a probability in [0, 1].")
    return 1.0 - p**k


def expected_coverage(probs: Any, k: int) -> float:
    """Coverage averaged over the main token ``a_0 ~ pi_old``: ``1 - sum_a pi(a)^(k+1)``."""
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 1 or np.any(p < 0) or not np.isclose(p.sum(), 1.0):
        raise ValueError("probs must be one probability vector over the actions.")
    return float(1.0 - np.sum(p ** (k + 1)))


# ----------------------------------------------------------------- Monte Carlo


def sample_action(policy: np.ndarray, node: int, rng: np.random.Generator) -> int:
    """Draw ``a ~ policy[node]`` (``policy`` of shape ``(n_nodes, n_actions)``)."""
    row = policy[node]
    a = np.searchsorted(np.cumsum(row), rng.random() * row.sum(), side="right")
    return int(min(a, row.size - 1))


def _step(env: Any, action: int) -> tuple[int, float, bool]:
    """Step a TreeMDP or TextTreeMDP (or a wrapper) by action index; return the new node."""
    base = env.unwrapped
    names = getattr(base, "actions", None)  # TextTreeMDP takes the exit's name
    _, r, terminated, truncated, _ = env.step(names[action] if names else action)
    return int(base.node), float(r), bool(terminated or truncated)


def rollout(
    env: Any, policy: np.ndarray, rng: np.random.Generator, *, max_steps: int | None = None
) -> tuple[float, list[int]]:
    """Continue the current episode of a TreeMDP (or TextTreeMDP) with ``policy``.

    Args:
        env: The env (or a wrapper of it), mid-episode.
        policy: ``(n_nodes, n_actions)`` tabular policy.
        rng: Source of the actions.
        max_steps: Stop after this many steps (``None``: run to the end of the episode).

    Returns:
        ``(rewards collected, the nodes visited, the current one first)``.
    """
    node = int(env.unwrapped.node)
    nodes, ret, done = [node], 0.0, env.unwrapped.tree.is_terminal(node)
    while not done and (max_steps is None or len(nodes) <= max_steps):
        node, r, done = _step(env, sample_action(policy, node, rng))
        nodes.append(node)
        ret += r
    return ret, nodes


def branch_siblings(
    env: Any,
    snap: Any,
    policy: np.ndarray,
    k: int,
    rng: np.random.Generator,
    *,
    first_action: int | None = None,
    reseed: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Roll out ``k`` siblings from one snapshot: restore, reseed, act, finish.

    The snapshot carries the env's RNG, so a plain restore replays the same
    environment randomness in every sibling (common random numbers). Siblings must be
    independent draws of the transition distribution (Assumption 1, Theorem 2), so
    each sibling gets a fresh RNG seeded from ``rng`` after the restore.

    Args:
        env: A TreeMDP (or TextTreeMDP with integer steps) or a wrapper of one.
        snap: A snapshot of ``env`` at the branch state.
        policy: ``(n_nodes, n_actions)`` tabular policy.
        k: Number of siblings.
        rng: Source of the actions and of the siblings' env seeds.
        first_action: Force every sibling's first action (``None``: sample it).
        reseed: Give each sibling a fresh env RNG (default). ``False`` keeps the
            snapshot's RNG: siblings then share their environment randomness, which is
            what an engine that forgets to reseed would measure.

    Returns:
        ``(returns, first_actions)``, each of shape ``(k,)``.
    """
    import branchgym

    returns = np.empty(k)
    actions = np.empty(k, dtype=np.int64)
    for j in range(k):
        branchgym.restore(env, snap)
        base = env.unwrapped
        if reseed:
            base.np_random = np.random.Generator(np.random.PCG64(rng.integers(2**63)))
        node = int(base.node)
        a = sample_action(policy, node, rng) if first_action is None else int(first_action)
        _, g, done = _step(env, a)
        if not done:
            g += rollout(env, policy, rng)[0]
        returns[j], actions[j] = g, a
    return returns, actions


def independent_groups(
    env: Any, policy: np.ndarray, k: int, n: int, rng: np.random.Generator
) -> np.ndarray:
    """Returns of ``n`` groups of ``k`` independent episodes (the GRPO/RLOO topology).

    Returns:
        ``(n, k)`` array of episode returns.
    """
    out = np.empty((n, k))
    for i in range(n):
        for j in range(k):
            env.reset(seed=int(rng.integers(2**31)))
            out[i, j] = rollout(env, policy, rng)[0]
    return out


def branched_groups(
    env: Any,
    policy: np.ndarray,
    depth: int,
    k: int,
    n: int,
    rng: np.random.Generator,
    *,
    reseed: bool = True,
) -> np.ndarray:
    """Returns of ``n`` groups of ``k`` siblings branched at ``depth`` (Branching PO).

    Each group walks a backbone from a fresh reset to ``depth``, snapshots it there and
    rolls out ``k`` siblings with :func:`branch_siblings` (the first is the backbone's
    own continuation, in distribution). Every episode must reach ``depth`` undone (a
    leaf above it has no decision to branch; :class:`ValueError`).

    Returns:
        ``(n, k)`` array of returns (which, rewards being paid at leaves only, are the
        siblings' returns-to-go from the branch state).
    """
    import branchgym

    out = np.empty((n, k))
    for i in range(n):
        env.reset(seed=int(rng.integers(2**31)))
        _, nodes = rollout(env, policy, rng, max_steps=depth)
        if env.unwrapped.tree.is_terminal(nodes[-1]):
            raise ValueError(
                f"an episode ended at depth {len(nodes) - 1}, before the branch depth "
                f"{depth}; branch at a depth every episode reaches."
            )
        with branchgym.snapshot(env) as snap:
            out[i] = branch_siblings(env, snap, policy, k, rng, reseed=reseed)[0]
    return out
