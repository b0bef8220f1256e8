"""The generated task set: twelve tiny Python repositories, each with one real bug.

Every task is a real git repository built on first use (in the branchgym cache, a few
hundred milliseconds in all) with an issue text, a gold patch, a test patch, and the
FAIL_TO_PASS / PASS_TO_PASS lists, in SWE-bench's exact record format. So the whole
loop (edit, test, submit, grade) runs offline, in tests and demos. Each task also ships
a plausible *wrong* fix (it passes some new tests but not all, or breaks an old one),
so graders are tested against near misses as well as against an empty patch, and a
one-line ``fix_command`` that applies the gold fix from a shell, for scripted agents.

The sources are data files in ``data/swebench-generated/`` (one folder per task: the
repository at its base commit, the test patch's files, the issue and the fixes; see
:data:`DATA_DIR`); :func:`build_generated_tasks` turns them into repos with deterministic
commits (fixed author and dates), so ``base_commit`` is the same on every machine.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from branchgym.envs.swebench.tasks import (
    DEFAULT_TEST_CMD,
    SWEBenchTask,
    cache_folder,
    cache_root,
    load_tasks,
)
from branchgym.error import DataError

__all__ = [
    "SHIPPED_DATA",
    "DATA_DIR",
    "TaskDef",
    "TASK_DEFS",
    "build_generated_tasks",
    "generated_tasks",
    "generated_repos",
    "load_task_defs",
    "REALISTIC_DIR",
    "RealisticTaskDef",
    "load_realistic_defs",
    "file_edits",
    "write_tree",
    "apply_edits",
    "build_realistic_tasks",
    "realistic_tasks",
    "realistic_repos",
    "TASK_SETS",
    "task_set",
]

#: Bump when the build procedure changes (the cache key includes it).
FORMAT_VERSION = 3

_GITIGNORE = "__pycache__/\n*.pyc\n.pytest_cache/\n"


@dataclasses.dataclass(frozen=True)
class TaskDef:
    """The source of one generated task.

    Attributes:
        name: Package name; the repository is ``branchgym/<name>``.
        issue: The problem statement.
        files: Repository files at the base commit.
        fix: ``(path, old, new)`` replacements that make the gold patch.
        wrong: Replacements of a plausible but wrong fix.
        tests: New content of test files (the test patch).
        fail_to_pass: Test ids that fail before the fix and pass after.
        pass_to_pass: Test ids that pass before and after.
    """

    name: str
    issue: str
    files: dict[str, str]
    fix: tuple[tuple[str, str, str], ...]
    wrong: tuple[tuple[str, str, str], ...]
    tests: dict[str, str]
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]

    @property
    def instance_id(self) -> str:
        """``branchgym__<name>-1``, SWE-bench's ``owner__name-number`` form."""
        return f"branchgym__{self.name}-1"

    def fixed_files(self, which: str = "fix") -> dict[str, str]:
        """The files the gold (or ``wrong``) fix produces."""
        out = {}
        for path, old, new in getattr(self, which):
            text = out.get(path, self.files[path])
            if old not in text:
                raise DataError(f"{self.name}: fix text not found in {path}: {old!r}")
            out[path] = text.replace(old, new, 1)
        return out

    @property
    def fix_command(self) -> str:
        """One shell line that applies the gold fix (from any working directory)."""
        # One physical line (no newline even inside the quotes), so it can be typed or
        # piped line by line, as `branchgym play` reads its input.
        code = (
            "import pathlib; [pathlib.Path(p).write_text(pathlib.Path(p).read_text()"
            f".replace(a, b, 1)) for p, a, b in {[list(r) for r in self.fix]!r}]"
        )
        return "cd /testbed && python3 -c " + shlex.quote(code)


_PACKAGE = Path(__file__).resolve().parents[2]  # branchgym/
#: The shipped data: the checkout's top-level ``data/``, which the wheel installs as
#: ``branchgym/data/`` (pyproject's package-dir maps one onto the other).
SHIPPED_DATA = next(
    (p for p in (_PACKAGE / "data", _PACKAGE.parent / "data") if p.is_dir()), _PACKAGE / "data"
)

#: The task sources, one folder each: ``issue.md``, ``base/`` (the repository at its base
#: commit), ``test_patch/`` (the test files the task's tests become) and ``task.json``
#: (the gold and wrong fixes as ``[path, old, new]`` replacements, FAIL_TO_PASS and
#: PASS_TO_PASS); ``tasks.json`` gives their order.
DATA_DIR = SHIPPED_DATA / "swebench-generated"


