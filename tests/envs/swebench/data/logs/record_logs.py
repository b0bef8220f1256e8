"""Record the eval logs under this folder (see README.md); not run by the tests.

Usage (once, with network for the downloads; nothing here runs in CI)::

    pip download --no-deps --no-binary :all: django==5.2.8 sympy==1.12.1 \
        requests==2.32.5 marshmallow==3.26.1 -d SRC/sdists
    (cd SRC && for f in sdists/*.tar.gz; do tar xzf "$f"; done)
    python3 -m venv SRC/venv
    SRC/venv/bin/pip install pytest asgiref sqlparse mpmath urllib3 idna \
        charset_normalizer certifi
    for d in django-5.2.8 sympy-1.12.1 requests-2.32.5 marshmallow-3.26.1; do
        SRC/venv/bin/pip install --no-deps -e SRC/$d; done
    python tests/envs/swebench/data/logs/record_logs.py SRC

Each case turns an unpacked sdist into a git repository (commit 1: the sdist as
released; commit 2, the task's ``base_commit``: one real function broken), makes the
gold patch (the function restored), a wrong patch and a test patch (a test added to the
project's own test file), builds the instance's ``TestSpec`` with branchgym's
``harness.test_spec`` (the package's ``make_test_spec``), and for each patch does what
upstream's ``run_instance`` does: ``git apply --verbose`` the patch, run the spec's
``eval_script`` with ``bash``, keep stdout and stderr together as ``<name>.log``; a run
killed at its timeout gets upstream's ``Timeout error: N seconds exceeded.`` line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: sympy's ``bin/test`` and ``bin/get_sympy.py`` (from sympy's git repository; the sdist
#: leaves ``bin/`` out but SWE-bench's Sympy test command is ``bin/test -C --verbose``).
SYMPY_BIN_TEST = """#!/usr/bin/env python
import sys
import os
from optparse import OptionParser

from get_sympy import path_hack
path_hack()

parser = OptionParser()
parser.add_option("-v", "--verbose", action="store_true", dest="verbose",
        default=False)
parser.add_option("--pdb", action="store_true", dest="pdb",
        default=False, help="Run post mortem pdb on each failure")
parser.add_option("--no-colors", action="store_false", dest="colors",
        default=True, help="Do not report colored [OK] and [FAIL]")
parser.add_option("-k", dest="kw",
        help="only run tests matching the given keyword expression",
        metavar="KEYWORD", default="")
parser.add_option("--tb", dest="tb",
        help="traceback verboseness (short/no) [default: %default]",
        metavar="TBSTYLE", default="short")
parser.add_option("--random", action="store_false", dest="sort", default=True,
        help="Run tests in random order instead of sorting them")
parser.add_option("--seed", dest="seed", type="int",
        help="use this seed for randomised tests",
        metavar="SEED")
parser.add_option('-t', '--types', dest='types', action='store',
        default=None, choices=['gmpy', 'python', 'sympy'],
        help='setup ground types: gmpy | python | sympy')
parser.add_option('-C', '--no-cache', dest='cache', action='store_false',
        default=True, help='disable caching mechanism')
parser.add_option("--timeout", action="store", dest="timeout",
        default=False, help="Set a timeout for the all functions.", type='int')
parser.add_option("--slow", action="store_true", dest="slow",
        default=False, help="Run only the slow functions.")
parser.set_usage("test [options ...] [tests ...]")

options, args = parser.parse_args()

if not options.cache:
    os.environ['SYMPY_USE_CACHE'] = 'no'
if options.types:
    os.environ['SYMPY_GROUND_TYPES'] = options.types

import sympy

ok = sympy.test(*args, **{"verbose": options.verbose, "kw": options.kw,
    "tb": options.tb, "pdb": options.pdb, "colors": options.colors,
    "sort": options.sort, "seed": options.seed, "slow": options.slow,
    "timeout": options.timeout})

if ok:
    sys.exit(0)
else:
    sys.exit(1)
