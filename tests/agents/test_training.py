"""The training machinery: losses on hand-built trees, log-prob consistency, resume, errors.

The loss checks build rollout trees by hand and compare each learner's loss with the
functions of ``branchgym.agents.estimators.losses`` applied to tensors the test lays out itself;
the math is never re-implemented here.
"""

import dataclasses
import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from branchgym.agents.engines.hf import HFEngine  # noqa: E402
from branchgym.agents.estimators import advantages, losses, pbr  # noqa: E402
from branchgym.agents.forward import packed as forward  # noqa: E402
from branchgym.agents.learners import bellman_po, bpo, branch_opd, grpo, sft  # noqa: E402
from branchgym.agents.policies.models import load_model, tiny_qwen2  # noqa: E402
from branchgym.agents.policies.policy import ActRequest, Context, LLMPolicy, Policy  # noqa: E402
from branchgym.agents.policies.scoring import ScoringPolicy, trie_logprobs  # noqa: E402
from branchgym.agents.train import LEARNERS, make_args, train  # noqa: E402
from branchgym.agents.training import run as training  # noqa: E402
from branchgym.agents.training.run import (  # noqa: E402
    POLICIES,
    Batch,
    Run,
    args_from_dict,
    field_docs,
)
from branchgym.cli import main as cli_main  # noqa: E402
from branchgym.error import (  # noqa: E402
    CheckpointError,
    DataError,
    TrainingConfigError,
    UnknownEnvError,
)
from branchgym.rollout.executor_base import EnvRecipe  # noqa: E402
from branchgym.rollout.grow import group_rollouts, grow_tree  # noqa: E402
from branchgym.rollout.tree import RolloutTree  # noqa: E402

ENV_KWARGS = {"depth": 3, "n_actions": 3, "reward_kind": "bernoulli", "structure_seed": 2}
SPEC = EnvRecipe("branchgym/TextTreeMDP-v0", ENV_KWARGS)
TINY = {
    "env_kwargs": ENV_KWARGS,
    "prompts_per_step": 2,
    "lr": 1e-4,
    "threads": 1,
    "progress": False,
}


# ------------------------------------------------------------------ hand-built trees


def node(tree, parent, tokens, reward=0.0, done=False, prefix_len=0, seed=0):
    rng = np.random.default_rng(seed + 7 * len(tree))
    return tree.add(
        parent,
        action=f"a{len(tree)}",
        text=f"a{len(tree)}",
        token_ids=tokens,
        logprobs=-rng.uniform(0.05, 2.0, len(tokens)),
        entropies=np.ones(len(tokens)),
        reward=reward,
        terminated=done,
        prefix_len=prefix_len,
    ).id


def branching_tree():
    """Backbone 0-1-2; K=4 siblings at step 1 (under 0), K=3 at step 2 (under 1).

    Sibling 9 forks inside its turn: it copies the backbone's first token (prefix 1).
    """
    t = RolloutTree("hand", 0, "start", {})
    n0 = node(t, -1, [5, 6])
    n1 = node(t, n0, [7, 8, 9])
    node(t, n1, [10, 11], reward=1.0, done=True)  # 2
    for r in (0.0, 1.0, 0.0):  # 3-4, 5-6, 7-8
        s = node(t, n0, [12, 13])
        node(t, s, [14], reward=r, done=True)
    node(t, n1, [10, 15], reward=0.0, done=True, prefix_len=1)  # 9
    node(t, n1, [16, 17, 18], reward=0.0, done=True)  # 10
    t.set_fork_offset(n1, 0)
    return t


def group_tree(rewards, lengths, seed=0):
    """Independent rollouts from the reset state: each a chain of nodes, reward at the end."""
    t = RolloutTree("hand", seed, "start", {})
    for i, (r, n) in enumerate(zip(rewards, lengths, strict=True)):
        parent = -1
        for j in range(n):
            last = j == n - 1
            parent = node(
                t, parent, [20 + j, 30 + i], reward=r if last else 0.0, done=last, seed=seed
            )
    return t


