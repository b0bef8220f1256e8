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
  per-token teacher-student log-ratio (§2); :mod:`branchgym.agents.estimators.losses` consumes them.

Below the registry, the tensor functions every entry is built on: the group baselines
(:func:`grpo_advantages`, :func:`rloo_advantages`, :func:`sibling_advantages`) take
rewards whose **last dimension is the group** (the G responses of one prompt, or the K
siblings of one branch point), any leading dimensions being independent groups; eq. 5
is :func:`propagate_advantages` along one owning path. Bad input raises
:class:`~branchgym.error.LossInputError`, whose message says the fix.

Learners pick an entry with :func:`advantage` (unknown names raise
:class:`~branchgym.error.TrainingConfigError` listing the known ones) or
:func:`per_prompt`, which calls it on each prompt's trees of a batch. The estimator study
(:mod:`branchgym.envs.toy.estimators`) keeps a vectorised numpy path; ``tests/agents/
test_advantages.py`` and ``tests/bench/test_estimator*.py`` pin it to these entries.

Why this module is over 600 lines: it is the one home of every estimator (issue 30);
the tensor functions, eq. 4-5 on trees and the credit variants share input checks and
helpers, and split up they would again be copies in several places.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from branchgym.error import DependencyMissingError, LossInputError, TrainingConfigError
from branchgym.rollout.tree import RolloutTree

try:
    import torch
    from torch import Tensor
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra(
        "branchgym.agents.estimators.advantages", "llm", "torch"
    ) from exc

