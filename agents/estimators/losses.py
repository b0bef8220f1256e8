"""Losses shared by every learner: pure functions on torch tensors.

Equation numbers refer to ``docs/algorithms.md``. The advantages the losses consume
(group baselines, eq. 4-5, Bellman PO's weights, OPD's log-ratio) live in
:mod:`branchgym.agents.estimators.advantages`. Conventions:

* Token losses take per-token log-probabilities of shape ``(..., T)`` whose **last
  dimension is tokens**; ``mask`` (same shape, bool or 0/1) says which tokens count.
  A rollout tree's mask counts each shared prefix once (algorithms.md eq. 6); building it is the
  engine's job, these functions only honour it.
* Sequence-level advantages of shape ``(...,)`` are broadcast to every token of their
  sequence; per-token advantages of shape ``(..., T)`` are used as they are.
* Every option docs/algorithms.md calls an ambiguity is a keyword with its default; the
  variants are picked from dicts of functions (:data:`AGGREGATIONS`,
  :data:`KL_ESTIMATORS`, :data:`PBR_CAPS`), never by string comparison inside a loss.

Bad input (wrong shapes, unknown options) raises
:class:`branchgym.error.LossInputError`, whose message says the fix.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

from branchgym.agents.estimators.advantages import (
    bellman_po_weights,
    grpo_advantages,
    opd_advantages,
)
from branchgym.error import DependencyMissingError, LossInputError

try:
    import torch
    from torch import Tensor
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra(
        "branchgym.agents.estimators.losses", "llm", "torch"
    ) from exc

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "PBR_CAPS",
    "BellmanPOLoss",
    "PBRLoss",
    "PolicyLoss",
    "ProtocolConstraint",
    "aggregate",
    "bellman_po_loss",
    "bellman_po_mask",
    "kl_estimate",
    "opd_tree_loss",
    "pbr_loss",
    "ppo_clip_loss",
]


# ================================================================== aggregation


def _weighted(values: Tensor, mask: Tensor) -> Tensor:
    # where, not a product: NaN or inf in padding must not reach the sum (NaN * 0 = NaN).
    return torch.where(mask > 0, values * mask, 0.0)


def _token_mean(values: Tensor, mask: Tensor) -> Tensor:
    return _weighted(values, mask).sum() / mask.sum().clamp(min=1)


def _per_sequence(values: Tensor, mask: Tensor, *, mean: bool) -> Tensor:
    n = mask.sum(-1)
    per_seq = _weighted(values, mask).sum(-1)
    if mean:
        per_seq = per_seq / n.clamp(min=1)
    has = (n > 0).to(values.dtype)  # sequences with no counted token are left out
    return (per_seq * has).sum() / has.sum().clamp(min=1)


#: Loss aggregation over tokens (last dim) and sequences; names as in verl.
AGGREGATIONS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    # every counted token of the batch weighs the same (eq. 6, L_tree of BranchOPD)
    "token-mean": _token_mean,
    # mean over tokens within a sequence, then over sequences (Bellman PO, algorithms.md §3)
    "seq-mean-token-mean": lambda v, m: _per_sequence(v, m, mean=True),
    # sum over tokens within a sequence, then mean over sequences
    "seq-mean-token-sum": lambda v, m: _per_sequence(v, m, mean=False),
}


def aggregate(values: Tensor, mask: Tensor | None = None, mode: str = "token-mean") -> Tensor:
    """Reduce per-token ``values`` (``(..., T)``) to a scalar with :data:`AGGREGATIONS`.

    Tokens with ``mask == 0`` do not count; sequences without counted tokens are left out
    of sequence means; an empty batch gives 0 (still connected to the graph).
    """
    fn = AGGREGATIONS.get(mode)
    if fn is None:
        raise LossInputError(f"unknown aggregation {mode!r}; choose one of {list(AGGREGATIONS)}.")
    m = torch.ones_like(values) if mask is None else mask.to(values.dtype)
    if m.shape != values.shape:
        raise LossInputError(
            f"mask shape {tuple(m.shape)} differs from per-token shape {tuple(values.shape)}."
        )
    if values.ndim == 0:
        raise LossInputError("aggregate: values need a token dimension (last); got a scalar.")
    return fn(values, m)


def _token_inputs(
    what: str, logp: Tensor, others: dict[str, Tensor | None], mask: Tensor | None
) -> Tensor:
    """Check per-token shapes; return the float mask."""
    if not isinstance(logp, Tensor) or logp.ndim == 0:
        raise LossInputError(
            f"{what}: logp must be a tensor of per-token log-probabilities, shape (..., T)."
        )
    for name, t in others.items():
        if t is not None and t.shape != logp.shape:
            raise LossInputError(
                f"{what}: {name} shape {tuple(t.shape)} differs from logp shape "
                f"{tuple(logp.shape)}; both are per-token, last dimension = tokens."
            )
    if mask is None:
        return torch.ones_like(logp)
    if mask.shape != logp.shape:
        raise LossInputError(
            f"{what}: mask shape {tuple(mask.shape)} differs from logp shape {tuple(logp.shape)}."
        )
    return mask.to(logp.dtype)


def _broadcast_advantages(what: str, advantages: Tensor, logp: Tensor) -> Tensor:
    """Sequence-level ``(...,)`` advantages go to every token; ``(..., T)`` stay as they are."""
    adv = torch.as_tensor(advantages, dtype=logp.dtype, device=logp.device)
    if adv.shape == logp.shape:
        return adv
    if adv.shape == logp.shape[:-1]:
        return adv.unsqueeze(-1).expand_as(logp)
    raise LossInputError(
        f"{what}: advantages of shape {tuple(adv.shape)} fit neither the sequences "
        f"{tuple(logp.shape[:-1])} nor the tokens {tuple(logp.shape)}."
    )


# ========================================================================== KL


def _kl_k1(log_r: Tensor) -> Tensor:
    return -log_r


def _kl_k2(log_r: Tensor) -> Tensor:
    return 0.5 * log_r.square()


def _kl_k3(log_r: Tensor) -> Tensor:
    return torch.expm1(log_r) - log_r


#: Schulman, "Approximating KL Divergence" (2020): with x ~ q and r = p(x) / q(x),
#: KL(q || p) is estimated by k1 = -log r (unbiased, high variance, can be negative),
#: k2 = (log r)^2 / 2 (biased, low variance), k3 = (r - 1) - log r (unbiased, >= 0).
KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {"k1": _kl_k1, "k2": _kl_k2, "k3": _kl_k3}


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of ``KL(pi_theta || pi_ref)`` from tokens sampled by ``pi_theta``.

    This is the ``beta * KL(pi_theta || pi_ref)`` term of eq. (6). With
    ``r = pi_ref(a|s) / pi_theta(a|s)``: ``k1 = -log r``, ``k2 = (log r)^2 / 2``,
    ``k3 = (r - 1) - log r`` (the default, as in GRPO). Gradients flow through ``logp``.

    Args:
        logp: ``(..., T)`` log-probabilities of the sampled tokens under the policy.
        ref_logp: Same shape, under the frozen reference policy.
        kind: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        Per-token estimates, shape ``(..., T)``; aggregate them with :func:`aggregate`.
    """
    fn = KL_ESTIMATORS.get(kind)
    if fn is None:
        raise LossInputError(
            f"unknown KL estimator {kind!r}; choose one of {list(KL_ESTIMATORS)} "
            "(Schulman's k1, k2, k3)."
        )
    if ref_logp.shape != logp.shape:
        raise LossInputError(
            f"kl_estimate: ref_logp shape {tuple(ref_logp.shape)} differs from logp shape "
            f"{tuple(logp.shape)}."
        )
    return fn(ref_logp.detach() - logp)


