"""The branching engine: grow rollout trees (BPO, BranchOPD) and independent groups (GRPO/RLOO).

:func:`grow_tree` implements docs/algorithms.md §1 steps 1-4 (and section 2 steps
1-4 with the ``fork_score`` schedule):

1. sample a backbone to termination, recording the policy's per-token log-probs and
   entropies at every decision;
2. let a schedule pick the branch points;
3. restore each chosen state and run K-1 siblings to termination (the backbone's own
   action is sibling ``k = 1``), releasing each snapshot as soon as its last sibling
   has restored from it.

:func:`group_rollouts` makes N independent rollouts from the reset state through the
same code path, so trees and groups are compared at matched compute.

How states at candidate points are kept until the schedule picks (``keep=``):

* ``"snapshot"`` (default): snapshot before every backbone decision, release the
  unchosen ones once the schedule has picked. Costs one snapshot per step and holds
  up to T snapshots for the length of the backbone.
* ``"replay"``: take no snapshots on the backbone; after the schedule picks, reset
  with the same seed and replay the backbone's actions once, snapshotting only at the
  chosen steps (the env must be deterministic given seed and actions, which the
  replay checks against the backbone's observations).

``branchgym bench branching`` measures both; see docs/engine.md.

The policy stays in this process: siblings advance in lockstep, so each policy call
is one batch, and the K-1 siblings of a branch point ask for their first action in one
request (an LLM engine samples them from one shared prefix). Environment calls go to an
:class:`~branchgym.rollout.executor_base.Executor`.

Failures never shrink a tree: a sibling whose restore, step or sandbox fails, or that
the tree's time budget (``tree_timeout``) cuts or never starts, is a leaf whose
``error`` says why, so every sibling group keeps its K members on record.

The module is over 600 lines because the lockstep loop, its two entry points (trees and
groups), option checks and the failure bookkeeping share one engine state (``_Engine``);
split apart, they would pass that state across modules.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from tqdm import tqdm

from branchgym.compare import first_difference
from branchgym.error import OptionError
from branchgym.rollout.executor_base import EnvRecipe, Executor, SnapshotRef
from branchgym.rollout.executors import InProcessExecutor, make_executor
from branchgym.rollout.policy import ActionSample, ActRequest, Context, Policy, Turn
from branchgym.rollout.schedules import ForkPoint, get_schedule, planned_steps
from branchgym.rollout.tree import ROOT, Node, RolloutTree

__all__ = ["grow_tree", "group_rollouts", "spec_of", "KEEP_MODES"]

#: How states at candidate branch points are kept until the schedule picks.
KEEP_MODES = ("snapshot", "replay")

#: Step cap for envs without a time limit (a policy that only emits invalid text).
DEFAULT_MAX_STEPS = 100

Teacher = Callable[[RolloutTree, list[int]], None]


def spec_of(env: gym.Env) -> EnvRecipe:
    """The :class:`EnvRecipe` a ``gym.make`` env was built from."""
    spec = env.spec
    if spec is None:
        raise ValueError(
            "this env was not made with gym.make, so siblings cannot build instances like "
            "it; pass an EnvRecipe(id, kwargs, factory=...) instead of the instance."
        )
    kwargs = dict(spec.kwargs)
    if spec.max_episode_steps is not None:
        kwargs.setdefault("max_episode_steps", spec.max_episode_steps)
    return EnvRecipe(spec.id, kwargs)


def _resolve(
    env: gym.Env | EnvRecipe | str, executor: Executor | str | None, **executor_kwargs: Any
) -> tuple[EnvRecipe, Executor, bool]:
    """(spec, executor, whether we own the executor)."""
    if isinstance(env, str):
        env = EnvRecipe(env)
    if isinstance(env, EnvRecipe):
        if executor is None:
            return env, InProcessExecutor(), True
        owned = not isinstance(executor, Executor)
        return env, make_executor(executor, **executor_kwargs), owned
    spec = spec_of(env)
    if executor is None:
        # The instance itself is the pool: every sibling restores into it (fast path).
        ex = InProcessExecutor(max_instances=1)
        ex.worker.adopt(spec, env)
        return spec, ex, True
    owned = not isinstance(executor, Executor)
    ex = make_executor(executor, **executor_kwargs)
    if isinstance(ex, InProcessExecutor):
        ex.worker.adopt(spec, env)
    return spec, ex, owned


def _capacity(max_concurrent: int | None, ex: Executor) -> int | None:
    """Sessions alive at once: ``max_concurrent``, never more than the executor holds."""
    limits = [c for c in (max_concurrent, ex.capacity) if c is not None]
    return min(limits) if limits else None


#: Seconds one tree (or group of rollouts) may take unless told otherwise.
DEFAULT_TREE_TIMEOUT = 3600.0


def check_options(**options: Any) -> None:
    """Refuse out-of-range run options with :class:`~branchgym.error.OptionError`.

    Known names: ``m`` (>= 0), ``k``, ``n``, ``max_steps``, ``max_concurrent``,
    ``max_tokens`` (>= 1 or None), ``gamma`` (finite, in [0, 1]), ``seed`` and ``env_seed``
    (>= 0 or None).
    """
    for name, value in options.items():
        if name == "tree_timeout":
            if value is None:
                continue
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or value <= 0:
                raise OptionError(f"tree_timeout must be positive seconds or None, got {value!r}")
            continue
        if name == "gamma":
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or not 0.0 <= value <= 1.0:
                raise OptionError(f"gamma must be a finite number in [0, 1], got {value!r}")
            continue
        low = 0 if name in ("m", "seed", "env_seed") else 1
        optional = name in ("max_steps", "max_concurrent", "max_tokens", "seed", "env_seed")
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
            allowed = f"a whole number >= {low}" + (" or None" if optional else "")
            raise OptionError(f"{name} must be {allowed}, got {value!r}")


def _max_steps(spec: EnvRecipe, max_steps: int | None) -> int:
    """Decisions before a rollout is cut: ``max_steps``, else the spec's time limit.

    ``max_episode_steps=-1`` is Gymnasium's "no time limit": the default cap applies.
    """
    if max_steps is not None:
        return int(max_steps)
    limit = spec.kwargs.get("max_episode_steps")
    if limit is None and spec.factory is None:
        try:
            limit = gym.spec(spec.id).max_episode_steps
        except Exception:
            limit = None
    if limit is None or limit == -1:
        return DEFAULT_MAX_STEPS
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise OptionError(
            f"max_episode_steps must be a whole number >= 1, or -1 for no time limit, got {limit!r}"
        )
    return limit


@dataclasses.dataclass
class _Line:
    """One rollout being played: a session, its context and where it hangs in the tree."""

    session: int
    context: Context
    parent: int
    rollout: int
    sibling: int = 0
    prefix: tuple[int, ...] = ()
    group: Any = None  # lines with the same group ask for their first action together
    snapshot_each: bool = False
    snaps: dict[int, SnapshotRef] = dataclasses.field(default_factory=dict)
    stepped: bool = False  # has a node of its own in the tree
    moves: int = 0  # nodes this line has added
    rng: np.random.Generator | None = None  # this rollout's own random stream
    phase: int = 0  # grow_tree: 0 the backbone, 1 a sibling (node numbering)
    snap_at: frozenset[int] = frozenset()  # steps to snapshot before (a planned schedule)


class _Engine:
    """The state of one :func:`grow_tree` or :func:`group_rollouts` call."""

    def __init__(
        self,
        spec: EnvRecipe,
        ex: Executor,
        policy: Policy,
        rng: np.random.Generator,
        max_steps: int,
        tree: RolloutTree,
        tree_timeout: float | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.spec, self.ex, self.policy, self.rng = spec, ex, policy, rng
        self.max_steps = max_steps
        self.max_tokens = max_tokens
        self.tree = tree
        self.live: dict[int, SnapshotRef] = {}
        self.tree_timeout = tree_timeout
        self.deadline = None if tree_timeout is None else time.monotonic() + tree_timeout
        # Every rollout draws from its own stream, keyed by (branch point, sibling): the
        # tree is a function of its seeds, not of the executor or the scheduling order.
        self.root_seed = int(rng.integers(2**63))
        # Node ids follow the schedule, not the order in which lines finish (which depends
        # on the executor's capacity): every node gets a key (phase, moves of its line
        # before it, rollout) and number_nodes() renumbers the tree by it. That is the
        # order an in-process run with room for every line adds them in.
        # phase: grow_tree's backbone 0, its siblings 1 (whenever they ran)
        self.keys: list[tuple[int, int, int]] = []

    def add(self, parent: int, moves: int, rollout: int, phase: int, **fields: Any) -> Node:
        """Add a node to the tree, keyed for :meth:`number_nodes`.

        ``moves`` is -1 for a leaf that records a rollout that could not start.
        """
        self.keys.append((phase, moves, rollout))
        return self.tree.add(parent, rollout=rollout, **fields)

    def number_nodes(self) -> None:
        """Renumber the tree's nodes in schedule order (see ``keys``); again is a no-op."""
        order = sorted(range(len(self.keys)), key=self.keys.__getitem__)
        self.tree.renumber(order)
        self.keys = [self.keys[i] for i in order]

    def stream(self, *key: int) -> np.random.Generator:
        """The random stream of one rollout.

        Keys: ``(0, 0)`` the backbone, ``(step + 1, k)`` sibling k at a branch point,
        ``(i + 1, 0)`` the i-th independent rollout of a group.
        """
        return np.random.default_rng([self.root_seed, *key])

    @property
    def expired(self) -> bool:
        """The tree's time budget is spent: nothing new starts, running lines are cut."""
        return self.deadline is not None and time.monotonic() > self.deadline

    def timeout_reason(self) -> str:
        return f"tree timeout: the tree ran past its {self.tree_timeout:g} s budget"

    def record_not_run(
        self, parent: int, sibling: int, rollout: int, why: str, phase: int = 0
    ) -> None:
        """A scheduled rollout that never ran: a leaf saying why (the group stays whole)."""
        self.add(parent, -1, rollout, phase, sibling=sibling, truncated=True, error=why)
        self.tree.stats.errors += 1

    # -- snapshot bookkeeping -----------------------------------------------------
    def track(self, ref: SnapshotRef) -> None:
        self.live[id(ref)] = ref
        s = self.tree.stats
        s.snapshots_taken += 1
        count = len(self.live)
        nbytes = sum(r.nbytes for r in self.live.values())
        if count > s.peak_live_snapshots:
            s.peak_live_snapshots, s.peak_live_bytes = count, nbytes

    def release(self, ref: SnapshotRef) -> None:
        if self.live.pop(id(ref), None) is not None:
            self.ex.release(ref)

    def release_all(self) -> None:
        for ref in list(self.live.values()):
            self.release(ref)

    def snapshot_lines(
        self,
        lines: Sequence[_Line],
        forked: Callable[[_Line, SnapshotRef], None] | None = None,
    ) -> None:
        outs = self.ex.snapshot([ln.session for ln in lines])
        for ln, o in zip(lines, outs, strict=True):
            self.tree.stats.snapshot_s += o.seconds
            if o.error is None and o.snapshot is not None:
                self.track(o.snapshot)
                ln.snaps[ln.context.step] = o.snapshot
                if forked is not None and ln.context.step in ln.snap_at:
                    forked(ln, o.snapshot)
            else:
                self.tree.meta.setdefault("snapshot_errors", []).append(o.error)

    # -- the lockstep loop ----------------------------------------------------------
    def advance(
        self,
        lines: list[_Line],
        refill: Callable[[int], list[_Line] | None] | None = None,
        capacity: int | None = None,
        bar: tqdm | None = None,
        forked: Callable[[_Line, SnapshotRef], None] | None = None,
    ) -> list[_Line]:
        """Play lines to termination; ``refill(n)`` starts up to n more as lines end.

        ``refill`` returns the lines it started (possibly none, when every start failed:
        each failure is recorded in the tree) or None once nothing is left to start. It
        is called until the room is full or it returns None, so a run of failed restores
        never ends the tree while siblings are still waiting.

        Before each turn, lines snapshot where they are due (every step, or the steps
        of their ``snap_at``); ``forked(line, ref)`` hears of each ``snap_at`` snapshot
        before ``refill`` runs, so siblings restored from it act in this same turn.
        """
        finished: list[_Line] = []
        active = list(lines)
        while True:
            if active and self.expired:
                self._cut(active)
                finished.extend(active)
                active = []
            snap_now = [ln for ln in active if ln.snapshot_each or ln.context.step in ln.snap_at]
            if snap_now:
                self.snapshot_lines(snap_now, forked)
            if refill is not None and not self.expired:
                while (room := (capacity or 1 << 30) - len(active)) > 0:
                    started = refill(room)
                    if started is None:
                        break
                    active.extend(started)
            if not active:
                break
            samples, cost = self._act(active)
            outs = self.ex.step([ln.session for ln in active], [s.action for s in samples])
            still = []
            for ln, smp, out in zip(active, samples, outs, strict=True):
                node = self.add(
                    ln.parent,
                    ln.moves,
                    ln.rollout,
                    ln.phase,
                    action=smp.action,
                    text=smp.text,
                    token_ids=smp.token_ids,
                    logprobs=smp.logprobs,
                    entropies=smp.entropies,
                    entropies_top20=smp.entropies_top20,
                    prefix_len=smp.prefix_len,
                    observation=out.observation,
                    reward=out.reward,
                    terminated=out.terminated,
                    truncated=out.truncated or out.error is not None,
                    info=dict(out.info) if isinstance(out.info, dict) else {},
                    sibling=ln.sibling,
                    costs={"generate": cost, "env_step": out.seconds},
                    error=out.error,
                    parse_error=smp.parse_error,
                )
                self.tree.stats.env_s += out.seconds
                self.tree.stats.env_steps += 1
                if out.error is not None:
                    self.tree.stats.errors += 1
                ln.parent, ln.sibling, ln.prefix, ln.group = node.id, 0, (), None
                ln.stepped, ln.moves = True, ln.moves + 1
                ln.context = ln.context.extend(
                    Turn(
                        smp.text,
                        tuple(int(t) for t in smp.token_ids),
                        smp.action,
                        out.observation,
                        node.info,
                    )
                )
                if not node.done and ln.context.step >= self.max_steps:
                    node.truncated = True
                if not node.done and self.max_tokens is not None:
                    spent = sum(len(t.token_ids) for t in ln.context.turns)
                    node.truncated = spent >= self.max_tokens
                if node.done:
                    if out.error is None:
                        self.ex.close([ln.session])
                    finished.append(ln)
                    if bar is not None:
                        bar.update(1)
                else:
                    still.append(ln)
            active = still
        return finished

    def _cut(self, lines: Sequence[_Line]) -> None:
        """End lines where they are when the tree's budget runs out (recorded as errors)."""
        why = self.timeout_reason()
        for ln in lines:
            if ln.stepped:
                node = self.tree[ln.parent]
                node.truncated = True
                node.error = node.error or why
                self.tree.stats.errors += 1
            else:  # restored but not yet stepped: its leaf says why
                self.record_not_run(ln.parent, ln.sibling, ln.rollout, why, ln.phase)
        self.ex.close([ln.session for ln in lines])

    def _act(self, lines: Sequence[_Line]) -> tuple[list[ActionSample], float]:
        """One batched policy call; lines of one group share a request (shared prefix)."""
        requests: list[ActRequest] = []
        owners: list[list[int]] = []
        by_group: dict[Any, int] = {}
        for i, ln in enumerate(lines):
            own = (ln.rng,) if ln.rng is not None else ()
            if ln.group is not None and ln.group in by_group:
                j = by_group[ln.group]
                requests[j] = dataclasses.replace(
                    requests[j], n=requests[j].n + 1, rngs=(*requests[j].rngs, *own)
                )
                owners[j].append(i)
                continue
            if ln.group is not None:
                by_group[ln.group] = len(requests)
            requests.append(ActRequest(ln.context, 1, ln.prefix, own))
            owners.append([i])
        t0 = time.perf_counter()
        batches = self.policy.act(requests, self.rng)
        secs = time.perf_counter() - t0
        self.tree.stats.generate_s += secs
        out: list[ActionSample | None] = [None] * len(lines)
        for req, own, batch in zip(requests, owners, batches, strict=True):
            if len(batch) != req.n:
                raise ValueError(f"policy returned {len(batch)} samples for n={req.n}")
            for i, smp in zip(own, batch, strict=True):
                out[i] = smp
        # each sample's share of the batched call
        return out, secs / len(lines)  # type: ignore[return-value]


