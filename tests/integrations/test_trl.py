"""BranchingGRPOTrainer against the real TRL: rows, masks, gradients, training runs.

The tiny random Qwen2 rarely writes an admissible action, so the trees here grow with
:class:`PickByReply`: the env's own prompt, with the reply mapped to an admissible
action by its bytes. Returns then vary between paths and advantages are not all zero;
everything TRL and branchgym compute downstream is unchanged.
"""

import functools
import importlib
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")

from branchgym.agents.estimators import advantages  # noqa: E402
from branchgym.agents.forward.rows import WEIGHTS, Batch, token_weight  # noqa: E402
from branchgym.agents.learners import bpo, grpo  # noqa: E402
from branchgym.agents.policies.models import tiny_qwen2  # noqa: E402
from branchgym.agents.policies.policy import LLMPolicy, admissible_actions  # noqa: E402
from branchgym.agents.policies.prompts import ParsedAction, TextTreePrompt, WebShopPrompt  # noqa: E402
from branchgym.agents.training.run import Run  # noqa: E402
from branchgym.error import (  # noqa: E402
    DependencyMissingError,
    IntegrationError,
    TrainingConfigError,
)
from branchgym.integrations import trl as bt  # noqa: E402
from branchgym.rollout.grow import grow_tree  # noqa: E402

ENV = "branchgym/TextTreeMDP-v0"
ENV_KWARGS = {"depth": 3, "n_actions": 3, "reward_kind": "bernoulli", "structure_seed": 2}


class PickByReply(TextTreePrompt):
    """The maze's prompt; a reply picks the admissible action its byte sum points at."""

    def parse(self, text, info=None):
        acts = admissible_actions(info or {}) or []
        if not acts:
            return super().parse(text, info)
        return ParsedAction(acts[sum(text.encode()) % len(acts)], True)


class ShopByReply(WebShopPrompt):
    """WebShop's prompt, with :class:`PickByReply`'s mapping onto its admissible actions."""

    parse = PickByReply.parse


def config(tmp_path, **kw):
    opts = {
        "output_dir": str(tmp_path / "trl"),
        "per_device_train_batch_size": 2,
        "num_generations": 2,
        "max_steps": 2,
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "bf16": False,
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
        "gradient_checkpointing": False,  # TRL's default; the tiny model needs no memory saving
        **kw,
    }
    return trl.GRPOConfig(**opts)


def trainer(
    tmp_path, model_tok=None, *, branching=None, prompt=None, env=ENV, env_kwargs=None, **kw
):
    model, tok = model_tok or tiny_qwen2()
    return bt.BranchingGRPOTrainer(
        model,
        env,
        env_kwargs=ENV_KWARGS if env_kwargs is None else env_kwargs,
        branching=branching
        or bt.BranchingArgs(m=2, k=3, schedule="even", max_new_tokens=6, max_episode_steps=3),
        args=config(tmp_path, **kw),
        processing_class=tok,
        prompt=prompt or PickByReply(),
        prompts=8,
    )


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# ------------------------------------------------------------------ the hook


def test_a_missing_trl_is_a_typed_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)
    monkeypatch.delitem(sys.modules, "branchgym.integrations.trl")
    with pytest.raises(DependencyMissingError, match=r"branchgym\[trl\]"):
        importlib.import_module("branchgym.integrations.trl")


def test_the_installed_trl_has_the_hook_and_its_output_keys(tmp_path):
    """The real parent hook, run once, still returns every key TRL's loss reads."""
    import datasets

    bt.check_hook(trl.GRPOTrainer)
    model, tok = tiny_qwen2()
    plain = trl.GRPOTrainer(
        model,
        reward_funcs=[lambda completions, **kw: [float(len(c)) for c in completions]],
        args=config(tmp_path, max_completion_length=4),
        train_dataset=datasets.Dataset.from_dict({"prompt": ["go north", "go east"]}),
        processing_class=tok,
    )
    out = plain._generate_and_score_completions([{"prompt": "go north"}, {"prompt": "go north"}])
    bt.check_hook_output(out)  # raises, naming the TRL version, if a key went away
    assert out["advantages"].shape == (2,)


def test_a_changed_hook_fails_with_the_trl_version():
    class NewSignature(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs, mode):  # a TRL that changed it
            return {}

    with pytest.raises(IntegrationError, match=f"installed trl is {trl.__version__}"):
        bt.check_hook(NewSignature)

    class NewLoss(trl.GRPOTrainer):
        def _compute_loss(self, model, inputs):  # reads no per-token advantages any more
            return inputs["loss"]

    with pytest.raises(IntegrationError, match="no longer reads"):
        bt.check_hook(NewLoss)
    with pytest.raises(
        IntegrationError, match=rf"no longer returns \['advantages'.*{trl.__version__}"
    ):
        bt.check_hook_output(
            {"prompt_ids": 0, "prompt_mask": 0, "completion_ids": 0, "completion_mask": 0}
        )


