"""The ``swebench`` package (5.x) as branchgym's grader: test specs, eval scripts, log grading.

branchgym grades exactly as SWE-bench's harness does by calling the package, not by
re-implementing it (see docs/swebench.md, "Grading"):

* :func:`test_spec` builds the instance's ``TestSpec`` with
  ``swebench.harness.utils.make_test_spec`` (which also makes the eval script record the
  test command's exit status);
* the eval script it carries is run in a sandbox by :mod:`~branchgym.envs.swebench.grading`;
* :func:`grade_log` reads the log with ``swebench.harness.grading.get_logs_eval`` and
  ``get_eval_report`` (the repository's log parser from ``PARSER_REGISTRY``, upstream's
  verdicts, its refusal of logs without both output markers or with an error marker).

Where the package needs something branchgym must supply, this module supplies it and
nothing more:

* SWE-bench 5.x rows carry their own ``eval_script``, ``log_parser``, ``eval_type`` and
  ``image``; such rows are passed to ``make_test_spec`` unchanged. Classic rows
  (SWE-bench / Verified / Lite exports without those columns) and branchgym's shipped
  tasks get an eval script in the harness's layout (:func:`eval_script`): reset the test
  files, apply the test patch from a here-document, print the start marker, run the test
  command on the test directives, print the end marker, reset again; under
  ``set -uxo pipefail``, so the markers appear as bash's trace lines
  (``+ : '>>>>> Start Test Output'``). The environment is activated by the backend (the
  image's conda ``testbed`` or the task's virtual environment), so the script carries no
  ``conda activate`` lines.
* The package no longer ships per-repository test commands (5.x moved them into the
  rows); :data:`UPSTREAM_TEST_CMDS` holds those of the SWE-bench Python repositories as
  the 4.x harness defined them (``tests/runtests.py --verbosity 2 --settings=test_sqlite
  --parallel 1`` for Django, ``bin/test -C --verbose`` for Sympy, ``pytest -rA`` for
  most). The log parser always comes from the package (``MAP_REPO_TO_PARSER_*``), and an
  unknown repository (branchgym's shipped tasks) gets the documented default:
  ``parse_log_pytest`` with the task's ``test_cmd`` (pytest ``-rA``).
* A run that timed out is not resolved: upstream's ``run_instance`` appends
  ``Timeout error: N seconds exceeded.`` to the log and never grades it; so does
  :func:`grade_log` (``timed_out=True``, or a log that ends that way).
"""

from __future__ import annotations

import functools
import os
import re
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from branchgym.envs.swebench.tasks import DEFAULT_TEST_CMD, SWEBenchTask
from branchgym.error import DataError

if TYPE_CHECKING:
    from swebench.types import TestSpec

__all__ = [
    "UPSTREAM_TEST_CMDS",
    "DEFAULT_LOG_PARSER",
    "HEREDOC_DELIMITER",
    "TIMEOUT_NOTE",
    "log_parser_name",
    "eval_type",
    "test_cmd",
    "test_directives",
    "eval_script",
    "instance_record",
    "test_spec",
    "grade_log",
    "timed_out_log",
]

_PYTEST = "pytest -rA"
#: Test commands of the SWE-bench Python repositories, as the 4.x harness's
#: ``MAP_REPO_VERSION_TO_SPECS`` defined them (the 5.x package carries them in each
#: row's ``eval_script`` instead). Per-version exceptions are in ``_VERSION_TEST_CMDS``.
UPSTREAM_TEST_CMDS: Mapping[str, str] = {
    "astropy/astropy": _PYTEST,
    "django/django": "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1",
    "marshmallow-code/marshmallow": _PYTEST,
    "matplotlib/matplotlib": _PYTEST,
    "mwaskom/seaborn": "pytest --no-header -rA",
    "pallets/flask": _PYTEST,
    "psf/requests": _PYTEST,
    "pvlib/pvlib-python": _PYTEST,
    "pydata/xarray": _PYTEST,
    "pydicom/pydicom": _PYTEST,
    "pylint-dev/astroid": _PYTEST,
    "pylint-dev/pylint": _PYTEST,
    "pytest-dev/pytest": _PYTEST,
    "pyvista/pyvista": _PYTEST,
    "scikit-learn/scikit-learn": _PYTEST,
    "sphinx-doc/sphinx": "tox --current-env -epy39 -v --",
    "sqlfluff/sqlfluff": _PYTEST,
    "sympy/sympy": (
        "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose"
    ),
}
_ASTROPY_OLD = "pytest -rA -vv -o console_output_style=classic --tb=no"
_VERSION_TEST_CMDS: Mapping[tuple[str, str], str] = {
    ("django/django", "1.9"): "./tests/runtests.py --verbosity 2",
    **{
        ("astropy/astropy", v): _ASTROPY_OLD
        for v in ("0.1", "0.2", "0.3", "0.4", "1.1", "1.2", "1.3")
    },
}

