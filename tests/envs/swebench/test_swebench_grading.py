"""Grading through the swebench package: recorded logs of four repositories, real sandboxes.

The logs under data/logs/ are genuine eval-script output of Django's, Sympy's and
pytest's runners (data/logs/README.md says how each was recorded); the verdicts asserted
here are the package's (``get_eval_report``), in the styles the issue named: Django,
Sympy, pytest (marshmallow), pytest-options (requests).
"""

import dataclasses
import json
from pathlib import Path

import pytest

from branchgym.envs.swebench import harness
from branchgym.envs.swebench.grading import ResolvedStatus, grade
from branchgym.envs.swebench.tasks import DEFAULT_TEST_CMD, parse_task
from branchgym.error import DataError

LOGS = Path(__file__).parent / "data" / "logs"

# (instance, parser the package picks for the repository, wrong patch's upstream status)
RECORDED = [
    ("django__django-get-text-list", "parse_log_django", ResolvedStatus.NO),
    ("sympy__sympy-is-palindromic", "parse_log_sympy", ResolvedStatus.NO),
    ("psf__requests-case-insensitive-eq", "parse_log_requests", ResolvedStatus.NO),
    (
        "marshmallow-code__marshmallow-is-collection",
        "parse_log_marshmallow",
        ResolvedStatus.PARTIAL,
    ),
]


def _recorded(instance_id):
    row = json.loads((LOGS / instance_id / "instance.json").read_text())
    task = parse_task(row)
    return row, task, harness.test_spec(task, workdir=row["recorded_workdir"])


def _status(report):
    from swebench.harness.grading import get_resolution_status

    return ResolvedStatus(get_resolution_status(report["tests_status"]))


@pytest.mark.parametrize(("instance_id", "parser", "wrong_status"), RECORDED)
def test_recorded_logs_grade_as_upstream(instance_id, parser, wrong_status):
    row, task, spec = _recorded(instance_id)
    assert spec.log_parser == parser
    gold_log = (LOGS / instance_id / "gold.log").read_text()
    # The log is the output of this very eval script: its trace has the script's test
    # command on the instance's directives, between upstream's markers.
    command = harness.test_cmd(task).split()[-1]
    body = gold_log.split("+ : '>>>>> Start Test Output'")[1].split(">>>>> End Test Output")[0]
    assert command in body and all(d in body for d in harness.test_directives(task))
    assert command in spec.eval_script and ">>>>> Test Exit Code" in gold_log

    gold, status_map = harness.grade_log(spec, gold_log, patch=row["patch"])
    assert gold["resolved"] and _status(gold) is ResolvedStatus.FULL
    assert set(task.fail_to_pass) <= set(status_map)
    assert gold["tests_status"]["FAIL_TO_PASS"]["success"] == list(task.fail_to_pass)

    wrong_log = (LOGS / instance_id / "wrong.log").read_text()
    wrong, _ = harness.grade_log(spec, wrong_log, patch=row["model_patches"]["wrong"])
    assert wrong["patch_successfully_applied"] and not wrong["resolved"]
    assert _status(wrong) is wrong_status
    assert wrong["tests_status"]["FAIL_TO_PASS"]["failure"]


def test_the_pytest_parser_of_old_reads_django_and_sympy_logs_as_nothing():
    """The bug the package fixes: one pytest parser for every repository."""
    from branchgym.envs.swebench.grading import parse_log_pytest

    for instance_id in ("django__django-get-text-list", "sympy__sympy-is-palindromic"):
        body = (LOGS / instance_id / "gold.log").read_text().split(">>>>> Start Test Output")[1]
        assert parse_log_pytest(body) == {}


def test_sympy_last_test_of_a_file_is_invisible_to_its_parser():
    """Upstream's Sympy parser reads "test_x ok", not "test_x ok   [OK]" (a file's last test).

    The recorded instance lists only tests the parser sees, as upstream's validation does.
    """
    row, task, spec = _recorded("sympy__sympy-is-palindromic")
    log = (LOGS / row["instance_id"] / "gold.log").read_text()
    assert "test_is_palindromic ok" in log and "[OK]" in log
    _, status_map = harness.grade_log(spec, log)
    assert "test_is_palindromic" not in status_map
    assert status_map["test_is_palindromic_bases"] == "PASSED"


