"""``branchgym bench trl`` times both trainers in one run and writes its report (the
figures are measured by the study, never asserted here)."""

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("trl")

from branchgym.bench import STUDIES  # noqa: E402
from branchgym.cli import main  # noqa: E402


@pytest.mark.slow
def test_trl_study_times_both_trainers(tmp_path, capsys):
    assert "trl" in STUDIES
    rc = main(
        [
            "bench",
            "trl",
            "--steps",
            "2",
            "--prompts",
            "1",
            "--m",
            "1",
            "--k",
            "2",
            "--max-new-tokens",
            "4",
            "--max-episode-steps",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    data = json.loads((tmp_path / "trl.json").read_text())
    assert set(data) == {"branchgym bpo", "TRL BranchingGRPOTrainer"}
    assert all(len(run["step_s"]) == 2 for run in data.values())
    assert (tmp_path / "trl_step_time.png").exists()
    assert "TRL / bpo median step time" in capsys.readouterr().out
