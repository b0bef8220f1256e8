"""``branchgym bench learners --quick`` runs and writes its report."""

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from branchgym.cli import main  # noqa: E402


@pytest.mark.slow
def test_bench_learners_quick(tmp_path, capsys):
    assert (
        main(["bench", "learners", "--quick", "--algos", "bpo", "grpo", "--out", str(tmp_path)])
        == 0
    )
    out = capsys.readouterr().out
    assert "| bpo |" in out and "grad-norm variance BPO/GRPO" in out
    data = json.loads((tmp_path / "learners.json").read_text())
    for algo in ("bpo", "grpo"):
        (run,) = data["runs"][algo]
        assert [s for s, _ in run["curve"]] == [0, 2, 4]
        assert 0.0 <= run["end"] <= 1.0 and run["rollouts"] == 7 * 4
    assert (tmp_path / "learners_success.png").stat().st_size > 0


def test_the_variant_runs_are_valid_learner_options_and_the_long_maze_evaluates_exactly():
    import gymnasium as gym

    from branchgym.agents.train import make_args
    from branchgym.bench.all_learners import MAZES, VARIANTS, variant_options

    for maze in MAZES.values():
        for label in VARIANTS:
            algo, options = variant_options(label, maze)
            args = make_args(algo, env_id="branchgym/TextTreeMDP-v0", env_kwargs=maze, **options)
            args.check()  # raises TrainingConfigError on an unknown or out-of-range option
            assert label.startswith(algo)
            if options.get("schedule") == "depths":  # the horizon's last decision
                assert tuple(args.branch_depths) == (maze["depth"] - 1,)
    tree = gym.make("branchgym/TextTreeMDP-v0", **MAZES["long_noisy"]).unwrapped.tree
    inner = int((tree.depth < tree.depth.max()).sum())
    assert tree.depth.max() == 6 and inner <= 5_000  # exact_value's limit: curves stay exact
