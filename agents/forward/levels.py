"""Packed forward passes computed in a few calls over a key/value cache.

:func:`~branchgym.agents.forward.packed.packed_forward` reads a packed tree (a dialogue plus
segments, each continuing an earlier token) as one sequence with a dense 4-D mask: every
token of the pack is scored against every other, masked or not, so a pack of length ``L``
computes ``L^2`` attention pairs however few of them a token may see. On 7 rows of 140
tokens behind an 8-token prompt that is 988^2 pairs where the rows need 7 x 148^2,
and the merged pack ran slower than its rows (docs/learners.md, Tree packing).

:func:`level_forward` computes the same log-probs and gradients from less. The pieces
of a pack (its dialogue, then each segment) form a tree by the piece their attach point
lies in; a piece's *level* is its depth in that tree (:func:`pieces`). With ``cut = c``
the pass makes ``c + 1`` model calls: call ``l < c`` runs the pieces of level ``l``, one
row each; call ``c`` runs one row per piece of level ``c`` holding that piece and all
its descendants, with a dense 4-D mask among them. Each row is handed the keys and
values of its context (the tokens its first piece sees, computed by earlier calls) as a
key/value cache, so a row of ``q`` tokens after ``p`` context tokens costs ``q (p + q)``
attention pairs (:func:`level_pairs`), and every shared token is still computed once.
Gradients flow through the cache into the calls that produced it, so the backward pass is
exact too. ``cut = 1`` is the usual choice: the dialogues causally, then every branch
with what it continues as its cache.

Each extra call costs more than its tokens (in backward, the weights' gradients are
summed over the calls; the matrix products are smaller), which :data:`CALL_COST`
prices in :func:`~branchgym.agents.forward.packed.pack_cost`; the token embedding runs once for the
whole pass (a tied embedding's gradient is a dense vocabulary x hidden matrix per call).

Where it applies (:func:`levels_supported`): a model whose transformer takes
``past_key_values``, ``inputs_embeds`` and ``position_ids`` and applies a custom 4-D mask
(eager or SDPA attention, the condition :func:`~branchgym.agents.forward.packed.packing_exact`
checks), not in gradient-checkpointed training (a recomputed layer would append to the
cache twice).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

from branchgym.error import DependencyMissingError, TrainingConfigError

try:
    import torch
    from torch import Tensor
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra(
        "branchgym.agents.forward.levels", "llm", "torch"
    ) from exc

__all__ = [
    "CALL_COST",
    "Piece",
    "call_shapes",
    "level_forward",
    "level_pairs",
    "level_rows",
    "levels_supported",
    "pieces",
]

#: What each model call of :func:`level_forward` after the first adds, in tokens of the
#: pass (the weights' gradients summed once more, the call's fixed work): a fixed cost,
#: not a share of the pass. ``branchgym bench packing`` on SmolLM2 (float32, 2 threads):
#: one group of 120 + 7 x 28 took 2.10 s dense and 2.72 s in two calls, where tokens,
#: pairs and padding rate the two calls slightly cheaper: about 0.6 s, some 90 of that
#: pass's tokens (docs/learners.md, Reading a tree through a KV cache).
CALL_COST = 100.0


@dataclasses.dataclass
class Piece:
    """A contiguous run of a pack's tokens.

    Attributes:
        start: First token index in the pack.
        end: One past the last.
        context: Pack indices this piece attends before its own tokens, in order.
        level: 0 for a dialogue (or a segment that sees only itself), else its parent's + 1.
        parent: Index of the piece its attach point lies in (None at level 0).
    """

    start: int
    end: int
    context: list[int]
    level: int
    parent: int | None


def pieces(tokens: int, segments: Sequence[tuple[int, int, int]]) -> list[Piece]:
    """The pieces of a pack of ``tokens`` tokens with ``segments`` (``Pack.segments``)."""
    first = min([s for s, _, _ in segments] + [tokens])
    out = [Piece(0, first, [], 0, None)] if first else []
    owner: list[int] = [0] * first  # pack index -> its piece
    for start, end, attach in segments:
        if attach > start:
            raise TrainingConfigError(
                f"a side branch at {start} continues token {attach - 1}, which comes after "
                "it; list segments after the tokens they continue."
            )
        if attach == 0:
            ctx, level, parent = [], 0, None
        else:
            parent = owner[attach - 1]
            ctx = out[parent].context + list(range(out[parent].start, attach))
            level = out[parent].level + 1
        owner.extend([len(out)] * (end - start))
        out.append(Piece(start, end, ctx, level, parent))
    return out


def level_rows(parts: Sequence[Piece], cut: int) -> list[tuple[int, list[int]]]:
    """``(call, pieces)`` of each row :func:`level_forward` runs for one pack at ``cut``.

    A piece above level ``cut`` has a row of its own in call ``level``; a piece at level
    ``cut`` starts a row in call ``cut`` that its descendants join (in pack order).
    """
    rows: list[tuple[int, list[int]]] = []
    row_of: dict[int, int] = {}
    for j, pc in enumerate(parts):
        if pc.level <= cut:
            row_of[j] = len(rows)
            rows.append((pc.level, [j]))
        else:
            row_of[j] = row_of[pc.parent]  # type: ignore[index]
            rows[row_of[j]][1].append(j)
    return rows


def _row_sizes(
    tokens: int, segments: Sequence[tuple[int, int, int]], cut: int
) -> Iterator[tuple[int, int, int]]:
    """``(call, own tokens, context tokens)`` of each row of one pack at ``cut``."""
    parts = pieces(tokens, segments)
    for call, members in level_rows(parts, cut):
        own = sum(parts[j].end - parts[j].start for j in members)
        yield call, own, len(parts[members[0]].context)


def level_pairs(tokens: int, segments: Sequence[tuple[int, int, int]], cut: int = 1) -> int:
    """Attention pairs :func:`level_forward` computes for one pack at ``cut`` (no padding)."""
    return sum(own * (ctx + own) for _, own, ctx in _row_sizes(tokens, segments, cut))


def call_shapes(packs: Sequence[Any], cut: int) -> list[tuple[int, int, int]]:
    """``(rows, longest row, longest context)`` of each call :func:`level_forward` makes."""
    calls: dict[int, list[tuple[int, int]]] = {}
    for p in packs:
        for call, own, ctx in _row_sizes(len(p.tokens), p.segments, cut):
            calls.setdefault(call, []).append((own, ctx))
    return [
        (len(rows), max(o for o, _ in rows), max(c for _, c in rows))
        for _, rows in sorted(calls.items())
    ]


def levels_supported(model: Any, base: Any) -> bool:
    """Whether :func:`level_forward` can run ``model`` (through ``base``, its transformer)."""
    if base is None or not hasattr(base, "get_input_embeddings"):
        return False
    if getattr(model, "is_gradient_checkpointing", False) and model.training:
        return False
    try:
        from transformers import DynamicCache  # noqa: F401
    except ImportError:  # pragma: no cover - transformers is part of the llm extra
        return False
    return True


def _layers(cache: Any) -> list[tuple[Tensor, Tensor]]:
    """Per layer ``(keys, values)`` of a transformers cache, shape ``(B, heads, T, d)``."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))  # older transformers