def _read_tree(folder: Path) -> dict[str, str]:
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            with open(path, encoding="utf-8", newline="") as f:
                out[path.relative_to(folder).as_posix()] = f.read()
    return out


def load_task_defs(folder: str | os.PathLike[str] = DATA_DIR) -> tuple[TaskDef, ...]:
    """Read task sources from ``folder`` (the shipped twelve by default).

    Raises:
        DataError: a task folder misses a file or its ``task.json`` a key; the message
            names the file.
    """
    folder = Path(folder)
    try:
        order = json.loads((folder / "tasks.json").read_text())["order"]
    except (OSError, ValueError, KeyError) as exc:
        raise DataError(
            f"{folder}/tasks.json must list the task folders as {{'order': [...]}}: {exc}"
        ) from exc
    defs = []
    for name in order:
        d = folder / name
        try:
            meta = json.loads((d / "task.json").read_text())
            with open(d / "issue.md", encoding="utf-8", newline="") as f:
                issue = f.read()
            defs.append(
                TaskDef(
                    name=name,
                    issue=issue,
                    files=_read_tree(d / "base"),
                    fix=tuple(tuple(r) for r in meta["fix"]),
                    wrong=tuple(tuple(r) for r in meta["wrong"]),
                    tests=_read_tree(d / "test_patch"),
                    fail_to_pass=tuple(meta["fail_to_pass"]),
                    pass_to_pass=tuple(meta["pass_to_pass"]),
                )
            )
        except (OSError, ValueError, KeyError) as exc:
            raise DataError(
                f"generated task {name!r} in {d} is incomplete ({exc}); it needs issue.md, "
                "base/, test_patch/ and task.json with fix, wrong, fail_to_pass, pass_to_pass"
            ) from exc
        if not defs[-1].files or not defs[-1].tests:
            raise DataError(f"generated task {name!r}: {d}/base and {d}/test_patch must hold files")
    return tuple(defs)


TASK_DEFS: tuple[TaskDef, ...] = load_task_defs()


# ------------------------------------------------------------------------ building

_GIT_ID = {
    "GIT_AUTHOR_NAME": "branchgym",
    "GIT_AUTHOR_EMAIL": "tasks@branchgym.invalid",
    "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "branchgym",
    "GIT_COMMITTER_EMAIL": "tasks@branchgym.invalid",
    "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+0000",
}


