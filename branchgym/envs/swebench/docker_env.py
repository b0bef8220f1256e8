"""Each repository's environment in the Docker backends: an image per repository and version.

SWE-bench grades a task in an instance image built over an environment image of its
repository and version (its dependencies, then ``pip install -e .`` of the checkout at
``/testbed``). Where a task has no SWE-bench image on the daemon, the Docker backends do
the same over the offline base image (``scripts/swebench_docker_image.sh``):
:func:`env_image` builds ``branchgym/swebench-env:<repo>-<version>-<key>`` once per
repository, version and base image, and each task image of that repository is built over
it (the task's checkout at ``/testbed``). Later sandboxes, other processes and later runs
find it on the daemon and reuse it.

The build installs the repository as the local backends' environments do
(:mod:`~branchgym.envs.swebench.repo_env`): ``pip install -e . --no-deps
--no-build-isolation --no-index`` of a copy of the checkout (without ``.git``) put at
``/testbed``, by the image's ``python3`` into its system site folder
(``/usr/local/lib/python3.X/dist-packages``, which the sandbox user cannot write), in a
container without network: nothing is downloaded; the build backend (setuptools, wheel)
and what tests import (pytest, tkinter) are the base image's Debian packages. The
install's paths name ``/testbed`` (a ``src/`` layout's too), and ``/testbed`` is emptied
before the image is committed, so each task image over it imports its own working tree.
Every dependency the repository declares must then be importable: a missing one, an
install that fails or a base image without pip is a
:class:`~branchgym.error.RepoEnvironmentError` that says how to provide it.

A checkout without packaging metadata (pyproject.toml, setup.py or setup.cfg) gets no
environment image: its task images are built over the base image, and its tests import
``/testbed`` from the working directory, as the local backends run them with branchgym's
interpreter.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import re
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from branchgym.envs.swebench.docker_sandbox import docker_sdk, owner_labels
from branchgym.envs.swebench.repo_env import (
    DEPENDENCY_CHECK,
    EDITABLE_INSTALL,
    PIP_ENV,
    installable,
)
from branchgym.envs.swebench.sandbox import WORKDIR
from branchgym.envs.swebench.tasks import SWEBenchTask, cache_folder, cache_root
from branchgym.error import CacheLocationError, RepoEnvironmentError

__all__ = ["ENV_REPOSITORY", "env_image", "env_image_name", "testbed_archive"]

#: The repository environment images are tagged in.
ENV_REPOSITORY = "branchgym/swebench-env"
#: Bump when the build procedure changes (the tag's key includes it).
FORMAT_VERSION = 1
#: Seconds an install may take (setup.py runs; the container has no network to wait on).
BUILD_TIMEOUT = 600

# Run by the base image's python3 in the build container, the checkout at /testbed:
# install it, name the distribution whose direct_url.json is /testbed, check its
# dependencies, empty /testbed. The last line of output is the JSON verdict.
_BUILD = r"""
import json, os, shutil, subprocess, sys
pip_env, install, check = json.loads(sys.argv[1])
def done(**verdict):
    print("\n" + json.dumps(verdict))
    sys.exit(0)
try:
    import pip  # noqa: F401
except ImportError:
    done(error="no pip")
env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
env.update(pip_env, PIP_BREAK_SYSTEM_PACKAGES="1", PIP_NO_CACHE_DIR="1",
           PIP_ROOT_USER_ACTION="ignore", PYTHONDONTWRITEBYTECODE="1")
