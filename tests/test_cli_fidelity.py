"""``branchgym check`` runs the property suite too; exit codes follow both reports."""

from branchgym.cli import main
from branchgym.scenarios import SCENARIOS

#: Passes check_env (its continuations replay the same actions) but not the property suite.
stale_cache_tree = SCENARIOS["stale_obs_cache"].factory("branchgym/TreeMDP-v0")


def test_check_prints_both_reports_and_passes(capsys):
    assert main(["check", "branchgym/TextTreeMDP-v0", "--max-examples", "20"]) == 0
    out = capsys.readouterr().out
    assert "check_env: branchgym/TextTreeMDP-v0" in out
    assert "check_snapshot_fidelity: branchgym/TextTreeMDP-v0 (exact mode" in out
    assert out.rstrip().endswith("OK")


def test_check_fails_when_only_the_property_suite_fails(capsys):
    assert main(["check", "tests.test_cli_fidelity:stale_cache_tree", "--no-fidelity"]) == 0
    capsys.readouterr()
    assert main(["check", "tests.test_cli_fidelity:stale_cache_tree"]) == 1
    out = capsys.readouterr().out
    check_env_part, fidelity_part = out.split("check_snapshot_fidelity:")
    assert check_env_part.rstrip().endswith("OK")
    assert "FAILED" in fidelity_part and "continuation: obs" in fidelity_part
    assert "from tests.test_cli_fidelity import stale_cache_tree as make" in fidelity_part


def test_check_fails_on_a_broken_snapshot_with_both_reports(capsys):
    assert main(["check", "tests.fidelity.test_checks:AliasingTree", "--max-examples", "30"]) == 1
    out = capsys.readouterr().out
    assert "check(s) FAILED" in out and "violation: digest: state_digest" in out


def test_check_reports_an_env_that_cannot_be_built(capsys):
    assert main(["check", "tests.test_cli_fidelity:broken_factory"]) == 1
    assert "RuntimeError: no sandbox here" in capsys.readouterr().out


def broken_factory():
    raise RuntimeError("no sandbox here")