__all__ = [
    "ADVANTAGES",
    "CREDITS",
    "DEPTH_COUNTS",
    "DEPTH_WEIGHTS",
    "GROUP_ESTIMATORS",
    "TAILS",
    "TOKEN_ADVANTAGES",
    "AdvantageOptions",
    "GroupAdvantages",
    "NodeAdvantages",
    "advantage",
    "bellman_po_weights",
    "degenerate_groups",
    "grpo_advantages",
    "opd_advantages",
    "per_prompt",
    "propagate_advantages",
    "register_advantage",
    "rloo_advantages",
    "sibling_advantages",
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
        if self.tail not in TAILS:
            raise TrainingConfigError(f"tail must be one of {TAILS}; got {self.tail!r}.")
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
TOKEN_ADVANTAGES: dict[str, Callable[..., Tensor]] = {}  # filled below the definitions


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


# =============================================================== group advantages


@dataclasses.dataclass(frozen=True)
class GroupAdvantages:
    """Advantages of a batch of groups, with the groups that carry no signal.

    Attributes:
        advantages: Same shape as the rewards.
        degenerate: Bool, shape ``rewards.shape[:-1]``: groups whose valid rewards are all
            equal (std = 0) or that have fewer than two valid members. Their advantages
            are exactly zero; learners skip them and log :attr:`n_degenerate` as
            "groups skipped".
    """

    advantages: Tensor
    degenerate: Tensor

    @property
    def n_degenerate(self) -> int:
        """Number of degenerate (skipped) groups."""
        return int(self.degenerate.sum())

    @property
    def n_groups(self) -> int:
        """Number of groups."""
        return int(self.degenerate.numel())

    def __iter__(self) -> Iterator[Tensor]:  # ``adv, skipped = grpo_advantages(r)``
        return iter((self.advantages, self.degenerate))


def _check_rewards(rewards: Tensor, mask: Tensor | None, what: str) -> tuple[Tensor, Tensor]:
    if not isinstance(rewards, Tensor):
        raise LossInputError(
            f"{what}: rewards must be a torch.Tensor (last dimension = group); got "
            f"{type(rewards).__name__}. Wrap them with torch.as_tensor(...)."
        )
    if rewards.ndim == 0:
        raise LossInputError(
            f"{what}: rewards must have a group dimension (last); got a scalar. "
            "Pass shape (G,) for one group or (..., G) for many."
        )
    if rewards.shape[-1] == 0:
        raise LossInputError(f"{what}: empty groups (last dimension 0); a group needs rewards.")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if mask is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    else:
        if mask.shape != rewards.shape:
            raise LossInputError(
                f"{what}: mask shape {tuple(mask.shape)} differs from rewards shape "
                f"{tuple(rewards.shape)}; give one flag per reward."
            )
        valid = mask.to(torch.bool)
    if not bool(torch.isfinite(torch.where(valid, rewards, 0.0)).all()):
        raise LossInputError(
            f"{what}: rewards contain NaN or inf; mask the failed rollouts out "
            "(mask=...) or fix the reward function."
        )
    return rewards, valid


def _group_stats(rewards: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Count, mean and degenerate flag of each group over its valid members."""
    n = valid.sum(-1)
    r = torch.where(valid, rewards, 0.0)
    mean = r.sum(-1) / n.clamp(min=1)
    # "std = 0" is decided exactly (max == min over valid members), not by a threshold:
    # equal rewards always give exactly zero advantages, whatever the rounding of the mean.
    hi = torch.where(valid, rewards, -math.inf).amax(-1)
    lo = torch.where(valid, rewards, math.inf).amin(-1)
    degenerate = (n < 2) | (hi == lo)
    return n, mean, degenerate


def degenerate_groups(rewards: Tensor, mask: Tensor | None = None) -> Tensor:
    """Groups without signal: all valid rewards equal, or fewer than two valid members.

    Args:
        rewards: ``(..., G)`` rewards or returns.
        mask: Optional ``(..., G)`` validity flags (False = failed rollout, ignored).

    Returns:
        Bool tensor of shape ``rewards.shape[:-1]``.
    """
    rewards, valid = _check_rewards(rewards, mask, "degenerate_groups")
    return _group_stats(rewards, valid)[2]


def grpo_advantages(
    rewards: Tensor,
    eps: float = 1e-6,
    *,
    mask: Tensor | None = None,
    unbiased: bool = True,
) -> GroupAdvantages:
    """Group-normalised advantages of GRPO (algorithms.md §3, §4): ``(R_i - mean) / (std + eps)``.

    Args:
        rewards: ``(..., G)`` rewards, last dimension = the group of one prompt.
        eps: Added to the std; only stabilises small spreads. Groups whose std is exactly
            zero never divide: they are flagged degenerate and get zero advantages.
        mask: Optional ``(..., G)`` validity flags; invalid members are left out of the
            statistics and get advantage 0.
        unbiased: Bessel-corrected std (``N - 1``), as TRL and verl compute it (default);
            ``False`` for the population std (``N``).

    Returns:
        :class:`GroupAdvantages` (unpacks as ``advantages, degenerate``).
    """
    rewards, valid = _check_rewards(rewards, mask, "grpo_advantages")
    n, mean, degenerate = _group_stats(rewards, valid)
    centred = torch.where(valid, rewards - mean.unsqueeze(-1), 0.0)
    dof = (n - 1) if unbiased else n
    std = (centred.square().sum(-1) / dof.clamp(min=1)).sqrt()
    adv = centred / (std + eps).unsqueeze(-1)
    adv = torch.where(degenerate.unsqueeze(-1) | ~valid, 0.0, adv)
    return GroupAdvantages(adv, degenerate)


def _leave_one_out(rewards: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    n, _, degenerate = _group_stats(rewards, valid)
    r = torch.where(valid, rewards, 0.0)
    others = (r.sum(-1, keepdim=True) - r) / (n - 1).clamp(min=1).unsqueeze(-1)
    adv = torch.where(degenerate.unsqueeze(-1) | ~valid, 0.0, rewards - others)
    return adv, degenerate


def rloo_advantages(rewards: Tensor, *, mask: Tensor | None = None) -> GroupAdvantages:
    """Leave-one-out advantages of RLOO (algorithms.md §4), unnormalised.

    ``A_i = R_i - (1 / (G - 1)) * sum_{j != i} R_j``, which equals
    ``G / (G - 1) * (R_i - mean_j R_j)``.

    Args:
        rewards: ``(..., G)`` rewards, last dimension = group, ``G >= 2``.
        mask: Optional ``(..., G)`` validity flags; the leave-one-out mean runs over the
            valid members only.

    Returns:
        :class:`GroupAdvantages`; degenerate groups (all equal, or < 2 valid) are zero.
    """
    rewards, valid = _check_rewards(rewards, mask, "rloo_advantages")
    if rewards.shape[-1] < 2:
        raise LossInputError(
            "rloo_advantages: a leave-one-out baseline needs at least 2 rewards per group; "
            f"got groups of {rewards.shape[-1]}. Sample G >= 2 responses per prompt."
        )
    return GroupAdvantages(*_leave_one_out(rewards, valid))


def sibling_advantages(returns: Tensor, *, mask: Tensor | None = None) -> Tensor:
    """Local sibling advantage of Branching PO, algorithms.md eq. (4).

    ``A_local(t, k) = G_t^(t,k) - (1 / (K - 1)) * sum_{j != k} G_t^(t,j)``: each sibling's
    return-to-go from the branch state minus the mean of the other ``K - 1``. Given the
    branch state, its mean is exactly ``Q(s_t, a_k) - V(s_t)`` (unbiased; with the mean
    of all K instead, it would shrink by ``(K - 1) / K``).

    Args:
        returns: ``(..., K)`` returns-to-go of the K siblings of each branch point (the
            backbone's own continuation is sibling 1), ``K >= 2``.
        mask: Optional ``(..., K)`` validity flags (a sibling whose rollout failed).

    Returns:
        Tensor of the same shape; zero for branch points whose siblings all returned the
        same value. With ``K = 1`` there is no sibling to compare with: fall back to
        :func:`rloo_advantages` over independent backbones (algorithms.md §1 step 6).
    """
    returns, valid = _check_rewards(returns, mask, "sibling_advantages")
    if returns.shape[-1] < 2:
        raise LossInputError(
            "sibling_advantages: eq. 4 needs K >= 2 siblings per branch point; got K = "
            f"{returns.shape[-1]}. With K = 1, use rloo_advantages over independent backbones."
        )
    return _leave_one_out(returns, valid)[0]


# ======================================================================== eq. 5

TAILS = ("last", "zero")


def propagate_advantages(
    n_steps: int,
    branch_steps: Sequence[int] | Tensor,
    local_adv: Sequence[float] | Tensor,
    lam: float = 0.95,
    tail: str = "last",
) -> Tensor:
    """Advantage of every decision step along one owning path of a rollout tree, eq. (5).

    A path is the sequence of decisions ``0 .. n_steps - 1`` from the root to one leaf.
    ``branch_steps`` are the steps of that path that are branch points, in increasing
    order, and ``local_adv[i]`` is the eq. (4) local advantage of the sibling this path
    takes at ``branch_steps[i]``. For a step ``t'``, with ``b_i = branch_steps[i]``::

        A(t') = sum over i with b_i >= t' of lam ** (b_i - t') * local_adv[i]

    so a branch step ``b`` itself gets ``local_adv(b)`` plus the discounted advantages
    of the later branch points on the path, and the shared steps before the first branch
    point collect every downstream comparison (the "advantage broadcast" of eq. 6).

    Steps after the last branch point ``b*`` (a sibling's own tail, or the backbone's
    tail) have no branch point at or after them:

    * ``tail="last"`` (algorithms.md default): they get ``local_adv(b*)`` undiscounted, as RLOO
      gives every token of a trajectory its trajectory advantage;
    * ``tail="zero"``: they get 0 (the strict reading of eq. 5).

    Only branch points at or after a step affect it, so a caller that needs the steps
    from ``t0`` on may pass just the branch points at or after ``t0``; entries before
    ``t0`` are then meaningless.

    With no branch points on the path (``M = 0`` or ``K = 1``) every step gets 0 under
    either tail: there is no sibling comparison to propagate, and the learner must fall
    back to the group (RLOO) baseline over independent backbones (algorithms.md §1 step 6).

    Args:
        n_steps: Number of decision steps on the path (``>= 0``).
        branch_steps: Strictly increasing step indices in ``[0, n_steps)``.
        local_adv: One local advantage per branch step (a sequence or a 1-D tensor).
        lam: Discount ``lambda`` in ``[0, 1]`` (algorithms.md default 0.95).
        tail: ``"last"`` or ``"zero"``, see above.

    Returns:
        1-D float tensor of length ``n_steps`` (dtype and device of ``local_adv`` when it
        is a floating tensor; the default dtype otherwise).
    """
    if tail not in TAILS:
        raise LossInputError(f"propagate_advantages: tail must be one of {TAILS}; got {tail!r}.")
    if not 0.0 <= float(lam) <= 1.0:
        raise LossInputError(
            f"propagate_advantages: lam must be in [0, 1] (algorithms.md default 0.95); got {lam}."
        )
    if isinstance(n_steps, bool) or int(n_steps) != n_steps or n_steps < 0:
        raise LossInputError(
            f"propagate_advantages: n_steps must be a non-negative int; got {n_steps!r}."
        )
    n_steps = int(n_steps)
    if isinstance(local_adv, Tensor) and local_adv.is_floating_point():
        adv = local_adv.reshape(-1)
    else:
        adv = torch.as_tensor(local_adv, dtype=torch.get_default_dtype()).reshape(-1)
    steps = torch.as_tensor(branch_steps, dtype=torch.long, device=adv.device).reshape(-1)
    if steps.numel() != adv.numel():
        raise LossInputError(
            f"propagate_advantages: {steps.numel()} branch steps but {adv.numel()} local "
            "advantages; give one local advantage per branch step of the path."
        )
    if steps.numel():
        if int(steps.min()) < 0 or int(steps.max()) >= n_steps:
            raise LossInputError(
                f"propagate_advantages: branch steps {steps.tolist()} must lie in "
                f"[0, n_steps={n_steps})."
            )
        if steps.numel() > 1 and not bool((steps[1:] > steps[:-1]).all()):
            raise LossInputError(
                f"propagate_advantages: branch steps {steps.tolist()} must be strictly "
                "increasing (one local advantage per branch point along the path)."
            )
    out = torch.zeros(n_steps, dtype=adv.dtype, device=adv.device)
    if steps.numel() == 0:
        return out
    t = torch.arange(n_steps, device=adv.device)
    gap = steps.unsqueeze(0) - t.unsqueeze(1)  # (n_steps, M): b - t'
    weight = torch.where(
        gap >= 0, torch.tensor(float(lam), dtype=adv.dtype, device=adv.device) ** gap, 0.0
    )
    out = weight @ adv
    if tail == "last":
        last = int(steps[-1])
        out[last + 1 :] = adv[-1]
    return out


# =============================================================== token estimators


def bellman_po_weights(mu: Tensor, pi: Tensor, eps: float = 0.1) -> Tensor:
    """Smoothed complementary-probability ratio of Bellman PO (algorithms.md §3).

    ``omega = (1 + eps - mu) / (1 + eps - pi)``, with ``mu`` the rollout policy's and
    ``pi`` the current policy's probability of the sampled token. ``omega = 1`` when
    ``pi = mu``; it grows when the current policy has become more certain of the token.
    With ``eps = 0`` it is the exact ratio ``(1 - q) / (1 - p)`` of the identity
    ``grad[log p + KL_bin(mu || pi; y)] = (1 - q) / (1 - p) * grad log p``.

    Args:
        mu: Probabilities (not log-probabilities) under the rollout policy.
        pi: Probabilities under the current policy (same shape).
        eps: Smoothing (algorithms.md default 0.1); must be > 0 unless no probability equals 1.

    Returns:
        ``omega``, same shape; differentiable (the loss stops its gradient).
    """
    if eps < 0:
        raise LossInputError(f"bellman_po_weights: eps must be >= 0 (default 0.1); got {eps}.")
    return (1.0 + eps - mu) / (1.0 + eps - pi)


def opd_advantages(teacher_logp: Tensor, student_logp: Tensor, delta: float = 1.0) -> Tensor:
    """Per-token distillation advantage of (Branching) OPD (algorithms.md §2 step 5).

    ``A = clip(stopgrad(log pi_T(a|s) - log pi_theta(a|s)), -delta, delta)``: positive
    where the teacher likes the student's token more than the student does. Its
    expectation under the student is minus the reverse KL's gradient weight.

    The spec does not give ``delta``; the default 1.0 bounds a token's advantage at the
    scale of a normalised advantage. (The source lists an unexplained ``eta = 0.2`` among
    its key hyperparameters, which may be this; pass ``delta=0.2`` to try it.)

    Args:
        teacher_logp: ``(..., T)`` log-probabilities of the sampled tokens under the
            frozen teacher.
        student_logp: Same shape, under the student.
        delta: Clip bound, ``> 0``.

    Returns:
        Detached per-token advantages.
    """
    if delta <= 0:
        raise LossInputError(f"opd_advantages: delta must be > 0; got {delta}.")
    if teacher_logp.shape != student_logp.shape:
        raise LossInputError(
            f"opd_advantages: teacher shape {tuple(teacher_logp.shape)} differs from student "
            f"shape {tuple(student_logp.shape)}."
        )
    return torch.clamp((teacher_logp - student_logp).detach(), -delta, delta)


# ================================================================ group baselines


def _group(
    trees: Sequence[RolloutTree], estimate: Callable[..., GroupAdvantages]
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
    return _group(trees, lambda r, mask: grpo_advantages(r, options.std_eps, mask=mask))


def rloo(trees: Sequence[RolloutTree], options: AdvantageOptions) -> NodeAdvantages:
    """RLOO: ``R_i - mean_{j != i} R_j`` (algorithms.md §4); Branching PO's K = 1 fallback."""
    return _group(trees, rloo_advantages)


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
        a = sibling_advantages(returns, mask=valid)
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
        along = propagate_advantages(len(nodes), steps, values, lam, tail)
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
            loo, _ = rloo_advantages(
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
TOKEN_ADVANTAGES.update(bellman_po=bellman_po_weights, opd=opd_advantages)
