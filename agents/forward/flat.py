"""Packed forward passes over unpadded tokens: every token once, attention per piece.

The dense read of :func:`~branchgym.agents.forward.packed.packed_forward` scores every token of
a pack against every other (a 4-D mask); the key/value-cache read of
:func:`~branchgym.agents.forward.levels.level_forward` attends only what each row sees but
pads every row of a call to the longest one, and the linear layers (most of a small
model's work) compute the padding too. :func:`flat_forward` computes the packs as one
row of exactly their tokens, so the linear layers, the norms and the MLP see each
token once and nothing else. Only attention knows the tree: the model runs with the
``branchgym_tree`` attention function (registered in transformers' attention
interface), which, for each piece of a pack (its dialogue, each segment; the pieces of
:func:`~branchgym.agents.forward.levels.pieces`), scores the piece's queries against the
keys of its context and its own keys (causally), nothing else. Pieces of similar shape
share one padded scaled-dot-product call, so padding costs only attention, and only
within a group (:func:`plan`).

Log-probs and gradients are those of the dense read to float rounding (the same
products, summed in another order): the per-learner tests compare them with the rows
read one by one. Where it applies (:func:`flat_supported`): a transformers model whose
attention layers call the attention interface with no sliding window or soft cap (the
probe runs a three-token tree once per model class and checks every layer went
through the tree attention), not in gradient-checkpointed training (a recomputed layer
would run outside the pass). Elsewhere the learners use the other two reads
(docs/learners.md, Tree packing).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

from branchgym.agents.forward.levels import pieces
from branchgym.agents.forward.pack import Pack
from branchgym.error import DependencyMissingError, TrainingConfigError

try:
    import torch
    from torch import Tensor
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra("branchgym.agents.forward.flat", "llm", "torch") from exc

__all__ = ["ATTENTION", "TreePlan", "flat_forward", "flat_supported", "plan"]

#: The attention implementation name registered in transformers' ``AttentionInterface``.
ATTENTION = "branchgym_tree"

#: A group of pieces pads its (queries x keys) area at most this much over its pieces' own
#: areas (plus :data:`_SLACK` pairs) before a new group starts.
_PAD_RATIO = 1.5
_SLACK = 4096

_PLAN: contextvars.ContextVar[TreePlan | None] = contextvars.ContextVar(ATTENTION, default=None)


@dataclasses.dataclass
class _Group:
    """Pieces read by one padded attention call.

    Attributes:
        q: ``(G, qmax)`` flat index of each query slot (padding: 0).
        kv: ``(G, kmax)`` flat index of each key slot (padding: 0).
        mask: ``(G, 1, qmax, kmax)``: which keys each query sees.
        take: Real query slots in ``(G * qmax)`` order.
    """

    q: Tensor
    kv: Tensor
    mask: Tensor
    take: Tensor


@dataclasses.dataclass
class TreePlan:
    """What the tree attention reads for one flat pass (:func:`plan`).

    Attributes:
        tokens: Tokens of the flat row (every pack's, in order).
        groups: The padded attention calls of each layer.
        back: Row of each flat token among the groups' real query slots, concatenated.
        layers: Layers that ran the tree attention (counted, to catch a model that
            bypasses it).
    """

    tokens: int
    groups: list[_Group]
    back: Tensor
    layers: int = 0

    def to(self, device: torch.device) -> TreePlan:
        """The plan with its index tensors on ``device``."""
        groups = [
            _Group(g.q.to(device), g.kv.to(device), g.mask.to(device), g.take.to(device))
            for g in self.groups
        ]
        return TreePlan(self.tokens, groups, self.back.to(device))


def plan(packs: Sequence[Any]) -> TreePlan:
    """The tree attention's plan for ``packs`` laid end to end in one row.

    Each piece (a pack's dialogue, or a segment) attends its context (what its attach
    point sees, and that point) and itself causally. Pieces are sorted by their key and
    query lengths and grouped while a group's padded area stays within
    :data:`_PAD_RATIO` of its pieces' own.
    """
    shapes: list[tuple[list[int], list[int]]] = []  # (query indices, context indices)
    offset = 0
    for p in packs:
        for pc in pieces(len(p.tokens), p.segments):
            own = list(range(offset + pc.start, offset + pc.end))
            shapes.append((own, [offset + c for c in pc.context]))
        offset += len(p.tokens)

    def size(j: int) -> tuple[int, int]:
        own, ctx = shapes[j]
        return len(ctx) + len(own), len(own)

    order = sorted(range(len(shapes)), key=size)
    grouped: list[list[int]] = []
    qmax = kmax = area = 0
    for j in order:
        q = len(shapes[j][0])
        k = q + len(shapes[j][1])
        if grouped:
            nq, nk = max(qmax, q), max(kmax, k)
            if (len(grouped[-1]) + 1) * nq * nk <= _PAD_RATIO * (area + q * k) + _SLACK:
                grouped[-1].append(j)
                qmax, kmax, area = nq, nk, area + q * k
                continue
        grouped.append([j])
        qmax, kmax, area = q, k, q * k
    groups, order_q = [], []
    for members in grouped:
        qm = max(len(shapes[j][0]) for j in members)
        km = max(len(shapes[j][0]) + len(shapes[j][1]) for j in members)
        g = len(members)
        qi = torch.zeros(g, qm, dtype=torch.long)
        ki = torch.zeros(g, km, dtype=torch.long)
        mask = torch.zeros(g, 1, qm, km, dtype=torch.bool)
        mask[:, 0, :, 0] = True  # padding queries see one key (their output is dropped)
        take = []
        for r, j in enumerate(members):
            own, ctx = shapes[j]
            n, c = len(own), len(ctx)
            qi[r, :n] = torch.as_tensor(own, dtype=torch.long)
            ki[r, : c + n] = torch.as_tensor(ctx + own, dtype=torch.long)
            mask[r, 0, :n, 0] = False
            mask[r, 0, :n, :c] = True
            mask[r, 0, :n, c : c + n] = torch.tril(torch.ones(n, n, dtype=torch.bool))
            take.extend(range(r * qm, r * qm + n))
            order_q.extend(own)
        groups.append(_Group(qi, ki, mask, torch.as_tensor(take, dtype=torch.long)))
    back = torch.empty(offset, dtype=torch.long)
    back[torch.as_tensor(order_q, dtype=torch.long)] = torch.arange(offset)
    return TreePlan(offset, groups, back)


def tree_attention(
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The attention function of the ``branchgym_tree`` implementation.

    ``query`` ``(1, heads, T, d)``, ``key``/``value`` ``(1, kv heads, T, d)`` of the flat
    row; returns ``(1, T, heads, d)`` as every attention function does.
    """
    tree = _PLAN.get()
    if tree is None:
        raise TrainingConfigError(
            f"attention {ATTENTION!r} runs only inside flat_forward; load the model with "
            "attn_implementation='sdpa' or 'eager' for other passes."
        )
    if kwargs.get("sliding_window") or kwargs.get("softcap"):
        raise TrainingConfigError(
            f"attention {ATTENTION!r} applies no sliding window or soft cap; this model "
            "needs the dense packed read."
        )
    if query.shape[0] != 1 or query.shape[2] != tree.tokens:
        raise TrainingConfigError(
            f"attention {ATTENTION!r} got queries of shape {tuple(query.shape)} for a plan of "
            f"{tree.tokens} tokens in one row."
        )
    heads, kv_heads = query.shape[1], key.shape[1]
    q, k, v = query[0], key[0], value[0]  # (heads, T, d)
    p = dropout if module is None or getattr(module, "training", False) else 0.0

    def rows(x: Tensor, idx: Tensor) -> Tensor:
        # (h, T, d) at idx (G, n) -> (G, h, n, d). index_select, not x[:, idx]: its
        # backward adds into the gradient (index_add) instead of an accumulating index_put
        # that sorts the indices: a fifth of the flat forward and backward in a profile
        h, d = x.shape[0], x.shape[-1]
        return x.index_select(1, idx.reshape(-1)).view(h, *idx.shape, d).transpose(0, 1)

    outs = []
    for g in tree.groups:
        o = torch.nn.functional.scaled_dot_product_attention(
            rows(q, g.q),
            rows(k, g.kv),  # the key/value heads themselves: grouped-query attention
            rows(v, g.kv),  # reads them without copying each one per query head
            attn_mask=g.mask,
            dropout_p=p,
            scale=scaling,
            enable_gqa=kv_heads != heads,
        )  # (G, heads, qmax, d)
        outs.append(o.transpose(1, 2).reshape(-1, heads, o.shape[-1]).index_select(0, g.take))
    tree.layers += 1
    return torch.cat(outs).index_select(0, tree.back)[None], None


def _register() -> bool:
    try:
        from transformers import AttentionInterface
    except ImportError:  # pragma: no cover - transformers is part of the llm extra
        return False
    AttentionInterface.register(ATTENTION, tree_attention)
    return True


_REGISTERED = _register()


@contextlib.contextmanager
def _tree_attention(base: Any, tree: TreePlan) -> Iterator[None]:
    """Run ``base`` with the tree attention and ``tree`` as its plan."""
    cfg = base.config
    before = cfg._attn_implementation
    token = _PLAN.set(tree)
    cfg._attn_implementation = ATTENTION
    try:
        yield
    finally:
        cfg._attn_implementation = before
        _PLAN.reset(token)


def flat_forward(base: Any, packs: Sequence[Any], device: torch.device) -> Tensor:
    """Hidden state of every token of every pack, in one call over their unpadded tokens.

    Args:
        base: The transformer of a causal LM (``forward.backbone(model)[0]``).
        packs: :class:`~branchgym.agents.forward.packed.Pack` objects.
        device: Where the model runs.

    Returns:
        ``(sum of pack lengths, hidden)``: pack ``i``'s token ``j`` at row
        ``offsets[i] + j`` (packs in order), as :func:`level_forward` returns.
    """
    tree = plan(packs).to(device)
    ids = torch.as_tensor([t for p in packs for t in p.tokens], dtype=torch.long)
    pos = torch.as_tensor([x for p in packs for x in p.positions()], dtype=torch.long)
    with _tree_attention(base, tree):
        out = base(
            input_ids=ids[None].to(device), position_ids=pos[None].to(device), use_cache=False
        )
    layers = getattr(base.config, "num_hidden_layers", None)
    if layers is not None and tree.layers != layers:
        raise TrainingConfigError(
            f"{tree.layers} of the model's {layers} layers ran the tree attention; its "
            "attention does not go through transformers' attention interface, so the flat "
            "read is not exact for it (the dense packed read is)."
        )
    return out.last_hidden_state[0]


_SUPPORT: dict[tuple[type, tuple[str, ...]], bool] = {}


def flat_supported(model: Any, base: Any) -> bool:
    """Whether :func:`flat_forward` computes ``model`` (through ``base``) exactly.

    Probed once per model class and attention configuration (sliding windows, soft caps
    and the attention implementation differ between models of one class): a three-token
    tree through the flat read must run the tree attention in every layer and give the
    dense causal pass's hidden states.
    """
    if not _REGISTERED or base is None or not hasattr(base, "config"):
        return False
    if getattr(model, "is_gradient_checkpointing", False) and model.training:
        return False
    cfg = base.config
    settings = tuple(
        repr(getattr(cfg, name, None))
        for name in ("sliding_window", "use_sliding_window", "layer_types",
                     "attn_logit_softcapping", "_attn_implementation")
    )  # fmt: skip
    kind = (type(base), settings)
    if kind not in _SUPPORT:
        _SUPPORT[kind] = _probe(base)
    return _SUPPORT[kind]


def _probe(base: Any) -> bool:
    try:
        param = next(base.parameters())
    except StopIteration:
        return False
    ids = [1, 2, 3]  # token 3 is a side branch continuing token 1

    def causal(seq: list[int]) -> Tensor:
        return base(input_ids=torch.tensor([seq], device=param.device)).last_hidden_state[0]

    try:
        with torch.no_grad():
            flat = flat_forward(base, [Pack(ids, [(2, 3, 1)])], param.device)
            plain, side = causal(ids[:2]), causal([ids[0], ids[2]])
    except (TrainingConfigError, TypeError, ValueError, RuntimeError):
        return False
    want = torch.cat([plain, side[1:]]).float()
    return bool(torch.allclose(flat.float(), want, atol=1e-3, rtol=1e-3))
