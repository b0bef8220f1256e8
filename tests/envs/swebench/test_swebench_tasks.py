"""SWE-bench task format, loaders, the generated task set and the pytest log parser."""

import json
import subprocess
import sys

import pytest

from branchgym.envs.swebench.generated import TASK_DEFS, build_generated_tasks
from branchgym.envs.swebench.grading import (
    ResolvedStatus,
    parse_log_pytest,
    resolution_status,
    tests_report,
)
from branchgym.envs.swebench.tasks import (
    diff_files,
    ensure_checkout,
    find_repo,
    load_tasks,
    new_files,
    parse_task,
)
from branchgym.error import DataError

RECORD = {
    "instance_id": "octo__lib-7",
    "repo": "octo/lib",
    "base_commit": "a" * 40,
    "problem_statement": "It breaks.",
    "patch": "",
    "test_patch": "diff --git a/t/test_a.py b/t/test_a.py\n",
    "FAIL_TO_PASS": '["t/test_a.py::test_x"]',
    "PASS_TO_PASS": "[]",
    "version": "1.2",
    "environment_setup_commit": "b" * 40,
    "hints_text": "",
    "created_at": "2023-01-01T00:00:00Z",
}


def git(cwd, *args):
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


# ------------------------------------------------------------------- generated set


def test_generated_tasks_are_real_git_repositories(tasks, checkout):
    assert len(tasks) == len(TASK_DEFS) >= 10
    for t in tasks:
        assert t.patch.startswith("diff --git") and t.test_patch.startswith("diff --git")
        assert t.fail_to_pass and t.pass_to_pass and t.problem_statement.strip()
        repo = checkout(t)
        assert git(repo, "rev-parse", "HEAD") == t.base_commit
        assert git(repo, "status", "--porcelain") == ""
        assert git(repo, "remote") == ""  # no origin to read the fix from
        # Upstream's record format survives a round trip.
        rec = t.to_record()
        assert json.loads(rec["FAIL_TO_PASS"]) == list(t.fail_to_pass)
        assert parse_task(rec) == t
        assert t.test_files == diff_files(t.test_patch) != []


def test_generated_build_is_deterministic(tmp_path, tasks):
    again = load_tasks(build_generated_tasks(tmp_path / "gen"))
    assert [t.base_commit for t in again] == [t.base_commit for t in tasks]
    assert [t.patch for t in again] == [t.patch for t in tasks]


# -------------------------------------------------------------------------- loaders


def test_load_json_and_jsonl(tmp_path):
    plain = dict(RECORD, instance_id="octo__lib-8", FAIL_TO_PASS=["t/test_a.py::test_y"])
    (tmp_path / "a.jsonl").write_text(json.dumps(RECORD) + "\n\n" + json.dumps(plain) + "\n")
    (tmp_path / "a.json").write_text(json.dumps([RECORD, plain]))
    (tmp_path / "wrapped.json").write_text(json.dumps({"instances": [RECORD]}))
    for name in ("a.jsonl", "a.json"):
        got = load_tasks(tmp_path / name)
        assert [t.instance_id for t in got] == ["octo__lib-7", "octo__lib-8"]
        assert got[0].fail_to_pass == ("t/test_a.py::test_x",)
        assert got[1].fail_to_pass == ("t/test_a.py::test_y",)
        assert got[0].extra == {"created_at": "2023-01-01T00:00:00Z"}
        assert got[0].version == "1.2"
    assert load_tasks(tmp_path / "wrapped.json")[0].instance_id == "octo__lib-7"
    only = load_tasks(tmp_path / "a.json", instance_ids=["octo__lib-8"])
    assert [t.instance_id for t in only] == ["octo__lib-8"]


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"instance_id": "x"', "not valid JSON"),
        (json.dumps([{k: v for k, v in RECORD.items() if k != "test_patch"}]), "test_patch"),
        (json.dumps([dict(RECORD, base_commit="main")]), "not a git commit"),
        (json.dumps([dict(RECORD, FAIL_TO_PASS="[broken")]), "not JSON"),
        (json.dumps([dict(RECORD, PASS_TO_PASS=3)]), "list of test ids"),
        (json.dumps([RECORD, RECORD]), "appears twice"),
        (json.dumps([]), "no task instances"),
        (json.dumps("text"), "expected a list"),
    ],
)
def test_malformed_task_files_raise_data_error(tmp_path, content, match):
    p = tmp_path / "t.json"
    p.write_text(content)
    with pytest.raises(DataError, match=match):
        load_tasks(p)


