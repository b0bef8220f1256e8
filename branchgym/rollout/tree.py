"""Rollout trees: one backbone trajectory, K siblings at a few branch points.

A :class:`RolloutTree` holds every agent decision the branching engine made for one
task instance. A :class:`Node` is one decision (one complete action, not one token):
the action and its text, the token ids the policy generated, the behaviour policy's
per-token log-probs and entropies, the observation that followed, reward, done flags,
costs and errors. Nodes link to their parent decision; the reset state is the implicit
root (parent ``-1``).

The tree answers what the learners need (docs/algorithms.md, sections 1 and 2):

* :meth:`RolloutTree.paths`: every root-to-leaf path (one per rollout);
* :meth:`RolloutTree.returns_to_go`: the return-to-go at each node along its own line;
* :meth:`RolloutTree.branch_points`: each branch point with its K siblings, the
  backbone's own action first (``k = 1``), and their returns (the input of eq. 4);
* :meth:`RolloutTree.owning_path`: for a node, the path whose advantage it takes and the
  branch steps at or after it with the sibling that path takes at each (eq. 5);
* :meth:`RolloutTree.token_masks`: per path and node, which tokens the loss counts, so
  that every shared prefix counts once (eq. 6; BranchOPD's mask M).

Advantage math is not here: ``branchgym.agents.estimators.losses`` computes it from these.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

__all__ = [
    "Node",
    "BranchPoint",
    "OwningPath",
    "TreeStats",
    "RolloutTree",
    "action_entropy",
    "ENTROPY_REDUCTIONS",
    "SUCCESS_KEYS",
    "success_of",
]

#: Root marker: the parent of the first decision is the reset state, not a node.
ROOT = -1


def _f32(x: Any) -> np.ndarray:
    return np.asarray([] if x is None else x, dtype=np.float32).reshape(-1)


def _i64(x: Any) -> np.ndarray:
    return np.asarray([] if x is None else x, dtype=np.int64).reshape(-1)


@dataclasses.dataclass(eq=False)
class Node:
    """One agent decision and what followed it.

    Attributes:
        id: Index in :attr:`RolloutTree.nodes`.
        parent: Id of the previous decision on the same path, ``-1`` for the first one.
        step: Decision index in the episode (the state ``s_step`` it acted in).
        action: What was passed to ``env.step`` (text, or an int for discrete envs).
        text: The raw text the policy generated (empty for non-text policies).
        token_ids: Token ids of the action as generated (prefix included, see below).
        logprobs: Behaviour policy's log-prob of each token (``log mu``), float32.
        entropies: Exact per-token entropy of the behaviour distribution (nats).
        entropies_top20: Entropy estimated from the top-20 probabilities (BranchOPD's
            ``U_t``), when the engine provides it.
        prefix_len: Leading tokens copied from the sibling ``k = 1`` rather than
            generated (a token-level fork inside a turn); the loss never counts them.
        observation: The observation that followed the action.
        reward: Reward of the transition.
        terminated: The episode ended in a terminal state.
        truncated: The episode was cut (time limit, error, step cap).
        info: Small, picklable info of the transition (``admissible_actions``, ``node``).
        sibling: ``k`` at the branch point this node starts (1 = the backbone's own
            action, 2..K = resampled siblings); 0 when the node is not at a branch point.
        rollout: Index of the rollout (leaf path) that generated it; 0 is the backbone.
        costs: Seconds spent, by kind (``generate``, ``env_step``, ``restore``, ...).
        error: Why the sandbox failed on this step (a crash or timeout), else ``None``.
        parse_error: Why the policy's text was not a valid action, else ``None``.
        teacher_logprobs: Filled by a teacher pass (BranchOPD), else ``None``.
    """

    id: int
    parent: int
    step: int
    action: Any = None
    text: str = ""
    token_ids: np.ndarray = dataclasses.field(default_factory=lambda: _i64(None))
    logprobs: np.ndarray = dataclasses.field(default_factory=lambda: _f32(None))
    entropies: np.ndarray = dataclasses.field(default_factory=lambda: _f32(None))
    entropies_top20: np.ndarray | None = None
    prefix_len: int = 0
    observation: Any = None
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    sibling: int = 0
    rollout: int = 0
    costs: dict[str, float] = dataclasses.field(default_factory=dict)
    error: str | None = None
    parse_error: str | None = None
    teacher_logprobs: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.token_ids = _i64(self.token_ids)
        self.logprobs = _f32(self.logprobs)
        self.entropies = _f32(self.entropies)
        if self.entropies_top20 is not None:
            self.entropies_top20 = _f32(self.entropies_top20)
        n = self.token_ids.size
        for name in ("logprobs", "entropies"):
            got = getattr(self, name).size
            if got != n:
                raise ValueError(f"node {self.id}: {name} has {got} values for {n} tokens")
        if not 0 <= self.prefix_len <= n:
            raise ValueError(f"node {self.id}: prefix_len {self.prefix_len} not in [0, {n}]")

    @property
    def done(self) -> bool:
        """The episode ended after this decision (terminated, truncated or failed)."""
        return self.terminated or self.truncated

    @property
    def n_tokens(self) -> int:
        """Tokens of the action (copied prefix included)."""
        return int(self.token_ids.size)

    @property
    def n_generated(self) -> int:
        """Tokens actually sampled for this node (``n_tokens - prefix_len``)."""
        return self.n_tokens - self.prefix_len

    def entropy(self, reduce: str = "mean") -> float:
        """Per-action entropy ``H_t`` of eq. (3) from the per-token entropies.

        Args:
            reduce: ``mean`` over the action's tokens (the default of spec step 2),
                ``first`` (the first token's) or ``sum``.
        """
        return action_entropy(self.entropies, reduce)


def action_entropy(entropies: np.ndarray, reduce: str = "mean") -> float:
    """Reduce per-token entropies to one per-action entropy (algorithms.md eq. 3, step 2)."""
    fn = ENTROPY_REDUCTIONS.get(reduce)
    if fn is None:
        raise ValueError(
            f"entropy reduction {reduce!r} unknown; use one of {list(ENTROPY_REDUCTIONS)}"
        )
    e = np.asarray(entropies, dtype=np.float64)
    return float(fn(e)) if e.size else 0.0


ENTROPY_REDUCTIONS = {
    "mean": np.mean,
    "first": lambda e: e[0],
    "sum": np.sum,
}


@dataclasses.dataclass(frozen=True)
class BranchPoint:
    """A state where the tree forks into K siblings.

    Attributes:
        parent: The decision that led to the state (``-1``: the reset state).
        step: The state's decision index ``t`` (siblings act at step ``t``).
        token_offset: Tokens of the ``k = 1`` action shared by every sibling (0 for a
            turn-level fork; BranchOPD forks inside a turn).
        siblings: Node ids of the K sibling decisions, ``k = 1`` (the backbone's) first.
        returns: Each sibling's return-to-go from step ``t`` (``G_t^(t,k)``, eq. 4's input).
    """

    parent: int
    step: int
    token_offset: int
    siblings: tuple[int, ...]
    returns: tuple[float, ...]

    @property
    def k(self) -> int:
        """Number of siblings."""
        return len(self.siblings)


@dataclasses.dataclass(frozen=True)
class OwningPath:
    """The path that owns a node, for eq. (5) along it.

    Attributes:
        leaf: The leaf the path ends in.
        nodes: Node ids from the first decision to ``leaf``.
        position: Index of the owned node in ``nodes`` (its step).
        branch_steps: Branch points on the path at or after the node, as positions in
            ``nodes`` (ascending).
        siblings: For each of ``branch_steps``, which sibling ``k`` the path takes there.
        branch_index: For each of ``branch_steps``, its index in ``tree.branch_points()``.
    """

    leaf: int
    nodes: tuple[int, ...]
    position: int
    branch_steps: tuple[int, ...]
    siblings: tuple[int, ...]
    branch_index: tuple[int, ...]


@dataclasses.dataclass
class TreeStats:
    """What a tree cost, for comparisons at matched compute.

    Attributes:
        rollouts: Root-to-leaf paths (N = 1 + M(K-1) for a full tree).
        env_steps: Environment steps taken (all nodes, plus replay steps).
        replay_steps: Of those, steps spent replaying to branch points (``keep="replay"``).
        generated_tokens: Tokens the policy sampled (each shared prefix once).
        independent_tokens: Tokens that independent rollouts with the same leaves
            would have generated (every path's tokens in full).
        generate_s: Seconds in the policy.
        env_s: Seconds in ``env.step``/``reset`` (the sandbox).
        snapshot_s: Seconds taking snapshots.
        restore_s: Seconds restoring snapshots (replay included for ``keep="replay"``).
        wall_s: Wall-clock seconds for the whole tree.
        snapshots_taken: Snapshots taken.
        peak_live_snapshots: Most snapshots alive at once for this tree.
        peak_live_bytes: Their bytes at that moment.
        errors: Nodes whose sandbox failed (crash or timeout).
    """

    rollouts: int = 0
    env_steps: int = 0
    replay_steps: int = 0
    generated_tokens: int = 0
    independent_tokens: int = 0
    generate_s: float = 0.0
    env_s: float = 0.0
    snapshot_s: float = 0.0
    restore_s: float = 0.0
    wall_s: float = 0.0
    snapshots_taken: int = 0
    peak_live_snapshots: int = 0
    peak_live_bytes: int = 0
    errors: int = 0

    @property
    def tokens_saved(self) -> float:
        """Share of tokens shared prefixes saved against independent rollouts."""
        if self.independent_tokens <= 0:
            return 0.0
        return 1.0 - self.generated_tokens / self.independent_tokens

    @property
    def branching_overhead(self) -> float:
        """Snapshot + restore time over rollout time (generation + sandbox)."""
        rollout = self.generate_s + self.env_s
        return (self.snapshot_s + self.restore_s) / rollout if rollout > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        """Flat dict with the derived ratios, for logs (``branching/...`` keys upstream)."""
        d = dataclasses.asdict(self)
        d["tokens_saved"] = self.tokens_saved
        d["branching_overhead"] = self.branching_overhead
        return d

    def __iadd__(self, other: TreeStats) -> TreeStats:
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name.startswith("peak_"):
                setattr(self, f.name, max(a, b))
            else:
                setattr(self, f.name, a + b)
        return self


class RolloutTree:
    """The decisions of one task instance, as a tree rooted in the reset state.

    Args:
        env_id: The env the tree was grown in.
        seed: The reset seed (the task instance).
        observation: The reset observation.
        info: The reset info.
        gamma: Discount used by :meth:`returns_to_go` (1.0: undiscounted, the source's
            terminal-reward setting).
    """

    def __init__(
        self,
        env_id: str = "",
        seed: int | None = None,
        observation: Any = None,
        info: dict[str, Any] | None = None,
        *,
        gamma: float = 1.0,
    ) -> None:
        """Start an empty tree at the reset state."""
        self.env_id = env_id
        self.seed = seed
        self.observation = observation
        self.info = dict(info or {})
        self.gamma = float(gamma)
        self.nodes: list[Node] = []
        self._children: dict[int, list[int]] = {ROOT: []}
        #: (parent, step) -> token offset for branch points declared by the engine
        self._fork_offsets: dict[int, int] = {}
        self.stats = TreeStats()
        self.meta: dict[str, Any] = {}

    # ------------------------------------------------------------------ building
    def add(self, parent: int, **fields: Any) -> Node:
        """Append a decision under ``parent`` (``-1``: the reset state) and return it.

        ``step`` is derived from the parent; every other :class:`Node` field may be given.
        """
        if parent != ROOT and not 0 <= parent < len(self.nodes):
            raise ValueError(f"parent {parent} is not a node of this tree")
        if parent != ROOT and self.nodes[parent].done:
            raise ValueError(f"node {parent} ended its episode; a decision cannot follow it")
        step = 0 if parent == ROOT else self.nodes[parent].step + 1
        node = Node(id=len(self.nodes), parent=parent, step=step, **fields)
        self.nodes.append(node)
        self._children.setdefault(parent, []).append(node.id)
        self._children[node.id] = []
        return node

    def add_path(self, parent: int, decisions: Sequence[dict[str, Any]]) -> list[Node]:
        """Append a chain of decisions, each a dict of :class:`Node` fields."""
        out = []
        for fields in decisions:
            node = self.add(parent, **fields)
            out.append(node)
            parent = node.id
        return out

    def renumber(self, order: Sequence[int]) -> None:
        """Give the nodes new ids: the node ``order[i]`` (an old id) becomes node ``i``.

        ``order`` lists every node once, each parent before its children. Children are
        listed in their new id order, so :meth:`main_line` follows the first of them.
        """
        order = [int(i) for i in order]
        if sorted(order) != list(range(len(self.nodes))):
            raise ValueError(f"order must list each of the {len(self.nodes)} node ids once")
        new = {old: i for i, old in enumerate(order)}
        new[ROOT] = ROOT
        nodes = [self.nodes[old] for old in order]
        for node in nodes:
            if new[node.parent] > new[node.id]:
                raise ValueError(f"order puts node {node.id} before its parent {node.parent}")
        self._children = {
            new[p]: sorted(new[c] for c in kids) for p, kids in self._children.items()
        }
        self._fork_offsets = {new[p]: off for p, off in self._fork_offsets.items()}
        for node in nodes:
            node.id, node.parent = new[node.id], new[node.parent]
        self.nodes = nodes

    def set_fork_offset(self, parent: int, token_offset: int) -> None:
        """Declare that the siblings under ``parent`` share ``token_offset`` leading tokens."""
        self._fork_offsets[parent] = int(token_offset)

    @property
    def fork_offsets(self) -> dict[int, int]:
        """Every declared fork offset: ``parent -> token_offset`` (a copy)."""
        return dict(self._fork_offsets)

    # ------------------------------------------------------------------ structure
    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __getitem__(self, i: int) -> Node:
        return self.nodes[i]

    def children(self, node: int) -> list[int]:
        """Decisions that follow ``node`` (``-1``: the first decisions), oldest first."""
        return list(self._children.get(node, []))

    def leaves(self) -> list[int]:
        """Nodes without children, in the order they were added (backbone's first)."""
        return [n.id for n in self.nodes if not self._children[n.id]]

    def path_to(self, node: int) -> list[int]:
        """Node ids from the first decision down to ``node``."""
        out = []
        while node != ROOT:
            out.append(node)
            node = self.nodes[node].parent
        return out[::-1]

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path, one per rollout, backbone first."""
        return [self.path_to(leaf) for leaf in self.leaves()]

    def main_line(self, node: int) -> list[int]:
        """``node`` and its continuation through each first child (``k = 1``) to a leaf."""
        out = [node]
        while self._children[out[-1]]:
            out.append(self._children[out[-1]][0])
        return out

    @property
    def backbone(self) -> list[int]:
        """The backbone: the main line from the first decision."""
        first = self._children[ROOT]
        return self.main_line(first[0]) if first else []

    # ------------------------------------------------------------------ returns
    def path_returns_to_go(self, path: Sequence[int]) -> np.ndarray:
        """Discounted return-to-go at every node of ``path``: ``G_t = r_t + gamma G_{t+1}``."""
        g = 0.0
        out = np.zeros(len(path))
        for i in range(len(path) - 1, -1, -1):
            g = self.nodes[path[i]].reward + self.gamma * g
            out[i] = g
        return out

    def returns_to_go(self) -> np.ndarray:
        """Return-to-go at every node along its own line (its ``k = 1`` continuation).

        For the backbone and each sibling's own steps the line is unique; at a node whose
        subtree forks, the value is that of the path through the first child, which is
        the return the node's own trajectory collected.
        """
        out = np.zeros(len(self.nodes))
        for n in reversed(self.nodes):  # children are always added after their parent
            kids = self._children[n.id]
            out[n.id] = n.reward + (self.gamma * out[kids[0]] if kids else 0.0)
        return out

    def returns(self) -> np.ndarray:
        """The return of every rollout (path), in :meth:`paths` order."""
        return np.array([self.path_returns_to_go(p)[0] if p else 0.0 for p in self.paths()])

    def line_valid(self, node: int) -> bool:
        """Whether ``node``'s line (it and its ``k = 1`` continuation) ran without error.

        A crashed, timed-out or never-run line has no return to compare.
        """
        return all(self.nodes[n].error is None for n in self.main_line(node))

    def valid_paths(self) -> np.ndarray:
        """One flag per rollout, in :meth:`paths` order: False where a node hit an error.

        Errors are sandbox failures (crash, timeout, failed restore, not run). Learners
        leave those rollouts out of their advantage groups (eq. 4, the group baselines).
        """
        paths = self.paths()
        return np.array([all(self.nodes[n].error is None for n in p) for p in paths], bool)

    # ------------------------------------------------------------------ branching
    def branch_points(self) -> list[BranchPoint]:
        """Every state with more than one decision under it, shallowest first.

        Siblings are ordered by ``k``: the decision added first (the backbone's, or the
        line that existed before the fork) is ``k = 1``.
        """
        rtg = self.returns_to_go()
        out = []
        for parent, kids in self._children.items():
            if len(kids) > 1:
                step = 0 if parent == ROOT else self.nodes[parent].step + 1
                out.append(
                    BranchPoint(
                        parent=parent,
                        step=step,
                        token_offset=self._fork_offsets.get(parent, 0),
                        siblings=tuple(kids),
                        returns=tuple(float(rtg[k]) for k in kids),
                    )
                )
        out.sort(key=lambda b: (b.step, b.parent))
        return out

    def sibling_index(self, node: int) -> int:
        """``k`` of ``node`` among its siblings (1-based), 0 if its parent does not fork."""
        kids = self._children[self.nodes[node].parent]
        return kids.index(node) + 1 if len(kids) > 1 else 0

    def owner(self, node: int) -> int:
        """The leaf whose path owns ``node``: the end of the node's own line."""
        return self.main_line(node)[-1]

    def owning_path(self, node: int) -> OwningPath:
        """The path that owns ``node`` and the branch steps at or after it (eq. 5).

        The owning path runs from the first decision through ``node`` and on through
        first children. Eq. (5) sums ``lambda^(b - t') A_local(b, k_b)`` over the branch
        points ``b >= t'`` on it, with ``k_b`` the sibling this path takes at ``b``.
        """
        leaf = self.owner(node)
        nodes = self.path_to(leaf)
        position = self.nodes[node].step
        index = {(b.parent, b.step): i for i, b in enumerate(self.branch_points())}
        steps, sibs, bidx = [], [], []
        for pos in range(position, len(nodes)):
            nid = nodes[pos]
            parent = self.nodes[nid].parent
            kids = self._children[parent]
            if len(kids) > 1:
                steps.append(pos)
                sibs.append(kids.index(nid) + 1)
                bidx.append(index[(parent, pos)])
        return OwningPath(leaf, tuple(nodes), position, tuple(steps), tuple(sibs), tuple(bidx))

    def owned_nodes(self) -> dict[int, list[int]]:
        """For each leaf, the nodes its path owns (a partition of all nodes)."""
        out: dict[int, list[int]] = {leaf: [] for leaf in self.leaves()}
        for n in self.nodes:
            out[self.owner(n.id)].append(n.id)
        return out

    # ------------------------------------------------------------------ tokens
    def token_masks(self) -> list[tuple[list[int], list[np.ndarray]]]:
        """Per path, its nodes and a 0/1 mask over each node's tokens.

        A node's tokens count (mask 1) only on the path that owns it, and a node's
        copied prefix (``prefix_len``, a fork inside a turn) never counts, so summing
        the masks over all paths counts every generated token exactly once.
        """
        out = []
        for path in self.paths():
            leaf = path[-1]
            masks = []
            for nid in path:
                n = self.nodes[nid]
                m = np.zeros(n.n_tokens, dtype=np.float32)
                if self.owner(nid) == leaf:
                    m[n.prefix_len :] = 1.0
                masks.append(m)
            out.append((path, masks))
        return out

    def generated_tokens(self) -> int:
        """Tokens sampled by the policy over the whole tree (shared prefixes once)."""
        return int(sum(n.n_generated for n in self.nodes))

    def independent_tokens(self) -> int:
        """Tokens independent rollouts would generate to reach the same leaves."""
        return int(sum(self.nodes[i].n_tokens for p in self.paths() for i in p))

    # ------------------------------------------------------------------ display
    def render(self, width: int = 60) -> str:
        """A text drawing of the tree: one line per decision, indented by step."""
        lines = [f"RolloutTree {self.env_id} seed={self.seed}: {len(self.paths())} rollouts"]

        def walk(parent: int, indent: str) -> None:
            kids = self._children[parent]
            for i, nid in enumerate(kids):
                n = self.nodes[nid]
                last = i == len(kids) - 1
                mark = f"k={i + 1} " if len(kids) > 1 else ""
                act = n.text.strip() or str(n.action)
                act = act.replace("\n", " ")[:width]
                tail = f" r={n.reward:.3f}" if n.reward else ""
                tail += " [done]" if n.done else ""
                tail += f" [error: {n.error}]" if n.error else ""
                lines.append(f"{indent}{'`-' if last else '|-'} {mark}{act}{tail}")
                walk(nid, indent + ("   " if last else "|  "))

        walk(ROOT, "")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"<RolloutTree {self.env_id} seed={self.seed} nodes={len(self.nodes)} "
            f"rollouts={len(self.leaves())} branch_points={len(self.branch_points())}>"
        )


#: The ``info`` flags an env sets for success, read in this order.
SUCCESS_KEYS = ("won", "success", "resolved")


def success_of(tree: RolloutTree, path: Sequence[int], threshold: float = 1.0) -> bool:
    """Whether the rollout ``path`` succeeded: the env's own flag, else return >= threshold."""
    if not path:
        return False
    info = tree[path[-1]].info or {}
    for key in SUCCESS_KEYS:
        if key in info and isinstance(info[key], bool | np.bool_):
            return bool(info[key])
    return float(tree.path_returns_to_go(path)[0]) >= threshold - 1e-9
