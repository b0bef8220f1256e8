"""branchgym/SWEBench-v0: shell actions, tracked cwd/env, submit grading, snapshots, leaks."""

import io
import pickle

import gymnasium as gym
import pytest

import branchgym
from branchgym.cli import play
from branchgym.envs.swebench.env import PROBE_ACTIONS
from branchgym.envs.swebench.layers import wait_for_cleanup
from branchgym.envs.swebench.mounts import list_local_mounts
from branchgym.error import (
    DataError,
    ResetNeededError,
    SandboxError,
    SnapshotNotPicklableError,
    SnapshotReleasedError,
)
from branchgym.fidelity.checks import CHECKS, check_env

ENV_ID = "branchgym/SWEBench-v0"


@pytest.fixture
def env():
    e = gym.make(ENV_ID)
    yield e
    e.close()


def start(env, name):
    return env.reset(options={"instance_id": f"branchgym__{name}-1"})


def test_reset_shows_the_issue_and_is_seeded(env):
    obs, info = env.reset(seed=3)
    task = env.unwrapped.task
    assert task.problem_statement.strip() in obs and "submit" in obs
    assert info == {
        "instance_id": task.instance_id,
        "cwd": "/testbed",
        "exit_code": 0,
        "timed_out": False,
        "invalid_action": False,
    }
    assert env.reset(seed=3)[0] == obs
    ids = {env.reset(seed=s)[1]["instance_id"] for s in range(12)}
    assert len(ids) > 3
    with pytest.raises(DataError, match="no task"):
        env.reset(options={"instance_id": "nope-1"})


def test_cwd_and_exported_variables_carry_over(env):
    start(env, "textstats")
    assert env.step("cd textstats && export GREETING='hi there'")[4]["cwd"] == "/testbed/textstats"
    obs, *_, info = env.step("pwd; echo $GREETING; ls")
    assert obs == "/testbed/textstats\nhi there\n__init__.py\ncore.py\n"
    env.step("unset GREETING; cd ..")
    assert env.step("pwd; echo ${GREETING:-unset}")[0] == "/testbed\nunset\n"
    # `exit`, a syntax error and a failing command keep the shell state and report the code.
    env.step("cd tests; export A=1; exit 3")
    assert env.unwrapped.shell.cwd == "/testbed/tests" and env.unwrapped.shell.env["A"] == "1"
    obs, *_, info = env.step('echo "unclosed')
    assert info["exit_code"] == 2 and "[exit code 2]" in obs and info["cwd"] == "/testbed/tests"
    env.step("mkdir -p /testbed/gone && cd /testbed/gone && rmdir /testbed/gone")
    obs = env.step("pwd")[0]
    assert "no longer exists" in obs and obs.endswith("/testbed\n")


def test_timeout_truncation_and_invalid_actions(env):
    short = gym.make(ENV_ID, command_timeout=1, max_output_chars=200)
    try:
        start(short, "rpn")
        obs, *_, info = short.step("cd rpn; echo started; sleep 20")
        assert info["timed_out"] and "timed out after 1 s" in obs and obs.startswith("started")
        assert info["cwd"] == "/testbed"  # the cd of a killed command is not kept
        obs = short.step("seq 1 10000")[0]
        assert "characters omitted" in obs and obs.startswith("1\n2\n") and "10000" in obs
        assert len(obs) < 400
    finally:
        short.close()
    start(env, "rpn")
    digest = env.unwrapped.state_digest()
    for bad, why in [(3, "got int"), ("  ", "empty"), ("echo \x00", "NUL")]:
        obs, reward, term, trunc, info = env.step(bad)
        assert obs.startswith("Invalid action") and why in obs
        assert info["invalid_action"] and reward == 0.0 and not term
    # The invalid actions ran nothing (only the step counter moved).
    env.unwrapped.step_index -= 3
    assert env.unwrapped.state_digest() == digest
    assert env.step("echo ok")[0] == "ok\n"


def test_every_gold_patch_resolves_through_submit(env, tasks):
    for task in tasks:
        start(env, task.repo.split("/")[1])
        env.unwrapped.sandbox.write("/testbed/gold.patch", task.patch.encode())
        assert env.step("git apply gold.patch && rm gold.patch")[4]["exit_code"] == 0
        obs, reward, terminated, truncated, info = env.step("submit")
        assert terminated and not truncated, obs
        assert reward == 1.0 and info["resolved"], (task.instance_id, obs)
        assert info["patch"] == task.patch  # the graded diff is exactly the gold patch
        assert info["report"]["tests_status"]["FAIL_TO_PASS"]["failure"] == []
        with pytest.raises(ResetNeededError):
            env.step("ls")


def test_no_patch_and_wrong_patches_do_not_resolve(env, tasks):
    start(env, "textstats")
    obs, reward, terminated, _, info = env.step("submit")
    assert reward == 0.0 and terminated and not info["resolved"]
    assert "no changes" in obs and info["report"]["patch_exists"] is False
    base = env.unwrapped
    for task in tasks:
        start(env, task.repo.split("/")[1])
        wrong = base.grade(task.extra["branchgym_wrong_patch"])
        assert wrong.patch_applied and not wrong.resolved, task.instance_id
        failing = wrong.tests_status["FAIL_TO_PASS"]["failure"]
        failing += wrong.tests_status["PASS_TO_PASS"]["failure"]
        assert failing and set(failing) <= set(task.fail_to_pass + task.pass_to_pass)
    garbage = base.grade("diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-nope\n+yes\n")
    assert garbage.patch_exists and not garbage.patch_applied and not garbage.resolved
    assert "does not apply" in garbage.summary()


