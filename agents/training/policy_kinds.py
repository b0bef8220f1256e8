"""Policy kinds: how a learner's model acts and how it rescores what it did, with gradients.

:data:`POLICIES` maps a ``--policy`` name to a :class:`PolicyKind`:

* ``generate`` (:class:`GenerateKind`): free generation through
  :class:`~branchgym.agents.policies.policy.LLMPolicy`; a row's dialogue is one sequence and
  its decisions' tokens are scored.
* ``scoring`` (:class:`ScoringKind`): a softmax over the admissible actions
  (:class:`~branchgym.agents.policies.scoring.ScoringPolicy`); the other candidates are side
  branches of the same packed sequence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from branchgym.agents.forward import packed as forward
from branchgym.agents.forward.packed import Pack
from branchgym.agents.forward.rows import Decision, Row
from branchgym.agents.policies.policy import LLMPolicy
from branchgym.error import DependencyMissingError, TrainingConfigError

if TYPE_CHECKING:
    from branchgym.agents.training.options import TrainArgs

try:
    import torch
    from torch import Tensor
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra(
        "branchgym.agents.training.policy_kinds", "llm", "torch"
    ) from exc

__all__ = ["POLICIES", "GenerateKind", "PolicyKind", "ScoringKind", "resolve_policy"]


class PolicyKind:
    """How a learner acts and recomputes log-probs; one instance per entry of :data:`POLICIES`."""

    name = ""

    def make(self, engine: Any, args: TrainArgs) -> Any:
        """The behaviour policy on ``engine``."""
        raise NotImplementedError

    @staticmethod
    def sequence(policy: Any, row: Row) -> tuple[list[int], list[tuple[int, int]]]:
        """The row's token sequence (prompt and dialogue) and each decision's span in it.

        The dialogue is the whole path up to the row's last decision, so the decisions of
        the row are scored in the context they were sampled in.
        """
        if "sequence" not in row.cache:
            last = row.decisions[-1]
            seq = policy.prompt_ids(last.context) + [int(t) for t in last.token_ids]
            spans = []
            for d in row.decisions:
                a = len(policy.prompt_ids(d.context))
                b = a + d.n_tokens
                if seq[a:b] != [int(t) for t in d.token_ids]:
                    raise TrainingConfigError(
                        "a decision's tokens are not where its prompt puts them; the tree was "
                        "grown with another prompt builder or policy."
                    )
                spans.append((a, b))
            row.cache["sequence"] = (seq, spans)
        return row.cache["sequence"]

    def packs(self, policy: Any, rows: Sequence[Row]) -> tuple[list[Pack], list[Any]]:
        """One :class:`Pack` per row, and what :meth:`unpack` needs to read it back."""
        raise NotImplementedError

    def unpack(self, scores: Tensor, plan: Any) -> list[Tensor]:
        """Per decision of the row, the log-prob of each of its tokens."""
        raise NotImplementedError

    def logprobs(
        self,
        policy: Any,
        model: Any,
        rows: Sequence[Row],
        device: torch.device,
        *,
        logit_positions: Sequence[Sequence[int]] | None = None,
        pack_trees: bool = False,
    ) -> tuple[list[list[Tensor]], list[Tensor]]:
        """Per row, per decision, the log-prob of each token under ``model``.

        Gradients flow when called outside ``torch.no_grad``. ``logit_positions`` (row
        sequence positions) returns full logits there, for PBR. ``pack_trees`` reads the
        prefix the rows of one tree share once
        (:func:`~branchgym.agents.forward.packed.pack_trees`).
        """
        live = [i for i, r in enumerate(rows) if r.decisions]
        out: list[list[Tensor]] = [[] for _ in rows]
        if not live:
            return out, [torch.zeros(0, device=device) for _ in logit_positions or []]
        pieces = [(i, sub) for i in live for sub in self.runs(policy, rows[i])]
        where = None
        if logit_positions is not None:
            where = []
            for i, _ in pieces:
                split = len(self.runs(policy, rows[i])) > 1
                if split and logit_positions[i]:
                    raise TrainingConfigError(
                        "logit positions refer to one sequence per row, but this row's "
                        "dialogue was shortened to fit the context; give it no positions."
                    )
                where.append([] if split else logit_positions[i])
        packs, plans = self.packs(policy, [sub for _, sub in pieces])
        trees = [rows[i].tree for i, _ in pieces] if pack_trees else None
        scores, extra = forward.bucketed_forward(
            model, packs, device, logit_positions=where, trees=trees
        )
        row_extra: dict[int, Tensor] = {}
        for (i, _), s, plan, e in zip(
            pieces, scores, plans, extra or [None] * len(pieces), strict=True
        ):
            out[i].extend(self.unpack(s, plan))
            if e is not None:
                row_extra.setdefault(i, e)
        if logit_positions is None:
            return out, []
        return out, [row_extra[i] for i in live]

    @staticmethod
    def runs(policy: Any, row: Row) -> list[Row]:
        """The row as runs of decisions that each fit in one token sequence.

        A decision's prompt normally extends the previous one, so a whole path is one
        sequence. When a long dialogue outgrows the model's context, the prompt drops its
        oldest turns (:meth:`LLMPolicy.prompt_ids`) and stops extending; each run then
        gets its own sequence, so every decision is still scored in the exact context it
        was sampled in. Rows are split only here: advantages stay per path.
        """
        if "runs" not in row.cache:
            runs: list[list[Decision]] = []
            prev: list[int] | None = None
            for d in row.decisions:
                prompt = policy.prompt_ids(d.context)
                if runs and prev is not None and prompt[: len(prev)] == prev:
                    runs[-1].append(d)
                else:
                    runs.append([d])
                prev = prompt + [int(t) for t in d.token_ids]
            row.cache["runs"] = (
                [row]
                if len(runs) <= 1
                else [dataclasses.replace(row, decisions=r, cache={}) for r in runs]
            )
        return row.cache["runs"]


class GenerateKind(PolicyKind):
    """Free generation: each row's dialogue is one sequence; its decisions' tokens are scored."""

    name = "generate"

    def make(self, engine: Any, args: TrainArgs) -> Any:
        """An :class:`LLMPolicy` with the env's prompt builder."""
        return LLMPolicy(engine, max_new_tokens=args.max_new_tokens)

    def packs(self, policy: Any, rows: Sequence[Row]) -> tuple[list[Pack], list[Any]]:
        """The row sequence; a target per token of each decision."""
        packs, plans = [], []
        for row in rows:
            seq, spans = self.sequence(policy, row)
            targets = [(i - 1, seq[i]) for a, b in spans for i in range(a, b)]
            packs.append(Pack(list(seq), [], targets))
            plans.append([b - a for a, b in spans])
        return packs, plans

    def unpack(self, scores: Tensor, plan: Any) -> list[Tensor]:
        """Split the targets back into decisions."""
        return list(torch.split(scores, plan))


