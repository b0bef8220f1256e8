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

    grouped = key.shape[1] != query.shape[1]
    if attention_mask is None or not grouped or kwargs.get("position_bias") is not None:
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