# ==================================================================== PPO-clip


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """A policy loss and its diagnostics (diagnostics are detached scalars).

    Attributes:
        loss: The scalar to backpropagate (policy term + ``beta`` * KL term).
        policy_loss: The clipped policy-gradient term alone.
        kl: Aggregated KL to the reference policy (0 when no reference was given).
        clip_fraction: Share of counted tokens whose gradient the clip removed (ratio
            above ``1 + eps_high`` with a positive advantage, or below ``1 - eps`` with a
            negative one).
        ratio_mean: Mean ratio ``pi_theta / pi_old`` over counted tokens.
        approx_kl_old: k3 estimate of ``KL(pi_old || pi_theta)``, the usual drift monitor.
        advantage_mean: Mean token advantage over counted tokens.
    """

    loss: Tensor
    policy_loss: Tensor
    kl: Tensor
    clip_fraction: Tensor
    ratio_mean: Tensor
    approx_kl_old: Tensor
    advantage_mean: Tensor

    def metrics(self, prefix: str = "losses/") -> dict[str, float]:
        """Namespaced floats for logging."""
        return {
            f"{prefix}{f.name}": float(getattr(self, f.name).detach())
            for f in dataclasses.fields(self)
        }


def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    *,
    eps: float = 0.2,
    eps_high: float | None = None,
    aggregation: str = "token-mean",
    ref_logp: Tensor | None = None,
    beta: float = 0.05,
    kl_estimator: str = "k3",
) -> PolicyLoss:
    """PPO-clip surrogate over the tokens of a batch or a rollout tree, algorithms.md eq. (6).

    ``L = -agg[min(rho * A, clip(rho, 1 - eps, 1 + eps_high) * A)] + beta * agg[KL]`` with
    the per-token ratio ``rho = pi_theta(a|s) / pi_old(a|s)`` and the action's advantage
    broadcast to each of its tokens.

    Args:
        logp: ``(..., T)`` log-probabilities under the current policy (with gradient).
        old_logp: Same shape, under the rollout policy ``pi_old`` (no gradient).
        advantages: ``(...,)`` per sequence (broadcast to its tokens) or ``(..., T)``
            per token (a tree whose steps carry eq. 5 advantages).
        mask: ``(..., T)`` tokens that count; a tree's mask counts shared prefixes once.
        eps: Clip range (algorithms.md default 0.2).
        eps_high: Upper clip range when it differs (DAPO's clip-higher); default ``eps``.
        aggregation: A key of :data:`AGGREGATIONS`; ``"token-mean"`` (default, eq. 6) or
            ``"seq-mean-token-mean"`` / ``"seq-mean-token-sum"``.
        ref_logp: Log-probabilities under the frozen reference policy; when given, the
            ``beta * KL(pi_theta || pi_ref)`` term of eq. (6) is added.
        beta: KL coefficient (algorithms.md default 0.05); used only with ``ref_logp``.
        kl_estimator: A key of :data:`KL_ESTIMATORS` (default ``"k3"``).

    Returns:
        :class:`PolicyLoss`.
    """
    m = _token_inputs("ppo_clip_loss", logp, {"old_logp": old_logp, "ref_logp": ref_logp}, mask)
    if eps < 0 or (eps_high is not None and eps_high < 0):
        raise LossInputError("ppo_clip_loss: clip ranges must be >= 0.")
    hi = eps if eps_high is None else eps_high
    on = m > 0
    # Padding may hold garbage (NaN, -inf): replace it before any nonlinearity, so that
    # neither the loss nor the gradient (0 * NaN) can see it.
    adv = torch.where(on, _broadcast_advantages("ppo_clip_loss", advantages, logp).detach(), 0.0)
    log_ratio = torch.where(on, logp - old_logp.detach(), 0.0)
    ratio = torch.exp(log_ratio)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - eps, 1.0 + hi) * adv)
    policy = aggregate(-surrogate, m, aggregation)
    if ref_logp is not None:
        per_token_kl = kl_estimate(
            torch.where(on, logp, 0.0), torch.where(on, ref_logp, 0.0), kl_estimator
        )
        kl = aggregate(per_token_kl, m, aggregation)
        loss = policy + beta * kl
    else:
        kl = torch.zeros((), dtype=logp.dtype, device=logp.device)
        loss = policy
    with torch.no_grad():
        clipped = ((ratio > 1.0 + hi) & (adv > 0)) | ((ratio < 1.0 - eps) & (adv < 0))
        stats = (
            _token_mean(clipped.to(m.dtype), m),
            _token_mean(ratio, m),
            _token_mean(torch.expm1(log_ratio) - log_ratio, m),
            _token_mean(adv, m),
        )
    return PolicyLoss(loss, policy, kl.detach(), *stats)


