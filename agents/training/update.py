"""The update of a training run: rescoring rows with gradients and one optimiser step.

:class:`RunUpdate` holds :class:`~branchgym.agents.training.run.Run`'s methods that read
rows: log-probs through the packed forward passes (:mod:`branchgym.agents.forward`),
frozen models' log-probs, chunks for gradient accumulation, the update (loss, backward,
clipping, step) and the tokens a pass reads against its distinct tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from branchgym.agents.forward.flat import flat_supported
from branchgym.agents.forward.levels import levels_supported
from branchgym.agents.forward.packed import (
    Pack,
    backbone,
    pack_trees,
    pair_cost,
    plan_packs,
)
from branchgym.agents.forward.rows import (
    Batch,
    Chunk,
    Row,
    token_weight,
)
from branchgym.agents.training.memory import token_chunks, training_mode
from branchgym.error import DependencyMissingError

try:
    import torch
    from torch import Tensor
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra(
        "branchgym.agents.training.update", "llm", "torch"
    ) from exc


class RunUpdate:
    """Rescoring and the optimiser update of a :class:`~branchgym.agents.training.run.Run`."""

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
                self.policy,
                model,
                rows,
                self.device,
                logit_positions=logit_positions,
                pack_trees=self.args.pack_trees,
            )

    @torch.no_grad()
    def frozen_logprobs(self, model: Any, batch: Batch, field: str) -> None:
        """Fill ``decision.<field>`` (``ref_logp``, ``teacher_logp``) with ``model``'s log-probs.

        Timed as ``time/reference_s`` (``ref_logp``) or ``time/teacher_s``.
        """
        with self.timed("reference" if field == "ref_logp" else "teacher"):
            self._frozen_logprobs(model, batch, field)

    def _frozen_logprobs(self, model: Any, batch: Batch, field: str) -> None:
        if self.args.micro_batch_tokens:  # the update's token-budget chunks (groups may split)
            scored = [i for i, r in enumerate(batch.rows) if r.decisions]
            parts = [[batch.rows[i] for i in c] for c in self.chunks(batch, scored)]
        else:
            rows = [r for r in batch.rows if r.decisions]
            step = max(1, self.args.micro_batch_rows or len(rows))
            parts = [rows[i : i + step] for i in range(0, len(rows), step)]
        base = self.args.lora_rank and model is self.ref
        for part in parts:
            with self.model.disable_adapter() if base else contextlib.nullcontext():
                lps, _ = self.logprobs(model, part)
            for row, per in zip(part, lps, strict=True):
                for d, lp in zip(row.decisions, per, strict=True):
                    setattr(d, field, lp.float().cpu().numpy())

    # ---------------------------------------------------------------- updates
    def row_tokens(self, rows: Sequence[Row]) -> list[int]:
        """Tokens each row adds to a forward pass.

        With ``pack_trees``, the tokens beyond the prefix it shares with the row before it
        of the same tree.
        """
        seqs = []
        for row in rows:
            if not row.decisions:  # nothing to score (an SFT episode with no label): no pass
                seqs.append([])
                continue
            packs, _ = self.kind.packs(self.policy, self.kind.runs(self.policy, row))
            seqs.append([t for p in packs for t in p.tokens])
        costs = []
        for i, (row, seq) in enumerate(zip(rows, seqs, strict=True)):
            shared = 0
            if self.args.pack_trees and i and rows[i - 1].tree == row.tree:
                prev = seqs[i - 1]
                while shared < min(len(seq), len(prev)) and seq[shared] == prev[shared]:
                    shared += 1
            costs.append(len(seq) - shared)
        return costs

    def chunks(
        self, batch: Batch, rows: Sequence[int], *, whole_groups: bool = False
    ) -> list[list[int]]:
        """Split rows for gradient accumulation.

        ``micro_batch_tokens``: by token budget (groups may split, unless
        ``whole_groups``); ``micro_batch_rows``: by rows, groups whole.
        """
        if self.args.micro_batch_tokens:
            costs = self.row_tokens([batch.rows[r] for r in rows])
            groups = [batch.rows[r].group for r in rows]
            cut = token_chunks(
                costs, groups, self.args.micro_batch_tokens, whole_groups=whole_groups
            )
            return [[rows[i] for i in c] for c in cut]
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
        whole_groups: bool = False,
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
            whole_groups: The loss reads whole groups (Bellman PO): token-budget chunks
                cut only between groups.

        Returns:
            The loss metrics (share-weighted over chunks) and ``grad/*``.
        """
        weight = weight or token_weight
        chunks = self.chunks(batch, rows, whole_groups=whole_groups)
        weights = [float(weight(batch, c)) for c in chunks]
        # data parallel: shares of the normaliser over every rank's rows (distributed.py)
        total = self.dp.all_sum([sum(weights)])[0]
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
            with training_mode(self.model, self.args.gradient_checkpointing):
                lps, logits = self.logprobs(self.model, rws, logit_positions=positions)
                ch = batch.chunk(c, lps, self.device)
                if positions is not None:
                    ch.logits = torch.cat(logits) if logits else None
                loss, m = loss_fn(ch)
                (loss * share).backward()
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + share * float(v)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.dp.active:  # one process's gradient and loss on the whole batch
            self.dp.sum_gradients(params)
            keys = sorted(set().union(*self.dp.gather(sorted(metrics))))
            summed = self.dp.all_sum([metrics.get(k, 0.0) for k in keys])
            metrics = dict(zip(keys, summed, strict=True))
        if self.masters is not None:  # bf16 gradients onto the float32 masters
            self.masters.grads_to_masters()
            params = self.masters.params
        max_norm = self.args.grad_clip if self.args.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        self.optimizer.step()
        if self.masters is not None:
            self.masters.masters_to_params()
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
        """``updates_per_batch`` updates over the batch's mini-batches; metrics averaged.

        Timed as ``time/update_s``; with vLLM sampling, the trainer's forward that
        recomputes the behaviour log-probs first, as ``time/old_policy_s``. The token
        counts after them are bookkeeping, not timed.
        """
        if self.args.engine == "vllm":  # vLLM's log-probs -> the trainer's (vllm_training)
            from branchgym.agents.training.vllm_training import behaviour_correction

            with self.timed("old_policy"):
                self.log(behaviour_correction(self, batch))
        with self.timed("update"):
            merged = self._updates(batch, loss_fn, **kwargs)
        merged.update(self.token_counts(batch))
        return merged

    def _updates(
        self,
        batch: Batch,
        loss_fn: Callable[[Chunk], tuple[Tensor, dict[str, float]]],
        **kwargs: Any,
    ) -> dict[str, float]:
        self._step_batch = batch  # its trees and advantages, for save_trees_every
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

    def token_counts(self, batch: Batch) -> dict[str, float]:
        """Tokens one pass of the policy over the batch reads, against its distinct tokens.

        ``tokens/learner``: the tokens the forward passes read, chunked as the update
        chunks them; ``tokens/unique``: each mini-batch's rows in one token trie, each
        shared prefix once (within a tree, and across trees: a prompt or system prompt
        that several trees share). They are equal when tree packing is on, the model is
        read flat (``flat_forward.flat_supported``) and no chunk or forward budget splits
        a mini-batch.
        """

        def packs(rows: Sequence[Row]) -> tuple[list[Pack], list[int]]:
            pieces = [(r, s) for r in rows if r.decisions for s in self.kind.runs(self.policy, r)]
            out, _ = self.kind.packs(self.policy, [s for _, s in pieces])
            return out, [r.tree for r, _ in pieces]

        pair, learner, unique = pair_cost(self.model), 0, 0
        # the update's plan: a flat or key/value-cache read of merged packs unless
        # checkpointing
        base = backbone(self.model)[0]
        levels = levels_supported(self.model, base) and not self.args.gradient_checkpointing
        flat = flat_supported(self.model, base) and not self.args.gradient_checkpointing
        for mb in {tuple(m) for m in batch.minibatches(self.args.updates_per_batch)}:
            for c in self.chunks(batch, list(mb)):
                ps, keys = packs([batch.rows[r] for r in c])
                read, _ = plan_packs(
                    ps, keys if self.args.pack_trees else None, pair=pair, levels=levels, flat=flat
                )
                learner += sum(len(p.tokens) for p in read)
            ps, _ = packs([batch.rows[r] for r in mb])
            unique += sum(len(p.tokens) for p in pack_trees(ps, [0] * len(ps))[0]) if ps else 0
        return {"tokens/learner": float(learner), "tokens/unique": float(unique)}
