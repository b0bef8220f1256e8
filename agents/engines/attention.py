"""Grouped-query attention with a padding mask, without copying the key/value heads.

transformers' ``sdpa`` attention hands grouped-query attention (SmolLM2: 9 query heads
on 3 key/value heads) to ``scaled_dot_product_attention(enable_gqa=True)`` only when
there is no attention mask. With a mask (every left-padded batch :class:`HFEngine`
decodes) it first repeats each key/value head once per query head: a copy of the whole
KV cache, three times its size, in every layer at every decoded token. On a CPU that
copy costs more than the attention it feeds: in a profile of ``branchgym bench eval``
(8 WebShop episodes in one batch) ``repeat_kv`` took 3.2 of 28.7 seconds, and one
decode step's attention over 8 rows of 3,000 cached tokens takes 0.16 s with the copy
against 0.003 s without it (same outputs, bit for bit).

:func:`masked_gqa` runs a model with the ``branchgym_gqa_sdpa`` implementation, which is
transformers' ``sdpa`` (its mask builder, its function for every call without a mask)
except that a masked grouped-query call reads the key/value heads in place. CPU only:
on CUDA, SDPA's fused kernels refuse a mask with ``enable_gqa`` and fall back to the math
kernel, where the copy is cheaper than that fallback.

A decode step (one query per row, mask or not) skips SDPA altogether: on a CPU its
kernel is slow for a single query, and two grouped matmuls read the cache once
(:func:`_one_query`). Prefill and every other call stay with SDPA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["GQA_SDPA", "gqa_sdpa_attention", "masked_gqa"]

#: The attention implementation name registered in transformers' interfaces.
GQA_SDPA = "branchgym_gqa_sdpa"


def gqa_sdpa_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``sdpa`` attention of transformers; a masked grouped-query call skips ``repeat_kv``.

    ``query`` ``(B, heads, q, d)``, ``key``/``value`` ``(B, kv heads, k, d)``; returns
    ``(B, q, heads, d)`` as every attention function does.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = kwargs.get("position_bias") is None and not kwargs.get("softcap")
    if plain and query.shape[2] == 1 and key.shape[1] and query.shape[1] % key.shape[1] == 0:
        return _one_query(query, key, value, attention_mask, scaling), None
    grouped = key.shape[1] != query.shape[1]
    if attention_mask is None or not grouped or not plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask[:, :, :, : key.shape[-2]],
        dropout_p=dropout,
        scale=scaling,
        is_causal=False,  # the mask carries causality, as in transformers' sdpa path
        enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous(), None


def _one_query(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """Attention of one new token per row (a decode step) as two grouped matmuls.

    Each key/value head's query heads are stacked as rows, ``(B, kv, group, d)``, so the
    cache is read once per key/value head; the softmax is taken in float32. SDPA's CPU
    kernel spends most of a decode step on this shape (16 rows of 1,300 cached tokens, views
    of a larger buffer as the engine's caches are: about 4 ms against 2.9 ms in float32,
    11.7 ms against 3.3 ms in bfloat16).
    """
    b, heads, _, d = query.shape
    kv, length = key.shape[1], key.shape[-2]
    q = query.reshape(b * kv, heads // kv, d)
    # (B, kv) folds into one batch dimension without a copy for a cache view (its rows are
    # whole buffers); torch.matmul on the 4-d view copied the whole cache at every step
    keys, values = key.flatten(0, 1), value.flatten(0, 1)
    scale = d**-0.5 if scaling is None else scaling
    scores = torch.bmm(q, keys.transpose(1, 2)).float().view(b, kv, -1, length) * scale
    if mask is not None:
        mask = mask[:, :, :, :length]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype).view(b * kv, -1, length)
    out = torch.bmm(probs, values)  # (B * kv, group, d)
    return out.reshape(b, 1, heads, d)


def _register() -> bool:
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # pragma: no cover - transformers is part of the llm extra
        return False
    AttentionInterface.register(GQA_SDPA, gqa_sdpa_attention)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    return True


_REGISTERED = _register()


@contextlib.contextmanager
def masked_gqa(model: Any) -> Iterator[None]:
    """Run ``model`` with :data:`GQA_SDPA` inside, when it uses ``sdpa`` on a CPU.

    Any other implementation (eager, flash, branchgym's tree attention) or device is left
    as it is. The configuration is restored on exit, also after an error.
    """
    cfg = getattr(model, "config", None)
    before = getattr(cfg, "_attn_implementation", None)
    device = getattr(model, "device", torch.device("cpu"))
    if not _REGISTERED or before != "sdpa" or torch.device(device).type != "cpu":
        yield
        return
    cfg._attn_implementation = GQA_SDPA
    try:
        yield
    finally:
        cfg._attn_implementation = before