def _context_at(tree: RolloutTree, backbone: Sequence[int], step: int) -> Context:
    ctx = Context(tree.env_id, tree.observation, tree.info)
    for nid in backbone[:step]:
        n = tree[nid]
        ctx = ctx.extend(
            Turn(n.text, tuple(int(t) for t in n.token_ids), n.action, n.observation, n.info)
        )
    return ctx


def _replay_to(
    eng: _Engine,
    tree: RolloutTree,
    backbone: Sequence[int],
    steps: Sequence[int],
    seed: Any,
    options: Any,
    env_seed: int | None = None,
) -> dict[int, SnapshotRef]:
    """Reset with the tree's seed and replay the backbone once, snapshotting at ``steps``."""
    ex = eng.ex
    t0 = time.perf_counter()
    snap_s = 0.0
    (out,) = ex.reset([eng.spec], [seed], options=options, reseeds=[env_seed])
    refs: dict[int, SnapshotRef] = {}
    if out.error is not None:
        tree.meta.setdefault("replay_errors", []).append(out.error)
        return refs
    session = out.session
    want = sorted(set(steps))
    obs = out.observation
    for t in range(max(want) + 1):
        expected = tree.observation if t == 0 else tree[backbone[t - 1]].observation
        diff = first_difference(obs, expected)
        if diff is not None:
            tree.meta.setdefault("replay_errors", []).append(
                f"replay diverged from the backbone at step {t} ({diff}); the env is not "
                "deterministic given seed and actions: use keep='snapshot'"
            )
            break
        if t in want:
            (so,) = ex.snapshot([session])
            tree.stats.snapshot_s += so.seconds
            snap_s += so.seconds
            if so.snapshot is not None:
                eng.track(so.snapshot)
                refs[t] = so.snapshot
        if t == max(want):
            break
        (st,) = ex.step([session], [tree[backbone[t]].action])
        tree.stats.replay_steps += 1
        tree.stats.env_steps += 1
        if st.error is not None:
            tree.meta.setdefault("replay_errors", []).append(st.error)
            session = None
            break
        obs = st.observation
    if session is not None:
        ex.close([session])
    # replaying is how this mode restores: its time counts as restore time
    tree.stats.restore_s += time.perf_counter() - t0 - snap_s
    return refs


