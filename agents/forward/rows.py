"""Rollout trees as rows of token decisions: what a loss reads.

A row is the part of one root-to-leaf path that this path owns (every node is owned by
exactly one path, so a shared prefix is counted once, algorithms.md eq. 6); for independent
rollouts a row is a whole trajectory.

* :class:`Decision`: one tree node whose tokens the loss counts, with its context,
  behaviour log-probs, mask and advantage.
* :class:`Row`: the decisions one path owns; :class:`Batch`: the rows of a batch of
  trees, padded into a :class:`Chunk` of tensors for one forward/backward pass.
* :data:`WEIGHTS`: a chunk's share of the loss for each aggregation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from branchgym.error import DependencyMissingError
from branchgym.rollout.policy import Context, Turn
from branchgym.rollout.tree import RolloutTree, success_of

try:
    import torch
    from torch import Tensor
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra("branchgym.agents.forward.rows", "llm", "torch") from exc

__all__ = [
    "Batch",
    "Chunk",
    "Decision",
    "Row",
    "WEIGHTS",
    "path_decisions",
    "row_weight",
    "token_weight",
]


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
        is_weight: Per-token importance weight on the advantage (truncated importance
            sampling of vLLM samples, :mod:`~branchgym.agents.training.vllm_training`), or None.
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
    is_weight: np.ndarray | None = None

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
            advantages=self.pad(
                rows, lambda d: d.advantage if d.is_weight is None else d.advantage * d.is_weight
            ).to(device),
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


def token_weight(batch: Batch, rows: list[int]) -> float:
    """Counted tokens of ``rows``: a chunk's share of a token-mean loss."""
    return float(sum(float(d.mask.sum()) for d in batch.decisions(rows)))


def row_weight(batch: Batch, rows: list[int]) -> float:
    """Rows with a counted token: a chunk's share of a sequence-mean loss."""
    return float(sum(1 for r in rows if any(d.mask.sum() > 0 for d in batch.rows[r].decisions)))


#: aggregation name of :data:`branchgym.agents.estimators.losses.AGGREGATIONS` -> chunk weight.
WEIGHTS: dict[str, Callable[[Batch, list[int]], float]] = {
    "token-mean": token_weight,
    "seq-mean-token-mean": row_weight,
    "seq-mean-token-sum": row_weight,
}
