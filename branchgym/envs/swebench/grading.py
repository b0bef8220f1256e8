"""SWE-bench grading: apply the patch, apply the test patch, run the tests, parse the log.

This follows SWE-bench's harness (``swebench.harness.grading`` and its eval script) step
by step, so a branchgym reward means what a SWE-bench "resolved" means:

1. In a fresh sandbox at ``base_commit``, apply the model patch with ``git apply -v``,
   then ``git apply -v --reject``, then ``patch --batch --fuzz=5 -p1``; if none works the
   patch "failed to apply" and the instance is not resolved.
2. Reset the files the test patch touches to ``base_commit`` (new ones are removed),
   apply the test patch, and run the task's test command on those files.
3. Parse the log with the pytest log parser (:func:`parse_log_pytest`, the same line
   format as upstream's ``parse_log_pytest``: ``-rA`` summary lines such as
   ``PASSED tests/test_x.py::test_y`` or ``FAILED tests/test_x.py::test_z - Assert...``).
4. ``FAIL_TO_PASS`` tests succeed when PASSED or XFAIL; ``PASS_TO_PASS`` tests are
   maintained when PASSED, XFAIL or SKIPPED; a test missing from the log has failed.
   Resolved (``RESOLVED_FULL``) = every FAIL_TO_PASS succeeds and every PASS_TO_PASS is
   maintained; ``RESOLVED_PARTIAL`` = some but not all FAIL_TO_PASS, all PASS_TO_PASS.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import shlex
import uuid
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from branchgym.envs.swebench.tasks import SWEBenchTask, diff_files, new_files

if TYPE_CHECKING:
    from branchgym.envs.swebench.sandbox import Sandbox

__all__ = [
    "TestStatus",
    "ResolvedStatus",
    "GradeReport",
    "parse_log_pytest",
    "tests_report",
    "resolution_status",
    "grade",
    "run_eval",
    "working_tree_patch",
    "harness_files",
    "rejected_report",
    "HARNESS_NAMES",
    "test_directives",
    "START_TEST_OUTPUT",
    "END_TEST_OUTPUT",
]

START_TEST_OUTPUT = ">>>>> Start Test Output"
END_TEST_OUTPUT = ">>>>> End Test Output"
FAIL_TO_PASS = "FAIL_TO_PASS"
PASS_TO_PASS = "PASS_TO_PASS"

#: Files of a test patch that are data, not tests (upstream's ``NON_TEST_EXTS``).
NON_TEST_EXTS = (
    ".json",
    ".png",
    "csv",
    ".txt",
    ".md",
    ".jpg",
    ".jpeg",
    ".pkl",
    ".yml",
    ".yaml",
    ".toml",
)


class TestStatus(str, enum.Enum):
    """A test's outcome as pytest's ``-rA`` summary prints it."""

    __test__ = False  # not a pytest test class

    FAILED = "FAILED"
    PASSED = "PASSED"
    SKIPPED = "SKIPPED"
    ERROR = "ERROR"
    XFAIL = "XFAIL"


class ResolvedStatus(str, enum.Enum):
    """SWE-bench's resolution levels."""

    FULL = "RESOLVED_FULL"
    PARTIAL = "RESOLVED_PARTIAL"
    NO = "RESOLVED_NO"


_STATUS = "|".join(s.value for s in TestStatus)
_STATUS_FIRST = re.compile(rf"^({_STATUS})\s+(\S+)")
# Verbose lines name a node id (with "::"), which keeps section headers such as
# "____ ERROR at setup of test_x ____" out of the map.
_TEST_FIRST = re.compile(rf"^(\S+::\S*)\s+({_STATUS})(?:\s|$)")
_SKIP_COUNT = re.compile(r"\[\d+\]")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def parse_log_pytest(log: str) -> dict[str, str]:
    """Map each test id in a pytest log to its status (``PASSED``, ``FAILED``, ...).

    Reads both the ``-rA`` short summary (``STATUS test_id [- message]``) and verbose
    lines (``test_id STATUS [NN%]``); a later line for the same test wins, as upstream.
    Summary lines of skipped counts (``SKIPPED [2] tests/x.py:10: reason``) are not tests.
    Colour codes and carriage returns are removed first (upstream's v2 parser does so).
    """
    status_map: dict[str, str] = {}
    for raw in log.split("\n"):
        line = _ANSI.sub("", raw).replace("\r", "")
        m = _STATUS_FIRST.match(line)
        if m:
            status, test = m.groups()
            if status == TestStatus.FAILED.value:
                # "FAILED tests/x.py::t - AssertionError": the id is the second word.
                test = line.replace(" - ", " ").split()[1]
            if status == TestStatus.SKIPPED.value and _SKIP_COUNT.match(test):
                continue
            status_map[test] = status
            continue
        m = _TEST_FIRST.match(line)
        if m:
            test, status = m.groups()
            status_map[test] = status
    return status_map


