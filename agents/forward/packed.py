"""Log-probs with gradients in packed forward passes (4-D attention masks).

* :class:`Pack`: one sequence of a forward pass: a row's dialogue plus side branches
  (other candidates of a decision) that see only their attach prefix.
* :func:`packed_forward`: the log-prob of every target of every pack in one padded
  pass; :func:`bucketed_forward` splits the packs into :func:`length_buckets` of at most
  :data:`FORWARD_TOKENS` padded tokens first.
* :func:`pack_trees`: tree packing. The rows of one rollout tree share their prefix up to
  each fork; merged into one :class:`Pack` (a token trie: every other row continues the
  token where it leaves the rows before it), each shared prefix is read once per forward
  pass instead of once per path, with the same log-probs (the 4-D mask and position ids
  give every token exactly the context it had in its own row).
* :func:`plan_packs`: tree packing where it pays. A tree's rows go into the number of
  merged packs that costs least (:func:`pack_cost`: tokens, plus the attention pairs the
  read computes); a tree whose rows share no prefix keeps its rows, and rows without
  side branches go through the plain causal path (``bucketed_forward`` never gives them
  a 4-D mask because another pack of the pass needs one).
* How a merged pack is read (:func:`best_cut`): in one call with a dense 4-D mask
  (``length^2`` pairs; cheapest for short branches), or in a few calls over a key/value
  cache (:mod:`~branchgym.agents.forward.levels`: the dialogues, then each branch with
  what it continues as its cache, attending only what its row attends; cheapest for
  long branches, where the dense mask used to make a tree cheaper split in several packs).
* :func:`packing_exact`: whether a model computes a packed pass exactly (None) or why
  not (flash-attention kernels and sliding windows ignore a custom 4-D mask).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from branchgym.agents.forward.flat import flat_forward, flat_supported
from branchgym.agents.forward.levels import (
    CALL_COST,
    call_shapes,
    level_forward,
    levels_supported,
)
from branchgym.agents.forward.pack import Pack
from branchgym.agents.forward.target_logprobs import fusable, target_logprobs
from branchgym.error import DependencyMissingError, TrainingConfigError

try:
    import torch
    from torch import Tensor
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra(
        "branchgym.agents.forward.packed", "llm", "torch"
    ) from exc

__all__ = [
    "FORWARD_TOKENS",
    "Pack",
    "PackedTree",
    "backbone",
    "best_cut",
    "bucketed_forward",
    "length_buckets",
    "pack_trees",
    "packed_forward",
    "packing_exact",
    "pack_cost",
    "pass_cost",
    "plan_packs",
]


def packed_forward(
    model: Any,
    packs: Sequence[Pack],
    device: torch.device,
    *,
    logit_positions: Sequence[Sequence[int]] | None = None,
    dense_mask: bool = False,
    cut: int | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """Log-prob of every target of every pack, in one padded forward pass.

    Packs without side branches use the ordinary causal mask; otherwise each pack gets a
    4-D boolean mask (side branches see their attach prefix and themselves) and explicit
    position ids. Only hidden states that predict a target go through the output layer,
    so a large vocabulary costs ``(targets x V)``, not ``(positions x V)``.
    ``dense_mask`` gives plain packs the 4-D mask too (the same causal pattern; the
    benchmark's same-tokens comparison of the two paths).

    Packs with side branches are read flat where the model allows it (``cut=FLAT``,
    :func:`~branchgym.agents.forward.flat.flat_forward`: one row of exactly their tokens,
    attention per piece; :func:`~branchgym.agents.forward.flat.flat_supported`), or else
    through a few calls over a key/value cache
    (:func:`~branchgym.agents.forward.levels.level_forward` at ``cut``: each branch is
    handed what it continues as a cache, so it attends only what it sees): ``cut=None``
    picks flat, or the cheaper of the cache and the dense mask (:func:`best_cut`) where
    the model allows it (:func:`~branchgym.agents.forward.levels.levels_supported`);
    ``cut=0`` (or ``dense_mask``) forces the one-call dense 4-D mask.

    Returns:
        Per pack, a tensor of its targets' log-probs; and per pack the full next-token
        logits at ``logit_positions`` (PBR's constraints).
    """
    base, head = backbone(model)
    branched = dense_mask or any(p.segments for p in packs)
    if cut is None:
        cut = 0
        if branched and not dense_mask and flat_supported(model, base):
            cut = FLAT
        elif branched and not dense_mask and levels_supported(model, base):
            cut = best_cut(packs, pair_cost(model))
    if cut:
        return _level_scores(base, head, packs, device, logit_positions, cut)
    width = max(len(p.tokens) for p in packs)
    ids = torch.zeros(len(packs), width, dtype=torch.long)
    pos = torch.zeros(len(packs), width, dtype=torch.long)
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
            if attach > start:
                raise TrainingConfigError(
                    f"a side branch at {start} continues token {attach - 1}, which comes after "
                    "it; list segments after the tokens they continue."
                )
            if attach > 0:
                att[i, start:end, :start] = att[i, attach - 1, :start]  # the parent's context
            att[i, start:end, start:end] = torch.tril(
                torch.ones(end - start, end - start, dtype=torch.bool)
            )
    ids, pos, att = ids.to(device), pos.to(device), att.to(device)
    if branched:
        att = att[:, None]  # (B, 1, L, L)
    rows, cols, tgt = _scored(packs, logit_positions)
    r = torch.tensor(rows, dtype=torch.long, device=device)
    c = torch.tensor(cols, dtype=torch.long, device=device)
    if base is not None and head is not None:
        hidden = base(
            input_ids=ids, attention_mask=att, position_ids=pos, use_cache=False
        ).last_hidden_state
        return _head_scores(head, hidden[r, c], packs, tgt, logit_positions, device)
    else:  # a model without a separate head: the full logits
        logits = model(input_ids=ids, attention_mask=att, position_ids=pos).logits[r, c]
    return _picked(logits, packs, tgt, logit_positions, device)


def _scored(
    packs: Sequence[Pack], logit_positions: Sequence[Sequence[int]] | None
) -> tuple[list[int], list[int], list[int]]:
    """Where every target is scored, then every logit position.

    Returns ``(packs, positions, tokens)``: one pack and position per target, then one per
    logit position; ``tokens`` lists the targets' tokens only.
    """
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
    return rows, cols, tgt


def _level_scores(
    base: Any,
    head: Any,
    packs: Sequence[Pack],
    device: torch.device,
    logit_positions: Sequence[Sequence[int]] | None,
    cut: int,
) -> tuple[list[Tensor], list[Tensor]]:
    """:func:`packed_forward` over a key/value cache (``cut >= 1``) or flat (``cut = FLAT``).

    :func:`~branchgym.agents.forward.levels.level_forward` or
    :func:`~branchgym.agents.forward.flat.flat_forward` computes the hidden states.
    """
    if cut == FLAT:
        hidden = flat_forward(base, packs, device)
    else:
        hidden = level_forward(base, packs, device, cut=cut)
    rows, cols, tgt = _scored(packs, logit_positions)
    offsets = [0]
    for p in packs:
        offsets.append(offsets[-1] + len(p.tokens))
    flat = torch.tensor([offsets[r] + c for r, c in zip(rows, cols, strict=True)], dtype=torch.long)
    return _head_scores(head, hidden[flat.to(device)], packs, tgt, logit_positions, device)


def _head_scores(
    head: Any,
    hidden: Tensor,
    packs: Sequence[Pack],
    tgt: list[int],
    logit_positions: Sequence[Sequence[int]] | None,
    device: torch.device,
) -> tuple[list[Tensor], list[Tensor]]:
    """:func:`_picked` from the scored rows' hidden states, through the output layer.

    A plain linear head scores the targets without their (rows x V) logits
    (:func:`~branchgym.agents.forward.target_logprobs.target_logprobs`); the logit positions
    (few) and any other head go through ``head`` itself.
    """
    n = len(tgt)
    if not fusable(head):
        return _picked(head(hidden), packs, tgt, logit_positions, device)
    picked = target_logprobs(hidden[:n], head, torch.tensor(tgt, dtype=torch.long, device=device))
    rest = head(hidden[n:]).float() if logit_positions else None
    return _split(picked, rest, packs, logit_positions)


def _picked(
    logits: Tensor,
    packs: Sequence[Pack],
    tgt: list[int],
    logit_positions: Sequence[Sequence[int]] | None,
    device: torch.device,
) -> tuple[list[Tensor], list[Tensor]]:
    """Split the scored rows' logits into per-pack target log-probs and logit rows."""
    logits = logits.float()
    n = len(tgt)
    picked = torch.log_softmax(logits[:n], dim=-1).gather(
        -1, torch.tensor(tgt, dtype=torch.long, device=device)[:, None]
    )[:, 0]
    return _split(picked, logits[n:], packs, logit_positions)


def _split(
    picked: Tensor,
    rest: Tensor | None,
    packs: Sequence[Pack],
    logit_positions: Sequence[Sequence[int]] | None,
) -> tuple[list[Tensor], list[Tensor]]:
    """Per pack: its targets' log-probs (``picked``) and its logit rows (``rest``)."""
    out, extra, at = [], [], 0
    for p in packs:
        out.append(picked[at : at + len(p.targets)])
        at += len(p.targets)
    at = 0
    for where in logit_positions or []:
        extra.append(rest[at : at + len(where)])  # type: ignore[index]
        at += len(where)
    return out, extra


def backbone(model: Any) -> tuple[Any, Any]:
    """``(transformer, output layer)`` of a causal LM, or ``(None, None)``.

    A PEFT model (LoRA) is unwrapped to the model its adapters were injected into: the
    adapters live inside its layers, so the unwrapped transformer runs them (and honours
    ``disable_adapter()``, the KL reference).
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    base = getattr(inner, "base_model", None)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if base is None or head is None or base is inner:
        return None, None
    return base, head


@dataclasses.dataclass
class PackedTree:
    """Where one input pack went in :func:`pack_trees`.

    Attributes:
        pack: Index of the merged pack.
        offset: Its first target among the merged pack's targets (they stay in order).
        index: Each of its token indices -> the merged pack's index of that token.
    """

    pack: int
    offset: int
    index: list[int]


def pack_trees(packs: Sequence[Pack], keys: Sequence[Any]) -> tuple[list[Pack], list[PackedTree]]:
    """Merge the packs that share a key (a tree) into one pack each: tree packing.

    The main sequences (tokens before the first segment) are put in a token trie: a pack
    reuses the longest prefix an earlier pack of its key already holds and adds the rest
    as a segment continuing the last shared token, so each shared prefix is read once.
    Its own side branches (scoring candidates) are copied after it, re-attached; its
    targets keep their order, so its scores are a contiguous slice of the merged pack's.

    Returns:
        The merged packs (in order of each key's first pack) and, per input pack, a
        :class:`PackedTree` that finds its targets and tokens in them.
    """
    merged: list[Pack] = []
    tries: dict[Any, tuple[int, dict[tuple[int, int], int]]] = {}
    where: list[PackedTree] = []
    for p, key in zip(packs, keys, strict=True):
        if key not in tries:
            tries[key] = (len(merged), {})
            merged.append(Pack([]))
        m, children = tries[key]
        out = merged[m]
        first = min([s for s, _, _ in p.segments] + [len(p.tokens)])
        index: list[int] = []
        node = -1
        j = 0
        while j < first and (node, p.tokens[j]) in children:
            node = children[(node, p.tokens[j])]
            index.append(node)
            j += 1
        if j < first:
            start = len(out.tokens)
            if start:  # the first pack of a key is the merged pack's dialogue
                out.segments.append((start, start + first - j, node + 1))
            for t in p.tokens[j:first]:
                children[(node, t)] = len(out.tokens)
                node = len(out.tokens)
                index.append(node)
                out.tokens.append(t)
        for start, end, attach in p.segments:
            at = len(out.tokens)
            index.extend(range(at, at + end - start))
            out.tokens.extend(p.tokens[start:end])
            out.segments.append((at, at + end - start, index[attach - 1] + 1 if attach else 0))
        where.append(PackedTree(m, len(out.targets), index))
        out.targets.extend((index[pred] if pred >= 0 else pred, tok) for pred, tok in p.targets)
    return merged, where


def pair_cost(model: Any) -> float:
    """One attention pair's cost in units of one token's linear layers (from the config).

    Per layer a token costs about twice the layer's weights in FLOPs; a (query, key) pair
    costs ``4 x hidden`` (scores and the weighted sum), times :data:`ATTENTION_PENALTY`
    (a masked attention kernel runs below matmul speed). Without a config: ``1e-3``.
    """
    cfg = getattr(model, "config", None)
    hidden = getattr(cfg, "hidden_size", None)
    if not hidden:
        return 1e-3
    heads = getattr(cfg, "num_attention_heads", None) or 1
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    ff = getattr(cfg, "intermediate_size", None) or 4 * hidden
    weights = hidden * hidden * (2 + 2 * kv / heads) + 3 * hidden * ff
    return ATTENTION_PENALTY * 4 * hidden / (2 * weights)


#: How much slower a masked attention pair runs than the FLOP count says, against matmuls
#: (``branchgym bench packing`` on CPU; docs/learners.md, Memory).
ATTENTION_PENALTY = 2.0


def pass_cost(lengths: Sequence[int], pair: float) -> float:
    """Cost of forwarding sequences of ``lengths``: tokens plus ``pair`` per attention pair."""
    return float(sum(n + pair * n * n for n in lengths))


def pack_cost(packs: Sequence[Pack], pair: float, *, cut: int = 0) -> float:
    """What one pass over ``packs`` computes at ``cut``, padding included.

    ``cut=0``: one padded batch with a dense mask (rows x longest tokens, and that
    squared in attention pairs per row). ``cut >= 1``:
    :func:`~branchgym.agents.forward.levels.level_forward`'s calls, each a padded batch
    of its rows (:func:`~branchgym.agents.forward.levels.call_shapes`), each call after
    the first adding :data:`~branchgym.agents.forward.levels.CALL_COST` tokens.
    Padding counts because it is computed: a row holding a branch and its nested
    branches makes every row of its call that long.
    """
    if not packs:
        return 0.0
    if not cut or not any(p.segments for p in packs):
        width = max(len(p.tokens) for p in packs)
        return float(len(packs) * (width + pair * width * width))
    shapes = call_shapes(packs, cut)
    tokens = sum(rows * own for rows, own, _ in shapes)
    pairs = sum(rows * own * (past + own) for rows, own, past in shapes)
    return tokens + CALL_COST * (len(shapes) - 1) + pair * pairs


def best_cut(packs: Sequence[Pack], pair: float, *, most: int = 3) -> int:
    """The cheapest way to read ``packs`` under :func:`pack_cost`.

    0 is the dense mask, ``c >= 1`` the ``cut`` of
    :func:`~branchgym.agents.forward.levels.level_forward` (at most ``most``).
    """
    return _cheapest_read(packs, pair, most)[0]


def _cheapest_read(packs: Sequence[Pack], pair: float, most: int = 3) -> tuple[int, float]:
    """``(cut, pack_cost)`` of the cheapest read of ``packs`` (dense for plain packs)."""
    if not any(p.segments for p in packs):
        return 0, pack_cost(packs, pair)
    costs = {c: pack_cost(packs, pair, cut=c) for c in range(most + 1)}
    cut = min(costs, key=lambda c: (costs[c], c))
    return cut, costs[cut]


def plan_packs(
    packs: Sequence[Pack],
    trees: Sequence[Any] | None,
    *,
    pair: float = 1e-3,
    levels: bool = False,
    flat: bool = False,
) -> tuple[list[Pack], list[PackedTree]]:
    """The packs a forward pass reads: each tree's rows merged by :func:`pack_trees` where it pays.

    A tree's rows go into the number of merged packs (consecutive rows each) whose
    :func:`pass_cost` is lowest: one pack reads every shared prefix once, but its dense
    4-D mask grows with the square of its length, so a tree with long branches may be
    read fastest as a few packs (the prefix once per pack), and a tree whose rows share
    nothing as its rows. Exact either way: the choice changes how often a prefix is
    read, never a log-prob. ``trees=None`` keeps every pack. ``levels``: a merged pack
    may also be read over a key/value cache (:func:`packed_forward`'s ``cut``), where it
    attends about what its rows attend; it is priced at the cheaper of the two reads.
    ``flat``: the packs will be read flat (:data:`FLAT`), where a token costs the same
    whatever pack holds it and attention is priced per piece, so merging always pays:
    every tree goes into one token trie with the trees before it (a prompt or system
    prompt that several trees share is read once too), one trie per
    :data:`FORWARD_TOKENS` of trees.

    Returns:
        The packs and, per input pack, where it went (:class:`PackedTree`).
    """
    if trees is None:
        plain = list(packs)
        return plain, [PackedTree(i, 0, list(range(len(p.tokens)))) for i, p in enumerate(plain)]
    if flat:
        return pack_trees(packs, _budget_groups(packs, trees))

    def tree_cost(ps: Sequence[Pack]) -> float:
        if not levels:
            return pass_cost([len(p.tokens) for p in ps], pair)
        return _cheapest_read(ps, pair)[1]  # as packed_forward's best_cut will read it

    members: dict[Any, list[int]] = {}
    for i, key in enumerate(trees):
        members.setdefault(key, []).append(i)
    out: list[Pack] = []
    placed: list[PackedTree | None] = [None] * len(packs)
    for own in members.values():
        n = len(own)
        best = tree_cost([packs[i] for i in own])
        plan: tuple[list[Pack], list[PackedTree]] | None = None  # None: the rows as they are
        # one pack, or a few (at most 8, or one per row): the candidates stay cheap to build
        for k in sorted({-(-n // g) for g in range(1, min(n, 8) + 1)}, reverse=True):
            if k == 1:
                continue
            merged, where = pack_trees([packs[i] for i in own], [j // k for j in range(n)])
            cost = tree_cost(merged)
            if cost < best:
                best, plan = cost, (merged, where)
        if plan is None:
            for i in own:
                placed[i] = PackedTree(len(out), 0, list(range(len(packs[i].tokens))))
                out.append(packs[i])
            continue
        merged, where = plan
        for i, w in zip(own, where, strict=True):
            placed[i] = PackedTree(len(out) + w.pack, w.offset, w.index)
        out.extend(merged)
    return out, [w for w in placed if w is not None]


def _budget_groups(packs: Sequence[Pack], trees: Sequence[Any]) -> list[int]:
    """A key per pack: consecutive trees share one while their unique tokens fit.

    The budget is :data:`FORWARD_TOKENS`; a larger tree keeps a key of its own.
    """
    members: dict[Any, list[int]] = {}
    for i, key in enumerate(trees):
        members.setdefault(key, []).append(i)
    group_of: dict[Any, int] = {}
    group, used = 0, 0
    for key, own in members.items():
        merged, _ = pack_trees([packs[i] for i in own], [0] * len(own))
        size = len(merged[0].tokens)
        if used and used + size > FORWARD_TOKENS:
            group, used = group + 1, 0
        group_of[key] = group
        used += size
    return [group_of[key] for key in trees]


def packing_exact(model: Any) -> str | None:
    """None when the model computes packed passes exactly; else why it does not.

    A packed pass hands the model a 4-D mask: eager and SDPA attention apply it as given.
    Flash-attention kernels take no custom mask (they would attend across branches), and a
    sliding window built from positions is not applied to a custom mask, so a tree
    longer than the window would see tokens its own row could not.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = getattr(inner, "config", None)
    if cfg is None:
        return None
    impl = getattr(cfg, "_attn_implementation", None) or "eager"
    if impl not in ("eager", "sdpa"):
        return f"attention {impl!r} takes no 4-D mask (eager and sdpa do)"
    layer_types = getattr(cfg, "layer_types", None) or []
    windowed = "sliding_attention" in layer_types or (
        getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", False)
    )
    if windowed:
        return "the model has sliding-window layers, which a custom 4-D mask bypasses"
    return None


#: :func:`packed_forward`'s ``cut`` of the flat read
#: (:func:`~branchgym.agents.forward.flat.flat_forward`: every token once, no padding).
FLAT = -1

#: Padded tokens (rows x longest row) per forward pass of :func:`bucketed_forward`.
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


def bucketed_forward(
    model: Any,
    packs: Sequence[Pack],
    device: torch.device,
    *,
    logit_positions: Sequence[Sequence[int]] | None = None,
    trees: Sequence[Any] | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """:func:`packed_forward` over :func:`length_buckets`; results in the packs' order.

    ``trees`` (a key per pack, e.g. its rollout tree) turns on tree packing: packs of one
    key are merged where it pays (:func:`plan_packs`) and their results read back per
    input pack. Packs without side branches and packs with them go through separate
    passes, so plain rows keep the causal path.
    """
    if trees is not None:
        base = backbone(model)[0]
        merged, where = plan_packs(
            packs,
            trees,
            pair=pair_cost(model),
            levels=levels_supported(model, base),
            flat=flat_supported(model, base),
        )
        positions = None
        if logit_positions is not None:
            positions = [[] for _ in merged]
            for w, pos in zip(where, logit_positions, strict=True):
                positions[w.pack].extend(w.index[q] for q in pos)
        scores, extra = bucketed_forward(model, merged, device, logit_positions=positions)
        out = [
            scores[w.pack][w.offset : w.offset + len(p.targets)]
            for w, p in zip(where, packs, strict=True)
        ]
        if logit_positions is None:
            return out, []
        taken = [0] * len(merged)
        rows = []
        for w, pos in zip(where, logit_positions, strict=True):
            rows.append(extra[w.pack][taken[w.pack] : taken[w.pack] + len(pos)])
            taken[w.pack] += len(pos)
        return out, rows
    kinds = [[i for i, p in enumerate(packs) if not p.segments]]
    kinds.append([i for i, p in enumerate(packs) if p.segments])
    buckets = [
        [kind[j] for j in b]
        for kind in kinds
        if kind
        for b in length_buckets([len(packs[i].tokens) for i in kind], FORWARD_TOKENS)
    ]
    if len(buckets) == 1:
        return packed_forward(model, packs, device, logit_positions=logit_positions)
    scores: dict[int, Tensor] = {}
    extra: dict[int, Tensor] = {}
    for b in buckets:
        where = [logit_positions[i] for i in b] if logit_positions is not None else None
        s, e = packed_forward(model, [packs[i] for i in b], device, logit_positions=where)
        scores.update(zip(b, s, strict=True))
        extra.update(zip(b, e, strict=False))  # e is empty without logit positions
    return [scores[i] for i in range(len(packs))], [extra[i] for i in sorted(extra)]