def test_bad_options_are_typed_errors(tmp_path):
    with pytest.raises(TrainingConfigError, match="no estimator called 'bp0'"):
        bt.BranchingArgs(estimator="bp0").learner_args()
    with pytest.raises(TrainingConfigError, match="credit='root' needs backbones >= 2"):
        bt.BranchingArgs(estimator="bpo-root", schedule="even").learner_args()
    with pytest.raises(TrainingConfigError, match="temperature"):
        trainer(tmp_path, temperature=0.7)
    for option, value in (("top_p", 0.9), ("top_k", 20), ("min_p", 0.1),
                          ("repetition_penalty", 1.1)):  # fmt: skip
        with pytest.raises(TrainingConfigError, match=f"'{option}': {value}.*top_p=1.0"):
            trainer(tmp_path, **{option: value})
    with pytest.raises(TrainingConfigError, match="KL reference"):
        trainer(tmp_path, beta=0.05)  # an in-memory model: no folder to load pi_ref from
    with pytest.raises(TrainingConfigError, match="integer 'seed' column"):
        bt._seed_of({"prompt": "x"})


# ------------------------------------------------------------------ rows and masks


@pytest.fixture(scope="module")
def fixed_tree():
    """One tree of the maze grown by the tiny model (M = 2, K = 3, even schedule)."""
    model, tok = tiny_qwen2()
    from branchgym.agents.engines.hf import HFEngine

    engine = HFEngine(model, tok, device="cpu", max_new_tokens=6)
    policy = LLMPolicy(engine, PickByReply(), max_new_tokens=6)
    from branchgym.rollout.executor_base import EnvRecipe

    tree = grow_tree(
        EnvRecipe(ENV, {**ENV_KWARGS, "max_episode_steps": 3}),
        policy,
        "even",
        m=2,
        k=3,
        seed=3,
        rng=np.random.default_rng(5),
    )
    returns = tree.returns()
    assert len(set(returns.tolist())) > 1, "the fixed tree should have paths with different returns"
    return tree


def test_rows_count_owned_tokens_once_and_mask_observations(tmp_path, fixed_tree):
    tr = trainer(tmp_path)
    batch, metrics = tr.score([fixed_tree], [0])
    out = tr.to_inputs(batch)
    mask = out["tool_mask"]
    # one TRL row per root-to-leaf path, every generated token counted exactly once
    assert mask.shape[0] == len(fixed_tree.leaves()) == len(batch.rows)
    owned = sum(n.n_tokens - n.prefix_len for n in fixed_tree.nodes)
    assert int(mask.sum()) == owned == token_weight(batch, list(range(len(batch.rows))))
    assert int(out["num_items_in_batch"]) == owned
    # the counted tokens are the decisions' tokens, never an observation's
    multi = 0
    for i, row in enumerate(batch.rows):
        counted = out["completion_ids"][i][mask[i] > 0].tolist()
        assert counted == [int(t) for d in row.decisions for t in d.token_ids]
        if len(row.decisions) > 1:  # the env's observation turns lie between, uncounted
            multi += 1
            assert int(mask[i].sum()) < int(out["completion_mask"][i].sum())
        adv = out["advantages"][i][mask[i] > 0].tolist()
        assert adv == pytest.approx([d.advantage for d in row.decisions for _ in d.token_ids])
    assert multi, "the backbone's row spans several decisions"
    for key in (
        "branching/tokens_saved",
        "branching/branch_points",
        "branching/degenerate_points",
        "branching/snapshot_ms",
        "branching/restore_ms",
    ):
        assert key in metrics
    assert metrics["branching/branch_points"] == 2
    assert metrics["branching/tokens_saved"] > 0


def test_rows_pad_to_the_generation_split(tmp_path, fixed_tree):
    tr = trainer(tmp_path)
    batch, _ = tr.score([fixed_tree], [0])
    out = tr.to_inputs(batch, multiple_of=4)
    assert out["prompt_ids"].shape[0] % 4 == 0
    assert int(out["tool_mask"][len(batch.rows) :].sum()) == 0


