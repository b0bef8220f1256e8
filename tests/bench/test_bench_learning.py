"""The learning, distill and bellman studies run end to end at the smallest scale."""

import json

import numpy as np
import pytest

from branchgym.bench.distill import exact_reverse_kl
from branchgym.bench.runs import mean_se, window_variance
from branchgym.cli import main


@pytest.mark.slow
def test_learning_study(tmp_path, capsys):
    assert (
        main(
            ["bench", "learning", "--quick", "--seeds", "2", "--steps", "2", "--out", str(tmp_path)]
        )
        == 0
    )
    md = (tmp_path / "learning.md").read_text()
    assert "| bpo spec (M=2, K=4, N=7) |" in md and "| grpo (N=7) |" in md
    assert "| bpo recommended (depths, value_diff, G=5, N=20) |" in md and "| rloo (N=7) |" in md
    assert "gradient-norm variance BPO/GRPO" in md and "Against the source" in md
    data = json.loads((tmp_path / "learning.json").read_text())
    row = data["summary"]["final success: BPO recommended / BPO spec / GRPO"]
    assert len(row["ours"].split(" / ")) == 3 and "recommended = depths" in row["note"]
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in md.splitlines()}
    assert rows["bpo recommended (depths, value_diff, G=5, N=20)"][5] == "20.0"  # rollouts/prompt
    assert rows["bpo spec (M=2, K=4, N=7)"][5] == "7.0"
    assert (tmp_path / "learning_main.png").stat().st_size > 1000


@pytest.mark.slow
def test_learning_study_webshop_phase(tmp_path, capsys):
    """The WebShop phase end to end: SFT, every learner from its checkpoint, report and plot."""
    pytest.importorskip("branchgym.envs.webshop")
    args = ["bench", "learning", "--seeds", "1", "--steps", "1", "--prompts", "1"]
    args += ["--no-ablations", "--maze", "ci", "--webshop-seeds", "1", "--webshop-steps", "1"]
    args += ["--webshop-eval", "2", "--webshop-sft-steps", "1", "--webshop-max-steps", "4"]
    args += ["--out", str(tmp_path)]
    assert main(args) == 0
    md = (tmp_path / "learning.md").read_text()
    assert "'depth': 3" in md  # --maze ci
    assert "## WebShop, tiny model after SFT" in md and "episodes cut at 4 steps" in md
    assert "success gain over SFT (points)" in md
    data = json.loads((tmp_path / "learning.json").read_text())
    for label in ("bpo", "grpo", "rloo"):
        (run,) = data["runs"][f"webshop|{label}"]
        steps = [s for s, _ in run["curve"]]
        assert steps == [0, 1]  # evaluated at the SFT checkpoint and after the update
        assert all(0.0 <= v <= 1.0 for _, v in run["curve"])
    assert "WebShop gain over SFT, BPO vs GRPO" in data["summary"]
    assert (tmp_path / "learning_webshop.png").stat().st_size > 1000


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [("--webshop-max-steps", "0", "0 must be at least 1"), ("--seeds", "two", "not an integer")],
)
def test_learning_study_refuses_bad_counts_before_any_run(option, value, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "learning", option, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert option in err and message in err


@pytest.mark.slow
def test_distill_study(tmp_path, capsys):
    assert (
        main(
            ["bench", "distill", "--quick", "--seeds", "1", "--steps", "2", "--out", str(tmp_path)]
        )
        == 0
    )
    md = (tmp_path / "distill.md").read_text()
    assert "branch_opd (B=3, k=2)" in md and "opd_multi (n=7)" in md and "tokens saved" in md
    kl = json.loads((tmp_path / "distill.json").read_text())["exact_reverse_kl"]
    assert all(v[0] >= 0 for v in kl.values())


@pytest.mark.slow
def test_bellman_study(tmp_path, capsys):
    assert (
        main(
            [
                "bench",
                "bellman",
                "--quick",
                "--seeds",
                "1",
                "--steps",
                "2",
                "--prompts",
                "2",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    md = (tmp_path / "bellman.md").read_text()
    assert "| bellman_po |" in md and "mean |omega - 1|" in md
    header = next(line for line in md.splitlines() if line.startswith("| learner |"))
    rows = [line for line in md.splitlines() if line.startswith("| bellman_po |")]
    # Every row has the header's cell count: no stray '|' inside a cell breaks the table.
    assert "mean abs(omega - 1)" in header
    assert all(r.count("|") == header.count("|") for r in rows)


def test_exact_reverse_kl_is_zero_for_equal_policies_and_positive_otherwise():
    import gymnasium as gym

    kw = {"depth": 3, "n_actions": 3}
    n = gym.make("branchgym/TextTreeMDP-v0", **kw).unwrapped.tree.n_nodes
    rng = np.random.default_rng(0)
    a = rng.dirichlet(np.ones(3), size=n)
    b = rng.dirichlet(np.ones(3), size=n)
    assert exact_reverse_kl(kw, a, a) == pytest.approx(0.0, abs=1e-12)
    assert exact_reverse_kl(kw, a, b) > 0
    # one decision per depth: the sum of per-state KLs along an episode
    uniform = np.full((n, 3), 1 / 3)
    one_hot = np.tile([0.998, 0.001, 0.001], (n, 1))
    per_state = float(np.sum(one_hot[0] * np.log(one_hot[0] * 3)))
    assert exact_reverse_kl(kw, one_hot, uniform) == pytest.approx(3 * per_state, rel=1e-9)


def test_window_variance_and_mean_se():
    norms = [1.0, 1.0, 2.0, 4.0, 3.0, 3.0]
    assert window_variance(norms, 3) == [0.0, 2.0, 0.0]
    free = window_variance([1.0, 3.0], 1, scale_free=True)
    assert free[0] == pytest.approx(2.0 / 4.0)
    m, se = mean_se([1.0, 3.0])
    assert (m, se) == (2.0, 1.0)
    assert np.isnan(window_variance([1.0], 1)[0])
