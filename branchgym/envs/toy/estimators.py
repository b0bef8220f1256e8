"""Policy-gradient estimators on a TreeMDP, measured against the exact gradient.

A tabular softmax policy (logits ``theta[s, a]``) on a :class:`~branchgym.envs.toy.TreeStructure`
has the exact gradient of ``J = V(s_0)``

    g*[s, a] = d(s) pi(a|s) (Q(s, a) - V(s))

with ``d(s)`` the probability of visiting ``s`` (:func:`exact_gradient`). An estimator
samples trajectories (here straight from the tree's arrays, vectorised over many
independent repeats) and returns ``g = sum over counted pairs w * grad log pi(a|s)``,
``grad log pi(a|s) = e_a - pi(s)``. :func:`measure` gives its mean, ``tr Cov`` and
``E|g - g*|^2`` over many repeats, overall, by decision depth and for the decisions
before the first branch point; :func:`estimate` gives one ``g`` per repeat (training).

Estimators (:class:`Design`, docs/estimators.md derives each one):

* ``rloo``/``grpo``: N independent rollouts, leave-one-out or mean/std-normalised
  advantage, every decision of a trajectory gets its trajectory's advantage, ``1/N``.
* Branching PO (docs/algorithms.md §1): G backbones (the spec: 1), M branch points each
  chosen by a schedule (``entropy``, ``random``, ``even``, ``root_even``: the root plus
  evenly spaced points, ``last``: the last M decisions, ``fixed``), K siblings per point
  (the backbone's action is sibling 1). Credit (``credit=``): ``lambda`` (eq. 5, tail
  ``last``), ``root`` (G >= 2: prefix decisions get a leave-one-out baseline among the
  backbones, later ones the
  comparison at the latest branch point at or above them), ``value_diff`` (backbone
  decisions between two branch points get the mean of the K sibling returns at the next
  point minus the baseline at the previous one). ``backbone="exclude"`` leaves the
  backbone's own actions out of the comparison (they only serve in the fresh siblings'
  baselines). ``norm="traj"`` divides by the number of leaves N (spec, RLOO);
  ``norm="depth"`` averages the pairs at each depth by their realised count (exact when
  every episode has the same length and the schedule does not look at the sampled
  trajectory; biased otherwise); ``norm="backbone"`` weights a pair by
  ``1 / (G c_i(t))``, ``c_i(t)`` the lines planned in its own backbone's tree at its depth
  (for ``fixed``: 1 + (K - 1) x the fixed depths at or above it, whether or not the
  lines got there), which no line's length changes: exact on any lengths with the
  ``fixed`` schedule (branching where the line is alive), and on fixed lengths with every
  trajectory-free schedule. docs/estimators.md derives all three.

Leaves may sit at any depth (``TreeStructure.random(end_actions=, termination_prob=)``):
an episode that ended stays at its leaf, takes no more decisions and costs no more steps;
a branch point a line does not reach does not exist.

The module is over 600 lines: the exact passes, the vectorised sampler of every design and
the moment accumulation share one array layout, and are read and tested together.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from branchgym.envs.toy.tree_mdp import TreeStructure

__all__ = [
    "CREDITS",
    "Design",
    "Exact",
    "Measurement",
    "NORMS",
    "SCHEDULES",
    "TreeArrays",
    "estimate",
    "exact",
    "exact_gradient",
    "exact_j",
    "measure",
    "optimal_j",
    "policy_snapshots",
    "schedule_depths",
    "softmax",
]

SCHEDULES = ("entropy", "random", "even", "root_even", "last", "fixed")
CREDITS = ("lambda", "root", "value_diff")
NORMS = ("traj", "depth", "backbone")


# ------------------------------------------------------------------------- trees


@dataclasses.dataclass(frozen=True, eq=False)
class TreeArrays:
    """A TreeStructure prepared for vectorised sampling and exact passes.

    Leaves may sit at any depth (episodes of variable length): ``inner[t]`` lists the
    decision states at depth ``t``, ``levels[t]`` every node there.
    """

    tree: TreeStructure
    depth: int
    levels: tuple[np.ndarray, ...]  # node ids at each depth 0..D
    cum_probs: np.ndarray  # (n_nodes, A, O) cumulative outcome probabilities
    r1: np.ndarray  # E[reward] at leaves
    r2: np.ndarray  # E[reward^2] at leaves
    leaf: np.ndarray  # (n_nodes,) bool
    inner: tuple[np.ndarray, ...]  # decision states at each depth 0..D-1

    @classmethod
    def of(cls, tree: TreeStructure) -> TreeArrays:
        """Precompute the arrays (any tree of :class:`TreeStructure`, full or not)."""
        d = tree.max_depth
        leaf = tree.children[:, 0, 0] < 0
        levels = tuple(np.flatnonzero(tree.depth == t) for t in range(d + 1))
        inner = tuple(np.flatnonzero((tree.depth == t) & ~leaf) for t in range(d))
        r1 = tree.reward_mean
        r2 = r1 if tree.reward_kind == "bernoulli" else r1**2 + tree.reward_std**2
        return cls(tree, d, levels, np.cumsum(tree.probs, axis=-1), r1, r2, leaf, inner)

    @property
    def variable_length(self) -> bool:
        """Whether some episode ends before the last level."""
        return bool(np.any(self.tree.depth[self.leaf] < self.depth))

    @property
    def n_nodes(self) -> int:
        """Number of nodes."""
        return self.tree.n_nodes

    @property
    def n_actions(self) -> int:
        """Actions per inner node."""
        return self.tree.n_actions


def softmax(theta: np.ndarray) -> np.ndarray:
    """Row-wise softmax over the last axis."""
    z = theta - theta.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


# ------------------------------------------------------------------------- exact


@dataclasses.dataclass(frozen=True)
class Exact:
    """Exact quantities of one policy: ``d(s)``, ``V``, ``Q``, ``Var(G|s)``, ``g*``, ``J``."""

    reach: np.ndarray
    v: np.ndarray
    q: np.ndarray
    var: np.ndarray
    grad: np.ndarray

    @property
    def j(self) -> float:
        """``J = V(s_0)``."""
        return float(self.v[0])


def exact(arr: TreeArrays, pi: np.ndarray) -> Exact:
    """Backward pass for ``V, Q, E[G^2]``, forward pass for ``d(s)``; ``g* = d pi (Q - V)``."""
    t = arr.tree
    n, a_n = arr.n_nodes, arr.n_actions
    v = np.zeros(n)
    v2 = np.zeros(n)
    q = np.zeros((n, a_n))
    for d in range(arr.depth - 1, -1, -1):
        s = arr.inner[d]
        c = t.children[s]
        g1 = arr.r1[c] + v[c]
        g2 = arr.r2[c] + 2 * arr.r1[c] * v[c] + v2[c]
        q[s] = np.sum(t.probs[s] * g1, axis=-1)
        q2 = np.sum(t.probs[s] * g2, axis=-1)
        v[s] = np.sum(pi[s] * q[s], axis=-1)
        v2[s] = np.sum(pi[s] * q2, axis=-1)
    var = np.where(arr.leaf, arr.r2 - arr.r1**2, np.maximum(v2 - v**2, 0.0))
    reach = np.zeros(n)
    reach[0] = 1.0
    for d in range(arr.depth):
        s = arr.inner[d]
        flow = reach[s][:, None, None] * pi[s][:, :, None] * t.probs[s]
        np.add.at(reach, t.children[s].reshape(-1), flow.reshape(-1))
    grad = reach[:, None] * pi * (q - v[:, None])
    grad[arr.leaf] = 0.0
    return Exact(reach, v, q, var, grad)


def exact_gradient(arr: TreeArrays, pi: np.ndarray) -> np.ndarray:
    """``g*[s, a] = d(s) pi(a|s) (Q(s, a) - V(s))``, the gradient of ``J`` in the logits."""
    return exact(arr, pi).grad


def exact_j(arr: TreeArrays, pis: np.ndarray) -> np.ndarray:
    """``J`` of a stack of policies ``(P, n_nodes, A)`` (one backward pass for all)."""
    t = arr.tree
    v = np.zeros((pis.shape[0], arr.n_nodes))
    for d in range(arr.depth - 1, -1, -1):
        s = arr.inner[d]
        c = t.children[s]
        q = np.sum(t.probs[s][None] * (arr.r1[c][None] + v[:, c]), axis=-1)
        v[:, s] = np.sum(pis[:, s] * q, axis=-1)
    return v[:, 0]


def policy_snapshots(
    arr: TreeArrays, fractions: tuple[float, ...] = (0.5, 0.9), lr: float = 5.0, steps: int = 4000
) -> dict[str, np.ndarray]:
    """Uniform policy plus snapshots of exact ascent at fractions of the way to optimal J.

    A snapshot is taken when J first covers each fraction of the way from the uniform
    policy's J to the optimal J.

    The ascent is exact and visitation-normalised (``theta[s] += lr pi(a|s) A(s, a)``, the
    gradient divided by ``d(s)``) so deep states learn as fast as shallow ones.
    """
    theta = np.zeros((arr.n_nodes, arr.n_actions))
    j_u = exact(arr, softmax(theta)).j
    j_opt = optimal_j(arr)
    out = {"uniform": softmax(theta)}
    names = ["mid", "late", "late2", "late3"]
    todo = list(fractions)
    for _ in range(steps):
        pi = softmax(theta)
        e = exact(arr, pi)
        while todo and e.j >= j_u + todo[0] * (j_opt - j_u):
            out[names[len(out) - 1]] = pi
            todo.pop(0)
        if not todo:
            break
        theta = theta + lr * pi * (e.q - e.v[:, None])
    for _ in todo:  # not reached within the budget: the last iterate
        out[names[len(out) - 1]] = softmax(theta)
    return out


def optimal_j(arr: TreeArrays) -> float:
    """The optimal policy's J (backward induction on max_a Q)."""
    t = arr.tree
    v = np.zeros(arr.n_nodes)
    for d in range(arr.depth - 1, -1, -1):
        s = arr.inner[d]
        c = t.children[s]
        v[s] = np.max(np.sum(t.probs[s] * (arr.r1[c] + v[c]), axis=-1), axis=-1)
    return float(v[0])