def test_zero_advantages_give_exactly_zero_gradient(tmp_path, fixed_tree):
    tr = trainer(tmp_path)
    batch, _ = tr.score([fixed_tree], [0])
    batch.set_advantages(lambda row, d: 0.0)
    tr.tree_loss(batch).backward()
    g = grads(tr.model)
    assert g and all(torch.count_nonzero(v) == 0 for v in g.values())


# ------------------------------------------------------------------ equivalence with bpo


def bpo_gradient(tmp_path, tree, args):
    """branchgym's own bpo learner's update on ``tree``: the gradient it stepped with."""
    run = Run(args, "bpo")
    try:
        adv, _, _ = advantages.tree_advantages(tree, args.lam, args.tail)
        batch = Batch([tree])
        batch.set_advantages(lambda row, d: adv[d.node])
        run.update(
            batch,
            list(range(len(batch.rows))),
            functools.partial(bpo.loss, args),
            weight=WEIGHTS[args.aggregation],
        )
        return grads(run.model)
    finally:
        run.close()


def trl_gradient(tmp_path, tree, **kw):
    tr = trainer(tmp_path, **kw)
    batch, _ = tr.score([tree], [0])
    tr.tree_loss(batch).backward()
    return grads(tr.model)


def assert_same(a, b):
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    scale = max(float(v.abs().max()) for v in a.values())
    print(f"max |grad difference| {worst:.2e} (max |grad| {scale:.2e})")
    assert scale > 1e-3, "the gradient should not vanish"
    assert worst <= 1e-5


@pytest.mark.parametrize("loss_type", sorted(bt.LOSS_AGGREGATIONS))
def test_trl_gradient_equals_the_bpo_learner(tmp_path, fixed_tree, loss_type):
    """Same tree, clip 0.2/0.28, no KL: TRL's loss through the trainer == bpo's update."""
    aggregation = bt.LOSS_AGGREGATIONS[loss_type]
    args = bpo.Args(
        model="tiny",
        policy="generate",
        env_id=ENV,
        env_kwargs=ENV_KWARGS,
        m=2,
        k=3,
        schedule="even",
        beta=0.0,
        eps=0.2,
        eps_high=0.28,
        aggregation=aggregation,
        grad_clip=0.0,
        max_new_tokens=6,
        out_dir=str(tmp_path / "bpo"),
        progress=False,
        threads=1,
    )
    ours = bpo_gradient(tmp_path, fixed_tree, args)
    theirs = trl_gradient(
        tmp_path, fixed_tree, loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, beta=0.0
    )
    assert_same(ours, theirs)


def test_rloo_topology_gradient_equals_the_rloo_learner(tmp_path):
    """grpo/rloo estimators: N independent rollouts, RLOO baseline, TRL == branchgym."""
    model, tok = tiny_qwen2()
    tr = trainer(
        tmp_path,
        branching=bt.BranchingArgs(estimator="rloo", n=4, max_new_tokens=6, max_episode_steps=3),
    )
    trees, groups = tr.grow([11])
    args = grpo.Args(
        model="tiny",
        policy="generate",
        env_id=ENV,
        env_kwargs=ENV_KWARGS,
        advantage="rloo",
        n=4,
        beta=0.0,
        aggregation="token-mean",
        grad_clip=0.0,
        max_new_tokens=6,
        out_dir=str(tmp_path / "rloo"),
        progress=False,
        threads=1,
    )
    run = Run(args, "rloo")
    try:
        adv, _, _ = advantages.per_prompt(
            args.advantage, trees, range(len(trees)), advantages.AdvantageOptions.of(args)
        )
        assert any(a != 0 for t in adv for a in t.values()), "the group should not be degenerate"
        batch = Batch(trees)
        batch.set_advantages(lambda row, d: adv[row.tree][row.leaf])
        run.update(
            batch,
            list(range(len(batch.rows))),
            functools.partial(grpo.loss, args),
            weight=WEIGHTS["token-mean"],
        )
        ours = grads(run.model)
    finally:
        run.close()
    fresh = trainer(
        tmp_path,
        (model, tok),
        loss_type="dapo",
        beta=0.0,
        branching=bt.BranchingArgs(estimator="rloo", n=4, max_new_tokens=6, max_episode_steps=3),
    )
    fresh.tree_loss(fresh.score(trees, groups)[0]).backward()
    assert_same(ours, grads(fresh.model))


# ------------------------------------------------------------------ training runs


