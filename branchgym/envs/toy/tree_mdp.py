"""TreeMDP: a finite stochastic tree MDP with exact values, the ground truth for theory tests.

Every state is a node of a tree of depth at most ``depth``. In a non-terminal node the
agent picks one of ``n_actions`` actions; the environment then moves to one of that
action's ``n_outcomes`` children (the intended one with probability
``1 - transition_noise``, otherwise uniformly at random). Reaching a leaf ends the
episode with a terminal reward whose mean is a property of the leaf, plus noise
(Gaussian with std ``reward_noise``, or a Bernoulli success with that mean). By default
every leaf is at depth ``depth``; ``end_actions`` (actions that end the episode) and
``termination_prob`` (the env ends it with a probability whatever the action) give
episodes of variable length, as WebShop's ``buy`` or a step limit do.

Because the tree is finite, values are exact: :meth:`TreeMDP.value`,
:meth:`TreeMDP.q_value` and :meth:`TreeMDP.return_variance` compute ``V^pi(s)``,
``Q^pi(s, a)`` and ``Var^pi(G | s)`` for any tabular policy by backward induction.
Learners' claims (unbiasedness of sibling advantages, the law-of-total-variance
decomposition of algorithms.md, Theorem 2) are tested against these numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from branchgym.core import SnapshottableEnv
from branchgym.digest import stable_hash
from branchgym.error import InvalidActionError, ResetNeededError, SnapshotCorruptError

__all__ = ["TreeStructure", "TreeMDP"]


@dataclasses.dataclass(frozen=True, eq=False)
class TreeStructure:
    """The immutable dynamics of a tree MDP, shared by every instance built from one spec.

    Node 0 is the root. For a non-terminal node ``s`` and action ``a``,
    ``children[s, a, :]`` lists the possible next nodes and ``probs[s, a, :]`` their
    probabilities. Terminal nodes carry ``reward_mean`` and ``reward_std``.
    """

    n_actions: int
    depth: np.ndarray  # (n_nodes,) depth of every node
    parent: np.ndarray  # (n_nodes,) -1 for the root
    children: np.ndarray  # (n_nodes, n_actions, n_outcomes) child ids, -1 = none
    probs: np.ndarray  # (n_nodes, n_actions, n_outcomes)
    reward_mean: np.ndarray  # (n_nodes,) terminal reward mean (0 for inner nodes)
    reward_std: np.ndarray  # (n_nodes,) terminal reward noise std
    reward_kind: str = "gaussian"  # or "bernoulli"

    @property
    def n_nodes(self) -> int:
        """Number of nodes (states)."""
        return int(self.depth.shape[0])

    @property
    def max_depth(self) -> int:
        """Depth of the leaves (episode length)."""
        return int(self.depth.max())

    def is_terminal(self, node: int) -> bool:
        """True for leaves."""
        return bool(self.children[node, 0, 0] < 0)

    def fingerprint(self) -> str:
        """Stable hash of the dynamics (part of the snapshot identity)."""
        return stable_hash(
            self.n_actions,
            self.children,
            self.probs,
            self.reward_mean,
            self.reward_std,
            self.reward_kind,
        )

    # ------------------------------------------------------------------ builders
    @classmethod
    def random(
        cls,
        *,
        depth: int = 4,
        n_actions: int = 3,
        n_outcomes: int = 2,
        transition_noise: float = 0.2,
        reward_noise: float = 0.1,
        reward_kind: str = "gaussian",
        seed: int = 0,
        depth_weights: Any = None,
        end_actions: int = 0,
        termination_prob: float = 0.0,
    ) -> TreeStructure:
        """A random tree whose leaf means depend on every decision along the path.

        Each (node, action) edge gets a quality ``q ~ N(0, 1)``; a leaf's mean reward is
        ``sigmoid(2 * sum(q along its path) / sqrt(depth))``, so good decisions early and
        late both matter and values are spread over (0, 1). Node ids grow breadth first.

        ``depth_weights`` (length ``depth``) scales the qualities of each decision depth
        before they add up (the ``sqrt(depth)`` becomes the weights' norm): large late
        weights resolve the return late (Theorem 2's ``nu_t^2`` small until late), large
        early ones resolve it early. ``None`` means all ones.

        Variable episode lengths (leaves above ``depth``, scored by the same formula on
        the path so far):

        * ``end_actions``: the last ``end_actions`` actions of every inner node end the
          episode (all their outcomes are leaves), as a "submit" action does;
        * ``termination_prob``: after any action the environment ends the episode with
          this probability whatever the action (one extra outcome, a leaf), as a step
          limit or a crash does; the other outcomes share ``1 - termination_prob``.

        With both at 0 (the default) every leaf is at ``depth`` and the tree is the one
        earlier versions built from the same seed.
        """
        if depth < 1 or n_actions < 1 or n_outcomes < 1:
            raise ValueError("depth, n_actions and n_outcomes must be >= 1")
        if not 0.0 <= transition_noise <= 1.0:
            raise ValueError("transition_noise must be in [0, 1]")
        if reward_kind not in ("gaussian", "bernoulli"):
            raise ValueError("reward_kind must be 'gaussian' or 'bernoulli'")
        w = np.ones(depth) if depth_weights is None else np.asarray(depth_weights, dtype=float)
        if w.shape != (depth,):
            raise ValueError(f"depth_weights needs one weight per depth ({depth})")
        if isinstance(end_actions, bool) or not 0 <= int(end_actions) < n_actions:
            raise ValueError(
                f"end_actions must be an int in [0, n_actions) (some action must go on); "
                f"got {end_actions!r}"
            )
        if not 0.0 <= termination_prob < 1.0:
            raise ValueError(f"termination_prob must be in [0, 1); got {termination_prob!r}")
        if end_actions or termination_prob > 0:
            return cls._random_variable(
                depth, n_actions, n_outcomes, transition_noise, reward_noise, reward_kind,
                seed, w, int(end_actions), float(termination_prob),
            )  # fmt: skip
        branching = n_actions * n_outcomes
        n_nodes = sum(branching**d for d in range(depth + 1))
        if n_nodes > 2_000_000:
            raise ValueError(f"tree would have {n_nodes} nodes; reduce depth or branching")
        rng = np.random.default_rng(seed)
        quality = rng.normal(size=(n_nodes, n_actions))
        starts = np.concatenate([[0], np.cumsum([branching**d for d in range(depth + 1)])])
        node_depth = np.zeros(n_nodes, dtype=np.int32)
        parent = np.full(n_nodes, -1, dtype=np.int64)
        children = np.full((n_nodes, n_actions, n_outcomes), -1, dtype=np.int64)
        probs = np.zeros((n_nodes, n_actions, n_outcomes), dtype=np.float64)
        path_q = np.zeros(n_nodes)
        p = np.full(n_outcomes, transition_noise / n_outcomes)
        p[0] += 1.0 - transition_noise
        for d in range(depth):  # one level at a time: children of node i are 1 + i*b ...
            inner = np.arange(starts[d], starts[d + 1])
            kids = 1 + inner[:, None] * branching + np.arange(branching)[None, :]
            children[inner] = kids.reshape(-1, n_actions, n_outcomes)
            probs[inner] = p
            flat = kids.reshape(-1)
            node_depth[flat] = d + 1
            parent[flat] = np.repeat(inner, branching)
            step_q = np.repeat(quality[inner] * w[d], n_outcomes, axis=1)
            path_q[flat] = (path_q[inner][:, None] + step_q).reshape(-1)
        leaves = node_depth == depth
        scale = np.sqrt(depth) if depth_weights is None else np.sqrt(np.sum(w**2))
        mean = np.where(leaves, 1.0 / (1.0 + np.exp(-2.0 * path_q / scale)), 0.0)
        std = np.where(leaves, reward_noise if reward_kind == "gaussian" else 0.0, 0.0)
        return cls(n_actions, node_depth, parent, children, probs, mean, std, reward_kind)

    @classmethod
    def _random_variable(
        cls,
        depth: int,
        n_actions: int,
        n_outcomes: int,
        transition_noise: float,
        reward_noise: float,
        reward_kind: str,
        seed: int,
        w: np.ndarray,
        end_actions: int,
        termination_prob: float,
    ) -> TreeStructure:
        """:meth:`random` with leaves above ``depth``, built one level at a time."""
        rng = np.random.default_rng(seed)
        stop = termination_prob > 0
        n_out = n_outcomes + int(stop)
        p = np.full(n_outcomes, transition_noise / n_outcomes)
        p[0] += 1.0 - transition_noise
        p = np.concatenate([p * (1.0 - termination_prob), [termination_prob]]) if stop else p
        # which (action, outcome) children are leaves above the last level
        ends = np.zeros((n_actions, n_out), dtype=bool)
        ends[n_actions - end_actions :, :] = True
        if stop:
            ends[:, -1] = True
        depth_l, parent_l, pq_l = [np.zeros(1, np.int32)], [np.full(1, -1)], [np.zeros(1)]
        child_blocks, inner_ids = [], np.zeros(1, dtype=np.int64)
        n_nodes, inner_all = 1, [inner_ids]
        for d in range(depth):
            k = inner_ids.size
            if k * n_actions * n_out + n_nodes > 2_000_000:
                raise ValueError("tree would have over 2,000,000 nodes; reduce depth or branching")
            quality = rng.normal(size=(k, n_actions)) * w[d]
            kids = n_nodes + np.arange(k * n_actions * n_out).reshape(k, n_actions, n_out)
            child_blocks.append(kids)
            n_nodes += kids.size
            depth_l.append(np.full(kids.size, d + 1, np.int32))
            parent_l.append(np.repeat(inner_ids, n_actions * n_out))
            pq_parent = np.concatenate(pq_l)[inner_ids]
            pq_l.append((pq_parent[:, None, None] + quality[:, :, None]).repeat(n_out, 2).ravel())
            leafy = np.broadcast_to(ends | (d + 1 == depth), kids.shape)
            inner_ids = kids[~leafy]
            inner_all.append(inner_ids)
        node_depth = np.concatenate(depth_l)
        parent = np.concatenate(parent_l)
        path_q = np.concatenate(pq_l)
        children = np.full((n_nodes, n_actions, n_out), -1, dtype=np.int64)
        probs = np.zeros((n_nodes, n_actions, n_out))
        for ids, kids in zip(inner_all, child_blocks, strict=False):
            children[ids] = kids
            probs[ids] = p
        leaves = children[:, 0, 0] < 0
        scale = np.sqrt(np.sum(w**2))
        mean = np.where(leaves, 1.0 / (1.0 + np.exp(-2.0 * path_q / scale)), 0.0)
        std = np.where(leaves, reward_noise if reward_kind == "gaussian" else 0.0, 0.0)
        return cls(n_actions, node_depth, parent, children, probs, mean, std, reward_kind)

    @classmethod
    def from_nested(
        cls, tree: Mapping[str, Any], *, reward_kind: str = "gaussian"
    ) -> TreeStructure:
        """Build a tree by hand.

        A node is ``{"actions": [action, ...]}`` (every inner node has the same number of
        actions) or a leaf ``{"reward": mean, "std": noise_std}``; an action is
        ``[(probability, node), ...]``. Example, two equally likely prefixes::

            leaf = lambda m: {"reward": m, "std": 0.05 ** 0.5}
            TreeStructure.from_nested({"actions": [[(0.5, {"actions": [[(1.0, leaf(0.8))]]}),
                                                    (0.5, {"actions": [[(1.0, leaf(0.2))]]})]]})
        """
        nodes: list[Mapping[str, Any]] = []
        depth_l: list[int] = []
        parent_l: list[int] = []
        queue = [(tree, 0, -1)]
        while queue:  # breadth first so ids grow with depth
            node, d, par = queue.pop(0)
            nodes.append(node)
            depth_l.append(d)
            parent_l.append(par)
            me = len(nodes) - 1
            for action in node.get("actions", []):
                for _, child in action:
                    queue.append((child, d + 1, me))
        n_actions = max(len(n.get("actions", [])) for n in nodes)
        n_out = max((len(a) for n in nodes for a in n.get("actions", [])), default=1)
        n = len(nodes)
        children = np.full((n, n_actions, n_out), -1, dtype=np.int64)
        probs = np.zeros((n, n_actions, n_out))
        mean = np.zeros(n)
        std = np.zeros(n)
        child_id = 1
        for i, node in enumerate(nodes):
            acts = node.get("actions", [])
            if not acts:
                mean[i] = float(node["reward"])
                std[i] = float(node.get("std", 0.0))
                continue
            if len(acts) != n_actions:
                raise ValueError("every inner node must have the same number of actions")
            for a, outcomes in enumerate(acts):
                total = sum(p for p, _ in outcomes)
                if not np.isclose(total, 1.0):
                    raise ValueError(f"outcome probabilities of node {i} action {a} sum to {total}")
                for o, (p, _) in enumerate(outcomes):
                    children[i, a, o] = child_id
                    probs[i, a, o] = p
                    child_id += 1
        return cls(
            n_actions,
            np.array(depth_l, dtype=np.int32),
            np.array(parent_l, dtype=np.int64),
            children,
            probs,
            mean,
            std,
            reward_kind,
        )

    # --------------------------------------------------------------- exact values
    def _policy(self, policy: Any) -> np.ndarray:
        if policy is None:
            return np.full((self.n_nodes, self.n_actions), 1.0 / self.n_actions)
        pi = np.asarray(policy, dtype=np.float64)
        if pi.shape == (self.n_actions,):
            pi = np.broadcast_to(pi, (self.n_nodes, self.n_actions))
        if pi.shape != (self.n_nodes, self.n_actions):
            raise ValueError(
                f"a tabular policy has shape ({self.n_nodes}, {self.n_actions}) or "
                f"({self.n_actions},); got {pi.shape}"
            )
        return pi

    def _leaf_moments(self) -> tuple[np.ndarray, np.ndarray]:
        m = self.reward_mean
        if self.reward_kind == "bernoulli":
            return m, m  # E[r^2] = p for a 0/1 reward
        return m, m**2 + self.reward_std**2

    def moments(self, policy: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Exact first and second moments of the return, by backward induction.

        Returns:
            ``(V, V2, Q, Q2)``: ``V[s] = E[G|s]``, ``V2[s] = E[G^2|s]`` with ``G`` the sum of
            rewards from ``s`` on (0 at leaves, whose reward is paid on arrival), and
            ``Q[s, a]``, ``Q2[s, a]`` the same after taking ``a`` in ``s``.
        """
        pi = self._policy(policy)
        r1, r2 = self._leaf_moments()
        n = self.n_nodes
        v = np.zeros(n)
        v2 = np.zeros(n)
        q = np.zeros((n, self.n_actions))
        q2 = np.zeros((n, self.n_actions))
        for s in np.argsort(-self.depth, kind="stable"):
            if self.is_terminal(s):
                continue
            ch = self.children[s]
            valid = ch >= 0
            c = np.where(valid, ch, 0)
            # G = r(child) + G(child); r only at leaves, G(leaf) = 0.
            g1 = r1[c] + v[c]
            g2 = r2[c] + 2 * r1[c] * v[c] + v2[c]
            q[s] = np.sum(np.where(valid, self.probs[s] * g1, 0.0), axis=-1)
            q2[s] = np.sum(np.where(valid, self.probs[s] * g2, 0.0), axis=-1)
            v[s] = pi[s] @ q[s]
            v2[s] = pi[s] @ q2[s]
        return v, v2, q, q2


class TreeMDP(SnapshottableEnv[int, int]):
    """A finite stochastic tree MDP with discrete spaces and exact values.

    Args:
        depth: Episode length (depth of the leaves).
        n_actions: Actions in every non-terminal state.
        n_outcomes: Possible next states per action.
        transition_noise: Probability of a uniformly random outcome instead of the intended one.
        reward_noise: Std of the Gaussian noise on terminal rewards.
        reward_kind: ``gaussian`` (mean + noise) or ``bernoulli`` (success with prob = mean).
        structure_seed: Seed of the random tree (the dynamics are part of the spec).
        end_actions: The last ``end_actions`` actions of every room end the episode
            (variable episode lengths; :meth:`TreeStructure.random`).
        termination_prob: Probability that the environment ends the episode after any
            action, whatever the action (variable episode lengths).
        structure: A hand-built :class:`TreeStructure` instead of a random one.
    """

    metadata = {"render_modes": ["ansi"]}
    default_env_id = "branchgym/TreeMDP-v0"
    _restore_copies = False  # the state is a tuple of ints

    def __init__(
        self,
        depth: int = 4,
        n_actions: int = 3,
        n_outcomes: int = 2,
        transition_noise: float = 0.2,
        reward_noise: float = 0.1,
        reward_kind: str = "gaussian",
        structure_seed: int = 0,
        end_actions: int = 0,
        termination_prob: float = 0.0,
        structure: TreeStructure | None = None,
        render_mode: str | None = None,
    ) -> None:
        """Build the tree (or take ``structure``) and the spaces."""
        self.tree = structure or TreeStructure.random(
            depth=depth,
            n_actions=n_actions,
            n_outcomes=n_outcomes,
            transition_noise=transition_noise,
            reward_noise=reward_noise,
            reward_kind=reward_kind,
            seed=structure_seed,
            end_actions=end_actions,
            termination_prob=termination_prob,
        )
        self._config = self.tree.fingerprint()
        self.observation_space = gym.spaces.Discrete(self.tree.n_nodes)
        self.action_space = gym.spaces.Discrete(self.tree.n_actions)
        self.render_mode = render_mode
        self.node: int | None = None
        self.step_index = 0
        self.last_reward = 0.0

    # ---------------------------------------------------------------- gym API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Start at the root."""
        super().reset(seed=seed)
        self.node = 0
        self.step_index = 0
        self.last_reward = 0.0
        return self._obs(), self._info()

    def step(self, action: Any):
        """Take ``action``; the next node is drawn from the action's outcome distribution."""
        a = self._check_action(action)
        node = self._require_live()
        children = self.tree.children[node, a]
        p = self.tree.probs[node, a]
        valid = children >= 0
        o = int(self.np_random.choice(int(valid.sum()), p=p[valid] / p[valid].sum()))
        self.node = int(children[o])
        self.step_index += 1
        terminated = self.tree.is_terminal(self.node)
        reward = self._terminal_reward(self.node) if terminated else 0.0
        self.last_reward = reward
        return self._obs(), reward, terminated, False, self._info()

    def render(self) -> str | None:
        """ANSI rendering: the node, its depth and its actions."""
        if self.render_mode != "ansi":
            return None
        return f"node {self.node} (depth {self.tree.depth[self.node]}/{self.tree.max_depth})"

    # ---------------------------------------------------------------- snapshots
    def _get_state(self) -> tuple[int | None, int, float]:
        return (self.node, self.step_index, self.last_reward)

    def _set_state(self, state: Any):
        if (
            not isinstance(state, tuple)
            or len(state) != 3
            or not (state[0] is None or 0 <= state[0] < self.tree.n_nodes)
        ):
            raise SnapshotCorruptError(
                f"TreeMDP snapshot payload is malformed ({state!r:.80}); take a new snapshot."
            )
        self.node, self.step_index, self.last_reward = state
        return self._obs(), self._info()

    def _snapshot_config(self) -> Any:
        return self._config

    # ---------------------------------------------------------------- exact values
    def value(self, state: int, policy: Any = None) -> float:
        """Exact ``V^pi(state)``: expected sum of future rewards (0 at leaves)."""
        return float(self.tree.moments(policy)[0][state])

    def q_value(self, state: int, action: int, policy: Any = None) -> float:
        """Exact ``Q^pi(state, action)``."""
        return float(self.tree.moments(policy)[2][state, action])

    def return_variance(self, state: int, policy: Any = None) -> float:
        """Exact ``Var^pi(G | state)``."""
        v, v2, _, _ = self.tree.moments(policy)
        return float(v2[state] - v[state] ** 2)

    def optimal_policy(self) -> np.ndarray:
        """A deterministic optimal tabular policy (greedy in exact ``Q*``, backward induction)."""
        t = self.tree
        r1, _ = t._leaf_moments()
        v = np.zeros(t.n_nodes)
        pi = np.full((t.n_nodes, t.n_actions), 1.0 / t.n_actions)
        for s in np.argsort(-t.depth, kind="stable"):
            if t.is_terminal(s):
                continue
            ch = t.children[s]
            c = np.where(ch >= 0, ch, 0)
            q = np.sum(np.where(ch >= 0, t.probs[s] * (r1[c] + v[c]), 0.0), axis=-1)
            best = int(np.argmax(q))
            pi[s] = 0.0
            pi[s, best] = 1.0
            v[s] = q[best]
        return pi

    # ---------------------------------------------------------------- helpers
    def _terminal_reward(self, node: int) -> float:
        mean = float(self.tree.reward_mean[node])
        if self.tree.reward_kind == "bernoulli":
            return float(self.np_random.random() < mean)
        std = float(self.tree.reward_std[node])
        return mean + (float(self.np_random.normal(0.0, std)) if std > 0 else 0.0)

    def _require_live(self) -> int:
        if self.node is None:
            raise ResetNeededError("Cannot call step() before reset(); call env.reset() first.")
        if self.tree.is_terminal(self.node):
            raise ResetNeededError(
                "The episode is over (a leaf was reached); call env.reset() before step()."
            )
        return self.node

    def _check_action(self, action: Any) -> int:
        if (
            isinstance(action, bool)
            or not isinstance(action, int | np.integer)
            or not (0 <= int(action) < self.tree.n_actions)
        ):
            raise InvalidActionError(
                f"TreeMDP actions are integers in [0, {self.tree.n_actions}); got {action!r}."
            )
        return int(action)

    def _obs(self) -> int:
        return int(self.node if self.node is not None else 0)

    def _info(self) -> dict[str, Any]:
        return {"node": self.node, "depth": int(self.tree.depth[self.node or 0])}

    def action_names(self) -> Sequence[str]:
        """Names of the actions (indices for the discrete env)."""
        return [str(a) for a in range(self.tree.n_actions)]
