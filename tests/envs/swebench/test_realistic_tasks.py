"""The realistic task set (real PyPI projects) and the per-repository environments."""

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from branchgym.envs.swebench.env import SWEBenchEnv
from branchgym.envs.swebench.generated import (
    REALISTIC_DIR,
    load_realistic_defs,
    task_set,
)
from branchgym.envs.swebench.grading import grade
from branchgym.envs.swebench.local import LocalBackend
from branchgym.envs.swebench.repo_env import repo_environment
from branchgym.envs.swebench.tasks import SWEBenchTask
from branchgym.error import DataError, RepoEnvironmentError


def test_at_least_twenty_tasks_from_several_licensed_projects():
    defs = load_realistic_defs()
    assert len(defs) >= 20
    projects = {td.project for td in defs}
    assert len(projects) >= 5
    for td in defs:
        assert td.license in {"MIT", "BSD-3-Clause", "Apache-2.0", "PSF-2.0"}
        assert any(re.fullmatch(r"LICEN[CS]E(\.txt)?", p) for p in td.upstream), td.project
        assert td.fail_to_pass and td.pass_to_pass
        # The held-back tests are not in the base commit; the test patch brings them.
        for test in td.fail_to_pass:
            name = test.split("::")[-1].split("[")[0]
            path = test.split("::")[0]
            assert f"def {name}(" not in td.base_files()[path]
            assert f"def {name}(" in td.upstream[path]


def test_records_are_in_swebench_format(real_tasks, real_checkout):
    for task in real_tasks:
        rec = task.to_record()
        assert re.fullmatch(r"[\w.-]+__[\w.-]+-\d+", rec["instance_id"])
        assert rec["repo"].replace("/", "__") == rec["instance_id"].rsplit("-", 1)[0]
        for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
            assert isinstance(rec[key], str) and json.loads(rec[key])
        assert re.fullmatch(r"[0-9a-f]{40}", rec["base_commit"])
        assert rec["environment_setup_commit"] and rec["created_at"] and rec["version"]
        assert rec["patch"].startswith("diff --git") and rec["test_patch"].startswith("diff --git")
        # The issue reads like a report: none of the fix's added lines is in it.
        added = [ln[1:].strip() for ln in rec["patch"].splitlines() if ln.startswith("+ ")]
        assert not [a for a in added if len(a) > 12 and a in rec["problem_statement"]]
    # The base commit has no history the agent could read the fix from: every commit
    # holds the base tree.
    checkout = real_checkout(real_tasks[0])
    trees = subprocess.run(
        ["git", "log", "--format=%T"], cwd=checkout, capture_output=True, text=True, check=True
    ).stdout.split()
    assert len(trees) == 2 and len(set(trees)) == 1


def test_task_sets_by_name():
    assert task_set("realistic").parent.name.startswith("realistic-")
    with pytest.raises(DataError, match="realistic"):
        task_set("nope")
    env = SWEBenchEnv(tasks="realistic", instance_ids=["benjaminp__six-1"])
    try:
        assert [t.instance_id for t in env.tasks] == ["benjaminp__six-1"]
    finally:
        env.close()


def test_load_realistic_defs_names_the_missing_file(tmp_path):
    (tmp_path / "tasks.json").write_text(json.dumps({"order": ["six/1"]}))
    with pytest.raises(DataError, match="project.json"):
        load_realistic_defs(tmp_path)
    assert load_realistic_defs(REALISTIC_DIR)


def _cachetools(real_tasks):
    return next(t for t in real_tasks if t.repo == "tkem/cachetools")