# ================================================================== Bellman PO


def bellman_po_mask(
    advantages: Tensor, omega: Tensor, eps_high: float = 0.28, eps_low: float = 0.2
) -> Tensor:
    """The sign-dependent mask ``M`` of Bellman PO (algorithms.md §3).

    ``M = 0`` where ``A > 0`` and ``omega > 1 + eps_high`` (the token was already pushed
    up enough), ``M = 0`` where ``A < 0`` and ``omega < 1 - eps_low`` (already pushed down
    enough), else ``M = 1``. The spec keeps ``eps_high`` and ``eps_low`` separate and gives
    no values; the defaults 0.28 / 0.2 are DAPO's clip-higher ranges, the baseline the
    source compares with. The mask tests ``omega``, never ``pi / mu``.

    Args:
        advantages: Advantages broadcastable to ``omega`` (per sequence ``(..., 1)`` or
            per token).
        omega: Token weights from :func:`bellman_po_weights`.
        eps_high: Upper threshold for positive advantages.
        eps_low: Lower threshold for negative advantages.

    Returns:
        Bool tensor of ``omega``'s shape; True = the token keeps its gradient.
    """
    drop_up = (advantages > 0) & (omega > 1.0 + eps_high)
    drop_down = (advantages < 0) & (omega < 1.0 - eps_low)
    return ~(drop_up | drop_down)