def test_task_file_errors_say_the_fix(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_tasks(tmp_path / "nope.jsonl")
    (tmp_path / "t.csv").write_text("x")
    with pytest.raises(DataError, match=".json or .jsonl"):
        load_tasks(tmp_path / "t.csv")
    (tmp_path / "t.jsonl").write_text(json.dumps(RECORD) + "\n{oops\n")
    with pytest.raises(DataError, match=r"t\.jsonl:2"):
        load_tasks(tmp_path / "t.jsonl")
    (tmp_path / "ok.jsonl").write_text(json.dumps(RECORD) + "\n")
    with pytest.raises(DataError, match="no instance"):
        load_tasks(tmp_path / "ok.jsonl", instance_ids=["missing-1"])


def test_diff_file_helpers():
    patch = (
        "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n"
        "diff --git a/new.py b/new.py\nnew file mode 100644\n--- /dev/null\n+++ b/new.py\n"
    )
    assert diff_files(patch) == ["x.py", "new.py"]
    assert new_files(patch) == ["new.py"]


# ---------------------------------------------------------------- local repositories


def test_checkout_hides_later_history(tmp_path, monkeypatch):
    monkeypatch.setenv("BRANCHGYM_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "repos" / "octo__lib"
    src.mkdir(parents=True)
    git(src, "init", "-q", "-b", "main")
    (src / "a.py").write_text("x = 1\n")
    git(src, "add", "-A")
    git(src, "commit", "-qm", "base")
    base = git(src, "rev-parse", "HEAD")
    (src / "a.py").write_text("x = 2  # the fix\n")
    git(src, "commit", "-qam", "fix")
    git(src, "tag", "v2")
    task = parse_task(dict(RECORD, base_commit=base))
    repo = ensure_checkout(task, tmp_path / "repos")
    assert (repo / "a.py").read_text() == "x = 1\n"
    assert git(repo, "log", "--all", "--format=%s") == "base"
    assert git(repo, "tag") == "" and git(repo, "remote") == ""
    assert ensure_checkout(task, tmp_path / "repos") == repo  # cached
    with pytest.raises(DataError, match="git clone https://github.com/octo/other"):
        find_repo("octo/other", tmp_path / "repos")
    with pytest.raises(DataError, match="not in"):
        ensure_checkout(parse_task(dict(RECORD, instance_id="octo__lib-9")), tmp_path / "repos")


# ---------------------------------------------------------------------- log parser

LOG = """\
============================= test session starts ==============================
collected 7 items

tests/test_a.py .F.sxE                                                   [100%]

==================================== ERRORS ====================================
_________________________ ERROR at setup of test_err __________________________
=========================== short test summary info ============================
PASSED tests/test_a.py::test_ok
PASSED tests/test_a.py::test_param[1-2]
\x1b[31mFAILED\x1b[0m tests/test_a.py::test_bad - AssertionError: assert 1 == 2
SKIPPED [1] tests/test_a.py:12: not today
XFAIL tests/test_a.py::test_known - reason: bug 12
ERROR tests/test_a.py::test_err - RuntimeError: fixture broke
tests/test_b.py::test_verbose PASSED                                     [ 50%]
tests/test_b.py::test_verbose_fail FAILED                                [100%]
========== 1 failed, 2 passed, 1 skipped, 1 xfailed, 1 error in 0.12s ==========
"""


def test_parse_log_pytest_reads_summary_and_verbose_lines():
    assert parse_log_pytest(LOG) == {
        "tests/test_a.py::test_ok": "PASSED",
        "tests/test_a.py::test_param[1-2]": "PASSED",
        "tests/test_a.py::test_bad": "FAILED",
        "tests/test_a.py::test_known": "XFAIL",
        "tests/test_a.py::test_err": "ERROR",
        "tests/test_b.py::test_verbose": "PASSED",
        "tests/test_b.py::test_verbose_fail": "FAILED",
    }


def test_parser_on_a_real_pytest_log(tmp_path):
    (tmp_path / "test_real.py").write_text(
        "import pytest\n"
        "def test_pass(): pass\n"
        "def test_fail(): assert 1 == 2\n"
        "@pytest.mark.skip(reason='no')\ndef test_skip(): pass\n"
        "@pytest.mark.xfail\ndef test_xfail(): assert 0\n"
        "@pytest.fixture\ndef broken(): raise RuntimeError('x')\n"
        "def test_error(broken): pass\n"
        "@pytest.mark.parametrize('n', [1, 2])\ndef test_param(n): assert n == 1\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--no-header", "-rA", "--tb=no", "-p", "no:cacheprovider",
         "test_real.py"],
        cwd=tmp_path, capture_output=True, text=True,
        env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PATH": "/usr/bin:/bin"},
    ).stdout  # fmt: skip
    sm = parse_log_pytest(out)
    assert sm == {
        "test_real.py::test_pass": "PASSED",
        "test_real.py::test_fail": "FAILED",
        "test_real.py::test_xfail": "XFAIL",
        "test_real.py::test_error": "ERROR",
        "test_real.py::test_param[1]": "PASSED",
        "test_real.py::test_param[2]": "FAILED",
    }, out


def test_report_and_resolution_follow_swebench():
    sm = {"a": "PASSED", "b": "XFAIL", "c": "FAILED", "p": "PASSED", "q": "SKIPPED"}
    full = tests_report(sm, ["a", "b"], ["p", "q"])
    assert full["FAIL_TO_PASS"] == {"success": ["a", "b"], "failure": []}
    assert full["PASS_TO_PASS"] == {"success": ["p", "q"], "failure": []}
    assert resolution_status(full) is ResolvedStatus.FULL
    partial = tests_report(sm, ["a", "c"], ["p"])
    assert resolution_status(partial) is ResolvedStatus.PARTIAL
    missing = tests_report(sm, ["a", "not-run"], ["p"])  # absent from the log = failed
    assert missing["FAIL_TO_PASS"]["failure"] == ["not-run"]
    broken = tests_report(sm, ["a"], ["c"])
    assert resolution_status(broken) is ResolvedStatus.NO
    skipped_f2p = tests_report(sm, ["q"], [])  # a skipped FAIL_TO_PASS did not pass
    assert resolution_status(skipped_f2p) is ResolvedStatus.NO
