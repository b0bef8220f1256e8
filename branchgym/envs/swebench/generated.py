"""The generated task set: twelve tiny Python repositories, each with one real bug.

Every task is a real git repository built on first use (in the branchgym cache, a few
hundred milliseconds in all) with an issue text, a gold patch, a test patch, and the
FAIL_TO_PASS / PASS_TO_PASS lists, in SWE-bench's exact record format. So the whole
loop (edit, test, submit, grade) runs offline, in tests and demos. Each task also ships
a plausible *wrong* fix (it passes some new tests but not all, or breaks an old one),
so graders are tested against near misses as well as against an empty patch, and a
one-line ``fix_command`` that applies the gold fix from a shell, for scripted agents.

The sources are data files in ``generated_repos/`` (one folder per task: the repository
at its base commit, the test patch's files, the issue and the fixes; see
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
from pathlib import Path

from branchgym.envs.swebench.tasks import DEFAULT_TEST_CMD, SWEBenchTask, cache_root, load_tasks
from branchgym.error import DataError

__all__ = [
    "DATA_DIR",
    "TaskDef",
    "TASK_DEFS",
    "build_generated_tasks",
    "generated_tasks",
    "generated_repos",
    "load_task_defs",
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


#: The task sources, one folder each: ``issue.md``, ``base/`` (the repository at its base
#: commit), ``test_patch/`` (the test files the task's tests become) and ``task.json``
#: (the gold and wrong fixes as ``[path, old, new]`` replacements, FAIL_TO_PASS and
#: PASS_TO_PASS); ``tasks.json`` gives their order.
DATA_DIR = Path(__file__).with_name("generated_repos")


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


def _write(repo: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = repo / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def _diff_of(repo: Path, files: dict[str, str]) -> str:
    """The git diff that turns the base commit into ``files`` (then back to base)."""
    _write(repo, files)
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
    _write(repo, files)
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
    tasks_file = root / "tasks.jsonl"
    if tasks_file.exists():
        return tasks_file
    if shutil.which("git") is None:
        raise DataError("the generated SWE-bench tasks need git; install it (apt-get install git)")
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{root}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent test processes build it once
        if tasks_file.exists():
            return tasks_file
        tmp = root.with_name(f"{root.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        records = [_build_one(td, tmp / "repos") for td in TASK_DEFS]
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
