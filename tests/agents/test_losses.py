"""branchgym.agents.estimators.losses: aggregation, PPO-clip, KL, Bellman PO, OPD, PBR.

The advantages these losses consume (group baselines, eq. 5, Bellman PO's weights, OPD's
log-ratio) are tested with their module in test_advantages.py.

Expected values are computed by hand in the tests (small cases) or by a second, plainer
formula; the theory tests on TreeMDP are in test_theory.py.
"""

import math

import pytest
import torch

from branchgym.agents.estimators import losses as L
from branchgym.error import LossInputError


@pytest.fixture(autouse=True)
def _float64():  # exact comparisons; restored afterwards
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


# ------------------------------------------------------------------- aggregation


def test_aggregations_differ_as_documented():
    v = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
    m = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert torch.isclose(L.aggregate(v, m, "token-mean"), torch.tensor(8 / 5))
    # per sequence 1 and 4; the third has no counted token and is left out
    assert torch.isclose(L.aggregate(v, m, "seq-mean-token-mean"), torch.tensor(2.5))
    assert torch.isclose(L.aggregate(v, m, "seq-mean-token-sum"), torch.tensor(4.0))
    x = torch.ones(2, 3, requires_grad=True)
    empty = L.aggregate(x, torch.zeros(2, 3))
    empty.backward()
    assert empty.item() == 0.0 and torch.equal(x.grad, torch.zeros(2, 3))
    with pytest.raises(LossInputError, match="unknown aggregation"):
        L.aggregate(v, m, "mean")


# ------------------------------------------------------------------------- PPO


def _logits_and_logp(shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(*shape, 6, generator=g)).requires_grad_(True)
    tokens = torch.randint(0, 6, shape, generator=g)
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    return logits, tokens, logp


def test_ppo_on_policy_is_the_policy_gradient():
    logits, _, logp = _logits_and_logp((3, 5))
    adv = torch.tensor([1.0, -0.5, 2.0])
    out = L.ppo_clip_loss(logp, logp.detach(), adv)
    assert torch.isclose(out.loss, -adv.mean())  # ratio 1 everywhere, 5 tokens each
    (g1,) = torch.autograd.grad(out.loss, logits, retain_graph=True)
    (g2,) = torch.autograd.grad(-(adv[:, None] * logp).mean(), logits)
    assert torch.allclose(g1, g2)
    assert out.clip_fraction == 0 and torch.isclose(out.ratio_mean, torch.tensor(1.0))
    assert out.approx_kl_old.abs() < 1e-12


def test_ppo_clip_cases():
    logp = torch.log(torch.tensor([[0.6, 0.3, 0.6, 0.3]])).requires_grad_(True)
    old = torch.log(torch.tensor([[0.4, 0.6, 0.4, 0.6]]))  # ratios 1.5, 0.5, 1.5, 0.5
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    out = L.ppo_clip_loss(logp, old, adv, eps=0.2)
    (g,) = torch.autograd.grad(out.loss, logp)
    # ratio 1.5 with A > 0 and 0.5 with A < 0 are clipped: no gradient; the other two keep
    # the unclipped (pessimistic) term, gradient -A * ratio / 4
    assert torch.allclose(g, torch.tensor([[0.0, 0.0, 1.5 / 4, -0.5 / 4]]))
    assert out.clip_fraction == 0.5
    expect = -(1.2 * 1 + 0.8 * -1 + 1.5 * -1 + 0.5 * 1) / 4
    assert torch.isclose(out.policy_loss, torch.tensor(expect))
    # clip-higher: a wider upper range lets the 1.5 token through
    hi = L.ppo_clip_loss(logp, old, adv, eps=0.2, eps_high=0.6)
    assert hi.clip_fraction == 0.25


def test_ppo_advantages_broadcast_and_mask():
    logits, _, logp = _logits_and_logp((2, 4))
    old = logp.detach() + 0.1
    seq_adv = torch.tensor([0.7, -1.2])
    a = L.ppo_clip_loss(logp, old, seq_adv)
    b = L.ppo_clip_loss(logp, old, seq_adv[:, None].expand(2, 4).clone())
    assert torch.isclose(a.loss, b.loss)
    # padding with garbage log-probs changes nothing where it is masked out
    pad = torch.cat([logp, torch.full((2, 3), float("nan"))], -1)
    pad_old = torch.cat([old, torch.full((2, 3), -1e9)], -1)
    mask = torch.cat([torch.ones(2, 4), torch.zeros(2, 3)], -1)
    c = L.ppo_clip_loss(pad, pad_old, seq_adv, mask)
    assert torch.isclose(c.loss, a.loss)
    with pytest.raises(LossInputError, match="fit neither"):
        L.ppo_clip_loss(logp, old, torch.ones(3))
    with pytest.raises(LossInputError, match="old_logp shape"):
        L.ppo_clip_loss(logp, old[:, :2], seq_adv)


