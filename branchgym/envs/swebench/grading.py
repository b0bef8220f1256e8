"""SWE-bench grading: apply the patch, run the instance's eval script, grade the log upstream's way.

A branchgym reward means what a SWE-bench "resolved" means because the ``swebench``
package grades it (:mod:`~branchgym.envs.swebench.harness` wraps the package; see
docs/swebench.md, "Grading"):

1. In a fresh sandbox at ``base_commit``, apply the model patch as upstream's
   ``run_instance`` does (its ``GIT_APPLY_CMDS`` in order, the tree reset between
   attempts, then ``git apply --check --reverse`` for a patch already in place); if none
   works the patch "failed to apply" and the instance is not resolved.
2. Run the instance's eval script (the package's ``TestSpec.eval_script``: reset the test
   files, apply the test patch, run the repository's test command between the
   ``>>>>> Start Test Output`` / ``>>>>> End Test Output`` markers, record its exit code).
3. Grade the log with the package's ``get_logs_eval`` / ``get_eval_report``: the
   repository's log parser (Django's ``test_x (module.Class) ... ok``, Sympy's, pytest's
   ``-rA`` summary, ``parse_log_pytest_options`` for requests / pylint / pydicom, ...),
   ``FAIL_TO_PASS`` passed (PASSED or XFAIL), ``PASS_TO_PASS`` maintained (or SKIPPED);
   a log without both markers, or whose exit code contradicts it, is not resolved.
4. A run past its timeout is not resolved (upstream never grades it).

With ``guard=True`` (the env's ``harness_guard``, its default) a patch that changes how
the tests run is refused after it applies (:mod:`~branchgym.envs.swebench.guard`), and
a pytest log is trusted only where pytest's own reports, recorded by branchgym's plugin,
confirm it (:mod:`~branchgym.envs.swebench.outcomes`); see docs/swebench.md, "Reward hacks".
"""

from __future__ import annotations

import dataclasses
import enum
import re
import shlex
import uuid
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from branchgym.envs.swebench import harness
from branchgym.envs.swebench.tasks import SWEBenchTask

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

#: Upstream's markers (``swebench.harness.constants``), kept here so importing this module
#: does not import the package.
START_TEST_OUTPUT = ">>>>> Start Test Output"
END_TEST_OUTPUT = ">>>>> End Test Output"
FAIL_TO_PASS = "FAIL_TO_PASS"
PASS_TO_PASS = "PASS_TO_PASS"


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
    :func:`grade` does not use it: it grades with the package's parser for the repository.
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


def tests_report(
    status_map: Mapping[str, str], fail_to_pass: Iterable[str], pass_to_pass: Iterable[str]
) -> dict[str, dict[str, list[str]]]:
    """Success and failure lists of FAIL_TO_PASS and PASS_TO_PASS.

    Upstream's ``get_eval_tests_report`` (pass-and-fail grading).
    """
    from swebench.harness.grading import get_eval_tests_report

    gold = {FAIL_TO_PASS: list(fail_to_pass), PASS_TO_PASS: list(pass_to_pass)}
    report = get_eval_tests_report(dict(status_map), gold)
    return {k: report[k] for k in (FAIL_TO_PASS, PASS_TO_PASS)}


tests_report.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


def resolution_status(report: Mapping[str, Mapping[str, list[str]]]) -> ResolvedStatus:
    """FULL when all FAIL_TO_PASS and PASS_TO_PASS succeed; PARTIAL; NO.

    Upstream's ``get_resolution_status``.
    """
    from swebench.harness.grading import get_resolution_status

    return ResolvedStatus(get_resolution_status(dict(report)))


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
        test_log: The eval script's whole output (upstream's ``test_output.txt``).
        rejected: Why the patch is not resolved whatever the log says (``harness_guard``):
            a file that changes how the tests run (refused before they run), or a log
            that pytest's own reports contradict or that ended early.
        timed_out: The eval script ran past its timeout (upstream: not resolved).
        outcome_check: How the log's outcomes were checked: ``"pytest reports"`` (branchgym's
            recorder confirmed them), ``""`` (upstream grading, or not run), or why they
            could not be (``"not checked: ..."``).
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
    timed_out: bool = False
    outcome_check: str = ""

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
        if self.timed_out:
            return "Not resolved: the tests ran past the grading timeout."
        f, p = self.tests_status[FAIL_TO_PASS], self.tests_status[PASS_TO_PASS]
        counts = (
            f"FAIL_TO_PASS {len(f['success'])}/{len(f['success']) + len(f['failure'])} pass, "
            f"PASS_TO_PASS {len(p['success'])}/{len(p['success']) + len(p['failure'])} pass"
        )
        if self.resolved:
            return f"Resolved ({counts})."
        failing = (f["failure"] + p["failure"])[:5]
        return f"Not resolved ({counts}); failing: {', '.join(failing)}."


