"""Where an episode was lost: the value of each state along it, measured by forking.

A sandbox that can be snapshotted can answer what a transcript cannot: from the state
``s_t`` before step ``t`` of an episode, could the same agent still have succeeded? Restore
``s_t`` K times, let the agent play each fork to the end, and the share that succeed
estimates ``V(s_t)``, the probability of success from there, with an exact (Clopper-Pearson)
interval. Along a failed episode V starts where the agent's success rate on the task is
and ends at 0; the step after which it falls is where the episode was lost, and the action
taken there is the decisive one.

* :func:`attribute_episode` measures V at the steps it needs and names the decisive step
  of a failed episode, or says there is none: the drop from ``V(s_t)`` to ``V(s_{t+1})``
  must be significant (a one-sided Fisher exact test, p < ``alpha``), otherwise "no
  decisive step". A successful episode has none;
* ``mode="bisect"`` spends the budget where it matters: V at the first state and the
  known final outcome, then bisection into the half with the larger drop, so about
  ``log2(T)`` states are forked instead of T; it finds a step where V falls, the largest
  when V falls once (as along a single unrecoverable mistake). When the bisection ends on
  a pair whose drop is not significant (its choice of half followed noise), it forks at
  every step after all. ``mode="all"`` forks at every step and takes the largest
  significant drop. Both report their cost in env steps and generated tokens, and
  bisection reports what forking at every step would have cost (measured in ``all``
  mode, estimated from the forks it ran otherwise);
* a drop picked among T adjacent pairs may be noise, so the decisive step must
  **replicate**: both of its states are forked again with fresh streams, and the fresh
  forks alone must show the drop (p < ``alpha``); the reported values pool both batches;
* :func:`~branchgym.evaluation.attribution_run.attribute_run` runs it over a
  ``branchgym eval`` run's failed (or all) episodes and groups the decisive steps by kind
  of action (:func:`action_kind`).

The forks play the run's own agent (a policy, in lockstep across the forks, or a scripted
expert beside each fork's env). Before any fork is trusted, the env's snapshots are
checked (:func:`~branchgym.fidelity.checks.check_env`: round trip, independence, restoring
twice, portability to a fresh instance) and every recorded step is replayed and compared
with the transcript; an env that fails either is refused with
:class:`~branchgym.error.FidelityViolation` instead of numbers built on broken forks.
Stochastic envs give each fork its own environment randomness
(:func:`branchgym.reseed`), so V averages over it as the episode's own success did.
With an executor (``executor=``: threads, processes, Ray actors, served envs over the
fleet) the forks' envs live there: the episode is replayed once in one of its sessions
with a snapshot before each step (:class:`ExecutorStates`), and every fork restores one
in a fresh session; the forks are the same as in-process (the same draws in the same
order).

The module is over 600 lines because the episode replay, the forks (in-process and through
an executor), the bisection with its replication, and the fork tree the viewer draws
share one set of per-step records; split, each piece would pass them around.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from branchgym.error import ExecutorError, FidelityViolation, OptionError
from branchgym.rollout.policy import ActRequest, Context, Turn
from branchgym.rollout.tree import SUCCESS_KEYS, RolloutTree

__all__ = [
    "Attribution",
    "Episode",
    "ExecutorStates",
    "StepValue",
    "action_kind",
    "attribute_episode",
    "check_forks",
    "forks_from",
]

#: Snapshot checks that must pass before forks are trusted.
FORK_CHECKS = ("round_trip", "independence", "restore_twice", "portability")


@dataclasses.dataclass(frozen=True)
class StepValue:
    """``V(s_t)`` estimated from forks.

    Attributes:
        step: ``t``: the state before the episode's step ``t`` (``T``: after the last).
        successes: Forks that succeeded.
        forks: Forks run (0 for the final state, whose value is the episode's outcome).
        low: Lower end of the exact interval.
        high: Upper end.
        env_steps: Env steps the forks took.
        tokens: Tokens the forks generated.
    """

    step: int
    successes: int
    forks: int
    low: float
    high: float
    env_steps: int = 0
    tokens: int = 0

    @property
    def value(self) -> float:
        """The estimate (the outcome itself at the final state)."""
        return self.successes / self.forks if self.forks else float(self.successes)


@dataclasses.dataclass
class Attribution:
    """One episode's value curve and its decisive step.

    Attributes:
        task: The task.
        attempt: The attempt.
        success: Whether the episode succeeded.
        length: Its steps T.
        values: ``V(s_t)`` at the steps measured, by step (the final state included).
        decisive: The decisive step, or None.
        drop: ``V(s_t) - V(s_{t+1})`` at the decisive step.
        p_value: The one-sided Fisher exact test of that drop.
        action: The action taken at the decisive step, and its kind.
        statement: One sentence: what was found, and how sure.
        cost: Env steps, generated tokens and forks spent.
        naive_cost: What forking K times at every step costs (measured or estimated).
        tree: The episode with its forks as branches (:func:`_fork_tree`), for
            ``branchgym view``.
    """

    task: str
    attempt: int
    success: bool
    length: int
    values: list[StepValue]
    decisive: int | None
    drop: float | None
    p_value: float | None
    action: dict[str, str] | None
    statement: str
    cost: dict[str, int]
    naive_cost: dict[str, Any]
    tree: RolloutTree | None = dataclasses.field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (each value with its estimate; the fork tree is saved apart)."""
        tree, self.tree = self.tree, None
        try:
            d = dataclasses.asdict(self)
        finally:
            self.tree = tree
        d.pop("tree")
        for v, sv in zip(d["values"], self.values, strict=True):
            v["value"] = sv.value
        return d


def _interval(successes: int, n: int, confidence: float) -> tuple[float, float]:
    from scipy import stats

    ci = stats.binomtest(successes, n).proportion_ci(confidence, method="exact")
    return float(ci.low), float(ci.high)


def _pool(a: StepValue, b: StepValue, confidence: float) -> StepValue:
    """Two independent fork batches of one state as one estimate."""
    s, n = a.successes + b.successes, a.forks + b.forks
    lo, hi = _interval(s, n, confidence)
    return StepValue(a.step, s, n, lo, hi, a.env_steps + b.env_steps, a.tokens + b.tokens)


def _drop_p(a: StepValue, b: StepValue) -> float:
    """One-sided p-value that V(a) > V(b) (Fisher exact; a known outcome counts as K forks)."""
    from scipy import stats

    nb = b.forks or a.forks
    sb = b.successes if b.forks else b.successes * nb
    table = [[a.successes, a.forks - a.successes], [sb, nb - sb]]
    return float(stats.fisher_exact(table, alternative="greater").pvalue)


# ---------------------------------------------------------------- action kinds
def action_kind(env_id: str, action: Any) -> str:
    """The kind of an action, for reports of where episodes are lost.

    WebShop: ``search``, ``product choice``, ``option``, ``purchase``, ``navigation``;
    ALFWorld: the task phase (``navigation``, ``pick up``, ``place``, ``open/close``,
    ``heat/cool/clean/use``, ``inspect``); SWE-bench: the command's program (``submit``
    included); otherwise ``action``.
    """
    text = str(action).strip().lower()
    if env_id == "branchgym/WebShop-v0":
        if text.startswith("search["):
            return "search"
        inner = text[6:-1] if text.startswith("click[") else text
        if inner == "buy now":
            return "purchase"
        if inner in ("back to search", "next >", "< prev", "description", "features",
                     "reviews", "attributes"):  # fmt: skip
            return "navigation"
        if inner.startswith("b0") and len(inner) == 10:
            return "product choice"
        return "option"
    if env_id == "branchgym/ALFWorld-v0":
        for prefix, kind in (("go to", "navigation"), ("take", "pick up"), ("put", "place"),
                             ("move", "place"), ("open", "open/close"), ("close", "open/close"),
                             ("heat", "heat/cool/clean/use"), ("cool", "heat/cool/clean/use"),
                             ("clean", "heat/cool/clean/use"), ("use", "heat/cool/clean/use"),
                             ("examine", "inspect"), ("look", "inspect"),
                             ("inventory", "inspect")):  # fmt: skip
            if text.startswith(prefix):
                return kind
        return "other"
    if env_id == "branchgym/SWEBench-v0":
        return text.split()[0] if text.split() else "empty"
    return "action"


# ---------------------------------------------------------------- checks
def check_forks(factory: Callable[[], Any], seed: int = 0) -> None:
    """Refuse an env whose snapshots are not faithful (the checks forks rely on).

    Raises:
        FidelityViolation: naming each failed check and what it found.
    """
    from branchgym.fidelity.checks import check_env

    report = check_env(factory, seed=seed, checks=FORK_CHECKS)
    failed = [r for r in report.results if not r.passed]
    if failed:
        detail = "; ".join(f"{r.name}: {r.detail}" for r in failed)
        raise FidelityViolation(
            f"forks of this env cannot be trusted, its snapshots failed {detail}. Fix the "
            "env's snapshot()/restore() (branchgym check ENV_ID shows each check) before "
            "attributing episodes to steps."
        )


# ---------------------------------------------------------------- one episode
class Episode:
    """The recorded episode, replayed once with a snapshot before every step.

    Raises:
        FidelityViolation: The env does not reproduce the transcript's observations.
    """

    def __init__(self, tree: RolloutTree, make_env: Callable[[], Any], options: Any) -> None:
        import branchgym

        self.tree = tree
        self.options = options
        self.path = tree.paths()[0] if tree.paths() else []
        self.nodes = [tree[i] for i in self.path]
        env = make_env()
        self.env = env
        obs, info = env.reset(seed=tree.seed, options=options)
        if not _same(obs, tree.observation):
            raise FidelityViolation(
                "the env did not reproduce the episode's first observation after reset with "
                "its seed and options; attribution needs the run's own env configuration"
            )
        self.snaps = []
        self.infos = [dict(info)]
        for t, node in enumerate(self.nodes):
            self.snaps.append(branchgym.snapshot(env))
            obs, reward, term, trunc, info = env.step(node.action)
            if not _same(obs, node.observation):
                raise FidelityViolation(
                    f"replaying the episode's action at step {t} gave another observation "
                    "than the transcript's: the env is not deterministic given its seed, so "
                    "forks from its snapshots would not be the episode's states"
                )
            self.infos.append(dict(info))
        self.rewards = [float(n.reward) for n in self.nodes]

    def context(self, t: int) -> Context:
        """What the agent saw before step ``t``: the reset and the recorded turns."""
        ctx = Context(self.tree.env_id, self.tree.observation, self.infos[0])
        for i, n in enumerate(self.nodes[:t]):
            ctx = ctx.extend(Turn(n.text, tuple(int(x) for x in n.token_ids), n.action,
                                  n.observation, self.infos[i + 1]))  # fmt: skip
        return ctx

    def close(self) -> None:
        """Release the snapshots and close the env."""
        for s in self.snaps:
            s.release()
        self.env.close()


class ExecutorStates:
    """The episode's states held by an executor: its sessions restore them for the forks.

    The episode is replayed once in one session of ``executor`` (threads, processes, Ray
    actors, served envs over the fleet), with a snapshot before every step; its
    observations must equal the transcript's, as in-process. The snapshots stay where
    the executor keeps them (a worker, a server) until :meth:`close`.
    """

    def __init__(self, ep: Episode, executor: Any, recipe: Any) -> None:
        self.executor, self.recipe = executor, recipe
        self.refs: list[Any] = []
        (out,) = executor.reset([recipe], [ep.tree.seed], options=ep.options)
        _executor_ok(out, "replaying the episode")
        sid = out.session
        try:
            if not _same(out.observation, ep.tree.observation):
                raise FidelityViolation(
                    f"the {executor.name} executor's env did not reproduce the episode's "
                    "first observation: it must be configured as the run's env"
                )
            for t, node in enumerate(ep.nodes):
                (snap,) = executor.snapshot([sid])
                _executor_ok(snap, f"snapshotting step {t}")
                self.refs.append(snap.snapshot)
                (out,) = executor.step([sid], [node.action])
                _executor_ok(out, f"replaying step {t}")
                if not _same(out.observation, node.observation):
                    raise FidelityViolation(
                        f"replaying step {t} through the {executor.name} executor gave "
                        "another observation than the transcript's"
                    )
        except BaseException:
            self.close()
            raise
        finally:
            executor.close([sid])

    def close(self) -> None:
        """Release the snapshots wherever they live."""
        for ref in self.refs:
            self.executor.release(ref)
        self.refs = []


def _executor_ok(out: Any, what: str) -> None:
    if out.error is not None:
        raise ExecutorError(f"attribution lost a sandbox while {what}: {out.error}")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    return a == b


def _succeeded(info: dict[str, Any], total: float, threshold: float = 1.0) -> bool:
    for key in SUCCESS_KEYS:
        if key in info and isinstance(info[key], bool | np.bool_):
            return bool(info[key])
    return total >= threshold - 1e-9


def forks_from(
    ep: Episode,
    t: int,
    k: int,
    agent: Any,
    make_env: Callable[[], Any],
    envs: list[Any],
    max_steps: int,
    rng: np.random.Generator,
    states: ExecutorStates | None = None,
) -> tuple[int, int, int, list[list[dict[str, Any]]]]:
    """K forks of the agent from ``s_t``: in-process envs, or ``states``' executor.

    Returns:
        Successes, env steps, generated tokens, and each fork's decisions (as
        :meth:`RolloutTree.add_path` takes them).
    """
    import branchgym

    prefix = float(sum(ep.rewards[:t]))
    ctx = ep.context(t)  # immutable: every fork extends it into its own
    lines = []
    if states is None:
        while len(envs) < k:
            envs.append(make_env())
        for j in range(k):
            env = envs[j]
            obs, info = branchgym.restore(env, ep.snaps[t])
            branchgym.reseed(env, int(rng.integers(2**63)))
            line = _fork_line(ctx, info, prefix, np.random.default_rng(rng.integers(2**63)))
            line.update(env=env, act=agent.expert(env, rng) if agent.policy is None else None)
            lines.append(line)
    else:
        # the same draws in the same order as in-process: the same forks either way
        reseeds, rngs = [], []
        for _ in range(k):
            reseeds.append(int(rng.integers(2**63)))
            rngs.append(np.random.default_rng(rng.integers(2**63)))
        ex = states.executor
        outs = ex.restore([states.recipe] * k, [states.refs[t]] * k, reseeds=reseeds)
        bad = next((o for o in outs if o.error is not None), None)
        if bad is not None:
            ex.close([o.session for o in outs if o.error is None])
            _executor_ok(bad, f"restoring step {t}")
        for out, r in zip(outs, rngs, strict=True):
            lines.append({**_fork_line(ctx, out.info, prefix, r), "session": out.session})
    try:
        steps, tokens = _play_forks(lines, t, agent, max_steps, rng, states)
    finally:
        if states is not None:
            states.executor.close([ln["session"] for ln in lines if not ln["done"]])
    paths = [ln["path"] for ln in lines]
    return sum(1 for ln in lines if ln["ok"]), steps, tokens, paths


def _fork_line(
    ctx: Context, info: dict[str, Any], prefix: float, rng: np.random.Generator
) -> dict[str, Any]:
    """One fork's running record from ``ctx`` (its env or session is added by the caller)."""
    return {"ctx": ctx, "info": dict(info), "total": prefix, "done": False, "ok": False,
            "rng": rng, "path": [], "act": None}  # fmt: skip


def _play_forks(
    lines: list[dict[str, Any]],
    t: int,
    agent: Any,
    max_steps: int,
    rng: np.random.Generator,
    states: ExecutorStates | None,
) -> tuple[int, int]:
    """Play every fork to its end, in lockstep; env steps and generated tokens."""
    steps = tokens = 0
    for step in range(t, max_steps):
        live = [ln for ln in lines if not ln["done"]]
        if not live:
            break
        if agent.policy is not None:
            reqs = [ActRequest(ln["ctx"], 1, rngs=(ln["rng"],)) for ln in live]
            samples = [s[0] for s in agent.policy.act(reqs, rng)]
        else:
            samples = [None] * len(live)
        moves = []
        for ln, sample in zip(live, samples, strict=True):
            if sample is None:
                action = ln["act"](ln["ctx"].current_observation, ln["info"])
                text, ids, lps, ents = str(action), (), (), ()
            else:
                action, text = sample.action, sample.text
                ids = tuple(int(x) for x in sample.token_ids)
                lps, ents = sample.logprobs, sample.entropies
                tokens += len(ids)
            moves.append((action, text, ids, lps, ents))
        if states is None:
            results = [ln["env"].step(m[0]) for ln, m in zip(live, moves, strict=True)]
        else:
            outs = states.executor.step([ln["session"] for ln in live], [m[0] for m in moves])
            for ln, out in zip(live, outs, strict=True):
                if out.error is not None:
                    ln["done"] = True  # its session is gone
            bad = next((o for o in outs if o.error is not None), None)
            if bad is not None:
                _executor_ok(bad, f"playing a fork at step {step}")
            results = [(o.observation, o.reward, o.terminated, o.truncated, o.info) for o in outs]
        ended = []
        for ln, (action, text, ids, lps, ents), (obs, reward, term, trunc, info) in zip(
            live, moves, results, strict=True
        ):
            steps += 1
            ln["total"] += float(reward)
            ln["info"] = dict(info)
            ln["ctx"] = ln["ctx"].extend(Turn(text, ids, action, obs, dict(info)))
            cut = bool(trunc) or step + 1 >= max_steps
            ln["path"].append({
                "action": action, "text": text, "token_ids": ids, "logprobs": lps,
                "entropies": ents, "observation": obs,
                "reward": float(reward), "terminated": bool(term),
                "truncated": cut and not term, "info": dict(info),
            })  # fmt: skip
            if term or cut:
                ln["done"] = True
                ln["ok"] = _succeeded(info, ln["total"])
                ended.append(ln)
        if states is not None and ended:
            states.executor.close([ln["session"] for ln in ended])
    return steps, tokens


def attribute_episode(
    tree: RolloutTree,
    agent: Any,
    make_env: Callable[[], Any],
    *,
    options: dict[str, Any] | None = None,
    max_steps: int,
    forks: int = 8,
    mode: str = "bisect",
    seed: int = 0,
    confidence: float = 0.95,
    alpha: float = 0.05,
    task: str = "",
    attempt: int = 0,
    executor: Any = None,
    recipe: Any = None,
) -> Attribution:
    """Measure V along one recorded episode and name its decisive step (module notes).

    Args:
        tree: The episode (one rollout), as ``branchgym eval`` saved it.
        agent: A resolved :class:`~branchgym.evaluation.agents.Agent` (policy or expert).
        make_env: Builds an env configured as the episode's.
        options: The episode's reset options.
        max_steps: The protocol's step cap (forks stop there too).
        forks: K forks per state.
        mode: ``bisect`` or ``all``.
        seed: Seeds the forks.
        confidence: Level of each V interval.
        alpha: Level of the test that names a decisive step.
        task: The task id (for the report).
        attempt: The attempt (for the report).
        executor: Run the forks' envs through this executor
            (:mod:`branchgym.rollout.executors`: threads, processes, Ray, the fleet)
            instead of in-process (None); the episode is replayed there once and its
            snapshots stay there. A policy agent only: a scripted expert reads its env.
        recipe: The env's :class:`~branchgym.rollout.executor_base.EnvRecipe` (with
            ``executor``).
    """
    if mode not in ("bisect", "all"):
        raise OptionError(f"mode must be 'bisect' or 'all', got {mode!r}")
    if forks < 2:
        raise OptionError(f"forks must be at least 2 (K forks estimate V), got {forks}")
    if executor is not None and (agent.policy is None or recipe is None):
        raise OptionError(
            "forks run through an executor only for policy agents with the env's recipe: a "
            "scripted expert reads its live env, so attribute expert runs in-process"
        )
    ep = Episode(tree, make_env, options)
    states = None
    if executor is not None:
        try:
            states = ExecutorStates(ep, executor, recipe)
        except BaseException:
            ep.close()
            raise
    # each episode's forks draw their own streams: estimates of different episodes are
    # independent, and one episode's are the same whatever else is attributed
    rng = np.random.default_rng([seed, zlib.crc32(task.encode()), attempt, 0xA77])
    envs: list[Any] = []
    try:
        T = len(ep.nodes)
        success = bool(T) and _succeeded(ep.nodes[-1].info or {}, sum(ep.rewards))
        measured: dict[int, StepValue] = {T: StepValue(T, int(success), 0, float(success),
                                                       float(success))}  # fmt: skip
        fork_paths: dict[int, list[list[dict[str, Any]]]] = {}

        def _fresh(t: int) -> StepValue:
            s, steps_, toks, _ = forks_from(ep, t, forks, agent, make_env, envs, max_steps, rng,
                                            states)  # fmt: skip
            lo_, hi_ = _interval(s, forks, confidence)
            return StepValue(t, s, forks, lo_, hi_, steps_, toks)

        def value(t: int) -> StepValue:
            if t not in measured:
                s, steps, toks, paths = forks_from(ep, t, forks, agent, make_env, envs,
                                                   max_steps, rng, states)  # fmt: skip
                fork_paths[t] = paths
                lo, hi = _interval(s, forks, confidence)
                measured[t] = StepValue(t, s, forks, lo, hi, steps, toks)
            return measured[t]

        if T == 0:
            steps_to_fork: list[int] = []
        elif mode == "all":
            steps_to_fork = list(range(T))
        elif success:
            steps_to_fork = [0]  # V at the start, for the report; nothing to bisect
        else:
            steps_to_fork = []
            lo, hi = 0, T
            value(lo)
            while hi - lo > 1 and _drop_p(measured[lo], measured[hi]) < alpha:
                mid = (lo + hi) // 2
                v_mid = value(mid)
                left = measured[lo].value - v_mid.value
                right = v_mid.value - measured[hi].value
                lo, hi = (lo, mid) if left >= right else (mid, hi)
        for t in steps_to_fork:
            value(t)

        def candidate() -> tuple[int, float, float] | None:
            best = None
            for a in sorted(measured):
                if a + 1 not in measured or success:  # a won episode was not lost anywhere
                    continue
                p = _drop_p(measured[a], measured[a + 1])
                d = measured[a].value - measured[a + 1].value
                if p < alpha and (best is None or d > best[1]):
                    best = (a, d, p)
            return best

        found = candidate()
        if found is None and mode == "bisect" and T and not success:
            for t in range(T):  # bisection followed noise: measure every step after all
                value(t)
            found = candidate()
        decisive = drop = p_best = p_rep = None
        replicated: list[StepValue] = []
        if found is not None:
            # confirm with fresh forks at both ends: a drop seen once among T adjacent pairs
            # may be noise; an independent replication must show it too
            a = found[0]
            rep = [_fresh(a)] + ([_fresh(a + 1)] if a + 1 < T else [measured[a + 1]])
            replicated = [v for v in rep if v.forks]
            p_rep = _drop_p(rep[0], rep[1])
            if p_rep < alpha:
                measured[a] = _pool(measured[a], rep[0], confidence)
                if rep[1].forks:
                    measured[a + 1] = _pool(measured[a + 1], rep[1], confidence)
                decisive, p_best = a, found[2]
                drop = measured[a].value - measured[a + 1].value
        steps = sorted(measured)
        values = [measured[t] for t in steps]
        cost = {  # pooled values include the replication's forks
            "forks": sum(v.forks for v in values),
            "env_steps": sum(v.env_steps for v in values),
            "tokens": sum(v.tokens for v in values),
        }
        if decisive is None:  # a replication that failed still cost its forks
            for v in replicated:
                cost["forks"] += v.forks
                cost["env_steps"] += v.env_steps
                cost["tokens"] += v.tokens
        if mode == "all":
            naive = {"forks": cost["forks"], "env_steps": cost["env_steps"],
                     "tokens": cost["tokens"], "measured": True}  # fmt: skip
        else:  # each fork from s_t runs about as long as the forks measured from there
            per = [(v.step, v.env_steps / v.forks) for v in values if v.forks]
            est = 0.0
            for t in range(T):
                near = min(per, key=lambda p: abs(p[0] - t))[1] if per else T - t
                est += forks * near
            naive = {"forks": forks * T, "env_steps": round(est), "measured": False}
        action = None
        if decisive is not None:
            node = ep.nodes[decisive]
            action = {"action": str(node.action), "kind": action_kind(tree.env_id, node.action)}
            a, b = measured[decisive], measured[decisive + 1]
            statement = (
                f"lost at step {decisive} ({action['kind']}: {str(node.action)[:60]}): V falls "
                f"from {a.value:.2f} [{a.low:.2f}, {a.high:.2f}] to {b.value:.2f}"
                + (f" [{b.low:.2f}, {b.high:.2f}]" if b.forks else " (the outcome)")
                + f", one-sided Fisher p = {p_best:.2g}, replicated with fresh forks "
                f"(p = {p_rep:.2g})"
            )
        elif found is not None:
            statement = (
                f"no decisive step: the drop after step {found[0]} (p = {found[2]:.2g}) did "
                f"not replicate with fresh forks (p = {p_rep:.2g})"
            )
        else:
            statement = (
                "no decisive step: no drop of V between adjacent measured states is "
                f"significant at {alpha:g}"
                + (" (the episode succeeded)" if success else "")
            )
        res = Attribution(task, attempt, success, T, values, decisive, drop, p_best, action,
                          statement, cost, naive)  # fmt: skip
        res.tree = _fork_tree(ep, measured, fork_paths, res)
        return res
    finally:
        for env in envs:
            env.close()
        if states is not None:
            states.close()
        ep.close()



def _fork_tree(
    ep: Episode,
    measured: dict[int, StepValue],
    fork_paths: dict[int, list[list[dict[str, Any]]]],
    res: Attribution,
) -> RolloutTree:
    """The episode as the backbone, each state's forks as branches from it.

    The backbone's action at step ``t`` carries ``V(s_{t+1}) - V(s_t)`` as its advantage
    (its effect on the chance of success), where both ends were measured, so
    ``branchgym view`` colours the decisive action; ``meta`` holds the value curve.
    """
    from branchgym.rollout.tree import ROOT

    tree = RolloutTree(ep.tree.env_id, ep.tree.seed, ep.tree.observation, ep.infos[0])
    backbone = tree.add_path(ROOT, [
        {"action": n.action, "text": n.text, "token_ids": n.token_ids, "logprobs": n.logprobs,
         "entropies": n.entropies, "observation": n.observation, "reward": n.reward,
         "terminated": n.terminated, "truncated": n.truncated, "info": dict(n.info or {}),
         "sibling": 1 if i in fork_paths else 0}
        for i, n in enumerate(ep.nodes)
    ])  # fmt: skip
    rollout = 1
    for t, paths in sorted(fork_paths.items()):
        parent = ROOT if t == 0 else backbone[t - 1].id
        for j, path in enumerate(paths):
            if not path:
                continue
            nodes = tree.add_path(parent, [{**d, "rollout": rollout} for d in path])
            nodes[0].sibling = j + 2
            rollout += 1
    adv = {
        backbone[t].id: measured[t + 1].value - measured[t].value
        for t in range(len(backbone))
        if t in measured and t + 1 in measured
    }
    tree.meta["advantages"] = adv
    tree.meta["attribution"] = {
        "values": [[v.step, v.value, v.low, v.high, v.forks] for v in sorted(
            measured.values(), key=lambda v: v.step)],
        "decisive": res.decisive,
        "statement": res.statement,
    }  # fmt: skip
    return tree
