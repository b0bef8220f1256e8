"""Trusted configuration at grading: the files of a patch that would change how the tests run.

The tests of a SWE-bench task decide its reward, so whatever decides how they run must
come from the base commit, as the test files themselves do (upstream's eval script
checks them out from ``base_commit`` before applying the test patch). Each route below
was read from pytest's and CPython's documentation and source (pytest 7.2 and 9.x, the
versions the shipped tasks run under; CPython 3.11); a patch that takes one is refused
before its tests run, and the refusal names the file and why (docs/swebench.md,
"Threat model"):

* pytest's configuration files, in every format pytest accepts (``pytest.toml``,
  ``.pytest.toml``, ``pytest.ini``, ``.pytest.ini``, ``pyproject.toml``'s
  ``[tool.pytest]`` and ``[tool.pytest.ini_options]``, ``tox.ini``'s ``[pytest]``,
  ``setup.cfg``'s ``[tool:pytest]``) in any folder, since pytest looks for them in every
  ancestor of its arguments: their ``addopts`` can load any importable module as a plugin
  (``-p``), override options (``-o``), move the rootdir or deselect tests;
* ``conftest.py`` anywhere (pytest loads those of every collected folder and their
  parents);
* interpreter start-up hooks: ``sitecustomize.py``, ``usercustomize.py``, ``*.pth``;
* compiled code: ``__pycache__``, ``*.pyc``, ``*.pyo`` (an unchecked-hash pyc replaces
  its source without looking at it), extension modules (``*.so``, ``*.pyd``, which take
  precedence over a ``.py`` of the same name);
* package metadata (``*.dist-info``, ``*.egg-info``, ``*.egg-link``): on ``sys.path``
  (the working directory is, under ``python -m pytest``) their ``pytest11`` entry points
  are plugins pytest loads unless autoloading is off;
* modules that shadow the standard library or the test runner (``pytest``, ``_pytest``,
  ``pluggy``, ...) where they would be found first: the repository's root (first on
  ``sys.path`` under ``python -m``), ``src/`` and the test files' folders;
* the test runner's own files, where the test command names them (Django's
  ``./tests/runtests.py`` and its ``--settings`` module, Sympy's ``bin/test``);
* the test folders themselves: files there that the test patch does not bring (helpers
  the tests import, ``__init__.py`` files that run at collection and change how pytest
  imports the tests), and an ``__init__.py`` added or removed on a test file's path;
* symbolic links that point outside the repository, or stand on a test file's path
  (a ``tests`` link to another folder keeps ``git checkout`` from restoring the tests);
* ``.gitattributes`` and ``.gitmodules`` (they change what ``git checkout`` and
  ``git apply`` write when the eval script restores and patches the test files);
* ``.pytest_cache`` (the state ``--lf`` and ``--sw`` select tests from).

Not routes, checked: pytest reads no ``.env`` file and CPython reads no file from the
working directory at start-up (``PYTHON*`` variables come only from the environment
the grader gives); ``setup.py`` and ``pyproject.toml``'s build settings do not run at
grading (environments are built from the pristine checkout).
"""

from __future__ import annotations

import configparser
import posixpath
import re
import shlex
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

import tomllib

from branchgym.envs.swebench.tasks import SWEBenchTask, diff_files

if TYPE_CHECKING:
    from branchgym.envs.swebench.sandbox import Sandbox

__all__ = [
    "CONFIG_FILES",
    "PROTECTED_MODULES",
    "patch_paths",
    "static_problems",
    "harness_problems",
]

#: pytest's configuration files by name -> the section pytest reads (None: the whole file).
CONFIG_FILES: dict[str, str | None] = {
    "pytest.toml": None,
    ".pytest.toml": None,
    "pytest.ini": None,
    ".pytest.ini": None,
    "pyproject.toml": "tool.pytest",
    "tox.ini": "pytest",
    "setup.cfg": "tool:pytest",
}

#: Top-level modules a patch may not add where they would be imported first: the
#: standard library, and pytest with what it imports.
PROTECTED_MODULES = frozenset(sys.stdlib_module_names) | {
    "pytest",
    "_pytest",
    "pluggy",
    "py",
    "iniconfig",
    "packaging",
    "exceptiongroup",
    "tomli",
    "colorama",
    "pygments",
    "attr",
    "attrs",
    "more_itertools",
    "setuptools",
    "pkg_resources",
    "_distutils_hack",
    "sitecustomize",
    "usercustomize",
}

_STARTUP = ("sitecustomize.py", "usercustomize.py")
_COMPILED = (".pyc", ".pyo", ".so", ".pyd")
_METADATA = (".dist-info", ".egg-info")
_GIT_FILES = (".gitattributes", ".gitmodules")
_HEADER = re.compile(
    r'^diff --git (?:"a/((?:[^"\\]|\\.)*)"|a/(.*?)) '
    r'(?:"b/((?:[^"\\]|\\.)*)"|b/(.*))$'
)


