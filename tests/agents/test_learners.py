"""Each learner on TextTreeMDP with the tiny model: every parameter moves, success improves.

CI settings (docs/algorithms.md's defaults are in each learner's Args; these override them so a
run fits in seconds on a 2-core CPU): the maze has depth 3, 3 exits, Bernoulli rewards
(success = reward 1) and structure seed 2 (uniform policy 0.43, optimal 0.92); the tiny
random Qwen2 acts through the scoring policy (softmax over the admissible replies); 4
prompts per step, 10 steps, lr 1e-4 (the source's 2e-6 moves a tiny model too slowly),
weight decay 0 (so a parameter that got no gradient cannot change), branch points at
least one step apart (the source's 64 tokens would allow one fork in a 3-step maze).

Success is measured exactly: in a tree MDP the dialogue is a function of the state, so
the policy is a table and its success probability V(s_0) follows by backward induction
(``branchgym.agents.training.evaluation.exact_value``). The comparison with the start is free of
evaluation noise.
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from branchgym.agents.engines.hf import HFEngine  # noqa: E402
from branchgym.agents.policies.models import load_model, tiny_qwen2  # noqa: E402
from branchgym.agents.policies.scoring import ScoringPolicy  # noqa: E402
from branchgym.agents.train import train  # noqa: E402
from branchgym.agents.training.evaluation import exact_value  # noqa: E402
from branchgym.rollout.executor_base import EnvRecipe  # noqa: E402

ENV_KWARGS = {"depth": 3, "n_actions": 3, "reward_kind": "bernoulli", "structure_seed": 2}
SPEC = EnvRecipe("branchgym/TextTreeMDP-v0", ENV_KWARGS)
CI = {
    "env_kwargs": ENV_KWARGS,
    "model": "tiny",
    "policy": "scoring",
    "prompts_per_step": 4,
    "steps": 10,
    "lr": 1e-4,
    "weight_decay": 0.0,
    "threads": 1,
    "progress": False,
}
#: the smallest improvement of exact success we accept (runs gain 0.2-0.3 here)
MIN_GAIN = 0.1


def exact_success(model, tok):
    engine = HFEngine(model, tok, device="cpu", threads=1)
    return exact_value(SPEC, ScoringPolicy(engine)).value


@pytest.fixture(scope="module")
def start():
    model, tok = tiny_qwen2()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return params, exact_success(model, tok)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """The OPD teacher: the tiny model fine-tuned on the maze's optimal policy."""
    out = tmp_path_factory.mktemp("teacher")
    opts = {**CI, "lr": 3e-4, "steps": 60, "episodes": 64, "batch_episodes": 8, "noise": 0.3}
    result = train("sft", out_dir=str(out), **opts)
    return result


def check_learned(result, start):
    params, before = start
    model, tok = load_model(result.checkpoint)
    unchanged = [
        name for name, p in model.named_parameters() if torch.equal(p.detach(), params[name])
    ]
    assert not unchanged, f"parameters that never moved: {unchanged}"
    after = exact_success(model, tok)
    print(f"exact success {before:.3f} -> {after:.3f}")
    assert after > before + MIN_GAIN, f"exact success {before:.3f} -> {after:.3f}"
    return after


@pytest.mark.slow
def test_sft_warm_start_learns_the_expert(teacher, start):
    after = check_learned(teacher, start)
    assert after > 0.8  # the optimal policy reaches 0.92
    assert teacher.history[-1]["sft/expert_success"] > 0.5


@pytest.mark.slow
@pytest.mark.parametrize(
    "algo, extra",
    [
        ("bpo", {"gap_unit": "steps"}),
        ("grpo", {}),
        ("rloo", {}),
        ("bellman_po", {"updates_per_batch": 4, "g": 7}),
    ],
)
def test_rl_learner_improves_success(algo, extra, start, tmp_path):
    result = train(algo, out_dir=str(tmp_path), **{**CI, **extra})
    check_learned(result, start)
    steps = [h for h in result.history if "charts/success" in h]
    assert len(steps) == CI["steps"]
    for key in ("losses/policy_loss", "grad/norm", "grad/norm_var", "advantages/max_abs"):
        assert all(key in h for h in steps), key
    if algo == "bpo":  # M = 2 branch points of K = 4 siblings per prompt: N = 7 rollouts
        assert all(h["charts/rollouts"] == 7 * CI["prompts_per_step"] for h in steps)
        assert all(h["branching/snapshots"] > 0 for h in steps)
    if algo == "bellman_po":  # after the first of several updates, pi has left mu
        assert any(abs(h["losses/omega_mean"] - 1.0) > 1e-4 for h in steps)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["branch_opd", "opd", "opd_multi"])
