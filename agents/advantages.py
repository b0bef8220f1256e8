"""Every advantage estimator of the learners, listed in one registry (docs/estimators.md).

Two kinds, each a dict of functions with one signature:

* :data:`ADVANTAGES`, node estimators:
  ``fn(trees, options) -> NodeAdvantages``. ``trees`` are the rollout trees of **one
  prompt** (GRPO/RLOO: one tree whose leaves are the N independent rollouts; Branching PO:
  the prompt's G backbones' trees), ``options`` an :class:`AdvantageOptions`. The result
  holds, per tree, node id -> the advantage of the decision that produced that node.
  Entries: ``grpo`` and ``rloo`` (algorithms.md §4, also Branching PO's K = 1 fallback),
  ``bpo`` (the spec: eq. 4 at each branch point, eq. 5 along each owning path), and the
  unbiased credit variants ``root`` and ``value_diff`` of docs/estimators.md.
  ``backbone_credit`` and ``depth_weight`` modify every tree estimator alike.
* :data:`TOKEN_ADVANTAGES`, token estimators on tensors, which no tree signature fits:
  Bellman PO's importance weights ``omega(mu, pi)`` (algorithms.md §3) and OPD's
  per-token teacher-student log-ratio (§2). They are pure tensor functions of
  :mod:`branchgym.agents.losses`, next to the losses that consume them.

Learners pick an entry with :func:`advantage` (unknown names raise
:class:`~branchgym.error.TrainingConfigError` listing the known ones) or
:func:`per_prompt`, which calls it on each prompt's trees of a batch. The estimator study
(:mod:`branchgym.estimators`) keeps a vectorised numpy path; ``tests/agents/
test_advantages.py`` and ``tests/bench/test_estimator*.py`` pin it to these entries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from branchgym.agents import losses
from branchgym.error import TrainingConfigError
from branchgym.rollout.tree import RolloutTree

__all__ = [
    "ADVANTAGES",
    "CREDITS",
    "DEPTH_COUNTS",
    "DEPTH_WEIGHTS",
    "GROUP_ESTIMATORS",
    "TOKEN_ADVANTAGES",
    "AdvantageOptions",
    "NodeAdvantages",
    "advantage",
    "per_prompt",
    "register_advantage",
    "tree_advantages",
]

#: ``depth_count`` values: what n_t of ``depth_weight`` counts (see :data:`DEPTH_WEIGHTS`).
DEPTH_COUNTS = ("backbone", "realised")


@dataclasses.dataclass(frozen=True)
class AdvantageOptions:
    """What the node estimators read; :meth:`of` takes the same-named fields of a learner's Args."""

    lam: float = 0.95
    """lambda of eq. (5)."""
    tail: str = "last"
    """Steps after a path's last branch point: ``last`` (its local advantage) or ``zero``."""
    backbone_credit: str = "include"
    """``exclude``: the backbone's own decisions get advantage 0."""
    depth_weight: bool = False
    """Scale each decision's advantage by N / n_t (docs/estimators.md)."""
    depth_count: str = "backbone"
    """What n_t of ``depth_weight`` counts, one of :data:`DEPTH_COUNTS`."""
    schedule: str = "entropy"
    """The branch schedule the trees were grown with (``depths`` plans ``branch_depths``)."""
    branch_depths: tuple[int, ...] = ()
    """Decision depths of ``schedule="depths"``."""
    m: int = 2
    """Branch points M per backbone (the planned rollouts of ``depth_weight``)."""
    k: int = 4
    """Siblings K per branch point."""
    std_eps: float = 1e-6
    """GRPO's ``eps`` added to the group std."""

    def __post_init__(self) -> None:
        if self.tail not in losses.TAILS:
            raise TrainingConfigError(f"tail must be one of {losses.TAILS}; got {self.tail!r}.")
        if self.depth_count not in DEPTH_COUNTS:
            raise TrainingConfigError(
                f"depth_count must be one of {DEPTH_COUNTS}; got {self.depth_count!r}."
            )
        if self.backbone_credit not in ("include", "exclude"):
            raise TrainingConfigError(
                f"backbone_credit must be include or exclude; got {self.backbone_credit!r}."
            )

    @classmethod
    def of(cls, args: Any) -> AdvantageOptions:
        """The options of a learner's Args (fields it lacks keep their defaults)."""
        given = {
            f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)
        }
        if "branch_depths" in given:
            given["branch_depths"] = tuple(given["branch_depths"])
        return cls(**given)