def test_ppo_kl_term_and_metrics():
    _, _, logp = _logits_and_logp((2, 4))
    ref = logp.detach() - 0.3
    out = L.ppo_clip_loss(logp, logp.detach(), torch.zeros(2), ref_logp=ref, beta=0.05)
    k3 = math.expm1(-0.3) + 0.3
    assert torch.isclose(out.kl, torch.tensor(k3))
    assert torch.isclose(out.loss, 0.05 * out.kl)
    metrics = out.metrics()
    assert set(metrics) >= {"losses/loss", "losses/kl", "losses/clip_fraction"}
    assert all(isinstance(v, float) for v in metrics.values())


# -------------------------------------------------------------------------- KL


def test_kl_estimators_against_exact_kl():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(8, generator=g), -1)  # pi_theta
    q = torch.softmax(torch.randn(8, generator=g), -1)  # pi_ref
    exact = (p * (p / q).log()).sum()
    lp, lq = p.log(), q.log()
    expect = {k: (p * L.kl_estimate(lp, lq, k)).sum() for k in ("k1", "k2", "k3")}
    # k1 and k3 are unbiased: their expectation under pi_theta is the KL exactly
    assert torch.isclose(expect["k1"], exact) and torch.isclose(expect["k3"], exact)
    assert (L.kl_estimate(lp, lq, "k3") >= 0).all()
    assert (L.kl_estimate(lp, lq, "k1") < 0).any()  # k1 can go negative per sample
    # k2 is biased but close for nearby policies
    q2 = torch.softmax(lp + 0.05 * torch.randn(8, generator=g), -1)
    exact2 = (p * (p / q2).log()).sum()
    assert torch.isclose((p * L.kl_estimate(lp, q2.log(), "k2")).sum(), exact2, rtol=0.05)
    assert L.KL_ESTIMATORS.keys() == {"k1", "k2", "k3"}
    with pytest.raises(LossInputError, match="Schulman"):
        L.kl_estimate(lp, lq, "k4")


# ------------------------------------------------------------------ Bellman PO


def test_bellman_skipped_groups_leave_the_mean():
    logits, _, logp = _logits_and_logp((2, 3, 4))
    old = logp.detach() - 0.05
    rewards = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.5]])
    both = L.bellman_po_loss(logp, old, rewards)
    alone = L.bellman_po_loss(logp[1:], old[1:], rewards[1:])
    assert both.groups_skipped == 1 and both.groups == 2
    assert torch.isclose(both.loss, alone.loss)  # not halved by the skipped group
    all_skipped = L.bellman_po_loss(logp[:1], old[:1], rewards[:1])
    all_skipped.loss.backward()  # zero, but still a graph
    assert all_skipped.loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))
    assert set(both.metrics()) >= {"losses/groups_skipped", "losses/mask_fraction"}
    with pytest.raises(LossInputError, match=r"\(\.\.\., G, T\)"):
        L.bellman_po_loss(logp, old, rewards[:, :2])


# ------------------------------------------------------------------------- OPD


def test_opd_tree_loss_is_token_mean_ppo_on_opd_advantages():
    logits, _, logp = _logits_and_logp((2, 5))
    old = logp.detach() + 0.05
    teacher = logp.detach() + torch.linspace(-2, 2, 10).reshape(2, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 0]])  # branch counted from its fork
    out = L.opd_tree_loss(logp, old, teacher, mask, delta=0.5)
    adv = torch.clamp(teacher - logp.detach(), -0.5, 0.5)
    ref = L.ppo_clip_loss(logp, old, adv, mask, aggregation="token-mean")
    assert torch.isclose(out.loss, ref.loss)
    old_variant = L.opd_tree_loss(logp, old, teacher, mask, delta=0.5, student="old")
    assert not torch.isclose(old_variant.loss, out.loss)
    # the student moves towards the teacher: descent raises the teacher-liked token
    # (1, 2) and lowers the disliked (0, 0); masked tokens get nothing
    (g,) = torch.autograd.grad(out.loss, logp)
    assert g[1, 2] < 0 < g[0, 0] and g[1, 0] == 0 and g[1, 4] == 0
    with pytest.raises(LossInputError, match="student must be"):
        L.opd_tree_loss(logp, old, teacher, mask, student="teacher")


# ------------------------------------------------------------------------- PBR


def test_pbr_loss_values_by_hand():
    logits = torch.tensor([[[2.0, 0.0, 1.0, -1.0], [0.0, 0.0, 0.0, 0.0]]], requires_grad=True)
    p = torch.softmax(logits.detach(), -1)[0]
    cons = [
        L.ProtocolConstraint(0, (3,), 1.0),  # raise token 3 at position 0
        L.ProtocolConstraint(1, (0, 1), 0.0),  # suppress {0, 1} at position 1
    ]
    out = L.pbr_loss(logits, cons, lam=1.0, cap=100.0)
    expect = (-torch.log(p[0, 3]) - torch.log(1 - p[1, 0] - p[1, 1])) / 2
    assert torch.isclose(out.proto_mean, expect) and torch.isclose(out.loss, expect)
    assert out.n_constraints == 2 and not out.capped
    # a descent step moves both probabilities the right way
    out.loss.backward()
    with torch.no_grad():
        q = torch.softmax(logits - 0.5 * logits.grad, -1)[0]
    assert q[0, 3] > p[0, 3] and q[1, :2].sum() < p[1, :2].sum()