def _passed(test: str, sm: Mapping[str, str]) -> bool:
    return sm.get(test) in (TestStatus.PASSED.value, TestStatus.XFAIL.value)


def _maintained(test: str, sm: Mapping[str, str]) -> bool:
    return _passed(test, sm) or sm.get(test) == TestStatus.SKIPPED.value


def tests_report(
    status_map: Mapping[str, str], fail_to_pass: Iterable[str], pass_to_pass: Iterable[str]
) -> dict[str, dict[str, list[str]]]:
    """Success and failure lists of FAIL_TO_PASS and PASS_TO_PASS, as upstream reports them."""
    report: dict[str, dict[str, list[str]]] = {
        FAIL_TO_PASS: {"success": [], "failure": []},
        PASS_TO_PASS: {"success": [], "failure": []},
    }
    for t in fail_to_pass:
        report[FAIL_TO_PASS]["success" if _passed(t, status_map) else "failure"].append(t)
    for t in pass_to_pass:
        report[PASS_TO_PASS]["success" if _maintained(t, status_map) else "failure"].append(t)
    return report


tests_report.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


def _rate(part: Mapping[str, list[str]]) -> float:
    total = len(part["success"]) + len(part["failure"])
    return 1.0 if total == 0 else len(part["success"]) / total


def resolution_status(report: Mapping[str, Mapping[str, list[str]]]) -> ResolvedStatus:
    """FULL when all FAIL_TO_PASS and PASS_TO_PASS succeed; PARTIAL; NO."""
    f2p, p2p = _rate(report[FAIL_TO_PASS]), _rate(report[PASS_TO_PASS])
    if f2p == 1 and p2p == 1:
        return ResolvedStatus.FULL
    if 0 < f2p < 1 and p2p == 1:
        return ResolvedStatus.PARTIAL
    return ResolvedStatus.NO


@dataclasses.dataclass
class GradeReport:
    """The outcome of grading one patch.

    Attributes:
        instance_id: The task.
        patch_exists: A non-empty patch was given.
        patch_applied: It applied to ``base_commit``.
        resolved: ``status`` is ``RESOLVED_FULL``.
        status: The resolution level.
        tests_status: FAIL_TO_PASS / PASS_TO_PASS success and failure lists.
        status_map: Every test the log mentions, with its status.
        apply_log: Output of the patch application.
        test_log: Output of the test run (between the start and end markers).
        rejected: Why the patch was refused without running (``harness_guard``), if it was.
    """

    instance_id: str
    patch_exists: bool
    patch_applied: bool
    resolved: bool
    status: ResolvedStatus
    tests_status: dict[str, dict[str, list[str]]]
    status_map: dict[str, str]
    apply_log: str = ""
    test_log: str = ""
    rejected: str = ""

    def to_swebench(self) -> dict[str, dict[str, Any]]:
        """The report in the shape of upstream's ``get_eval_report`` output."""
        return {
            self.instance_id: {
                "patch_is_None": not self.patch_exists,
                "patch_exists": self.patch_exists,
                "patch_successfully_applied": self.patch_applied,
                "resolved": self.resolved,
                "tests_status": self.tests_status,
            }
        }

    def summary(self) -> str:
        """One line for observations: resolved or not, and the counts."""
        if not self.patch_exists:
            return "Not resolved: the working tree has no changes (empty patch)."
        if self.rejected:
            return f"Not resolved: {self.rejected}."
        if not self.patch_applied:
            return "Not resolved: the patch does not apply to the base commit."
        f, p = self.tests_status[FAIL_TO_PASS], self.tests_status[PASS_TO_PASS]
        counts = (
            f"FAIL_TO_PASS {len(f['success'])}/{len(f['success']) + len(f['failure'])} pass, "
            f"PASS_TO_PASS {len(p['success'])}/{len(p['success']) + len(p['failure'])} pass"
        )
        if self.resolved:
            return f"Resolved ({counts})."
        failing = (f["failure"] + p["failure"])[:5]
        return f"Not resolved ({counts}); failing: {', '.join(failing)}."