def run(*argv):
    return subprocess.run([sys.executable, *argv], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
out = run("-m", "pip", *install, "/testbed")
if out.returncode:
    done(error="install", log=out.stdout[-1500:])
# A fresh interpreter: the site folder the install made may not have existed at our start.
find = ("import importlib.metadata as md, json; print(json.dumps(sorted("
        "d.metadata['Name'] for d in md.distributions() if json.loads("
        "d.read_text('direct_url.json') or '{}').get('url') == 'file:///testbed')))")
names = json.loads(run("-c", find).stdout or "[]")
if len(names) != 1:
    done(error="install", log=f"pip installed {names or 'no distribution'} from /testbed")
res = run("-c", check, names[0])
if res.returncode:
    done(error="check", log=res.stdout[-1500:])
for name in os.listdir("/testbed"):
    path = os.path.join("/testbed", name)
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)
done(dist=names[0], missing=json.loads(res.stdout.strip().splitlines()[-1]))
"""

_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_LOCK = threading.Lock()


def env_image_name(task: SWEBenchTask, base_id: str) -> str:
    """The environment image's name for ``task``'s repository and version over ``base_id``."""
    blob = json.dumps([FORMAT_VERSION, task.repo, task.version, base_id])
    key = hashlib.sha256(blob.encode()).hexdigest()[:12]
    part = re.sub(r"[^a-z0-9_.-]+", "-", f"{task.repo.replace('/', '__')}-{task.version}".lower())
    return f"{ENV_REPOSITORY}:{part.strip('-.')[:80]}-{key}"


def env_image(
    client: Any, base: Any, task: SWEBenchTask, checkout: Path, base_name: str
) -> str | None:
    """The id of ``task``'s environment image over ``base`` (built on first use).

    Args:
        client: The Docker client.
        base: The base image (a ``docker`` SDK image).
        task: The task (its ``repo`` and ``version`` key the image).
        checkout: A checkout to install from (only its packaging metadata stays).
        base_name: The base image's name, for messages.

    Returns:
        The image id, or None for a checkout without packaging metadata (its tasks run
        over the base image).

    Raises:
        RepoEnvironmentError: the base image has no pip, the install failed, or the
            repository declares dependencies the image lacks (the message says the fix).
    """
    if not installable(checkout):
        return None
    name = env_image_name(task, base.id)
    with _LOCKS_LOCK:
        lock = _LOCKS.setdefault(name, threading.Lock())
    with lock:
        found = _find(client, name)
        if found:
            return found
        with _process_lock(name):
            return _find(client, name) or _build(client, base, task, checkout, base_name, name)


@contextlib.contextmanager
def _process_lock(name: str) -> Iterator[None]:
    """Other processes on this host (parallel test workers) build ``name`` once too.

    A lock file in the cache; where the cache cannot be written (a read-only cache built
    elsewhere) no lock: two processes may then both build it, and either image works.
    """
    try:
        folder = cache_folder(cache_root() / "swebench" / "docker")
    except CacheLocationError:
        yield
        return
    with open(folder / f"{name.replace('/', '_').replace(':', '_')}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _find(client: Any, name: str) -> str | None:
    try:
        return str(client.images.get(name).id)
    except docker_sdk().errors.ImageNotFound:
        return None


def _build(
    client: Any, base: Any, task: SWEBenchTask, checkout: Path, base_name: str, name: str
) -> str:
    what = f"{task.repo} {task.version}"
    # --use-pep517: what the local backends' pip (25.3 and later) always does. Bookworm's
    # pip 23 would run the legacy ``setup.py develop`` for a project without
    # pyproject.toml, whose metadata stays in the checkout instead of the site folder.
    install = [*EDITABLE_INSTALL[:-1], "--use-pep517", EDITABLE_INSTALL[-1]]
    argv = json.dumps([PIP_ENV, install, DEPENDENCY_CHECK])
    c = client.containers.create(
        base.id,
        ["python3", "-c", _BUILD, argv],
        working_dir="/",
        network_mode="none",
        cap_drop=["ALL"],
        security_opt=["no-new-privileges"],
        labels=owner_labels(),  # prune_stale removes it if this process dies mid-build
    )
    try:
        c.put_archive("/", testbed_archive(checkout, 0, git=False))
        c.start()
        try:
            code = c.wait(timeout=BUILD_TIMEOUT).get("StatusCode")
        except Exception as exc:  # requests' ReadTimeout, or the daemon went away
            raise RepoEnvironmentError(
                f"installing {what} into the Docker base image {base_name!r} did not finish "
                f"in {BUILD_TIMEOUT} s ({type(exc).__name__}: {exc})"
            ) from exc
        log = c.logs().decode("utf-8", "replace")
        verdict = _verdict(log)
        if code != 0 or verdict is None:
            raise RepoEnvironmentError(
                f"installing {what} into the Docker base image {base_name!r} failed (exit "
                f"{code}):\n{log[-1500:]}"
            )
        _check(verdict, what, base_name)
        c.commit(
            repository=name.split(":")[0],
            tag=name.split(":")[1],
            changes=[f"WORKDIR {WORKDIR}", 'CMD ["sleep", "infinity"]'],
            conf={"Labels": {"branchgym.env": what, "branchgym.env.dist": verdict["dist"]}},
        )
    finally:
        c.remove(force=True)
    return str(client.images.get(name).id)


def _verdict(log: str) -> dict[str, Any] | None:
    lines = log.strip().splitlines()
    try:
        verdict = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    return verdict if isinstance(verdict, dict) else None


def _check(verdict: dict[str, Any], what: str, base_name: str) -> None:
    """Raise the error a failed build's verdict stands for (each says the fix)."""
    error = verdict.get("error")
    rebuild = (
        "Rebuild the base image with scripts/swebench_docker_image.sh (its PACKAGES "
        "include python3-pip, with setuptools and wheel)"
    )
    if error == "no pip":
        raise RepoEnvironmentError(
            f"the Docker base image {base_name!r} has no pip, which installing {what} into "
            f"its environment image needs. {rebuild}, or set BRANCHGYM_DOCKER_IMAGE to an "
            "image whose python3 has pip and setuptools."
        )
    if error:
        raise RepoEnvironmentError(
            f"pip install -e . of {what} failed in the Docker base image {base_name!r} "
            f"(offline: the build backend its pyproject.toml names, setuptools, flit_core or "
            f"hatchling, must be one of the image's Debian packages; add it to PACKAGES in "
            f"scripts/swebench_docker_image.sh):\n{verdict.get('log', '')}"
        )
    missing = verdict.get("missing") or []
    if missing:
        raise RepoEnvironmentError(
            f"{what} needs {', '.join(missing)}, which the Docker base image {base_name!r} "
            "lacks (its environment image is built offline, from the image's Debian "
            "packages). Add the Debian packages that provide them (python3-<name>) to "
            "PACKAGES in scripts/swebench_docker_image.sh and rerun it (the image's tag "
            "changes with the list), load SWE-bench's own image of the task "
            "(docker_image='swebench'; docs/swebench.md, Docker), or grade on "
            f"backend='local' with python_env={{{what.split()[0]!r}: '/path/to/python'}} "
            "naming an interpreter that has them."
        )


def testbed_archive(
    checkout: Path, uid: int, *, git: bool = True, folders: tuple[str, ...] = ()
) -> bytes:
    """A tar archive (for ``put_archive("/", ...)``) of ``checkout`` as ``/testbed``.

    Args:
        checkout: The folder to archive.
        uid: Owner (and group) of every entry.
        git: Keep the ``.git`` folders (False: leave them out, as the install copies do).
        folders: More empty folders (absolute paths, mode 755), e.g. the agent's home.
    """

    def owned(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if not git and ".git" in info.name.split("/"):
            return None
        info.uid = info.gid = uid
        info.uname = info.gname = ""
        return info

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(str(checkout), arcname=WORKDIR.lstrip("/"), filter=owned)
        for folder in folders:
            info = tarfile.TarInfo(folder.lstrip("/"))
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(owned(info))
    return buf.getvalue()
