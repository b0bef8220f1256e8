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
new tokens each turn (a one-sample reply's keys and values, computed while decoding it,
go into the LRU too), and lets siblings start from the KV cache the backbone built at
that state. ``branchgym bench engine`` measures both.

Distinct prompts are run together (``batch_prompts=True``): forward passes grouped by
length prefill every prompt's uncached tokens after its cached prefix (both
left-padded), then the KV
caches are left-padded into one batch with an attention mask and per-row positions, and
one forward pass per token advances every row; rows that stop leave the batch. Each
prompt draws its sampling noise from its own generator (``seeds``), so a prompt samples
the same tokens whether it is decoded alone or in a batch, and its log-probs and
entropies agree to float tolerance (the padded batch only changes summation order).

Runs on CPU (float32) here and on CUDA with bfloat16 when a GPU is present.

The module is over 600 lines because prefill, the prefix LRU, both sampling paths (one
decode loop, :meth:`HFEngine._decode`) and scoring share one KV cache layout.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from branchgym.error import DependencyMissingError, EngineError

try:
    import torch
except ImportError as exc:  # pragma: no cover - the llm extra is missing
    raise DependencyMissingError.for_extra("HFEngine", "llm", "torch") from exc

from branchgym.agents.engines.attention import masked_gqa
from branchgym.agents.engines.linear import onednn_linear

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


def _token_stats(
    rows: torch.Tensor, tokens: Sequence[int], k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-prob of each of ``tokens``, exact entropy, top-k entropy) of ``rows``.

    ``rows`` are the logits that predict the tokens, one row per token.
    """
    lp, ent, ent_k = _stats(rows, k)
    chosen = lp.gather(-1, torch.tensor(list(tokens), device=lp.device)[:, None])[:, 0]
    return chosen, ent, ent_k


#: Rows (candidates x tokens) of one batched :meth:`HFEngine.score` pass: its logits are
#: this many vocabulary rows (49152 x 4 bytes each for SmolLM2).
SCORE_ROWS = 512


def _common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    """Tokens every sequence starts with, leaving each at least one token of its own."""
    most = min(len(s) for s in seqs) - 1
    n = 0
    while n < most and all(s[n] == seqs[0][n] for s in seqs):
        n += 1
    return n


def _first_positions(cache: Any, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's keys and values of a cache's first ``n`` positions (views)."""
    return [(lay.keys[:, :, :n], lay.values[:, :, :n]) for lay in cache.layers]


