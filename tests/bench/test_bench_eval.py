"""bench eval runs both ways on the same tasks and reports the speed-up it measured."""

import json

import pytest

from branchgym.cli import main


@pytest.mark.slow
def test_bench_eval_measures_both_ways(tmp_path, capsys):
    pytest.importorskip("torch")
    argv = ["bench", "eval", "--model", "tiny", "--protocol", "texttree-ci", "--tasks", "3",
            "--max-envs", "3", "--max-new-tokens", "4", "--repeats", "2",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((tmp_path / "eval.json").read_text())
    pairs = data["pairs"]
    assert [p["order"] for p in pairs] == ["plain first", "batched first"]
    for pair in pairs:
        assert pair["plain"]["env_steps"] > 0 and pair["batched"]["env_steps"] > 0
        for run in ("plain", "batched"):  # the engine's counters, per run
            assert pair[run]["prefill_tokens"] > 0 and pair[run]["cached_tokens"] > 0
        assert pair["speedup"] == pytest.approx(
            pair["plain"]["seconds"] / pair["batched"]["seconds"]
        )
    assert data["speedup"] == pytest.approx(sum(data["ratios"]) / 2)  # the median of two
    out = capsys.readouterr().out
    assert "speed-up of branchgym eval over the plain loop" in out and "median of 2 pairs" in out


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


def test_each_timed_run_starts_from_an_empty_prefix_cache():
    # what one run leaves in the engine's prefix cache would hand the next the same
    # tasks' prompts for free
    pytest.importorskip("torch")
    from branchgym.bench.eval_speed import _cold, _plain_loop
    from branchgym.evaluation.agents import make_agent
    from branchgym.evaluation.protocols import get_protocol

    protocol = get_protocol("texttree-ci").resolve(tasks=1)
    agent = make_agent("tiny", protocol.env_id, max_new_tokens=4, policy="generate")
    _plain_loop(protocol, agent, seed=0)
    engine = agent.policy.engine
    assert len(engine._cache) > 0
    stats = _cold(agent)
    assert len(engine._cache) == 0 and stats == engine.stats and stats["prefill_tokens"] > 0