@dataclasses.dataclass(frozen=True)
class NodeAdvantages:
    """One prompt's advantages: per tree, node id -> advantage; and what carried no signal.

    Attributes:
        nodes: One dict per tree, in the order of the trees given.
        degenerate: Group estimators: 1 if the prompt's rollouts all returned the same
            (a skipped group), else 0. Tree estimators: branch points whose siblings tied.
        branch_points: Branch points of the trees (0 for group estimators).
    """

    nodes: list[dict[int, float]]
    degenerate: int = 0
    branch_points: int = 0


#: A node estimator: one prompt's trees and the options -> its advantages.
Advantage = Callable[[Sequence[RolloutTree], AdvantageOptions], NodeAdvantages]

#: estimator name -> node estimator; add entries with :func:`register_advantage`.
ADVANTAGES: dict[str, Advantage] = {}

#: Entries of :data:`ADVANTAGES` that are a group baseline over independent rollouts.
GROUP_ESTIMATORS = ("grpo", "rloo")

#: Branching PO's ``credit`` option -> its entry of :data:`ADVANTAGES`.
CREDITS = {"lambda": "bpo", "root": "root", "value_diff": "value_diff"}

#: Token estimators on tensors (see the module docstring): name -> function.
TOKEN_ADVANTAGES: dict[str, Callable[..., torch.Tensor]] = {
    "bellman_po": losses.bellman_po_weights,
    "opd": losses.opd_advantages,
}


def register_advantage(name: str, fn: Advantage) -> Advantage:
    """Add a node estimator under ``name`` (an existing name is refused)."""
    if name in ADVANTAGES:
        raise TrainingConfigError(f"advantage estimator {name!r} is already registered.")
    ADVANTAGES[name] = fn
    return fn


def advantage(name: str) -> Advantage:
    """The node estimator called ``name``."""
    try:
        return ADVANTAGES[name]
    except KeyError:
        raise TrainingConfigError(
            f"unknown advantage estimator {name!r}; known: {', '.join(sorted(ADVANTAGES))}."
        ) from None