def _batch_cache(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: int) -> Any:
    """A ``DynamicCache`` of ``rows`` copies of a batch-1 cache's ``layers`` (expanded views)."""
    return _cache_of([(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v in layers])


def _cache_of(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A ``DynamicCache`` that holds each layer's (keys, values) as given: no copy.

    ``DynamicCache(ddp_cache_data=...)`` appends each layer to an empty one with
    ``torch.cat``, a copy of the whole cache: 6.9 of 89 s of a 16-episode batched WebShop
    eval. A ``DynamicLayer`` never writes its tensors in place (it appends by
    concatenation), so holding views of tensors someone else reads is safe.
    """
    from transformers import DynamicCache

    cache = DynamicCache(ddp_cache_data=[(None, None)] * len(layers))
    for layer, (keys, values) in zip(cache.layers, layers, strict=True):
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    return cache


def _room_cache(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], room: int) -> Any:
    """A ``DynamicCache`` of ``layers`` (keys, values) with ``room`` free positions each.

    transformers' ``DynamicLayer`` appends a decode step's keys and values by
    concatenation, which copies (and on CPU freshly allocates) every layer's whole cache
    at every token: the first operator in a profile of a 28-row decode. These layers
    write each step into room allocated once, and hand attention views of it.
    """
    length = layers[0][0].shape[-2] if layers else 0
    return _held_cache([_with_room(k, v, room) for k, v in layers], length)


def _with_room(
    keys: torch.Tensor, values: torch.Tensor, room: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of ``keys`` and ``values`` with ``room`` free positions after them."""
    b, h, n, _ = keys.shape
    buf_k = keys.new_empty((b, h, n + room, keys.shape[-1]))
    buf_v = values.new_empty((b, h, n + room, values.shape[-1]))
    buf_k[:, :, :n] = keys
    buf_v[:, :, :n] = values
    return buf_k, buf_v


def _held_cache(buffers: Sequence[tuple[torch.Tensor, torch.Tensor]], length: int) -> Any:
    """A ``DynamicCache`` whose layers hold ``buffers``, their first ``length`` positions set."""
    from transformers import DynamicCache

    cache = DynamicCache()
    kind = _room_layer_class()
    cache.layers = []
    for buf_k, buf_v in buffers:
        layer = kind()
        layer.hold(buf_k, buf_v, length)
        cache.layers.append(layer)
    return cache


@functools.cache
def _room_layer_class() -> type:
    """:func:`_held_cache`'s layer class (made on first use: transformers loads lazily)."""
    from transformers.cache_utils import DynamicLayer

    class RoomLayer(DynamicLayer):
        """A ``DynamicLayer`` whose keys and values are views of preallocated buffers."""

        def hold(self, buf_k: torch.Tensor, buf_v: torch.Tensor, length: int) -> None:
            """Use ``buf_k``, ``buf_v`` as the buffers; their first ``length`` positions are set."""
            self.buf_k, self.buf_v, self.length = buf_k, buf_v, int(length)
            self.dtype, self.device = buf_k.dtype, buf_k.device
            self.is_initialized = True
            self._views()

        def _views(self) -> None:
            self.keys = self.buf_k[:, :, : self.length]
            self.values = self.buf_v[:, :, : self.length]

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kw: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            end = self.length + key_states.shape[-2]
            if end > self.buf_k.shape[-2]:  # out of room: copy into twice the room, once
                room = max(key_states.shape[-2], self.length)
                self.hold(*_with_room(self.keys, self.values, room), self.length)
            self.buf_k[:, :, self.length : end] = key_states
            self.buf_v[:, :, self.length : end] = value_states
            self.length = end
            self._views()
            return self.keys, self.values

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            order = indices.tolist()
            if all(a < b for a, b in zip(order, order[1:], strict=False)):
                # rows kept in order (a decode dropping its stopped rows): move each kept
                # row's set positions forward within the buffers, in place. Row j takes
                # row order[j] >= j, which no earlier move wrote; a fresh gathered copy
                # costs the whole room and, on a CPU, the page faults of new memory
                for j, src in enumerate(order):
                    if j != src:
                        self.buf_k[j, :, : self.length] = self.buf_k[src, :, : self.length]
                        self.buf_v[j, :, : self.length] = self.buf_v[src, :, : self.length]
                self.buf_k, self.buf_v = self.buf_k[: len(order)], self.buf_v[: len(order)]
            else:
                self.buf_k, self.buf_v = self.buf_k[indices], self.buf_v[indices]
            self._views()

        def batch_repeat_interleave(self, repeats: int) -> None:
            self.buf_k = self.buf_k.repeat_interleave(repeats, dim=0)
            self.buf_v = self.buf_v.repeat_interleave(repeats, dim=0)
            self._views()

        def crop(self, tokens_to_remove: int) -> None:
            self.length = max(0, self.length - abs(int(tokens_to_remove)))
            self._views()

    return RoomLayer


def _cpu_kernels(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run an engine method with the CPU kernels the engine prefers (no-ops elsewhere).

    :func:`~branchgym.agents.engines.attention.masked_gqa`: left-padded batches carry an
    attention mask, and transformers' ``sdpa`` copies every key/value head per query head
    under a mask; this reads them in place.
    :func:`~branchgym.agents.engines.linear.onednn_linear` (``onednn_linear=True``):
    float32 linear layers on oneDNN's kernels, twice as fast as MKL's on an AMD CPU.
    """

    @functools.wraps(method)
    def run(self: HFEngine, *args: Any, **kwargs: Any) -> Any:
        with masked_gqa(self.model), onednn_linear(self.model, self.onednn_linear):
            return method(self, *args, **kwargs)

    return run


#: What one more prefill pass costs, in padded tokens (a pass's fixed work on a CPU).
PASS_TOKENS = 32


def _prefill_passes(lengths: Sequence[int], pass_tokens: int = PASS_TOKENS) -> list[list[int]]:
    """Indices of ``lengths`` (rows' new tokens) split into prefill passes that pad least.

    Rows left-padded into one pass all cost the longest row's length. Sorted by length,
    the rows are cut into runs by dynamic programming over the total cost: each run's
    rows times its longest length, plus ``pass_tokens`` per run.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    best = [0] + [float("inf")] * len(order)
    cut = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        longest = lengths[order[end - 1]]
        for begin in range(end):
            cost = best[begin] + (end - begin) * longest + pass_tokens
            if cost < best[end]:
                best[end], cut[end] = cost, begin
    passes, end = [], len(order)
    while end:
        passes.append(order[cut[end] : end])
        end = cut[end]
    return passes[::-1]


#: A batched decode drops its stopped rows once they are more than this share of the
#: batch (dropping copies every layer's cache; keeping a stopped row costs its compute).
DROP_SHARE = 0.25


@dataclasses.dataclass
class _Decoded:
    """What the decode loop sampled, per batch row: tokens, their stats, stopped or not."""

    toks: list[list[int]]
    lps: list[list[float]]
    ents: list[list[float]]
    entk: list[list[float]]
    done: list[bool]
    last: list[torch.Tensor | None]  # the logits row that predicted the row's last token

    @classmethod
    def empty(cls, rows: int) -> _Decoded:
        """``rows`` rows with nothing sampled yet."""
        return cls(*([[] for _ in range(rows)] for _ in range(4)), [False] * rows, [None] * rows)

    def generation(
        self, r: int, prefix: list[int], pre: tuple[list[float], list[float], list[float]]
    ) -> Generation:
        """Row ``r`` as a :class:`Generation`, after its forced ``prefix`` and its stats."""
        pre_lp, pre_ent, pre_k = pre
        return Generation(
            token_ids=np.asarray(prefix + self.toks[r], dtype=np.int64),
            logprobs=np.asarray(pre_lp + self.lps[r], dtype=np.float32),
            entropies=np.asarray(pre_ent + self.ents[r], dtype=np.float32),
            entropies_top20=np.asarray(pre_k + self.entk[r], dtype=np.float32),
            prefix_len=len(prefix),
            finish_reason="stop" if self.done[r] else "length",
        )


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
        prefix_cache_entries: Prefilled contexts kept for later calls (0 disables); a
            batched call keeps at least one per prompt it decoded, so every line's next
            turn prefills only its new tokens.
        topk: k of the top-k entropy estimate (20).
        threads: CPU threads for torch (``torch.set_num_threads``; process-wide). One
            thread is fastest for tiny models on a shared CPU; None leaves torch's choice.
        batch_prompts: Decode distinct prompts in one left-padded batch (default True);
            False decodes them one after another (each prompt's n samples still batched).
        onednn_linear: On a CPU, run float32 linear layers on oneDNN rather than MKL
            (default True): the same float32 arithmetic in another summation order, about
            twice as fast on AMD CPUs, where MKL takes its AVX2 path (see
            :mod:`branchgym.agents.engines.linear`). False keeps PyTorch's default.
    """

    #: ``generate`` takes ``seeds=`` (one sampling stream per prompt).
    per_prompt_seeds = True

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
        batch_prompts: bool = True,
        onednn_linear: bool = True,
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
        self.batch_prompts = bool(batch_prompts)
        self.onednn_linear = bool(onednn_linear)
        self._working_set = 0  # prompts in the latest batched call (the LRU keeps as many)
        self._cache: collections.OrderedDict[tuple[int, ...], tuple[Any, torch.Tensor]] = (
            collections.OrderedDict()
        )
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        # transformers' causal LMs compute the output layer on the last rows only when asked
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.stats = {"prefill_tokens": 0, "cached_tokens": 0, "decode_steps": 0}

    @classmethod
    def from_pretrained(cls, name: str, **kwargs: Any) -> HFEngine:
        """``tiny``, ``smollm2`` or a model folder (see ``models.load_model``)."""
        from branchgym.agents.policies.models import load_model

        model, tok = load_model(name)
        return cls(model, tok, **kwargs)

    # ------------------------------------------------------------------ prefill
    def clear_cache(self) -> None:
        """Drop every cached prefix."""
        self._cache.clear()

    def _lookup(
        self, ids: tuple[int, ...], private: bool = True
    ) -> tuple[int, Any, torch.Tensor | None]:
        """Longest cached prefix of ``ids``: (length, its cache, logits).

        ``private``: a copy of the cache, which the caller may extend; else the entry's own
        cache, which the caller only reads.
        """
        best, hit = 0, None
        for key, val in self._cache.items():
            if len(key) <= len(ids) and len(key) > best and ids[: len(key)] == key:
                best, hit = len(key), (key, val)
        if hit is None:
            return 0, None, None
        self._cache.move_to_end(hit[0])
        cache, logits = hit[1]
        return best, copy.deepcopy(cache) if private else cache, logits

    def _store(
        self, ids: tuple[int, ...], cache: Any, logits: torch.Tensor, *, owned: bool = False
    ) -> None:
        """Keep ``cache`` (of ``ids``) and the logits row after it; ``owned``: no copy needed."""
        if self.prefix_cache_entries <= 0:
            return
        self._cache[ids] = (cache if owned else copy.deepcopy(cache), logits)
        self._cache.move_to_end(ids)
        # at least one entry per prompt of the latest batched call: each line's next prompt
        # extends its current one, so a smaller LRU would evict what the next turn reads
        while len(self._cache) > max(self.prefix_cache_entries, self._working_set):
            self._cache.popitem(last=False)

    def _forward(
        self, ids: torch.Tensor, cache: Any, keep: int = 0, **inputs: Any
    ) -> tuple[torch.Tensor, Any]:
        """Logits and cache after ``ids`` (``inputs``: mask, positions).

        With ``keep``, the logits of the last ``keep`` positions only.
        """
        if keep and self._keeps_logits:
            inputs["logits_to_keep"] = keep
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, **inputs)
        logits = out.logits[:, -keep:] if keep else out.logits
        return logits, out.past_key_values

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
            keep=1,  # only the last row predicts: the prompt's own rows are not needed
        )
        self.stats["prefill_tokens"] += len(key) - start
        self.stats["cached_tokens"] += start
        last = logits[0, -1:].clone()
        if use_cache:
            self._store(key, cache, last)
        return cache, last

    # ------------------------------------------------------------------ sampling
    @torch.inference_mode()
    @_cpu_kernels
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int | Sequence[int] = 1,
        *,
        prefixes: Sequence[Sequence[int]] | None = None,
        max_new_tokens: int | None = None,
        seed: int | None = None,
        seeds: Sequence[int] | None = None,
        reuse_prefix: bool | None = None,
        batch_prompts: bool | None = None,
    ) -> list[list[Generation]]:
        """Sample ``n[i]`` completions of each prompt at temperature 1.

        Args:
            prompts: Token ids of each prompt.
            n: Samples per prompt (an int for all).
            prefixes: Tokens each completion of prompt ``i`` must start with (a fork
                inside a turn); their log-probs and entropies are reported too.
            max_new_tokens: Cap on sampled tokens (default: the engine's).
            seed: Seed of the sampling noise (same seed, same samples): prompt ``i``
                draws from ``seed + i``.
            seeds: One seed per prompt instead (overrides ``seed``): a prompt's samples
                then depend only on its own seed, not on the other prompts of the call.
            reuse_prefix: Override the engine's setting for this call.
            batch_prompts: Override the engine's setting for this call (decode the
                prompts in one padded batch, or one after another).
        """
        counts = [n] * len(prompts) if isinstance(n, int) else list(n)
        if len(counts) != len(prompts):
            raise EngineError(f"{len(prompts)} prompts but {len(counts)} sample counts")
        if seeds is not None and len(seeds) != len(prompts):
            raise EngineError(f"{len(prompts)} prompts but {len(seeds)} seeds; give one each")
        prefixes = prefixes or [()] * len(prompts)
        reuse = self.reuse_prefix if reuse_prefix is None else reuse_prefix
        batched = self.batch_prompts if batch_prompts is None else batch_prompts
        limit = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if seeds is None:
            # without a seed, fresh OS entropy (torch.seed() would reseed torch's global RNG)
            base = int(seed) if seed is not None else int.from_bytes(os.urandom(7), "big")
            seeds = [(base + i) % (1 << 63) for i in range(len(prompts))]
        jobs = []
        for p, f, k, s in zip(prompts, prefixes, counts, seeds, strict=True):
            gen = torch.Generator(device=self.device)
            gen.manual_seed(int(s))
            jobs.append((list(p), list(f), k, gen))
        live = [j for j, job in enumerate(jobs) if job[2] > 0]
        out: list[list[Generation]] = [[] for _ in jobs]
        if batched and reuse and len(live) > 1 and self._paddable():
            for j, gens in zip(
                live, self._sample_batch([jobs[j] for j in live], limit), strict=True
            ):
                out[j] = gens
            return out
        for j in live:
            p, f, k, gen = jobs[j]
            out[j] = self._sample(p, f, k, limit, gen, reuse)
        return out

    def _paddable(self) -> bool:
        """Whether KV caches can be left-padded into one batch (no sliding-window layers)."""
        cfg = self.model.config
        return not getattr(cfg, "use_sliding_window", False) and not getattr(
            cfg, "sliding_window_pattern", None
        )

    def _check_length(self, ctx_len: int, limit: int) -> None:
        if ctx_len + limit > self.max_positions:
            raise EngineError(
                f"prompt of {ctx_len} tokens + {limit} new exceeds the model's "
                f"{self.max_positions} positions; shorten the dialogue or max_new_tokens."
            )

    def _open(self, prompt: list[int], prefix: list[int]) -> tuple[Any, torch.Tensor]:
        """Batch-1 KV cache of ``prompt + prefix`` and its logits rows.

        The rows run from the prompt's last token on: one per forced prefix token, then
        the one that predicts the first new token.
        """
        cache, rows = self._prefill(prompt, use_cache=self.prefix_cache_entries > 0)
        if prefix:  # forced tokens: their rows give their log-probs and entropies
            logits, cache = self._forward(torch.tensor([prefix], device=self.device), cache)
            self.stats["prefill_tokens"] += len(prefix)
            rows = torch.cat([rows, logits[0]], dim=0)
        return cache, rows

    def _open_many(
        self, jobs: Sequence[tuple[list[int], list[int]]]
    ) -> list[tuple[Any, torch.Tensor]]:
        """:meth:`_open` for every job, their uncached tokens prefilled in batched passes.

        Each job's longest cached prefix comes from the LRU (left-padded to the longest
        one of its pass); its uncached prompt tokens and forced prefix follow, left-padded
        too, so every row's last token sits in the last column. The attention mask hides
        both paddings and each row gets its own positions. The jobs go through as few
        passes as keep padding low (:func:`_prefill_passes`: prefill is compute-bound, a
        padded token costs as much as a real one). Each prompt's KV cache goes back to the
        LRU, and each job comes back as a compact batch-1 cache, as :meth:`_open` gives.
        """
        use = self.prefix_cache_entries > 0
        if use:
            self._prefill_shared([tuple(int(t) for t in p) for p, _ in jobs])
        found = []
        for prompt, _ in jobs:
            key = tuple(int(t) for t in prompt)
            # read only: the pass pads them into new tensors, _sample_batch copies them
            found.append((key, *(self._lookup(key, private=False) if use else (0, None, None))))
        todo = [
            i for i, ((key, start, _, _), (_, f)) in enumerate(zip(found, jobs, strict=True))
            if start < len(key) or f
        ]  # fmt: skip
        out: list[tuple[Any, torch.Tensor] | None] = [None] * len(jobs)
        for i, (_, start, cache, last) in enumerate(found):
            if i not in todo:  # the whole context is cached
                self.stats["cached_tokens"] += start
                out[i] = (cache, last)
        new = [len(found[i][0]) - found[i][1] + len(jobs[i][1]) for i in todo]
        for part in _prefill_passes(new):
            self._prefill_rows(jobs, found, [todo[k] for k in part], out)
        return out  # type: ignore[return-value]

    def _prefill_rows(
        self,
        jobs: Sequence[tuple[list[int], list[int]]],
        found: list[tuple[tuple[int, ...], int, Any, torch.Tensor | None]],
        todo: list[int],
        out: list[tuple[Any, torch.Tensor] | None],
    ) -> None:
        """One prefill pass of :meth:`_open_many` over the jobs ``todo`` (into ``out``)."""
        from transformers import DynamicCache

        use = self.prefix_cache_entries > 0
        dev = self.device
        starts = [found[i][1] for i in todo]
        tails = [list(found[i][0][found[i][1] :]) + jobs[i][1] for i in todo]
        wc, ws = max(starts), max(map(len, tails))
        mask = torch.zeros(len(todo), wc + ws, dtype=torch.long, device=dev)
        ids = torch.zeros(len(todo), ws, dtype=torch.long, device=dev)
        pos = torch.zeros(len(todo), ws, dtype=torch.long, device=dev)
        for r, (start, tail) in enumerate(zip(starts, tails, strict=True)):
            mask[r, wc - start : wc] = 1
            mask[r, wc + ws - len(tail) :] = 1
            ids[r, ws - len(tail) :] = torch.tensor(tail, device=dev)
            pos[r, ws - len(tail) :] = torch.arange(start, start + len(tail), device=dev)
        past = DynamicCache()
        if wc:
            # each row's cached prefix, left-padded, in buffers with room for the pass's
            # new tokens: the model writes them in place (no concatenation), and every
            # position is copied once
            ref = next(found[i][2] for i in todo if found[i][1])
            buffers = []
            for li, layer in enumerate(ref.layers):
                heads, dim = layer.keys.shape[1], layer.keys.shape[3]
                keys = layer.keys.new_empty((len(todo), heads, wc + ws, dim))
                values = layer.values.new_empty((len(todo), heads, wc + ws, layer.values.shape[3]))
                for r, (i, start) in enumerate(zip(todo, starts, strict=True)):
                    keys[r, :, : wc - start] = 0
                    values[r, :, : wc - start] = 0
                    if start:
                        keys[r, :, wc - start : wc] = found[i][2].layers[li].keys[0]
                        values[r, :, wc - start : wc] = found[i][2].layers[li].values[0]
                buffers.append((keys, values))
            past = _held_cache(buffers, wc)
        # the output layer on the rows that predict: each job's forced prefix and the
        # row before it (all rows end in the last column), not its prompt's rows
        width = min(ws, 1 + max(len(jobs[i][1]) for i in todo))
        logits, full = self._forward(ids, past, keep=width, attention_mask=mask, position_ids=pos)
        for r, (i, start, tail) in enumerate(zip(todo, starts, tails, strict=True)):
            key, _, _, last = found[i]
            forced = len(jobs[i][1])
            prompt_new = len(key) - start
            self.stats["prefill_tokens"] += len(tail)
            self.stats["cached_tokens"] += start
            # this row's real positions: its cached prefix, then its new tokens (a copy)
            real = (slice(wc - start, wc), slice(wc + ws - len(tail), wc + ws))
            row = _cache_of(
                [tuple(torch.cat([t[r : r + 1, :, part] for part in real], dim=2)
                       for t in (lay.keys, lay.values))
                 for lay in full.layers]
            )  # fmt: skip
            # rows from the prompt's last token on (one per forced token, then the next)
            rows = logits[r, width - forced - (1 if prompt_new else 0) :]
            if prompt_new:
                last, rows = rows[:1].clone(), rows[1:]
                if use:  # views of the row's cache: neither is ever written in place
                    self._store(key, _cache_of(_first_positions(row, len(key))), last, owned=True)
            out[i] = (row, torch.cat([last, rows], dim=0))

    def _prefill_shared(self, keys: Sequence[tuple[int, ...]]) -> None:
        """Prefill once the prefix that every prompt of a batched call starts with.

        Several trees or groups often start from one prompt (or one system prompt): left
        to the batched prefill, each would compute it again. Prefilled here into the
        prefix cache, every job then finds it there. Only when two or more prompts have
        it uncached.
        """
        if len(keys) < 2:
            return
        first = keys[0]
        n = min(len(k) for k in keys)
        for k in keys[1:]:
            i = 0
            while i < n and k[i] == first[i]:
                i += 1
            n = i
            if not n:
                return
        shared = first[:n]
        cached = self._lookup_length(shared)
        if cached < n and sum(self._lookup_length(k) < n for k in keys) >= 2:
            self._prefill(shared, True)

    def _lookup_length(self, ids: tuple[int, ...]) -> int:
        """Length of the longest cached prefix of ``ids`` (no copy, no LRU move)."""
        return max(
            (len(k) for k in self._cache if len(k) <= len(ids) and ids[: len(k)] == k), default=0
        )

    def _prefix_stats(
        self, prefix: list[int], rows: torch.Tensor
    ) -> tuple[list[float], list[float], list[float]]:
        """Log-probs, entropies and top-k entropies of the forced prefix tokens."""
        if not prefix:
            return [], [], []
        chosen, ent, ent_k = _token_stats(rows[:-1], prefix, self.topk)
        return chosen.tolist(), ent.tolist(), ent_k.tolist()

    @staticmethod
    def _gumbel(lp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Gumbel-max: an exact sample from softmax(lp) given uniform noise ``u``."""
        return torch.argmax(lp - torch.log(-torch.log(u.clamp_(1e-20, 1.0))), dim=-1)

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
        self._check_length(len(ctx), limit)
        if reuse:
            cache, rows = self._open(prompt, prefix)
            cache = _room_cache(
                [(lay.keys.expand(n, -1, -1, -1), lay.values.expand(n, -1, -1, -1))
                 for lay in cache.layers],
                limit,
            )  # fmt: skip
        else:  # recompute the shared context once per sample, as independent requests do
            from transformers import DynamicCache

            logits, cache = self._forward(
                torch.tensor([ctx] * n, device=self.device), DynamicCache()
            )
            cache = _room_cache([(lay.keys, lay.values) for lay in cache.layers], limit)
            self.stats["prefill_tokens"] += n * len(ctx)
            rows = logits[0, len(prompt) - 1 :]
        pre = self._prefix_stats(prefix, rows)

        def noise(lp: torch.Tensor, active: list[int]) -> torch.Tensor:
            # reproducible from `gen`; the batch keeps all n rows, stopped ones too
            return torch.rand(lp.shape, generator=gen, device=lp.device)

        def advance(
            nxt: torch.Tensor, active: list[int], keep: list[int]
        ) -> tuple[torch.Tensor, list[int]]:
            nonlocal cache
            logits, cache = self._forward(nxt[:, None], cache)
            return logits[:, -1], active

        dec = self._decode(rows[-1:].expand(n, -1), n, limit, noise, advance)
        if reuse and n == 1:  # the decode computed the reply's keys and values: keep them
            held = len(ctx) + len(dec.toks[0]) - 1
            self._keep_reply(
                ctx,
                len(prompt),
                dec.toks[0],
                [(k.clone(), v.clone()) for k, v in _first_positions(cache, held)],
                dec.last[0],
            )  # fmt: skip
        return [dec.generation(i, prefix, pre) for i in range(n)]

    def _keep_reply(
        self,
        ctx: list[int],
        prompt_len: int,
        toks: list[int],
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        last: torch.Tensor | None,
    ) -> None:
        """Keep the KV cache of a sampled reply in the prefix cache.

        A dialogue's next prompt is this one, the reply's tokens and the new message:
        without this entry the next turn prefills the reply again, though decoding it
        computed its keys and values already. ``layers``: each layer's (keys, values) of
        ``ctx + toks[:-1]`` (batch 1, owned: the sampled last token was never fed);
        ``last``: the logits row that predicted ``toks[-1]``. The prompt's own entry
        (``ctx[:prompt_len]``, which forks from this state read) is then held as views of
        the reply's tensors: the same keys and values, kept once.
        """
        if self.prefix_cache_entries <= 0 or len(toks) < 2 or last is None:
            return  # a one-token reply adds nothing to the prompt's own entry
        reply = _cache_of(layers)
        self._store(tuple(ctx + toks[:-1]), reply, last[None].clone(), owned=True)
        own = tuple(ctx[:prompt_len])
        if own in self._cache:
            self._cache[own] = (_cache_of(_first_positions(reply, prompt_len)), self._cache[own][1])

    def _sample_batch(
        self, jobs: Sequence[tuple[list[int], list[int], int, torch.Generator]], limit: int
    ) -> list[list[Generation]]:
        """Decode several prompts' samples in one left-padded batch.

        The jobs ``(prompt, prefix, n, generator)`` are prefilled together
        (:meth:`_open_many`, from the prefix cache); each job's KV cache is repeated n
        times and left-padded to the longest context. Every decode step is one forward
        pass over the live rows with an attention mask that hides the padding and each
        row's own positions. Job j draws
        its noise ``(n_j, V)`` from its own generator at every step until all its rows
        stop, exactly as :meth:`_sample` does, so both paths sample the same tokens (both
        decode in :meth:`_decode`). Stopped rows leave the batch once they are more than
        :data:`DROP_SHARE` of it (dropping copies the cache; a stopped row in the batch
        costs only its compute, and its samples are ignored).
        """
        for prompt, prefix, _, _ in jobs:
            if not prompt:
                raise EngineError("an empty prompt cannot be continued; give at least one token")
            self._check_length(len(prompt) + len(prefix), limit)
        self._working_set = len(jobs)
        opened = self._open_many([(p, f) for p, f, _, _ in jobs])
        lens = [len(p) + len(f) for p, f, _, _ in jobs]
        counts = [k for _, _, k, _ in jobs]
        width, total = max(lens), sum(counts)
        dev = self.device
        buffers = []
        for li in range(len(opened[0][0].layers)):
            ref = opened[0][0].layers[li]
            heads = ref.keys.shape[1]
            # the room after `width` is written before it is read: only padding is zeroed
            keys = ref.keys.new_empty((total, heads, width + limit, ref.keys.shape[-1]))
            values = ref.values.new_empty((total, heads, width + limit, ref.values.shape[-1]))
            row = 0
            for (one, _), length, k in zip(opened, lens, counts, strict=True):
                # left-padded to the longest context: each job's rows end at `width`
                keys[row : row + k, :, : width - length] = 0
                values[row : row + k, :, : width - length] = 0
                keys[row : row + k, :, width - length : width] = one.layers[li].keys
                values[row : row + k, :, width - length : width] = one.layers[li].values
                row += k
            buffers.append((keys, values))
        cache = _held_cache(buffers, width)
        mask = torch.zeros(total, width, dtype=torch.long, device=dev)
        owner, first = [], []
        for j, (length, k) in enumerate(zip(lens, counts, strict=True)):
            first.append(len(owner))
            for _ in range(k):
                mask[len(owner), width - length :] = 1
                owner.append(j)
        pos = torch.tensor([lens[j] for j in owner], device=dev)
        pre = [
            self._prefix_stats(f, rows)
            for (_, f, _, _), (_, rows) in zip(jobs, opened, strict=True)
        ]
        logits = torch.cat(
            [rows[-1:].expand(k, -1) for (_, rows), k in zip(opened, counts, strict=True)]
        )

        def noise(lp: torch.Tensor, active: list[int]) -> torch.Tensor:
            # job j draws (n_j, V) from its own generator while any of its rows samples
            parts = []
            for j, (_, _, k, gen) in enumerate(jobs):
                here = [r - first[j] for r in active if owner[r] == j]
                if not here:
                    continue
                u = torch.rand((k, lp.shape[-1]), generator=gen, device=lp.device)
                parts.append(u if len(here) == k else u[here])
            return torch.cat(parts)

        # replies of one-sample jobs: their KV cache goes to the prefix cache (the line's
        # next turn extends it), copied as each row stops, before it can leave the batch
        replies: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        held = list(range(total))  # the global rows the batch holds, in order

        def keep_replies(at: list[int]) -> None:
            for i in at:
                r = held[i]
                if r in replies or counts[owner[r]] != 1 or self.prefix_cache_entries <= 0:
                    continue
                # the row's context and reply so far: its context starts after its left
                # padding and the reply runs to the cache's end (a sliced copy, several
                # times faster than a gather of the mask's positions)
                start = width - lens[owner[r]]
                fmt = torch.contiguous_format
                replies[r] = [tuple(t[i : i + 1, :, start:].clone(memory_format=fmt)
                                    for t in (lay.keys, lay.values))
                              for lay in cache.layers]  # fmt: skip

        def advance(
            nxt: torch.Tensor, active: list[int], keep: list[int]
        ) -> tuple[torch.Tensor, list[int]]:
            nonlocal cache, mask, pos, held
            going = set(keep)
            keep_replies([i for i in range(len(active)) if i not in going])
            if len(keep) < (1 - DROP_SHARE) * len(active):  # stopped rows leave the batch
                idx = torch.tensor(keep, device=dev)
                cache.batch_select_indices(idx)
                mask, pos, nxt = mask[idx], pos[idx], nxt[idx]
                active = [active[i] for i in keep]
            mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
            out = self.model(
                input_ids=nxt[:, None],
                attention_mask=mask,
                position_ids=pos[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            cache, pos, held = out.past_key_values, pos + 1, active
            return out.logits[:, -1], active

        dec = self._decode(logits, total, limit, noise, advance)
        keep_replies(list(range(len(held))))  # rows that ran to the end
        self._working_set = len(jobs) + len(replies)
        for r, layers in replies.items():
            prompt, prefix, _, _ = jobs[owner[r]]
            self._keep_reply(prompt + prefix, len(prompt), dec.toks[r], layers, dec.last[r])
        return [
            [dec.generation(r, prefix, pre_j) for r in range(first[j], first[j] + k)]
            for j, ((_, prefix, k, _), pre_j) in enumerate(zip(jobs, pre, strict=True))
        ]

    def _decode(
        self,
        logits: torch.Tensor,
        rows: int,
        limit: int,
        noise: Callable[[torch.Tensor, list[int]], torch.Tensor],
        advance: Callable[[torch.Tensor, list[int], list[int]], tuple[torch.Tensor, list[int]]],
    ) -> _Decoded:
        """The decode loop of both sampling paths: up to ``limit`` tokens for ``rows`` rows.

        ``logits`` hold one row per batch row, predicting its first new token. Every
        step takes the stats of each row the batch holds (``active``, global rows in
        order), samples by Gumbel-max from ``noise(lp, active)`` (uniforms of those
        rows), and records the rows not yet stopped, checking the stop tokens. Then
        ``advance(next_tokens, active, keep)`` (``keep``: positions in ``active`` of the
        rows still sampling) runs the next forward pass and gives its logits and the
        rows the batch now holds: :meth:`_sample` keeps stopped rows in its batch,
        :meth:`_sample_batch` drops them.
        """
        dec = _Decoded.empty(rows)
        active = list(range(rows))
        stops = set(self.stop_token_ids)
        for step in range(limit):
            lp, ent, ent_k = _stats(logits, self.topk)
            nxt = self._gumbel(lp, noise(lp, active))
            chosen = lp.gather(-1, nxt[:, None])[:, 0]
            nxt_l, ch_l, ent_l, entk_l = nxt.tolist(), chosen.tolist(), ent.tolist(), ent_k.tolist()
            for i, r in enumerate(active):
                if dec.done[r]:  # stopped, still in the batch
                    continue
                dec.toks[r].append(nxt_l[i])
                dec.lps[r].append(ch_l[i])
                dec.ents[r].append(ent_l[i])
                dec.entk[r].append(entk_l[i])
                dec.done[r] = nxt_l[i] in stops
                dec.last[r] = logits[i]
            self.stats["decode_steps"] += 1
            keep = [i for i, r in enumerate(active) if not dec.done[r]]
            if not keep or step == limit - 1:
                break
            logits, active = advance(nxt, active, keep)
        return dec

    # ------------------------------------------------------------------ scoring
    @torch.inference_mode()
    @_cpu_kernels
    def score(
        self, prompt: Sequence[int], completions: Sequence[Sequence[int]]
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Log-prob and exact entropy of each completion token given ``prompt``.

        The prompt is prefilled once (its KV from the prefix cache when present), then the
        tokens every completion starts with (the scoring policy's ``Action: click[``) once
        more, and the rest of each completion goes through one batched forward pass on
        copies of that cache, right padded: a completion's tokens precede its padding, so
        causal attention never reads it. What a teacher does in BranchOPD, what the
        scoring policy asks at every decision, and what tests compare sampled log-probs
        against.
        """
        comps = [[int(t) for t in c] for c in completions]
        empty = (np.zeros(0, np.float32), np.zeros(0, np.float32))
        out: list[tuple[np.ndarray, np.ndarray]] = [empty] * len(comps)
        real = [i for i, c in enumerate(comps) if c]
        if not real:
            return out
        cache, last = self._prefill(list(prompt), use_cache=self.prefix_cache_entries > 0)
        if cache is None:  # the model keeps no cache (gradient checkpointing in train mode)
            return self._score_uncached(list(prompt), comps, out)
        n_prompt = len(prompt)
        prompt_kv = _first_positions(cache, n_prompt)
        # the tokens all completions share (each keeps at least one of its own): read once
        shared = _common_prefix([comps[i] for i in real]) if len(real) > 1 else 0
        head = last[:0]
        if shared:
            logits, ext = self._forward(
                torch.tensor([comps[real[0]][:shared]], device=self.device),
                _batch_cache(prompt_kv, 1),
            )
            head = torch.cat([last, logits[0, : shared - 1]])  # predict the shared tokens
            last = logits[0, shared - 1 : shared]  # predicts each completion's next token
            n_prompt += shared
            prompt_kv = _first_positions(ext, n_prompt)
        # candidates per forward pass: keep the logits of one pass near SCORE_ROWS rows
        width = max(len(comps[i]) for i in real) - shared - 1
        per_pass = max(1, SCORE_ROWS // max(1, width))
        for lo in range(0, len(real), per_pass):
            part = real[lo : lo + per_pass]
            logits = None
            if width > 0:
                ids = torch.zeros(len(part), width, dtype=torch.long, device=self.device)
                for r, i in enumerate(part):
                    tail = comps[i][shared:-1]
                    if tail:
                        ids[r, : len(tail)] = torch.tensor(tail, device=self.device)
                logits, _ = self._forward(ids, _batch_cache(prompt_kv, len(part)))
            for r, i in enumerate(part):
                comp = comps[i]
                own = len(comp) - shared  # rows predicting this completion's own tokens
                rows = last if own == 1 else torch.cat([last, logits[r, : own - 1]])
                out[i] = self._token_scores(torch.cat([head, rows]) if shared else rows, comp)
        return out

    def _token_scores(self, rows: torch.Tensor, comp: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Log-prob of each token of ``comp`` and the exact entropy, from its logits rows."""
        chosen, ent, _ = _token_stats(rows, comp, self.topk)
        return chosen.cpu().numpy().astype(np.float32), ent.cpu().numpy().astype(np.float32)

    def _score_uncached(
        self,
        prompt: list[int],
        comps: list[list[int]],
        out: list[tuple[np.ndarray, np.ndarray]],
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """:meth:`score` by one whole forward pass per completion (no cache to extend)."""
        for i, comp in enumerate(comps):
            if not comp:
                continue
            ids = torch.tensor([prompt + comp[:-1]], device=self.device)
            logits = self.model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 :]
            out[i] = self._token_scores(logits, comp)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` without special tokens."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)
