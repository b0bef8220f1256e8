"""The scenario library and the detection matrix (``branchgym scenarios``)."""

import gc
import os

import gymnasium as gym
import pytest

import branchgym
from branchgym.cli import main
from branchgym.fidelity.checks import ActionChooser
from branchgym.scenarios import (
    BENIGN,
    MUST_DETECT,
    SCENARIO_ENVS,
    SCENARIOS,
    ScenarioEnv,
    faults,
    scenario,
)
from branchgym.scenarios.matrix import Cell, Row, render_matrix, run_matrix

#: The faults issue #3 lists, by the name the catalogue gives them.
ISSUE_MUST_DETECT = {
    "unseeded_rng",
    "rng_not_snapshotted",
    "wall_clock",
    "hidden_global_counter",
    "aliased_history",
    "file_outside_snapshot",
    "background_thread",
    "latency_ordering",
    "partial_restore",
    "wrapper_counter_not_restored",
    "stale_obs_cache",
    "rare_nondeterminism",
}
ISSUE_BENIGN = {"seeded_stochastic", "declared_timing"}


def test_catalogue_covers_the_issue_and_documents_each_bug():
    must = {n for n, s in SCENARIOS.items() if s.verdict == MUST_DETECT}
    benign = {n for n, s in SCENARIOS.items() if s.verdict == BENIGN}
    assert ISSUE_MUST_DETECT <= must and ISSUE_BENIGN <= benign
    for s in SCENARIOS.values():
        assert "Real bug" in s.doc or s.verdict == BENIGN, s.name
        assert len(s.doc.splitlines()) >= 3, s.name
    ids = [e.id for e in SCENARIO_ENVS]
    assert {"branchgym/TreeMDP-v0", "branchgym/TextTreeMDP-v0"} <= set(ids)
    assert len(ids) == len(set(ids))


def test_applicability_is_explained():
    unregistered = ScenarioEnv("nowhere/Env-v0")
    assert SCENARIOS["aliased_history"].why_not(unregistered) == "not registered"
    deterministic = ScenarioEnv("branchgym/TreeMDP-v0", stochastic=False)
    assert "RNG" in SCENARIOS["rng_excluded_declared"].why_not(deterministic)
    assert SCENARIOS["unseeded_rng"].why_not(SCENARIO_ENVS[0]) is None


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("target", SCENARIO_ENVS, ids=lambda t: t.id)
def test_every_scenario_runs_episodes_and_releases_its_snapshots(name, target):
    sc = SCENARIOS[name]
    if sc.why_not(target):
        pytest.skip(sc.why_not(target))
    base = branchgym.live_snapshots().count
    env = sc.factory(target.id)()
    _, info = env.reset(seed=0)
    chooser = ActionChooser(env, 0)
    with env.snapshot() as snap:
        for _ in range(2):
            env.restore(snap)
            done = False
            while not done:
                *_, term, trunc, info = env.step(chooser(info))
                done = term or trunc
    env.close()
    assert branchgym.live_snapshots().count == base


def test_fault_resources_are_cleaned_up():
    env = SCENARIOS["file_outside_snapshot"].factory("branchgym/TreeMDP-v0")()
    env.reset(seed=0)
    env.step(0)
    layer = env.env
    assert os.path.exists(layer.path)
    env.close()
    assert not os.path.exists(layer.dir)
    env = SCENARIOS["background_thread"].factory("branchgym/TreeMDP-v0")()
    env.reset(seed=0)
    thread = env.env.thread
    assert thread.is_alive()
    env.close()
    assert not thread.is_alive()
    env = SCENARIOS["background_thread"].factory("branchgym/TreeMDP-v0")()
    env.reset(seed=0)
    stop = env.env.stop
    del env
    gc.collect()
    assert stop.is_set()  # a dropped env stops its thread too


def test_restore_fault_rates():
    make = gym.make("branchgym/TreeMDP-v0")
    env = faults.RestoreFault(make, 1.0, kind="rng", seed=0)
    env.reset(seed=0)
    snap = env.snapshot()
    for _ in range(3):
        env.restore(snap)
    assert env.faulty_restores == 3
    with pytest.raises(branchgym.error.FidelitySetupError):
        faults.RestoreFault(make, 0.1, kind="bogus")


def test_row_outcomes():
    hit, miss = Cell(1, 1, [5]), Cell(1, 0)
    assert str(hit) == "1/1 @5" and str(miss) == "0/1" and str(Cell()) == "n/a"
    must = {"digest": miss, "shadow": miss, "property": hit}
    assert Row("a", "e", MUST_DETECT, cells=must).outcome == "ok"
    assert Row("a", "e", MUST_DETECT, cells={**must, "property": miss}).outcome == "MISSED"
    assert Row("b", "e", BENIGN, cells=must).outcome == "FALSE POSITIVE"
    assert Row("b", "e", BENIGN, cells={**must, "property": miss}).outcome == "ok"
    assert Row("b", "e", BENIGN, skipped="why").outcome == "n/a"


def test_matrix_reports_a_miss_and_a_false_positive(monkeypatch):
    monkeypatch.setattr("branchgym.scenarios.SCENARIOS", dict(SCENARIOS))
    scenario("not_a_bug", MUST_DETECT)(lambda env: env)  # claims a bug it does not have
    scenario("actually_a_bug", BENIGN)(faults.AliasedHistory)
    import branchgym.scenarios as pkg

    monkeypatch.setattr("branchgym.scenarios.matrix.SCENARIOS", pkg.SCENARIOS)
    rows = run_matrix(
        ["not_a_bug", "actually_a_bug"],
        [ScenarioEnv("branchgym/TextTreeMDP-v0")],
        seeds=[0],
        workload_steps=60,
        max_examples=10,
        progress=False,
    )
    assert [r.outcome for r in rows] == ["MISSED", "FALSE POSITIVE"]
    text = render_matrix(rows)
    assert "caught by the property suite on every seed: 0/1" in text
    assert "benign flagged by any check: 1/1" in text


def test_cli_exit_code_follows_the_matrix(monkeypatch, capsys):
    bad = [
        Row(
            "x",
            "e",
            MUST_DETECT,
            "exact",
            {c: Cell(1, 0) for c in ("digest", "shadow", "property")},
        )
    ]
    monkeypatch.setattr("branchgym.scenarios.matrix.run_matrix", lambda *a, **k: bad)
    assert main(["scenarios", "--quick"]) == 1
    assert "MISSED: x on e" in capsys.readouterr().err
    assert main(["scenarios", "--list"]) == 0
    out = capsys.readouterr().out
    assert "rare_nondeterminism" in out and "must-detect" in out and "benign" in out


@pytest.mark.slow
def test_branchgym_scenarios_quick_passes(tmp_path, capsys):
    """The CI run: every must-detect caught at the default budget, no false positive."""
    assert main(["scenarios", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [(s, e) for s in SCENARIOS.values() for e in SCENARIO_ENVS if not s.why_not(e)]
    n_must = sum(s.verdict == MUST_DETECT for s, _ in rows)
    n_benign = sum(s.verdict == BENIGN for s, _ in rows)
    assert n_must >= 28 and n_benign >= 8  # at least the two toy envs
    assert f"on every seed: {n_must}/{n_must}" in out
    assert f"benign flagged by any check: 0/{n_benign}" in out
    assert (tmp_path / "scenarios.md").read_text().count("| ok |") == n_must + n_benign