def grow_tree(
    env: gym.Env | EnvRecipe | str,
    policy: Policy,
    schedule: str | Callable[..., list[ForkPoint]] = "entropy",
    *,
    m: int = 2,
    k: int = 4,
    seed: int | None = None,
    options: dict[str, Any] | None = None,
    executor: Executor | str | None = None,
    executor_options: dict[str, Any] | None = None,
    keep: str = "snapshot",
    max_steps: int | None = None,
    schedule_options: dict[str, Any] | None = None,
    rng: np.random.Generator | int | None = None,
    env_noise: str = "fresh",
    teacher: Teacher | None = None,
    max_concurrent: int | None = None,
    gamma: float = 1.0,
    env_seed: int | None = None,
    tree_timeout: float | None = DEFAULT_TREE_TIMEOUT,
    overlap: bool | None = None,
) -> RolloutTree:
    """Grow one rollout tree: a backbone, then K-1 siblings at M branch points.

    Args:
        env: An env instance (siblings restore into it one after another: the fast
            path), an :class:`EnvRecipe`, or a registered id.
        policy: Samples actions (see :mod:`branchgym.agents.policies.policy`).
        schedule: A name in :data:`branchgym.rollout.schedules.SCHEDULES` or a function.
        m: Branch points M (B for BranchOPD).
        k: Siblings per branch point K, the backbone's own action included. Rollouts:
            N = 1 + M(K-1).
        seed: Reset seed (the task instance).
        options: Reset options.
        executor: Where sandboxes run: an :class:`Executor` or a name (``inprocess``,
            ``thread``, ``process``, ``ray``); a named one is shut down at the end.
        executor_options: Keyword arguments of a named executor.
        keep: How candidate states are kept until the schedule picks: ``snapshot``
            (every step, unchosen ones released) or ``replay`` (replay to the chosen).
        max_steps: Truncate rollouts after this many decisions (default: the spec's
            time limit, else 100).
        schedule_options: Keyword arguments of the schedule (``reduce``, ``min_gap``...).
        rng: Seed or generator of the policy's sampling and the schedule's choices.
        env_noise: ``fresh``: each sibling's env gets a new RNG stream after restore, so
            its transitions are independent draws; ``shared``: keep the snapshot's
            stream (common random numbers).
        teacher: ``teacher(tree, backbone)`` fills ``teacher_logprobs`` before the
            schedule runs (BranchOPD's fork score needs it).
        max_concurrent: Sibling sessions alive at once (default: all, or the
            executor's ``max_instances``).
        gamma: Discount of the tree's returns-to-go.
        env_seed: Reseed the env's RNG right after the reset (``branchgym.reseed``), so
            several trees of one task (same ``seed``) draw independent environment
            randomness; ``None`` keeps the reset seed's stream.
        tree_timeout: Seconds the whole tree may take (None: no limit). Past it nothing
            new starts and running rollouts are cut; each is recorded with the reason
            (``node.error``), so every sibling group stays whole. Each sandbox call has
            its own limit too (the executor's ``timeout``).
        overlap: Start each branch point's siblings as soon as the backbone reaches it,
            so they act in the same policy calls as the backbone (one engine batch)
            instead of after it. Only a *planned* schedule allows it (``depths``: its
            points are fixed before the backbone exists, see
            :func:`~branchgym.rollout.schedules.planned_steps`); ``None`` (default)
            overlaps exactly then, unless a ``teacher`` is given (it scores the finished
            backbone before the siblings run; with ``True`` it runs at the end), ``False``
            never. Same tree either way: every rollout
            keeps its random stream. Snapshots are then taken only at the planned
            points (``keep`` is moot), and the backbone holds one of the executor's
            sessions while siblings run.

    Returns:
        The tree, its :class:`~branchgym.rollout.tree.TreeStats` filled in. Every scheduled
        rollout is in it: played out, or a leaf whose ``error`` says why it did not run
        or stopped (restore failed, sandbox crashed, timed out). Every snapshot it took is
        released, even when a sibling failed.
    """
    check_options(
        m=m, k=k, max_steps=max_steps, max_concurrent=max_concurrent, gamma=gamma, seed=seed,
        env_seed=env_seed, tree_timeout=tree_timeout,
    )  # fmt: skip
    if keep not in KEEP_MODES:
        raise ValueError(f"keep must be one of {KEEP_MODES}, got {keep!r}")
    if env_noise not in ("fresh", "shared"):
        raise ValueError(f"env_noise must be 'fresh' or 'shared', got {env_noise!r}")
    sched = get_schedule(schedule)
    plan = planned_steps(sched, m, schedule_options) if overlap is not False else None
    if overlap and plan is None:
        raise OptionError(
            f"overlap=True needs a planned schedule (one whose branch points are fixed "
            f"before the backbone exists, like 'depths'); {schedule!r} reads the finished "
            "backbone. Use schedule='depths' with schedule_options={'depths': (...)}, or "
            "overlap=None."
        )
    if teacher is not None and plan is not None and overlap is None:
        plan = None  # the teacher scores the finished backbone before the siblings run
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    spec, ex, owned = _resolve(env, executor, **(executor_options or {}))
    wall0 = time.perf_counter()
    tree = RolloutTree(spec.id, seed, gamma=gamma)
    eng = _Engine(spec, ex, policy, rng, _max_steps(spec, max_steps), tree, tree_timeout)
    try:
        (out,) = ex.reset([spec], [seed], options=options, reseeds=[env_seed])
        if out.error is not None:
            raise RuntimeError(f"reset of {spec.id} failed: {out.error}")
        tree.observation, tree.info = out.observation, dict(out.info)
        tree.stats.env_s += out.seconds
        ctx = Context(spec.id, out.observation, tree.info)
        branching = m > 0 and k > 1
        backbone_line = _Line(
            out.session,
            ctx,
            ROOT,
            0,
            snapshot_each=branching and keep == "snapshot" and plan is None,
            rng=eng.stream(0, 0),
        )
        if branching and plan is not None:
            forks = _grow_overlapped(eng, backbone_line, plan, k, env_noise, max_concurrent)
            tree.meta["forks"] = [dataclasses.asdict(f) for f in forks]
            if teacher is not None and tree.backbone:
                teacher(tree, tree.backbone)
            return tree
        eng.advance([backbone_line])
        backbone = tree.backbone
        if not branching or not backbone:
            return tree
        if teacher is not None:
            teacher(tree, backbone)
        forks = [
            f
            for f in sched(tree, backbone, m, rng, **(schedule_options or {}))
            if 0 <= f.step < len(backbone)
        ]
        tree.meta["forks"] = [dataclasses.asdict(f) for f in forks]
        chosen = {f.step for f in forks}
        if keep == "snapshot":
            refs = backbone_line.snaps
            for step, ref in list(refs.items()):
                if step not in chosen:
                    eng.release(ref)
                    refs.pop(step)
        else:
            refs = (
                _replay_to(eng, tree, backbone, sorted(chosen), seed, options, env_seed)
                if chosen
                else {}
            )
        _run_siblings(eng, tree, backbone, forks, refs, k, env_noise, max_concurrent)
        return tree
    finally:
        eng.release_all()
        eng.number_nodes()
        tree.stats.rollouts = len(tree.leaves())
        tree.stats.generated_tokens = tree.generated_tokens()
        tree.stats.independent_tokens = tree.independent_tokens()
        tree.stats.wall_s = time.perf_counter() - wall0
        if owned:
            ex.shutdown()


