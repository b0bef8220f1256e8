"""The source's variance diagnostic against TreeMDP's exact values, and `branchgym diagnose`."""

import numpy as np
import pytest

from branchgym.bench.variance import PAYS_BELOW, Diagnostic, diagnose
from branchgym.cli import main

KW = {"depth": 6, "n_outcomes": 2, "transition_noise": 0.3}


def test_diagnostic_matches_the_exact_ratio_on_treemdp():
    d = diagnose("branchgym/TreeMDP-v0", KW, prompts=150, seed=3)
    assert d.exact_ratio is not None and 0.3 < d.exact_ratio < 0.9
    # Theorem 2: within / independent -> sigma_t^2 / (sigma_t^2 + nu_t^2) at the midpoint.
    assert abs(d.ratio - d.exact_ratio) < 4 * d.ratio_se, (d.ratio, d.ratio_se, d.exact_ratio)
    assert d.mean_length == 6.0 and d.ratio < PAYS_BELOW
    assert "branching pays" in d.verdict


def test_trees_of_one_task_get_independent_env_noise():
    """Without env_seed, trees reset with one seed share the env's randomness."""
    from branchgym.agents.policies.policy import ScriptedPolicy
    from branchgym.rollout.grow import grow_tree

    policy = ScriptedPolicy([0] * 6)
    spec = "branchgym/TreeMDP-v0"

    def leaf(env_seed, keep="snapshot"):
        t = grow_tree(spec, policy, "even", m=1, k=2, seed=0, rng=0, env_seed=env_seed, keep=keep)
        return t[t.backbone[-1]].info["node"]

    assert len({leaf(None) for _ in range(5)}) == 1
    assert len({leaf(s) for s in range(12)}) > 1
    assert leaf(7) == leaf(7) == leaf(7, keep="replay")


def test_verdicts_read_plainly():
    base = dict(
        env_id="x",
        policy="p",
        prompts=1,
        var_independent=1.0,
        var_within=0.9,
        ratio=0.9,
        ratio_se=0.1,
        exact_ratio=None,
        mean_return=0.0,
        mean_length=1.0,
        seconds=0.0,
    )
    assert "hardly pays" in Diagnostic(**base).verdict
    base.update(ratio=float("nan"))
    assert "no verdict" in Diagnostic(**base).verdict


def test_diagnose_command(capsys):
    args = [
        "diagnose",
        "branchgym/TextTreeMDP-v0",
        "--prompts",
        "3",
        "--env-kwargs",
        '{"depth": 4, "transition_noise": 0.3}',
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "implied Var(A^BPO)/Var(A^GRPO)" in out and "(exact" in out and "=>" in out
    assert main(["diagnose", "branchgym/TextTreeMDP-v0", "--env-kwargs", "{depth"]) == 2
    assert main(["diagnose", "branchgym/TextTreeMDP-v9"]) == 1
    assert "Did you mean" in capsys.readouterr().err


def test_variance_study_quick(tmp_path, capsys):
    assert main(["bench", "variance", "--quick", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "variance.md").read_text()
    assert "TreeMDP-v0" in md and "exact" in md
    assert (tmp_path / "variance_ratio.png").stat().st_size > 1000


@pytest.mark.parametrize("bad", [(1, 4), (8, 1)])
def test_diagnose_needs_groups(bad):
    with pytest.raises(ValueError, match="at least 2"):
        diagnose("branchgym/TreeMDP-v0", KW, prompts=1, independent=bad[0], completions=bad[1])


def test_ratio_standard_error_is_finite():
    d = diagnose("branchgym/TreeMDP-v0", KW, prompts=6)
    assert np.isfinite(d.ratio_se) and d.ratio_se > 0
