"""Each repository's own Python environment, for the local backends.

SWE-bench runs a task's tests in a conda environment built for its repository and
version, with the repository installed by ``pip install -e .``. The local backends do the
same with a virtual environment: :func:`repo_environment` builds one per repository,
version and base interpreter under the branchgym cache (once; later calls and other
processes reuse it), installs the task's checkout into it the way the harness does
(``pip install -e . --no-deps --no-build-isolation``, offline, ``src/`` layouts included),
and checks that every dependency the repository declares is importable. Sandboxes bind
the environment read-only and put its ``bin/`` first on ``PATH``, so ``python3 -m
pytest`` runs with the repository installed; no sandbox can change it.

The editable install points at ``/testbed`` (the paths pip wrote for the build copy are
rewritten), so inside each sandbox it imports that sandbox's own working tree. Commands
run without isolation have no ``/testbed``: they get the source roots on ``PYTHONPATH``
instead (see :attr:`RepoEnvironment.roots`).

The base interpreter provides the test tools (pytest) and the repository's dependencies:
by default the one running branchgym, or one the user names per repository or task
(``python_env={"owner/name": "/opt/envs/name/bin/python"}``), e.g. a conda env that has
the dependencies. The venv sees the base's packages (``--system-site-packages``); the
repository's editable install comes before them.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from branchgym.envs.swebench.sandbox import WORKDIR
from branchgym.envs.swebench.tasks import SWEBenchTask, cache_folder, cache_root
from branchgym.error import CacheLocationError, RepoEnvironmentError, SandboxConfigError

__all__ = [
    "RepoEnvironment",
    "repo_environment",
    "resolve_python_env",
    "installable",
    "DEPENDENCY_CHECK",
    "EDITABLE_INSTALL",
    "PIP_ENV",
]

#: Bump when the build procedure changes (the cache key includes it).
FORMAT_VERSION = 2

#: Files whose presence makes a checkout pip-installable.
_PROJECT_FILES = ("pyproject.toml", "setup.py", "setup.cfg")

#: ``pip`` arguments that install a checkout (the folder follows) as SWE-bench's harness
#: does, offline: editable, without its dependencies, with the build backend at hand. The
#: Docker backends' environment images install with the same (docker_env.py).
EDITABLE_INSTALL = ("install", "--no-deps", "--no-build-isolation", "--no-index", "-e")
#: pip's environment for those installs: no index, no prompt, no version check.
PIP_ENV = {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1", "PIP_NO_INDEX": "1"}

#: Run by the environment's interpreter with the distribution's name as its argument:
#: prints (JSON) the declared requirements (markers evaluated, extras skipped) that no
#: installed distribution satisfies, and pytest when it does not import.
DEPENDENCY_CHECK = r"""
import importlib.metadata as md, importlib.util, json, re, sys
name = sys.argv[1]
missing = []
try:
    reqs = md.distribution(name).requires or []
except md.PackageNotFoundError:
    reqs = []
    missing.append(name + " (not installed)")
try:
    from packaging.requirements import Requirement
except ImportError:
    Requirement = None
for line in reqs:
    if Requirement is not None:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        dist = req.name
    else:
        if "extra ==" in line:
            continue
        dist = re.split(r"[\s;<>=!~\[(]", line, maxsplit=1)[0]
    try:
        md.distribution(dist)
    except md.PackageNotFoundError:
        missing.append(line)
if importlib.util.find_spec("pytest") is None:
    missing.append("pytest (the test runner)")
print(json.dumps(missing))
"""


@dataclasses.dataclass(frozen=True)
class RepoEnvironment:
    """A built per-repository environment.

    Attributes:
        prefix: The venv folder (bound read-only at the same path in sandboxes).
        base_python: The interpreter the venv was made from.
        dist: The distribution name the repository installs as.
        roots: Source roots relative to the repository (``"."``, ``"src"``): what the
            editable install puts on the import path.
        binds: Folders commands need read-only: the venv and the base installation.
    """

    prefix: Path
    base_python: str
    dist: str
    roots: tuple[str, ...]
    binds: tuple[str, ...]

    @property
    def bin_dir(self) -> Path:
        """The venv's ``bin`` folder (first on ``PATH`` in sandboxes)."""
        return self.prefix / "bin"

    @property
    def python(self) -> Path:
        """The venv's interpreter."""
        return self.bin_dir / "python"


def installable(checkout: str | os.PathLike[str]) -> bool:
    """Whether ``checkout`` is a pip-installable project (pyproject.toml/setup.py/setup.cfg)."""
    return any((Path(checkout) / f).is_file() for f in _PROJECT_FILES)


