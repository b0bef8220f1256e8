"""The main job's driver: studies run in order and the summary reads their reports."""

import json

import pytest

from branchgym.cli import main


@pytest.mark.slow
def test_demo_summarises_the_snapshot_study(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--skip", "branching", "variance", "learning", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    summary = (out / "summary.md").read_text()
    data = json.loads((out / "snapshot.json").read_text())["registered"]
    for env_id in ("branchgym/TreeMDP-v0", "branchgym/WebShop-v0", "branchgym/SWEBench-v0"):
        m = data[env_id]
        both = m["snapshot"]["median_ms"] + m["restore"]["median_ms"]
        row = f"| snapshot + restore (median) | {env_id.split('/')[1]} | {both:.3f} ms |"
        assert row in summary and row in text  # the figure of this run, printed and saved
    assert "| 42 ms |" in summary and "| 1920 ms |" in summary  # the source beside it
    assert "branching overhead" not in summary  # skipped studies add no rows
    assert (out / "snapshot_envs.png").stat().st_size > 1000


def test_demo_rejects_an_unknown_study(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--skip", "nonsense"])
