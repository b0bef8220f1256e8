"""Branch schedules: which decision points of a backbone get K siblings.

A schedule is a function chosen by name from :data:`SCHEDULES`::

    schedule(tree, backbone, m, rng, **options) -> list[ForkPoint]

``backbone`` lists the node ids of the backbone (decision ``t`` at index ``t``); a
:class:`ForkPoint` names the step whose state the siblings restart from and, for forks
inside a turn (BranchOPD), how many tokens of the backbone's action they keep.

Schedules (docs/algorithms.md §1 step 3, section 2 steps 2-3):

* ``entropy``: top-M decision points by per-action entropy ``H_t`` (eq. 3; reduction
  ``mean`` by default, ``first`` or ``sum``) with a minimum gap ``Delta_min`` between
  chosen points (64 tokens of the trajectory; 1 step for envs without tokens).
* ``lowest_entropy``: the bottom-M, the ablation that must lose.
* ``random``: uniformly random points (same gap rule).
* ``even``: evenly spaced points.
* ``depths``: the depths ``depths``, fixed in advance (*planned*, :func:`planned_steps`:
  ``grow_tree`` starts their siblings as the backbone reaches them).
* ``oracle``: the points with the largest exact advantage variance
  ``Var_{a~pi}[Q(s_t, a)]`` (TreeMDP only: exact values).
* ``fork_score``: BranchOPD's entropy + teacher-disagreement score (the math below,
  :func:`fork_scores`, is the one copy the learners import).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from branchgym.error import ScheduleError
from branchgym.rollout.tree import ENTROPY_REDUCTIONS, RolloutTree

__all__ = [
    "ForkPoint",
    "SCHEDULES",
    "Schedule",
    "register_schedule",
    "get_schedule",
    "entropy_schedule",
    "lowest_entropy_schedule",
    "random_schedule",
    "even_schedule",
    "depths_schedule",
    "planned_steps",
    "oracle_schedule",
    "fork_score_schedule",
    "topk_entropy",
    "rank_normalize",
    "window_disagreement",
    "fork_scores",
    "select_token_forks",
    "select_turn_forks",
    "DEFAULT_MIN_GAP_TOKENS",
]

#: Delta_min of algorithms.md §1 step 3, in tokens of the trajectory.
DEFAULT_MIN_GAP_TOKENS = 64


@dataclasses.dataclass(frozen=True, order=True)
class ForkPoint:
    """Where siblings start.

    Attributes:
        step: Decision index ``t``: siblings restore ``s_t`` and act there.
        token_offset: Leading tokens of the backbone's action ``a_t`` every sibling
            keeps (0: the whole action is resampled).
        score: What the schedule ranked it by (for logs).
    """

    step: int
    token_offset: int = 0
    score: float = float("nan")


Schedule = Callable[..., list[ForkPoint]]


# ----------------------------------------------------------------------- gap helpers


def _positions(tree: RolloutTree, backbone: Sequence[int], unit: str) -> np.ndarray:
    """Position of each decision along the trajectory, in tokens or steps."""
    if unit == "auto":
        unit = "tokens" if any(tree[i].n_tokens > 1 for i in backbone) else "steps"
    if unit == "steps":
        return np.arange(len(backbone), dtype=np.int64)
    if unit == "tokens":
        sizes = np.array([tree[i].n_tokens for i in backbone], dtype=np.int64)
        return np.concatenate([[0], np.cumsum(sizes)[:-1]]) if len(sizes) else sizes
    raise ScheduleError(f"gap_unit must be 'auto', 'tokens' or 'steps', got {unit!r}")


def _default_gap(tree: RolloutTree, backbone: Sequence[int], unit: str) -> int:
    if unit == "steps" or (unit == "auto" and not any(tree[i].n_tokens > 1 for i in backbone)):
        return 1
    return DEFAULT_MIN_GAP_TOKENS


def _greedy_with_gap(
    order: Sequence[int],
    scores: np.ndarray,
    positions: np.ndarray,
    m: int,
    min_gap: int,
    fill: bool,
) -> list[ForkPoint]:
    chosen: list[int] = []
    for t in order:
        if len(chosen) == m:
            break
        if all(abs(int(positions[t]) - int(positions[c])) >= min_gap for c in chosen):
            chosen.append(int(t))
    if fill:  # matched compute: top up with the best remaining points, gap relaxed
        for t in order:
            if len(chosen) == m:
                break
            if int(t) not in chosen:
                chosen.append(int(t))
    return sorted(ForkPoint(t, 0, float(scores[t])) for t in chosen)


def _check_m(m: int, backbone: Sequence[int]) -> int:
    if m < 0:
        raise ScheduleError(f"the number of branch points M must be >= 0, got {m}")
    return min(m, len(backbone))


def _ranked(
    tree: RolloutTree,
    backbone: Sequence[int],
    m: int,
    rng: np.random.Generator,
    scores: np.ndarray,
    *,
    descending: bool,
    min_gap: int | None,
    gap_unit: str,
    fill: bool,
) -> list[ForkPoint]:
    m = _check_m(m, backbone)
    if m == 0:
        return []
    pos = _positions(tree, backbone, gap_unit)
    gap = _default_gap(tree, backbone, gap_unit) if min_gap is None else int(min_gap)
    # Ties (a uniform policy has equal entropies everywhere) break at random, not by step.
    perm = rng.permutation(len(backbone))
    key = -scores[perm] if descending else scores[perm]
    order = perm[np.argsort(key, kind="stable")]
    return _greedy_with_gap(order, scores, pos, m, gap, fill)


# ------------------------------------------------------------------------- schedules


def _entropies(tree: RolloutTree, backbone: Sequence[int], reduce: str) -> np.ndarray:
    if reduce not in ENTROPY_REDUCTIONS:
        raise ScheduleError(
            f"entropy reduction {reduce!r} unknown; use one of {list(ENTROPY_REDUCTIONS)}"
        )
    return np.array([tree[i].entropy(reduce) for i in backbone], dtype=np.float64)


def entropy_schedule(
    tree: RolloutTree,
    backbone: Sequence[int],
    m: int,
    rng: np.random.Generator,
    *,
    reduce: str = "mean",
    min_gap: int | None = None,
    gap_unit: str = "auto",
    fill: bool = False,
) -> list[ForkPoint]:
    """Top-M decision points by entropy ``H_t`` (eq. 3) with a minimum gap (step 3).

    Args:
        tree: The tree holding the backbone.
        backbone: Backbone node ids, decision ``t`` at index ``t``.
        m: Branch points wanted (M).
        rng: Breaks ties.
        reduce: Per-action entropy from per-token ones: ``mean`` (default), ``first``, ``sum``.
        min_gap: ``Delta_min``; default 64 tokens, or 1 step for envs without tokens.
        gap_unit: ``tokens`` (generated tokens of the trajectory), ``steps``, or ``auto``
            (steps when every action is at most one token).
        fill: When the gap leaves fewer than M points, add the best remaining ones so
            the rollout count stays N = 1 + M(K-1) (off by default: the source's rule).
    """
    scores = _entropies(tree, backbone, reduce)
    return _ranked(
        tree,
        backbone,
        m,
        rng,
        scores,
        descending=True,
        min_gap=min_gap,
        gap_unit=gap_unit,
        fill=fill,
    )


def lowest_entropy_schedule(
    tree: RolloutTree,
    backbone: Sequence[int],
    m: int,
    rng: np.random.Generator,
    *,
    reduce: str = "mean",
    min_gap: int | None = None,
    gap_unit: str = "auto",
    fill: bool = False,
) -> list[ForkPoint]:
    """The M lowest-entropy points (the source's ablation: worse than GRPO at equal N)."""
    scores = _entropies(tree, backbone, reduce)
    return _ranked(
        tree,
        backbone,
        m,
        rng,
        scores,
        descending=False,
        min_gap=min_gap,
        gap_unit=gap_unit,
        fill=fill,
    )


def random_schedule(
    tree: RolloutTree,
    backbone: Sequence[int],
    m: int,
    rng: np.random.Generator,
    *,
    min_gap: int | None = None,
    gap_unit: str = "auto",
    fill: bool = False,
) -> list[ForkPoint]:
    """M points uniformly at random, under the same gap rule as ``entropy``."""
    scores = rng.random(len(backbone))
    return _ranked(
        tree,
        backbone,
        m,
        rng,
        scores,
        descending=True,
        min_gap=min_gap,
        gap_unit=gap_unit,
        fill=fill,
    )


def even_schedule(
    tree: RolloutTree, backbone: Sequence[int], m: int, rng: np.random.Generator
) -> list[ForkPoint]:
    """M points evenly spaced over the backbone's steps: ``round(i T / (M + 1))``."""
    m = _check_m(m, backbone)
    t_max = len(backbone)
    steps: list[int] = []
    for i in range(1, m + 1):
        t = min(t_max - 1, int(round(i * t_max / (m + 1))))
        # on a collision (short backbones) take the nearest free step
        free = [u for u in range(t_max) if u not in steps]
        steps.append(min(free, key=lambda u: (abs(u - t), u)))
    return sorted(ForkPoint(t, 0, float(t)) for t in steps)


def depths_schedule(
    tree: RolloutTree,
    backbone: Sequence[int],
    m: int,
    rng: np.random.Generator,
    *,
    depths: Sequence[int] = (),
) -> list[ForkPoint]:
    """Branch at the decision depths ``depths``, fixed in advance, where the backbone is alive.

    Branching at ``t`` depends only on the backbone still running at ``t``, so the lemma
    of docs/estimators.md holds on episodes of different lengths; a backbone that ended
    before a depth gets no point there (docs/engine.md: its siblings overlap it).
    """
    return [ForkPoint(t, 0, float(t)) for t in _depths_plan(m, depths=depths) if t < len(backbone)]


def _depths_plan(m: int, *, depths: Sequence[int] = ()) -> list[int]:
    for t in depths:
        if isinstance(t, bool) or not isinstance(t, int | np.integer) or t < 0:
            raise ScheduleError(f"depths are decision depths, whole numbers >= 0; got {t!r}")
    return sorted({int(t) for t in depths})


depths_schedule.planned = _depths_plan  # type: ignore[attr-defined]


def planned_steps(
    schedule: Schedule, m: int, options: dict[str, Any] | None = None
) -> list[int] | None:
    """A planned schedule's steps (its ``planned(m, **options)``); ``None`` for the others.

    Planned: for any backbone it returns exactly the planned steps the backbone reached,
    whole actions resampled (``entropy``, ``even``... read the finished backbone instead).
    """
    plan = getattr(schedule, "planned", None)
    if plan is None:
        return None
    return sorted({int(t) for t in plan(m, **(options or {}))})


def _state_info(tree: RolloutTree, backbone: Sequence[int], t: int) -> dict[str, Any]:
    return tree.info if t == 0 else tree[backbone[t - 1]].info


def oracle_schedule(
    tree: RolloutTree,
    backbone: Sequence[int],
    m: int,
    rng: np.random.Generator,
    *,
    env: Any = None,
    policy: Any = None,
) -> list[ForkPoint]:
    """Top-M points by exact advantage variance ``sum_a pi(a|s) (Q(s,a) - V(s))^2``.

    That is the spread sibling comparisons measure at ``s_t``; only a TreeMDP knows it.

    Args:
        tree: The tree.
        backbone: Backbone node ids.
        m: Branch points wanted.
        rng: Breaks ties.
        env: The (Text)TreeMDP env, any wrapper stack.
        policy: The behaviour policy's table (an array or a ``TabularPolicy``).
    """
    base = getattr(env, "unwrapped", None)
    if base is None or not hasattr(base, "tree") or not hasattr(base.tree, "moments"):
        raise ScheduleError(
            "the oracle schedule needs exact values: pass schedule_options={'env': <a "
            "TreeMDP or TextTreeMDP env>, 'policy': <its tabular policy>}."
        )
    table = getattr(policy, "table", policy)
    if table is None:
        raise ScheduleError("the oracle schedule needs the behaviour policy's table ('policy')")
    table = np.asarray(table, dtype=np.float64)
    if table.shape[0] == 1:
        table = np.broadcast_to(table, (base.tree.n_nodes, table.shape[1]))
    v, _, q, _ = base.tree.moments(table)
    scores = np.zeros(len(backbone))
    for t in range(len(backbone)):
        s = int(_state_info(tree, backbone, t).get("node", -1))
        if s < 0:
            raise ScheduleError("the oracle schedule needs info['node'] (a TreeMDP state)")
        scores[t] = float(table[s] @ (q[s] - v[s]) ** 2)
    return _ranked(
        tree,
        backbone,
        m,
        rng,
        scores,
        descending=True,
        min_gap=1,
        gap_unit="steps",
        fill=False,
    )


# ---------------------------------------------------------------- BranchOPD fork score


def topk_entropy(topk_logprobs: np.ndarray, *, renormalize: bool = True) -> np.ndarray:
    """Entropy estimated from the top-k log-probs of each position (BranchOPD's ``U_t``).

    Args:
        topk_logprobs: ``(..., k)`` log-probs of the k most likely tokens.
        renormalize: Renormalise the k probabilities to sum to 1 first (default); if
            False, ``-sum p log p`` over the k terms as they are.
    """
    lp = np.asarray(topk_logprobs, dtype=np.float64)
    if renormalize:
        lp = lp - np.logaddexp.reduce(lp, axis=-1, keepdims=True)
    p = np.exp(lp)
    return -(p * np.where(p > 0, lp, 0.0)).sum(-1)


def rank_normalize(x: np.ndarray) -> np.ndarray:
    """Map values to [0, 1] by rank within the array (ties share their mean rank).

    The smallest value maps to 0, the largest to 1; a single value maps to 0.5.
    """
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    n = x.size
    if n == 0:
        return x
    if n == 1:
        return np.array([0.5])
    order = np.argsort(x, kind="stable")
    ranks = np.empty(n)
    ranks[order] = np.arange(n, dtype=np.float64)
    # average the ranks of tied values
    uniq, inv = np.unique(x, return_inverse=True)
    if uniq.size < n:
        sums = np.bincount(inv, weights=ranks)
        counts = np.bincount(inv)
        ranks = (sums / counts)[inv]
    return ranks / (n - 1)


def window_disagreement(
    dlogp: np.ndarray, *, window: int = 128, mode: str = "forward", reduce: str = "mean"
) -> np.ndarray:
    """``D_t``: ``-dlogp`` aggregated over a token window (BranchOPD step 2).

    ``dlogp_t = log pi_T(a_t|s_t) - log pi_theta(a_t|s_t)``, so ``-dlogp`` is large where
    the student likes a token the teacher dislikes. The source does not say where the
    128-token window sits; default ``forward`` (tokens ``t .. t+window-1``: what a fork
    at ``t`` would change), options ``centered`` and ``backward``; ``reduce`` ``mean``
    (default) or ``sum`` (they differ only near the ends).
    """
    d = -np.asarray(dlogp, dtype=np.float64).reshape(-1)
    n = d.size
    if window < 1:
        raise ScheduleError(f"window must be >= 1, got {window}")
    csum = np.concatenate([[0.0], np.cumsum(d)])
    idx = np.arange(n)
    if mode == "forward":
        lo, hi = idx, np.minimum(n, idx + window)
    elif mode == "backward":
        lo, hi = np.maximum(0, idx - window + 1), idx + 1
    elif mode == "centered":
        lo, hi = np.maximum(0, idx - window // 2), np.minimum(n, idx + (window + 1) // 2)
    else:
        raise ScheduleError(f"window mode must be forward, centered or backward, got {mode!r}")
    total = csum[hi] - csum[lo]
    if reduce == "sum":
        return total
    if reduce == "mean":
        return total / np.maximum(1, hi - lo)
    raise ScheduleError(f"window reduce must be 'mean' or 'sum', got {reduce!r}")


def fork_scores(
    entropy: np.ndarray,
    dlogp: np.ndarray,
    *,
    alpha: float = 0.5,
    window: int = 128,
    window_mode: str = "forward",
) -> np.ndarray:
    """BranchOPD's fork score ``v_t = alpha R(U_t) + (1 - alpha) R(D_t)`` (section 2 step 2).

    Args:
        entropy: ``U_t``, the student's top-20 entropy at each generated token.
        dlogp: Teacher minus student log-prob of each generated token.
        alpha: Weight of the entropy rank (0.5 in the source).
        window: Tokens aggregated into ``D_t`` (128).
        window_mode: See :func:`window_disagreement`.
    """
    u = np.asarray(entropy, dtype=np.float64).reshape(-1)
    if u.shape != np.asarray(dlogp).reshape(-1).shape:
        raise ScheduleError("entropy and dlogp need one value per generated token each")
    d = window_disagreement(dlogp, window=window, mode=window_mode)
    return alpha * rank_normalize(u) + (1.0 - alpha) * rank_normalize(d)


def select_token_forks(
    scores: np.ndarray, entropy: np.ndarray, *, b: int = 3, min_entropy: float = 0.5
) -> list[int]:
    """Single-turn forks: the at most ``b`` best positions with entropy >= ``min_entropy``."""
    v = np.asarray(scores, dtype=np.float64)
    ok = np.flatnonzero(np.asarray(entropy) >= min_entropy)
    best = ok[np.argsort(-v[ok], kind="stable")][:b]
    return sorted(int(i) for i in best)


def select_turn_forks(
    scores: np.ndarray,
    entropy: np.ndarray,
    turn_of: np.ndarray,
    rng: np.random.Generator,
    *,
    max_turns: int = 3,
    min_turn_distance: int = 2,
    top_frac: float = 0.2,
    pick_from: int = 3,
    min_entropy: float = 0.5,
) -> list[tuple[int, int]]:
    """Multi-turn forks (BranchOPD section 2 step 3): turns first, then a position in each.

    A turn's score is the mean of its top ``top_frac`` position scores (all its
    positions). Turns are taken best first, at most ``max_turns``, any two at least
    ``min_turn_distance`` apart (2 = at least one turn between them, our reading of "at
    least one turn apart"); a turn needs an eligible position (entropy >=
    ``min_entropy``). Inside a chosen turn, one of its ``pick_from`` best eligible
    positions is drawn uniformly.

    Returns:
        ``(turn, position)`` pairs, ``position`` indexing the flat token arrays, sorted.
    """
    v = np.asarray(scores, dtype=np.float64)
    ent = np.asarray(entropy, dtype=np.float64)
    turn_of = np.asarray(turn_of)
    turns = np.unique(turn_of)
    turn_score = {}
    for m in turns:
        pos = np.flatnonzero(turn_of == m)
        if not (ent[pos] >= min_entropy).any():
            continue
        top = np.sort(v[pos])[::-1][: max(1, math.ceil(top_frac * pos.size))]
        turn_score[int(m)] = float(top.mean())
    chosen: list[int] = []
    for m in sorted(turn_score, key=lambda m: (-turn_score[m], m)):
        if len(chosen) == max_turns:
            break
        if all(abs(m - c) >= min_turn_distance for c in chosen):
            chosen.append(m)
    out = []
    for m in sorted(chosen):
        pos = np.flatnonzero((turn_of == m) & (ent >= min_entropy))
        best = pos[np.argsort(-v[pos], kind="stable")][:pick_from]
        out.append((m, int(rng.choice(best))))
    return out


def fork_score_schedule(
    tree: RolloutTree,
    backbone: Sequence[int],
    m: int,
    rng: np.random.Generator,
    *,
    alpha: float = 0.5,
    window: int = 128,
    window_mode: str = "forward",
    min_entropy: float = 0.5,
    mode: str = "turns",
    min_turn_distance: int = 2,
    top_frac: float = 0.2,
    pick_from: int = 3,
) -> list[ForkPoint]:
    """BranchOPD's forks (section 2 steps 2-3) over the backbone's generated tokens.

    Needs each backbone node's ``entropies_top20`` (from the engine) and
    ``teacher_logprobs`` (a teacher pass: ``grow_tree(..., teacher=...)``). ``m`` is the
    fork budget B (3 in the source).

    Args:
        tree: The tree.
        backbone: Backbone node ids.
        m: At most this many forks (B).
        rng: Picks a position among a turn's best.
        alpha: Entropy weight of the score.
        window: Disagreement window in tokens.
        window_mode: Where the window sits (see :func:`window_disagreement`).
        min_entropy: Eligibility threshold on ``U_t``.
        mode: ``turns`` (multi-turn agent tasks) or ``tokens`` (single-turn text: the
            fork is a token position of the only turn, or of any turn).
        min_turn_distance: See :func:`select_turn_forks`.
        top_frac: See :func:`select_turn_forks`.
        pick_from: See :func:`select_turn_forks`.
    """
    if m <= 0 or not backbone:
        return []
    ents, dl, turn_of, offset = [], [], [], []
    for t, nid in enumerate(backbone):
        node = tree[nid]
        g = slice(node.prefix_len, node.n_tokens)
        if node.n_generated == 0:
            continue
        if node.teacher_logprobs is None:
            raise ScheduleError(
                "the fork_score schedule needs teacher log-probs on the backbone: pass "
                "teacher=<engine or callable> to grow_tree (BranchOPD scores every token)."
            )
        u = node.entropies_top20 if node.entropies_top20 is not None else node.entropies
        teacher = np.asarray(node.teacher_logprobs, dtype=np.float64).reshape(-1)
        if teacher.size != node.n_tokens:
            raise ScheduleError(
                f"node {nid}: {teacher.size} teacher log-probs for {node.n_tokens} tokens"
            )
        ents.append(np.asarray(u)[g])
        dl.append(teacher[g] - node.logprobs[g])
        turn_of.append(np.full(node.n_generated, t))
        offset.append(np.arange(node.prefix_len, node.n_tokens))
    if not ents:
        return []
    ent = np.concatenate(ents)
    v = fork_scores(ent, np.concatenate(dl), alpha=alpha, window=window, window_mode=window_mode)
    turn_arr = np.concatenate(turn_of)
    off = np.concatenate(offset)
    if mode == "tokens":
        picks = select_token_forks(v, ent, b=m, min_entropy=min_entropy)
        return sorted(ForkPoint(int(turn_arr[i]), int(off[i]), float(v[i])) for i in picks)
    if mode == "turns":
        pairs = select_turn_forks(
            v,
            ent,
            turn_arr,
            rng,
            max_turns=m,
            min_turn_distance=min_turn_distance,
            top_frac=top_frac,
            pick_from=pick_from,
            min_entropy=min_entropy,
        )
        return sorted(ForkPoint(t, int(off[i]), float(v[i])) for t, i in pairs)
    raise ScheduleError(f"fork_score mode must be 'turns' or 'tokens', got {mode!r}")


# -------------------------------------------------------------------------- registry

#: name -> schedule function; add yours with :func:`register_schedule`.
SCHEDULES: dict[str, Schedule] = {
    "entropy": entropy_schedule,
    "lowest_entropy": lowest_entropy_schedule,
    "random": random_schedule,
    "even": even_schedule,
    "depths": depths_schedule,
    "oracle": oracle_schedule,
    "fork_score": fork_score_schedule,
}


def register_schedule(name: str, fn: Schedule) -> None:
    """Add a schedule ``fn(tree, backbone, m, rng, **options) -> list[ForkPoint]``.

    A ``planned(m, **options) -> steps`` attribute marks it planned (:func:`planned_steps`).
    """
    if not callable(fn):
        raise ScheduleError(f"schedule {name!r} must be a function")
    SCHEDULES[name] = fn


def get_schedule(schedule: str | Schedule) -> Schedule:
    """The schedule named ``schedule`` (a callable passes through)."""
    if callable(schedule):
        return schedule
    if schedule in SCHEDULES:
        return SCHEDULES[schedule]
    close = difflib.get_close_matches(str(schedule), list(SCHEDULES), n=2, cutoff=0.4)
    hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    raise ScheduleError(
        f"no branch schedule is named {schedule!r}.{hint} Known: {', '.join(SCHEDULES)}; "
        "add one with branchgym.rollout.schedules.register_schedule(name, fn)."
    )