def level_forward(base: Any, packs: Sequence[Any], device: torch.device, *, cut: int = 1) -> Tensor:
    """Hidden state of every token of every pack, in ``cut + 1`` calls at most.

    Args:
        base: The transformer of a causal LM (``forward.backbone(model)[0]``).
        packs: :class:`~branchgym.agents.forward.packed.Pack` objects.
        device: Where the model runs.
        cut: The last call's level (see the module docstring); ``cut >= 1``.

    Returns:
        ``(sum of pack lengths, hidden)``: pack ``i``'s token ``j`` at row
        ``offsets[i] + j`` (packs in order).
    """
    from transformers import DynamicCache

    if cut < 1:
        raise TrainingConfigError("level_forward needs cut >= 1 (cut 0 is the dense pass)")
    offsets, total = [], 0
    for p in packs:
        offsets.append(total)
        total += len(p.tokens)
    # per call: (pack, row's first piece's context, the row's pieces)
    calls: dict[int, list[tuple[int, list[int], list[Piece]]]] = {}
    for i, p in enumerate(packs):
        parts = pieces(len(p.tokens), p.segments)
        for call, members in level_rows(parts, cut):
            first = parts[members[0]]
            calls.setdefault(call, []).append((i, first.context, [parts[j] for j in members]))
    positions = [p.positions() for p in packs]
    # every token embedded once: one embedding backward for the pass, not one per call
    flat_ids = torch.as_tensor([t for p in packs for t in p.tokens], dtype=torch.long)
    embeds = base.get_input_embeddings()(flat_ids.to(device))
    slot = torch.full((total,), -1, dtype=torch.long)  # computed row of each token
    keys: list[Tensor] = []  # per layer (computed tokens, heads, d)
    values: list[Tensor] = []
    hidden: list[Tensor] = []
    order: list[Tensor] = []  # global index of each computed token, in order
    done = 0
    for call in sorted(calls):
        rows = calls[call]
        lengths = [sum(pc.end - pc.start for pc in members) for _, _, members in rows]
        q, past, b = max(lengths), max(len(ctx) for _, ctx, _ in rows), len(rows)
        ids = torch.zeros(b, q, dtype=torch.long)  # global index of each row token
        pos = torch.zeros(b, q, dtype=torch.long)
        mask = torch.zeros(b, q, past + q, dtype=torch.bool)
        gather = torch.zeros(b, past, dtype=torch.long)
        for r, (i, ctx, members) in enumerate(rows):
            n, c = lengths[r], len(ctx)
            local = torch.cat([torch.arange(pc.start, pc.end) for pc in members])
            ids[r, :n] = local + offsets[i]
            pos[r, :n] = torch.as_tensor(positions[i], dtype=torch.long)[local]
            if c:
                gather[r, :c] = slot[torch.as_tensor(ctx, dtype=torch.long) + offsets[i]]
                mask[r, :n, :c] = True
            at = {int(x): past + k for k, x in enumerate(local)}  # pack index -> column
            k = 0
            for pc in members:
                seen = [at[x] for x in pc.context[c:]]  # what it sees inside the row
                w = pc.end - pc.start
                if seen:
                    mask[r, k : k + w, seen] = True
                mask[r, k : k + w, past + k : past + k + w] = torch.tril(
                    torch.ones(w, w, dtype=torch.bool)
                )
                k += w
            mask[r, torch.arange(n, q), past + torch.arange(n, q)] = True  # padding: itself
        cache = DynamicCache()
        if past:
            idx = gather.to(device)
            for layer, (k_, v_) in enumerate(zip(keys, values, strict=True)):
                cache.update(k_[idx].permute(0, 2, 1, 3), v_[idx].permute(0, 2, 1, 3), layer)
        out = base(
            inputs_embeds=embeds[ids.to(device)],
            attention_mask=mask[:, None].to(device),
            position_ids=pos.to(device),
            past_key_values=cache,
            use_cache=True,
        )
        sel_r = torch.cat([torch.full((n,), r, dtype=torch.long) for r, n in enumerate(lengths)])
        sel_c = torch.cat([torch.arange(n) for n in lengths])
        dev_r, dev_c = sel_r.to(device), sel_c.to(device)
        new_k, new_v = [], []
        for k_, v_ in _layers(out.past_key_values):  # (b, heads, past + q, d) -> (n, heads, d)
            new_k.append(k_[dev_r, :, dev_c + past])
            new_v.append(v_[dev_r, :, dev_c + past])
        if keys:
            keys = [torch.cat([a, n], 0) for a, n in zip(keys, new_k, strict=True)]
            values = [torch.cat([a, n], 0) for a, n in zip(values, new_v, strict=True)]
        else:
            keys, values = new_k, new_v
        hidden.append(out.last_hidden_state[dev_r, dev_c])
        glob = ids[sel_r, sel_c]
        slot[glob] = torch.arange(done, done + len(glob))
        done += len(glob)
        order.append(glob)
    flat = torch.cat(hidden, 0)
    back = torch.empty(total, dtype=torch.long)
    back[torch.cat(order)] = torch.arange(total)
    return flat[back.to(device)]