#: File names that pytest loads (or Python runs at start-up) before any test. The
#: harness guard checks far more (:mod:`~branchgym.envs.swebench.guard`); this list
#: is the quick check of a patch's text alone.
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
    """What the test command is given (upstream's ``get_test_directives``).

    See :func:`~branchgym.envs.swebench.harness.test_directives`.
    """
    return harness.test_directives(task)


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
    """Apply ``patch`` as upstream's ``run_instance`` does; returns (applied, log).

    Each of upstream's ``GIT_APPLY_CMDS`` in turn, the tree reset to the base between attempts
    (a failed ``--reject`` leaves partial state), then ``git apply --check --reverse``
    (a patch that is already in place counts as applied). The patch file sits in the
    work tree (sandboxes write only there), kept out of the reset and removed after.
    """
    from swebench.harness.run_evaluation import GIT_APPLY_CMDS

    name = f".branchgym-model-{uuid.uuid4().hex[:8]}.patch"
    sandbox.write(f"{sandbox.workdir}/{name}", patch.encode())
    q = shlex.quote(name)
    lines = []
    for n, cmd in enumerate(GIT_APPLY_CMDS):
        if n:
            lines.append(f"git checkout -- . >/dev/null 2>&1; git clean -fdq -e {q}")
        lines.append(f"if {cmd} {q}; then rm -f {q}; exit 0; fi")
        lines.append(f"echo {shlex.quote('Failed to apply patch: ' + cmd)}")
    lines.append(f"if git apply --check --reverse {q}; then rm -f {q}; exit 0; fi")
    lines.append(f"rm -f {q}; exit 1")
    res = sandbox.exec("\n".join(lines), cwd=sandbox.workdir, timeout=timeout)
    return res.exit_code == 0, res.text


def run_eval(
    sandbox: Sandbox, task: SWEBenchTask, *, timeout: float = 600.0
) -> tuple[dict[str, str], str]:
    """Run ``task``'s eval script in ``sandbox``; returns (status map, log).

    The status map is what the package's log parser reads between the markers ({} for a
    log upstream would not grade: no markers, an error marker, a timeout). The sandbox
    is modified (test files reset and patched); pass a throwaway one.
    """
    spec = harness.test_spec(task, workdir=sandbox.workdir)
    log, timed_out = _run_spec(sandbox, spec, timeout)
    return harness.grade_log(spec, log, timed_out=timed_out)[1], log


def _run_spec(
    sandbox: Sandbox, spec: Any, timeout: float, env: Mapping[str, str] | None = None
) -> tuple[str, bool]:
    res = sandbox.exec(spec.eval_script, cwd=sandbox.workdir, env=env, timeout=timeout)
    log = res.text
    if res.timed_out:  # what upstream's run_instance writes to test_output.txt
        log += "\n\n" + harness.TIMEOUT_NOTE.format(timeout=f"{timeout:g}")
    return log, res.timed_out


def _base_env(sandbox: Sandbox) -> dict[str, str]:
    """The environment ``sandbox`` gives commands by default (its image's or its runner's)."""
    from branchgym.envs.swebench.sandbox import default_env

    own = getattr(sandbox, "default_env", None)
    return dict(own() if own is not None else default_env())