def test_fix_command_then_submit_and_grading_changes_no_state(env, task_by_name):
    start(env, "csvline")
    env.step("cd tests")
    env.step(task_by_name["csvline"].extra["branchgym_fix_command"])
    env.step("echo notes > NOTES.txt; mkdir -p __pycache__ && echo x > __pycache__/junk.pyc")
    digest = env.unwrapped.state_digest()
    patch = env.unwrapped.patch()
    assert "NOTES.txt" in patch and "junk.pyc" not in patch  # untracked in, ignored out
    report = env.unwrapped.grade()
    assert report.resolved and env.unwrapped.state_digest() == digest
    obs, reward, *_ = env.step("submit")
    assert reward == 1.0 and obs.startswith("Submitted. Resolved")


def test_snapshots_restore_across_instances_and_tasks(env):
    start(env, "romans")
    env.step("cd romans && export K=v && echo change >> core.py")
    snap = env.snapshot()
    assert snap.kind in ("overlay", "git") and not snap.picklable
    with pytest.raises(SnapshotNotPicklableError):
        pickle.dumps(snap)
    env.step("cd /; rm -rf /testbed/romans")
    other = gym.make(ENV_ID)
    try:
        start(other, "bank")
        obs, info = other.restore(snap)
        assert info["instance_id"] == "branchgym__romans-1" and info["cwd"] == "/testbed/romans"
        assert other.step("echo $K; tail -1 core.py")[0] == "v\nchange\n"
        assert env.restore(snap)[1] == info
        other.restore(snap)
        assert branchgym.state_digest(env) == branchgym.state_digest(other)
    finally:
        other.close()
    env.close()  # closing the env that took it releases the snapshot
    assert snap.inner.released  # (the handle gym.make returns wraps the env's own)
    with pytest.raises(SnapshotReleasedError):
        env.restore(snap)


@pytest.mark.parametrize("backend", ["overlay", pytest.param("git", marks=pytest.mark.slow)])
def test_fidelity_checks_pass_with_probe_actions(backend):
    report = check_env(
        lambda: gym.make(ENV_ID, backend=backend, suggested_actions=PROBE_ACTIONS), seed=1
    )
    assert report.ok, str(report)
    assert [r.name for r in report.results] == list(CHECKS)


def test_leak_free_after_100_snapshot_restore_fork_cycles(tasks):
    base_live = branchgym.live_snapshots().count
    env = gym.make(ENV_ID, backend="overlay")
    start(env, "durations")
    store = env.unwrapped.backend.store
    kept = []
    for i in range(100):
        env.step(f"echo {i} >> log.txt")
        snap = env.snapshot()
        env.step("rm -rf durations")
        env.restore(snap)
        child = env.unwrapped.sandbox.fork(snap.inner.payload.sandbox)
        child.exec("echo fork >> log.txt")
        child.close()
        if i % 10:
            snap.release()
        else:  # every tenth stays alive until close()
            kept.append(snap)
    assert env.unwrapped.sandbox.read("log.txt").count(b"\n") == 100
    assert env.unwrapped.live_resources()["snapshots"] == 10
    env.close()
    assert all(s.inner.released for s in kept)
    wait_for_cleanup()
    assert branchgym.live_snapshots().count == base_live
    assert list_local_mounts(store.root) == []
    assert store.live_layers() == 0
    for sub in ("l", "s", "trash"):
        assert list((store.root / sub).iterdir()) == [], sub


def test_errors_are_typed(tasks):
    with pytest.raises(SandboxError, match="unknown backend"):
        gym.make(ENV_ID, backend="vm")
    with pytest.raises(DataError, match="repos_dir"):
        gym.make(ENV_ID, tasks=[tasks[0].to_record()])
    fresh = gym.make(ENV_ID)
    with pytest.raises(ResetNeededError):  # the env's own check (under OrderEnforcing)
        fresh.unwrapped.step("ls")
    with pytest.raises(ResetNeededError):
        fresh.unwrapped.snapshot()
    fresh.close()


def test_play_by_hand(task_by_name):
    probe = branchgym.make(ENV_ID)
    first = probe.reset(seed=0)[1]["instance_id"]  # the task play() gets with seed 0
    probe.close()
    task = next(t for t in task_by_name.values() if t.instance_id == first)
    script = "\n".join(
        ["cd tests", ":snap", "rm -rf /testbed/*", "ls", ":restore 0", "pwd; ls",
         task.extra["branchgym_fix_command"], "submit", ":quit"]
    ) + "\n"  # fmt: skip
    out = io.StringIO()
    assert play(ENV_ID, seed=0, stdin=io.StringIO(script), stdout=out) == 0
    text = out.getvalue()
    assert task.problem_statement.splitlines()[0] in text
    assert "snapshot 0 at step 1 (overlay" in text
    assert "restored snapshot 0 (step 1)" in text and "/testbed/tests\n" in text
    assert "Submitted. Resolved" in text and "[reward 1.000]" in text
