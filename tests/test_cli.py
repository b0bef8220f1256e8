import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from branchgym.cli import main, play
from tests.fidelity.test_checks import AliasingTree  # noqa: F401  (importable target for module:attr)


def test_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "branchgym/TreeMDP-v0" in out and "| state |" in out


def test_check_ok_and_failures(capsys):
    assert main(["check", "branchgym/TreeMDP-v0"]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["check", "tests.fidelity.test_checks:AliasingTree"]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert main(["check", "branchgym/TreeMDP-v7"]) == 1
    assert "Did you mean" in capsys.readouterr().err
    assert main(["check", "no_such_module_q:Env"]) == 1


def test_installed_command_runs():
    out = subprocess.run(
        [sys.executable, "-m", "branchgym.cli", "check", "branchgym/TreeMDP-v0"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    exe = subprocess.run(
        [str(Path(sys.executable).parent / "branchgym"), "list"], capture_output=True, text=True
    )
    assert exe.returncode == 0 and "TextTreeMDP" in exe.stdout


def test_play_forks_by_hand():
    script = (
        "go north\n:snap\ngo east\n:history\n:restore 0\n:actions\nfly\n:restore 7\n:bogus\n:quit\n"
    )
    out = io.StringIO()
    assert play("branchgym/TextTreeMDP-v0", stdin=io.StringIO(script), stdout=out) == 0
    text = out.getvalue()
    assert "snapshot 0 at step 1" in text
    assert "actions: go north -> go east" in text
    assert "restored snapshot 0 (step 1)" in text
    assert "Invalid action: 'fly'" in text
    assert "usage: :restore N" in text and "unknown command" in text


def test_play_discrete_env_parses_integers():
    out = io.StringIO()
    play("branchgym/TreeMDP-v0", stdin=io.StringIO("1\nx\n0\n:quit\n"), stdout=out)
    assert "integer actions" in out.getvalue()


@pytest.mark.slow
def test_bench_snapshot_quick(tmp_path, capsys):
    assert main(["bench", "snapshot", "--quick", "--out", str(tmp_path), "--repeats", "3"]) == 0
    md = (tmp_path / "snapshot.md").read_text()
    assert "branchgym/TreeMDP-v0" in md and "PickleSnapshot" in md and "ReplaySnapshot" in md
    assert (tmp_path / "snapshot_envs.png").stat().st_size > 1000
    assert (tmp_path / "snapshot_cartpole.png").stat().st_size > 1000
    if os.environ.get("BRANCHGYM_REQUIRE_DOCKER") == "1":  # CI: every Docker mode measured
        for backend in ("docker commit", "docker overlay"):
            assert f"| {backend} | 1 |" in md and f"| {backend} | 100 |" in md


def test_bench_snapshot_envs_selects_sections(tmp_path, capsys):
    """``--envs`` runs the registered-env table for the named ids and only their sections."""
    from branchgym.bench.snapshot import SECTIONS, selected_sections

    assert len(selected_sections(None)) == len(SECTIONS)
    only_swe = selected_sections(["branchgym/SWEBench-v0"])
    assert only_swe == [
        "branchgym.bench.snapshot:section_registered",
        "branchgym.bench.swebench:section_swebench",
    ]
    argv = ["bench", "snapshot", "--quick", "--repeats", "3", "--out", str(tmp_path)]
    assert main([*argv, "--envs", "branchgym/TreeMDP-v0", "CartPole-v1"]) == 0
    md = (tmp_path / "snapshot.md").read_text()
    assert "branchgym/TreeMDP-v0" in md and "PickleSnapshot" in md
    assert "branchgym/TextTreeMDP-v0" not in md
    headings = [line for line in md.splitlines() if line.startswith("## ")]
    assert headings == ["## Registered envs", "## CartPole: pickle vs replay by depth"]
