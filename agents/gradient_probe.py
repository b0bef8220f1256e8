"""Estimator-level gradient noise of a learner at a frozen policy.

A learner's training step is rollouts -> advantages -> loss -> gradient -> optimizer
step. :func:`probe_learner` runs the learner's own ``main`` (its rollouts, its
advantages: the entries of :data:`branchgym.agents.estimators.advantages.ADVANTAGES` it picks,
its fallbacks and masks, its aggregation) with a :class:`ProbeRun` in place of
:class:`~branchgym.agents.training.run.Run`: instead of an optimizer update, each batch's
**surrogate policy gradient** is computed and handed to a callback, and the weights
never change. So every batch is an independent draw of the learner's gradient
estimator at one fixed policy, and nothing of eq. 4/5 is re-implemented here.

The surrogate gradient of a batch is the gradient of the learner's own loss with the
importance ratio exactly 1 (``old_logp`` set to the current log-probs, detached) and
``beta = 0``, negated (ascent direction). For PPO-clip at ratio 1 that is

    g = grad_theta agg_{counted tokens}( A_t * log pi_theta(a_t | s_t) )

with the learner's aggregation (``token-mean`` for ``bpo``, ``seq-mean-token-mean`` for
GRPO/RLOO), accumulated over ``micro_batch_rows`` chunks with the learner's chunk
weights exactly as :meth:`Run.update` does. The gradient is flattened over **all
trainable parameters** (no projection); :class:`NoiseStats` keeps running sums only
(O(parameters) memory, however many batches).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from branchgym.agents.training.run import Batch, Chunk, Run, TrainResult, token_weight
from branchgym.error import TrainingConfigError

try:
    import torch
    from torch import Tensor
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    from branchgym.error import DependencyMissingError

    raise DependencyMissingError.for_extra(
        "branchgym.agents.gradient_probe", "llm", "torch"
    ) from exc

__all__ = [
    "BatchGradient",
    "NoiseStats",
    "ProbeRun",
    "batch_tokens",
    "flat_grad",
    "parse_learner",
    "probe_learner",
    "surrogate_gradient",
]

#: Options every probe forces: no KL term (beta 0), one update over the whole batch, no
#: evaluation, no checkpoints; the learning rate is irrelevant (no optimizer step).
PROBE_OPTIONS: dict[str, Any] = {
    "beta": 0.0,
    "updates_per_batch": 1,
    "eval_episodes": 0,
    "checkpoint_every": 0,
    "progress": False,
    "overwrite": True,
}


@dataclasses.dataclass
class BatchGradient:
    """One batch's surrogate gradient and what the batch cost.

    Attributes:
        grad: Flattened gradient over all trainable parameters (float64, CPU).
        tokens: Generated tokens of the batch (each counted once: the tokens the loss counts).
        rollouts: Rollouts (root-to-leaf paths) of the batch.
        rows: Rows the loss saw.
        learner_tokens: Tokens the update's forward passes read without prefix sharing
            (every row's whole sequence: prompt, dialogue, replies).
        packed_tokens: The same with ``pack_trees`` (a row's prefix shared with the row
            before it of its tree read once).
        decisions: Decisions of the rows (a shared prefix's once).
        prompt_tokens: Mean tokens of a row's first prompt (system prompt and task).
    """

    grad: Tensor
    tokens: float
    rollouts: int
    rows: int
    learner_tokens: float = float("nan")
    packed_tokens: float = float("nan")
    decisions: int = 0
    prompt_tokens: float = float("nan")


def flat_grad(params: Sequence[Tensor]) -> Tensor:
    """``p.grad`` of every parameter, flattened and concatenated (zeros where None), float64."""
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).double()
            for p in params
        ]
    ).cpu()


def batch_tokens(batch: Batch) -> float:
    """Counted (generated, each once) tokens of a batch."""
    return token_weight(batch, list(range(len(batch.rows))))


def surrogate_gradient(
    run: Run,
    batch: Batch,
    loss_fn: Callable[[Chunk], tuple[Tensor, dict[str, float]]],
    weight: Callable[[Batch, list[int]], float] | None = None,
    rows: Sequence[int] | None = None,
) -> Tensor:
    """The policy gradient of ``rows`` (default all) at ratio 1 (ascent), flattened.

    The weights are left unchanged and no gradient is left behind on them.

    Same chunks and chunk weights as :meth:`Run.update`; ``old_logp`` of each chunk is
    replaced by its current log-probs (detached), so the clip never binds and the
    gradient is that of the learner's surrogate ``agg(A * log pi)``.
    """
    weight = weight or token_weight
    params = [p for p in run.model.parameters() if p.requires_grad]
    run.model.zero_grad(set_to_none=True)
    rows = list(range(len(batch.rows))) if rows is None else list(rows)
    chunks = run.chunks(batch, rows)
    weights = [float(weight(batch, c)) for c in chunks]
    total = sum(weights)
    if total > 0:
        for c, w in zip(chunks, weights, strict=True):
            if w <= 0:
                continue
            lps, _ = run.logprobs(run.model, [batch.rows[r] for r in c])
            ch = batch.chunk(c, lps, run.device)
            ch.old_logp = ch.logp.detach().clone()
            ch.ref_logp = None
            loss, _ = loss_fn(ch)
            (-loss * (w / total)).backward()
    g = flat_grad(params)
    run.model.zero_grad(set_to_none=True)
    return g


class ProbeRun(Run):
    """A :class:`Run` whose updates measure the surrogate gradient and never step.

    Set :attr:`sink` (``BatchGradient -> None``) before the learner's ``main`` builds it
    (:func:`probe_learner` does). Checkpoints, evaluation and curve plots are skipped.
    """

    sink: Callable[[BatchGradient], None] | None = None

    def update(
        self,
        batch: Batch,
        rows: Sequence[int],
        loss_fn: Callable[[Chunk], tuple[Tensor, dict[str, float]]],
        *,
        weight: Callable[[Batch, list[int]], float] | None = None,
        logit_positions: Callable[[Any], list[int]] | None = None,
    ) -> dict[str, float]:
        """Hand the surrogate gradient of ``rows`` to :attr:`sink`; no optimizer step.

        With ``updates_per_batch = 1`` (forced by :data:`PROBE_OPTIONS`) ``rows`` is the
        whole batch, whether the learner calls :meth:`updates` or this directly.
        """
        if logit_positions is not None:
            raise TrainingConfigError(
                "the gradient probe reads out losses of log-probs only (no full-logit losses)"
            )
        g = surrogate_gradient(self, batch, loss_fn, weight, rows)
        paths = sum(len(t.paths()) for t in batch.trees)
        if self.sink is not None:
            scored = [batch.rows[r] for r in rows if batch.rows[r].decisions]
            plain, packed = (sum(self.row_tokens_as(scored, pack)) for pack in (False, True))
            heads = [len(self.policy.prompt_ids(r.decisions[0].context)) for r in scored]
            self.sink(
                BatchGradient(
                    g,
                    token_weight(batch, list(rows)),
                    paths,
                    len(rows),
                    float(plain),
                    float(packed),
                    sum(len(r.decisions) for r in scored),
                    float(np.mean(heads)) if heads else float("nan"),
                )
            )
        return {"update/skipped": 0.0, "grad/norm": float(g.norm())}

    def row_tokens_as(self, rows: Sequence[Any], pack: bool) -> list[int]:
        """:meth:`Run.row_tokens` with ``pack_trees`` set to ``pack`` (both costs of a batch)."""
        was = self.args.pack_trees
        self.args.pack_trees = pack
        try:
            return self.row_tokens(rows)
        finally:
            self.args.pack_trees = was

    def save(self, folder: str | Path | None = None) -> Path:
        """No checkpoints: the policy never changes."""
        return self.out_dir

    def close(self) -> TrainResult:
        """Close the logs and the executor (no plot)."""
        self._metrics.close()
        self.executor.shutdown()
        return TrainResult(self.out_dir, None, self.history)


def parse_learner(text: str) -> tuple[str, str, dict[str, str]]:
    """``"bpo:lam=0.9,tail=zero"`` -> ``(label, algo, {"lam": "0.9", "tail": "zero"})``.

    The label is the text itself; options are the learner's Args fields (strings are
    converted by :func:`~branchgym.agents.train.make_args`).
    """
    algo, _, rest = text.partition(":")
    opts: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise TrainingConfigError(
                f"learner {text!r}: options are KEY=VALUE pairs after a colon, "
                "e.g. bpo:lam=0.9,tail=zero"
            )
        opts[key.strip().replace("-", "_")] = value.strip()
    return text, algo.strip(), opts


def probe_learner(
    algo: str,
    batches: int,
    *,
    on_batch: Callable[[BatchGradient], None],
    **options: Any,
) -> None:
    """Draw ``batches`` independent batches of ``algo`` at a frozen policy.

    Runs the learner's own ``main`` for ``batches`` steps with :class:`ProbeRun` in place
    of ``Run`` (options as for :func:`~branchgym.agents.train.train`; :data:`PROBE_OPTIONS`
    override them). Each step's prompts and sampling come from ``(seed, step)``, so the
    batches are independent draws; ``on_batch`` receives each one's gradient.
    """
    from branchgym.agents.train import learner, make_args

    opts = {**options, **PROBE_OPTIONS, "steps": int(batches)}
    with tempfile.TemporaryDirectory(prefix="gradient_probe_") as tmp:
        if options.get("out_dir") is None:
            opts["out_dir"] = tmp
        args = make_args(algo, **opts)
        spec = learner(algo)
        module = importlib.import_module(spec.module)
        _, main = spec.load()
        if getattr(module, "Run", None) is not Run:
            raise TrainingConfigError(
                f"{spec.module} does not build its run with branchgym.agents.training.run.Run; the "
                "gradient probe cannot stand in for it."
            )
        seen = [0]

        def sink(bg: BatchGradient) -> None:
            seen[0] += 1
            on_batch(bg)

        probe = type("ProbeRun", (ProbeRun,), {"sink": staticmethod(sink)})
        with mock.patch.object(module, "Run", probe):
            main(args, algo)
        if seen[0] != batches:
            raise TrainingConfigError(
                f"{algo}: expected {batches} gradient batches, got {seen[0]} (the learner's "
                "loop did not call run.updates once per step)."
            )


@dataclasses.dataclass
class NoiseStats:
    """Running sums of flattened gradients: noise, signal and split-half agreement.

    Batches alternate between halves A and B (even and odd draws). Memory is a few
    vectors of the gradient's size, whatever the number of batches.
    """

    n: int = 0
    total: Tensor | None = None
    half: list[Tensor | None] = dataclasses.field(default_factory=lambda: [None, None])
    half_n: list[int] = dataclasses.field(default_factory=lambda: [0, 0])
    half_sq: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0])
    sq: float = 0.0
    norms: list[float] = dataclasses.field(default_factory=list)
    tokens: list[float] = dataclasses.field(default_factory=list)
    rollouts: list[int] = dataclasses.field(default_factory=list)

    def add(self, g: Tensor | np.ndarray, tokens: float = 0.0, rollouts: int = 0) -> None:
        """Add one batch's gradient."""
        g = torch.as_tensor(g, dtype=torch.float64).reshape(-1)
        h = self.n % 2
        self.total = g.clone() if self.total is None else self.total + g
        self.half[h] = g.clone() if self.half[h] is None else self.half[h] + g
        self.half_n[h] += 1
        s = float(g @ g)
        self.sq += s
        self.half_sq[h] += s
        self.n += 1
        self.norms.append(math.sqrt(s))
        self.tokens.append(float(tokens))
        self.rollouts.append(int(rollouts))

    def summary(self) -> dict[str, float]:
        """Noise-to-signal ratio, split-half cosine and the noise-corrected signal.

        * ``trace_cov``: tr Cov(g), unbiased: ``(sum |g_i|^2 - n |mean|^2) / (n - 1)``;
        * ``mean_sq``: ``|mean|^2`` (biased up by ``trace_cov / n``);
        * ``signal``: ``|mean|^2 - trace_cov / n``, an unbiased estimate of ``|E g|^2``;
        * ``signal_split``: ``mean_A . mean_B``, another unbiased one (independent halves);
        * ``nsr``: ``trace_cov / |mean|^2`` (as asked: plain); ``nsr_corrected``:
          ``trace_cov / signal`` (nan when the signal estimate is not positive);
        * ``cosine``: cosine of the two half means (each from n/2 batches);
        * ``nsr_a``, ``nsr_b``: the plain NSR of each half alone (a spread indication);
        * ``norm_var``: Var(|g|) over batches at this fixed policy; ``norm_mean``.
        """
        n = self.n
        nan = float("nan")
        if n < 2 or self.total is None:
            raise ValueError("noise statistics need at least 2 batches")
        mean = self.total / n
        mean_sq = float(mean @ mean)
        tr = max((self.sq - n * mean_sq) / (n - 1), 0.0)
        signal = mean_sq - tr / n
        out = {
            "batches": float(n),
            "dims": float(mean.numel()),
            "trace_cov": tr,
            "mean_sq": mean_sq,
            "signal": signal,
            "nsr": tr / mean_sq if mean_sq > 0 else nan,
            "nsr_corrected": tr / signal if signal > 0 else nan,
            "norm_mean": float(np.mean(self.norms)),
            "norm_var": float(np.var(self.norms, ddof=1)),
            "tokens_per_batch": float(np.mean(self.tokens)),
            "rollouts_per_batch": float(np.mean(self.rollouts)),
        }
        a, b = self.half
        if a is not None and b is not None and min(self.half_n) >= 1:
            ma, mb = a / self.half_n[0], b / self.half_n[1]
            dot = float(ma @ mb)
            den = float(ma.norm() * mb.norm())
            out["cosine"] = dot / den if den > 0 else nan
            out["signal_split"] = dot
            for key, m, sq, k in (
                ("nsr_a", ma, self.half_sq[0], self.half_n[0]),
                ("nsr_b", mb, self.half_sq[1], self.half_n[1]),
            ):
                msq = float(m @ m)
                t = (sq - k * msq) / (k - 1) if k > 1 else nan
                out[key] = t / msq if msq > 0 and k > 1 else nan
        else:
            out.update(cosine=nan, signal_split=nan, nsr_a=nan, nsr_b=nan)
        return out
