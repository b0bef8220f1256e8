"""The main job's driver: studies run in order and the summary reads their reports."""

import json

import pytest

from branchgym.bench import demo
from branchgym.cli import main


def table_rows(markdown):
    """The cells of every markdown table row, header and separator rows included."""
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in markdown.splitlines()
        if line.strip().startswith("|")
    ]


@pytest.mark.slow
def test_demo_summarises_the_snapshot_study(tmp_path, capsys, monkeypatch):
    from branchgym.bench import snapshot

    # The summary reads the registered-env table; the scaling sections (CartPole, WebShop,
    # ALFWorld and SWE-bench backends) have their own test (test_cli's quick snapshot).
    monkeypatch.setattr(snapshot, "SECTIONS", snapshot.SECTIONS[:1])
    out = tmp_path / "demo"
    assert main(["demo", "--skip", "branching", "variance", "learning", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    summary = (out / "summary.md").read_text()
    data = json.loads((out / "snapshot.json").read_text())["registered"]
    rows = {row[1]: row for row in table_rows(summary) if row[0] == "snapshot + restore (median)"}
    assert set(rows) == {env_id.split("/")[1] for env_id in data}  # one row per measured env
    for env_id, m in data.items():
        name = env_id.split("/")[1]
        label, _, ours, source, note = rows[name]
        # the figures of this run, from the study's JSON, printed and saved
        assert ours == f"{m['snapshot']['median_ms'] + m['restore']['median_ms']:.3f} ms"
        assert note == (
            f"fork {m['fork']['median_ms']:.3f} ms, "
            f"replay {m['replay']['median_ms']:.2f} ms at depth {m['depth']}"
        )
        assert f"| {label} | {name} | {ours} |" in text
        # the source's figure sits in the row of the env it was measured on, or nowhere
        published = demo.SOURCE["snapshot_ms"].get(name)
        assert source == (f"{published:.0f} ms" if published else "")
    assert rows["TreeMDP-v0"][3] == ""  # no published figure for the toy env
    assert rows["WebShop-v0"][3] != rows["SWEBench-v0"][3]
    assert "branching overhead" not in summary  # skipped studies add no rows
    assert (out / "snapshot_envs.png").stat().st_size > 1000


def test_demo_rejects_an_unknown_study(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--skip", "nonsense"])
