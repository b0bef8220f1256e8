"""Policies: a context (prompt plus the dialogue so far) in, an action with its tokens out.

The protocol and its value types (:class:`Policy`, :class:`ActRequest`,
:class:`ActionSample`, :class:`Context`, :class:`Turn`) are defined in the core module
:mod:`branchgym.rollout.policy` and re-exported here. The branching engine asks a
:class:`Policy` for actions in batches of :class:`ActRequest` (a context, how many
samples, and optionally token ids the action must start with, for forks inside a turn)
and gets :class:`ActionSample` objects back: the env action, its text, token ids, the
behaviour policy's per-token log-probs and exact per-token entropies (algorithms.md eq. 3), and
the top-20 estimate when the engine has it (BranchOPD's ``U_t``).

Policies here:

* :class:`TabularPolicy`: a table ``pi[node, action]`` for TreeMDP/TextTreeMDP (one
  "token" per action), so exact values and sampled trees agree.
* :class:`TextPolicy`: a distribution over candidate strings (the admissible actions by
  default), with exact per-byte conditionals from a trie; a random or weighted text
  policy for tests and benchmarks, able to emit malformed actions on purpose.
* :class:`ScriptedPolicy`: plays a fixed list of actions (probability 1).
* :class:`LLMPolicy`: a prompt builder and a generation engine (HF or vLLM), ChatML
  prompts spliced from the sampled token ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# The protocol and its value types live in the core package (the engine imports them
# from there); they are re-exported here so existing imports keep working.
from branchgym.rollout.policy import (
    ActionSample,
    ActRequest,
    Context,
    Policy,
    Turn,
    admissible_actions,
    sample_rng,
)

__all__ = [
    "Turn",
    "Context",
    "ActRequest",
    "ActionSample",
    "Policy",
    "TabularPolicy",
    "TextPolicy",
    "ScriptedPolicy",
    "LLMPolicy",
    "sequence_distribution",
    "admissible_actions",
]


def _entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


# --------------------------------------------------------------------------- tabular


class TabularPolicy:
    """``pi[node, action]`` for TreeMDP and TextTreeMDP; one token per action.

    Args:
        table: ``(n_nodes, n_actions)`` or ``(n_actions,)`` action probabilities.
        action_names: Text of each action (TextTreeMDP's ``env.unwrapped.actions``);
            without it actions are the integer indices.
    """

    def __init__(self, table: Any, action_names: Sequence[str] | None = None) -> None:
        """Check and store the table."""
        t = np.asarray(table, dtype=np.float64)
        if t.ndim == 1:
            t = t[None, :]
        if t.ndim != 2 or (t < 0).any() or not np.allclose(t.sum(-1), 1.0):
            raise ValueError("a tabular policy is a (n_nodes, n_actions) table of probabilities")
        self.table = t
        self.action_names = list(action_names) if action_names is not None else None

    @classmethod
    def uniform(cls, env: Any) -> TabularPolicy:
        """The uniform policy of a (Text)TreeMDP env (any wrapper stack)."""
        base = env.unwrapped
        n = base.tree.n_actions
        names = getattr(base, "actions", None)
        return cls(np.full((base.tree.n_nodes, n), 1.0 / n), names)

    def _row(self, context: Context) -> np.ndarray:
        node = context.current_info.get("node", 0)
        return self.table[0 if self.table.shape[0] == 1 else int(node)]

    def act(
        self, requests: Sequence[ActRequest], rng: np.random.Generator
    ) -> list[list[ActionSample]]:
        """Sample action indices from each context's row."""
        out = []
        for req in requests:
            p = self._row(req.context)
            h = _entropy(p)
            samples = []
            for j in range(req.n):
                if req.prefix_token_ids:
                    a = int(req.prefix_token_ids[0])  # a one-token action is fully forced
                    prefix = 1
                else:
                    a = int(sample_rng(req, j, rng).choice(p.size, p=p))
                    prefix = 0
                name = self.action_names[a] if self.action_names else a
                samples.append(
                    ActionSample(
                        action=name,
                        text=str(name),
                        token_ids=np.array([a]),
                        logprobs=np.array([np.log(p[a])], dtype=np.float32),
                        entropies=np.array([h], dtype=np.float32),
                        entropies_top20=np.array([h], dtype=np.float32),
                        prefix_len=prefix,
                    )
                )
            out.append(samples)
        return out


# --------------------------------------------------------------------- sequence trie


def sequence_distribution(
    sequences: Sequence[Sequence[int]],
    probs: Sequence[float],
    chosen: int,
    *,
    prefix_len: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact per-token log-probs and entropies of one sequence of a finite distribution.

    A distribution over whole token sequences induces, at each position, a distribution
    over the next token given the prefix (the mass of the sequences that continue with
    it). This returns, for sequence ``chosen``, the log-prob of each of its tokens and
    the entropy of each of those next-token distributions, conditioned on the first
    ``prefix_len`` tokens. Sequences must be distinct and none a proper prefix of
    another (end them with a stop token).
    """
    p = np.asarray(probs, dtype=np.float64)
    seqs = [tuple(s) for s in sequences]
    target = seqs[chosen]
    alive = np.array([s[:prefix_len] == target[:prefix_len] for s in seqs])
    lps, ents = [], []
    for j in range(len(target)):
        groups: dict[int, float] = {}
        total = 0.0
        for i in np.flatnonzero(alive):
            s = seqs[i]
            if j < len(s):
                groups[s[j]] = groups.get(s[j], 0.0) + p[i]
                total += p[i]
        q = np.array(list(groups.values())) / total
        lps.append(np.log(groups[target[j]] / total))
        ents.append(_entropy(q))
        alive &= np.array([j < len(s) and s[j] == target[j] for s in seqs])
    return np.asarray(lps, dtype=np.float32), np.asarray(ents, dtype=np.float32)


# ------------------------------------------------------------------------ text policy

#: Token id that ends a :class:`TextPolicy` action (bytes are 0..255).
TEXT_EOS = 256


class TextPolicy:
    """A distribution over candidate action strings, tokenised as bytes.

    By default the candidates are the env's admissible actions, uniformly; that is the
    random text policy. Per-token log-probs and entropies are exact (a trie over the
    candidates' bytes), so entropy schedules see real structure: actions sharing a
    prefix (``go north``/``go nowhere``) have low entropy after it.

    Args:
        candidates: Fixed candidate strings, or ``None`` to use the admissible actions.
        weights: ``weights(context, candidates) -> unnormalised probs``; uniform if None.
        invalid_prob: Probability of emitting ``invalid_text`` instead (to exercise the
            env's invalid-action feedback).
        invalid_text: The malformed action.
    """

    def __init__(
        self,
        candidates: Sequence[str] | None = None,
        *,
        weights: Callable[[Context, list[str]], Sequence[float]] | None = None,
        invalid_prob: float = 0.0,
        invalid_text: str = "dance wildly",
    ) -> None:
        """Configure the candidate set."""
        if not 0.0 <= invalid_prob < 1.0:
            raise ValueError("invalid_prob must be in [0, 1)")
        self.candidates = list(candidates) if candidates is not None else None
        self.weights = weights
        self.invalid_prob = invalid_prob
        self.invalid_text = invalid_text

    def _distribution(self, context: Context) -> tuple[list[str], np.ndarray]:
        cands = self.candidates or admissible_actions(context.current_info)
        if not cands:
            raise ValueError(
                "TextPolicy has no candidates: the env gives no info['admissible_actions'] "
                "here; pass candidates=[...] explicitly."
            )
        cands = list(dict.fromkeys(cands))
        w = (
            np.ones(len(cands))
            if self.weights is None
            else np.asarray(self.weights(context, cands), dtype=np.float64)
        )
        if w.shape != (len(cands),) or (w < 0).any() or w.sum() <= 0:
            raise ValueError("TextPolicy weights must be non-negative, one per candidate")
        p = w / w.sum()
        if self.invalid_prob > 0 and self.invalid_text not in cands:
            cands.append(self.invalid_text)
            p = np.append(p * (1.0 - self.invalid_prob), self.invalid_prob)
        return cands, p

    @staticmethod
    def encode(text: str) -> tuple[int, ...]:
        """Byte tokens of an action, ended by :data:`TEXT_EOS`."""
        return (*text.encode("utf-8"), TEXT_EOS)

    def act(
        self, requests: Sequence[ActRequest], rng: np.random.Generator
    ) -> list[list[ActionSample]]:
        """Sample candidate strings; report exact per-byte log-probs and entropies."""
        out = []
        for req in requests:
            cands, p = self._distribution(req.context)
            seqs = [self.encode(c) for c in cands]
            prefix = tuple(req.prefix_token_ids)
            ok = np.array([s[: len(prefix)] == prefix for s in seqs])
            if not ok.any():
                raise ValueError(
                    f"no candidate action starts with the forced prefix {bytes(prefix)!r}"
                )
            cond = np.where(ok, p, 0.0)
            cond = cond / cond.sum()
            samples = []
            for j in range(req.n):
                i = int(sample_rng(req, j, rng).choice(len(cands), p=cond))
                lp, ent = sequence_distribution(seqs, p, i, prefix_len=len(prefix))
                samples.append(
                    ActionSample(
                        action=cands[i],
                        text=cands[i],
                        token_ids=np.array(seqs[i]),
                        logprobs=lp,
                        entropies=ent,
                        entropies_top20=ent,
                        prefix_len=len(prefix),
                        parse_error="not an admissible action"
                        if cands[i] == self.invalid_text and self.invalid_prob > 0
                        else None,
                    )
                )
            out.append(samples)
        return out


class ScriptedPolicy:
    """Plays ``actions[t]`` at decision ``t`` with probability 1 (entropy 0).

    After the script ends it repeats the last action. Useful for deterministic trees in
    tests and for replaying a known trajectory.
    """

    def __init__(self, actions: Sequence[Any]) -> None:
        """Store the script."""
        if not actions:
            raise ValueError("ScriptedPolicy needs at least one action")
        self.actions = list(actions)

    def act(
        self, requests: Sequence[ActRequest], rng: np.random.Generator
    ) -> list[list[ActionSample]]:
        """The scripted action for each request's step."""
        out = []
        for req in requests:
            a = self.actions[min(req.context.step, len(self.actions) - 1)]
            toks = TextPolicy.encode(str(a))
            zeros = np.zeros(len(toks), dtype=np.float32)
            prefix = len(req.prefix_token_ids)
            out.append(
                [
                    ActionSample(a, str(a), np.array(toks), zeros, zeros, zeros, prefix)
                    for _ in range(req.n)
                ]
            )
        return out


# ------------------------------------------------------------------------- LLM policy


class LLMPolicy:
    """A generation engine behind a prompt builder: ReAct replies parsed into env actions.

    The prompt is written in the tokenizer's chat template
    (:mod:`~branchgym.agents.policies.chat_format`; ChatML, ``<|im_start|>role ... <|im_end|>``,
    when the tokenizer has none). Earlier replies enter the prompt as the token ids that
    were sampled, not as re-tokenised text, so the context the model conditioned on is
    exactly the one whose log-probs were recorded, and each turn's prompt extends the
    previous one (the engine's prefix cache then prefills only new tokens).

    Args:
        engine: An engine with ``generate``, ``encode``, ``decode`` and ``stop_token_ids``
            (:class:`~branchgym.agents.engines.hf.HFEngine`, ``VLLMEngine``).
        prompt: A :class:`~branchgym.agents.policies.prompts.PromptBuilder`; default: the one
            registered for each context's env id.
        max_new_tokens: Cap on tokens per action.
    """

    def __init__(self, engine: Any, prompt: Any = None, *, max_new_tokens: int = 48) -> None:
        """Bind the engine and the prompt builder."""
        self.engine = engine
        self.prompt = prompt
        self.max_new_tokens = int(max_new_tokens)
        self._head: dict[tuple[str, str, str], list[int]] = {}
        self._chat: Any = None

    def builder(self, context: Context) -> Any:
        """The prompt builder for ``context``."""
        if self.prompt is not None:
            return self.prompt
        from branchgym.agents.policies.prompts import prompt_for

        return prompt_for(context.env_id)

    @property
    def chat(self) -> Any:
        """The prompt format: the engine tokenizer's chat template, else ChatML."""
        if self._chat is None:
            from branchgym.agents.policies.chat_format import chat_format

            tok = getattr(self.engine, "tokenizer", None)
            stops = tok.convert_ids_to_tokens(list(self.engine.stop_token_ids)) if tok else []
            self._chat = chat_format(tok, tuple(s for s in stops if isinstance(s, str)))
        return self._chat

    def prompt_ids(self, context: Context) -> list[int]:
        """Token ids of the prompt (:attr:`chat` format) for the next action in ``context``."""
        b = self.builder(context)
        enc = self.engine.encode
        chat = self.chat
        system, task = b.system_prompt(), b.task_message(context.observation, context.info)
        key = (type(b).__name__, system, task)
        if key not in self._head:
            if len(self._head) >= 256:  # one entry per task; keep the memory bounded
                self._head.clear()
            self._head[key] = enc(chat.head(system, task))
        head = self._head[key]
        stops = set(self.engine.stop_token_ids)
        segments = []
        for turn in context.turns:
            seg = list(turn.token_ids)
            if chat.stop_text and (not turn.token_ids or turn.token_ids[-1] not in stops):
                seg.extend(enc(chat.stop_text))  # a reply cut at max_new_tokens
            msg = b.observation_message(turn.observation, turn.info)
            seg.extend(enc(chat.after_stop + chat.user_turn(msg)))
            segments.append(seg)
        budget = self.max_prompt_tokens()
        rest = sum(map(len, segments))
        dropped, note = 0, []
        # Long episodes outgrow the model's context: keep the task and the latest turns,
        # and say how many were left out (the same context always gives the same prompt,
        # so a learner recomputing log-probs sees exactly what the sampler saw).
        while len(head) + len(note) + rest > budget and dropped < len(segments):
            rest -= len(segments[dropped])
            dropped += 1
            note = enc(
                f"[{dropped} earlier turn(s) omitted to fit the context]"
                + chat.reply_end
                + chat.user_turn("Continue.")
            )
        ids = list(head) + note
        for seg in segments[dropped:]:
            ids.extend(seg)
        return ids

    def max_prompt_tokens(self) -> int:
        """Prompt tokens that leave room for ``max_new_tokens`` in the engine's context."""
        limit = int(getattr(self.engine, "max_positions", 1 << 30))
        return max(1, limit - self.max_new_tokens)

    def teacher_hook(self, teacher: Any) -> Callable[[Any, list[int]], None]:
        """A ``grow_tree(teacher=...)`` hook: ``teacher`` scores every backbone token.

        BranchOPD's fork score needs ``log pi_T`` of each token the student generated,
        in the same context the student saw. ``teacher`` is an engine with ``score``
        sharing this policy's tokenizer.
        """

        def hook(tree: Any, backbone: list[int]) -> None:
            ctx = Context(tree.env_id, tree.observation, tree.info)
            for nid in backbone:
                n = tree[nid]
                ((lp, _),) = teacher.score(self.prompt_ids(ctx), [n.token_ids])
                n.teacher_logprobs = lp
                ctx = ctx.extend(
                    Turn(
                        n.text, tuple(int(t) for t in n.token_ids), n.action, n.observation, n.info
                    )
                )

        return hook

    def act(
        self, requests: Sequence[ActRequest], rng: np.random.Generator
    ) -> list[list[ActionSample]]:
        """Generate ``n`` replies per request in one engine call and parse them."""
        prompts = [self.prompt_ids(r.context) for r in requests]
        if getattr(self.engine, "per_prompt_seeds", False):
            # One seed per request from its first rollout's own stream: a request samples
            # the same tokens whichever other requests (other trees) share the batch.
            seeding: dict[str, Any] = {
                "seeds": [int(sample_rng(r, 0, rng).integers(2**62)) for r in requests]
            }
        else:
            # The first rollout's own stream when the engine gives one: the batch's seed
            # then does not depend on the order in which rollouts were scheduled.
            seeding = {
                "seed": int(sample_rng(requests[0], 0, rng).integers(2**62)) if requests else 0
            }
        gens = self.engine.generate(
            prompts,
            [r.n for r in requests],
            prefixes=[list(r.prefix_token_ids) for r in requests],
            max_new_tokens=self.max_new_tokens,
            **seeding,
        )
        out = []
        for req, batch in zip(requests, gens, strict=True):
            b = self.builder(req.context)
            samples = []
            for g in batch:
                text = self.engine.decode(g.token_ids)
                parsed = b.parse(text, req.context.current_info)
                samples.append(
                    ActionSample(
                        action=parsed.action,
                        text=text,
                        token_ids=g.token_ids,
                        logprobs=g.logprobs,
                        entropies=g.entropies,
                        entropies_top20=g.entropies_top20,
                        prefix_len=g.prefix_len,
                        parse_error=parsed.error,
                    )
                )
            out.append(samples)
        return out
