"""Training with vLLM generation (``engine="vllm"``): the worker, and the behaviour log-probs.

:func:`start_worker` starts a :class:`~branchgym.agents.engines.vllm_worker.VLLMWorker`
on the trainer's model (weights synced after every update; docs/engine.md, "Training
with vLLM"). The trees' behaviour log-probs then come from vLLM's sampler, while the
loss's ``pi_theta`` comes from the trainer's forward pass: two implementations of the
same policy, which agree only to rounding in float32 and differ more in bf16 (other
kernels, other reduction orders). :func:`behaviour_correction` runs at the start of
each batch's updates:

* it recomputes every counted token's log-prob with the trainer's model (one no-grad
  forward pass over the sampled tokens, the same weights vLLM sampled with) and logs
  the on-policy ratio ``r = pi_trainer / mu_vllm`` per token: ``vllm/ratio_absdev``
  (mean ``|r - 1|``), ``vllm/ratio_max_absdev`` (max ``|r - 1|``) and
  ``vllm/logp_maxdiff`` (max ``|log pi - log mu|``);
* ``vllm_logprobs="recompute"`` (default) makes the trainer's log-probs the PPO ratio's
  ``pi_old``, so the first update's ratio is exactly 1 and the clip is not spent on
  kernel noise;
* ``vllm_logprobs="tis"`` does the same and also weights each token's policy-gradient
  term by the truncated importance weight ``min(pi_old / mu_vllm, tis_cap)``
  (truncated importance sampling, from "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training"), which corrects for sampling from vLLM's slightly different
  distribution. The weight scales the token's advantage: exact for PPO-clip, whose
  per-token term is linear in a positive advantage scale. Logged: ``vllm/tis_weight``
  (mean) and ``vllm/tis_truncated`` (fraction of tokens at the cap).

Entropies stay vLLM's (exact for vocabularies up to 4,096 tokens, else its top-k
estimate): they pick branch points while a tree grows, before any trainer pass, and
enter no gradient.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from branchgym.error import DependencyMissingError

if TYPE_CHECKING:
    from branchgym.agents.engines.vllm_worker import VLLMWorker
    from branchgym.agents.forward.rows import Batch

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra(
        "branchgym.agents.training.vllm_training", "llm", "torch"
    ) from exc

__all__ = [
    "VLLM_LOGPROBS",
    "behaviour_correction",
    "shared_worker",
    "start_worker",
    "stop_worker",
    "worker_model_folder",
]

#: ``vllm_logprobs`` options: how the trainer treats vLLM's behaviour log-probs.
VLLM_LOGPROBS = ("recompute", "tis")

_SHARED: list[VLLMWorker] = []


@contextlib.contextmanager
def shared_worker(worker: VLLMWorker) -> Iterator[VLLMWorker]:
    """Runs started inside use ``worker`` instead of starting their own, and leave it running.

    One vLLM start for several runs (a sweep, a test module). Each run points the worker
    at its own model, whose weights replace the worker's before its first generation; the
    model architectures must match.
    """
    _SHARED.append(worker)
    try:
        yield worker
    finally:
        _SHARED.remove(worker)


def stop_worker(worker: VLLMWorker) -> None:
    """Stop a run's worker at the end of the run (a :func:`shared_worker` keeps running)."""
    if not any(w is worker for w in _SHARED):
        worker.close()


def worker_model_folder(model: Any, tokenizer: Any) -> tuple[str, bool]:
    """A model folder vLLM can start from, and whether it is a copy to delete afterwards.

    The folder the trainer loaded the model from when it holds safetensors weights (a
    plain start from a model folder), else a copy written to shared memory (the ``tiny``
    model, a checkpoint, whose optimizer state vLLM would take for weights, LoRA adapters
    merged): config, tokenizer and the weights.
    """
    from safetensors.torch import save_file

    from branchgym.agents.engines.vllm_worker import is_weights_file, state_dict_for_vllm

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    src = Path(str(getattr(base, "name_or_path", "") or ""))
    files = list(src.glob("*.safetensors")) if src.is_dir() else []
    if (src / "config.json").is_file() and files and all(map(is_weights_file, files)):
        return str(src), False
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    out = Path(tempfile.mkdtemp(prefix="branchgym-vllm-model-", dir=shm))
    base.config.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tokenizer.save_pretrained(out)
    save_file(state_dict_for_vllm(model), str(out / "model.safetensors"))
    return str(out), True


