"""SWE-bench task instances: the record format, loaders for task files, and repository checkouts.

A task is one row of SWE-bench (or SWE-bench Verified/Lite, or a SWE-Gym style export):
``instance_id, repo, base_commit, problem_statement, patch, test_patch, FAIL_TO_PASS,
PASS_TO_PASS, version, environment_setup_commit``. Upstream stores the two test lists
as JSON strings (``'["tests/test_a.py::test_x"]'``); the loaders accept that and plain
lists. Unknown keys are kept in :attr:`SWEBenchTask.extra`.

Repositories are never fetched: a task's repository comes from a local clone the user
gives (``repos_dir``), found as ``owner__name``, ``owner/name`` or ``name``. The
checkout at ``base_commit`` is cached under the branchgym cache and is the read-only
base layer every sandbox of that task starts from.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from branchgym.envs.swebench.sandbox import tree_digest
from branchgym.error import CacheLocationError, DataError

__all__ = [
    "SWEBenchTask",
    "load_tasks",
    "parse_task",
    "cache_root",
    "cache_folder",
    "find_repo",
    "ensure_checkout",
    "verify_checkout",
    "DEFAULT_TEST_CMD",
    "REQUIRED_FIELDS",
]

#: SWE-bench's default pytest command (``-rA`` prints the per-test summary the log
#: parser reads; ``--tb=no`` keeps logs short; no cache dir in the repository).
DEFAULT_TEST_CMD = "python3 -m pytest --no-header -rA --tb=no -p no:cacheprovider"

#: Fields every instance must have.
REQUIRED_FIELDS = (
    "instance_id",
    "repo",
    "base_commit",
    "problem_statement",
    "test_patch",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
)

_KNOWN = (
    *REQUIRED_FIELDS,
    "patch",
    "version",
    "environment_setup_commit",
    "hints_text",
    "test_cmd",
)


@dataclasses.dataclass(frozen=True)
class SWEBenchTask:
    """One SWE-bench task instance.

    Attributes:
        instance_id: Unique id, ``owner__name-number`` upstream.
        repo: ``owner/name`` of the repository.
        base_commit: The commit the agent starts from.
        problem_statement: The issue text shown to the agent.
        patch: The gold patch (a unified diff); may be empty for unlabeled tasks.
        test_patch: Diff adding the tests that decide resolution.
        fail_to_pass: Tests that fail at ``base_commit`` and must pass after a fix.
        pass_to_pass: Tests that pass before and must still pass.
        version: The repository version string (selects the test environment upstream).
        environment_setup_commit: Commit whose environment the tests run in.
        test_cmd: Command that runs the tests (the test files are appended).
        hints_text: Upstream's hints (comments before the fix), not shown by default.
        extra: Every other field of the record, unchanged.
    """

    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    patch: str
    test_patch: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    version: str = ""
    environment_setup_commit: str = ""
    test_cmd: str = DEFAULT_TEST_CMD
    hints_text: str = ""
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def test_files(self) -> list[str]:
        """Files the test patch touches (the test directives of SWE-bench's eval script)."""
        return diff_files(self.test_patch)

    def to_record(self) -> dict[str, Any]:
        """The upstream record (test lists as JSON strings), extras included."""
        rec = dict(self.extra)
        rec.update(
            instance_id=self.instance_id,
            repo=self.repo,
            base_commit=self.base_commit,
            problem_statement=self.problem_statement,
            patch=self.patch,
            test_patch=self.test_patch,
            FAIL_TO_PASS=json.dumps(list(self.fail_to_pass)),
            PASS_TO_PASS=json.dumps(list(self.pass_to_pass)),
            version=self.version,
            environment_setup_commit=self.environment_setup_commit,
            hints_text=self.hints_text,
        )
        if self.test_cmd != DEFAULT_TEST_CMD:
            rec["test_cmd"] = self.test_cmd
        return rec

    def __branchgym_state__(self) -> tuple:
        return (self.instance_id, self.base_commit, self.test_patch)


_DIFF_HEADER = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)


