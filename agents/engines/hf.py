"""HFEngine: sampling on transformers with exact entropies and prefix KV reuse.

Temperature-1 sampling with no truncation (the distribution the learners treat as
``pi_old``), implemented as an explicit decode loop rather than ``model.generate`` so
that every step yields:

* the sampled token's log-prob under the full softmax,
* the exact entropy ``-sum_v p_v log p_v`` of the full next-token distribution
  (algorithms.md eq. 3's per-token term), and
* the top-20 estimate BranchOPD uses (renormalised top-20 probabilities, ``U_t``).

Prefix reuse (``reuse_prefix=True``): the K-1 siblings of a branch point share their
whole context, so the prompt is prefilled once and its KV cache is repeated across the
batch of n samples, instead of being recomputed n times. A small LRU of prefilled
contexts (``prefix_cache_entries``) also lets a multi-turn dialogue prefill only its
new tokens each turn, and lets siblings start from the KV cache the backbone built at
that state. ``branchgym bench engine`` measures both.

Runs on CPU (float32) here and on CUDA with bfloat16 when a GPU is present.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from branchgym.error import DependencyMissingError, EngineError

try:
    import torch
except ImportError as exc:  # pragma: no cover - the llm extra is missing
    raise DependencyMissingError.for_extra("HFEngine", "llm", "torch") from exc

__all__ = ["Generation", "HFEngine", "TOPK_ENTROPY"]

#: k of BranchOPD's top-k entropy estimate.
TOPK_ENTROPY = 20


@dataclasses.dataclass
class Generation:
    """One sampled completion.

    Attributes:
        token_ids: Forced prefix tokens, then the sampled ones (stop token included).
        logprobs: Log-prob of each token under the model at temperature 1.
        entropies: Exact entropy of the next-token distribution at each token.
        entropies_top20: Entropy from the renormalised top-20 probabilities.
        prefix_len: Tokens that were forced, not sampled.
        finish_reason: ``stop`` (a stop token) or ``length``.
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    entropies: np.ndarray
    entropies_top20: np.ndarray
    prefix_len: int
    finish_reason: str


def _stats(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probs, exact entropy, top-k entropy) of ``logits[..., V]`` in float32."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ent = -(lp.exp() * lp).sum(-1)
    top = torch.topk(lp, min(k, lp.shape[-1]), dim=-1).values
    top = top - torch.logsumexp(top, dim=-1, keepdim=True)
    ent_k = -(top.exp() * top).sum(-1)
    return lp, ent, ent_k


