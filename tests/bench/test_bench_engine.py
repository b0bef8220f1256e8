"""The engine and branching studies run end to end and write their reports (figures are
measured by the studies themselves, never asserted here)."""

import json

import pytest

pytest.importorskip("torch")

from branchgym.bench import STUDIES  # noqa: E402
from branchgym.cli import main  # noqa: E402


def test_studies_are_registered():
    assert {"engine", "branching"} <= set(STUDIES)


def test_engine_study_runs(tmp_path, capsys):
    rc = main(
        [
            "bench",
            "engine",
            "--model",
            "tiny",
            "--prefix",
            "64",
            "--new-tokens",
            "4",
            "--repeats",
            "1",
            "--vllm",
            "off",
            "--sections",
            "prefix",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    data = json.loads((tmp_path / "engine.json").read_text())
    row = data["hf"]["by_prefix"]["64"]
    assert {"recompute", "reuse", "cached", "speedup_reuse"} <= set(row)
    assert (tmp_path / "engine_prefix.png").exists()
    assert "reuse speed-up" in capsys.readouterr().out


def test_engine_study_measures_batched_rollouts(tmp_path, capsys):
    rc = main(
        [
            "bench",
            "engine",
            "--sections",
            "rollouts",
            "--rollout-prompts",
            "2",
            "--rollout-new-tokens",
            "3",
            "--rollout-steps",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    data = json.loads((tmp_path / "engine.json").read_text())["rollouts"]
    assert data["same_trees"] is True  # batched and serial grew the same trees
    assert data["batched"]["generated_tokens"] == data["serial"]["generated_tokens"] > 0
    assert data["batched"]["env_steps"] == data["serial"]["env_steps"] > 0
    assert data["requests_batched"] > data["policy_calls_batched"]
    assert "hf" not in json.loads((tmp_path / "engine.json").read_text())
    assert "faster than serial" in capsys.readouterr().out


@pytest.mark.slow
def test_branching_study_runs(tmp_path, capsys):
    rc = main(
        [
            "bench",
            "branching",
            "--quick",
            "--trees",
            "1",
            "--max-new-tokens",
            "4",
            "--out",
            str(tmp_path),
            # ALFWorld's branching costs 90 s here and adds no path the others lack; its
            # restored-vs-replayed play is tested in tests/envs/alfworld.
            "--envs",
            "branchgym/TextTreeMDP-v0",
            "branchgym/WebShop-v0",
            "branchgym/SWEBench-v0",
        ]
    )
    assert rc == 0
    data = json.loads((tmp_path / "branching.json").read_text())
    for env_id in ("branchgym/TextTreeMDP-v0", "branchgym/WebShop-v0"):
        bpo = data[f"{env_id}|bpo|snapshot"]
        group = data[f"{env_id}|group|-"]
        assert bpo["rollouts"] == group["rollouts"] == 7
        assert group["tokens_saved"] == 0.0
        assert bpo["independent_tokens"] > bpo["generated_tokens"]
        replay = data[f"{env_id}|bpo|replay"]
        assert replay["replay_steps"] > 0
        # The same seeds grow the same tree whichever way states are kept.
        assert replay["generated_tokens"] == bpo["generated_tokens"]
    swe = data["branchgym/SWEBench-v0|group|-"]
    assert swe["rollouts"] == 7 and swe["tokens_saved"] == 0.0
    assert data["branchgym/SWEBench-v0|bpo|snapshot"]["snapshots_taken"] > 0
    snap = data["state_keeping|branchgym/TextTreeMDP-v0|snapshot"]
    replay = data["state_keeping|branchgym/TextTreeMDP-v0|replay"]
    assert replay["snapshots_taken"] < snap["snapshots_taken"] and replay["replay_steps"] > 0
    assert (tmp_path / "branching_overview.png").exists()
    assert "tokens saved" in capsys.readouterr().out


def test_engine_study_measures_its_overhead_against_model_generate(tmp_path, capsys):
    rc = main(
        [
            "bench",
            "engine",
            "--model",
            "tiny",
            "--sections",
            "overhead",
            "--quick",
            "--new-tokens",
            "3",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    data = json.loads((tmp_path / "engine.json").read_text())["overhead"]
    methods = {"model.generate", "engine, batched (prefix reuse)", "engine, reuse off"}
    assert set(data["timings"]) == set(data["one_token"]) == methods
    assert set(data["decode_ms_per_step"]) == methods
    assert len(data["prompt_tokens"]) == 2 and data["samples"] == 2 and data["new_tokens"] == 3
    assert all(t["median_ms"] > 0 for t in data["timings"].values())
    assert "time / model.generate" in capsys.readouterr().out
