"""Training machinery every learner shares: set-up, log-probs with gradients, updates, logs.

A learner file (``grpo.py``, ``bpo.py``, ``bellman_po.py``, ``branch_opd.py``, ``sft.py``)
is an ``Args`` dataclass and a loop that reads like its paper; what is the same for all
of them lives here, once:

* :class:`TrainArgs`: the options every learner has (env, model, policy, optimiser,
  schedule, batch, checkpoints), each with a docstring; learners subclass it.
* :data:`POLICIES`: how the model acts and how the log-probs of what it did are
  recomputed with gradients: ``generate`` (free generation through
  :class:`~branchgym.agents.policy.LLMPolicy`) or ``scoring`` (a softmax over the
  admissible actions, :class:`~branchgym.agents.scoring.ScoringPolicy`).
* :class:`Batch`: rollout trees turned into token rows. A row is the part of one
  root-to-leaf path that this path owns (every node is owned by exactly one path, so a
  shared prefix is counted once, spec eq. 6); for independent rollouts a row is a whole
  trajectory.
* :class:`Run`: model, engine, optimiser, scheduler, reference model, metrics (JSONL,
  namespaced keys), evaluation, checkpoints in safetensors with exact resume, and the
  training loop's progress bar.

The math is not here: losses and advantages come from :mod:`branchgym.agents.losses`.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import difflib
import inspect
import json
import math
import textwrap
import time
import types
import typing
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from branchgym.agents.policy import Context, LLMPolicy, Turn

from branchgym.error import CheckpointError, DependencyMissingError, TrainingConfigError
from branchgym.executors import EnvSpec, Executor, make_executor
from branchgym.rollout import group_rollouts
from branchgym.tree import RolloutTree

try:
    import torch
    from torch import Tensor
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra("branchgym.agents.training", "llm", "torch") from exc

__all__ = [
    "LR_SCHEDULES",
    "POLICIES",
    "SUCCESS_KEYS",
    "WEIGHTS",
    "Batch",
    "Chunk",
    "Decision",
    "EvalResult",
    "Pack",
    "PolicyKind",
    "Row",
    "Run",
    "RunningStats",
    "TrainArgs",
    "TrainResult",
    "advantage_metrics",
    "args_from_dict",
    "evaluate",
    "field_docs",
    "load_checkpoint_state",
    "path_decisions",
    "ratio_spread",
    "rollout_metrics",
    "success_of",
]

CHECKPOINT_VERSION = 1

# ============================================================================ Args


@dataclasses.dataclass
class TrainArgs:
    """Options every learner shares. Learners subclass this with their own fields."""

    env_id: str = "branchgym/TextTreeMDP-v0"
    """Environment id. The sources train on WebShop, ALFWorld and SWE-bench; TextTreeMDP
    (a maze with exact values) is the CI-sized task."""
    env_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of ``gym.make`` (e.g. ``{"depth": 3, "reward_kind": "bernoulli"}``)."""
    model: str = "tiny"
    """``tiny`` (random Qwen2, offline), ``smollm2`` (SmolLM2-135M-Instruct) or a model
    folder (``save_pretrained``; an SFT checkpoint)."""
    policy: str = "auto"
    """``generate`` (free generation, parsed ReAct replies), ``scoring`` (softmax over the
    admissible actions' sequence log-probs, for tiny models) or ``auto`` (scoring for the
    ``tiny`` model, generate otherwise)."""
    seed: int = 0
    """Seed of prompts, sampling and the schedule; each step's randomness derives from
    ``(seed, step)``, which makes resuming exact."""
    steps: int = 100
    """Rollout batches (each followed by ``updates_per_batch`` optimizer updates)."""
    prompts_per_step: int = 128
    """Prompts (task instances, reset seeds) per rollout batch (128 in the BPO source)."""
    lr: float = 2e-6
    """AdamW learning rate (BPO source: 2e-6; Bellman PO: 1e-6)."""
    lr_schedule: str = "cosine"
    """A key of :data:`LR_SCHEDULES`: ``cosine`` (BPO source), ``constant`` (Bellman PO),
    ``linear``."""
    warmup_steps: int = 0
    """Linear warm-up steps before the schedule."""
    weight_decay: float = 0.01
    """AdamW weight decay (torch's default; Bellman PO's source: 0.1)."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas (Bellman PO's source: (0.9, 0.98))."""
    grad_clip: float = 1.0
    """Clip the gradient's global norm to this (0: no clipping; Bellman PO: 1.0)."""
    updates_per_batch: int = 1
    """Optimizer updates per rollout batch: the rows are split into this many mini-batches
    (whole groups each), cycled when there are fewer groups than updates."""
    micro_batch_rows: int = 0
    """Rows per forward/backward pass inside an update (gradient accumulation; 0: all)."""
    max_new_tokens: int = 48
    """Tokens per generated action (``generate`` policy)."""
    scoring_template: str = "Action: {action}"
    """How the ``scoring`` policy writes an admissible action as a reply."""
    max_episode_steps: int | None = None
    """Truncate rollouts after this many decisions (default: the env's time limit, else 100)."""
    success_threshold: float = 1.0
    """A rollout succeeds when its env says so (``won``/``success``/``resolved`` in info), else
    when its return reaches this (WebShop's and SWE-bench's success is reward 1)."""
    eval_episodes: int = 0
    """Episodes of the fixed evaluation set, run before training, every ``eval_every``
    steps and at the end (0: no evaluation)."""
    eval_every: int = 0
    """Evaluate every this many steps (0: only at the start and the end)."""
    eval_seed: int = 1_000_000
    """First reset seed of the evaluation set (episode i uses eval_seed + i; the policy's
    sampling is seeded the same way, so evaluations are paired)."""
    out_dir: str | None = None
    """Where metrics.jsonl, checkpoints and curves.png go (default: runs/<algo>-<env>-<seed>)."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (0: only at the end)."""
    resume: str | None = None
    """A checkpoint folder to resume from, exactly (weights, optimizer, scheduler, step)."""
    overwrite: bool = False
    """Start a new run in an ``out_dir`` that already holds one (its metrics are replaced)."""
    device: str = "auto"
    """``auto`` (CUDA when present), ``cpu`` or ``cuda``."""
    precision: str = "auto"
    """``auto``: float32 weights, bfloat16 autocast on CUDA; ``fp32``: float32 everywhere."""
    threads: int | None = None
    """torch CPU threads (one is fastest for tiny models on a shared CPU)."""
    executor: str = "inprocess"
    """Where sandboxes run: ``inprocess``, ``thread``, ``process`` or ``ray``."""
    progress: bool = True
    """Show a tqdm progress bar."""

    def check(self) -> None:
        """Raise :class:`TrainingConfigError` for an option out of range (subclasses extend)."""
        positive = ("steps", "prompts_per_step", "updates_per_batch", "max_new_tokens")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TrainingConfigError(f"{name} must be an integer >= 1; got {value!r}.")
        for name in ("micro_batch_rows", "warmup_steps", "eval_episodes", "eval_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TrainingConfigError(f"{name} must be an integer >= 0; got {value!r}.")
        require(self.lr > 0, f"lr must be > 0; got {self.lr}.")
        require(self.weight_decay >= 0, f"weight_decay must be >= 0; got {self.weight_decay}.")
        require(self.grad_clip >= 0, f"grad_clip must be >= 0 (0: off); got {self.grad_clip}.")
        require(
            len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas),
            f"adam_betas must be two numbers in [0, 1); got {self.adam_betas}.",
        )
        require_one_of("policy", self.policy, ("auto", *POLICIES))
        require_one_of("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        require_one_of("device", self.device, ("auto", "cpu", "cuda"))
        require_one_of("precision", self.precision, ("auto", "fp32"))
        if not isinstance(self.env_kwargs, dict):
            raise TrainingConfigError(
                f"env_kwargs must be a dict of gym.make keywords; got {self.env_kwargs!r}."
            )


def require(ok: bool, message: str) -> None:
    """Raise :class:`TrainingConfigError` with ``message`` unless ``ok`` (argument checks)."""
    if not ok:
        raise TrainingConfigError(message)


def require_one_of(name: str, value: Any, options: Any) -> None:
    """Raise :class:`TrainingConfigError` unless ``value`` is in ``options`` (names the closest)."""
    if value not in options:
        close = difflib.get_close_matches(str(value), [str(o) for o in options], n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise TrainingConfigError(
            f"{name} must be one of {', '.join(map(str, options))}; got {value!r}.{hint}"
        )


# Former private names, kept for code that imported them before they were made public.
_require = require
_choice = require_one_of


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each dataclass field (CleanRL style), through the class's bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # pragma: no cover - classes built at run time
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, nxt in zip(body, [*body[1:], None], strict=True):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _coerce(value: Any, hint: Any, name: str) -> Any:
    """Convert a CLI string (or a JSON value) to the field's type."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        non_none = [a for a in args if a is not type(None)]
        return _coerce(value, non_none[0], name)
    if not isinstance(value, str):
        if origin is tuple and isinstance(value, list):
            return tuple(value)
        return value
    try:
        if hint is bool:
            low = value.lower()
            if low not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return low in ("true", "1", "yes")
        if hint in (int, float, str):
            return hint(value)
        if origin in (dict, tuple, list):
            parsed = json.loads(value) if value.strip()[:1] in "[{" else value.split(",")
            if origin is tuple:
                inner = [a for a in args if a is not Ellipsis] or [str]
                return tuple(
                    _coerce(v, inner[min(i, len(inner) - 1)], name) for i, v in enumerate(parsed)
                )
            return parsed
    except (ValueError, json.JSONDecodeError) as exc:
        raise TrainingConfigError(
            f"option {name}: cannot read {value!r} as {getattr(hint, '__name__', hint)}."
        ) from exc
    return value


def args_from_dict(cls: type, values: dict[str, Any]) -> Any:
    """Build ``cls`` (an Args dataclass) from a dict, converting strings to the field types.

    Unknown names raise :class:`TrainingConfigError` with the closest option; the result
    has been :meth:`TrainArgs.check`-ed.
    """
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in names:
            close = difflib.get_close_matches(name, names, n=2)
            hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise TrainingConfigError(
                f"{cls.__module__.rsplit('.', 1)[-1]} has no option {key!r}.{hint} "
                "`branchgym train --algo ALGO --options` lists them."
            )
        kwargs[name] = _coerce(value, hints[name], name)
    try:
        args = cls(**kwargs)
    except TypeError as exc:  # pragma: no cover - guarded by the name check above
        raise TrainingConfigError(str(exc)) from exc
    args.check()
    return args


# ================================================================ LR schedules


def _constant(step: int, total: int) -> float:
    return 1.0


def _cosine(step: int, total: int) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * min(step, total) / max(total, 1)))


def _linear(step: int, total: int) -> float:
    return max(0.0, 1.0 - step / max(total, 1))


#: name -> multiplier of the learning rate after warm-up, ``f(step, total_steps)``.
LR_SCHEDULES: dict[str, Callable[[int, int], float]] = {
    "constant": _constant,
    "cosine": _cosine,
    "linear": _linear,
}


# ================================================================ batch of trees


@dataclasses.dataclass
class Decision:
    """One decision (tree node) whose tokens the loss counts.

    Attributes:
        tree: Index of its tree in the batch.
        node: Node id in that tree.
        context: The dialogue before the action.
        token_ids: The action's tokens (a copied prefix included).
        old_logp: Behaviour log-prob of each token (``pi_old`` / ``mu``).
        mask: 1 for tokens the loss counts (owned by this row, not a copied prefix).
        advantage: The decision's advantage, broadcast to its tokens.
        ref_logp: Reference policy's log-probs (filled when a KL term needs them).
        teacher_logp: Frozen teacher's log-probs (OPD).
    """

    tree: int
    node: int
    context: Context
    token_ids: np.ndarray
    old_logp: np.ndarray
    mask: np.ndarray
    advantage: float = 0.0
    ref_logp: np.ndarray | None = None
    teacher_logp: np.ndarray | None = None

    @property
    def n_tokens(self) -> int:
        """Tokens of the action."""
        return int(self.token_ids.size)


@dataclasses.dataclass
class Row:
    """The decisions one root-to-leaf path owns, in order (consecutive steps).

    Attributes:
        tree: Index of the tree.
        leaf: The path's leaf node.
        group: The prompt the tree belongs to (group of GRPO/Bellman PO).
        decisions: Owned decisions with tokens.
        reward: The path's return.
        success: Whether the rollout succeeded.
        cache: Per-policy-kind scratch (the row's token sequence for ``generate``).
    """

    tree: int
    leaf: int
    group: int
    decisions: list[Decision]
    reward: float
    success: bool
    cache: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        """Tokens of the row."""
        return sum(d.n_tokens for d in self.decisions)


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


def path_decisions(
    tree: RolloutTree, path: Sequence[int], index: int, masks: Sequence[np.ndarray] | None = None
) -> list[Decision]:
    """A :class:`Decision` per node of ``path`` with its context (mask: all generated tokens)."""
    ctx = Context(tree.env_id, tree.observation, tree.info)
    out = []
    for j, nid in enumerate(path):
        n = tree[nid]
        if masks is None:
            mask = np.zeros(n.n_tokens, dtype=np.float32)
            mask[n.prefix_len :] = 1.0
        else:
            mask = np.asarray(masks[j], dtype=np.float32)
        out.append(Decision(index, nid, ctx, n.token_ids, n.logprobs, mask))
        ctx = ctx.extend(
            Turn(n.text, tuple(int(t) for t in n.token_ids), n.action, n.observation, n.info)
        )
    return out


class Batch:
    """Rollout trees as rows of token decisions (each generated token counted once).

    Args:
        trees: The trees of one rollout batch.
        groups: The prompt (group) of each tree (default: one group per tree).
        success_threshold: See :func:`success_of`.
        keep: ``keep(tree, node) -> bool``: which decisions the loss sees (default all);
            the others stay in the dialogue as context.
    """

    def __init__(
        self,
        trees: Sequence[RolloutTree],
        groups: Sequence[int] | None = None,
        *,
        success_threshold: float = 1.0,
        keep: Callable[[RolloutTree, int], bool] | None = None,
    ) -> None:
        """Split every tree into the rows its paths own."""
        self.trees = list(trees)
        self.groups = list(groups) if groups is not None else list(range(len(self.trees)))
        self.rows: list[Row] = []
        for ti, tree in enumerate(self.trees):
            for path, masks in tree.token_masks():
                decisions = [
                    d
                    for d in path_decisions(tree, path, ti, masks)
                    if d.n_tokens
                    and float(d.mask.sum()) > 0
                    and (keep is None or keep(tree, d.node))
                ]
                self.rows.append(
                    Row(
                        ti,
                        path[-1],
                        self.groups[ti],
                        decisions,
                        float(tree.path_returns_to_go(path)[0]) if path else 0.0,
                        success_of(tree, path, success_threshold),
                    )
                )

    def decisions(self, rows: Sequence[int] | None = None) -> Iterator[Decision]:
        """Every decision of the given rows (all rows by default)."""
        for r in range(len(self.rows)) if rows is None else rows:
            yield from self.rows[r].decisions

    def group_rows(self) -> dict[int, list[int]]:
        """Rows of each group, in order."""
        out: dict[int, list[int]] = {}
        for i, row in enumerate(self.rows):
            out.setdefault(row.group, []).append(i)
        return out

    def set_advantages(self, fn: Callable[[Row, Decision], float]) -> None:
        """Set each decision's advantage to ``fn(row, decision)``."""
        for row in self.rows:
            for d in row.decisions:
                d.advantage = float(fn(row, d))

    def pad(
        self, rows: Sequence[int], values: Callable[[Decision], Any], fill: float = 0.0
    ) -> Tensor:
        """A ``(len(rows), T)`` float tensor of per-token ``values(decision)``, padded."""
        width = max([self.rows[r].n_tokens for r in rows] + [1])
        out = np.full((len(rows), width), fill, dtype=np.float32)
        for i, r in enumerate(rows):
            pos = 0
            for d in self.rows[r].decisions:
                v = values(d)
                out[i, pos : pos + d.n_tokens] = v
                pos += d.n_tokens
        return torch.from_numpy(out)

    def chunk(
        self,
        rows: Sequence[int],
        logp: Sequence[Sequence[Tensor]],
        device: torch.device | str = "cpu",
    ) -> Chunk:
        """Padded tensors of ``rows`` with the current log-probs ``logp`` (per row, per decision).

        The current log-probs keep their gradient; everything else is data.
        """
        rows = list(rows)
        width = max([self.rows[r].n_tokens for r in rows] + [1])
        padded = []
        for per in logp:
            parts = [t.float() for t in per]
            flat = torch.cat(parts) if parts else torch.zeros(0, device=device)
            padded.append(torch.nn.functional.pad(flat, (0, width - flat.numel())))

        def optional(field: str) -> Tensor | None:
            if all(getattr(d, field) is not None for d in self.decisions(rows)):
                return self.pad(rows, lambda d: getattr(d, field)).to(device)
            return None

        return Chunk(
            rows=rows,
            logp=torch.stack(padded) if padded else torch.zeros(0, width, device=device),
            old_logp=self.pad(rows, lambda d: d.old_logp).to(device),
            mask=self.pad(rows, lambda d: d.mask).to(device),
            advantages=self.pad(rows, lambda d: d.advantage).to(device),
            ref_logp=optional("ref_logp"),
            teacher_logp=optional("teacher_logp"),
            rewards=torch.tensor([self.rows[r].reward for r in rows], device=device),
            groups=torch.tensor([self.rows[r].group for r in rows], device=device),
        )

    def minibatches(self, n: int) -> list[list[int]]:
        """``n`` lists of rows (whole groups each), cycled when there are fewer groups."""
        groups = list(self.group_rows().values())
        k = min(n, len(groups)) or 1
        split = [
            [r for g in groups[i::k] for r in g] for i in range(k)
        ]  # interleaved: each mini-batch sees prompts from across the batch
        return [split[i % k] for i in range(n)]


@dataclasses.dataclass
class Chunk:
    """The padded tensors of some rows, for one forward/backward pass.

    Attributes:
        rows: Row indices into the :class:`Batch`.
        logp: ``(R, T)`` current log-probs, with gradient.
        old_logp: Behaviour log-probs.
        mask: Counted tokens.
        advantages: Per-token advantages (each decision's, broadcast).
        ref_logp: Reference log-probs, when computed.
        teacher_logp: Teacher log-probs, when computed.
        rewards: ``(R,)`` each row's return.
        groups: ``(R,)`` each row's group.
        logits: Full next-token logits at requested positions (PBR), else None.
    """

    rows: list[int]
    logp: Tensor
    old_logp: Tensor
    mask: Tensor
    advantages: Tensor
    ref_logp: Tensor | None
    teacher_logp: Tensor | None
    rewards: Tensor
    groups: Tensor
    logits: Tensor | None = None


def advantage_metrics(
    values: Sequence[float] | np.ndarray, groups: Sequence[int] | np.ndarray
) -> dict[str, float]:
    """``advantages/*``: mean, std, max |A|, and the share of groups with max |A| > 0.1.

    ``values`` are per-decision (or per-token) advantages over counted decisions and
    ``groups`` the prompt of each; a group is non-degenerate when some advantage in it
    exceeds 0.1 in size (the BPO source's statistic: 71 % -> 94 % on SWE-bench).
    """
    v = np.asarray(values, dtype=np.float64)
    g = np.asarray(groups)
    if v.size == 0:
        return {
            "advantages/mean": 0.0,
            "advantages/std": 0.0,
            "advantages/max_abs": 0.0,
            "advantages/nondegenerate_frac": 0.0,
        }
    ids = np.unique(g)
    nondeg = [float(np.abs(v[g == i]).max() > 0.1) for i in ids]
    return {
        "advantages/mean": float(v.mean()),
        "advantages/std": float(v.std()),
        "advantages/max_abs": float(np.abs(v).max()),
        "advantages/nondegenerate_frac": float(np.mean(nondeg)),
    }


def rollout_metrics(batch: Batch) -> dict[str, float]:
    """``charts/*``, ``env/*``, ``tokens/*`` and ``branching/*`` of a rollout batch."""
    trees = batch.trees
    stats = [t.stats for t in trees]
    paths = [p for t in trees for p in t.paths()]
    rets = [r.reward for r in batch.rows]
    snaps = sum(s.snapshots_taken for s in stats)
    env_steps = sum(s.env_steps for s in stats)
    restores = sum(max(0, len(t.paths()) - 1) for t in trees if t.branch_points())
    nodes = [n for t in trees for n in t.nodes]
    gen_s = sum(s.generate_s for s in stats)
    rollout_s = gen_s + sum(s.env_s for s in stats)
    return {
        "charts/success": float(np.mean([r.success for r in batch.rows])) if batch.rows else 0.0,
        "charts/return": float(np.mean(rets)) if rets else 0.0,
        "charts/episode_length": float(np.mean([len(p) for p in paths])) if paths else 0.0,
        "charts/invalid_frac": float(np.mean([n.parse_error is not None for n in nodes]))
        if nodes
        else 0.0,
        "charts/rollouts": float(sum(s.rollouts for s in stats)),
        "env/steps": float(env_steps),
        "env/step_ms": 1000.0 * sum(s.env_s for s in stats) / max(env_steps, 1),
        "env/errors": float(sum(s.errors for s in stats)),
        "tokens/generated": float(sum(s.generated_tokens for s in stats)),
        "tokens/independent": float(sum(s.independent_tokens for s in stats)),
        "tokens/per_second": sum(s.generated_tokens for s in stats) / gen_s if gen_s else 0.0,
        "branching/snapshots": float(snaps),
        "branching/snapshot_ms": 1000.0 * sum(s.snapshot_s for s in stats) / max(snaps, 1),
        "branching/restore_ms": 1000.0 * sum(s.restore_s for s in stats) / max(restores, 1),
        "branching/overhead": sum(s.snapshot_s + s.restore_s for s in stats) / rollout_s
        if rollout_s
        else 0.0,
        "branching/peak_live": float(max([s.peak_live_snapshots for s in stats] + [0])),
        "branching/branch_points": float(sum(len(t.branch_points()) for t in trees)),
    }


# ================================================================ policy kinds


@dataclasses.dataclass
class Pack:
    """One sequence of a packed forward pass.

    Attributes:
        tokens: The row's dialogue, then any extra segments.
        segments: ``(start, end, attach)``: tokens ``[start, end)`` are a side branch that
            sees ``tokens[:attach]`` and itself (causally), placed at positions
            ``attach, attach + 1, ...``: how other candidates of a decision are scored
            without repeating the dialogue.
        targets: ``(predictor, token)``: score ``token`` under the distribution at index
            ``predictor``.
    """

    tokens: list[int]
    segments: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    targets: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def positions(self) -> list[int]:
        """Position id of every token (side branches continue their attach point)."""
        pos = list(range(len(self.tokens)))
        for start, end, attach in self.segments:
            pos[start:end] = range(attach, attach + end - start)
        return pos


def _packed_forward(
    model: Any,
    packs: Sequence[Pack],
    device: torch.device,
    *,
    logit_positions: Sequence[Sequence[int]] | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """Log-prob of every target of every pack, in one padded forward pass.

    Packs without side branches use the ordinary causal mask; otherwise each pack gets a
    4-D boolean mask (side branches see their attach prefix and themselves) and explicit
    position ids. Only hidden states that predict a target go through the output layer,
    so a large vocabulary costs ``(targets x V)``, not ``(positions x V)``.

    Returns:
        Per pack, a tensor of its targets' log-probs; and per pack the full next-token
        logits at ``logit_positions`` (PBR's constraints).
    """
    width = max(len(p.tokens) for p in packs)
    ids = torch.zeros(len(packs), width, dtype=torch.long)
    pos = torch.zeros(len(packs), width, dtype=torch.long)
    branched = any(p.segments for p in packs)
    if branched:
        att = torch.eye(width, dtype=torch.bool).repeat(len(packs), 1, 1)  # padding: self only
    else:
        att = torch.zeros(len(packs), width, dtype=torch.long)
    for i, p in enumerate(packs):
        n = len(p.tokens)
        ids[i, :n] = torch.as_tensor(p.tokens, dtype=torch.long)
        pos[i, :n] = torch.as_tensor(p.positions(), dtype=torch.long)
        if not branched:
            att[i, :n] = 1
            continue
        first = min([s for s, _, _ in p.segments] + [n])
        att[i, :first, :first] = torch.tril(torch.ones(first, first, dtype=torch.bool))
        for start, end, attach in p.segments:
            att[i, start:end, :attach] = True
            att[i, start:end, start:end] = torch.tril(
                torch.ones(end - start, end - start, dtype=torch.bool)
            )
    ids, pos, att = ids.to(device), pos.to(device), att.to(device)
    if branched:
        att = att[:, None]  # (B, 1, L, L)
    rows, cols, tgt = [], [], []
    for i, p in enumerate(packs):
        for predictor, token in p.targets:
            if predictor < 0:
                raise TrainingConfigError("a scored token needs at least one token of context")
            rows.append(i)
            cols.append(predictor)
            tgt.append(int(token))
    for i, where in enumerate(logit_positions or []):
        rows.extend([i] * len(where))
        cols.extend(where)
    r = torch.tensor(rows, dtype=torch.long, device=device)
    c = torch.tensor(cols, dtype=torch.long, device=device)
    base = getattr(model, "base_model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if base is not None and head is not None and base is not model:
        hidden = base(input_ids=ids, attention_mask=att, position_ids=pos).last_hidden_state
        logits = head(hidden[r, c])
    else:  # a model without a separate head: the full logits
        logits = model(input_ids=ids, attention_mask=att, position_ids=pos).logits[r, c]
    logits = logits.float()
    n = len(tgt)
    picked = torch.log_softmax(logits[:n], dim=-1).gather(
        -1, torch.tensor(tgt, dtype=torch.long, device=device)[:, None]
    )[:, 0]
    out, extra, at = [], [], 0
    for p in packs:
        out.append(picked[at : at + len(p.targets)])
        at += len(p.targets)
    at = n
    for where in logit_positions or []:
        extra.append(logits[at : at + len(where)])
        at += len(where)
    return out, extra


#: Padded tokens (rows x longest row) per forward pass of :func:`_bucketed_forward`.
FORWARD_TOKENS = 8_192


def length_buckets(lengths: Sequence[int], budget: int = FORWARD_TOKENS) -> list[list[int]]:
    """Indices of ``lengths`` in forward batches of at most ``budget`` padded tokens.

    Everything stays in one batch, in its order, when it fits. Otherwise rows are sorted
    by length and cut greedily, so short rows are not padded to the longest one: attention
    costs ``rows x width^2`` per batch, and one long WebShop dialogue in a batch of short
    ones would multiply the cost of all of them (a row longer than the budget goes alone).
    """
    if not lengths:
        return []
    if len(lengths) * max(lengths) <= budget:
        return [list(range(len(lengths)))]
    out: list[list[int]] = [[]]
    for i in sorted(range(len(lengths)), key=lambda j: lengths[j]):
        if out[-1] and (len(out[-1]) + 1) * lengths[i] > budget:
            out.append([])
        out[-1].append(i)
    return out


def _bucketed_forward(
    model: Any,
    packs: Sequence[Pack],
    device: torch.device,
    *,
    logit_positions: Sequence[Sequence[int]] | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """:func:`_packed_forward` over :func:`length_buckets`; results in the packs' order."""
    buckets = length_buckets([len(p.tokens) for p in packs], FORWARD_TOKENS)
    if len(buckets) == 1:
        return _packed_forward(model, packs, device, logit_positions=logit_positions)
    scores: dict[int, Tensor] = {}
    extra: dict[int, Tensor] = {}
    for b in buckets:
        where = [logit_positions[i] for i in b] if logit_positions is not None else None
        s, e = _packed_forward(model, [packs[i] for i in b], device, logit_positions=where)
        scores.update(zip(b, s, strict=True))
        extra.update(zip(b, e, strict=False))  # e is empty without logit positions
    return [scores[i] for i in range(len(packs))], [extra[i] for i in sorted(extra)]


class PolicyKind:
    """How a learner acts and recomputes log-probs; one instance per entry of :data:`POLICIES`."""

    name = ""

    def make(self, engine: Any, args: TrainArgs) -> Any:
        """The behaviour policy on ``engine``."""
        raise NotImplementedError

    @staticmethod
    def sequence(policy: Any, row: Row) -> tuple[list[int], list[tuple[int, int]]]:
        """The row's token sequence (prompt and dialogue) and each decision's span in it.

        The dialogue is the whole path up to the row's last decision, so the decisions of
        the row are scored in the context they were sampled in.
        """
        if "sequence" not in row.cache:
            last = row.decisions[-1]
            seq = policy.prompt_ids(last.context) + [int(t) for t in last.token_ids]
            spans = []
            for d in row.decisions:
                a = len(policy.prompt_ids(d.context))
                b = a + d.n_tokens
                if seq[a:b] != [int(t) for t in d.token_ids]:
                    raise TrainingConfigError(
                        "a decision's tokens are not where its prompt puts them; the tree was "
                        "grown with another prompt builder or policy."
                    )
                spans.append((a, b))
            row.cache["sequence"] = (seq, spans)
        return row.cache["sequence"]

    def packs(self, policy: Any, rows: Sequence[Row]) -> tuple[list[Pack], list[Any]]:
        """One :class:`Pack` per row, and what :meth:`unpack` needs to read it back."""
        raise NotImplementedError

    def unpack(self, scores: Tensor, plan: Any) -> list[Tensor]:
        """Per decision of the row, the log-prob of each of its tokens."""
        raise NotImplementedError

    def logprobs(
        self,
        policy: Any,
        model: Any,
        rows: Sequence[Row],
        device: torch.device,
        *,
        logit_positions: Sequence[Sequence[int]] | None = None,
    ) -> tuple[list[list[Tensor]], list[Tensor]]:
        """Per row, per decision, the log-prob of each token under ``model``.

        Gradients flow when called outside ``torch.no_grad``. ``logit_positions`` (row
        sequence positions) returns full logits there, for PBR.
        """
        live = [i for i, r in enumerate(rows) if r.decisions]
        out: list[list[Tensor]] = [[] for _ in rows]
        if not live:
            return out, [torch.zeros(0, device=device) for _ in logit_positions or []]
        pieces = [(i, sub) for i in live for sub in self.runs(policy, rows[i])]
        where = None
        if logit_positions is not None:
            where = []
            for i, _ in pieces:
                split = len(self.runs(policy, rows[i])) > 1
                if split and logit_positions[i]:
                    raise TrainingConfigError(
                        "logit positions refer to one sequence per row, but this row's "
                        "dialogue was shortened to fit the context; give it no positions."
                    )
                where.append([] if split else logit_positions[i])
        packs, plans = self.packs(policy, [sub for _, sub in pieces])
        scores, extra = _bucketed_forward(model, packs, device, logit_positions=where)
        row_extra: dict[int, Tensor] = {}
        for (i, _), s, plan, e in zip(
            pieces, scores, plans, extra or [None] * len(pieces), strict=True
        ):
            out[i].extend(self.unpack(s, plan))
            if e is not None:
                row_extra.setdefault(i, e)
        if logit_positions is None:
            return out, []
        return out, [row_extra[i] for i in live]

    @staticmethod
    def runs(policy: Any, row: Row) -> list[Row]:
        """The row as runs of decisions that each fit in one token sequence.

        A decision's prompt normally extends the previous one, so a whole path is one
        sequence. When a long dialogue outgrows the model's context, the prompt drops its
        oldest turns (:meth:`LLMPolicy.prompt_ids`) and stops extending; each run then
        gets its own sequence, so every decision is still scored in the exact context it
        was sampled in. Rows are split only here: advantages stay per path.
        """
        if "runs" not in row.cache:
            runs: list[list[Decision]] = []
            prev: list[int] | None = None
            for d in row.decisions:
                prompt = policy.prompt_ids(d.context)
                if runs and prev is not None and prompt[: len(prev)] == prev:
                    runs[-1].append(d)
                else:
                    runs.append([d])
                prev = prompt + [int(t) for t in d.token_ids]
            row.cache["runs"] = (
                [row]
                if len(runs) <= 1
                else [dataclasses.replace(row, decisions=r, cache={}) for r in runs]
            )
        return row.cache["runs"]


class GenerateKind(PolicyKind):
    """Free generation: each row's dialogue is one sequence; its decisions' tokens are scored."""

    name = "generate"

    def make(self, engine: Any, args: TrainArgs) -> Any:
        """An :class:`LLMPolicy` with the env's prompt builder."""
        return LLMPolicy(engine, max_new_tokens=args.max_new_tokens)

    def packs(self, policy: Any, rows: Sequence[Row]) -> tuple[list[Pack], list[Any]]:
        """The row sequence; a target per token of each decision."""
        packs, plans = [], []
        for row in rows:
            seq, spans = self.sequence(policy, row)
            targets = [(i - 1, seq[i]) for a, b in spans for i in range(a, b)]
            packs.append(Pack(list(seq), [], targets))
            plans.append([b - a for a, b in spans])
        return packs, plans

    def unpack(self, scores: Tensor, plan: Any) -> list[Tensor]:
        """Split the targets back into decisions."""
        return list(torch.split(scores, plan))


class ScoringKind(PolicyKind):
    """Scoring the admissible actions: ``log pi(a|s)`` = log-softmax of sequence log-probs.

    The chosen reply's tokens are already in the row's dialogue; every other candidate is
    a side branch attached where it leaves the chosen one, so a decision with C
    candidates costs its C - 1 suffixes, not C copies of the dialogue.
    """

    name = "scoring"

    def make(self, engine: Any, args: TrainArgs) -> Any:
        """A :class:`~branchgym.agents.scoring.ScoringPolicy`."""
        from branchgym.agents.scoring import ScoringPolicy

        return ScoringPolicy(engine, template=args.scoring_template)

    def packs(self, policy: Any, rows: Sequence[Row]) -> tuple[list[Pack], list[Any]]:
        """The row sequence plus one side branch per other candidate of each decision."""
        packs, plans = [], []
        for row in rows:
            seq, spans = self.sequence(policy, row)
            pack = Pack(list(seq))
            plan = []
            for d, (a, b) in zip(row.decisions, spans, strict=True):
                cands = policy.candidates(d.context)
                chosen = cands.index(d.token_ids)
                own = list(range(len(pack.targets), len(pack.targets) + (b - a)))
                pack.targets.extend((i - 1, seq[i]) for i in range(a, b))
                per_cand = []
                for ci, c in enumerate(cands.token_ids):
                    if ci == chosen:
                        per_cand.append((len(c), []))
                        continue
                    shared = 0
                    limit = min(len(c), d.n_tokens)
                    while shared < limit and c[shared] == d.token_ids[shared]:
                        shared += 1
                    if shared == len(c):
                        raise TrainingConfigError(
                            f"the reply {cands.texts[ci]!r} is a prefix of another; end every "
                            "candidate with the stop token."
                        )
                    idx = [len(pack.targets)]
                    pack.targets.append((a + shared - 1, c[shared]))  # where it leaves
                    start = len(pack.tokens)
                    tail = list(c[shared:-1])  # inputs that predict the rest of c
                    if tail:
                        pack.tokens.extend(tail)
                        pack.segments.append((start, start + len(tail), a + shared))
                        for j, token in enumerate(c[shared + 1 :]):
                            idx.append(len(pack.targets))
                            pack.targets.append((start + j, token))
                    per_cand.append((shared, idx))
                plan.append((own, per_cand, cands.token_ids, chosen))
            packs.append(pack)
            plans.append(plan)
        return packs, plans

    def unpack(self, scores: Tensor, plan: Any) -> list[Tensor]:
        """Sequence log-probs -> log-softmax over candidates -> per-token conditionals."""
        from branchgym.agents.scoring import trie_logprobs

        out = []
        for own, per_cand, cand_ids, chosen in plan:
            chosen_lp = scores[own]
            totals = []
            for ci, (shared, idx) in enumerate(per_cand):
                if ci == chosen:
                    totals.append(chosen_lp.sum())
                else:
                    totals.append(chosen_lp[:shared].sum() + scores[idx].sum())
            log_pi = torch.log_softmax(torch.stack(totals), dim=-1)
            out.append(trie_logprobs(log_pi, cand_ids, chosen))
        return out


def ratio_spread(c: Chunk, *, omega_eps: float | None = None) -> dict[str, float]:
    """How far the current policy has drifted from the behaviour policy on counted tokens.

    ``ratio/*`` describe the importance ratio ``pi/mu``; with ``omega_eps`` also Bellman
    PO's weight ``omega = (1 + eps - mu) / (1 + eps - pi)`` (spec section 3), whose spread
    stays bounded where the ratio's does not. Diagnostics only (no gradient).
    """
    with torch.no_grad():
        m = c.mask > 0
        if not bool(m.any()):
            return {}
        pi, mu = c.logp.detach()[m].exp(), c.old_logp[m].exp()
        ratio = pi / mu
        out = {
            "ratio/absdev": float((ratio - 1).abs().mean()),
            "ratio/std": float(ratio.std()) if ratio.numel() > 1 else 0.0,
            "ratio/max": float(ratio.max()),
        }
        if omega_eps is not None:
            from branchgym.agents.losses import bellman_po_weights

            omega = bellman_po_weights(mu, pi, eps=omega_eps)
            out.update(
                {
                    "omega/absdev": float((omega - 1).abs().mean()),
                    "omega/std": float(omega.std()) if omega.numel() > 1 else 0.0,
                    "omega/max": float(omega.max()),
                }
            )
        return out


#: policy name -> how it acts and how its log-probs are recomputed.
POLICIES: dict[str, PolicyKind] = {"generate": GenerateKind(), "scoring": ScoringKind()}


# ================================================================ running stats


@dataclasses.dataclass
class RunningStats:
    """Welford's running mean and variance (of the gradient norm, across updates)."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        """Add one value."""
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (x - self.mean)

    @property
    def var(self) -> float:
        """Sample variance (0 before two values)."""
        return self.m2 / (self.n - 1) if self.n > 1 else 0.0


# ================================================================ evaluation


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
    spec: EnvSpec,
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
    (:func:`branchgym.agents.evaluation.exact_value`).
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
    if exact:
        from branchgym.agents.evaluation import exact_value, supports_exact

        if supports_exact(spec, policy):
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


# ================================================================ checkpoints


def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Split an optimizer's state dict into tensors (safetensors) and JSON."""
    sd = opt.state_dict()
    tensors: dict[str, Tensor] = {}
    plain: dict[str, dict[str, Any]] = {}
    for pid, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, Tensor):
                tensors[f"state.{pid}.{key}"] = value.detach().contiguous().cpu()
            else:
                plain.setdefault(str(pid), {})[key] = value
    return tensors, {"param_groups": sd["param_groups"], "plain": plain}


def _optimizer_state(tensors: dict[str, Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        _, pid, key = name.split(".", 2)
        state.setdefault(int(pid), {})[key] = value
    for pid, values in meta.get("plain", {}).items():
        state.setdefault(int(pid), {}).update(values)
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    return {"state": state, "param_groups": groups}


def load_checkpoint_state(folder: str | Path) -> dict[str, Any]:
    """The ``trainer_state.json`` of a checkpoint (a :class:`CheckpointError` if absent)."""
    path = Path(folder) / "trainer_state.json"
    if not path.is_file():
        raise CheckpointError(
            f"{folder} is not a training checkpoint (no trainer_state.json); give a "
            "checkpoint-NNNNNN folder written by branchgym train."
        )
    try:
        state = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is damaged ({exc}); use another checkpoint.") from exc
    if state.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint version {state.get('version')}, this branchgym reads "
            f"{CHECKPOINT_VERSION}."
        )
    return state


# ================================================================ the run


@dataclasses.dataclass
class TrainResult:
    """What a training run produced.

    Attributes:
        out_dir: The run folder.
        checkpoint: The last checkpoint written.
        history: Every logged metrics line.
        eval_start: Evaluation before training (None when ``eval_episodes == 0``).
        eval_end: Evaluation after training.
    """

    out_dir: Path
    checkpoint: Path | None
    history: list[dict[str, float]]
    eval_start: EvalResult | None = None
    eval_end: EvalResult | None = None


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No transformers progress bars while loading and saving (the run has its own)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


class _Autocast:
    """A policy wrapper that samples under the run's autocast context (bf16 on CUDA)."""

    def __init__(self, policy: Any, ctx: Callable[[], Any]) -> None:
        self.policy, self.ctx = policy, ctx

    def act(self, requests: Any, rng: np.random.Generator) -> Any:
        with self.ctx():
            return self.policy.act(requests, rng)


class Run:
    """One training run: everything a learner's loop needs, set up from its Args.

    Args:
        args: The learner's Args (already checked).
        algo: The learner's name (``bpo``, ``grpo``, ...), recorded in checkpoints.
        needs_ref: Keep a frozen copy of the initial model as ``pi_ref`` (KL term).
    """

    def __init__(self, args: TrainArgs, algo: str, *, needs_ref: bool = False) -> None:
        """Load the model (or the checkpoint), build engine, optimizer, scheduler and logs."""
        from branchgym.agents.engines.hf import HFEngine
        from branchgym.agents.models import load_model

        args.check()
        self.algo = algo
        self.args = args
        resume = load_checkpoint_state(args.resume) if args.resume else None
        if resume is not None and resume.get("algo") != algo:
            raise CheckpointError(
                f"{args.resume} is a {resume.get('algo')!r} checkpoint; resume it with "
                f"--algo {resume.get('algo')} (or start {algo} from its weights with --model)."
            )
        if args.device == "cuda" and not torch.cuda.is_available():
            raise TrainingConfigError("device='cuda' but torch sees no GPU; use device='cpu'.")
        use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        self.device = torch.device("cuda" if use_cuda else "cpu")
        self.bf16 = self.device.type == "cuda" and args.precision == "auto"
        torch.manual_seed(args.seed)
        with _quiet_transformers():
            model, tok = load_model(args.resume or args.model)
        model = model.float()  # float32 master weights; bf16 only as autocast (CUDA)
        self.tokenizer = tok
        self.engine = HFEngine(
            model,
            tok,
            device=str(self.device),
            dtype=torch.float32,
            max_new_tokens=args.max_new_tokens,
            threads=args.threads,
        )
        self.model = self.engine.model
        name = args.policy
        if name == "auto":
            name = "scoring" if args.model == "tiny" else "generate"
        self.kind = POLICIES[name]
        self.policy = self.kind.make(self.engine, args)
        self.behaviour = _Autocast(self.policy, self.autocast) if self.bf16 else self.policy
        self.spec = EnvSpec(args.env_id, self._env_kwargs(args.env_kwargs))
        self._check_env()
        self.executor = make_executor(args.executor)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=args.lr, betas=tuple(args.adam_betas), weight_decay=args.weight_decay
        )
        fn = LR_SCHEDULES[args.lr_schedule]
        warm, total = args.warmup_steps, args.steps

        def multiplier(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            return fn(step - warm, max(total - warm, 1))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, multiplier)
        self.ref = None
        if needs_ref:
            self.ref = self._frozen_copy(self.model)
        self.step = 0
        self.grad_norm = RunningStats()
        self.history: list[dict[str, float]] = []
        self.eval_start: EvalResult | None = None
        self.eval_end: EvalResult | None = None
        self.last_checkpoint: Path | None = None
        self._pending: dict[str, float] = {}
        self._t0 = time.perf_counter()
        env_name = args.env_id.split("/")[-1]
        self.out_dir = Path(args.out_dir or f"runs/{algo}-{env_name}-{args.seed}")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        metrics_file = self.out_dir / "metrics.jsonl"
        if resume is None and metrics_file.is_file() and metrics_file.stat().st_size:
            if not args.overwrite:
                raise TrainingConfigError(
                    f"{self.out_dir} already holds a run (metrics.jsonl); choose another "
                    "out_dir, resume it (resume=<checkpoint>) or set overwrite=true."
                )
            metrics_file.unlink()
        if resume is not None:
            self._load(Path(args.resume), resume)
        (self.out_dir / "args.json").write_text(
            json.dumps({"algo": algo, **dataclasses.asdict(args)}, indent=2, default=str)
        )
        self._metrics = (self.out_dir / "metrics.jsonl").open("a")

    # ---------------------------------------------------------------- set-up helpers
    def _env_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        kw = dict(kwargs)
        if self.args.max_episode_steps is not None:
            kw.setdefault("max_episode_steps", int(self.args.max_episode_steps))
        return kw

    def _check_env(self) -> None:
        import gymnasium as gym

        import branchgym

        try:
            gym.spec(self.spec.id)
        except gym.error.Error:
            branchgym.make(self.spec.id)  # raises UnknownEnvError with "did you mean"
        env = self.spec.make()
        try:
            if not isinstance(env.action_space, gym.spaces.Text):
                raise TrainingConfigError(
                    f"{self.spec.id} takes {type(env.action_space).__name__} actions; LLM "
                    "learners need text actions (use branchgym/TextTreeMDP-v0 for the maze)."
                )
        finally:
            env.close()

    def _frozen_copy(self, model: Any) -> Any:
        ref = copy.deepcopy(model)
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def load_frozen(self, name: str) -> Any:
        """A frozen model (a teacher) on this run's device; its tokenizer must match."""
        from branchgym.agents.models import load_model

        with _quiet_transformers():
            model, tok = load_model(name)
        if tok.get_vocab() != self.tokenizer.get_vocab():
            raise TrainingConfigError(
                f"the teacher {name!r} has another tokenizer than the student "
                f"{self.args.model!r}; on-policy distillation scores the student's tokens, so "
                "both must share one vocabulary."
            )
        model = model.float().to(self.device)
        return self._frozen_copy(model)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """bfloat16 autocast on CUDA (``precision='auto'``), nothing on CPU."""
        if self.bf16:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                yield
        else:
            yield

    # ---------------------------------------------------------------- randomness
    def rng(self, *key: int) -> np.random.Generator:
        """A generator derived from ``(seed, step, *key)``: steps replay exactly on resume."""
        return np.random.default_rng([self.args.seed, self.step, *key])

    def prompt_seeds(self) -> list[int]:
        """This step's task instances (reset seeds)."""
        rng = self.rng(0x5EED)
        return [int(s) for s in rng.integers(0, 2**31 - 1, size=self.args.prompts_per_step)]

    # ---------------------------------------------------------------- log-probs
    def logprobs(
        self,
        model: Any,
        rows: Sequence[Row],
        *,
        logit_positions: Sequence[Sequence[int]] | None = None,
    ) -> tuple[list[list[Tensor]], list[Tensor]]:
        """Per row and decision, ``model``'s log-prob of each token (grad unless no_grad)."""
        with self.autocast():
            return self.kind.logprobs(
                self.policy, model, rows, self.device, logit_positions=logit_positions
            )

    @torch.no_grad()
    def frozen_logprobs(self, model: Any, batch: Batch, field: str) -> None:
        """Fill ``decision.<field>`` (``ref_logp``, ``teacher_logp``) with ``model``'s log-probs."""
        rows = [r for r in batch.rows if r.decisions]
        step = max(1, self.args.micro_batch_rows or len(rows))
        for i in range(0, len(rows), step):
            part = rows[i : i + step]
            lps, _ = self.logprobs(model, part)
            for row, per in zip(part, lps, strict=True):
                for d, lp in zip(row.decisions, per, strict=True):
                    setattr(d, field, lp.float().cpu().numpy())

    # ---------------------------------------------------------------- updates
    def chunks(self, batch: Batch, rows: Sequence[int]) -> list[list[int]]:
        """Split rows for gradient accumulation (``micro_batch_rows``), keeping groups whole."""
        size = self.args.micro_batch_rows
        if not size:
            return [list(rows)]
        out: list[list[int]] = [[]]
        last_group = None
        for r in rows:
            g = batch.rows[r].group
            if len(out[-1]) >= size and g != last_group:
                out.append([])
            out[-1].append(r)
            last_group = g
        return [c for c in out if c]

    def update(
        self,
        batch: Batch,
        rows: Sequence[int],
        loss_fn: Callable[[Chunk], tuple[Tensor, dict[str, float]]],
        *,
        weight: Callable[[Batch, list[int]], float] | None = None,
        logit_positions: Callable[[Row], list[int]] | None = None,
    ) -> dict[str, float]:
        """One optimizer update on ``rows``: loss, backward (accumulated over chunks), step.

        Args:
            batch: The rollout batch.
            rows: Rows of this mini-batch.
            loss_fn: ``chunk -> (loss, metrics)``, the learner's loss on some rows.
            weight: How much of the full loss a chunk carries (its share of the loss's
                normaliser: counted tokens for a token mean, the default); it makes
                gradient accumulation equal to one pass over all rows.
            logit_positions: Row sequence positions whose full logits the loss needs.

        Returns:
            The loss metrics (share-weighted over chunks) and ``grad/*``.
        """
        weight = weight or token_weight
        chunks = self.chunks(batch, rows)
        weights = [float(weight(batch, c)) for c in chunks]
        total = sum(weights)
        self.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, float] = {}
        if total <= 0:
            return {"update/skipped": 1.0}
        for c, w in zip(chunks, weights, strict=True):
            if w <= 0:
                continue
            share = w / total
            rws = [batch.rows[r] for r in c]
            positions = [logit_positions(r) for r in rws] if logit_positions else None
            lps, logits = self.logprobs(self.model, rws, logit_positions=positions)
            ch = batch.chunk(c, lps, self.device)
            if positions is not None:
                ch.logits = torch.cat(logits) if logits else None
            loss, m = loss_fn(ch)
            (loss * share).backward()
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + share * float(v)
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.args.grad_clip if self.args.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        self.optimizer.step()
        # the engine's prefix KV cache holds activations of the old weights
        self.engine.clear_cache()
        self.grad_norm.add(norm)
        metrics.update(
            {
                "grad/norm": norm,
                "grad/norm_mean": self.grad_norm.mean,
                "grad/norm_var": self.grad_norm.var,
                "update/skipped": 0.0,
            }
        )
        return metrics

    def updates(
        self,
        batch: Batch,
        loss_fn: Callable[[Chunk], tuple[Tensor, dict[str, float]]],
        **kwargs: Any,
    ) -> dict[str, float]:
        """``updates_per_batch`` updates over the batch's mini-batches; metrics averaged."""
        out: dict[str, list[float]] = {}
        for rows in batch.minibatches(self.args.updates_per_batch):
            for k, v in self.update(batch, rows, loss_fn, **kwargs).items():
                out.setdefault(k, []).append(v)
        merged = {k: float(np.mean(v)) for k, v in out.items()}
        for key in ("grad/norm_mean", "grad/norm_var"):  # running statistics: the last value
            if key in out:
                merged[key] = out[key][-1]
        merged["update/count"] = float(len(batch.minibatches(self.args.updates_per_batch)))
        return merged

    # ---------------------------------------------------------------- the loop
    def loop(self) -> Iterator[int]:
        """Yield each step to run; after each, log, evaluate and checkpoint as configured."""
        from tqdm import tqdm

        a = self.args
        if a.eval_episodes and self.step == 0:
            self.eval_start = self.evaluate()
            self.log_line({"step": 0, **self.eval_start.metrics()})
        bar = tqdm(
            total=a.steps, initial=self.step, desc=self.algo, disable=not a.progress, leave=False
        )
        try:
            while self.step < a.steps:
                self._pending = {}
                self._t0 = time.perf_counter()
                yield self.step
                with warnings.catch_warnings():
                    # a step whose batch had nothing to learn skips optimizer.step(); the
                    # schedule still counts it, which torch would warn about
                    warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
                    self.scheduler.step()
                self.step += 1
                line = {"step": self.step, "charts/lr": self.optimizer.param_groups[0]["lr"]}
                line.update(self._pending)
                line["time/step_s"] = time.perf_counter() - self._t0
                if a.eval_episodes and a.eval_every and self.step % a.eval_every == 0:
                    line.update(self.evaluate().metrics())
                self.log_line(line)
                bar.update(1)
                bar.set_postfix(
                    {k.split("/")[-1]: f"{line[k]:.3f}" for k in _BAR_KEYS if k in line}
                )
                if a.checkpoint_every and self.step % a.checkpoint_every == 0:
                    self.save()
        finally:
            bar.close()
        if a.eval_episodes:
            self.eval_end = self.evaluate()
            self.log_line({"step": self.step, **self.eval_end.metrics()})
        if self.last_checkpoint is None or not self.last_checkpoint.name.endswith(
            f"{self.step:06d}"
        ):
            self.save()

    def log(self, metrics: dict[str, float]) -> None:
        """Add metrics to the current step's line."""
        self._pending.update({k: float(v) for k, v in metrics.items()})

    def log_line(self, line: dict[str, float]) -> None:
        """Write one JSONL line (and keep it in :attr:`history`)."""
        clean = {k: (float(v) if k != "step" else int(v)) for k, v in line.items()}
        self.history.append(clean)
        self._metrics.write(json.dumps(clean) + "\n")
        self._metrics.flush()

    def evaluate(self) -> EvalResult:
        """Success on the fixed evaluation set (and the exact value where computable)."""
        return evaluate(
            self.spec,
            self.behaviour,
            episodes=self.args.eval_episodes,
            seed=self.args.eval_seed,
            executor=self.executor,
            max_steps=self.args.max_episode_steps,
            success_threshold=self.args.success_threshold,
        )

    # ---------------------------------------------------------------- checkpoints
    def save(self, folder: str | Path | None = None) -> Path:
        """Write a checkpoint: HF model folder + optimizer (safetensors) + trainer state."""
        from safetensors.torch import save_file, save_model

        out = Path(folder) if folder else self.out_dir / f"checkpoint-{self.step:06d}"
        tmp = out.with_name(out.name + ".partial")
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        with _quiet_transformers():
            self.model.save_pretrained(tmp, safe_serialization=True)
            self.tokenizer.save_pretrained(tmp)
        tensors, opt_meta = _optimizer_tensors(self.optimizer)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        if self.ref is not None:
            save_model(self.ref, str(tmp / "ref.safetensors"))
        state = {
            "version": CHECKPOINT_VERSION,
            "algo": self.algo,
            "step": self.step,
            "args": dataclasses.asdict(self.args),
            "optimizer": opt_meta,
            "scheduler": self.scheduler.state_dict(),
            "grad_norm": dataclasses.asdict(self.grad_norm),
            "torch_rng": torch.get_rng_state().tolist(),
            "policy": self.kind.name,
        }
        (tmp / "trainer_state.json").write_text(json.dumps(state, default=_json_default))
        if out.exists():
            import shutil

            shutil.rmtree(out)
        tmp.rename(out)  # a half-written checkpoint is never taken for a whole one
        self.last_checkpoint = out
        return out

    def _load(self, folder: Path, state: dict[str, Any]) -> None:
        from safetensors.torch import load_file, load_model

        try:
            tensors = load_file(str(folder / "optimizer.safetensors"))
            self.optimizer.load_state_dict(_optimizer_state(tensors, state["optimizer"]))
            self.scheduler.load_state_dict(state["scheduler"])
            if self.ref is not None:
                ref_file = folder / "ref.safetensors"
                if not ref_file.is_file():
                    raise CheckpointError(
                        f"{folder} has no ref.safetensors, but this run has a KL term; resume "
                        "with the options the checkpoint was made with."
                    )
                load_model(self.ref, str(ref_file), device=str(self.device))
        except (OSError, KeyError, ValueError, RuntimeError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(
                f"cannot resume from {folder}: {type(exc).__name__}: {exc}. The checkpoint is "
                "damaged or was written for another model or optimizer."
            ) from exc
        if state.get("policy") not in (None, self.kind.name):
            raise CheckpointError(
                f"{folder} was trained with policy={state['policy']!r}; resume with the same."
            )
        self.step = int(state["step"])
        self.grad_norm = RunningStats(**state["grad_norm"])
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))

    def close(self) -> TrainResult:
        """Close the logs, draw the curves, shut the executor down; the run's result."""
        self._metrics.close()
        self.executor.shutdown()
        plot_curves(self.history, self.out_dir / "curves.png", title=self.algo)
        return TrainResult(
            self.out_dir, self.last_checkpoint, self.history, self.eval_start, self.eval_end
        )


_BAR_KEYS = ("charts/success", "charts/return", "losses/policy_loss", "eval/success")


def _json_default(x: Any) -> Any:
    if isinstance(x, Tensor):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, tuple):
        return list(x)
    return str(x)


def token_weight(batch: Batch, rows: list[int]) -> float:
    """Counted tokens of ``rows``: a chunk's share of a token-mean loss."""
    return float(sum(float(d.mask.sum()) for d in batch.decisions(rows)))


def row_weight(batch: Batch, rows: list[int]) -> float:
    """Rows with a counted token: a chunk's share of a sequence-mean loss."""
    return float(sum(1 for r in rows if any(d.mask.sum() > 0 for d in batch.rows[r].decisions)))


#: aggregation name of :data:`branchgym.agents.losses.AGGREGATIONS` -> chunk weight.
WEIGHTS: dict[str, Callable[[Batch, list[int]], float]] = {
    "token-mean": token_weight,
    "seq-mean-token-mean": row_weight,
    "seq-mean-token-sum": row_weight,
}


def plot_curves(history: Sequence[dict[str, float]], path: Path, *, title: str = "") -> None:
    """PNG of success, return, policy loss and gradient norm over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [
        ("charts/success", "eval/success"),
        ("charts/return", "eval/return"),
        ("losses/policy_loss", "losses/sft"),
        ("grad/norm", None),
    ]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3))
    for ax, (train_key, eval_key) in zip(axes, keys, strict=True):
        for key, style in ((train_key, "-"), (eval_key, "o--")):
            pts = [(h["step"], h[key]) for h in history if key and key in h]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, style, label=key)
        ax.set_xlabel("step")
        ax.set_title(train_key.split("/")[-1])
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