#: The parser of repositories the package does not know (branchgym's shipped tasks).
DEFAULT_LOG_PARSER = "parse_log_pytest"
#: The here-document delimiter of upstream's eval scripts.
HEREDOC_DELIMITER = "EOF_114329324912"
#: What upstream's ``run_instance`` appends to the log of a run past its timeout.
TIMEOUT_NOTE = "Timeout error: {timeout} seconds exceeded."
_TIMEOUT_RE = re.compile(r"Timeout error: \S+ seconds exceeded\.\s*\Z")
_MODIFIED = re.compile(r"^--- a/(.*)$", re.MULTILINE)
_DIFF_B = re.compile(r"^diff --git a/.* b/(.*)$", re.MULTILINE)


@functools.cache
def _parser_map() -> dict[str, str]:
    """Repository -> parser name, from the package's per-language ``MAP_REPO_TO_PARSER_*``.

    Several names share one function (``parse_log_requests`` is ``parse_log_pytest_options``):
    the repository's own name is used when the registry has it, else the first one.
    """
    from swebench.harness import log_parsers
    from swebench.harness.log_parsers import c, go, java, javascript, php, python, ruby, rust

    names_of: dict[int, list[str]] = {}
    for name, func in log_parsers.PARSER_REGISTRY.items():
        names_of.setdefault(id(func), []).append(name)
    out: dict[str, str] = {}
    for mod in (python, javascript, c, go, java, php, ruby, rust):
        for attr, table in vars(mod).items():
            if not attr.startswith("MAP_REPO_TO_PARSER"):
                continue
            for repo, func in table.items():
                names = names_of.get(id(func))
                if names:
                    own = "parse_log_" + repo.split("/")[-1].replace("-", "_").replace(".", "_")
                    out.setdefault(repo, own if own in names else names[0])
    return out


def log_parser_name(task: SWEBenchTask) -> str:
    """The ``PARSER_REGISTRY`` name that reads ``task``'s logs.

    The row's own ``log_parser`` (5.x rows), else the package's parser for the repository,
    else :data:`DEFAULT_LOG_PARSER`.

    Raises:
        DataError: the row names a parser the package does not have.
    """
    from swebench.harness.log_parsers import PARSER_REGISTRY

    name = task.extra.get("log_parser") or _parser_map().get(task.repo, DEFAULT_LOG_PARSER)
    if name not in PARSER_REGISTRY:
        raise DataError(
            f"{task.instance_id}: log_parser {name!r} is not one of the swebench package's "
            f"parsers ({', '.join(sorted(PARSER_REGISTRY)[:6])}, ...); fix the row or upgrade "
            "the swebench extra (pip install 'branchgym[swebench]')."
        )
    return str(name)


def eval_type(task: SWEBenchTask) -> str:
    """``pass_and_fail``, or ``fail_only`` for the repositories upstream grades that way."""
    from swebench.harness.constants import FAIL_ONLY_REPOS, EvalType

    if task.extra.get("eval_type"):
        return str(EvalType(task.extra["eval_type"]).value)
    return (EvalType.FAIL_ONLY if task.repo in FAIL_ONLY_REPOS else EvalType.PASS_AND_FAIL).value


def test_cmd(task: SWEBenchTask) -> str:
    """The test command of ``task``.

    The row's own ``test_cmd``, else upstream's for the repository and version, else
    branchgym's default (:data:`~branchgym.envs.swebench.tasks.DEFAULT_TEST_CMD`).
    """
    if task.test_cmd != DEFAULT_TEST_CMD:
        return task.test_cmd
    return _VERSION_TEST_CMDS.get(
        (task.repo, task.version), UPSTREAM_TEST_CMDS.get(task.repo, DEFAULT_TEST_CMD)
    )


test_cmd.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