@dataclasses.dataclass(frozen=True)
class BellmanPOLoss:
    """Bellman PO loss and its diagnostics (diagnostics are detached).

    Attributes:
        loss: The scalar to backpropagate.
        groups_skipped: Groups with std = 0 (no signal), left out of the loss.
        groups: All groups.
        mask_fraction: Share of counted tokens the sign-dependent mask removed.
        cap_fraction: Share of counted tokens whose weight hit the cap ``C``.
        omega_mean: Mean ``omega`` over counted tokens.
    """

    loss: Tensor
    groups_skipped: int
    groups: int
    mask_fraction: Tensor
    cap_fraction: Tensor
    omega_mean: Tensor

    def metrics(self, prefix: str = "losses/") -> dict[str, float]:
        """Namespaced floats for logging."""
        return {
            f"{prefix}bellman_po": float(self.loss.detach()),
            f"{prefix}groups_skipped": float(self.groups_skipped),
            f"{prefix}groups": float(self.groups),
            f"{prefix}mask_fraction": float(self.mask_fraction),
            f"{prefix}cap_fraction": float(self.cap_fraction),
            f"{prefix}omega_mean": float(self.omega_mean),
        }


def bellman_po_loss(
    logp: Tensor,
    old_logp: Tensor,
    rewards: Tensor,
    mask: Tensor | None = None,
    *,
    eps: float = 0.1,
    cap: float = 3.0,
    eps_high: float = 0.28,
    eps_low: float = 0.2,
    std_eps: float = 1e-6,
    aggregation: str = "seq-mean-token-mean",
) -> BellmanPOLoss:
    """Bellman Policy Optimization loss (algorithms.md §3).

    Per token: ``L = -A_i * M_{i,t} * min(stopgrad(omega_{i,t}), C) * log pi_t``, with
    ``A_i`` the group-normalised advantage of response ``i`` (:func:`grpo_advantages`),
    ``omega`` from :func:`bellman_po_weights` and ``M`` from :func:`bellman_po_mask`;
    mean over tokens within a sequence, then over sequences. Groups whose rewards are
    all equal carry no signal: their sequences are left out of the mean entirely (not
    averaged in as zeros) and counted in :attr:`BellmanPOLoss.groups_skipped`.

    Args:
        logp: ``(..., G, T)`` log-probabilities under the current policy ``pi``.
        old_logp: Same shape, under the rollout policy ``mu``.
        rewards: ``(..., G)`` terminal rewards of the G responses of each prompt.
        mask: ``(..., G, T)`` generated tokens that count.
        eps: Smoothing of ``omega`` (algorithms.md default 0.1).
        cap: Weight cap ``C`` (algorithms.md default 3.0).
        eps_high: Mask threshold for positive advantages.
        eps_low: Mask threshold for negative advantages.
        std_eps: Stabiliser of the advantage's std.
        aggregation: A key of :data:`AGGREGATIONS` (spec: ``"seq-mean-token-mean"``).

    Returns:
        :class:`BellmanPOLoss`.
    """
    m = _token_inputs("bellman_po_loss", logp, {"old_logp": old_logp}, mask)
    if cap <= 0:
        raise LossInputError(f"bellman_po_loss: cap C must be > 0 (default 3.0); got {cap}.")
    adv, degenerate = grpo_advantages(rewards, std_eps)
    if logp.ndim < 2 or adv.shape != logp.shape[:-1]:
        raise LossInputError(
            f"bellman_po_loss: rewards shape {tuple(adv.shape)} must equal logp's "
            f"leading shape {tuple(logp.shape[:-1])}: logp is (..., G, T), rewards (..., G)."
        )
    adv = adv.to(device=logp.device, dtype=logp.dtype)
    degenerate = degenerate.to(logp.device)
    # Skipped groups leave the sequence mean entirely instead of adding zeros to it.
    m = m * (~degenerate).to(m.dtype)[..., None, None]
    on = m > 0
    logp = torch.where(on, logp, 0.0)  # padding garbage must not reach the gradient
    with torch.no_grad():
        omega = bellman_po_weights(torch.where(on, old_logp, 0.0).exp(), logp.exp(), eps)
        a = adv.unsqueeze(-1)
        keep = bellman_po_mask(a, omega, eps_high, eps_low).to(m.dtype)
        weight = torch.clamp(omega, max=cap)
    per_token = -a * keep * weight * logp
    loss = aggregate(per_token, m, aggregation)
    with torch.no_grad():
        stats = (
            _token_mean(1.0 - keep, m),
            _token_mean((omega >= cap).to(m.dtype), m),
            _token_mean(omega, m),
        )
    return BellmanPOLoss(loss, int(degenerate.sum()), int(degenerate.numel()), *stats)