class ScoringKind(PolicyKind):
    """Scoring the admissible actions: ``log pi(a|s)`` = log-softmax of sequence log-probs.

    The chosen reply's tokens are already in the row's dialogue; every other candidate is
    a side branch attached where it leaves the chosen one, so a decision with C
    candidates costs its C - 1 suffixes, not C copies of the dialogue.
    """

    name = "scoring"

    def make(self, engine: Any, args: TrainArgs) -> Any:
        """A :class:`~branchgym.agents.policies.scoring.ScoringPolicy`."""
        from branchgym.agents.policies.scoring import ScoringPolicy

        return ScoringPolicy(engine, template=args.scoring_template)

    def packs(self, policy: Any, rows: Sequence[Row]) -> tuple[list[Pack], list[Any]]:
        """The row sequence plus one side branch per other candidate of each decision."""
        packs, plans = [], []
        for row in rows:
            seq, spans = self.sequence(policy, row)
            pack = Pack(list(seq))
            plan = []
            for d, (a, b) in zip(row.decisions, spans, strict=True):
                cands = policy.candidates(d.context)
                chosen = cands.index(d.token_ids)
                own = list(range(len(pack.targets), len(pack.targets) + (b - a)))
                pack.targets.extend((i - 1, seq[i]) for i in range(a, b))
                per_cand = []
                for ci, c in enumerate(cands.token_ids):
                    if ci == chosen:
                        per_cand.append((len(c), []))
                        continue
                    shared = 0
                    limit = min(len(c), d.n_tokens)
                    while shared < limit and c[shared] == d.token_ids[shared]:
                        shared += 1
                    if shared == len(c):
                        raise TrainingConfigError(
                            f"the reply {cands.texts[ci]!r} is a prefix of another; end every "
                            "candidate with the stop token."
                        )
                    idx = [len(pack.targets)]
                    pack.targets.append((a + shared - 1, c[shared]))  # where it leaves
                    start = len(pack.tokens)
                    tail = list(c[shared:-1])  # inputs that predict the rest of c
                    if tail:
                        pack.tokens.extend(tail)
                        pack.segments.append((start, start + len(tail), a + shared))
                        for j, token in enumerate(c[shared + 1 :]):
                            idx.append(len(pack.targets))
                            pack.targets.append((start + j, token))
                    per_cand.append((shared, idx))
                plan.append((own, per_cand, cands.token_ids, chosen))
            packs.append(pack)
            plans.append(plan)
        return packs, plans

    def unpack(self, scores: Tensor, plan: Any) -> list[Tensor]:
        """Sequence log-probs -> log-softmax over candidates -> per-token conditionals."""
        from branchgym.agents.policies.scoring import trie_logprobs

        out = []
        for own, per_cand, cand_ids, chosen in plan:
            chosen_lp = scores[own]
            totals = []
            for ci, (shared, idx) in enumerate(per_cand):
                if ci == chosen:
                    totals.append(chosen_lp.sum())
                else:
                    totals.append(chosen_lp[:shared].sum() + scores[idx].sum())
            log_pi = torch.log_softmax(torch.stack(totals), dim=-1)
            out.append(trie_logprobs(log_pi, cand_ids, chosen))
        return out


#: policy name -> how it acts and how its log-probs are recomputed.
POLICIES: dict[str, PolicyKind] = {"generate": GenerateKind(), "scoring": ScoringKind()}


def resolve_policy(policy: str, model: str) -> str:
    """The policy kind a run with ``policy`` on ``model`` uses.

    ``auto`` is the scoring policy for the ``tiny`` model (a random model almost never
    writes a valid action) and free generation for any other.
    """
    if policy == "auto":
        return "scoring" if model == "tiny" else "generate"
    return policy
