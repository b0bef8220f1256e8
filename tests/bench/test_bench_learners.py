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
