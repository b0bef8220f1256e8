"""VLLMEngine: sampling on vLLM with automatic prefix caching and per-token log-probs.

The same interface as :class:`~branchgym.agents.engines.hf.HFEngine`:
``generate(prompts, n, prefixes=..., seed=...)`` returns :class:`Generation` objects
with token ids, log-probs and entropies, and ``score(prompt, completions)`` gives
teacher log-probs. vLLM's automatic prefix caching shares the KV blocks of a prompt
between the n samples of one request and between requests that share a prefix (the
siblings of a branch point, successive turns of a dialogue).

Entropies: vLLM returns the top-k log-probs of each step. With ``full_logprobs=True``
(the default for vocabularies up to 4,096 tokens) it returns the whole distribution,
and entropies are exact; otherwise ``entropies`` holds the top-k estimate, like
``entropies_top20`` always does. Sampling is at temperature 1 with no top-k/top-p.

On this project's CPU machines vLLM lives in its own virtual environment
(``.venv-vllm``, made by ``make test``), because it pins its own torch stack. Run the
self-check there::

    .venv-vllm/bin/python -m branchgym.agents.engines.vllm check MODEL_DIR OUT.json

It samples with prefix caching on, and writes tokens and log-probs as JSON; the main
test suite compares them with a direct forward pass in transformers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from branchgym.error import DependencyMissingError, EngineError

__all__ = ["VLLMEngine", "Generation"]


@dataclasses.dataclass
class Generation:
    """One sampled completion (fields as :class:`branchgym.agents.engines.hf.Generation`)."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    entropies: np.ndarray
    entropies_top20: np.ndarray
    prefix_len: int
    finish_reason: str


def _entropy_from(lp_dict: dict[int, Any], k: int | None) -> float:
    """Entropy of a step's returned log-probs: all of them, or the renormalised top-k."""
    lps = np.array(sorted((v.logprob for v in lp_dict.values()), reverse=True), dtype=np.float64)
    lps = lps[np.isfinite(lps)]
    if k is not None:
        lps = lps[:k]
        lps = lps - np.logaddexp.reduce(lps)
    return float(-(np.exp(lps) * lps).sum())


