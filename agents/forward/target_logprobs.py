"""Log-probs of target tokens through the output layer without a (rows x vocabulary) graph.

The learners need ``log softmax(h W^T + b)[target]`` at every scored position. Written
plainly, autograd keeps the logits, their log-softmax, a zero-filled tensor for the
gather's gradient and the log-softmax's gradient: four ``(rows x V)`` float tensors per
pass (SmolLM2: 150 MB each for 800 completion tokens), each freshly allocated, which on a
CPU means page faults as the kernel zeroes them. :func:`target_logprobs` computes the
same numbers in chunks of rows and keeps one ``(rows x V)`` tensor, the softmax, for the
backward pass (none without gradients: the reference and old-policy passes):

* forward, per chunk: ``z = h W^T + b``; ``lse = logsumexp(z)``; the result is
  ``z[target] - lse``; ``softmax = exp(z - lse)`` is kept;
* backward, per chunk, with ``g`` the gradient of the result:
  ``dz = g (onehot(target) - softmax)``, ``dh = dz W``, ``dW += dz^T h``, ``db += sum dz``.

Exact to float rounding (the same sums in another order); the learners' gradient tests
compare against the plain path. Applies to a plain ``torch.nn.Linear`` output layer
(:func:`fusable`); anything else (a LoRA-wrapped head, logit soft-capping inside the
model's own forward) keeps the plain path.
"""

from __future__ import annotations

from typing import Any

from branchgym.error import DependencyMissingError

try:
    import torch
    from torch import Tensor
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra(
        "branchgym.agents.forward.target_logprobs", "llm", "torch"
    ) from exc

__all__ = ["CHUNK_ROWS", "fusable", "target_logprobs"]

#: Rows of the output layer computed at once (SmolLM2: 128 x 49,152 floats = 25 MB).
CHUNK_ROWS = 128


def fusable(head: Any) -> bool:
    """Whether :func:`target_logprobs` computes ``head`` (a plain ``nn.Linear``)."""
    return type(head) is torch.nn.Linear


def target_logprobs(hidden: Tensor, head: torch.nn.Linear, targets: Tensor) -> Tensor:
    """``log_softmax(head(hidden).float())[i, targets[i]]`` for every row ``i``.

    Args:
        hidden: ``(rows, d)`` hidden states that predict the targets.
        head: The output layer (:func:`fusable`).
        targets: ``(rows,)`` token ids.

    Returns:
        ``(rows,)`` float32 log-probs, differentiable in ``hidden`` and the head's
        parameters when gradients are on.
    """
    targets = targets.to(device=hidden.device, dtype=torch.long)
    if torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in head.parameters())
    ):
        return _TargetLogprobs.apply(hidden, head.weight, head.bias, targets)
    out, _ = _chunks(hidden, head.weight, head.bias, targets, keep=False)
    return out


def _chunks(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, *, keep: bool
) -> tuple[Tensor, Tensor | None]:
    """Target log-probs, chunk by chunk; with ``keep``, the softmax of every row too."""
    rows = hidden.shape[0]
    out = torch.empty(rows, dtype=torch.float32, device=hidden.device)
    probs = (
        torch.empty(rows, weight.shape[0], dtype=torch.float32, device=hidden.device)
        if keep
        else None
    )
    for s in range(0, rows, CHUNK_ROWS):
        e = min(rows, s + CHUNK_ROWS)
        z = torch.nn.functional.linear(hidden[s:e], weight, bias).float()
        lse = torch.logsumexp(z, dim=-1)
        out[s:e] = z.gather(-1, targets[s:e, None])[:, 0] - lse
        if probs is not None:
            torch.exp(z.sub_(lse[:, None]), out=probs[s:e])
    return out, probs


class _TargetLogprobs(torch.autograd.Function):
    """:func:`target_logprobs` with gradients (see the module notes for the formulas)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor
    ) -> Tensor:
        out, probs = _chunks(hidden, weight, bias, targets, keep=True)
        ctx.save_for_backward(hidden, weight, targets, probs)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, targets, probs = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w: Tensor | None = None
        grad_b = (
            torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
            if need_b and ctx.has_bias
            else None
        )
        grad = grad.float()
        for s in range(0, hidden.shape[0], CHUNK_ROWS):
            e = min(hidden.shape[0], s + CHUNK_ROWS)
            g = grad[s:e]
            dz = probs[s:e] * -g[:, None]
            dz[torch.arange(e - s, device=dz.device), targets[s:e]] += g
            if grad_b is not None:
                grad_b += dz.sum(0)
            dz = dz.to(weight.dtype)
            if grad_h is not None:
                grad_h[s:e] = dz @ weight
            if need_w:  # accumulated in float32; the first chunk's product starts it
                dzt, h = dz.t().float(), hidden[s:e].float()
                grad_w = dzt @ h if grad_w is None else grad_w.addmm_(dzt, h)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(weight.dtype)
        return grad_h, grad_w, grad_b, None