@pytest.mark.slow
def test_trains_on_text_tree_mdp(tmp_path):
    model, tok = tiny_qwen2()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tr = trainer(tmp_path, (model, tok), max_steps=3)
    tr.train()
    logs = [h for h in tr.state.log_history if "loss" in h]
    assert len(logs) == 3
    for key in (
        "branching/tokens_saved",
        "branching/branch_points",
        "branching/degenerate_points",
        "branching/snapshot_ms",
        "branching/restore_ms",
        "charts/return",
        "advantages/mean",
    ):
        assert all(key in h for h in logs), key
    assert all(h["branching/branch_points"] == 2 for h in logs)  # one prompt, M = 2
    moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert moved, "no parameter moved in three steps"


@pytest.mark.slow
def test_trains_on_webshop(tmp_path):
    pytest.importorskip("Stemmer")
    pytest.importorskip("thefuzz")
    tr = trainer(
        tmp_path,
        env="branchgym/WebShop-v0",
        env_kwargs={"generated_products": 40, "split": "all", "max_steps": 2},
        prompt=ShopByReply(),
        branching=bt.BranchingArgs(m=1, k=2, schedule="even", max_new_tokens=6),
        max_steps=2,
    )
    tr.train()
    logs = [h for h in tr.state.log_history if "loss" in h]
    assert len(logs) == 2
    assert all(h["branching/branch_points"] == 1 and h["env/steps"] > 0 for h in logs)
    assert all(np.isfinite(h["loss"]) for h in logs)


@pytest.mark.slow
def test_the_docs_example_trains(tmp_path, monkeypatch, capsys):
    """docs/integrations.md's example script, as written, trains and prints tree metrics."""
    import pathlib
    import re

    doc = pathlib.Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
    code = re.search(r"```python\n(.*?)```", doc.read_text(), re.S).group(1)
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)  # the shared CI machine: one thread is fastest for the tiny model
    exec(compile(code, str(doc), "exec"), {"__name__": "__main__"})
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert "'branching/branch_points': 4.0" in printed  # 2 trees a step, M = 2
    assert "'branching/tokens_saved'" in printed


@pytest.mark.parametrize("estimator", ["bpo-root", "bpo-value_diff"])
def test_variant_credit_matches_the_bpo_learners(tmp_path, estimator):
    """Two backbones per prompt; advantages as the registry's credit variant gives them."""
    branching = bt.BranchingArgs(
        estimator=estimator,
        backbones=2,
        m=1,
        k=2,
        schedule="even",
        max_new_tokens=4,
        max_episode_steps=2,
    )
    tr = trainer(tmp_path, branching=branching)
    trees, groups = tr.grow([7])
    assert groups == [0, 0] and len(trees) == 2
    batch, _ = tr.score(trees, groups)
    la = tr.learner_args
    expected = advantages.advantage(advantages.CREDITS[la.credit])(
        trees, advantages.AdvantageOptions.of(la)
    ).nodes
    for row in batch.rows:
        for d in row.decisions:
            assert d.advantage == expected[row.tree][d.node]


def test_the_kl_term_reads_the_reference_model(tmp_path, fixed_tree):
    """beta > 0: the hook hands TRL the reference log-probs; at the start pi == pi_ref, so
    the KL is 0 and the gradient is the beta = 0 one."""
    from branchgym.agents.policies.models import save_tiny_qwen2

    folder = save_tiny_qwen2(tmp_path / "tiny")  # TRL loads its reference from the folder
    _, tok = tiny_qwen2()

    def gradient(beta):
        tr = bt.BranchingGRPOTrainer(
            str(folder),
            ENV,
            env_kwargs=ENV_KWARGS,
            branching=bt.BranchingArgs(m=2, k=3, schedule="even", max_new_tokens=6),
            args=config(tmp_path, beta=beta),
            processing_class=tok,
            prompt=PickByReply(),
            prompts=8,
        )
        batch, _ = tr.score([fixed_tree], [0])
        tr.tree_loss(batch).backward()
        return tr, grads(tr.model)

    with_kl, g_kl = gradient(0.05)
    assert with_kl.ref_model is not None
    assert abs(with_kl._metrics["train"]["kl"][-1]) < 1e-6
    _, g = gradient(0.0)
    assert_same(g, g_kl)


def test_an_env_factory_grows_trees(tmp_path):
    import gymnasium as gym

    def make_maze():
        return gym.make(ENV, **ENV_KWARGS, max_episode_steps=2)

    branching = bt.BranchingArgs(m=1, k=2, schedule="even", max_new_tokens=4)
    tr = trainer(tmp_path, env=make_maze, env_kwargs={}, branching=branching)
    (tree,), _ = tr.grow([5])
    assert len(tree.branch_points()) == 1 and len(tree.leaves()) == 2
    with pytest.raises(TrainingConfigError, match="takes no env_kwargs"):
        trainer(tmp_path, env=make_maze, env_kwargs={"depth": 2})