def test_pbr_cap_modes():
    logits = torch.zeros(1, 3, 50, requires_grad=True)
    cons = [L.ProtocolConstraint(i, (7,), 1.0) for i in range(3)]  # -log(1/50) = 3.91 each
    scaled = L.pbr_loss(logits, cons)  # 0.01 * 3.91 > 0.02
    assert scaled.capped and torch.isclose(scaled.loss, torch.tensor(0.02))
    (g_scaled,) = torch.autograd.grad(scaled.loss, logits)
    raw = L.pbr_loss(logits, cons, lam=0.01, cap=1.0)
    (g_raw,) = torch.autograd.grad(raw.loss, logits)
    # same direction, magnitude scaled by cap / value
    assert torch.allclose(g_scaled, g_raw * 0.02 / raw.loss.item())
    clamped = L.pbr_loss(logits, cons, cap_mode="clamp")
    (g_clamped,) = torch.autograd.grad(clamped.loss, logits)
    assert torch.isclose(clamped.loss, torch.tensor(0.02)) and torch.equal(
        g_clamped, torch.zeros_like(g_clamped)
    )
    none = L.pbr_loss(logits, [])
    assert none.loss.item() == 0.0 and none.n_constraints == 0


def test_pbr_input_errors():
    logits = torch.zeros(2, 4, 10)
    for bad, match in [
        (L.ProtocolConstraint(4, (1,), 1.0), "outside logits"),
        (L.ProtocolConstraint(0, (1,), 1.0, seq=2), "outside logits"),
        (L.ProtocolConstraint(0, (10,), 1.0), r"ids in \[0, 10\)"),
        (L.ProtocolConstraint(0, (), 1.0), "non-empty"),
        (L.ProtocolConstraint(0, (1,), 2.0), "target b"),
    ]:
        with pytest.raises(LossInputError, match=match):
            L.pbr_loss(logits, [bad])
    with pytest.raises(LossInputError, match="cap_mode"):
        L.pbr_loss(logits, [], cap_mode="soft")
    with pytest.raises(LossInputError, match="ProtocolConstraint"):
        L.pbr_loss(logits, [(0, (1,), 1.0)])
    # C = the whole vocabulary with b = 1 is fine (loss 0), not NaN
    whole = L.pbr_loss(logits, [L.ProtocolConstraint(0, tuple(range(10)), 1.0)])
    assert torch.isfinite(whole.loss) and abs(whole.loss.item()) < 1e-6


def test_pbr_loss_computes_in_float32_for_bf16_logits():
    logits = torch.zeros(1, 2, 40, dtype=torch.bfloat16)
    logits[0, 0, 5] = -12.0  # p ~ 1.5e-7: below what bf16 resolves next to 1
    out = L.pbr_loss(logits, [L.ProtocolConstraint(0, (5,), 1.0)], lam=1.0, cap=100.0)
    assert out.loss.dtype == torch.float32
    expect = 12.0 + math.log(39 + math.exp(-12.0))
    assert out.loss.item() == pytest.approx(expect, rel=1e-4)


def test_padding_garbage_reaches_neither_loss_nor_gradient():
    logits, _, logp = _logits_and_logp((2, 3, 4))
    mask = torch.ones(2, 3, 4)
    mask[..., 3] = 0  # the last token of every sequence is padding
    nan = torch.full((2, 3, 1), float("nan"))
    pad = lambda x: torch.cat([x[..., :3], nan], -1)  # noqa: E731
    logp_p, old_p = pad(logp), pad(logp.detach() - 0.1)
    rewards = torch.tensor([[1.0, 0.0, 0.5], [0.0, 0.0, 1.0]])
    losses = [
        L.ppo_clip_loss(logp_p, old_p, pad(torch.ones(2, 3, 4)), mask, ref_logp=old_p).loss,
        L.bellman_po_loss(logp_p, old_p, rewards, mask).loss,
        L.opd_tree_loss(logp_p, old_p, pad(logp.detach() + 0.5), mask).loss,
    ]
    for loss in losses:
        (g,) = torch.autograd.grad(loss, logits, retain_graph=True)
        assert torch.isfinite(loss) and torch.isfinite(g).all() and g.abs().sum() > 0
    for mode in L.AGGREGATIONS:
        assert torch.isfinite(L.aggregate(pad(torch.ones(2, 3, 4)), mask, mode))