class VLLMEngine:
    """Generation engine on vLLM.

    Args:
        model: A model folder (``save_pretrained`` output; weights in safetensors).
        max_new_tokens: Default cap on sampled tokens.
        topk: k of the top-k entropy estimate (20).
        full_logprobs: Ask vLLM for the whole distribution at each step (exact
            entropies); default: when the vocabulary has at most 4,096 tokens.
        enable_prefix_caching: vLLM's automatic prefix caching (on).
        ignore_eos: Keep sampling past the stop token (benchmarks with fixed lengths).
        llm_kwargs: Passed to ``vllm.LLM`` (``dtype``, ``max_model_len``, ``seed``...).
    """

    def __init__(
        self,
        model: str,
        *,
        max_new_tokens: int = 48,
        topk: int = 20,
        full_logprobs: bool | None = None,
        enable_prefix_caching: bool = True,
        ignore_eos: bool = False,
        **llm_kwargs: Any,
    ) -> None:
        """Start the vLLM engine on ``model``."""
        try:
            import vllm
        except ImportError as exc:
            raise DependencyMissingError(
                "VLLMEngine needs vLLM. On a GPU machine: pip install vllm. On this project's "
                "CPU machines it lives in .venv-vllm (make test creates it): run there with "
                ".venv-vllm/bin/python."
            ) from exc
        if not os.path.exists(os.path.join(model, "config.json")):
            raise EngineError(f"{model} is not a model folder (no config.json)")
        self._vllm = vllm
        cfg = json.load(open(os.path.join(model, "config.json")))
        vocab = int(cfg.get("vocab_size", 1 << 20))
        self.full_logprobs = vocab <= 4096 if full_logprobs is None else bool(full_logprobs)
        self.topk = int(topk)
        self.max_new_tokens = int(max_new_tokens)
        self.ignore_eos = bool(ignore_eos)
        kwargs = {
            "dtype": "float32",
            "max_model_len": min(2048, int(cfg.get("max_position_embeddings", 2048))),
            "enable_prefix_caching": enable_prefix_caching,
            "max_logprobs": -1 if self.full_logprobs else self.topk,
            **llm_kwargs,
        }
        self.llm = vllm.LLM(model=model, **kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        eos = self.tokenizer.eos_token_id
        self.stop_token_ids = [] if eos is None else [int(eos)]

    def _params(self, n: int, max_tokens: int, seed: int | None, prompt_logprobs: bool) -> Any:
        k = -1 if self.full_logprobs else self.topk
        return self._vllm.SamplingParams(
            ignore_eos=self.ignore_eos,
            n=n,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_tokens=max_tokens,
            logprobs=k,
            prompt_logprobs=k if prompt_logprobs else None,
            seed=seed,
            stop_token_ids=[] if self.ignore_eos else self.stop_token_ids,
            skip_special_tokens=True,
        )

    def _k(self) -> int | None:
        return None if self.full_logprobs else self.topk

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int | Sequence[int] = 1,
        *,
        prefixes: Sequence[Sequence[int]] | None = None,
        max_new_tokens: int | None = None,
        seed: int | None = None,
    ) -> list[list[Generation]]:
        """Sample ``n[i]`` completions of each prompt; see ``HFEngine.generate``."""
        from vllm.inputs import TokensPrompt

        counts = [n] * len(prompts) if isinstance(n, int) else list(n)
        prefixes = prefixes or [()] * len(prompts)
        limit = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        inputs, params = [], []
        for i, (p, f, k) in enumerate(zip(prompts, prefixes, counts, strict=True)):
            inputs.append(TokensPrompt(prompt_token_ids=[int(t) for t in (*p, *f)]))
            params.append(
                self._params(max(k, 1), limit, None if seed is None else seed + i, bool(f))
            )
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        result = []
        for out, f, k in zip(outs, prefixes, counts, strict=True):
            f = [int(t) for t in f]
            pre_lp, pre_ent, pre_k = [], [], []
            if f:
                rows = out.prompt_logprobs[-len(f) :]
                for tok, row in zip(f, rows, strict=True):
                    pre_lp.append(row[tok].logprob)
                    pre_ent.append(_entropy_from(row, self._k()))
                    pre_k.append(_entropy_from(row, self.topk))
            gens = []
            for c in out.outputs[:k]:
                ids = list(c.token_ids)
                lps = [c.logprobs[j][t].logprob for j, t in enumerate(ids)]
                ents = [_entropy_from(row, self._k()) for row in c.logprobs]
                entk = [_entropy_from(row, self.topk) for row in c.logprobs]
                gens.append(
                    Generation(
                        token_ids=np.asarray(f + ids, dtype=np.int64),
                        logprobs=np.asarray(pre_lp + lps, dtype=np.float32),
                        entropies=np.asarray(pre_ent + ents, dtype=np.float32),
                        entropies_top20=np.asarray(pre_k + entk, dtype=np.float32),
                        prefix_len=len(f),
                        finish_reason="stop" if c.finish_reason == "stop" else "length",
                    )
                )
            result.append(gens)
        return result

    def score(
        self, prompt: Sequence[int], completions: Sequence[Sequence[int]]
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Log-prob and entropy of each completion token given ``prompt`` (prompt log-probs)."""
        from vllm.inputs import TokensPrompt

        out = []
        for comp in completions:
            ids = [int(t) for t in (*prompt, *comp)]
            (res,) = self.llm.generate(
                [TokensPrompt(prompt_token_ids=ids)],
                self._params(1, 1, 0, True),
                use_tqdm=False,
            )
            rows = res.prompt_logprobs[len(prompt) :]
            out.append(
                (
                    np.array([r[t].logprob for r, t in zip(rows, comp, strict=True)], np.float32),
                    np.array([_entropy_from(r, self._k()) for r in rows], np.float32),
                )
            )
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` without special tokens."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)


def _check(model: str, out_path: str, n: int = 3, max_tokens: int = 12) -> None:
    """Sample from ``model`` with prefix caching and write tokens and log-probs as JSON."""
    import time

    eng = VLLMEngine(model, max_new_tokens=max_tokens, seed=0, enforce_eager=True)
    prompt = eng.encode(
        "<|im_start|>user\nYou stand at the entrance of a maze. Exits: go north, go east."
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    t0 = time.perf_counter()
    (gens,) = eng.generate([prompt], n, seed=1)
    t1 = time.perf_counter()
    # the same prompt again: served from the prefix cache
    (again,) = eng.generate([prompt], n, seed=1)
    t2 = time.perf_counter()
    forced = [int(t) for t in gens[0].token_ids[:2]]
    (fork,) = eng.generate([prompt], 2, prefixes=[forced], seed=2)
    scored = eng.score(prompt, [gens[0].token_ids])[0]
    report = {
        "prompt": prompt,
        "samples": [
            {
                "token_ids": g.token_ids.tolist(),
                "logprobs": g.logprobs.tolist(),
                "entropies": g.entropies.tolist(),
                "entropies_top20": g.entropies_top20.tolist(),
            }
            for g in gens
        ],
        "repeat_same_tokens": [
            a.token_ids.tolist() == b.token_ids.tolist() for a, b in zip(gens, again, strict=True)
        ],
        "fork": [
            {"token_ids": g.token_ids.tolist(), "logprobs": g.logprobs.tolist()} for g in fork
        ],
        "score_logprobs": scored[0].tolist(),
        "seconds_first": t1 - t0,
        "seconds_cached": t2 - t1,
        "full_logprobs": eng.full_logprobs,
    }
    report["tree"] = _tree_check(eng)
    with open(out_path, "w") as fh:
        json.dump(report, fh)


def _tree_check(eng: VLLMEngine) -> dict[str, Any]:
    """Grow a small tree with this engine behind LLMPolicy; record what a test rescores."""
    import gymnasium as gym

    import branchgym
    from branchgym.agents.policies.policy import Context, LLMPolicy, Turn
    from branchgym.rollout.grow import grow_tree

    policy = LLMPolicy(eng, max_new_tokens=6)
    env = gym.make("branchgym/TextTreeMDP-v0", max_episode_steps=3)
    tree = grow_tree(env, policy, "entropy", m=1, k=3, seed=0, rng=0)
    ctx = Context(tree.env_id, tree.observation, tree.info)
    nodes = []
    for nid in tree.backbone:
        n = tree[nid]
        nodes.append(
            {
                "prompt_ids": policy.prompt_ids(ctx),
                "token_ids": n.token_ids.tolist(),
                "logprobs": n.logprobs.tolist(),
            }
        )
        ctx = ctx.extend(
            Turn(n.text, tuple(int(t) for t in n.token_ids), n.action, n.observation, n.info)
        )
    return {
        "rollouts": tree.stats.rollouts,
        "branch_points": len(tree.branch_points()),
        "live_snapshots": branchgym.live_snapshots().count,
        "backbone": nodes,
    }


def _bench(model: str, out_path: str, prefixes: list[int], siblings: int, new_tokens: int) -> None:
    """Time sibling generation at long shared prefixes, prefix caching on vs off."""
    import time

    results: dict[str, dict[str, float]] = {}
    for caching in (True, False):
        rng = np.random.default_rng(0)
        eng = VLLMEngine(
            model,
            max_new_tokens=new_tokens,
            enable_prefix_caching=caching,
            full_logprobs=False,
            seed=0,
            max_model_len=max(prefixes) + new_tokens + 64,
            enforce_eager=True,  # no torch.compile warm-up: both settings run the same kernels
            ignore_eos=True,
        )
        vocab = len(eng.tokenizer)
        for plen in prefixes:
            times = []
            for rep in range(4):
                # a fresh prefix each repeat; the backbone's request comes first, as in a tree
                prompt = rng.integers(10, vocab - 10, size=plen).tolist()
                eng.generate([prompt], 1, max_new_tokens=new_tokens, seed=rep)
                t0 = time.perf_counter()
                eng.generate([prompt], siblings, max_new_tokens=new_tokens, seed=100 + rep)
                times.append(time.perf_counter() - t0)
            results.setdefault(str(plen), {})["on" if caching else "off"] = float(
                np.median(times[1:])
            )
        del eng
    with open(out_path, "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":  # vLLM starts worker processes: keep this guard
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "check" and len(sys.argv) == 4:
        _check(sys.argv[2], sys.argv[3])
    elif cmd == "bench" and len(sys.argv) == 7:
        plens = [int(x) for x in sys.argv[4].split(",")]
        _bench(sys.argv[2], sys.argv[3], plens, int(sys.argv[5]), int(sys.argv[6]))
    else:
        print(
            "usage: python -m branchgym.agents.engines.vllm check MODEL_DIR OUT.json\n"
            "       python -m branchgym.agents.engines.vllm bench MODEL_DIR OUT.json "
            "PREFIX_TOKENS[,PREFIX_TOKENS...] SIBLINGS NEW_TOKENS",
            file=sys.stderr,
        )
        sys.exit(2)
