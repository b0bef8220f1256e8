"""Estimator-level gradient noise: surrogate gradient, NSR/cosine math, the study, diagnose."""

import functools
import json
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from branchgym.agents.forward.rows import WEIGHTS, Batch, Decision, Row  # noqa: E402
from branchgym.agents.gradient_probe import (  # noqa: E402
    NoiseStats,
    parse_learner,
    surrogate_gradient,
)
from branchgym.agents.learners import bpo, grpo  # noqa: E402
from branchgym.cli import main  # noqa: E402

# ------------------------------------------------------------ the surrogate gradient

S, V = 3, 4  # states and tokens of a tabular "model": log pi(token | state) = log_softmax(theta[s])


class Table(torch.nn.Module):
    def __init__(self, theta):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.tensor(theta, dtype=torch.float32))


def _fake_run(model):
    """What surrogate_gradient needs of a Run: model, chunks, logprobs, device."""

    def logprobs(m, rows, logit_positions=None):
        lp = torch.log_softmax(m.theta, dim=-1)
        out = []
        for row in rows:
            out.append([lp[d.context, torch.as_tensor(d.token_ids)] for d in row.decisions])
        return out, []

    return types.SimpleNamespace(
        model=model,
        device="cpu",
        chunks=lambda batch, rows: [list(rows[:1]), list(rows[1:])],  # two chunks: accumulation
        logprobs=logprobs,
    )


def _decision(state, tokens, mask, adv):
    tokens = np.asarray(tokens)
    return Decision(
        tree=0,
        node=0,
        context=state,
        token_ids=tokens,
        old_logp=np.full(tokens.size, -9.0, dtype=np.float32),  # far off: ratio 1 must be forced
        mask=np.asarray(mask, dtype=np.float32),
        advantage=adv,
    )


def _tiny_batch():
    rows = [
        # row 0: two decisions; the first token of the second is a copied prefix (mask 0)
        [_decision(0, [1, 2], [1, 1], 0.7), _decision(1, [3, 0, 0], [0, 1, 1], -0.4)],
        [_decision(2, [2], [1], 1.5)],
        [_decision(0, [0, 3, 1], [1, 1, 1], -1.1)],
    ]
    batch = Batch([])
    batch.rows = [Row(0, i, i, ds, 0.0, False) for i, ds in enumerate(rows)]
    return batch