def _git(repo: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(_GIT_ID, GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL="/dev/null", LC_ALL="C")
    out = subprocess.run(
        ["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise DataError(f"git {' '.join(args)} failed in {repo}: {out.stderr.strip()}")
    return out.stdout


def write_tree(folder: Path, files: dict[str, str]) -> None:
    """Write ``files`` (relative path -> text) under ``folder``, byte for byte (UTF-8)."""
    for rel, text in files.items():
        p = folder / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "w", encoding="utf-8", newline="") as f:
            f.write(text)


def _diff_of(repo: Path, files: dict[str, str]) -> str:
    """The git diff that turns the base commit into ``files`` (then back to base)."""
    write_tree(repo, files)
    _git(repo, "add", "-A")
    diff = _git(repo, "diff", "--cached", "--no-color", "--full-index", "HEAD")
    _git(repo, "reset", "-q", "--hard", "HEAD")
    return diff


def _build_one(td: TaskDef, repos: Path) -> dict:
    repo = repos / f"branchgym__{td.name}"
    repo.mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    files = {
        "README.md": f"# {td.name}\n\nA small library (a branchgym generated task).\n",
        ".gitignore": _GITIGNORE,
        **td.files,
    }
    write_tree(repo, files)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", f"{td.name}: initial version")
    base = _git(repo, "rev-parse", "HEAD").strip()
    task = SWEBenchTask(
        instance_id=td.instance_id,
        repo=f"branchgym/{td.name}",
        base_commit=base,
        problem_statement=td.issue,
        patch=_diff_of(repo, td.fixed_files("fix")),
        test_patch=_diff_of(repo, td.tests),
        fail_to_pass=td.fail_to_pass,
        pass_to_pass=td.pass_to_pass,
        version="1.0",
        environment_setup_commit=base,
        # The tiny repos need no pytest plugins, and autoloading whatever plugins the
        # interpreter has installed (hypothesis, ...) would triple their test time.
        test_cmd=f"PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 {DEFAULT_TEST_CMD}",
        extra={
            "created_at": "2024-01-01T00:00:00Z",
            "branchgym_wrong_patch": _diff_of(repo, td.fixed_files("wrong")),
            "branchgym_fix_command": td.fix_command,
        },
    )
    return task.to_record()


def _fingerprint() -> str:
    blob = json.dumps([FORMAT_VERSION, [dataclasses.astuple(t) for t in TASK_DEFS]], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def build_generated_tasks(dest: str | os.PathLike[str] | None = None) -> Path:
    """Build the generated repositories and their ``tasks.jsonl`` (once; cached).

    Args:
        dest: Folder to build in (default: ``<cache>/swebench/generated-<fingerprint>``).

    Returns:
        The path of ``tasks.jsonl``; the repositories are in ``repos/`` beside it.
    """
    root = Path(dest) if dest else cache_root() / "swebench" / f"generated-{_fingerprint()}"
    return _build_once(root, "generated", lambda repos: [_build_one(td, repos) for td in TASK_DEFS])


def _build_once(root: Path, name: str, build: Callable[[Path], list[dict]]) -> Path:
    """``root/tasks.jsonl`` from ``build(repos_folder)``, built once under a lock."""
    tasks_file = root / "tasks.jsonl"
    if tasks_file.exists():
        return tasks_file
    if shutil.which("git") is None:
        raise DataError(f"the {name} SWE-bench tasks need git; install it (apt-get install git)")
    cache_folder(root.parent)
    with open(f"{root}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent test processes build it once
        if tasks_file.exists():
            return tasks_file
        tmp = root.with_name(f"{root.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        records = build(tmp / "repos")
        (tmp / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        shutil.rmtree(root, ignore_errors=True)
        os.rename(tmp, root)
    return tasks_file


def generated_tasks() -> list[SWEBenchTask]:
    """The generated task set (built on first use)."""
    return load_tasks(build_generated_tasks())


def generated_repos() -> Path:
    """The ``repos_dir`` holding the generated repositories."""
    return build_generated_tasks().parent / "repos"


# ------------------------------------------------------------------ realistic tasks

#: The realistic task set's data (the output of ``scripts/build_swebench_tasks.py``): per
#: project ``<project>/upstream/`` (its PyPI sdist, trimmed, licence included) and
#: ``project.json`` (repository, version, licence, source roots), and per task
#: ``<project>/<n>/`` with ``base.json`` (the base commit as ``[path, old, new]`` edits of
#: upstream's files: the broken function, the held-back tests removed; see
#: :func:`file_edits`), ``issue.md`` and ``task.json`` (gold and wrong
#: fixes as ``[path, old, new]`` replacements, the test files, FAIL_TO_PASS and
#: PASS_TO_PASS as computed by running the suite); ``tasks.json`` gives their order.
REALISTIC_DIR = SHIPPED_DATA / "swebench-realistic"

#: How the realistic tasks run their tests (upstream's pytest command; test files appended).
REALISTIC_TEST_CMD = f"PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 {DEFAULT_TEST_CMD}"


@dataclasses.dataclass(frozen=True)
class RealisticTaskDef:
    """One realistic task: a real project with one of its functions broken.

    Attributes:
        project: Folder name of the project (``six``).
        number: The task's number within the project (``owner__name-<number>``).
        repo: ``owner/name`` of the upstream repository.
        version: The project's version (``major.minor``, as SWE-bench keys environments).
        license: The project's licence (its text ships in ``upstream/``).
        upstream: The project's files (the sdist, trimmed).
        base: The files the base commit changes (their full text).
        issue: The problem statement.
        fix: ``(path, old, new)`` replacements of the gold patch (on the base).
        wrong: Replacements of a plausible but wrong fix.
        test_files: The test files of the test patch (upstream's versions).
        fail_to_pass: Tests that fail at the base commit and pass after the fix.
        pass_to_pass: Tests that pass before and after.
        created_at: The task's date (SWE-bench's ``created_at``).
        hints_text: Hints (empty unless the spec gives some).
    """

    project: str
    number: int
    repo: str
    version: str
    license: str
    upstream: dict[str, str]
    base: dict[str, str]
    issue: str
    fix: tuple[tuple[str, str, str], ...]
    wrong: tuple[tuple[str, str, str], ...]
    test_files: tuple[str, ...]
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    created_at: str
    hints_text: str = ""

    @property
    def instance_id(self) -> str:
        """``owner__name-<number>``, SWE-bench's form."""
        return f"{self.repo.replace('/', '__')}-{self.number}"

    def base_files(self) -> dict[str, str]:
        """The repository at the base commit."""
        return {**self.upstream, **self.base}

    def fixed_files(self, which: str = "fix") -> dict[str, str]:
        """The files the gold (or ``wrong``) fix changes, as they become."""
        files = self.base_files()
        out: dict[str, str] = {}
        for path, old, new in getattr(self, which):
            text = out.get(path, files[path])
            if old not in text:
                raise DataError(f"{self.instance_id}: fix text not found in {path}: {old!r}")
            out[path] = text.replace(old, new, 1)
        return out

    @property
    def fix_command(self) -> str:
        """One shell line that applies the gold fix (from any working directory)."""
        return TaskDef.fix_command.fget(self)  # type: ignore[attr-defined]


def file_edits(old: dict[str, str], new: dict[str, str]) -> list[list[str]]:
    """``[path, before, after]`` replacements that turn ``old``'s files into ``new``'s.

    A task's base differs from upstream by a few lines (the broken function, the held-back
    tests), so it ships as these edits instead of a second copy of each file. Each edit
    replaces a run of whole lines, with just enough unchanged lines around it that
    ``before`` occurs exactly once in the file as it is when the edit applies (edits of a
    file apply in order): :func:`apply_edits` checks that and gives back ``new`` exactly.
    Every path of ``new`` must be in ``old``.
    """
    import difflib

    edits: list[list[str]] = []
    for path in sorted(new):
        if path not in old:
            raise DataError(f"{path}: a base edit needs the file in upstream's tree")
        a = old[path].splitlines(keepends=True)
        b = new[path].splitlines(keepends=True)
        cur = list(a)
        delta = 0
        matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag == "equal":
                continue
            s, e = i1 + delta, i2 + delta
            text = "".join(cur)
            for c in range(len(cur) + 1):
                lo, hi = max(0, s - c), min(len(cur), e + c)
                before = "".join(cur[lo:hi])
                if before and text.count(before) == 1:
                    break
            after = "".join(cur[lo:s] + b[j1:j2] + cur[e:hi])
            edits.append([path, before, after])
            cur[lo:hi] = cur[lo:s] + b[j1:j2] + cur[e:hi]
            delta += (j2 - j1) - (i2 - i1)
        if "".join(cur) != new[path]:  # pragma: no cover - a bug here, not in the data
            raise DataError(f"{path}: the computed edits do not rebuild the file")
    return edits


def apply_edits(files: dict[str, str], edits: list[list[str]], where: str) -> dict[str, str]:
    """The files ``edits`` (from :func:`file_edits`) change, as they become.

    Raises:
        DataError: an edit's ``before`` text is not in its file exactly once.
    """
    out: dict[str, str] = {}
    for path, before, after in edits:
        text = out.get(path, files.get(path))
        if text is None or text.count(before) != 1:
            raise DataError(
                f"{where}: base edit of {path} does not apply (its text must occur exactly "
                "once); rebuild the task with scripts/build_swebench_tasks.py"
            )
        out[path] = text.replace(before, after, 1)
    return out


def load_realistic_defs(
    folder: str | os.PathLike[str] = REALISTIC_DIR,
) -> tuple[RealisticTaskDef, ...]:
    """Read the realistic task set from ``folder`` (the shipped one by default).

    Raises:
        DataError: a file is missing or malformed; the message names it.
    """
    folder = Path(folder)
    try:
        order = json.loads((folder / "tasks.json").read_text())["order"]
    except (OSError, ValueError, KeyError) as exc:
        raise DataError(
            f"{folder}/tasks.json must list the tasks as {{'order': ['project/n', ...]}}: {exc}"
        ) from exc
    projects: dict[str, tuple[dict, dict[str, str]]] = {}
    defs = []
    for entry in order:
        name, _, number = entry.partition("/")
        d = folder / name / number
        try:
            if name not in projects:
                info = json.loads((folder / name / "project.json").read_text())
                projects[name] = (info, _read_tree(folder / name / "upstream"))
            info, upstream = projects[name]
            meta = json.loads((d / "task.json").read_text())
            with open(d / "issue.md", encoding="utf-8", newline="") as f:
                issue = f.read()
            defs.append(
                RealisticTaskDef(
                    project=name,
                    number=int(number),
                    repo=info["repo"],
                    version=info["version"],
                    license=info["license"],
                    upstream=upstream,
                    base=apply_edits(upstream, json.loads((d / "base.json").read_text()), str(d)),
                    issue=issue,
                    fix=tuple(tuple(r) for r in meta["fix"]),
                    wrong=tuple(tuple(r) for r in meta["wrong"]),
                    test_files=tuple(meta["test_files"]),
                    fail_to_pass=tuple(meta["fail_to_pass"]),
                    pass_to_pass=tuple(meta["pass_to_pass"]),
                    created_at=meta["created_at"],
                    hints_text=meta.get("hints_text", ""),
                )
            )
        except (OSError, ValueError, KeyError) as exc:
            raise DataError(
                f"realistic task {entry!r} in {folder} is incomplete ({exc}); it needs "
                f"{name}/project.json, {name}/upstream/, and {entry}/ with issue.md, base.json and "
                "task.json (fix, wrong, test_files, fail_to_pass, pass_to_pass, created_at)"
            ) from exc
    return tuple(defs)


def _realistic_fingerprint(defs: tuple[RealisticTaskDef, ...]) -> str:
    h = hashlib.sha256(json.dumps([FORMAT_VERSION, REALISTIC_TEST_CMD, 2]).encode())
    for td in defs:
        h.update(json.dumps(dataclasses.astuple(td), sort_keys=True).encode())
    return h.hexdigest()[:12]


def _build_realistic(defs: tuple[RealisticTaskDef, ...], repos: Path) -> list[dict]:
    records = []
    made: set[str] = set()
    for td in defs:
        repo = repos / td.repo.replace("/", "__")
        if td.repo not in made:
            repo.mkdir(parents=True)
            _git(repo, "init", "-q", "-b", "main")
            write_tree(repo, {".gitignore": _GITIGNORE, **td.upstream})
            _git(repo, "add", "-A")
            _git(repo, "commit", "-q", "-m", f"{td.project} {td.version} (upstream sdist)")
            made.add(td.repo)
        # Each task's history is its own: a root commit with the base tree (no commit
        # holds the working function the agent could read the fix from), then an empty
        # base commit, so `git show` (the eval script prints it) stays a few lines.
        _git(repo, "checkout", "-q", "--orphan", f"task-{td.number}", "main")
        _git(repo, "rm", "-rq", "--cached", ".")
        write_tree(repo, {".gitignore": _GITIGNORE, **td.base_files()})
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", f"Import {td.project} {td.version}")
        _git(repo, "commit", "-q", "--allow-empty", "-m", f"Start {td.instance_id}")
        base = _git(repo, "rev-parse", "HEAD").strip()
        upstream_tests = {p: td.upstream[p] for p in td.test_files}
        task = SWEBenchTask(
            instance_id=td.instance_id,
            repo=td.repo,
            base_commit=base,
            problem_statement=td.issue,
            patch=_diff_of(repo, td.fixed_files("fix")),
            test_patch=_diff_of(repo, upstream_tests),
            fail_to_pass=td.fail_to_pass,
            pass_to_pass=td.pass_to_pass,
            version=td.version,
            environment_setup_commit=base,
            test_cmd=REALISTIC_TEST_CMD,
            hints_text=td.hints_text,
            extra={
                "created_at": td.created_at,
                "branchgym_wrong_patch": _diff_of(repo, td.fixed_files("wrong")),
                "branchgym_fix_command": td.fix_command,
                "branchgym_license": td.license,
            },
        )
        records.append(task.to_record())
        _git(repo, "checkout", "-q", "-f", "main")
        _git(repo, "clean", "-qfdx")
    return records


def build_realistic_tasks(dest: str | os.PathLike[str] | None = None) -> Path:
    """Build the realistic task set's repositories and ``tasks.jsonl`` (once; cached).

    One git repository per project (``repos/owner__name``, upstream's sources on
    ``main``), one root commit per task (its base commit, branch ``task-<n>``).

    Args:
        dest: Folder to build in (default: ``<cache>/swebench/realistic-<fingerprint>``).

    Returns:
        The path of ``tasks.jsonl``; the repositories are in ``repos/`` beside it.
    """
    defs = load_realistic_defs()
    root = (
        Path(dest)
        if dest
        else cache_root() / "swebench" / f"realistic-{_realistic_fingerprint(defs)}"
    )
    return _build_once(root, "realistic", lambda repos: _build_realistic(defs, repos))


def realistic_tasks() -> list[SWEBenchTask]:
    """The realistic task set (built on first use)."""
    return load_tasks(build_realistic_tasks())


def realistic_repos() -> Path:
    """The ``repos_dir`` holding the realistic task set's repositories."""
    return build_realistic_tasks().parent / "repos"


#: The shipped task sets by name: each gives the path of its ``tasks.jsonl`` (the
#: repositories are in ``repos/`` beside it). ``SWEBenchEnv(tasks="realistic")`` and the
#: benchmarks' ``--task-set`` pick one.
TASK_SETS = {"generated": build_generated_tasks, "realistic": build_realistic_tasks}


def task_set(name: str) -> Path:
    """The ``tasks.jsonl`` of the shipped task set ``name`` (built on first use).

    Raises:
        DataError: no such set; the message lists them.
    """
    if name not in TASK_SETS:
        raise DataError(f"no task set {name!r}; the shipped sets are {', '.join(TASK_SETS)}")
    return TASK_SETS[name]()