def current_logp(batch, seed=0):
    """A perturbed copy of each decision's old log-probs, as leaves with gradients."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for row in batch.rows:
        per = []
        for d in row.decisions:
            old = torch.tensor(d.old_logp, dtype=torch.float32)
            per.append((old + 0.3 * torch.randn(old.shape, generator=g)).requires_grad_())
        out.append(per)
    return out


def flat_counted(batch, per_decision):
    """One row of every counted token (token-mean losses do not depend on the layout)."""
    cols = [
        (row_i, d_i, t)
        for row_i, row in enumerate(batch.rows)
        for d_i, d in enumerate(row.decisions)
        for t in range(d.n_tokens)
        if d.mask[t] > 0
    ]
    return torch.stack([per_decision(r, d, t) for r, d, t in cols])[None], cols


def test_bpo_loss_on_a_hand_built_tree_matches_eqs_4_5_6():
    tree = branching_tree()
    args = bpo.Args(beta=0.0, lam=0.9)
    adv, n_bp, n_deg = advantages.tree_advantages(tree, args.lam, args.tail)
    assert n_bp == 2 and n_deg == 0
    # eq. 4 at each branch point, by the losses module
    a1 = advantages.sibling_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64))
    a2 = advantages.sibling_advantages(torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    # eq. 5 along each owning path: (nodes, branch steps, local advantages of the path)
    paths = {
        2: ([0, 1, 2], [1, 2], [a1[0], a2[0]]),
        9: ([0, 1, 9], [1, 2], [a1[0], a2[1]]),
        10: ([0, 1, 10], [1, 2], [a1[0], a2[2]]),
        4: ([0, 3, 4], [1], [a1[1]]),
        6: ([0, 5, 6], [1], [a1[2]]),
        8: ([0, 7, 8], [1], [a1[3]]),
    }
    owned = {2: [0, 1, 2], 9: [9], 10: [10], 4: [3, 4], 6: [5, 6], 8: [7, 8]}
    expected = {}
    for leaf, (nodes, steps, local) in paths.items():
        along = advantages.propagate_advantages(len(nodes), steps, local, args.lam, args.tail)
        for nid in owned[leaf]:
            expected[nid] = float(along[nodes.index(nid)])
    assert adv == pytest.approx(expected)

    batch = Batch([tree])
    batch.set_advantages(lambda row, d: adv[d.node])
    # every generated token counted once: 2+3+2 backbone, 3x(2+1) siblings, 1+3 forks
    assert sum(float(d.mask.sum()) for d in batch.decisions()) == 7 + 9 + 4
    logp = current_logp(batch)
    got, _ = bpo.loss(args, batch.chunk(range(len(batch.rows)), logp))
    node_of = {(r, i): d for r, row in enumerate(batch.rows) for i, d in enumerate(row.decisions)}
    new, cols = flat_counted(batch, lambda r, d, t: logp[r][d][t])
    old, _ = flat_counted(batch, lambda r, d, t: torch.tensor(node_of[r, d].old_logp[t]))
    a, _ = flat_counted(batch, lambda r, d, t: torch.tensor(expected[node_of[r, d].node]))
    want = losses.ppo_clip_loss(new, old, a.float(), eps=args.eps, aggregation="token-mean")
    assert float(got.detach()) == pytest.approx(float(want.loss.detach()), rel=1e-6)
    g1 = torch.autograd.grad(got, [t for per in logp for t in per], retain_graph=True)
    g2 = torch.autograd.grad(want.loss, [t for per in logp for t in per], allow_unused=True)
    for x, y in zip(g1, g2, strict=True):
        torch.testing.assert_close(x, torch.zeros_like(x) if y is None else y)
    # the copied token of the in-turn fork (node 9) never counts
    (fork,) = [d for d in batch.decisions() if d.node == 9]
    assert fork.mask.tolist() == [0.0, 1.0]


def test_bpo_without_branches_falls_back_to_rloo_over_backbones():
    trees = [group_tree([1.0, 0.0, 0.0], [2, 2, 1]), group_tree([0.0, 0.0, 0.0], [1, 1, 1])]
    per_tree, skipped, _ = advantages.per_prompt(
        "rloo", trees, range(len(trees)), advantages.AdvantageOptions()
    )
    want, degenerate = advantages.rloo_advantages(torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert skipped == int(degenerate.sum()) == 1
    leaf_adv = [[per_tree[i][leaf] for leaf in t.leaves()] for i, t in enumerate(trees)]
    np.testing.assert_allclose(leaf_adv, want.numpy())


#: Per-rollout advantages of returns [1, 0, 1, 0], worked out by hand: GRPO divides the
#: deviation from the mean (0.5) by the Bessel-corrected std sqrt(1/3) (+ 1e-6); RLOO
#: subtracts the mean of the other three returns (2/3 or 1/3).
HAND_ADVANTAGES = {
    "grpo": [0.5 / (math.sqrt(1 / 3) + 1e-6) * s for s in (1, -1, 1, -1)],
    "rloo": [2 / 3, -2 / 3, 2 / 3, -2 / 3],
}


@pytest.mark.parametrize("advantage", ["grpo", "rloo"])
def test_grpo_loss_equals_a_from_scratch_computation(advantage):
    """GRPO's advantages and loss on a hand-made batch against plain-float arithmetic.

    The expected loss is computed here token by token, with no tensor code and nothing
    from ``branchgym.agents.estimators.losses``: per token ``rho = exp(logp - old)``, surrogate
    ``min(rho * A, clip(rho, 0.8, 1.2) * A)``, k3 KL ``exp(ref - logp) - 1 - (ref - logp)``;
    each aggregated as a token mean per row, then a mean over rows.
    """
    trees = [group_tree([1.0, 0.0, 1.0, 0.0], [2, 1, 3, 2], seed=s) for s in (0, 1)]
    args = grpo.Args(advantage=advantage, n=4, beta=0.05)
    adv, _, _ = advantages.per_prompt(
        args.advantage, trees, range(len(trees)), advantages.AdvantageOptions.of(args)
    )
    leaf_adv = [[adv[i][leaf] for leaf in t.leaves()] for i, t in enumerate(trees)]
    np.testing.assert_allclose(leaf_adv, [HAND_ADVANTAGES[advantage]] * 2, rtol=1e-6)
    batch = Batch(trees)
    rank = [{leaf: j for j, leaf in enumerate(t.leaves())} for t in trees]
    row_adv = [HAND_ADVANTAGES[advantage][rank[r.tree][r.leaf]] for r in batch.rows]
    batch.set_advantages(lambda row, d: adv[row.tree][row.leaf])
    for d in batch.decisions():  # a reference policy a little off the old one
        d.ref_logp = d.old_logp - 0.1
    logp = current_logp(batch, seed=1)
    got, metrics = grpo.loss(args, batch.chunk(list(range(len(batch.rows))), logp))

    policy_terms, kl_terms = [], []
    for row, per, a in zip(batch.rows, logp, row_adv, strict=True):
        surrogate, kl, counted = 0.0, 0.0, 0.0
        for d, new in zip(row.decisions, per, strict=True):
            for lp, old, ref, m in zip(
                new.detach().double().tolist(),
                d.old_logp.tolist(),
                d.ref_logp.tolist(),
                d.mask.tolist(),
                strict=True,
            ):
                old, ref = float(np.float32(old)), float(np.float32(ref))  # the chunk's dtype
                rho = math.exp(lp - old)
                clipped = min(max(rho, 0.8), 1.2)
                surrogate += m * min(rho * a, clipped * a)
                kl += m * (math.exp(ref - lp) - 1 - (ref - lp))
                counted += m
        assert counted > 0
        policy_terms.append(-surrogate / counted)
        kl_terms.append(kl / counted)
    want_kl = sum(kl_terms) / len(kl_terms)
    want = sum(policy_terms) / len(policy_terms) + 0.05 * want_kl
    assert float(got.detach()) == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert metrics["losses/kl"] == pytest.approx(want_kl, rel=1e-5, abs=1e-7)
    # the surrogate is not trivially flat: some ratios leave the clip range
    assert metrics["losses/clip_fraction"] > 0


def test_bellman_po_loss_matches_the_losses_module():
    rewards = [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]  # the second group carries no signal
    trees = [group_tree(r, [2, 1, 2], seed=i) for i, r in enumerate(rewards)]
    args = bellman_po.Args(g=3)
    batch = Batch(trees)
    logp = current_logp(batch, seed=2)
    got, metrics = bellman_po.loss(args, batch.chunk(range(len(batch.rows)), logp))
    width = max(r.n_tokens for r in batch.rows)
    new = torch.stack(
        [
            torch.nn.functional.pad(torch.cat(p), (0, width - sum(x.numel() for x in p)))
            for p in logp
        ]
    ).reshape(2, 3, width)
    old = torch.zeros(6, width)
    mask = torch.zeros(6, width)
    for i, row in enumerate(batch.rows):
        vals = np.concatenate([d.old_logp for d in row.decisions])
        old[i, : vals.size] = torch.tensor(vals)
        mask[i, : vals.size] = 1.0
    want = losses.bellman_po_loss(
        new, old.reshape(2, 3, width), torch.tensor(rewards), mask.reshape(2, 3, width)
    )
    assert want.groups_skipped == 1
    assert float(got.detach()) == pytest.approx(float(want.loss.detach()), rel=1e-6)
    assert metrics["losses/omega_mean"] == pytest.approx(float(want.omega_mean))


def test_branch_opd_loss_matches_opd_tree_loss_and_pbr():
    tree = branching_tree()
    batch = Batch([tree])
    rng = np.random.default_rng(3)
    for d in batch.decisions():
        d.teacher_logp = d.old_logp + rng.normal(0.0, 0.8, d.n_tokens).astype(np.float32)
    args = branch_opd.Args(teacher="x", delta=0.5)
    logp = current_logp(batch, seed=3)
    chunk = batch.chunk(range(len(batch.rows)), logp)
    got, metrics = branch_opd.loss(args, chunk)
    node_of = {(r, i): d for r, row in enumerate(batch.rows) for i, d in enumerate(row.decisions)}
    new, _ = flat_counted(batch, lambda r, d, t: logp[r][d][t])
    old, _ = flat_counted(batch, lambda r, d, t: torch.tensor(node_of[r, d].old_logp[t]))
    tea, _ = flat_counted(batch, lambda r, d, t: torch.tensor(node_of[r, d].teacher_logp[t]))
    want = losses.opd_tree_loss(new, old, tea, delta=0.5, eps=0.2)
    assert float(got.detach()) == pytest.approx(float(want.loss.detach()), rel=1e-6)
    assert metrics["losses/pbr"] == 0.0
    # with constraints and logits the capped PBR term is added
    vocab = 40
    cons = [losses.ProtocolConstraint(3, (7,), 1.0), losses.ProtocolConstraint(5, (9, 10), 0.0)]
    batch.rows[0].cache["pbr"] = cons
    chunk.logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    got2, metrics2 = branch_opd.loss(args, chunk, batch=batch)
    flat = [dataclasses.replace(c, position=i) for i, c in enumerate(cons)]
    aux = losses.pbr_loss(chunk.logits.unsqueeze(0), flat, lam=0.01, cap=0.02)
    assert float(got2.detach()) == pytest.approx(float((want.loss + aux.loss).detach()), rel=1e-6)
    assert metrics2["losses/pbr_constraints"] == 2


def test_react_action_end_marks_a_finished_action_line():
    assert branch_opd.react_action_end("Thought: x\nAction: go north\nmore") == len(
        "Thought: x\nAction: go north"
    )
    assert branch_opd.react_action_end("Action: go north") is None  # stopped in time
    assert branch_opd.react_action_end("no action here\n") is None
    tok = tiny_qwen2()[1]
    ids = tok("Action: go north\nAction: go", add_special_tokens=False).input_ids
    seq = pbr.ProtocolSequence.from_tokenizer(tok, ids)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    rule = pbr.FinalAnswerEOS((eos,), answer_end=branch_opd.react_action_end)
    (c,) = rule(seq)
    assert tok.decode(ids[: c.position + 1]) == "Action: go north" and c.target == 1.0


def test_sft_loss_is_the_token_nll():
    tree = branching_tree()
    batch = Batch([tree], keep=lambda t, n: n != 3)
    assert all(d.node != 3 for d in batch.decisions())
    logp = current_logp(batch, seed=4)
    got, _ = sft.loss(batch.chunk(range(len(batch.rows)), logp))
    new, _ = flat_counted(batch, lambda r, d, t: logp[r][d][t])
    assert float(got.detach()) == pytest.approx(float(losses.aggregate(-new).detach()), rel=1e-6)


# ------------------------------------------------------------------ policies


@pytest.fixture(scope="module")
def tiny_engine():
    model, tok = tiny_qwen2()
    return HFEngine(model, tok, device="cpu", max_new_tokens=8, threads=1)


def test_scoring_policy_is_a_policy_with_exact_decision_statistics(tiny_engine):
    pol = ScoringPolicy(tiny_engine)
    assert isinstance(pol, Policy)
    env = SPEC.make()
    obs, info = env.reset(seed=0)
    ctx = Context(SPEC.id, obs, info)
    cands, p = pol.distribution(ctx)
    assert list(cands.actions) == info["admissible_actions"] and p.sum() == pytest.approx(1.0)
    (samples,) = pol.act([ActRequest(ctx, n=300)], np.random.default_rng(0))
    h = -float(np.sum(p * np.log(p)))
    counts = np.zeros(len(p))
    for s in samples:
        i = list(cands.actions).index(s.action)
        counts[i] += 1
        # per-token log-probs sum to log pi(a|s); the exits differ at one token, so the
        # per-token entropies sum to the decision entropy (algorithms.md eq. 3)
        assert float(s.logprobs.sum()) == pytest.approx(math.log(p[i]), abs=1e-5)
        assert float(s.entropies.sum()) == pytest.approx(h, abs=1e-5)
        assert s.parse_error is None and s.token_ids[-1] == tiny_engine.stop_token_ids[0]
    assert np.abs(counts / 300 - p).max() < 4 * np.sqrt(0.25 / 300)
    # a forced prefix (a fork inside the turn) keeps only the candidates that start with it
    prefix = tuple(cands.token_ids[2][:-2])
    (forked,) = pol.act([ActRequest(ctx, n=5, prefix_token_ids=prefix)], np.random.default_rng(1))
    assert all(tuple(s.token_ids[: len(prefix)]) == prefix for s in forked)


def test_trie_logprobs_are_the_sequence_conditionals():
    cands = [(1, 2, 9), (1, 3, 9), (4, 9)]
    log_pi = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    lp = trie_logprobs(log_pi, cands, 1)
    torch.testing.assert_close(lp.exp(), torch.tensor([0.8, 0.3 / 0.8, 1.0]))
    assert float(lp.sum()) == pytest.approx(math.log(0.3))


@pytest.mark.parametrize("bucketed", [False, True])
@pytest.mark.parametrize("short_context", [False, True])
@pytest.mark.parametrize("kind", ["scoring", "generate"])
def test_recomputed_logprobs_equal_the_behaviour_logprobs(
    kind, short_context, bucketed, tiny_engine, monkeypatch
):
    model = tiny_engine.model
    if bucketed:
        # A small forward budget: rows are scored in several length-sorted batches.
        monkeypatch.setattr(forward, "FORWARD_TOKENS", 900)
    if short_context:
        # Prompts then drop their oldest turns: decisions no longer share one sequence,
        # and each run of them is scored in its own context.
        monkeypatch.setattr(tiny_engine, "max_positions", 260)
    pol = (
        ScoringPolicy(tiny_engine)
        if kind == "scoring"
        else LLMPolicy(tiny_engine, max_new_tokens=8)
    )
    spec = EnvRecipe(SPEC.id, {**ENV_KWARGS, "max_episode_steps": 4})
    tree = grow_tree(
        spec, pol, "entropy", m=2, k=3, seed=1, rng=1, schedule_options={"gap_unit": "steps"}
    )
    batch = Batch([tree])
    split = [len(POLICIES[kind].runs(pol, r)) > 1 for r in batch.rows]
    assert any(split) == short_context
    if bucketed:
        k = POLICIES[kind]
        lengths = [len(k.sequence(pol, sub)[0]) for r in batch.rows for sub in k.runs(pol, r)]
        buckets = forward.length_buckets(lengths, forward.FORWARD_TOKENS)
        assert len(buckets) > 1 and max(map(len, buckets)) > 1
    lps, _ = POLICIES[kind].logprobs(pol, model, batch.rows, torch.device("cpu"))
    for row, per in zip(batch.rows, lps, strict=True):
        for d, lp in zip(row.decisions, per, strict=True):
            assert lp.requires_grad
            np.testing.assert_allclose(lp.detach().numpy(), d.old_logp, atol=2e-5)
    with torch.no_grad():  # tree packing (the learners' default), runs split or not
        packed, _ = POLICIES[kind].logprobs(
            pol, model, batch.rows, torch.device("cpu"), pack_trees=True
        )
    for row, per in zip(batch.rows, packed, strict=True):
        for d, lp in zip(row.decisions, per, strict=True):
            np.testing.assert_allclose(lp.numpy(), d.old_logp, atol=2e-5)
    # gradients reach the model
    sum(lp.sum() for per in lps for lp in per).backward()
    assert model.get_input_embeddings().weight.grad is not None
    model.zero_grad(set_to_none=True)


def test_length_buckets_keep_short_rows_away_from_long_ones():
    assert training.length_buckets([]) == []
    assert training.length_buckets([5, 3, 4], budget=15) == [[0, 1, 2]]  # fits: order kept
    buckets = training.length_buckets([100, 10, 12, 90, 11], budget=40)
    assert sorted(i for b in buckets for i in b) == [0, 1, 2, 3, 4]
    assert buckets[0] == [1, 4, 2]  # the short rows together, shortest first
    assert [0] in buckets and [3] in buckets  # rows over the budget go alone
    for b in buckets:
        assert len(b) == 1 or len(b) * max([100, 10, 12, 90, 11][i] for i in b) <= 40


def test_gradient_accumulation_equals_one_pass(tmp_path):
    run = Run(
        bpo.Args(**TINY, gap_unit="steps", beta=0.05, out_dir=str(tmp_path)), "bpo", needs_ref=True
    )
    trees = [
        grow_tree(
            run.spec,
            run.policy,
            "entropy",
            m=2,
            k=3,
            seed=s,
            rng=s,
            executor=run.executor,
            schedule_options={"gap_unit": "steps"},
        )
        for s in (0, 1)
    ]
    batch = Batch(trees)
    adv = [advantages.tree_advantages(t)[0] for t in trees]
    batch.set_advantages(lambda row, d: adv[row.tree][d.node])
    run.frozen_logprobs(run.ref, batch, "ref_logp")
    run.optimizer.step = lambda: None  # keep the weights; compare the gradients
    grads = []
    for micro in (0, 2):
        run.args.micro_batch_rows = micro
        run.update(batch, range(len(batch.rows)), lambda c: bpo.loss(bpo.Args(), c))
        grads.append([p.grad.clone() for p in run.model.parameters()])
    assert len(run.chunks(batch, range(len(batch.rows)))) > 1
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    run.close()


# ------------------------------------------------------------------ checkpoints


@pytest.mark.slow
@pytest.mark.parametrize(
    "algo, extra",
    [("bpo", {"gap_unit": "steps"}), ("bellman_po", {"g": 3, "updates_per_batch": 2})],
)
def test_resume_reproduces_the_next_step_exactly(algo, extra, tmp_path):
    opts = {**TINY, **extra, "steps": 2}
    straight = train(algo, out_dir=str(tmp_path / "a"), checkpoint_every=1, **opts)
    ckpt = tmp_path / "a" / "checkpoint-000001"
    for name in ("model.safetensors", "optimizer.safetensors", "trainer_state.json"):
        assert (ckpt / name).is_file()
    assert (ckpt / "ref.safetensors").is_file() == (algo == "bpo")
    resumed = train(algo, out_dir=str(tmp_path / "b"), resume=str(ckpt))
    a = next(h for h in straight.history if h["step"] == 2)
    b = next(h for h in resumed.history if h["step"] == 2)
    for key in a:
        if key.startswith(("time/", "tokens/per_second")) or key.endswith(("_ms", "overhead")):
            continue
        assert a[key] == b[key], key
    m1, _ = load_model(straight.checkpoint)
    m2, _ = load_model(resumed.checkpoint)
    for (n, p), q in zip(m1.named_parameters(), m2.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_keep_checkpoints_deletes_older_regular_checkpoints_only(tmp_path):
    out = tmp_path / "run"
    crash = out / "checkpoint-000001-crash"  # crash checkpoints are never pruned
    crash.mkdir(parents=True)
    opts = {**TINY, "steps": 3, "checkpoint_every": 1}
    result = train("grpo", out_dir=str(out), keep_checkpoints=2, **opts)
    names = sorted(p.name for p in out.glob("checkpoint-*"))
    assert names == ["checkpoint-000001-crash", "checkpoint-000002", "checkpoint-000003"]
    assert result.checkpoint == out / "checkpoint-000003"
    every = train("grpo", out_dir=str(tmp_path / "all"), **opts)  # 0: keep every one
    assert len(list(every.checkpoint.parent.glob("checkpoint-*"))) == 3
    # learning-curve points survive the pruning: every second step's, and the newest two
    curve = train("grpo", out_dir=str(tmp_path / "curve"), keep_checkpoints=2,
                  keep_checkpoint_every=2, **{**opts, "steps": 6})  # fmt: skip
    names = sorted(p.name[-2:] for p in curve.checkpoint.parent.glob("checkpoint-*"))
    assert names == ["02", "04", "05", "06"]


def test_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not a training checkpoint"):
        train("grpo", resume=str(tmp_path))
    result = train(
        "sft",
        out_dir=str(tmp_path / "s"),
        steps=1,
        episodes=2,
        batch_episodes=2,
        **{k: v for k, v in TINY.items() if k != "prompts_per_step"},
    )
    with pytest.raises(CheckpointError, match="'sft' checkpoint; resume it with --algo sft"):
        train("grpo", resume=str(result.checkpoint), out_dir=str(tmp_path / "g"))
    state = result.checkpoint / "trainer_state.json"
    state.write_text("{broken")
    with pytest.raises(CheckpointError, match="damaged"):
        train("sft", resume=str(result.checkpoint))
    with pytest.raises(TrainingConfigError, match="already holds a run"):
        train(
            "sft",
            out_dir=str(tmp_path / "s"),
            steps=1,
            episodes=2,
            batch_episodes=2,
            threads=1,
            env_kwargs=ENV_KWARGS,
            progress=False,
        )


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "algo, options, error, match",
    [
        ("bop", {}, TrainingConfigError, "Did you mean"),
        ("bpo", {"lamda": 0.9}, TrainingConfigError, "Did you mean 'lam'"),
        ("bpo", {"k": 0}, TrainingConfigError, "k \\(siblings per branch point\\) must be >= 1"),
        ("bpo", {"lam": 2.0}, TrainingConfigError, "lam must be in \\[0, 1\\]"),
        ("bpo", {"tail": "first"}, TrainingConfigError, "tail must be one of last, zero"),
        ("bpo", {"schedule": "entropyy"}, TrainingConfigError, "Did you mean 'entropy'"),
        ("grpo", {"n": 1}, TrainingConfigError, "N >= 2"),
        ("grpo", {"lr": "fast"}, TrainingConfigError, "cannot read 'fast' as float"),
        ("rloo", {"advantage": "grpo"}, TrainingConfigError, "--algo rloo fixes advantage"),
        ("bellman_po", {"cap": 0}, TrainingConfigError, "cap C must be > 0"),
        ("branch_opd", {}, TrainingConfigError, "needs a frozen teacher"),
        ("sft", {"noise": 1.5}, TrainingConfigError, "noise must be in"),
        ("grpo", {"policy": "sample"}, TrainingConfigError, "policy must be one of"),
    ],
)
def test_bad_options_raise_typed_errors_that_say_the_fix(algo, options, error, match):
    with pytest.raises(error, match=match):
        make_args(algo, **options)


def test_bad_env_and_model_raise_typed_errors(tmp_path):
    with pytest.raises(UnknownEnvError, match="TextTreeMDP"):
        train("grpo", env_id="branchgym/TextTreeMPD-v0", out_dir=str(tmp_path / "a"))
    with pytest.raises(DataError, match="not a model folder"):
        train("grpo", model=str(tmp_path / "nowhere"), out_dir=str(tmp_path / "b"))
    with pytest.raises(TrainingConfigError, match="text actions"):
        train("grpo", env_id="branchgym/TreeMDP-v0", out_dir=str(tmp_path / "c"))
    with pytest.raises(TrainingConfigError, match="no scripted expert"):
        make_args("sft", env_id="branchgym/SWEBench-v0")
    env = SPEC.make()
    obs, info = env.reset(seed=0)
    pol = ScoringPolicy(HFEngine(*tiny_qwen2(), device="cpu"))
    with pytest.raises(TrainingConfigError, match="policy='generate'"):
        pol.candidates(Context(SPEC.id, obs, {}))


def test_every_learner_documents_every_option():
    for algo, spec in LEARNERS.items():
        cls, main = spec.load()
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in docs]
        assert not missing, f"{algo}: options without a docstring: {missing}"
        assert callable(main)
    assert "eq. (5)" in field_docs(bpo.Args)["lam"]


def test_args_from_dict_converts_cli_strings():
    args = args_from_dict(
        bpo.Args,
        {
            "lam": "0.9",
            "m": "3",
            "fill": "true",
            "min_gap": "none",
            "adam_betas": "0.9,0.98",
            "env_kwargs": '{"depth": 3}',
        },
    )
    assert (args.lam, args.m, args.fill, args.min_gap) == (0.9, 3, True, None)
    assert args.adam_betas == (0.9, 0.98) and args.env_kwargs == {"depth": 3}


# ------------------------------------------------------------------ CLI


def test_cli_train_writes_metrics_and_a_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    code = cli_main(
        [
            "train",
            "--algo",
            "grpo",
            "--env",
            "branchgym/TextTreeMDP-v0",
            "--env-kwargs",
            json.dumps(ENV_KWARGS),
            "--model",
            "tiny",
            "--steps",
            "2",
            "--prompts",
            "1",
            "--out",
            str(out),
            "--no-progress",
            "--set",
            "n=3",
            "threads=1",
            "eval_episodes=2",
        ]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 2 and "eval/exact_value" in summary["eval_end"]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if "charts/success" in x]
    assert [x["step"] for x in train_lines] == [1, 2]
    for key in (
        "charts/success",
        "charts/return",
        "advantages/mean",
        "advantages/std",
        "advantages/max_abs",
        "advantages/nondegenerate_frac",
        "losses/policy_loss",
        "losses/kl",
        "losses/clip_fraction",
        "grad/norm",
        "grad/norm_var",
        "env/steps",
        "tokens/generated",
        "groups/skipped",
        "branching/snapshot_ms",
        "charts/lr",
    ):
        assert key in train_lines[-1], key
    ckpt = out / "checkpoint-000002"
    assert {"model.safetensors", "optimizer.safetensors", "trainer_state.json"} <= {
        p.name for p in ckpt.iterdir()
    }
    assert (out / "curves.png").stat().st_size > 0


def test_cli_train_reports_bad_input(capsys):
    assert cli_main(["train", "--algo", "ppo"]) == 1
    assert "no learner is called 'ppo'" in capsys.readouterr().err
    assert cli_main(["train", "--algo", "bpo", "--set", "lam"]) == 1
    assert "KEY=VALUE" in capsys.readouterr().err
    assert cli_main(["train", "--algo", "bpo", "--env-kwargs", "{depth: 3}"]) == 1
    assert "JSON object" in capsys.readouterr().err
    assert cli_main(["train", "--algo", "bellman_po", "--options"]) == 0
    listing = capsys.readouterr().out
    assert "omega_eps (float) = 0.1" in listing and "updates_per_batch (int) = 8" in listing


def test_sft_collects_webshop_expert_episodes(tmp_path):
    pytest.importorskip("Stemmer")
    run = Run(
        sft.Args(
            env_id="branchgym/WebShop-v0",
            episodes=2,
            steps=1,
            threads=1,
            progress=False,
            policy="generate",
            noise=0.0,
            out_dir=str(tmp_path),
        ),
        "sft",
    )
    trees, metrics = sft.collect(run, run.args)
    assert len(trees) == 2 and metrics["sft/labelled_steps"] >= 4
    first = trees[0][0]
    assert (
        first.text.startswith("Action: search[")
        and first.token_ids[-1] == run.engine.stop_token_ids[0]
    )
    run.close()


def test_group_rollouts_tree_rows_are_whole_trajectories(tiny_engine):
    tree = group_rollouts(SPEC, ScoringPolicy(tiny_engine), 3, seed=0, rng=0)
    batch = Batch([tree])
    assert len(batch.rows) == 3
    assert all(len(r.decisions) == 3 for r in batch.rows)  # depth 3, nothing shared


def test_sft_collects_alfworld_planner_episodes(tmp_path):
    pytest.importorskip("alfworld")
    pytest.importorskip("fast_downward")
    run = Run(
        sft.Args(
            env_id="branchgym/ALFWorld-v0",
            episodes=1,
            steps=1,
            threads=1,
            progress=False,
            policy="scoring",
            noise=0.0,
            out_dir=str(tmp_path),
        ),
        "sft",
    )
    trees, metrics = sft.collect(run, run.args)
    (tree,) = trees
    assert metrics["sft/expert_success"] == 1.0  # the planner solves every shipped problem
    assert metrics["sft/unscorable_steps"] == 0  # its commands are admissible
    assert len(tree) >= 2 and tree[len(tree) - 1].info.get("won") is True
    batch = Batch(trees, keep=lambda t, n: n not in t.meta["unlabelled"])
    lps, _ = run.logprobs(run.model, batch.rows)
    assert all(float(lp.detach().sum()) <= 0 for per in lps for lp in per)
    run.close()


def test_bpo_with_m_0_trains_on_independent_backbones(tmp_path):
    result = train(
        "bpo", out_dir=str(tmp_path), m=0, fallback_n=3, steps=1, **{**TINY, "prompts_per_step": 1}
    )
    (line,) = [h for h in result.history if "charts/success" in h]
    assert line["charts/rollouts"] == 3 and line["branching/snapshots"] == 0
    assert line["branching/branch_points"] == 1  # the reset state: 3 independent children


def test_pbr_logits_reach_the_loss_at_the_constraint_positions(tmp_path):
    run = Run(
        branch_opd.Args(
            **TINY,
            teacher="tiny",
            policy="generate",
            max_new_tokens=6,
            max_episode_steps=2,
            out_dir=str(tmp_path),
        ),
        "branch_opd",
    )
    tree = group_rollouts(run.spec, run.policy, 2, seed=0, rng=0, executor=run.executor)
    batch = Batch([tree])
    for d in batch.decisions():
        d.teacher_logp = d.old_logp
    seq, spans = POLICIES["generate"].sequence(run.policy, batch.rows[1])
    where = spans[0][0] + 1
    batch.rows[0].cache["pbr"] = []
    batch.rows[1].cache["pbr"] = [losses.ProtocolConstraint(where, (3,), 1.0)]
    seen = {}
    run.optimizer.step = lambda: None  # compare with the same weights below

    def loss_fn(c):
        seen["logits"] = c.logits
        return branch_opd.loss(run.args, c, batch=batch)

    metrics = run.update(
        batch, [0, 1], loss_fn, logit_positions=lambda row: [c.position for c in row.cache["pbr"]]
    )
    assert metrics["losses/pbr_constraints"] == 1 and metrics["losses/pbr"] > 0
    with torch.no_grad():
        direct = run.model(torch.tensor([seq[: where + 1]])).logits[0, -1]
    torch.testing.assert_close(seen["logits"][0].detach(), direct, atol=1e-4, rtol=1e-4)
    run.close()


def test_policy_names_are_the_registered_policy_kinds():
    """options checks --policy before a model loads, against the kinds policy_kinds registers."""
    from branchgym.agents.training.options import POLICY_NAMES
    from branchgym.agents.training.policy_kinds import POLICIES

    assert tuple(POLICIES) == POLICY_NAMES
    with pytest.raises(TrainingConfigError, match="policy"):
        training.TrainArgs(policy="sampling").check()


def test_an_env_step_budget_stops_runs_of_any_shape_at_matched_env_steps(tmp_path):
    """max_env_steps ends a run at the first step whose env steps reach it, resumed or not."""
    budget = 40
    runs = {}
    for algo, extra in (("grpo", {}), ("bpo", {"gap_unit": "steps"})):
        runs[algo] = train(
            algo, out_dir=str(tmp_path / algo), steps=50, max_env_steps=budget,
            checkpoint_every=1, **{**TINY, **extra},
        )  # fmt: skip
    for algo, result in runs.items():
        lines = [h for h in result.history if "env/steps" in h]
        spent = np.cumsum([h["env/steps"] for h in lines])
        assert spent[-1] >= budget, algo
        assert len(lines) == 1 or spent[-2] < budget, algo  # no step past the budget
        assert len(lines) < 50, algo
    # resumed from its first checkpoint into another folder, a run counts the env steps
    # it had taken before: bpo's stops where the uninterrupted one did
    steps = [h["step"] for h in runs["bpo"].history if "env/steps" in h]
    assert len(steps) >= 2
    first = tmp_path / "bpo" / "checkpoint-000001"
    resumed = train("bpo", out_dir=str(tmp_path / "again"), resume=str(first))
    assert [h["step"] for h in resumed.history if "env/steps" in h] == steps[1:]
    with pytest.raises(TrainingConfigError, match="max_env_steps must be an integer >= 0"):
        train("grpo", out_dir=str(tmp_path / "bad"), max_env_steps=-1, **TINY)


def test_sft_with_a_token_budget_skips_episodes_without_a_label(tmp_path, monkeypatch):
    """An episode with no scorable expert step has no decision: no tokens, no crash.

    (WebShop's shopper searches with its own query, which the scoring policy cannot
    score; an episode cut after that step had no label and crashed the token budget.)
    """
    from branchgym.agents.policies import experts

    real = experts.EXPERTS["treemdp"]

    def sometimes_lost(env, rng):
        act = real(env, rng)
        lost = rng.random() < 0.5
        return (lambda obs, info: "go nowhere") if lost else act

    monkeypatch.setitem(experts.EXPERTS, "treemdp", sometimes_lost)
    opts = {k: v for k, v in TINY.items() if k != "prompts_per_step"}
    result = train("sft", out_dir=str(tmp_path / "s"), steps=2, episodes=8, batch_episodes=8,
                   noise=0.0, micro_batch_tokens=64, **opts)  # fmt: skip
    lines = [h for h in result.history if "sft/labelled_steps" in h]
    assert len(lines) == 2
    assert 0 < lines[0]["sft/unscorable_steps"] and lines[0]["sft/labelled_steps"] > 0