def _hand_gradient(theta, batch, aggregation):
    """d/dtheta of agg(A * log softmax(theta[s])[token]) over counted tokens, by hand."""
    theta = np.asarray(theta, dtype=np.float64)
    p = np.exp(theta - theta.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    per_row = []
    for row in batch.rows:
        g, count = np.zeros_like(theta), 0.0
        for d in row.decisions:
            for tok, m in zip(d.token_ids, d.mask, strict=True):
                if m:
                    g[d.context] += d.advantage * (np.eye(V)[tok] - p[d.context])
                    count += 1
        per_row.append((g, count))
    if aggregation == "token-mean":
        return sum(g for g, _ in per_row) / sum(c for _, c in per_row)
    return sum(g / c for g, c in per_row) / len(per_row)  # seq-mean-token-mean


@pytest.mark.parametrize(
    ("loss", "aggregation"),
    [
        (functools.partial(bpo.loss, bpo.Args(beta=0.0)), "token-mean"),
        (functools.partial(grpo.loss, grpo.Args(beta=0.0)), "seq-mean-token-mean"),
    ],
)
def test_surrogate_gradient_matches_the_hand_computed_one(loss, aggregation):
    rng = np.random.default_rng(0)
    theta = rng.normal(size=(S, V))
    model = Table(theta)
    batch = _tiny_batch()
    g = surrogate_gradient(_fake_run(model), batch, loss, WEIGHTS[aggregation])
    want = _hand_gradient(model.theta.detach().numpy(), batch, aggregation)
    assert g.shape == (S * V,)
    np.testing.assert_allclose(g.numpy(), want.reshape(-1), rtol=1e-5, atol=1e-6)
    assert model.theta.grad is None  # read out, not left behind for an optimizer


# ------------------------------------------------------------ NSR and cosine math


def test_noise_stats_exact_on_small_vectors():
    g = np.array([[1.0, 0.0, 2.0], [0.0, 1.0, 1.0], [2.0, 1.0, 0.0], [1.0, 2.0, 1.0]])
    st = NoiseStats()
    for row in g:
        st.add(row, tokens=10, rollouts=2)
    s = st.summary()
    mean = g.mean(0)
    tr = np.trace(np.cov(g.T, ddof=1))
    assert s["trace_cov"] == pytest.approx(tr)
    assert s["mean_sq"] == pytest.approx(mean @ mean)
    assert s["nsr"] == pytest.approx(tr / (mean @ mean))
    assert s["signal"] == pytest.approx(mean @ mean - tr / 4)
    a, b = g[0::2].mean(0), g[1::2].mean(0)  # halves: even and odd draws
    assert s["cosine"] == pytest.approx(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
    assert s["signal_split"] == pytest.approx(a @ b)
    norms = np.linalg.norm(g, axis=1)
    assert s["norm_var"] == pytest.approx(norms.var(ddof=1))
    assert s["tokens_per_batch"] == 10 and s["rollouts_per_batch"] == 2


def test_noise_stats_recover_a_known_covariance():
    rng = np.random.default_rng(1)
    d, n = 40, 4000
    mu = np.zeros(d)
    mu[:4] = 1.0  # |mu|^2 = 4
    sigma = np.linspace(0.5, 1.5, d)  # tr Cov = sum sigma^2
    st = NoiseStats()
    for _ in range(n):
        st.add(mu + sigma * rng.normal(size=d))
    s = st.summary()
    tr = float((sigma**2).sum())
    assert s["trace_cov"] == pytest.approx(tr, rel=0.05)
    assert s["signal"] == pytest.approx(4.0, rel=0.05)
    assert s["signal_split"] == pytest.approx(4.0, rel=0.05)
    assert s["nsr_corrected"] == pytest.approx(tr / 4.0, rel=0.07)
    assert s["nsr"] == pytest.approx(tr / (4.0 + tr / n), rel=0.07)
    # each half mean = mu + noise of covariance Cov / (n/2): E cos ~ |mu|^2 / (|mu|^2 + tr/(n/2))
    assert s["cosine"] == pytest.approx(4.0 / (4.0 + 2 * tr / n), abs=0.02)


def test_noise_stats_need_two_batches():
    st = NoiseStats()
    st.add(np.ones(3))
    with pytest.raises(ValueError, match="at least 2"):
        st.summary()


def test_parse_learner():
    assert parse_learner("grpo") == ("grpo", "grpo", {})
    assert parse_learner("bpo:lam=0.9, tail=zero") == (
        "bpo:lam=0.9, tail=zero",
        "bpo",
        {"lam": "0.9", "tail": "zero"},
    )
    with pytest.raises(Exception, match="KEY=VALUE"):
        parse_learner("bpo:lam")


# ------------------------------------------------------------ the study and diagnose


@pytest.mark.slow
def test_gradient_noise_study_quick(tmp_path, capsys):
    args = ["bench", "gradient-noise", "--quick", "--out", str(tmp_path)]
    args += ["--learners", "grpo", "rloo", "bpo", "bpo:lam=0.5"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "NSR (matched rollouts)" in out and "bpo / grpo" in out
    md = (tmp_path / "gradient_noise.md").read_text()
    for label in ("| grpo |", "| rloo |", "| bpo |", "| bpo:lam=0.5 |"):
        assert label in md
    data = json.loads((tmp_path / "gradient_noise.json").read_text())
    res = data["results"]
    assert set(res) == {"grpo", "rloo", "bpo", "bpo:lam=0.5"}
    for s in res.values():
        assert s["batches"] == 6 and s["dims"] > 1000
        assert np.isfinite(s["nsr"]) and s["nsr"] > 0 and -1 <= s["cosine"] <= 1
        assert s["rollouts_per_batch"] == 14  # 2 prompts x N = 7, matched rollouts
        # learner tokens from the rows' real sequences; pack_trees reads shared prefixes once
        assert 0 < s["packed_tokens_per_batch"] < s["learner_tokens_per_batch"]
        assert s["decisions_per_batch"] > 0 and s["prompt_tokens_per_row"] > 0
    ref = res["grpo"]["tokens_per_batch"]
    b = res["bpo"]
    assert b["nsr_tokens"] == pytest.approx(b["nsr"] * b["tokens_per_batch"] / ref)
    assert (tmp_path / "gradient_noise_nsr.png").stat().st_size > 1000


def test_maze_options_parse_and_reject_bad_pairs():
    from branchgym.bench.gradient_noise import _maze_options
    from branchgym.error import OptionError

    assert _maze_options("termination_prob=0.3, end_actions=1") == {
        "termination_prob": 0.3,
        "end_actions": 1,
    }
    assert _maze_options("") == {}
    with pytest.raises(OptionError, match="KEY=VALUE"):
        _maze_options("termination_prob")


@pytest.mark.slow
def test_diagnose_prints_the_estimator_figure(capsys):
    args = ["diagnose", "branchgym/TextTreeMDP-v0", "--prompts", "2"]
    args += ["--env-kwargs", '{"depth": 3, "transition_noise": 0.3}', "--noise-batches", "4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "implied Var(A^BPO)/Var(A^GRPO)" in out
    assert "noise-to-signal at matched tokens, BPO/RLOO" in out
    assert "=> estimator:" in out


def _study_args(*argv):
    import argparse

    from branchgym.bench import gradient_noise

    parser = argparse.ArgumentParser()
    gradient_noise.configure(parser)
    return gradient_noise, parser.parse_args(list(argv))


def test_maze_options_apply_to_the_maze_only_and_env_kwargs_are_checked(tmp_path):
    from branchgym.error import OptionError

    study, args = _study_args(
        "--env", "branchgym/WebShop-v0", "--maze", "depth=3", "--out", str(tmp_path)
    )
    with pytest.raises(OptionError, match="--env-kwargs"):
        study.main(args)
    study, args = _study_args(
        "--env", "branchgym/WebShop-v0", "--env-kwargs", "max_steps", "--out", str(tmp_path)
    )
    with pytest.raises(OptionError, match="--env-kwargs takes KEY=VALUE"):
        study.main(args)
    assert not list(tmp_path.iterdir())  # refused before measuring anything