class _Siblings:
    """The K-1 siblings of each fork: queued, restored as room frees up, recorded if never run."""

    def __init__(self, eng: _Engine, k: int, env_noise: str) -> None:
        self.eng, self.k, self.env_noise = eng, k, env_noise
        self.pending: collections.deque[tuple[int, int]] = collections.deque()  # (step, kk)
        self.remaining: dict[int, int] = {}
        self.refs: dict[int, SnapshotRef] = {}
        self.contexts: dict[int, Context] = {}
        self.parents: dict[int, int] = {}
        self.prefixes: dict[int, tuple[int, ...]] = {}
        self.rollout_ids = iter(range(1, 1 << 30))

    def fork(
        self, step: int, ref: SnapshotRef, context: Context, parent: int, prefix: tuple[int, ...]
    ) -> None:
        """Queue K-1 siblings restoring ``ref`` (the state before decision ``step``)."""
        self.refs[step], self.contexts[step] = ref, context
        self.parents[step], self.prefixes[step] = parent, prefix
        self.remaining[step] = self.k - 1
        self.pending.extend((step, kk) for kk in range(2, self.k + 1))

    def _started(self, step: int) -> None:
        self.remaining[step] -= 1
        if self.remaining[step] == 0:  # the last sibling has restored: free the state
            self.eng.release(self.refs[step])

    def refill(self, room: int) -> list[_Line] | None:
        eng = self.eng
        starts = []
        while self.pending and len(starts) < room:
            starts.append(self.pending.popleft())
        if not starts:
            return None
        streams = [eng.stream(step + 1, kk) for step, kk in starts]
        reseeds = [int(st.integers(2**63)) if self.env_noise == "fresh" else None for st in streams]
        outs = eng.ex.restore(
            [eng.spec] * len(starts), [self.refs[step] for step, _ in starts], reseeds=reseeds
        )
        lines = []
        for (step, kk), out, stream in zip(starts, outs, streams, strict=True):
            eng.tree.stats.restore_s += out.seconds
            self._started(step)
            parent, rid = self.parents[step], next(self.rollout_ids)
            if out.error is not None:
                eng.add(parent, -1, rid, 1, sibling=kk, truncated=True, error=out.error)
                eng.tree.stats.errors += 1
                continue
            lines.append(
                _Line(
                    out.session,
                    self.contexts[step],
                    parent,
                    rid,
                    kk,
                    self.prefixes[step],
                    group=step,
                    rng=stream,
                    phase=1,
                )  # fmt: skip
            )
        return lines

    def record_unrun(self) -> None:
        """The budget ran out with siblings still waiting: each is recorded, none vanishes."""
        eng = self.eng
        while self.pending:
            step, kk = self.pending.popleft()
            why = "not run: " + eng.timeout_reason()
            eng.record_not_run(self.parents[step], kk, next(self.rollout_ids), why, phase=1)
            self._started(step)