# ------------------------------------------------------------------------- designs


@dataclasses.dataclass(frozen=True)
class Design:
    """One estimator: the rollout topology and the credit each decision gets.

    Attributes:
        kind: ``rloo``, ``grpo`` (N independent rollouts) or ``tree`` (branching).
        n: Rollouts of ``rloo``/``grpo``.
        g: Backbones per prompt (tree).
        m: Branch points per backbone.
        k: Siblings per branch point, the backbone's action included.
        schedule: One of :data:`SCHEDULES`.
        depths: Branch depths of the ``fixed`` schedule, decided before sampling; a
            negative one counts from the tree's depth D (``-1``: the last decision of
            the horizon). A line that ended before a depth does not branch there.
        lam: lambda of eq. 5 (``credit="lambda"``).
        credit: One of :data:`CREDITS`.
        backbone: ``include`` (spec) or ``exclude`` (the backbone's own actions get no
            credit; fresh siblings still compare against its return).
        norm: One of :data:`NORMS`.
    """

    kind: str = "tree"
    n: int = 7
    g: int = 1
    m: int = 2
    k: int = 4
    schedule: str = "entropy"
    depths: tuple[int, ...] = ()
    lam: float = 0.95
    credit: str = "lambda"
    backbone: str = "include"
    norm: str = "traj"

    def __post_init__(self) -> None:
        """Validate the combination."""
        if self.kind not in ("rloo", "grpo", "tree"):
            raise ValueError(f"kind must be rloo, grpo or tree; got {self.kind!r}")
        if self.kind != "tree":
            if self.n < 2:
                raise ValueError("rloo/grpo need n >= 2 rollouts")
            return
        if self.schedule not in SCHEDULES or self.credit not in CREDITS or self.norm not in NORMS:
            raise ValueError(f"unknown schedule, credit or norm in {self}")
        if self.k < 2 or self.m < 1 or self.g < 1:
            raise ValueError("a tree needs k >= 2, m >= 1 and g >= 1")
        if self.credit == "root" and self.g < 2:
            raise ValueError("credit='root' needs g >= 2 backbones")
        if self.backbone not in ("include", "exclude"):
            raise ValueError("backbone must be 'include' or 'exclude'")
        if self.schedule == "fixed" and len(self.depths) != self.m:
            raise ValueError("the fixed schedule needs m depths")

    @property
    def rollouts(self) -> int:
        """Leaves per prompt: N, or G (1 + M (K - 1))."""
        return self.n if self.kind != "tree" else self.g * (1 + self.m * (self.k - 1))