@pytest.mark.slow
def test_repo_env_installs_src_layout_once_and_tests_run_in_it(real_tasks, real_checkout):
    task = _cachetools(real_tasks)
    checkout = real_checkout(task)
    env = repo_environment(task, checkout)
    marker = env.prefix.parent / "env.json"
    stamp = marker.stat().st_mtime_ns
    again = repo_environment(task, checkout)
    assert again == env and marker.stat().st_mtime_ns == stamp  # built once, reused
    assert env.roots == ("src",)
    site = next(env.prefix.glob("lib/python*/site-packages"))
    pth = "".join(p.read_text() for p in site.glob("__editable__*"))
    assert "/testbed/src" in pth and str(checkout) not in pth
    backend = LocalBackend()
    sb = backend.create(task, checkout)
    try:
        res = sb.exec(
            "python3 -c 'import cachetools, sys; print(cachetools.__file__); print(sys.prefix)'"
        )
        out = res.output.decode()
        assert res.exit_code == 0, out
        assert "/testbed/src/cachetools/__init__.py" in out
        assert str(env.prefix) in out
        # The venv is read-only inside the sandbox.
        res = sb.exec(f"touch {env.prefix}/x")
        assert res.exit_code != 0 or backend.runner.isolation == "none"
    finally:
        sb.close()


def _venv_of_this_python(folder: Path) -> str:
    """A venv made from this interpreter that sees its packages (as a worktree's is)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    import site

    (site_dir,) = folder.glob("lib/python*/site-packages")
    (site_dir / "outer.pth").write_text("".join(f"{s}\n" for s in site.getsitepackages()))
    return str(folder / "bin" / "python")


@pytest.mark.slow
def test_each_venv_gets_its_own_environment_and_a_stale_one_is_rebuilt(
    real_tasks, real_checkout, tmp_path
):
    # Two venvs of one interpreter resolve to the same binary but add different
    # site-packages: one venv's environment must never serve the other (CI once met a
    # deleted worktree venv's environment and could not start its python).
    task = _cachetools(real_tasks)
    checkout = real_checkout(task)
    root = tmp_path / "envs"
    first = _venv_of_this_python(tmp_path / "a")
    second = _venv_of_this_python(tmp_path / "b")
    env_a = repo_environment(task, checkout, base_python=first, root=root)
    env_b = repo_environment(task, checkout, base_python=second, root=root)
    assert env_a.prefix != env_b.prefix
    assert (env_a.base_python, env_b.base_python) == (first, second)
    # An environment whose base interpreter is gone is rebuilt, not handed out.
    meta = env_b.prefix.parent / "env.json"
    data = json.loads(meta.read_text())
    meta.write_text(json.dumps({**data, "base_python": str(tmp_path / "gone" / "python")}))
    again = repo_environment(task, checkout, base_python=second, root=root)
    assert again.base_python == second
    assert json.loads(meta.read_text())["base_python"] == second
    out = subprocess.run(
        [str(again.prefix / "bin" / "python"), "-c", "import cachetools, pip"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    # So is one a site folder of which has gone (its venv deleted and not remade).
    data = json.loads(meta.read_text())
    assert data["sites"]
    meta.write_text(json.dumps({**data, "sites": [*data["sites"], str(tmp_path / "no-site")]}))
    repo_environment(task, checkout, base_python=second, root=root)
    assert str(tmp_path / "no-site") not in json.loads(meta.read_text())["sites"]


@pytest.mark.slow
def test_unisolated_commands_import_the_sandboxs_own_sources(real_tasks, real_checkout):
    task = _cachetools(real_tasks)
    sb = LocalBackend("git", isolation="none").create(task, real_checkout(task))
    try:
        res = sb.exec("python3 -c 'import cachetools; print(cachetools.__file__)'")
        assert res.exit_code == 0, res.text
        assert res.text.strip() == str(sb.host_dir / "src" / "cachetools" / "__init__.py")
    finally:
        sb.close()


@pytest.mark.slow
def test_restoring_another_tasks_snapshot_switches_its_environment():
    env = SWEBenchEnv(tasks="realistic", instance_ids=["benjaminp__six-1", "tkem__cachetools-1"])
    try:
        env.reset(options={"instance_id": "benjaminp__six-1"})
        snap = env.snapshot()
        env.reset(options={"instance_id": "tkem__cachetools-1"})
        obs, *_ = env.step("python3 -c 'import sys; print(sys.prefix)'")
        assert "tkem__cachetools" in obs
        env.restore(snap)
        obs, *_ = env.step("python3 -c 'import sys; print(sys.prefix)'")
        assert "benjaminp__six" in obs
        snap.release()
    finally:
        env.close()


def test_host_python_env_keeps_branchgyms_interpreter(real_tasks, real_checkout):
    task = _cachetools(real_tasks)
    backend = LocalBackend(python_env="host")
    sb = backend.create(task, real_checkout(task))
    try:
        out = sb.exec("python3 -c 'import sys; print(sys.prefix)'").output.decode()
        assert out.strip() == sys.prefix
    finally:
        sb.close()


@pytest.mark.slow
def test_missing_dependency_is_a_typed_error_naming_the_fix(needy_project, tmp_path):
    task, proj = needy_project("branchgym-no-such-distribution>=1")
    with pytest.raises(RepoEnvironmentError, match="branchgym-no-such-distribution.*python_env"):
        repo_environment(task, proj, root=tmp_path / "envs")


@pytest.mark.slow
def test_gold_patch_resolves_every_task_and_wrong_patch_none(real_tasks, real_checkout):
    """With the defences on (trusted configuration, pytest's recorded outcomes)."""
    backend = LocalBackend()
    for task in real_tasks:  # environments first (once per repository and version)
        backend.runner_for(task, real_checkout(task))

    def run(task: SWEBenchTask, which: str) -> tuple[str, str, bool]:
        patch = task.patch if which == "gold" else task.extra["branchgym_wrong_patch"]
        sb = backend.create(task, real_checkout(task))
        try:
            report = grade(sb, task, patch, timeout=300, guard=True)
        finally:
            sb.close()
        assert not report.rejected, (task.instance_id, which, report.rejected)
        assert report.outcome_check == "pytest reports", (task.instance_id, report.outcome_check)
        return task.instance_id, which, report.resolved

    jobs = [(t, w) for t in real_tasks for w in ("gold", "wrong")]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda j: run(*j), jobs))
    wrong_verdicts = {(i, w): r for i, w, r in results if r != (w == "gold")}
    assert not wrong_verdicts, wrong_verdicts
    assert len(results) == 2 * len(real_tasks) >= 40


