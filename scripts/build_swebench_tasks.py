"""Build the realistic SWE-bench task set from PyPI source distributions.

Reads the task specs in ``scripts/swebench_realistic/`` (one JSON file per project: which
sdist, which files to keep, and per task a mutation that breaks a real function, a
partial "wrong" fix, the test files and the issue text beside it as ``<project>-<n>.md``),
extracts each sdist, and for every task:

1. applies the mutation to the upstream sources (the bug);
2. runs the task's test files against the mutated sources: the tests that now fail are
   held back from the base commit (removed from the base's test files, function by
   function), and the upstream test files become the test patch;
3. runs the test files on the base with the test patch (before), with the gold patch
   (the mutation reverted: after) and with the wrong patch;
4. FAIL_TO_PASS = fail before and pass after; PASS_TO_PASS = pass both; the wrong patch
   must leave a FAIL_TO_PASS test failing or break a PASS_TO_PASS one; the base's own
   tests must pass.

The output is ``data/swebench-realistic/``: ``<project>/upstream/`` (the
trimmed sdist, licence included), ``<project>/<n>/`` per task (``base.json``: the base
commit as edits of upstream's files, ``issue.md``, ``task.json``) and ``tasks.json``;
``branchgym.envs.swebench.generated`` turns them into git repositories and SWE-bench rows.

Usage (the sdists downloaded first, PyPI reachable at setup time only)::

    pip download --no-deps --no-binary :all: -d /tmp/sdists six==1.16.0 ...  # see specs
    python scripts/build_swebench_tasks.py --sdists /tmp/sdists [--only six]
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from branchgym.envs.swebench.generated import file_edits, write_tree

ROOT = Path(__file__).resolve().parent.parent
SPECS = Path(__file__).resolve().parent / "swebench_realistic"
OUT = ROOT / "data" / "swebench-realistic"
TEST_CMD = "python3 -m pytest --no-header -rA --tb=no -p no:cacheprovider"
_STATUS = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", re.M)


def extract(sdist: Path, keep: list[str], drop: list[str]) -> dict[str, str]:
    """The sdist's files matching ``keep`` (and not ``drop``), top folder stripped."""
    out: dict[str, str] = {}
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            if not m.isfile():
                continue
            rel = m.name.split("/", 1)[1] if "/" in m.name else m.name
            if not any(fnmatch.fnmatch(rel, k) for k in keep):
                continue
            if any(fnmatch.fnmatch(rel, d) for d in drop):
                continue
            data = tar.extractfile(m).read()  # type: ignore[union-attr]
            out[rel] = data.decode("utf-8")
    return out


def replace(files: dict[str, str], edits: list[list[str]], what: str) -> dict[str, str]:
    """``files`` with each ``[path, old, new]`` edit applied (``old`` must occur once)."""
    out = dict(files)
    for path, old, new in edits:
        if out[path].count(old) != 1:
            raise SystemExit(f"{what}: {old!r} occurs {out[path].count(old)} times in {path}")
        out[path] = out[path].replace(old, new, 1)
    return out


def run_tests(files: dict[str, str], roots: list[str], tests: list[str]) -> dict[str, str]:
    """Status of each test id, running ``tests`` on a tree of ``files``."""
    with tempfile.TemporaryDirectory(prefix="branchgym-build-") as tmp:
        for rel, text in files.items():
            p = Path(tmp, rel)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
        env["PYTHONPATH"] = os.pathsep.join(str(Path(tmp, r)) for r in roots)
        argv = [sys.executable, *TEST_CMD.split()[1:], *tests]
        res = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, check=False)
    status = {m.group(2): m.group(1) for m in _STATUS.finditer(res.stdout)}
    if not status:
        raise SystemExit(f"no test results:\n{res.stdout[-3000:]}{res.stderr[-2000:]}")
    return status