def test_a_timed_out_run_is_not_resolved_even_if_its_tests_passed():
    row, task, spec = _recorded("django__django-get-text-list")
    log = (LOGS / row["instance_id"] / "timeout.log").read_text()
    assert harness.timed_out_log(log)
    # Every test the instance names printed "ok" before the run was killed ...
    from swebench.harness.log_parsers import PARSER_REGISTRY

    partial = PARSER_REGISTRY[spec.log_parser](log, spec)
    assert all(partial[t] == "PASSED" for t in (*task.fail_to_pass, *task.pass_to_pass))
    # ... but upstream does not grade a timed-out run ...
    report, status_map = harness.grade_log(spec, log, patch=row["model_patches"]["timeout"])
    assert not report["resolved"] and report["timed_out"] and status_map == {}
    # ... and without the note the log still has no end marker: not graded either.
    bare = log.rsplit("Timeout error:", 1)[0]
    assert not harness.timed_out_log(bare)
    report, _ = harness.grade_log(spec, bare, patch="x")
    assert not report["resolved"] and not report["patch_successfully_applied"]


def test_specs_come_from_the_package_and_the_row():
    _, django, _ = _recorded("django__django-get-text-list")
    assert harness.test_directives(django) == ["utils_tests.test_text"]
    assert harness.test_cmd(django).startswith("./tests/runtests.py --verbosity 2")
    assert harness.test_cmd(dataclasses.replace(django, version="1.9")) == (
        "./tests/runtests.py --verbosity 2"
    )
    _, sympy, _ = _recorded("sympy__sympy-is-palindromic")
    assert "bin/test -C --verbose" in harness.test_cmd(sympy)
    # A repository the package does not know: branchgym's default, pytest -rA.
    mine = dataclasses.replace(sympy, repo="someone/tool", extra={})
    assert harness.test_cmd(mine) == DEFAULT_TEST_CMD
    assert harness.log_parser_name(mine) == "parse_log_pytest"
    assert harness.eval_type(mine) == "pass_and_fail"
    # A 5.x row carries its own script, parser and grading type: used as they are.
    own = "\n".join(
        ["#!/bin/bash", "set -uxo pipefail", ": '>>>>> Start Test Output'", "make check"]
        + [": '>>>>> End Test Output'", ""]
    )
    row5 = dataclasses.replace(
        mine, extra={"eval_script": own, "log_parser": "parse_log_gotest", "eval_type": "fail_only"}
    )
    spec = harness.test_spec(row5)
    assert spec.log_parser == "parse_log_gotest" and spec.eval_type == "fail_only"
    assert "make check" in spec.eval_script and "SWEBENCH_TEST_EXIT_CODE=$?" in spec.eval_script
    with pytest.raises(DataError, match="log_parser"):
        harness.test_spec(dataclasses.replace(mine, extra={"log_parser": "parse_log_nothing"}))


@pytest.fixture
def fresh(overlay_backend, task_by_name, checkout):
    made = []

    def make(task):
        sb = overlay_backend.create(task, checkout(task))
        made.append(sb)
        return sb

    yield make
    for sb in made:
        sb.close()


def test_grade_in_a_real_sandbox_runs_the_eval_script(fresh, task_by_name):
    task = task_by_name["textstats"]
    gold = grade(fresh(task), task, task.patch, timeout=120)
    assert gold.resolved and gold.status is ResolvedStatus.FULL and not gold.timed_out
    assert "+ : '>>>>> Start Test Output'" in gold.test_log
    assert ">>>>> Test Exit Code: 0" in gold.test_log
    assert all(gold.status_map[t] == "PASSED" for t in task.fail_to_pass)
    wrong = grade(fresh(task), task, task.extra["branchgym_wrong_patch"], timeout=120)
    assert wrong.patch_applied and not wrong.resolved
    assert ">>>>> Test Exit Code: 1" in wrong.test_log


def test_grade_in_a_real_sandbox_times_out_unresolved(fresh, task_by_name):
    task = task_by_name["textstats"]
    slow = dataclasses.replace(task, test_cmd="sleep 30; " + DEFAULT_TEST_CMD)
    report = grade(fresh(slow), slow, task.patch, timeout=3)
    assert report.patch_applied and report.timed_out and not report.resolved
    assert "Timeout error: 3 seconds exceeded." in report.test_log
    assert "timeout" in report.summary()


def test_patches_apply_through_upstreams_fallback_chain(fresh, task_by_name):
    """A patch whose context drifted fails `git apply` but `patch --fuzz=5` takes it."""
    task = task_by_name["textstats"]
    drifted = "\n".join(
        line.replace(" def words(text):", " def words(txt):")
        for line in task.patch.splitlines()
        if not line.startswith("index ")
    )
    assert drifted != task.patch
    report = grade(fresh(task), task, drifted + "\n", timeout=120)
    assert report.patch_applied and report.resolved
    assert "Failed to apply patch: git apply --verbose --reject" in report.apply_log
    garbage = grade(
        fresh(task), task, "diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n"
    )
    assert not garbage.patch_applied and not garbage.resolved
    assert garbage.apply_log.count("Failed to apply patch") == 4