def _run_siblings(
    eng: _Engine,
    tree: RolloutTree,
    backbone: list[int],
    forks: Sequence[ForkPoint],
    refs: dict[int, SnapshotRef],
    k: int,
    env_noise: str,
    max_concurrent: int | None,
) -> None:
    """Restore each fork's snapshot into K-1 sessions and play them out."""
    sibs = _Siblings(eng, k, env_noise)
    for f in forks:
        node = tree[backbone[f.step]]
        node.sibling = 1
        if f.token_offset:
            tree.set_fork_offset(node.parent, min(f.token_offset, node.n_tokens))
        if f.step not in refs:
            tree.meta.setdefault("skipped_forks", []).append(f.step)
            continue
        prefix = tuple(int(t) for t in node.token_ids[: f.token_offset])
        sibs.fork(f.step, refs[f.step], _context_at(tree, backbone, f.step), node.parent, prefix)
    eng.advance([], refill=sibs.refill, capacity=_capacity(max_concurrent, eng.ex))
    sibs.record_unrun()


def _grow_overlapped(
    eng: _Engine,
    backbone_line: _Line,
    steps: Sequence[int],
    k: int,
    env_noise: str,
    max_concurrent: int | None,
) -> list[ForkPoint]:
    """A planned schedule's tree: each point's siblings start when the backbone reaches it.

    The backbone snapshots only before its decisions at ``steps``; each snapshot queues
    K-1 siblings that restore from it at once (room permitting) and act in the same
    turns as the backbone and the other points' siblings, so the engine decodes them in
    one batch. Every rollout keeps its own stream and node key, so the tree is the one
    the backbone-first order grows (for an LLM engine: the same tokens, up to the float
    tolerance of a differently padded batch).
    """
    tree = eng.tree
    sibs = _Siblings(eng, k, env_noise)
    backbone_line.snap_at = frozenset(steps)

    def forked(line: _Line, ref: SnapshotRef) -> None:
        sibs.fork(line.context.step, ref, line.context, line.parent, ())

    capacity = _capacity(max_concurrent, eng.ex)
    eng.advance([backbone_line], refill=sibs.refill, capacity=capacity, forked=forked)
    sibs.record_unrun()
    # a sibling that failed to restore was added before the backbone's node at its step:
    # number the nodes now, so each node's first child is its backbone child again
    eng.number_nodes()
    backbone = tree.backbone
    forks = [ForkPoint(t, 0, float(t)) for t in steps if t < len(backbone)]
    for f in forks:
        tree[backbone[f.step]].sibling = 1
        if f.step not in sibs.refs:
            tree.meta.setdefault("skipped_forks", []).append(f.step)
    return forks