def remove_tests(text: str, names: set[str]) -> str:
    """``text`` without the test functions or methods named in ``names`` (decorators too)."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    spans = []
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        for child in body if isinstance(body, list) else []:
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) and child.name in names:
                start = min([child.lineno, *(d.lineno for d in child.decorator_list)]) - 1
                spans.append((start, child.end_lineno, node, child))
    for start, end, parent, child in sorted(spans, key=lambda s: -s[0]):
        body = [c for c in parent.body if not isinstance(c, ast.Expr | ast.Pass)]
        if isinstance(parent, ast.ClassDef) and body == [child]:
            lines[start:end] = [" " * child.col_offset + "pass\n"]
        else:
            lines[start:end] = []
    return "".join(lines)


def test_name(test_id: str) -> str:
    """The function name of a pytest id (class and parameters dropped)."""
    return test_id.split("::")[-1].split("[")[0]


def build_task(project: dict, upstream: dict[str, str], task: dict, issue: str) -> dict:
    """Steps 1-4 of the module docstring for one task: its base files and task.json."""
    roots, tests = project["roots"], task["test_files"]
    where = f"{project['name']}-{task['number']}"
    buggy = replace(upstream, task["mutation"], f"{where} mutation")
    on_buggy = run_tests(buggy, roots, tests)
    clean = run_tests(upstream, roots, tests)
    broken = {
        t for t, s in on_buggy.items() if s in ("FAILED", "ERROR") and clean.get(t) == "PASSED"
    }
    if not broken:
        raise SystemExit(f"{where}: the mutation breaks no test")
    base = dict(buggy)
    by_file: dict[str, set[str]] = {}
    for t in broken:
        by_file.setdefault(t.split("::")[0], set()).add(test_name(t))
    for path, names in by_file.items():
        base[path] = remove_tests(base[path], names)
    # The harness runs the test patch's files only: the lists are computed on those.
    tests = [f for f in tests if base[f] != upstream[f]]
    on_buggy = run_tests(buggy, roots, tests)
    on_base = run_tests(base, roots, tests)
    bad = sorted(
        t for t, s in on_base.items() if s in ("FAILED", "ERROR") and clean.get(t) == "PASSED"
    )
    if bad:
        raise SystemExit(f"{where}: the base commit's own tests fail: {bad[:5]}")
    # Gold patch: the base's sources back to upstream; test patch: the upstream tests.
    fix = [[p, new, old] for p, old, new in task["mutation"]]
    if not all(new for _, _, new in task["mutation"]):
        raise SystemExit(f"{where}: a mutation must keep some context (its fix needs an anchor)")
    fixed = replace(buggy, fix, f"{where} fix")
    if fixed != upstream:
        raise SystemExit(f"{where}: the gold patch does not restore upstream's sources")
    wrong_files = replace(buggy, task["wrong"], f"{where} wrong")
    after = run_tests(fixed, roots, tests)
    wrong = run_tests(wrong_files, roots, tests)
    f2p = sorted(t for t in broken if after.get(t) == "PASSED")
    p2p = sorted(t for t, s in on_buggy.items() if s == "PASSED" and after.get(t) == "PASSED")
    resolved = all(wrong.get(t) == "PASSED" for t in f2p + p2p)
    if resolved:
        raise SystemExit(f"{where}: the wrong patch resolves the task")
    changed = {p: base[p] for p in base if base[p] != upstream.get(p)}
    return {
        "changed": changed,
        "meta": {
            "fix": fix,
            "wrong": task["wrong"],
            "test_files": tests,
            "fail_to_pass": f2p,
            "pass_to_pass": p2p,
            "created_at": task["created_at"],
            "hints_text": task.get("hints_text", ""),
        },
        "issue": issue,
    }


def main() -> None:
    """Build every project of the specs (or those of ``--only``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sdists", required=True, help="folder of the downloaded .tar.gz sdists")
    ap.add_argument("--only", nargs="*", help="projects to rebuild (default: all)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    out = Path(args.out)
    order = []
    for spec_file in sorted(SPECS.glob("*.json")):
        project = json.loads(spec_file.read_text())
        name = project["name"]
        order += [f"{name}/{t['number']}" for t in project["tasks"]]
        if args.only and name not in args.only:
            continue
        sdist = Path(args.sdists) / project["sdist"]
        upstream = extract(sdist, project["keep"], project.get("drop", []))
        shutil.rmtree(out / name, ignore_errors=True)
        write_tree(out / name / "upstream", upstream)
        info = {k: project[k] for k in ("repo", "version", "license", "sdist", "roots")}
        (out / name / "project.json").write_text(json.dumps(info, indent=2) + "\n")
        for task in project["tasks"]:
            issue = (SPECS / f"{name}-{task['number']}.md").read_text()
            built = build_task(project, upstream, task, issue)
            d = out / name / str(task["number"])
            edits = file_edits(upstream, built["changed"])
            (d / "base.json").write_text(json.dumps(edits, indent=1) + "\n")
            (d / "issue.md").write_text(built["issue"])
            (d / "task.json").write_text(json.dumps(built["meta"], indent=2) + "\n")
            m = built["meta"]
            print(
                f"{name}-{task['number']}: FAIL_TO_PASS {len(m['fail_to_pass'])}, "
                f"PASS_TO_PASS {len(m['pass_to_pass'])}, files {sorted(built['changed'])}"
            )
    (out / "tasks.json").write_text(json.dumps({"order": order}, indent=2) + "\n")


if __name__ == "__main__":
    main()
