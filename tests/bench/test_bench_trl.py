"""``branchgym bench trl`` times branchgym's learners and TRL's trainers in one run and
writes its report (the figures are measured by the study, never asserted here)."""

import json

import pytest

pytest.importorskip("torch")

from branchgym.bench import STUDIES  # noqa: E402
from branchgym.bench.trl_trainer import unique_tokens  # noqa: E402
from branchgym.cli import main  # noqa: E402

TRAINERS = {
    "single turn": {"branchgym grpo", "TRL GRPOTrainer"},
    "multi turn": {
        "branchgym grpo",
        "branchgym bpo",
        "branchgym bpo depths",
        "TRL BranchingGRPOTrainer",
    },
}


def test_unique_tokens_count_each_shared_prefix_once_per_group():
    # two rows sharing 3 tokens: 3 + 2 + 1; a group does not share with another
    assert unique_tokens([[[1, 2, 3, 4, 5], [1, 2, 3, 9]]]) == 6
    assert unique_tokens([[[1, 2]], [[1, 2]]]) == 4
    assert unique_tokens([[[7, 7], [7, 7]]]) == 2


@pytest.mark.slow
def test_trl_study_times_every_trainer_with_its_split_and_tokens(tmp_path, capsys):
    pytest.importorskip("trl")
    assert "trl" in STUDIES
    rc = main(["bench", "trl", "--quick", "--m", "1", "--k", "2", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "trl.json").read_text())
    assert {w: set(runs) for w, runs in data.items()} == TRAINERS
    for runs in data.values():
        for name, run in runs.items():
            assert len(run["step_s"]) == 2, name
            for phase in ("generation", "reference", "update"):
                assert all(0 < t < s for t, s in zip(run[phase], run["step_s"], strict=True)), (
                    name,
                    phase,
                )
            # a forward reads at least the unique tokens, and they hold what was generated
            for gen, learner, unique in zip(
                run["generated"], run["learner"], run["unique"], strict=True
            ):
                assert gen <= unique <= learner, name
        # branchgym packs each group's shared prompt: it reads the unique tokens only
        for name in runs:
            if name.startswith("branchgym"):
                assert runs[name]["learner"] == runs[name]["unique"], name
    # TRL reads the prompt once per completion: more than the unique tokens
    trl = data["single turn"]["TRL GRPOTrainer"]
    assert all(lr > u for lr, u in zip(trl["learner"], trl["unique"], strict=True))
    assert (tmp_path / "trl_step_time.png").exists()
    out = capsys.readouterr().out
    assert "single turn: branchgym grpo / TRL GRPOTrainer step time" in out
    assert "multi turn: branchgym bpo / TRL BranchingGRPOTrainer step time" in out
    assert "multi turn: branchgym bpo depths / branchgym grpo step time" in out


def test_trl_study_says_when_trl_is_missing(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a)
    )
    args = ["bench", "trl", "--quick", "--m", "1", "--k", "2", "--workloads", "single turn"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    assert "TRL is not installed" in capsys.readouterr().out
    data = json.loads((tmp_path / "trl.json").read_text())
    assert set(data["single turn"]) == {"branchgym grpo"}
    assert "TRL is not installed" in (tmp_path / "trl.md").read_text()