def schedule_depths(design: Design, depth: int) -> list[int] | None:
    """Branch depths of the trajectory-independent schedules ``even``/``root_even``/``fixed``.

    ``even`` is :func:`branchgym.rollout.schedules.even_schedule` on a backbone of ``depth`` steps;
    ``root_even`` is the root plus ``even`` with M - 1 points; ``last`` the last M
    decisions; ``fixed`` its depths (negative ones from ``depth``). ``None`` for
    ``entropy`` and ``random``, whose points differ per backbone. On variable lengths the
    sampler calls it with each backbone's own length (as the learner's schedules see it),
    except for ``fixed``, whose depths count from the horizon.
    """

    def even(m: int) -> list[int]:
        steps: list[int] = []
        m = min(m, depth)  # a short backbone has fewer points (schedules._check_m)
        for i in range(1, m + 1):
            t = min(depth - 1, int(round(i * depth / (m + 1))))
            free = [u for u in range(depth) if u not in steps]
            steps.append(min(free, key=lambda u: (abs(u - t), u)))
        return sorted(steps)

    if design.schedule == "even":
        return even(design.m)
    if design.schedule == "root_even":
        return sorted({0, *[max(1, u) for u in even(design.m - 1)]})
    if design.schedule == "last":
        return list(range(max(0, depth - design.m), depth))
    if design.schedule == "fixed":
        return sorted(int(u) if u >= 0 else depth + int(u) for u in design.depths)
    return None