class HFEngine:
    """Generation engine on a transformers causal LM.

    Args:
        model: A causal LM (``AutoModelForCausalLM``).
        tokenizer: Its tokenizer.
        device: ``cpu``/``cuda``; default CUDA when available.
        dtype: Weights' dtype; default bfloat16 on CUDA, float32 on CPU.
        max_new_tokens: Default cap on sampled tokens per completion.
        stop_token_ids: Tokens that end a completion (default: the tokenizer's eos).
        reuse_prefix: Prefill a shared prompt once for its n samples (default True).
        prefix_cache_entries: Prefilled contexts kept for later calls (0 disables).
        topk: k of the top-k entropy estimate (20).
        threads: CPU threads for torch (``torch.set_num_threads``; process-wide). One
            thread is fastest for tiny models on a shared CPU; None leaves torch's choice.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        device: str | None = None,
        dtype: Any = None,
        max_new_tokens: int = 48,
        stop_token_ids: Sequence[int] | None = None,
        reuse_prefix: bool = True,
        prefix_cache_entries: int = 16,
        topk: int = TOPK_ENTROPY,
        threads: int | None = None,
    ) -> None:
        """Move the model to its device and dtype and set the stop tokens."""
        if threads is not None:
            torch.set_num_threads(int(threads))
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None:
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.tokenizer = tokenizer
        self.max_new_tokens = int(max_new_tokens)
        if stop_token_ids is None:
            eos = tokenizer.eos_token_id
            stop_token_ids = [] if eos is None else [int(eos)]
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self.reuse_prefix = reuse_prefix
        self.prefix_cache_entries = int(prefix_cache_entries)
        self.topk = int(topk)
        self._cache: collections.OrderedDict[tuple[int, ...], tuple[Any, torch.Tensor]] = (
            collections.OrderedDict()
        )
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.stats = {"prefill_tokens": 0, "cached_tokens": 0, "decode_steps": 0}

    @classmethod
    def from_pretrained(cls, name: str, **kwargs: Any) -> HFEngine:
        """``tiny``, ``smollm2`` or a model folder (see ``models.load_model``)."""
        from branchgym.agents.models import load_model

        model, tok = load_model(name)
        return cls(model, tok, **kwargs)

    # ------------------------------------------------------------------ prefill
    def clear_cache(self) -> None:
        """Drop every cached prefix."""
        self._cache.clear()

    def _lookup(self, ids: tuple[int, ...]) -> tuple[int, Any, torch.Tensor | None]:
        """Longest cached prefix of ``ids``: (length, a private copy of its cache, logits)."""
        best, hit = 0, None
        for key, val in self._cache.items():
            if len(key) <= len(ids) and len(key) > best and ids[: len(key)] == key:
                best, hit = len(key), (key, val)
        if hit is None:
            return 0, None, None
        self._cache.move_to_end(hit[0])
        cache, logits = hit[1]
        return best, copy.deepcopy(cache), logits

    def _store(self, ids: tuple[int, ...], cache: Any, logits: torch.Tensor) -> None:
        if self.prefix_cache_entries <= 0:
            return
        self._cache[ids] = (copy.deepcopy(cache), logits)
        self._cache.move_to_end(ids)
        while len(self._cache) > self.prefix_cache_entries:
            self._cache.popitem(last=False)

    def _forward(self, ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
        return out.logits, out.past_key_values

    def _prefill(self, ids: Sequence[int], use_cache: bool) -> tuple[Any, torch.Tensor]:
        """KV cache of ``ids`` (batch 1) and the logits row that predicts the next token."""
        from transformers import DynamicCache

        key = tuple(int(t) for t in ids)
        start, cache, last = self._lookup(key) if use_cache else (0, None, None)
        if start == len(key) and last is not None:
            self.stats["cached_tokens"] += start
            return cache, last
        logits, cache = self._forward(
            torch.tensor([key[start:]], device=self.device),
            cache if cache is not None else DynamicCache(),
        )
        self.stats["prefill_tokens"] += len(key) - start
        self.stats["cached_tokens"] += start
        last = logits[0, -1:].clone()
        if use_cache:
            self._store(key, cache, last)
        return cache, last

    # ------------------------------------------------------------------ sampling
    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int | Sequence[int] = 1,
        *,
        prefixes: Sequence[Sequence[int]] | None = None,
        max_new_tokens: int | None = None,
        seed: int | None = None,
        reuse_prefix: bool | None = None,
    ) -> list[list[Generation]]:
        """Sample ``n[i]`` completions of each prompt at temperature 1.

        Args:
            prompts: Token ids of each prompt.
            n: Samples per prompt (an int for all).
            prefixes: Tokens each completion of prompt ``i`` must start with (a fork
                inside a turn); their log-probs and entropies are reported too.
            max_new_tokens: Cap on sampled tokens (default: the engine's).
            seed: Seed of the sampling noise (same seed, same samples).
            reuse_prefix: Override the engine's setting for this call.
        """
        counts = [n] * len(prompts) if isinstance(n, int) else list(n)
        if len(counts) != len(prompts):
            raise EngineError(f"{len(prompts)} prompts but {len(counts)} sample counts")
        prefixes = prefixes or [()] * len(prompts)
        reuse = self.reuse_prefix if reuse_prefix is None else reuse_prefix
        gen = torch.Generator(device=self.device)
        # without a seed, fresh OS entropy (torch.seed() would reseed torch's global RNG)
        gen.manual_seed(int(seed) if seed is not None else int.from_bytes(os.urandom(7), "big"))
        limit = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        return [
            self._sample(list(p), list(f), k, limit, gen, reuse) if k > 0 else []
            for p, f, k in zip(prompts, prefixes, counts, strict=True)
        ]

    def _sample(
        self,
        prompt: list[int],
        prefix: list[int],
        n: int,
        limit: int,
        gen: torch.Generator,
        reuse: bool,
    ) -> list[Generation]:
        if not prompt:
            raise EngineError("an empty prompt cannot be continued; give at least one token")
        ctx = prompt + prefix
        if len(ctx) + limit > self.max_positions:
            raise EngineError(
                f"prompt of {len(ctx)} tokens + {limit} new exceeds the model's "
                f"{self.max_positions} positions; shorten the dialogue or max_new_tokens."
            )
        if reuse:
            cache, rows = self._prefill(prompt, use_cache=self.prefix_cache_entries > 0)
            if prefix:  # forced tokens: their rows give their log-probs and entropies
                logits, cache = self._forward(torch.tensor([prefix], device=self.device), cache)
                self.stats["prefill_tokens"] += len(prefix)
                rows = torch.cat([rows, logits[0]], dim=0)
            if n > 1:
                cache.batch_repeat_interleave(n)
        else:  # recompute the shared context once per sample, as independent requests do
            from transformers import DynamicCache

            logits, cache = self._forward(
                torch.tensor([ctx] * n, device=self.device), DynamicCache()
            )
            self.stats["prefill_tokens"] += n * len(ctx)
            rows = logits[0, len(prompt) - 1 :]
        # log-probs and entropies of the forced prefix tokens
        pre_lp, pre_ent, pre_k = [], [], []
        if prefix:
            lp, ent, ent_k = _stats(rows[:-1], self.topk)
            idx = torch.tensor(prefix, device=lp.device)
            pre_lp = lp.gather(-1, idx[:, None])[:, 0].tolist()
            pre_ent, pre_k = ent.tolist(), ent_k.tolist()
        logits = rows[-1:].expand(n, -1)
        toks: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        ents: list[list[float]] = [[] for _ in range(n)]
        entk: list[list[float]] = [[] for _ in range(n)]
        done = [False] * n
        stops = set(self.stop_token_ids)
        for _ in range(limit):
            lp, ent, ent_k = _stats(logits, self.topk)
            # Gumbel-max: an exact sample from softmax(logits), reproducible from `gen`
            u = torch.rand(lp.shape, generator=gen, device=lp.device).clamp_(1e-20, 1.0)
            nxt = torch.argmax(lp - torch.log(-torch.log(u)), dim=-1)
            chosen = lp.gather(-1, nxt[:, None])[:, 0]
            nxt_l, ch_l, ent_l, entk_l = nxt.tolist(), chosen.tolist(), ent.tolist(), ent_k.tolist()
            for i in range(n):
                if done[i]:
                    continue
                toks[i].append(nxt_l[i])
                lps[i].append(ch_l[i])
                ents[i].append(ent_l[i])
                entk[i].append(entk_l[i])
                done[i] = nxt_l[i] in stops
            self.stats["decode_steps"] += 1
            if all(done):
                break
            logits, cache = self._forward(nxt[:, None], cache)
            logits = logits[:, -1]
        return [
            Generation(
                token_ids=np.asarray(prefix + toks[i], dtype=np.int64),
                logprobs=np.asarray(pre_lp + lps[i], dtype=np.float32),
                entropies=np.asarray(pre_ent + ents[i], dtype=np.float32),
                entropies_top20=np.asarray(pre_k + entk[i], dtype=np.float32),
                prefix_len=len(prefix),
                finish_reason="stop" if done[i] else "length",
            )
            for i in range(n)
        ]

    # ------------------------------------------------------------------ scoring
    @torch.inference_mode()
    def score(
        self, prompt: Sequence[int], completions: Sequence[Sequence[int]]
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Log-prob and exact entropy of each completion token given ``prompt``.

        One forward pass over ``prompt + completion`` (the prompt's KV from the prefix
        cache when present): what a teacher does in BranchOPD and what tests compare
        sampled log-probs against.
        """
        out = []
        for comp in completions:
            comp = [int(t) for t in comp]
            if not comp:
                out.append((np.zeros(0, np.float32), np.zeros(0, np.float32)))
                continue
            cache, rows = self._prefill(list(prompt), use_cache=self.prefix_cache_entries > 0)
            if len(comp) > 1:
                logits, _ = self._forward(torch.tensor([comp[:-1]], device=self.device), cache)
            allrows = rows if len(comp) == 1 else torch.cat([rows, logits[0]], dim=0)
            lp, ent, _ = _stats(allrows, self.topk)
            idx = torch.tensor(comp, device=lp.device)
            chosen = lp.gather(-1, idx[:, None])[:, 0]
            out.append(
                (chosen.cpu().numpy().astype(np.float32), ent.cpu().numpy().astype(np.float32))
            )
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` without special tokens."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)