def diff_files(patch: str) -> list[str]:
    """Paths a unified git diff touches (the ``b/`` side), in order, without duplicates."""
    out: list[str] = []
    for _, b in _DIFF_HEADER.findall(patch or ""):
        if b not in out:
            out.append(b)
    return out


def new_files(patch: str) -> list[str]:
    """Paths a git diff creates (``--- /dev/null``)."""
    out = []
    for block in re.split(r"(?=^diff --git )", patch or "", flags=re.MULTILINE):
        m = _DIFF_HEADER.match(block)
        if m and re.search(r"^--- /dev/null$", block, re.MULTILINE):
            out.append(m.group(2))
    return out


def _test_list(value: Any, field: str, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{where}: {field} is a string but not JSON ({exc}); upstream stores it as a "
                "JSON list such as '[\"tests/test_x.py::test_y\"]'."
            ) from exc
    if not isinstance(value, list | tuple) or not all(isinstance(t, str) for t in value):
        raise DataError(
            f"{where}: {field} must be a list of test ids (or its JSON string), "
            f"got {type(value).__name__}"
        )
    return tuple(value)


def parse_task(record: Mapping[str, Any], where: str = "task") -> SWEBenchTask:
    """Validate one record and build the task.

    Raises:
        DataError: a required field is missing or has the wrong type.
    """
    if not isinstance(record, Mapping):
        raise DataError(f"{where}: a task must be a JSON object, got {type(record).__name__}")
    missing = [f for f in REQUIRED_FIELDS if f not in record]
    if missing:
        raise DataError(
            f"{where}: missing field(s) {', '.join(missing)}; a SWE-bench instance needs "
            f"{', '.join(REQUIRED_FIELDS)}."
        )
    for f in ("instance_id", "repo", "base_commit", "problem_statement", "test_patch"):
        if not isinstance(record[f], str):
            raise DataError(f"{where}: {f} must be a string, got {type(record[f]).__name__}")
    if not record["instance_id"] or "/" in record["instance_id"]:
        raise DataError(f"{where}: instance_id must be non-empty and contain no '/'")
    if not re.fullmatch(r"[0-9a-fA-F]{7,40}", record["base_commit"]):
        raise DataError(f"{where}: base_commit {record['base_commit']!r} is not a git commit hash")
    wid = f"{where} ({record['instance_id']})"
    return SWEBenchTask(
        instance_id=record["instance_id"],
        repo=record["repo"],
        base_commit=record["base_commit"],
        problem_statement=record["problem_statement"],
        patch=str(record.get("patch") or ""),
        test_patch=record["test_patch"],
        fail_to_pass=_test_list(record["FAIL_TO_PASS"], "FAIL_TO_PASS", wid),
        pass_to_pass=_test_list(record["PASS_TO_PASS"], "PASS_TO_PASS", wid),
        version=str(record.get("version") or ""),
        environment_setup_commit=str(record.get("environment_setup_commit") or ""),
        test_cmd=str(record.get("test_cmd") or DEFAULT_TEST_CMD),
        hints_text=str(record.get("hints_text") or ""),
        extra={k: v for k, v in record.items() if k not in _KNOWN},
    )


def _records(path: Path) -> Iterable[tuple[str, Any]]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    yield f"{path}:{n}", json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}:{n}: not valid JSON ({exc.msg})") from exc
        return
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); a .json task file "
            "holds a list of instances (use .jsonl for one instance per line)"
        ) from exc
    if isinstance(data, Mapping) and "instance_id" in data:
        data = [data]
    elif isinstance(data, Mapping):  # {"instances": [...]} / {"data": [...]} exports
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise DataError(f"{path}: expected a list of instances, got an object")
        data = lists[0]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a list of instances, got {type(data).__name__}")
    for n, rec in enumerate(data):
        yield f"{path}[{n}]", rec