# ------------------------------------------------------------------------- sampling


def _rollouts(
    arr: TreeArrays,
    pis: np.ndarray,
    pol: np.ndarray,
    states: np.ndarray,
    start: np.ndarray,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Continue rows from ``states[:, start]`` to a leaf under policy ``pis[pol]``.

    ``states`` is ``(n, D + 1)`` with each row's prefix filled up to ``start``; returns
    ``(states, actions (n, D), returns (n,))``. Actions before ``start`` and after the
    episode ended are -1; a row that reached a leaf stays there (``states[:, D]`` is
    every row's leaf).
    """
    t = arr.tree
    n, d = states.shape[0], arr.depth
    actions = np.full((n, d), -1, dtype=np.int64)
    a_n = arr.n_actions
    flat_pi = pis.reshape(-1, a_n)
    for step in range(d):
        going = start <= step
        states[going, step + 1] = states[going, step]  # ended rows stay at their leaf
        rows = np.flatnonzero(going & ~arr.leaf[states[:, step]])
        if rows.size == 0:
            continue
        s = states[rows, step]
        cum = np.cumsum(flat_pi[pol[rows] * arr.n_nodes + s], axis=1)
        u = rng.random(rows.size) * cum[:, -1]
        a = np.minimum((u[:, None] >= cum).sum(axis=1), a_n - 1)
        cp = arr.cum_probs[s, a]
        o = np.minimum((rng.random(rows.size)[:, None] >= cp).sum(axis=1), cp.shape[1] - 1)
        actions[rows, step] = a
        states[rows, step + 1] = t.children[s, a, o]
    leaf = states[:, d]
    mean = t.reward_mean[leaf]
    if t.reward_kind == "bernoulli":
        ret = (rng.random(n) < mean).astype(float)
    else:
        ret = mean + t.reward_std[leaf] * rng.normal(size=n)
    return states, actions, ret


@dataclasses.dataclass
class Pairs:
    """Counted (state, action) pairs of a batch of repeats, with their weights.

    ``grad = sum w (e_a - pi(s))`` per repeat; ``pre`` marks backbone decisions above the
    first branch point; ``steps`` is each repeat's env steps; ``counts`` each repeat's
    lines, decisions and decisions along every line's whole path (for token costs).
    """

    rep: np.ndarray
    s: np.ndarray
    a: np.ndarray
    w: np.ndarray
    pre: np.ndarray
    steps: np.ndarray
    counts: np.ndarray | None = None  # (reps, 3): lines, decisions, path decisions


def _entropy(pis: np.ndarray, pol: np.ndarray, states: np.ndarray, n_nodes: int) -> np.ndarray:
    p = pis.reshape(-1, pis.shape[-1])[pol[:, None] * n_nodes + states]
    return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)


def _pick(
    design: Design, h: np.ndarray, rng: np.random.Generator, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Branch depths ``(rows, M)`` sorted, and which of them exist.

    ``h`` is the backbones' entropies ``(rows, D)``, ``lengths`` their decisions. A point
    a backbone does not reach (the ``fixed`` depths below its end, or fewer decisions
    than M) does not exist: its depth is set to D and its mask to False.
    """
    rows, d = h.shape
    alive = np.arange(d)[None, :] < lengths[:, None]
    if design.schedule in ("entropy", "random"):
        tie = rng.random(h.shape)
        if design.schedule == "entropy":  # top-M by H_t (min gap 1 step), ties at random
            perm = np.argsort(tie, axis=1)
            key = np.where(alive, np.round(-h, 12), np.inf)
            hp = np.take_along_axis(key, perm, axis=1)
            order = np.take_along_axis(perm, np.argsort(hp, axis=1, kind="stable"), axis=1)
        else:  # random: M distinct decisions uniformly
            order = np.argsort(np.where(alive, tie, 2.0), axis=1)
        picked = np.sort(order[:, : design.m], axis=1)
    elif design.schedule == "fixed":  # decided in advance; negative depths from the horizon
        got = sorted(int(u) if u >= 0 else d + int(u) for u in design.depths)
        picked = np.tile(np.asarray(got, dtype=np.int64), (rows, 1))
    else:  # the schedules of schedule_depths, per backbone length
        picked = np.full((rows, design.m), d, dtype=np.int64)
        for length in np.unique(lengths):
            sel = lengths == length
            got = [u for u in (schedule_depths(design, int(length)) or []) if u < length]
            picked[np.ix_(sel, np.arange(len(got)))] = got
    valid = picked < lengths[:, None]
    return np.where(valid, picked, d), valid


def _loo(x: np.ndarray) -> np.ndarray:
    """Leave-one-out mean over the last axis."""
    k = x.shape[-1]
    return (x.sum(axis=-1, keepdims=True) - x) / (k - 1)


def sample_pairs(
    arr: TreeArrays,
    design: Design,
    pis: np.ndarray,
    pol: np.ndarray,
    rng: np.random.Generator,
) -> Pairs:
    """Sample one prompt's rollouts per repeat (policy ``pis[pol[r]]``); weight the pairs."""
    d = arr.depth
    reps = pol.size
    steps_t = np.arange(d)[None, :]
    if design.kind != "tree":
        n = design.n
        rows_pol = np.repeat(pol, n)
        st = np.zeros((reps * n, d + 1), dtype=np.int64)
        st, ac, ret = _rollouts(arr, pis, rows_pol, st, np.zeros(reps * n, np.int64), rng)
        g = ret.reshape(reps, n)
        if design.kind == "rloo":
            adv = g - _loo(g)
        else:
            c = g - g.mean(axis=1, keepdims=True)
            std = np.sqrt((c**2).sum(axis=1, keepdims=True) / (n - 1))
            adv = np.where(std > 0, c / (std + 1e-6), 0.0)
        live = (ac >= 0).reshape(-1)
        w = np.repeat(adv.reshape(-1) / n, d)
        rep = np.repeat(np.arange(reps), n * d)
        tokens = _tokens(ac >= 0, np.zeros(reps * n, np.int64), np.repeat(np.arange(reps), n), reps)
        return Pairs(
            rep[live],
            st[:, :d].reshape(-1)[live],
            ac.reshape(-1)[live],
            w[live],
            np.zeros(int(live.sum()), bool),
            (ac >= 0).reshape(reps, n * d).sum(axis=1),
            tokens,
        )
    gb, m, k = design.g, design.m, design.k
    nb = reps * gb
    bpol = np.repeat(pol, gb)
    bst, bac, bret = _rollouts(
        arr, pis, bpol, np.zeros((nb, d + 1), np.int64), np.zeros(nb, np.int64), rng
    )
    balive = bac >= 0  # (nb, D): the backbone decides at t
    h = _entropy(pis, bpol, bst[:, :d], arr.n_nodes)
    bps, bval = _pick(design, h, rng, balive.sum(axis=1))  # (nb, M)
    # fresh siblings: (nb, M, K-1); a point that does not exist starts at D (no decisions)
    sst = np.repeat(bst, m * (k - 1), axis=0)
    sstart = np.repeat(bps.reshape(-1), k - 1)
    spol = np.repeat(bpol, m * (k - 1))
    sst, sac, sret = _rollouts(arr, pis, spol, sst, sstart, rng)
    sret = sret.reshape(nb, m, k - 1)
    allg = np.concatenate([bret[:, None, None].repeat(m, axis=1), sret], axis=2)  # (nb, M, K)
    local = allg - _loo(allg)  # eq. 4
    fresh_base = sret.mean(axis=2)  # (nb, M): baseline from the K-1 fresh siblings
    vhat = allg.mean(axis=2)  # (nb, M)
    n_valid = bval.sum(axis=1)
    # latest existing branch point at or above each step (-1: none, the prefix); points
    # that do not exist sit at D, below every decision
    idx = (bps[:, None, :] <= steps_t[:, :, None]).sum(axis=2) - 1  # (nb, D)
    # ---- backbone credit (nb, D)
    if design.credit == "lambda":
        cred = np.zeros((nb, d))
        for j in range(m):
            b = bps[:, j : j + 1]
            gap = b - steps_t
            on = (gap >= 0) & bval[:, j : j + 1]
            cred += np.where(on, design.lam ** np.maximum(gap, 0), 0.0) * local[:, j, :1]
        last_j = np.maximum(n_valid - 1, 0)
        last_b = np.where(n_valid > 0, np.take_along_axis(bps, last_j[:, None], axis=1)[:, 0], d)
        last_a = np.take_along_axis(local[:, :, 0], last_j[:, None], axis=1)
        cred = np.where(steps_t > last_b[:, None], last_a, cred)
    else:
        # the prefix's value: the first point's sibling mean, or the return if none exists
        x_v = np.where(bval[:, 0], vhat[:, 0], bret)
        if gb >= 2:
            gr = bret.reshape(reps, gb)
            vr = x_v.reshape(reps, gb)
            root_g = (gr - _loo(gr)).reshape(-1)
            root_v = (vr - _loo(vr)).reshape(-1)
        else:
            root_g = bret.copy()
            root_v = x_v.copy()
        if design.credit == "root":
            at = np.take_along_axis(local[:, :, 0], np.maximum(idx, 0), axis=1)
            cred = np.where(idx < 0, root_g[:, None], at)
        else:  # value_diff: next point's sibling mean if the line reaches it, else its return
            nxt = np.minimum(idx + 1, m - 1)
            v_next = np.take_along_axis(vhat, nxt, axis=1)
            has_next = (idx + 1 < m) & np.take_along_axis(bval, nxt, axis=1)
            base = np.take_along_axis(fresh_base, np.maximum(idx, 0), axis=1)
            mid = np.where(has_next, v_next, bret[:, None]) - base
            cred = np.where(idx < 0, root_v[:, None], mid)
    if design.backbone == "exclude":
        cred = np.zeros_like(cred)
    pre = steps_t < bps[:, :1]
    # ---- weights
    scred = local[:, :, 1:].reshape(-1)  # (ns,) every fresh line's advantage
    salive = sac >= 0  # (ns, D)
    if design.norm == "traj":
        bw = cred / design.rollouts
        sw = scred[:, None] / design.rollouts + np.zeros(salive.shape)
    elif design.norm == "depth":  # the realised number of decisions at each depth
        lines = balive.astype(np.int64) + salive.reshape(nb, m * (k - 1), d).sum(axis=1)
        lines_rep = np.maximum(lines.reshape(reps, gb, d).sum(axis=1), 1)  # (reps, D)
        bw = cred / np.repeat(lines_rep, gb, axis=0)
        sw = scred[:, None] / np.repeat(lines_rep, gb * m * (k - 1), axis=0)
    else:  # backbone: 1 / (G c_i(t)), c_i(t) the lines planned in backbone i's tree at t
        if design.schedule == "fixed":  # planned: every fixed depth at or above t, reached
            # or not (a line that ended is an ended trajectory: it just adds no pairs)
            planned = np.sort([u if u >= 0 else d + u for u in design.depths])
            c = np.broadcast_to(1 + (k - 1) * (planned[None, :] <= steps_t.T).sum(axis=1), (nb, d))
        else:  # the backbone's own points (all exist when every episode has length D)
            c = 1 + (k - 1) * (idx + 1)  # (nb, D)
        bw = cred / (gb * c)
        sw = scred[:, None] / np.repeat(gb * c, m * (k - 1), axis=0)
    brep = np.repeat(np.arange(reps), gb)
    srep = np.repeat(brep, m * (k - 1))
    bkeep = balive
    keep = salive
    # lines: every backbone and every fresh line of an existing point (planned ones that
    # do not exist cost nothing)
    line_start = np.concatenate([np.zeros(nb, np.int64), sstart])
    line_alive = np.concatenate([balive, salive])
    line_rep = np.concatenate([brep, srep])
    exists = np.concatenate([np.ones(nb, bool), np.repeat(bval.reshape(-1), k - 1)])
    tokens = _tokens(line_alive[exists], line_start[exists], line_rep[exists], reps)
    return Pairs(
        np.concatenate(
            [np.repeat(brep, d)[bkeep.reshape(-1)], np.repeat(srep, d)[keep.reshape(-1)]]
        ),
        np.concatenate([bst[:, :d][bkeep], sst[:, :d][keep]]),
        np.concatenate([bac[bkeep], sac[keep]]),
        np.concatenate([bw[bkeep], sw[keep]]),
        np.concatenate([pre[bkeep], np.zeros(int(keep.sum()), bool)]),
        np.bincount(line_rep, weights=line_alive.sum(axis=1), minlength=reps).astype(np.int64),
        tokens,
    )


def _tokens(alive: np.ndarray, start: np.ndarray, rep: np.ndarray, reps: int) -> np.ndarray:
    """Per repeat ``(lines, decisions, path decisions)``: the counts the token costs need.

    ``decisions`` are the decisions taken (each once: a shared prefix is not re-run);
    ``path decisions`` add, for every line, the decisions of the prefix it shares with
    the backbone (``start``), which an update without prefix sharing reads again.
    """
    own = alive.sum(axis=1)
    out = np.zeros((reps, 3))
    np.add.at(out, rep, np.stack([np.ones(own.size), own, own + start], axis=1))
    return out


# ------------------------------------------------------------------------- measuring


@dataclasses.dataclass
class Measurement:
    """Moments of one estimator over ``repeats`` independent draws.

    ``mean`` is ``E g``; ``sq`` is ``E|g|^2``; ``cross`` is ``E<g, g*>``; the ``*_depth``
    arrays restrict ``g`` to the states of each decision depth; ``*_pre`` to the
    contributions of backbone decisions above the first branch point.
    """

    repeats: int
    truth: np.ndarray
    mean: np.ndarray
    sq: float
    cross: float
    sq_depth: np.ndarray
    cross_depth: np.ndarray
    mean_pre: np.ndarray
    sq_pre: float
    steps: float
    depth_of: np.ndarray
    counts: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(3))

    def _stats(self, mean: np.ndarray, truth: np.ndarray, sq: float, cross: float) -> dict:
        t2 = float(np.sum(truth**2))
        m2 = float(np.sum(mean**2))
        cov = max(sq - m2, 0.0)
        cos = float(np.sum(mean * truth) / np.sqrt(max(m2 * t2, 1e-300)))
        best = 1.0 - cross**2 / max(sq * t2, 1e-300)
        err2 = float(np.sum((mean - truth) ** 2))
        bias2 = max(err2 - cov / self.repeats, 0.0)
        return {
            "cosine": cos,
            # |mean - g*| in standard errors of the mean: about 1 when unbiased
            "bias_se": float(np.sqrt(err2 / max(cov / self.repeats, 1e-300))),
            "projection": float(np.sum(mean * truth)) / max(t2, 1e-300),
            "noise_to_signal": cov / max(m2, 1e-300),
            "noise_to_truth": cov / max(t2, 1e-300),
            "rel_mse": (sq - 2 * cross + t2) / max(t2, 1e-300),
            "rel_mse_best_scale": best,
            "rel_bias2": bias2 / max(t2, 1e-300),
            "norm_ratio": float(np.sqrt(m2 / max(t2, 1e-300))),
            "cosine_floor": 1.0 - 0.5 * cov / max(self.repeats * m2, 1e-300),
        }

    def summary(self) -> dict[str, Any]:
        """Overall figures, by depth and for the prefix.

        Cosine of ``E g`` to ``g*``; ``bias_se``: ``|mean - g*|`` over the mean's standard
        error ``sqrt(tr Cov / R)`` (about 1 for an unbiased estimator, growing as
        ``sqrt(R)`` for a biased one: the bias test); ``projection``: ``<E g, g*> / |g*|^2``;
        noise-to-signal ``tr Cov / |E g|^2`` and ``noise_to_truth`` ``tr Cov / |g*|^2``
        (the first inflates the noise of an estimator whose mean is shrunk); relative MSE
        ``E|g - g*|^2 / |g*|^2`` (and at the best scalar step), squared bias corrected for
        the mean's own noise, env steps, and ``counts``: lines, decisions and decisions
        along every line's whole path per draw (token costs).

        ``cosine_floor`` is what the cosine of an unbiased estimator's sample mean is
        expected to be at this many repeats (``1 - tr Cov / (2 R |E g|^2)``).
        """
        out = self._stats(self.mean, self.truth, self.sq, self.cross)
        out["steps"] = self.steps
        out["lines"], out["decisions"], out["path_decisions"] = (float(c) for c in self.counts)
        by = []
        for t in range(self.sq_depth.size):
            sel = self.depth_of == t
            by.append(
                self._stats(self.mean[sel], self.truth[sel], self.sq_depth[t], self.cross_depth[t])
            )
        out["by_depth"] = by
        t2 = float(np.sum(self.truth**2))
        m2 = float(np.sum(self.mean_pre**2))
        out["prefix"] = {
            "second_moment_share": self.sq_pre / max(self.sq, 1e-300),
            "mean_norm_ratio": float(np.sqrt(m2 / max(t2, 1e-300))),
            "cosine": float(np.sum(self.mean_pre * self.truth) / np.sqrt(max(m2 * t2, 1e-300)))
            if m2 > 0
            else float("nan"),
        }
        return out


def _grad_rows(
    arr: TreeArrays, pis: np.ndarray, pol: np.ndarray, pairs: Pairs, reps: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group the pairs by (repeat, state): keys, the repeat of each key, and ``g`` rows."""
    a_n = arr.n_actions
    key = pairs.rep * arr.n_nodes + pairs.s
    uk, inv = np.unique(key, return_inverse=True)
    wa = np.zeros((uk.size, a_n))
    np.add.at(wa, (inv, pairs.a), pairs.w)
    wsum = np.bincount(inv, weights=pairs.w, minlength=uk.size)
    rep = uk // arr.n_nodes
    s = uk % arr.n_nodes
    rows = wa - wsum[:, None] * pis.reshape(-1, a_n)[pol[rep] * arr.n_nodes + s]
    return s, rep, rows


def measure(
    arr: TreeArrays,
    design: Design,
    pi: np.ndarray,
    repeats: int,
    rng: np.random.Generator,
    *,
    chunk: int = 4000,
    truth: np.ndarray | None = None,
) -> Measurement:
    """Mean, second moment and cross term with ``g*`` of ``design`` over ``repeats`` draws."""
    truth = exact_gradient(arr, pi) if truth is None else truth
    d = arr.depth
    depth_of = np.asarray(arr.tree.depth)
    total = np.zeros_like(truth)
    total_pre = np.zeros_like(truth)
    sq = cross = sq_pre = 0.0
    sq_d = np.zeros(d)
    cross_d = np.zeros(d)
    steps = 0.0
    counts = np.zeros(3)
    pis = pi[None]
    done = 0
    while done < repeats:
        n = min(chunk, repeats - done)
        pol = np.zeros(n, dtype=np.int64)
        pairs = sample_pairs(arr, design, pis, pol, rng)
        s, rep, rows = _grad_rows(arr, pis, pol, pairs, n)
        np.add.at(total, s, rows)
        r2 = np.sum(rows**2, axis=1)
        rc = np.sum(rows * truth[s], axis=1)
        sq += float(r2.sum())
        cross += float(rc.sum())
        dep = depth_of[s]
        sq_d += np.bincount(dep, weights=r2, minlength=d)[:d]
        cross_d += np.bincount(dep, weights=rc, minlength=d)[:d]
        if pairs.pre.any():
            f = pairs.pre
            sub = Pairs(pairs.rep[f], pairs.s[f], pairs.a[f], pairs.w[f], f[f], pairs.steps)
            ps, _, prow = _grad_rows(arr, pis, pol, sub, n)
            np.add.at(total_pre, ps, prow)
            sq_pre += float(np.sum(prow**2))
        steps += float(pairs.steps.sum())
        counts += pairs.counts.sum(axis=0)
        done += n
    return Measurement(
        repeats,
        truth,
        total / repeats,
        sq / repeats,
        cross / repeats,
        sq_d / repeats,
        cross_d / repeats,
        total_pre / repeats,
        sq_pre / repeats,
        steps / repeats,
        depth_of,
        counts / repeats,
    )


def estimate(
    arr: TreeArrays, design: Design, pis: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One draw of ``design`` per policy of the stack ``pis`` ``(P, n_nodes, A)``, sparse.

    Returns:
        ``(policy, state, rows, steps)``: ``g[policy[i], state[i]] = rows[i]`` (each
        ``(policy, state)`` once; every other entry of ``g`` is 0) and each draw's env steps.
    """
    p = pis.shape[0]
    pol = np.arange(p, dtype=np.int64)
    pairs = sample_pairs(arr, design, pis, pol, rng)
    s, rep, rows = _grad_rows(arr, pis, pol, pairs, p)
    return rep, s, rows, pairs.steps
