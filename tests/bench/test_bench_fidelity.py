"""bench fidelity and bench erosion: eq. (4), its exact bias under faults, the reports."""

import numpy as np
import pytest

from branchgym.bench.erosion import exact_expected_error, run_rate, sibling_advantages
from branchgym.cli import main
from branchgym.envs.toy import TreeMDP


def test_sibling_advantages_is_eq_4():
    g = np.array([[1.0, 0.0, 0.5, 0.5], [2.0, 2.0, 2.0, 2.0]])
    a = sibling_advantages(g)
    assert a[0, 0] == pytest.approx(1.0 - (0.0 + 0.5 + 0.5) / 3)
    assert np.allclose(a[1], 0.0) and np.allclose(a.sum(axis=1), 0.0)
    with pytest.raises(ValueError):
        sibling_advantages(np.array([[1.0]]))


def test_exact_bias_is_zero_without_fault_and_for_the_rng_control():
    tree = TreeMDP(depth=3).tree
    pi = np.random.default_rng(0).dirichlet(np.ones(3), size=tree.n_nodes)
    for p, kind in [(0.0, "slip"), (0.2, "rng")]:
        bb, rest = exact_expected_error(tree, pi, p, 4, kind)
        assert np.all(bb == 0) and np.all(rest == 0)
    bb, rest = exact_expected_error(tree, pi, 0.2, 4, "slip")
    inner = tree.depth < tree.max_depth
    assert np.abs(rest[inner]).max() > 0.01


def test_measured_error_matches_the_closed_form():
    clean = run_rate(p=0.0, kind="slip", prompts=500, K=4, depth=4, seed=0)
    lo, ci = clean["siblings"]
    assert abs(lo) < 1.5 * ci  # eq. 4 is unbiased without a fault
    faulty = run_rate(p=0.2, kind="slip", prompts=500, K=4, depth=4, seed=0)
    assert faulty["relative_rms_bias"] > 0.2 and faulty["exact_slope"] < 0.85
    assert abs(faulty["slope"] - faulty["exact_slope"]) < 0.12
    mean, ci = faulty["backbone"]
    assert abs(mean - faulty["exact_backbone"]) < 2 * ci
    control = run_rate(p=0.2, kind="rng", prompts=300, K=4, depth=4, seed=0)
    assert control["faulty_restores"] > 0 and control["relative_rms_bias"] == 0.0


@pytest.mark.slow
def test_bench_erosion_quick(tmp_path, capsys):
    assert main(["bench", "erosion", "--quick", "--out", str(tmp_path), "--prompts", "200"]) == 0
    md = (tmp_path / "erosion.md").read_text()
    assert md.count("| slip |") == 4 and md.count("| rng |") == 4
    assert (tmp_path / "erosion_bias.png").stat().st_size > 1000


@pytest.mark.slow
def test_bench_fidelity_quick(tmp_path, capsys):
    # The toy envs and WebShop: the study's logic, not a measurement of every sandbox.
    envs = ["branchgym/TreeMDP-v0", "branchgym/TextTreeMDP-v0", "branchgym/WebShop-v0"]
    args = ["bench", "fidelity", "--quick", "--no-suite", "--out", str(tmp_path), "--envs", *envs]
    assert main([*args, "--blocks", "2", "--episodes", "4"]) == 0
    out = capsys.readouterr().out
    assert "digest mode adds" in out and "target < 10 %" in out
    md = (tmp_path / "fidelity.md").read_text()
    assert "| branchgym/TreeMDP-v0 | digest 1/10 |" in md
    assert (tmp_path / "fidelity_overhead.png").stat().st_size > 1000
