"""bench eval runs both ways on the same tasks and reports the speed-up it measured."""

import json

import pytest

from branchgym.cli import main


@pytest.mark.slow
def test_bench_eval_measures_both_ways(tmp_path, capsys):
    pytest.importorskip("torch")
    argv = ["bench", "eval", "--model", "tiny", "--protocol", "texttree-ci", "--tasks", "3",
            "--max-envs", "3", "--max-new-tokens", "4", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((tmp_path / "eval.json").read_text())
    assert data["plain"]["env_steps"] > 0 and data["batched"]["env_steps"] > 0
    for run in ("plain", "batched"):  # the engine's counters, per run
        assert data[run]["prefill_tokens"] > 0 and data[run]["cached_tokens"] > 0
    assert data["speedup"] == pytest.approx(
        data["plain"]["seconds"] / data["batched"]["seconds"]
    )
    assert "speed-up of branchgym eval over the plain loop" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_eval_states_reports_both_widths(tmp_path, capsys):
    argv = ["bench", "eval-states", "--envs", "webshop", "--tasks", "6", "--forks", "2",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((tmp_path / "eval_states.json").read_text())
    web = data["webshop"]
    assert web["from_states"]["states"] == 12 and web["independent"]["env_steps"] > 0
    assert web["se_ratio_equal_steps"] > 0
    assert "SE ratio from-states / independent" in capsys.readouterr().out