def test_directives(task: SWEBenchTask) -> list[str]:
    """What the test command is given: the test patch's files, data files excluded.

    As upstream's ``get_test_directives``: Django's runner takes dotted module labels
    (``tests/admin_views/test_forms.py`` -> ``admin_views.test_forms``).
    """
    from swebench.harness.constants import NON_TEST_EXTS

    found = _DIFF_B.findall(task.test_patch or "")
    directives = [d for d in found if not any(d.endswith(ext) for ext in NON_TEST_EXTS)]
    if task.repo == "django/django":
        out = []
        for d in directives:
            d = d[: -len(".py")] if d.endswith(".py") else d
            d = d[len("tests/") :] if d.startswith("tests/") else d
            out.append(d.replace("/", "."))
        directives = out
    return list(dict.fromkeys(directives))


test_directives.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


def eval_script(task: SWEBenchTask, *, workdir: str = "/testbed") -> str:
    """The eval script for ``task``: the row's own (5.x rows), else one in upstream's layout.

    Args:
        task: The instance.
        workdir: The repository's directory inside the sandbox.
    """
    own = task.extra.get("eval_script")
    if own:
        return str(own)
    import shlex

    from swebench.harness.constants import END_TEST_OUTPUT, START_TEST_OUTPUT

    base = shlex.quote(task.base_commit)
    files = " ".join(shlex.quote(f) for f in dict.fromkeys(_MODIFIED.findall(task.test_patch)))
    reset = f"git checkout {base} {files}" if files else ":"
    patch = task.test_patch if task.test_patch.endswith("\n") else task.test_patch + "\n"
    command = " ".join([test_cmd(task), *map(shlex.quote, test_directives(task))])
    lines = [
        "#!/bin/bash",
        "set -uxo pipefail",
        f"cd {shlex.quote(workdir)}",
        "git status",
        "git show",
        f"git -c core.fileMode=false diff {base}",
        reset,
        f"git apply -v - <<'{HEREDOC_DELIMITER}'\n{patch}{HEREDOC_DELIMITER}",
        f": '{START_TEST_OUTPUT}'",
        command,
        f": '{END_TEST_OUTPUT}'",
        reset,
    ]
    return "\n".join(lines) + "\n"


def instance_record(task: SWEBenchTask, *, workdir: str = "/testbed") -> dict[str, Any]:
    """The row ``make_test_spec`` reads: the task's record plus the columns 5.x rows carry."""
    rec = task.to_record()
    rec.update(
        image=str(task.extra.get("image") or ""),
        eval_script=eval_script(task, workdir=workdir),
        log_parser=log_parser_name(task),
        eval_type=eval_type(task),
    )
    return rec


def test_spec(task: SWEBenchTask, *, workdir: str = "/testbed") -> TestSpec:
    """The package's ``TestSpec`` for ``task`` (``make_test_spec`` on :func:`instance_record`)."""
    from swebench.harness.utils import make_test_spec

    return make_test_spec(instance_record(task, workdir=workdir))


test_spec.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


def timed_out_log(log: str) -> bool:
    """Whether ``log`` is one upstream marked as timed out (its note or its marker)."""
    from swebench.harness.constants import TESTS_TIMEOUT

    return bool(_TIMEOUT_RE.search(log)) or TESTS_TIMEOUT in log


def grade_log(
    spec: TestSpec,
    log: str,
    *,
    patch: str | None = "",
    timed_out: bool = False,
) -> tuple[dict[str, Any], dict[str, str]]:
    """Grade an eval-script log as upstream does.

    Args:
        spec: The instance's ``TestSpec`` (:func:`test_spec`).
        log: The eval script's output (``test_output.txt`` upstream).
        patch: The model patch (``None``: no patch, as upstream's ``patch_is_None``).
        timed_out: The run was killed at its timeout (also read from the log's note).

    Returns:
        ``(report, status_map)``: ``get_eval_report``'s entry for the instance (with
        ``tests_status`` when the log was graded) and the parsed status map.
    """
    from swebench.harness.grading import get_eval_report, get_logs_eval

    pred = {
        "instance_id": spec.instance_id,
        "model_patch": patch,
        "model_name_or_path": "branchgym",
    }
    if timed_out or timed_out_log(log):
        # Upstream raises EvaluationError for a timed-out run: no report, not resolved.
        return {
            "patch_is_None": patch is None,
            "patch_exists": patch is not None,
            "patch_successfully_applied": True,
            "resolved": False,
            "timed_out": True,
        }, {}
    fd, path = tempfile.mkstemp(prefix="branchgym-eval-", suffix=".log")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as f:
            f.write(log)
        status_map, _found = get_logs_eval(spec, path)
        report = get_eval_report(spec, pred, path, include_tests_status=True)
    finally:
        os.unlink(path)
    return report[spec.instance_id], status_map