def load_tasks(
    path: str | os.PathLike[str], *, instance_ids: Sequence[str] | None = None
) -> list[SWEBenchTask]:
    """Load SWE-bench instances from a ``.json`` (list) or ``.jsonl`` file.

    Args:
        path: The task file (a SWE-bench / Verified / Lite export, SWE-Gym rows, or
            ``branchgym``'s generated ``tasks.jsonl``).
        instance_ids: Keep only these instances (in the file's order).

    Raises:
        DataError: the file is missing or malformed, ids repeat, or a requested id is absent.
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(
            f"task file {str(p)!r} does not exist; give the path of a SWE-bench .json/.jsonl "
            "export (e.g. saved with datasets' to_json), or leave tasks unset for the "
            "generated task set."
        )
    if p.suffix not in (".json", ".jsonl"):
        raise DataError(f"{p}: task files are .json or .jsonl, not {p.suffix or 'no suffix'}")
    tasks, seen = [], set()
    for where, rec in _records(p):
        t = parse_task(rec, where)
        if t.instance_id in seen:
            raise DataError(f"{where}: instance_id {t.instance_id!r} appears twice")
        seen.add(t.instance_id)
        tasks.append(t)
    if not tasks:
        raise DataError(f"{p}: the file holds no task instances")
    if instance_ids is not None:
        by_id = {t.instance_id: t for t in tasks}
        absent = [i for i in instance_ids if i not in by_id]
        if absent:
            raise DataError(f"{p}: no instance(s) {', '.join(map(repr, absent))} in the file")
        tasks = [by_id[i] for i in instance_ids]
    return tasks


# ------------------------------------------------------------------ repositories


def cache_root() -> Path:
    """Where branchgym caches checkouts and generated tasks (``$BRANCHGYM_CACHE``)."""
    env = os.environ.get("BRANCHGYM_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "branchgym"
    return base.expanduser()


def cache_folder(folder: str | os.PathLike[str]) -> Path:
    """Make ``folder`` (inside the cache) and check branchgym can write there.

    Building task sets, checkouts and environments writes to the cache; once built they
    are only read, so a cache built elsewhere can be used read-only.

    Raises:
        CacheLocationError: the folder cannot be made or written (a read-only parent,
            no permission); the message says what to set ``BRANCHGYM_CACHE`` to.
    """
    folder = Path(folder)
    try:
        # Through the real path: a link whose target does not exist yet gets it made.
        Path(os.path.realpath(folder)).mkdir(parents=True, exist_ok=True)
        problem = "" if os.access(folder, os.W_OK | os.X_OK) else "it is not writable"
    except OSError as exc:
        problem = exc.strerror or str(exc)
    if problem:
        raise CacheLocationError(
            f"the branchgym cache {os.fspath(cache_root())!r} cannot be written at "
            f"{os.fspath(folder)!r} ({problem}), and building the SWE-bench tasks and "
            "environments writes there. Set BRANCHGYM_CACHE to a writable folder (e.g. "
            "/var/tmp/branchgym or ~/.cache/branchgym), or build the cache once where it is "
            "writable and mount it read-only afterwards."
        )
    return folder


def find_repo(repo: str, repos_dir: str | os.PathLike[str]) -> Path:
    """The local clone of ``owner/name`` inside ``repos_dir``.

    Raises:
        DataError: no clone found; the message lists where it looked and how to clone.
    """
    owner, _, name = repo.partition("/")
    root = Path(repos_dir).expanduser()
    tried = [root / f"{owner}__{name}", root / owner / name, root / name]
    for cand in tried:
        if (cand / ".git").exists() or (cand / "HEAD").is_file():
            return cand
    raise DataError(
        f"no local clone of {repo!r} in {str(root)!r} (looked for "
        f"{', '.join(str(t.relative_to(root)) for t in tried)}). branchgym never downloads "
        f"repositories: clone it once, e.g. `git clone https://github.com/{repo} "
        f"{tried[0]}`, and pass repos_dir={str(root)!r}."
    )


def _git(*args: str, cwd: Path | None = None) -> str:
    out = subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, env=_git_env(), check=False
    )
    if out.returncode != 0:
        raise DataError(f"git {' '.join(args)} failed in {cwd}: {out.stderr.strip()}")
    return out.stdout


def _git_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_CONFIG_NOSYSTEM="1", GIT_TERMINAL_PROMPT="0", LC_ALL="C")
    return env


def ensure_checkout(task: SWEBenchTask, repos_dir: str | os.PathLike[str]) -> Path:
    """The cached checkout of ``task.repo`` at ``task.base_commit`` (created once).

    The checkout is a self-contained clone (objects hard-linked from the user's clone,
    which git never modifies in place) with the ``origin`` remote removed, like
    SWE-bench's ``/testbed``. It is never written afterwards: sandboxes use it as their
    read-only base layer.
    """
    src = find_repo(task.repo, repos_dir)
    dest = cache_root() / "swebench" / "checkouts" / f"{task.instance_id}-{task.base_commit[:12]}"
    if (dest / ".branchgym-ready").exists():
        return dest / "repo"
    cache_folder(dest.parent)
    with open(f"{dest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per checkout, across processes
        if (dest / ".branchgym-ready").exists():
            return dest / "repo"
        shutil.rmtree(dest, ignore_errors=True)
        repo = dest / "repo"
        _git("clone", "-q", "--no-checkout", "--no-tags", str(src), str(repo))
        try:
            _git("checkout", "-q", "-f", "-B", "main", task.base_commit, cwd=repo)
        except DataError as exc:
            shutil.rmtree(dest, ignore_errors=True)
            raise DataError(
                f"commit {task.base_commit} of {task.instance_id} is not in {src}; fetch the "
                "full history of that clone (git fetch --unshallow) and try again."
            ) from exc
        # As SWE-bench does for /testbed: no remote, and no later commits the agent could
        # read the fix from (the clone's other refs and their objects are dropped).
        _git("remote", "remove", "origin", cwd=repo)
        for ref in _git("for-each-ref", "--format=%(refname)", cwd=repo).split():
            if ref != "refs/heads/main":
                _git("update-ref", "-d", ref, cwd=repo)
        _git("reflog", "expire", "--expire=now", "--all", cwd=repo)
        _git("gc", "-q", "--prune=now", cwd=repo)
        (dest / _DIGEST).write_text(tree_digest(repo) + "\n")
        (dest / ".branchgym-ready").write_text(task.base_commit + "\n")
    return dest / "repo"


_DIGEST = ".branchgym-digest"


def verify_checkout(checkout: str | os.PathLike[str]) -> str:
    """Check that a cached checkout is exactly as :func:`ensure_checkout` made it.

    Grading starts from this checkout; a changed file there (a planted ``conftest.py``,
    an edited test) would change every later grade. Sandboxes never see the cache, so a
    mismatch means something outside branchgym wrote to it.

    Returns:
        The checkout's tree digest.

    Raises:
        SandboxError: the digest differs from the one recorded at creation.
    """
    from branchgym.error import SandboxError

    repo = Path(checkout)
    record = repo.parent / _DIGEST
    actual = tree_digest(repo)
    if not record.exists():  # a checkout cached before digests were recorded
        record.write_text(actual + "\n")
        return actual
    expected = record.read_text().strip()
    if actual != expected:
        raise SandboxError(
            f"the pristine checkout {repo} changed since it was made (tree digest {actual} != "
            f"{expected}): something wrote to the branchgym cache. Grading refuses to run on it; "
            f"delete {repo.parent} and it is rebuilt from repos_dir on the next reset."
        )
    return actual