def start_worker(run: Any) -> VLLMWorker:
    """The vLLM worker of a :class:`~branchgym.agents.training.run.Run` (``engine="vllm"``).

    It starts from the run's model and syncs ``run.model`` whenever the run's update
    marks the weights stale (``engine.clear_cache()``), before the next generation.
    """
    from branchgym.agents.engines.vllm_worker import VLLMWorker

    a = run.args
    if _SHARED:
        worker = _SHARED[-1]
        worker.trainer_model = lambda: run.model
        worker.clear_cache()
        return worker
    folder, copy = worker_model_folder(run.model, run.tokenizer)
    try:
        worker = VLLMWorker(
            folder,
            tokenizer=run.tokenizer,
            trainer_model=lambda: run.model,
            python=a.vllm_python,
            max_new_tokens=a.max_new_tokens,
            llm_kwargs=a.vllm_options,
            remove_model=copy,
        )
    except BaseException:
        if copy:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)
        raise
    worker.clear_cache()  # a resumed run loads its weights after this: sync before sampling
    return worker


@torch.no_grad()
def behaviour_correction(run: Any, batch: Batch) -> dict[str, float]:
    """Recompute the batch's behaviour log-probs with the trainer; log the on-policy ratio.

    Sets each decision's ``old_logp`` to the trainer's log-probs (and, for ``tis``, its
    ``is_weight``); returns the ``vllm/*`` metrics. See the module docstring.
    """
    a = run.args
    rows = [r for r in batch.rows if r.decisions]
    if not rows or getattr(run, "algo", None) == "sft":  # SFT's replies are not sampled
        return {}
    budget = getattr(a, "micro_batch_tokens", 0)
    if budget:  # the forward passes of the update's token budget (memory.py)
        from branchgym.agents.training.memory import token_chunks

        groups = [r.group for r in rows]
        parts = [[rows[i] for i in c] for c in token_chunks(run.row_tokens(rows), groups, budget)]
    else:
        step = max(1, a.micro_batch_rows or len(rows))
        parts = [rows[i : i + step] for i in range(0, len(rows), step)]
    deltas, weights = [], []
    for part in parts:
        lps, _ = run.logprobs(run.model, part)  # the adapters on, when LoRA trains
        for row, per in zip(part, lps, strict=True):
            for d, lp in zip(row.decisions, per, strict=True):
                mine = lp.float().cpu().numpy().astype(np.float32)
                counted = d.mask > 0
                deltas.append((mine - np.asarray(d.old_logp, np.float32))[counted])
                if a.vllm_logprobs == "tis":
                    w = np.minimum(np.exp(mine - np.asarray(d.old_logp, np.float64)), a.tis_cap)
                    d.is_weight = w.astype(np.float32)
                    weights.append(w[counted])
                d.old_logp = mine
    delta = np.concatenate(deltas) if deltas else np.zeros(0)
    if not delta.size:
        return {}
    dev = np.abs(np.expm1(delta.astype(np.float64)))
    out = {
        "vllm/ratio_absdev": float(dev.mean()),
        "vllm/ratio_max_absdev": float(dev.max()),
        "vllm/logp_maxdiff": float(np.abs(delta).max()),
        "vllm/tokens": float(delta.size),
    }
    if weights:
        w = np.concatenate(weights)
        out["vllm/tis_weight"] = float(w.mean())
        out["vllm/tis_truncated"] = float((w >= a.tis_cap).mean())
    stats = getattr(run.engine, "stats", {})
    out["vllm/syncs_total"] = float(stats.get("syncs", 0))  # weight syncs so far
    out["vllm/sync_s_total"] = float(stats.get("sync_s", 0.0))
    return out