def test_realistic_task_ids_are_unique_and_stable():
    ids = [td.instance_id for td in load_realistic_defs()]
    assert len(ids) == len(set(ids))
    assert "benjaminp__six-1" in ids and "tkem__cachetools-1" in ids
    assert Path(REALISTIC_DIR, "six", "upstream", "LICENSE").is_file()


def test_base_edits_rebuild_files_exactly_and_refuse_ambiguous_text():
    from branchgym.envs.swebench.generated import apply_edits, file_edits

    old = {
        "a.py": "x = 1\nx = 1\ndef f():\n    return 1\n\ndef g():\n    return 1\nend\n",
        "b.py": "same\nsame\nsame\n",
    }
    new = {
        # a change inside repeated lines, a deleted function, a line added at the end
        "a.py": "x = 1\nx = 2\ndef f():\n    return 1\n\nend\nmore\n",
        "b.py": "first\nsame\nsame\nsame\n",
    }
    edits = file_edits(old, new)
    assert apply_edits(old, edits, "t") == new
    # Each edit's text occurs once where it applies, so the edits are much smaller than
    # the files only when the files are large; here they still rebuild them exactly.
    assert all(p in old for p, _, _ in edits)
    with pytest.raises(DataError, match="exactly once"):
        apply_edits({"b.py": "same\nsame\n"}, [["b.py", "same\n", "other\n"]], "t")
    with pytest.raises(DataError, match="does not apply"):
        apply_edits(old, [["missing.py", "a", "b"]], "t")
    with pytest.raises(DataError, match="upstream"):
        file_edits(old, {"new.py": "x\n"})


def test_shipped_bases_are_small_edits_of_upstream():
    import json

    from branchgym.envs.swebench.generated import REALISTIC_DIR

    for path in REALISTIC_DIR.glob("*/[0-9]*/base.json"):
        edits = json.loads(path.read_text())
        assert edits and all(len(e) == 3 for e in edits), path
        assert not (path.parent / "base").exists()