def _unquote(s: str) -> str:
    r"""A path as git C-quotes it (``"a/with\\ttab"``), back to the name."""
    if "\\" not in s:
        return s
    return (
        s.encode("latin-1", "backslashreplace")
        .decode("unicode_escape")
        .encode("latin-1")
        .decode("utf-8", "replace")
    )


def _side(word: str) -> str | None:
    """A ``---``/``+++`` path without its ``a/``/``b/`` prefix (None for /dev/null)."""
    word = word.split("\t", 1)[0].rstrip()
    if word.startswith('"') and word.endswith('"'):
        word = _unquote(word[1:-1])
    if word == "/dev/null":
        return None
    return word[2:] if word.startswith(("a/", "b/")) else word


def patch_paths(patch: str) -> dict[str, str]:
    """Every path ``patch`` touches -> its new mode (``""`` when not stated, ``"deleted"``).

    Read from git's headers (``diff --git``, renames, copies, modes) and from the
    ``---``/``+++`` lines that ``patch(1)``, upstream's last fallback, also reads.
    """
    out: dict[str, str] = {}
    current: list[str] = []
    for line in patch.splitlines():
        m = _HEADER.match(line)
        if m:
            a = _unquote(m.group(1)) if m.group(1) is not None else m.group(2)
            b = _unquote(m.group(3)) if m.group(3) is not None else m.group(4)
            current = [p for p in (a, b) if p]
            for p in current:
                out.setdefault(p, "")
            continue
        for key in ("rename from ", "rename to ", "copy from ", "copy to "):
            if line.startswith(key):
                p = _side(line[len(key) :])
                if p:
                    out.setdefault(p, "")
        if line.startswith(("--- ", "+++ ")):
            p = _side(line[4:])
            if p:
                out.setdefault(p, "")
        elif line.startswith(("new file mode ", "new mode ")) and current:
            out[current[-1]] = line.split()[-1]
        elif line.startswith("deleted file mode ") and current:
            out[current[0]] = "deleted"
    return {posixpath.normpath(p): mode for p, mode in out.items() if p}


def _test_dirs(task: SWEBenchTask) -> set[str]:
    """Folders holding a file of the test patch (``""`` for the root)."""
    return {posixpath.dirname(p) for p in diff_files(task.test_patch)}


def _ancestors(path: str) -> list[str]:
    """``a/b/c`` -> ``["", "a", "a/b"]``."""
    parts = path.split("/")[:-1]
    return ["/".join(parts[:i]) for i in range(len(parts) + 1)]


def _runner_files(task: SWEBenchTask) -> set[str]:
    """Files of the repository that the test command names (``./tests/runtests.py``).

    Django's ``--settings=test_sqlite`` names ``tests/test_sqlite.py``.
    """
    from branchgym.envs.swebench import harness

    out = set()
    for word in shlex.split(harness.test_cmd(task)):
        if "=" in word and not word.startswith("-"):
            continue  # VAR=value
        if word.startswith("--settings="):
            out.add(f"tests/{word.split('=', 1)[1].replace('.', '/')}.py")
        elif "/" in word and not word.startswith(("-", "/")):
            out.add(posixpath.normpath(word))
    return out