"""
SYMPY_GET_SYMPY = '''"""Functions to get the correct sympy version to run tests."""

import os
import sys

def path_hack():
    """
    Hack sys.path to import correct (local) sympy.
    """
    this_file = os.path.abspath(__file__)
    sympy_dir = os.path.join(os.path.dirname(this_file), "..")
    sympy_dir = os.path.normpath(sympy_dir)
    sys.path.insert(0, sympy_dir)
'''


@dataclasses.dataclass
class Case:
    instance_id: str
    repo: str
    version: str
    src: str  # unpacked sdist folder name
    path: str  # the source file the bug is in
    good: str  # the released text
    bad: str  # the bug (base_commit has it)
    wrong: str  # what the wrong patch puts in place of ``bad``
    test_path: str
    test_add: str  # added to the test file by the test patch (at its end, or before test_anchor)
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    problem: str
    hang: tuple[str, str, str] | None = None  # (path, old, new) added to gold for timeout.log
    extra_files: dict[str, str] = dataclasses.field(default_factory=dict)
    test_anchor: str = ""


DJ = "utils_tests.test_text.TestUtilsText"
CASES = [
    Case(
        instance_id="django__django-get-text-list",
        repo="django/django",
        version="5.2",
        src="django-5.2.8",
        path="django/utils/text.py",
        good="        str(last_word),\n        str(list_[-1]),",
        bad='        "or",\n        str(list_[-1]),',
        wrong='        "and",\n        str(list_[-1]),',
        test_path="tests/utils_tests/test_text.py",
        test_add=(
            "\n\nclass GetTextListLastWordTests(SimpleTestCase):\n"
            "    def test_last_word(self):\n"
            '        self.assertEqual(text.get_text_list(["a", "b"], "y"), "a y b")\n'
            '        self.assertEqual(text.get_text_list(["a", "b", "c"], "and"), "a, b and c")\n'
        ),
        fail_to_pass=[
            "test_last_word (utils_tests.test_text.GetTextListLastWordTests.test_last_word)",
            f"test_get_text_list ({DJ}.test_get_text_list)",
        ],
        pass_to_pass=[
            f"test_compress_sequence ({DJ}.test_compress_sequence)",
            f"test_format_lazy ({DJ}.test_format_lazy)",
            f"test_normalize_newlines ({DJ}.test_normalize_newlines)",
        ],
        problem="get_text_list() ignores its last_word argument: it always says 'or'.",
        hang=(
            "django/utils/text.py",
            '    return "".join(char2number.get(c, c) for c in phone.lower())',
            "    while phone:\n        pass\n"
            '    return "".join(char2number.get(c, c) for c in phone.lower())',
        ),
    ),
    Case(
        instance_id="sympy__sympy-is-palindromic",
        repo="sympy/sympy",
        version="1.12",
        src="sympy-1.12.1",
        path="sympy/ntheory/digits.py",
        good="    return _palindromic(digits(n, b), 1)",
        bad="    return _palindromic(digits(n, b), 0)",
        wrong="    return _palindromic(digits(n, 10), 1)",
        test_path="sympy/ntheory/tests/test_digits.py",
        # Not at the end: Sympy's runner prints the last test of a file as
        # "test_x ok    [OK]", which parse_log_sympy does not read (see README.md).
        test_anchor="def test_digits():",
        test_add=(
            "def test_is_palindromic_bases():\n"
            "    assert is_palindromic(5, 2)\n"
            "    assert is_palindromic(0o171, 8)\n"
            "    assert not is_palindromic(88, 8)\n"
            "\n\n"
        ),
        fail_to_pass=["test_is_palindromic_bases"],
        pass_to_pass=["test_digits", "test_count_digits"],
        problem="is_palindromic(11) is False: the base itself is compared as a digit.",
        extra_files={"bin/test": SYMPY_BIN_TEST, "bin/get_sympy.py": SYMPY_GET_SYMPY},
    ),
    Case(
        instance_id="psf__requests-case-insensitive-eq",
        repo="psf/requests",
        version="2.32",
        src="requests-2.32.5",
        path="src/requests/structures.py",
        good="        return dict(self.lower_items()) == dict(other.lower_items())",
        bad="        return dict(self.items()) == dict(other.items())",
        wrong="        return dict(self.lower_items()) == dict(other.items())",
        test_path="tests/test_structures.py",
        test_add=(
            "\n\n@pytest.mark.parametrize(\n"
            '    "other", ({"ACCEPT": "application/json"}, {"accept": "application/json"})\n'
            ")\n"
            "def test_equality_ignores_key_case(other):\n"
            '    assert CaseInsensitiveDict({"Accept": "application/json"}) == other\n'
        ),
        fail_to_pass=[
            "tests/test_structures.py::test_equality_ignores_key_case[other0]",
            "tests/test_structures.py::test_equality_ignores_key_case[other1]",
            "tests/test_structures.py::TestCaseInsensitiveDict::test_instance_equality[other0-True]",
        ],
        pass_to_pass=[
            "tests/test_structures.py::TestCaseInsensitiveDict::test_getitem[aCcEpT]",
            "tests/test_structures.py::TestCaseInsensitiveDict::test_copy",
            "tests/test_structures.py::TestCaseInsensitiveDict::test_instance_equality[None-False]",
            "tests/test_structures.py::TestLookupDict::test_repr",
        ],
        problem="CaseInsensitiveDict({'Accept': 'x'}) == {'ACCEPT': 'x'} is False.",
    ),
    Case(
        instance_id="marshmallow-code__marshmallow-is-collection",
        repo="marshmallow-code/marshmallow",
        version="3.26",
        src="marshmallow-3.26.1",
        path="src/marshmallow/utils.py",
        good="    return is_iterable_but_not_string(obj) and not isinstance(obj, Mapping)",
        bad="    return is_iterable_but_not_string(obj)",
        wrong="    return is_iterable_but_not_string(obj) and not isinstance(obj, dict)",
        test_path="tests/test_utils.py",
        test_add=(
            "\n\ndef test_is_collection_rejects_any_mapping():\n"
            "    import types\n\n"
            '    assert utils.is_collection(types.MappingProxyType({"a": 1})) is False\n'
        ),
        fail_to_pass=[
            "tests/test_utils.py::test_is_collection",
            "tests/test_utils.py::test_is_collection_rejects_any_mapping",
        ],
        pass_to_pass=[
            "tests/test_utils.py::test_is_keyed_tuple",
            "tests/test_utils.py::test_get_value_from_dict",
            "tests/test_utils.py::test_from_iso_date",
        ],
        problem="utils.is_collection({'foo': 'bar'}) is True; a mapping is not a collection.",
    ),
]

GIT = ["git", "-c", "user.name=recorder", "-c", "user.email=recorder@localhost"]


def git(root: Path, *args: str) -> str:
    return subprocess.run(
        [*GIT, *args], cwd=root, check=True, capture_output=True, text=True
    ).stdout


def replace(root: Path, path: str, old: str, new: str) -> None:
    p = root / path
    text = p.read_text()
    assert text.count(old) == 1, (path, old)  # noqa: S101 - a recording aid
    p.write_text(text.replace(old, new))


def diff_of(root: Path, edit) -> str:
    edit()
    out = git(root, "diff", "--no-color")
    git(root, "checkout", "-q", "--", ".")
    return out


def run_eval(root: Path, script: str, venv: Path, timeout: float) -> str:
    env = {
        "PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin",
        "HOME": tempfile.mkdtemp(),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
    }
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            ["bash", "-c", script],
            cwd=root,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            timed_out = True
        out.seek(0)
        log = out.read().decode("utf-8", errors="replace")
    if timed_out:  # what upstream's run_instance writes after a timed-out run
        log += f"\n\nTimeout error: {timeout:g} seconds exceeded."
    return log


def record(case: Case, src: Path, venv: Path) -> None:
    sys.path.insert(0, str(HERE.parents[4]))
    from branchgym.envs.swebench.harness import test_spec
    from branchgym.envs.swebench.tasks import parse_task

    root = src / case.src
    if not (root / ".git").exists():
        for rel, text in case.extra_files.items():
            (root / rel).write_text(text)
            (root / rel).chmod(0o755)
        git(root, "init", "-q")
        git(root, "add", "-A")
        git(root, "commit", "-q", "-m", "sdist as released")
        replace(root, case.path, case.good, case.bad)
        git(root, "commit", "-q", "-am", "the bug")
    base = git(root, "rev-parse", "HEAD").strip()
    git(root, "reset", "-q", "--hard", base)
    gold = diff_of(root, lambda: replace(root, case.path, case.bad, case.good))
    wrong = diff_of(root, lambda: replace(root, case.path, case.bad, case.wrong))

    def add_test() -> None:
        if case.test_anchor:
            replace(root, case.test_path, case.test_anchor, case.test_add + case.test_anchor)
        else:
            p = root / case.test_path
            p.write_text(p.read_text() + case.test_add)

    test_patch = diff_of(root, add_test)
    patches = {"gold": gold, "wrong": wrong}
    if case.hang:

        def hung() -> None:
            replace(root, case.path, case.bad, case.good)
            replace(root, *case.hang)

        patches["timeout"] = diff_of(root, hung)
    row = {
        "instance_id": case.instance_id,
        "repo": case.repo,
        "version": case.version,
        "base_commit": base,
        "problem_statement": case.problem,
        "patch": gold,
        "test_patch": test_patch,
        "FAIL_TO_PASS": json.dumps(case.fail_to_pass),
        "PASS_TO_PASS": json.dumps(case.pass_to_pass),
        "environment_setup_commit": base,
        "recorded_workdir": str(root),
        "model_patches": {k: v for k, v in patches.items() if k != "gold"},
    }
    spec = test_spec(parse_task(row), workdir=str(root))
    out = HERE / case.instance_id
    out.mkdir(exist_ok=True)
    (out / "instance.json").write_text(json.dumps(row, indent=1) + "\n")
    for name, patch in patches.items():
        git(root, "reset", "-q", "--hard", base)
        git(root, "clean", "-fdq")
        with tempfile.NamedTemporaryFile("w", suffix=".diff", delete=False) as f:
            f.write(patch)
        subprocess.run([*GIT, "apply", "--verbose", f.name], cwd=root, check=True)
        os.unlink(f.name)
        timeout = 15.0 if name == "timeout" else 600.0
        (out / f"{name}.log").write_text(run_eval(root, spec.eval_script, venv, timeout))
        print(case.instance_id, name, "recorded")
    git(root, "reset", "-q", "--hard", base)
    git(root, "clean", "-fdq")


def main() -> None:
    src = Path(sys.argv[1]).resolve()
    only = sys.argv[2:]
    for case in CASES:
        if not only or case.instance_id in only:
            record(case, src, src / "venv")


if __name__ == "__main__":
    main()