# ======================================================================== OPD


def opd_tree_loss(
    logp: Tensor,
    old_logp: Tensor,
    teacher_logp: Tensor,
    mask: Tensor | None = None,
    *,
    delta: float = 1.0,
    eps: float = 0.2,
    student: str = "current",
) -> PolicyLoss:
    """``L_tree`` of Branching OPD (algorithms.md §2 step 5): token-mean PPO-clip on OPD advantages.

    The mask ``M`` keeps every generated token of the main trajectory and each branch's
    tokens from its fork on, so a shared prefix is counted once; environment
    observations are context only and must be masked out.

    Args:
        logp: ``(..., T)`` student log-probabilities (with gradient).
        old_logp: Same shape, under the rollout policy ``pi_old``.
        teacher_logp: Same shape, under the frozen teacher.
        mask: ``(..., T)`` the ``M`` mask.
        delta: Advantage clip bound, see :func:`opd_advantages`.
        eps: PPO clip range (algorithms.md default 0.2).
        student: Which student log-prob enters ``dlogp``: ``"current"`` (``pi_theta``, the
            spec's wording; detached) or ``"old"`` (``pi_old``, fixed across updates).

    Returns:
        :class:`PolicyLoss` (no KL term).
    """
    students = {"current": logp, "old": old_logp}
    if student not in students:
        raise LossInputError(f"opd_tree_loss: student must be 'current' or 'old'; got {student!r}.")
    _token_inputs("opd_tree_loss", logp, {"old_logp": old_logp, "teacher_logp": teacher_logp}, mask)
    adv = opd_advantages(teacher_logp, students[student], delta)
    return ppo_clip_loss(logp, old_logp, adv, mask, eps=eps, aggregation="token-mean")