#: File names a patch may not add or change under ``harness_guard``: pytest loads them
#: (or Python runs them at start-up) before any test, so they can rewrite outcomes.
HARNESS_NAMES = ("conftest.py", "pytest.ini", "sitecustomize.py", "usercustomize.py")


def harness_files(patch: str) -> list[str]:
    """Files of ``patch`` that belong to the test harness (see :data:`HARNESS_NAMES`, ``*.pth``)."""
    out = []
    for line in patch.splitlines():
        if not line.startswith(("diff --git ", "+++ ", "--- ", "rename to ", "copy to ")):
            continue
        for word in line.split()[1:]:
            name = word.rsplit("/", 1)[-1]
            if (name in HARNESS_NAMES or name.endswith(".pth")) and word not in out:
                path = word[2:] if word.startswith(("a/", "b/")) else word
                if path not in out and path != "/dev/null":
                    out.append(path)
    return out


def rejected_report(task: SWEBenchTask, reason: str) -> GradeReport:
    """A "not resolved" report for a patch refused before it ran (``reason`` says why)."""
    report = GradeReport(
        task.instance_id,
        True,
        False,
        False,
        ResolvedStatus.NO,
        {
            FAIL_TO_PASS: {"success": [], "failure": list(task.fail_to_pass)},
            PASS_TO_PASS: {"success": [], "failure": list(task.pass_to_pass)},
        },  # fmt: skip
        {},
        apply_log=f"refused: {reason}",
        rejected=reason,
    )
    return report


def test_directives(task: SWEBenchTask) -> list[str]:
    """Test files to run: those the test patch touches, data files excluded."""
    return [f for f in diff_files(task.test_patch) if not f.endswith(NON_TEST_EXTS)]


test_directives.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


def working_tree_patch(sandbox: Sandbox, base_commit: str, *, timeout: float = 120.0) -> str:
    """The diff from ``base_commit`` to the sandbox's working tree, untracked files included.

    ``base_commit`` is the commit the episode started from: the task's base commit, or in
    SWE-bench's images the image's ``HEAD`` at reset (``DockerSandbox.base_ref``: the base
    commit plus the image's setup commit, which must stay out of the submission: it is
    already in the image the patch is graded in).

    Like SWE-agent's submission (``git add -A; git diff --cached``), ignored files are
    left out. It uses a temporary index and object directory, so the repository's own
    index and object store are not touched: grading mid-episode changes no state.

    Raises:
        SandboxError: git failed (the agent removed or broke ``.git``); the message has
            git's output.
    """
    from branchgym.error import SandboxError

    script = (
        "set -e; t=$(mktemp -d); trap 'rm -rf \"$t\"' EXIT; "
        'objects=$(cd "$(git rev-parse --git-path objects)" && pwd); '
        'if [ -f .git/index ]; then cp .git/index "$t/index"; fi; mkdir "$t/objects"; '
        'export GIT_INDEX_FILE="$t/index" GIT_OBJECT_DIRECTORY="$t/objects" '
        'GIT_ALTERNATE_OBJECT_DIRECTORIES="$objects"; '
        'git add -A . 2>"$t/err" >/dev/null || { cat "$t/err"; exit 1; }; '
        "git -c core.quotepath=off diff --cached --binary --no-color --full-index "
        f'{base_commit} 2>"$t/err" || {{ cat "$t/err"; exit 1; }}'
    )
    res = sandbox.exec(script, cwd=sandbox.workdir, timeout=timeout)
    if res.exit_code != 0:
        raise SandboxError(
            "could not compute the working tree's diff against the base commit: " + res.text[-2000:]
        )
    return res.text