def group_rollouts(
    env: gym.Env | EnvRecipe | str,
    policy: Policy,
    n: int,
    *,
    seed: int | None = None,
    options: dict[str, Any] | None = None,
    executor: Executor | str | None = None,
    executor_options: dict[str, Any] | None = None,
    max_steps: int | None = None,
    rng: np.random.Generator | int | None = None,
    env_noise: str = "fresh",
    max_concurrent: int | None = None,
    gamma: float = 1.0,
    tree_timeout: float | None = DEFAULT_TREE_TIMEOUT,
    max_tokens: int | None = None,
) -> RolloutTree:
    """N independent rollouts from the reset state (GRPO/RLOO's topology), as one tree.

    The tree's root is a branch point with N siblings; no snapshot is taken (every
    rollout resets with ``seed``). Arguments are those of :func:`grow_tree`, and
    ``max_tokens``: truncate a rollout after the decision at which its actions' tokens
    reach this many (None: no limit).
    """
    check_options(
        n=n, max_steps=max_steps, max_concurrent=max_concurrent, gamma=gamma, seed=seed,
        tree_timeout=tree_timeout, max_tokens=max_tokens,
    )  # fmt: skip
    if env_noise not in ("fresh", "shared"):
        raise ValueError(f"env_noise must be 'fresh' or 'shared', got {env_noise!r}")
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    spec, ex, owned = _resolve(env, executor, **(executor_options or {}))
    wall0 = time.perf_counter()
    tree = RolloutTree(spec.id, seed, gamma=gamma)
    eng = _Engine(
        spec, ex, policy, rng, _max_steps(spec, max_steps), tree, tree_timeout, max_tokens
    )
    todo = collections.deque(range(n))
    capacity = _capacity(max_concurrent, ex)

    def refill(room: int) -> list[_Line] | None:
        starts = [todo.popleft() for _ in range(min(room, len(todo)))]
        if not starts:
            return None
        streams = {i: eng.stream(i + 1, 0) for i in starts}
        reseeds = [
            None if (i == 0 or env_noise == "shared") else int(streams[i].integers(2**63))
            for i in starts
        ]
        outs = ex.reset(
            [spec] * len(starts), [seed] * len(starts), options=options, reseeds=reseeds
        )
        lines = []
        for i, out in zip(starts, outs, strict=True):
            tree.stats.env_s += out.seconds
            if out.error is not None:
                sib = i + 1 if n > 1 else 0
                eng.add(ROOT, -1, i, 0, sibling=sib, truncated=True, error=out.error)
                tree.stats.errors += 1
                continue
            if tree.observation is None:
                tree.observation, tree.info = out.observation, dict(out.info)
            ctx = Context(spec.id, out.observation, dict(out.info))
            sib = i + 1 if n > 1 else 0
            lines.append(_Line(out.session, ctx, ROOT, i, sib, group="root", rng=streams[i]))
        return lines

    try:
        eng.advance([], refill=refill, capacity=capacity)
        for i in todo:  # the budget ran out before these started
            eng.record_not_run(ROOT, i + 1 if n > 1 else 0, i, "not run: " + eng.timeout_reason())
        return tree
    finally:
        eng.release_all()
        eng.number_nodes()
        tree.stats.rollouts = len(tree.leaves())
        tree.stats.generated_tokens = tree.generated_tokens()
        tree.stats.independent_tokens = tree.independent_tokens()
        tree.stats.wall_s = time.perf_counter() - wall0
        if owned:
            ex.shutdown()