# ======================================================================== PBR


@dataclasses.dataclass(frozen=True)
class ProtocolConstraint:
    """One protocol-boundary constraint ``(s, C, b)`` (algorithms.md §2 step 6).

    Attributes:
        position: Index into the logits' token dimension: ``logits[seq, position]`` is the
            distribution of the token that follows ``tokens[: position + 1]`` (causal-LM
            convention, as Hugging Face models return them).
        token_ids: The token set ``C``.
        target: ``b``: 1 raises ``p(C|s)``, 0 suppresses it (a float in [0, 1] is a soft
            target).
        seq: Row of the batch the position belongs to.
        rule: Name of the detector that emitted it (for logs).
    """

    position: int
    token_ids: tuple[int, ...]
    target: float
    seq: int = 0
    rule: str = ""


def _psi_scale(value: Tensor, cap: float) -> Tensor:
    # Rescale to the cap but keep the gradient's direction: the worst protocol errors,
    # exactly those that exceed the cap, still get repaired.
    if float(value.detach()) <= cap:
        return value
    return value * (cap / value.detach())


def _psi_clamp(value: Tensor, cap: float) -> Tensor:
    return torch.clamp(value, max=cap)


#: How ``Psi`` caps ``lambda * mean l_proto``: ``scale`` (default) rescales to the cap and
#: keeps a gradient of bounded size; ``clamp`` is ``min(x, cap)``, whose gradient is zero
#: once the cap binds.
PBR_CAPS: dict[str, Callable[[Tensor, float], Tensor]] = {
    "scale": _psi_scale,
    "clamp": _psi_clamp,
}


@dataclasses.dataclass(frozen=True)
class PBRLoss:
    """Protocol-boundary repair loss and its diagnostics.

    Attributes:
        loss: ``Psi[lambda * mean l_proto]``, to add to ``L_tree``.
        proto_mean: Detached ``mean l_proto`` before weighting and capping.
        n_constraints: Number of constraints.
        capped: Whether the cap bound.
    """

    loss: Tensor
    proto_mean: Tensor
    n_constraints: int
    capped: bool

    def metrics(self, prefix: str = "losses/") -> dict[str, float]:
        """Namespaced floats for logging."""
        return {
            f"{prefix}pbr": float(self.loss.detach()),
            f"{prefix}pbr_proto_mean": float(self.proto_mean),
            f"{prefix}pbr_constraints": float(self.n_constraints),
            f"{prefix}pbr_capped": float(self.capped),
        }