def resolve_python_env(spec: str | Mapping[str, str] | None, task: SWEBenchTask) -> str | None:
    """The base interpreter for ``task``'s environment, or None for branchgym's own.

    Args:
        spec: ``"auto"``/None (a per-repository venv over branchgym's interpreter for
            installable repositories), ``"host"`` (no venv: branchgym's interpreter, as
            before), or a mapping from instance id or ``owner/name`` to an interpreter
            (``"*"`` for every other task; ``"host"`` as a value opts a task out).
        task: The task whose interpreter is asked for.

    Returns:
        ``"host"``, or the path of the base interpreter (``sys.executable`` by default).
    """
    if spec is None or spec == "auto":
        return sys.executable
    if spec == "host":
        return "host"
    if isinstance(spec, str):
        return _check_python(spec)
    if not isinstance(spec, Mapping):
        raise SandboxConfigError(
            f"python_env must be 'auto', 'host', an interpreter path or a mapping of "
            f"instance id or owner/name to an interpreter, not {type(spec).__name__}"
        )
    for key in (task.instance_id, task.repo, "*"):
        if key in spec:
            value = spec[key]
            return "host" if value == "host" else _check_python(value)
    return sys.executable


def _is_interpreter(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _check_python(path: str | os.PathLike[str]) -> str:
    path = os.fspath(path)
    if not _is_interpreter(path):
        raise SandboxConfigError(
            f"python_env names {path!r}, which is not an executable interpreter; give the "
            "path of a python binary (e.g. /opt/conda/envs/name/bin/python)"
        )
    return os.path.abspath(path)


@functools.cache
def _prefixes(python: str) -> tuple[str, ...]:
    """The installation folders of ``python`` outside /usr (to bind read-only).

    Asked once per interpreter and process: starting it costs 100-200 ms, which every
    env instance paid again for each task it met (a restore of another task's snapshot
    into a pool instance).
    """
    code = (
        "import sys, os, json; print(json.dumps(sorted({os.path.realpath(p) for p in "
        "(sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix)} | "
        "{p for p in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix)})))"
    )
    out = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RepoEnvironmentError(f"cannot run {python}: {out.stderr.strip()[-500:]}")
    keep = []
    for p in json.loads(out.stdout):
        p = os.path.normpath(p)
        if p == "/" or p == "/usr" or p.startswith("/usr/"):
            continue
        if os.path.isdir(p) and not any(p.startswith(k.rstrip("/") + "/") for k in keep):
            keep.append(p)
    return tuple(keep)


def _key(task: SWEBenchTask, base_python: str) -> str:
    # ``base_python`` is absolute (repo_environment makes it so).
    # The interpreter's own path, not its real path: every venv made from one python
    # resolves to that python's binary, yet each has its own site-packages, which the
    # environment's .pth adds. Keyed by the real path, a second venv (a fresh clone's, a
    # CI checkout's) met the first one's environment and ran its tests on packages that
    # were not its own, or on none once that venv was deleted.
    blob = json.dumps([FORMAT_VERSION, task.repo, task.version, base_python])
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{task.repo.replace('/', '__')}-{task.version}")
    return f"{name}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def repo_environment(
    task: SWEBenchTask,
    checkout: str | os.PathLike[str],
    *,
    base_python: str | None = None,
    root: str | os.PathLike[str] | None = None,
) -> RepoEnvironment:
    """The environment of ``task``'s repository and version (built on first use).

    Args:
        task: The task (its ``repo`` and ``version`` key the environment).
        checkout: A checkout of the repository to install from (only its packaging
            metadata matters after the build: the install points at ``/testbed``).
        base_python: Interpreter the venv is made from (default: branchgym's).
        root: Cache folder (default ``<cache>/swebench/envs``).

    Raises:
        RepoEnvironmentError: the install failed, or the repository declares
            dependencies the base interpreter lacks (the message lists them and says
            how to provide them).
    """
    base_python = os.path.abspath(base_python or sys.executable)
    # The real path: sandboxes bind it there and put its bin/ on PATH, whatever links
    # (a home or cache folder that is a link) lead to it.
    folder = Path(os.path.realpath(Path(root) if root else cache_root() / "swebench" / "envs"))
    target = folder / _key(task, base_python)
    if os.pathsep in os.fspath(target):
        raise CacheLocationError(
            f"the environment of {task.repo} would be {os.fspath(target)!r}, whose name holds "
            f"{os.pathsep!r}, the PATH separator: its bin/ cannot go on PATH (and venv refuses "
            "it). Set BRANCHGYM_CACHE to a folder whose path has no ':' (e.g. /var/tmp/branchgym)."
        )
    meta = target / "env.json"
    if _stale(meta):
        cache_folder(folder)
        with open(f"{target}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent processes build it once
            if _stale(meta):
                _build(task, Path(checkout), base_python, target)
    data = json.loads(meta.read_text())
    return RepoEnvironment(
        prefix=target / "venv",
        base_python=data["base_python"],
        dist=data["dist"],
        roots=tuple(data["roots"]),
        binds=tuple([str(target / "venv"), *_prefixes(data["base_python"])]),
    )


def _stale(meta: Path) -> bool:
    """Whether the environment ``meta`` describes must be (re)built.

    It must when it was never built, or when what it stands on is gone: its base
    interpreter, or a site folder its .pth adds (a venv deleted or rebuilt since). Such an
    environment would start no interpreter, or import without the packages it was built
    against, so it is rebuilt rather than used.
    """
    try:
        data = json.loads(meta.read_text())
    except (OSError, ValueError):
        return True
    python = data.get("base_python")
    if not (isinstance(python, str) and _is_interpreter(python)):
        return True
    return not all(os.path.isdir(s) for s in data.get("sites", ()))


def _run(argv: list[str], what: str, cwd: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env.update(PIP_ENV)
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RepoEnvironmentError(
            f"{what} failed ({' '.join(argv[:4])} ...):\n{(out.stdout + out.stderr)[-1500:]}"
        )
    return out.stdout


def _build(task: SWEBenchTask, checkout: Path, base_python: str, target: Path) -> None:
    if not installable(checkout):
        raise RepoEnvironmentError(
            f"{task.repo} at {checkout} has no pyproject.toml, setup.py or setup.cfg, so it "
            "cannot be installed; pass python_env='host' to run its tests with branchgym's "
            "interpreter"
        )
    shutil.rmtree(target, ignore_errors=True)  # a build that died half-way
    target.mkdir(parents=True)
    venv = target / "venv"
    _run([base_python, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
         f"creating the venv of {task.repo}")  # fmt: skip
    # A venv made from a venv sees the *base* installation only: a .pth adds the given
    # interpreter's own site folders (with their .pth files) after the venv's.
    code = "import json, site; print(json.dumps(site.getsitepackages()))"
    sites = json.loads(_run([base_python, "-I", "-c", code], f"reading {base_python}'s sites"))
    (site_dir,) = venv.glob("lib/python*/site-packages")
    (site_dir / "~branchgym-base.pth").write_text(
        "".join(f"import site; site.addsitedir({s!r})\n" for s in sites)
    )
    python = str(venv / "bin" / "python")
    has_pip = subprocess.run([python, "-c", "import pip"], capture_output=True, check=False)
    if has_pip.returncode != 0:
        raise RepoEnvironmentError(
            f"the interpreter {base_python} has no pip, which installing {task.repo} needs; "
            "install pip there (python -m ensurepip) or name another interpreter in python_env"
        )
    # Install from a copy (the checkout stays pristine: build/ and *.egg-info go here).
    src = target / "src"
    shutil.copytree(checkout, src, symlinks=True, ignore=shutil.ignore_patterns(".git"))
    before = set(_site_files(venv))
    _run(
        [python, "-m", "pip", *EDITABLE_INSTALL, str(src)],
        f"pip install -e . of {task.repo} (the build backend must be installed in "
        f"{base_python}: setuptools, flit_core or hatchling, as the project's pyproject.toml "
        "names)",
    )  # fmt: skip
    roots: set[str] = set()
    dist = ""
    prefix = str(src)
    for path in sorted(set(_site_files(venv)) - before):
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        if path.name == "direct_url.json":
            dist = path.parent.name.split("-")[0]
        if prefix not in text:
            continue
        for m in re.finditer(re.escape(prefix) + r"(/[^'\"\n]*)?", text):
            rel = (m.group(1) or "").lstrip("/")
            if path.suffix == ".py" and rel:  # a finder's mapping: package -> its folder
                rel = os.path.dirname(rel)
            if path.suffix in (".py", ".pth"):
                roots.add(rel or ".")
        path.write_text(text.replace(prefix, WORKDIR))
    shutil.rmtree(src)
    if not dist:
        raise RepoEnvironmentError(f"pip installed {task.repo} but wrote no direct_url.json")
    check = [python, "-c", DEPENDENCY_CHECK, dist]
    missing = json.loads(_run(check, f"checking {task.repo}'s dependencies"))
    if missing:
        raise RepoEnvironmentError(
            f"{task.repo} {task.version} needs {', '.join(missing)}, which the interpreter "
            f"{base_python} lacks. Install them there (pip install ...), or pass "
            f"python_env={{{task.repo!r}: '/path/to/python'}} naming an interpreter that has "
            "them (a conda env or venv with the repository's dependencies)."
        )
    meta = {
        "base_python": base_python,
        "sites": [s for s in sites if os.path.isdir(s)],
        "dist": dist,
        "roots": sorted(roots) or ["."],
    }
    (target / "env.json").write_text(json.dumps(meta))


def _site_files(venv: Path) -> list[Path]:
    return [p for p in venv.glob("lib/python*/site-packages/**/*") if p.is_file()]