def test_distillation_improves_success(algo, teacher, start, tmp_path):
    result = train(algo, out_dir=str(tmp_path), teacher=str(teacher.checkpoint), **CI)
    check_learned(result, start)
    steps = [h for h in result.history if "charts/success" in h]
    first = steps[0]
    assert first["opd/teacher_minus_student"] < 0  # the student starts far from the teacher
    if algo == "branch_opd":
        assert sum(h["opd/forks"] for h in steps) > 0
        # forks share their prefix: fewer generated than independent tokens
        assert first["tokens/generated"] < first["tokens/independent"]
    if algo == "opd":
        assert all(h["charts/rollouts"] == CI["prompts_per_step"] for h in steps)
    if algo == "opd_multi":
        assert all(h["charts/rollouts"] == 7 * CI["prompts_per_step"] for h in steps)


@pytest.mark.slow
def test_free_generation_sft_then_rl(tmp_path):
    """With free generation the random model writes no valid action; SFT fixes that, and RL
    on the generated replies then updates every parameter."""
    gen = {**CI, "policy": "generate", "max_new_tokens": 12, "max_episode_steps": 5}
    warm = train(
        "sft",
        out_dir=str(tmp_path / "sft"),
        **{**gen, "lr": 1e-3, "steps": 40, "episodes": 64, "batch_episodes": 8, "noise": 0.3},
        eval_episodes=16,
    )
    assert warm.eval_start.invalid_frac > 0.9 and warm.eval_start.success == 0.0
    assert warm.eval_end.invalid_frac < 0.2 and warm.eval_end.success > 0.4
    model, _ = load_model(warm.checkpoint)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    rl = train(
        "grpo", out_dir=str(tmp_path / "grpo"), **{**gen, "model": str(warm.checkpoint), "steps": 3}
    )
    after, _ = load_model(rl.checkpoint)
    moved = [not torch.equal(p.detach(), before[k]) for k, p in after.named_parameters()]
    assert all(moved)
    steps = [h for h in rl.history if "charts/success" in h]
    assert all(h["charts/invalid_frac"] < 0.5 for h in steps)


# ------------------------------------------------------------------ failed rollouts


def _leaf(tree, parent, reward, error=None):
    return tree.add(parent, action="a", text="a", reward=reward, terminated=True, error=error).id


def test_group_learners_leave_failed_rollouts_out_of_the_group():
    import numpy as np

    from branchgym.agents.estimators import advantages
    from branchgym.agents.forward.rows import Batch
    from branchgym.agents.training.metrics import rollout_metrics
    from branchgym.rollout.tree import RolloutTree

    t = RolloutTree("hand", 0, "start", {})
    for r, err in ((1.0, None), (0.0, None), (0.0, "sandbox crashed"), (1.0, None)):
        _leaf(t, -1, r, err)
    assert t.valid_paths().tolist() == [True, True, False, True]
    options = advantages.AdvantageOptions()
    adv = advantages.advantage("rloo")([t], options).nodes[0]
    # leave-one-out over the three valid rollouts only: 1 - (0 + 1)/2, 0 - (1 + 1)/2
    assert np.allclose([adv[leaf] for leaf in t.leaves()], [0.5, -1.0, 0.0, 0.5])
    adv = advantages.advantage("grpo")([t], options).nodes[0]
    leaf_adv = [adv[leaf] for leaf in t.leaves()]
    assert leaf_adv[2] == 0 and np.isclose(sum(leaf_adv), 0.0)
    assert rollout_metrics(Batch([t]))["groups/invalid_rollouts"] == 1.0


def test_bpo_leaves_failed_siblings_out_of_eq4():
    from branchgym.agents.estimators import advantages
    from branchgym.rollout.tree import RolloutTree

    t = RolloutTree("hand", 0, "start", {})
    n0 = t.add(-1, action="a", text="a").id
    rewards = (1.0, 0.0, 1.0, 0.0)  # siblings k = 1..4 under n0
    errors = (None, None, "timeout: step took > 1 s", None)
    leaves = [_leaf(t, n0, r, e) for r, e in zip(rewards, errors, strict=True)]
    adv, n_bp, _ = advantages.tree_advantages(t, lam=1.0)
    assert n_bp == 1
    # eq. 4 over the three valid siblings: each minus the mean of the other two
    assert [adv[n] for n in leaves] == [1.0, -0.5, 0.0, -0.5]
    # the failed sibling neither gets a signal nor moves the others' baseline
    t2 = RolloutTree("hand", 0, "start", {})
    m0 = t2.add(-1, action="a", text="a").id
    ok = [_leaf(t2, m0, r) for r, e in zip(rewards, errors, strict=True) if e is None]
    adv2, _, _ = advantages.tree_advantages(t2, lam=1.0)
    valid_adv = [adv[n] for n, e in zip(leaves, errors, strict=True) if e is None]
    assert [adv2[n] for n in ok] == valid_adv