def pbr_loss(
    logits: Tensor,
    constraints: Iterable[ProtocolConstraint],
    *,
    lam: float = 0.01,
    cap: float = 0.02,
    cap_mode: str = "scale",
) -> PBRLoss:
    """Protocol-boundary repair auxiliary loss of Branching OPD (algorithms.md §2 step 6).

    For each constraint ``(s, C, b)``:
    ``l_proto = -b log p(C|s) - (1 - b) log(1 - p(C|s))`` with ``p(C|s)`` the total
    probability of the token set ``C``; the loss is ``Psi[lambda * mean l_proto]``, where
    ``Psi`` caps it at ``cap``. Both logs are computed exactly as log-sum-exps over ``C``
    and over its complement, so neither underflows.

    Args:
        logits: ``(T, V)`` or ``(B, T, V)`` next-token logits of the student.
        constraints: From the detectors of :mod:`branchgym.agents.estimators.pbr`.
        lam: Weight ``lambda`` (algorithms.md default 0.01).
        cap: The cap ``Psi`` enforces (algorithms.md default 0.02).
        cap_mode: A key of :data:`PBR_CAPS` (``"scale"`` by default, or ``"clamp"``).

    Returns:
        :class:`PBRLoss`; zero (and no gradient) without constraints.
    """
    psi = PBR_CAPS.get(cap_mode)
    if psi is None:
        raise LossInputError(
            f"pbr_loss: cap_mode must be one of {list(PBR_CAPS)}; got {cap_mode!r}."
        )
    if logits.ndim == 2:
        logits = logits.unsqueeze(0)
    if logits.ndim != 3:
        raise LossInputError(
            f"pbr_loss: logits must be (T, V) or (B, T, V); got shape {tuple(logits.shape)}."
        )
    cons = list(constraints)
    zero = logits.new_zeros(())
    if not cons:
        return PBRLoss(zero, zero, 0, False)
    n_seq, n_pos, vocab = logits.shape
    member = torch.zeros(len(cons), vocab, dtype=torch.bool, device=logits.device)
    for i, c in enumerate(cons):
        _check_constraint(c, n_seq, n_pos, vocab)
        member[i, list(c.token_ids)] = True
    seq = torch.tensor([c.seq for c in cons], device=logits.device)
    pos = torch.tensor([c.position for c in cons], device=logits.device)
    # Log-softmax in float32 at least: bf16 logits lose the small probabilities PBR targets.
    logprobs = torch.log_softmax(
        logits[seq, pos].to(torch.promote_types(logits.dtype, torch.float32)), dim=-1
    )
    b = torch.tensor([float(c.target) for c in cons], dtype=logprobs.dtype, device=logits.device)
    log_in = torch.logsumexp(logprobs.masked_fill(~member, -math.inf), dim=-1)
    log_out = torch.logsumexp(logprobs.masked_fill(member, -math.inf), dim=-1)
    # 0 * (-inf) would be NaN when C (or its complement) is the whole vocabulary.
    term_in = torch.where(b > 0, -b * log_in, 0.0)
    term_out = torch.where(b < 1, -(1.0 - b) * log_out, 0.0)
    proto = (term_in + term_out).mean()
    value = lam * proto
    out = psi(value, cap)
    return PBRLoss(out, proto.detach(), len(cons), bool(value.detach() > cap))


def _check_constraint(c: Any, n_seq: int, n_pos: int, vocab: int) -> None:
    if not isinstance(c, ProtocolConstraint):
        raise LossInputError(
            f"pbr_loss: constraints must be ProtocolConstraint; got {type(c).__name__}."
        )
    if not (0 <= c.seq < n_seq and 0 <= c.position < n_pos):
        raise LossInputError(
            f"pbr_loss: constraint at seq {c.seq}, position {c.position} is outside logits "
            f"of {n_seq} sequences x {n_pos} positions."
        )
    if not c.token_ids or not all(0 <= t < vocab for t in c.token_ids):
        raise LossInputError(
            f"pbr_loss: token set {c.token_ids!r} of rule {c.rule!r} must be non-empty ids "
            f"in [0, {vocab})."
        )
    if not 0.0 <= float(c.target) <= 1.0:
        raise LossInputError(f"pbr_loss: target b must be in [0, 1]; got {c.target}.")