def static_problems(task: SWEBenchTask, patch: str, base_files: Iterable[str] = ()) -> list[str]:
    """What in ``patch`` alone takes a route into the test run: ``"path: why"`` each.

    Args:
        task: The task (its test patch names the test files and folders).
        patch: The submitted diff.
        base_files: The paths of the base commit (to tell added modules from the
            repository's own).
    """
    base = set(base_files)
    tests = set(diff_files(task.test_patch))
    runner = _runner_files(task)
    test_dirs = _test_dirs(task) - {""}
    test_paths = {a for t in tests for a in _ancestors(t)} | tests
    roots = {"", "src"} | _test_dirs(task)
    problems: list[str] = []

    def refuse(path: str, why: str) -> None:
        problems.append(f"{path}: {why}")

    for path, mode in patch_paths(patch).items():
        parts = path.split("/")
        name = parts[-1]
        if path.startswith("../") or path.startswith("/") or ".git" in parts:
            refuse(path, "outside the work tree")
        elif mode == "120000":
            refuse(path, "a symbolic link (could lead outside the repository or over a test)")
        elif path in runner:
            refuse(path, "the test command runs it (the test runner itself)")
        elif name in CONFIG_FILES:
            continue  # compared section by section after the patch is applied
        elif name == "conftest.py":
            refuse(path, "a conftest.py runs before any test and can rewrite outcomes")
        elif name in _STARTUP or name.endswith(".pth"):
            refuse(path, "Python runs it at interpreter start-up")
        elif "__pycache__" in parts or name.endswith(_COMPILED):
            refuse(path, "compiled code runs in place of the sources, unreviewed")
        elif any(p.endswith(_METADATA) for p in parts) or name.endswith(".egg-link"):
            refuse(path, "package metadata on sys.path (its entry points are pytest plugins)")
        elif name in _GIT_FILES:
            refuse(path, "changes what git writes when the test files are restored")
        elif ".pytest_cache" in parts:
            refuse(path, "pytest's cache selects tests (--lf, --sw)")
        elif path in test_paths - tests:
            refuse(path, "stands on a test file's path")
        elif posixpath.dirname(path) in test_dirs and path not in tests:
            refuse(path, "a test folder's file the test patch does not bring (tests import it)")
        elif (
            name == "__init__.py"
            and posixpath.dirname(path) in test_paths
            and (path not in base or mode == "deleted")
        ):
            refuse(path, "adding or removing it changes how pytest imports the tests")
        else:
            for root in roots:
                prefix = f"{root}/" if root else ""
                if not path.startswith(prefix):
                    continue
                top = path[len(prefix) :].split("/")[0]
                module = top.split(".")[0]
                top_path = prefix + top
                new = top_path not in base and not any(b.startswith(top_path + "/") for b in base)
                if module in PROTECTED_MODULES and new:
                    refuse(
                        path,
                        f"module {module!r} would shadow the standard library or the test "
                        "runner (found first on sys.path)",
                    )
                    break
    return problems


def _section(text: str, name: str, section: str | None) -> str | None:
    """The part of a configuration file pytest reads, normalised (None: none there).

    Raises:
        ValueError: the file does not parse (pytest would fail on it, or read it
            another way).
    """
    if section is None:
        return text
    if name.endswith(".toml"):
        data = tomllib.loads(text)
        table = data.get("tool", {}).get("pytest")
        return None if table is None else repr(sorted(table.items()))
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.read_string(text)
    found = [s for s in parser.sections() if s.strip() in (section, "pytest")]
    if not found:
        return None
    return repr([(s, sorted(parser.items(s))) for s in found])


def _config_problem(path: str, old: str | None, new: str | None) -> str | None:
    name = posixpath.basename(path)
    section = CONFIG_FILES[name]
    what = "pytest's configuration" if section is None else f"its [{section}] settings"
    if section is None:
        if old != new:
            return f"{path}: pytest reads its options from it ({what} must come from the base)"
        return None
    try:
        before = None if old is None else _section(old, name, section)
    except (ValueError, configparser.Error):
        before = "unparsed"
    try:
        after = None if new is None else _section(new, name, section)
    except (ValueError, configparser.Error) as exc:
        return f"{path}: does not parse after the patch ({exc}); pytest reads it"
    if before != after:
        return f"{path}: the patch changes {what}, which decide how the tests run"
    return None


def harness_problems(sandbox: Sandbox, task: SWEBenchTask, patch: str) -> list[str]:
    """Routes ``patch`` takes into the test run, checked in ``sandbox`` after it applied.

    ``sandbox`` holds the base commit at ``HEAD`` with the patch applied to its work
    tree. Returns ``"path: why"`` for each file that would change how the tests run
    (empty: the run reads only trusted configuration).
    """
    from branchgym.error import SandboxError

    tests = diff_files(task.test_patch)
    on_path = sorted({a for t in tests for a in _ancestors(t) if a} | set(tests))
    script = "git ls-tree -r -z --name-only HEAD; printf '\\0--links--\\0'; "
    if on_path:
        script += (
            "for p in "
            + " ".join(shlex.quote(p) for p in on_path)
            + '; do if [ -L "$p" ]; then printf "%s\\0" "$p"; fi; done'
        )
    res = sandbox.exec(script, cwd=sandbox.workdir, timeout=120)
    listing, _, links = res.text.partition("\0--links--\0")
    base = [p for p in listing.split("\0") if p]
    problems = [f"{p}: a symbolic link on a test file's path" for p in links.split("\0") if p]
    problems += static_problems(task, patch, base)
    for path, mode in patch_paths(patch).items():
        if posixpath.basename(path) not in CONFIG_FILES:
            continue
        old = None
        if path in base:
            shown = sandbox.exec(
                f"git show HEAD:{shlex.quote(path)}", cwd=sandbox.workdir, timeout=60
            )
            old = shown.text if shown.exit_code == 0 else None
        try:
            new = None if mode == "deleted" else sandbox.read(path).decode("utf-8", "replace")
        except SandboxError:
            new = None  # not there after the patch (or a link out): compared as absent
        problem = _config_problem(path, old, new)
        if problem:
            problems.append(problem)
    return list(dict.fromkeys(problems))