def _apply_model_patch(sandbox: Sandbox, patch: str, timeout: float) -> tuple[bool, str]:
    name = f".branchgym-model-{uuid.uuid4().hex[:8]}.patch"
    sandbox.write(f"{sandbox.workdir}/{name}", patch.encode())
    q = shlex.quote(name)
    script = (
        f"git apply -v {q} || git apply -v --reject {q} || patch --batch --fuzz=5 -p1 -i {q}; "
        f"rc=$?; rm -f {q}; exit $rc"
    )
    res = sandbox.exec(script, cwd=sandbox.workdir, timeout=timeout)
    return res.exit_code == 0, res.text


def run_eval(
    sandbox: Sandbox, task: SWEBenchTask, *, timeout: float = 600.0
) -> tuple[dict[str, str], str]:
    """Apply the test patch and run the tests in ``sandbox``; returns (status map, log).

    The sandbox is modified (test files reset and patched); pass a throwaway one.
    """
    modified = [f for f in diff_files(task.test_patch) if f not in new_files(task.test_patch)]
    created = new_files(task.test_patch)
    name = f".branchgym-test-{uuid.uuid4().hex[:8]}.patch"
    sandbox.write(f"{sandbox.workdir}/{name}", task.test_patch.encode())
    parts = []
    if modified:
        files = " ".join(map(shlex.quote, modified))
        parts.append(f"git checkout -q {shlex.quote(task.base_commit)} -- {files}")
    if created:
        parts.append("rm -f " + " ".join(map(shlex.quote, created)))
    parts.append(f"git apply -v {shlex.quote(name)}; rm -f {shlex.quote(name)}")
    directives = " ".join(map(shlex.quote, test_directives(task)))
    parts.append(f"echo {shlex.quote(START_TEST_OUTPUT)}")
    parts.append(f"{task.test_cmd} {directives}")
    parts.append(f"echo {shlex.quote(END_TEST_OUTPUT)}")
    res = sandbox.exec("\n".join(parts), cwd=sandbox.workdir, timeout=timeout)
    log = res.text
    if START_TEST_OUTPUT in log and END_TEST_OUTPUT in log:
        body = log.split(START_TEST_OUTPUT, 1)[1].split(END_TEST_OUTPUT, 1)[0]
    else:  # timed out or the test patch did not apply: parse what there is
        body = log
    return parse_log_pytest(body), log


def grade(
    sandbox: Sandbox, task: SWEBenchTask, patch: str | None, *, timeout: float = 600.0
) -> GradeReport:
    """Grade ``patch`` for ``task`` in ``sandbox``, a fresh sandbox at the base commit.

    Args:
        sandbox: Consumed: the patches are applied to it. Close it afterwards.
        task: The task (its test patch and test lists decide).
        patch: A unified diff (``None`` or blank = no patch).
        timeout: Seconds for the test run.
    """
    empty = {FAIL_TO_PASS: {"success": [], "failure": list(task.fail_to_pass)},
             PASS_TO_PASS: {"success": [], "failure": list(task.pass_to_pass)}}  # fmt: skip
    if patch is None or not patch.strip():
        return GradeReport(task.instance_id, False, False, False, ResolvedStatus.NO, empty, {})
    applied, apply_log = _apply_model_patch(sandbox, patch, timeout=min(timeout, 120.0))
    if not applied:
        return GradeReport(
            task.instance_id, True, False, False, ResolvedStatus.NO, empty, {}, apply_log
        )
    status_map, log = run_eval(sandbox, task, timeout=timeout)
    report = tests_report(status_map, task.fail_to_pass, task.pass_to_pass)
    status = resolution_status(report)
    return GradeReport(
        task.instance_id,
        True,
        True,
        status is ResolvedStatus.FULL,
        status,
        report,
        status_map,
        apply_log,
        log,
    )