def grade(
    sandbox: Sandbox,
    task: SWEBenchTask,
    patch: str | None,
    *,
    timeout: float = 600.0,
    guard: bool = False,
) -> GradeReport:
    """Grade ``patch`` for ``task`` in ``sandbox``, a fresh sandbox at the base commit.

    Args:
        sandbox: Consumed: the patches are applied to it. Close it afterwards.
        task: The task (its test patch, test lists and repository's spec decide).
        patch: A unified diff (``None`` or blank = no patch).
        timeout: Seconds for the eval script (a run past it is not resolved).
        guard: Grade from trusted configuration only: refuse a patch that changes how
            the tests run (:func:`~branchgym.envs.swebench.guard.harness_problems`), and
            for pytest tasks accept the log only where pytest's own reports, recorded
            by branchgym's plugin, confirm it (:mod:`~branchgym.envs.swebench.outcomes`).
            ``False`` grades as upstream SWE-bench does (gameable: docs/swebench.md).
    """
    from branchgym.envs.swebench import guard as guard_mod
    from branchgym.envs.swebench import outcomes

    empty = {FAIL_TO_PASS: {"success": [], "failure": list(task.fail_to_pass)},
             PASS_TO_PASS: {"success": [], "failure": list(task.pass_to_pass)}}  # fmt: skip
    if patch is None or not patch.strip():
        return GradeReport(task.instance_id, False, False, False, ResolvedStatus.NO, empty, {})
    spec = harness.test_spec(task, workdir=sandbox.workdir)  # bad rows fail before running
    trust = None
    if guard and outcomes.uses_pytest(task):  # read at the base commit, before the patch
        trust = outcomes.trusted_sources(sandbox, task, patch, timeout=min(timeout, 120.0))
    applied, apply_log = _apply_model_patch(sandbox, patch, timeout=min(timeout, 120.0))
    if not applied:
        return GradeReport(
            task.instance_id, True, False, False, ResolvedStatus.NO, empty, {}, apply_log
        )
    env = None
    recorder = None
    check = ""
    if guard:
        problems = guard_mod.harness_problems(sandbox, task, patch)
        if problems:
            report = rejected_report(task, _refusal(problems))
            report.patch_applied = True
            report.apply_log = apply_log
            return report
        if trust is not None:
            recorder = outcomes.install(sandbox, trust)
            env = recorder.environment(_base_env(sandbox), sandbox.workdir)
        else:
            check = f"not checked: {harness.log_parser_name(task)} reads a runner other than pytest"
    log, timed_out = _run_spec(sandbox, spec, timeout, env)
    upstream, status_map = harness.grade_log(spec, log, patch=patch, timed_out=timed_out)
    tests_status = upstream.get("tests_status")
    if tests_status is None:  # not graded: no markers, an error marker, or a timeout
        status = ResolvedStatus.NO
        tests_status = empty
    else:
        tests_status = {k: tests_status[k] for k in (FAIL_TO_PASS, PASS_TO_PASS)}
        status = resolution_status(tests_status)
    resolved = bool(upstream["resolved"])
    rejected = ""
    if recorder is not None and not timed_out:
        from branchgym.error import SandboxError

        try:
            record = sandbox.read(recorder.report).decode("utf-8", "replace")
        except SandboxError as exc:
            record = ""
            rejected = f"the trusted outcome record is gone ({exc}): the test run removed it"
        if not rejected:
            rejected = outcomes.check(
                record, task, status_map, _parser(task, spec), key=recorder.key, trust=trust
            )
        check = "pytest reports" if not rejected else "pytest reports disagree"
        if rejected:
            resolved = False
            status = ResolvedStatus.NO
    return GradeReport(
        task.instance_id,
        True,
        True,
        resolved,
        status,
        tests_status,
        status_map,
        apply_log,
        log,
        rejected=rejected,
        timed_out=timed_out,
        outcome_check=check,
    )


def _refusal(problems: list[str]) -> str:
    shown = "; ".join(problems[:4])
    more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
    return (
        f"the patch changes how the tests run: {shown}{more}. Grading reads only the base "
        "commit's test configuration (harness_guard=False grades it as upstream does)"
    )


def _parser(task: SWEBenchTask, spec: Any) -> Any:
    """The repository's log parser as ``log -> status map``."""
    from swebench.harness.log_parsers import PARSER_REGISTRY

    func = PARSER_REGISTRY[harness.log_parser_name(task)]
    return lambda log: func(log, spec)