def per_prompt(
    name: str, trees: Sequence[RolloutTree], groups: Sequence[int], options: AdvantageOptions
) -> tuple[list[dict[int, float]], int, int]:
    """Call estimator ``name`` on each prompt's trees (``groups[i]``: the prompt of tree i).

    Returns:
        ``(advantage by node id per tree, in the trees' order, degenerate, branch points)``
        with the counts summed over prompts.
    """
    fn = advantage(name)
    per_tree: list[dict[int, float]] = [{} for _ in trees]
    degenerate = branch_points = 0
    for g in dict.fromkeys(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        out = fn([trees[i] for i in idx], options)
        for i, a in zip(idx, out.nodes, strict=True):
            per_tree[i] = a
        degenerate += out.degenerate
        branch_points += out.branch_points
    return per_tree, degenerate, branch_points


# ================================================================ group baselines


def _group(
    trees: Sequence[RolloutTree], estimate: Callable[..., losses.GroupAdvantages]
) -> NodeAdvantages:
    """A group baseline over all rollouts (leaves) of the prompt's trees, on all their nodes.

    A rollout whose sandbox failed (``RolloutTree.valid_paths``) is left out of the
    statistics and gets advantage 0.
    """
    returns = torch.as_tensor(np.concatenate([t.returns() for t in trees]))[None]
    valid = torch.as_tensor(np.concatenate([t.valid_paths() for t in trees]))[None]
    adv, degenerate = estimate(returns, mask=valid)
    nodes, j = [], 0
    for t in trees:
        by_node = {}
        for leaf in t.leaves():
            for nid in t.path_to(leaf):
                by_node[nid] = float(adv[0, j])
            j += 1
        nodes.append(by_node)
    return NodeAdvantages(nodes, int(degenerate.sum()))


def grpo(trees: Sequence[RolloutTree], options: AdvantageOptions) -> NodeAdvantages:
    """GRPO: ``(R_i - mean) / (std + eps)`` over the prompt's rollouts (algorithms.md §4)."""
    return _group(trees, lambda r, mask: losses.grpo_advantages(r, options.std_eps, mask=mask))


def rloo(trees: Sequence[RolloutTree], options: AdvantageOptions) -> NodeAdvantages:
    """RLOO: ``R_i - mean_{j != i} R_j`` (algorithms.md §4); Branching PO's K = 1 fallback."""
    return _group(trees, losses.rloo_advantages)


# ============================================================ tree estimators


def tree_advantages(
    tree: RolloutTree, lam: float = 0.95, tail: str = "last"
) -> tuple[dict[int, float], int, int]:
    """Eq. (4) at every branch point, then eq. (5) along every path: node -> advantage.

    Each node takes the advantage computed on its owning path (the path through its own
    continuation), so a shared prefix gets the discounted sum of every downstream
    comparison on that path once.

    Returns:
        ``(advantage by node id, branch points, degenerate branch points)``; nodes of a
        tree without branch points get 0.
    """
    bps = tree.branch_points()
    local: list[torch.Tensor] = []
    degenerate = 0
    for bp in bps:
        returns = torch.tensor(bp.returns, dtype=torch.float64)
        valid = torch.tensor([tree.line_valid(s) for s in bp.siblings])  # errors left out
        a = losses.sibling_advantages(returns, mask=valid)
        degenerate += int(bool((a == 0).all()))
        local.append(a)
    index = {(b.parent, b.step): i for i, b in enumerate(bps)}
    out: dict[int, float] = {}
    for leaf, owned in tree.owned_nodes().items():
        nodes = tree.path_to(leaf)
        steps, values = [], []
        for pos, nid in enumerate(nodes):
            k = tree.sibling_index(nid)
            if k:
                steps.append(pos)
                values.append(float(local[index[(tree[nid].parent, pos)]][k - 1]))
        along = losses.propagate_advantages(len(nodes), steps, values, lam, tail)
        for nid in owned:
            out[nid] = float(along[tree[nid].step])
    return out, len(bps), degenerate


@dataclasses.dataclass(frozen=True)
class _Point:
    """One branch point of a backbone: what the credit variants read."""

    step: int
    g_backbone: float  # the backbone sibling's return-to-go from the point
    v_hat: float  # mean return of the valid siblings (the value estimate at the point)
    base: float  # mean return of the valid fresh siblings (the backbone left out)
    valid: bool  # the backbone's own line ran


def _backbone_points(tree: RolloutTree) -> list[_Point]:
    """The branch points on the backbone, by depth."""
    backbone = tree.backbone
    bps = sorted(
        (b for b in tree.branch_points() if b.siblings[0] in backbone), key=lambda b: b.step
    )
    points = []
    for b in bps:
        ret = np.asarray(b.returns, dtype=np.float64)
        ok = np.array([tree.line_valid(x) for x in b.siblings])
        fresh = ok.copy()
        fresh[0] = False
        v_hat = float(ret[ok].mean()) if ok.any() else 0.0
        base = float(ret[fresh].mean()) if fresh.any() else 0.0
        points.append(_Point(b.step, float(ret[0]), v_hat, base, bool(ok[0])))
    return points


def _root_step(points: list[_Point], i: int) -> float:
    """``root``: the comparison at the latest branch point at or above the decision."""
    return points[i].g_backbone - points[i].base


def _value_diff_step(points: list[_Point], i: int) -> float:
    """``value_diff``: rewards to the next point + its sibling mean - this point's baseline."""
    if i == len(points) - 1:
        return _root_step(points, i)
    nxt = points[i + 1]
    return points[i].g_backbone - nxt.g_backbone + nxt.v_hat - points[i].base


def _root_prefix(g0: float, first: _Point) -> float:
    """``root``: the prefix's value is the backbone's return."""
    return g0


def _value_diff_prefix(g0: float, first: _Point) -> float:
    """``value_diff``: rewards to the first point + its sibling mean."""
    return g0 - first.g_backbone + first.v_hat


def _backbone_credit(
    trees: Sequence[RolloutTree],
    eq45: list[dict[int, float]],
    step_credit: Callable[[list[_Point], int], float],
    prefix_value: Callable[[float, _Point], float],
) -> list[dict[int, float]]:
    """The unbiased variants: fresh siblings keep eq. 4/5; backbone decisions get the credit.

    Decisions above the first branch point get a leave-one-out baseline among the
    prompt's backbones (with one backbone, as ``root_even`` has, the first point is the
    root and there is no prefix).
    """
    per_tree = [dict(a) for a in eq45]
    prefix: list[tuple[float, bool]] = []  # per backbone: (prefix value, valid)
    pending: list[list[int]] = []  # per tree: backbone nodes above the first branch point
    for tree, out in zip(trees, per_tree, strict=True):
        backbone = tree.backbone
        points = _backbone_points(tree)
        pending.append([])
        for pos, nid in enumerate(backbone):
            i = max((j for j, p in enumerate(points) if p.step <= pos), default=-1)
            if i < 0:
                pending[-1].append(nid)
            else:
                out[nid] = step_credit(points, i)
        g0 = float(tree.path_returns_to_go(backbone)[0]) if backbone else 0.0
        if points:
            prefix.append((prefix_value(g0, points[0]), points[0].valid))
        else:  # the line ended before its first planned point: its return is the value
            prefix.append((g0, bool(backbone) and tree.line_valid(backbone[0])))
    if any(pending):
        if len(trees) >= 2:
            loo, _ = losses.rloo_advantages(
                torch.tensor([[p[0] for p in prefix]], dtype=torch.float64),
                mask=torch.tensor([[p[1] for p in prefix]]),
            )
            values = [float(x) for x in loo[0]]
        else:
            values = [p[0] for p in prefix]
        for out, nodes, v in zip(per_tree, pending, values, strict=True):
            for nid in nodes:
                out[nid] = v
    return per_tree


def _exclude_backbone(trees: Sequence[RolloutTree], per_tree: list[dict[int, float]]) -> None:
    """``backbone_credit="exclude"``: the backbone's own decisions get 0."""
    for tree, out in zip(trees, per_tree, strict=True):
        for nid in tree.backbone:
            out[nid] = 0.0


def _realised_depth_weight(
    trees: Sequence[RolloutTree], per_tree: list[dict[int, float]], options: AdvantageOptions
) -> None:
    """``depth_count="realised"``: n_t = the prompt's decisions at the depth."""
    count: dict[int, int] = {}
    for tree in trees:
        for n in tree.nodes:
            count[n.step] = count.get(n.step, 0) + 1
    n_leaves = sum(len(t.leaves()) for t in trees)
    for tree, out in zip(trees, per_tree, strict=True):
        for nid in out:
            out[nid] *= n_leaves / count[tree[nid].step]


def _backbone_depth_weight(
    trees: Sequence[RolloutTree], per_tree: list[dict[int, float]], options: AdvantageOptions
) -> None:
    """``depth_count="backbone"``: n_t = G x the lines planned in the decision's tree at t."""
    g = len(trees)
    planned = g * (1 + options.m * (options.k - 1))
    for tree, out in zip(trees, per_tree, strict=True):
        if options.schedule == "depths":  # planned: reached or not (a line that ended
            steps = sorted(options.branch_depths)  # adds no pairs; its count still does)
        else:  # the backbone's own points (all exist on fixed-length episodes)
            steps = sorted(b.step for b in tree.branch_points() if b.siblings[0] in tree.backbone)
        for nid in out:
            above = sum(1 for b in steps if b <= tree[nid].step)
            out[nid] *= planned / (g * (1 + (options.k - 1) * above))


#: ``depth_count`` -> how ``depth_weight`` rescales the advantages in place.
DEPTH_WEIGHTS = {"backbone": _backbone_depth_weight, "realised": _realised_depth_weight}


def _tree_estimate(
    trees: Sequence[RolloutTree],
    options: AdvantageOptions,
    credit: Callable[[Sequence[RolloutTree], list[dict[int, float]]], list[dict[int, float]]]
    | None,
) -> NodeAdvantages:
    """Eq. 4/5 on each tree, ``credit`` for the backbone, then the shared modifiers."""
    eq45, n_bp, n_degenerate = [], 0, 0
    for t in trees:
        a, bp, deg = tree_advantages(t, options.lam, options.tail)
        eq45.append(a)
        n_bp, n_degenerate = n_bp + bp, n_degenerate + deg
    per_tree = eq45 if credit is None else credit(trees, eq45)
    if options.backbone_credit == "exclude":
        _exclude_backbone(trees, per_tree)
    if options.depth_weight:
        DEPTH_WEIGHTS[options.depth_count](trees, per_tree, options)
    return NodeAdvantages(per_tree, n_degenerate, n_bp)


def bpo(trees: Sequence[RolloutTree], options: AdvantageOptions) -> NodeAdvantages:
    """Branching PO as specified: eq. (4) at each branch point, eq. (5) along each path."""
    return _tree_estimate(trees, options, None)


def root(trees: Sequence[RolloutTree], options: AdvantageOptions) -> NodeAdvantages:
    """Backbone decisions: the comparison at the latest branch point at or above them."""
    return _tree_estimate(
        trees, options, lambda ts, eq45: _backbone_credit(ts, eq45, _root_step, _root_prefix)
    )


def value_diff(trees: Sequence[RolloutTree], options: AdvantageOptions) -> NodeAdvantages:
    """Backbone decisions between two points: next point's value estimate minus this baseline."""
    return _tree_estimate(
        trees,
        options,
        lambda ts, eq45: _backbone_credit(ts, eq45, _value_diff_step, _value_diff_prefix),
    )


register_advantage("grpo", grpo)
register_advantage("rloo", rloo)
register_advantage("bpo", bpo)
register_advantage("root", root)
register_advantage("value_diff", value_diff)
