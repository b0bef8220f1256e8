"""Docker containers as sandboxes: the container, its snapshots and the sandbox over it.

What every Docker snapshot mode shares (:mod:`~branchgym.envs.swebench.docker_backend`
makes the sandboxes and picks the mode; :mod:`~branchgym.envs.swebench.docker_overlay`
builds its ``/testbed`` on these containers): a reference-counted :class:`Container`,
the ``commit`` and ``git`` modes' snapshots, :class:`DockerSandbox` (commands, file
access, limits) and the labels that mark what a process owns. A sandbox reaches its
backend only through :class:`ContainerHost`, so this module imports neither of the two
above.
"""

from __future__ import annotations

import dataclasses
import io
import os
import shlex
import socket
import tarfile
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from branchgym.envs.swebench.gitsnap import GITSNAP_SOURCE
from branchgym.envs.swebench.limits import Limits
from branchgym.envs.swebench.sandbox import (
    TREE_DIGEST_SOURCE,
    WORKDIR,
    ExecResult,
    Sandbox,
    SandboxSnapshot,
    inside_workdir,
)
from branchgym.error import DependencyMissingError, SandboxError

__all__ = [
    "AGENT_HOME",
    "HOST",
    "IMAGE_INFO",
    "OWNER_LABEL",
    "SANDBOX_UID",
    "SNAPSHOT_LABEL",
    "Container",
    "ContainerHost",
    "DockerGitSnapshot",
    "DockerSandbox",
    "DockerSnapshot",
    "ImageInfo",
    "ImageRefs",
    "docker_sdk",
    "owner_labels",
]

#: Label of every container and image a branchgym process owns (``prune_stale`` reads it).
OWNER_LABEL = "branchgym.sandbox"
#: Label of snapshot images.
SNAPSHOT_LABEL = "branchgym.snapshot"
#: The agent's uid and gid in branchgym-built images, and its home folder there.
SANDBOX_UID = 1000
AGENT_HOME = "/home/agent"
#: This host's name, in the owner labels (a pid is only meaningful on its host).
HOST = socket.gethostname()


def docker_sdk() -> Any:
    """The ``docker`` package (the ``docker`` extra), or a typed error that says to install it."""
    try:
        import docker
    except ImportError as exc:
        raise DependencyMissingError.for_extra("the docker backend", "docker", "docker") from exc
    return docker


@dataclasses.dataclass(frozen=True)
class ImageInfo:
    """How commands run in containers of one image (and of snapshots taken from them).

    ``env`` is None for branchgym-built images (commands get :func:`default_env`); for
    SWE-bench's images it is the image's environment with ``testbed`` activated, and
    ``head`` the commit ``/testbed`` is at in the image.
    """

    user: str
    env: Mapping[str, str] | None = None
    head: str | None = None
    name: str = ""


#: image id -> how its containers run commands, per client (snapshot images inherit it);
#: shared by the backends of one daemon, as snapshots restore across env instances.
IMAGE_INFO: dict[int, dict[str, ImageInfo]] = {}


def owner_labels(**extra: str) -> dict[str, str]:
    """Labels that mark a container or image as this process's (``prune_stale`` reads them)."""
    return {OWNER_LABEL: "1", "branchgym.pid": str(os.getpid()), "branchgym.host": HOST, **extra}


class ImageRefs:
    """Reference counts of snapshot images (handles, containers and child images hold them)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.lock = threading.Lock()
        self.refs: dict[str, int] = {}
        self.parent: dict[str, str | None] = {}

    def adopt(self, image_id: str, parent: str | None) -> None:
        """Own a new snapshot image (count 0) that keeps ``parent`` alive."""
        with self.lock:
            self.refs[image_id] = 0
            self.parent[image_id] = parent if parent in self.refs else None
            if self.parent[image_id]:
                self.refs[parent] += 1  # type: ignore[index]

    def hold(self, image_id: str) -> None:
        """One more holder of ``image_id`` (if it is a snapshot image this process owns)."""
        with self.lock:
            if image_id in self.refs:
                self.refs[image_id] += 1

    def drop(self, image_id: str | None) -> None:
        """One holder fewer; remove the image with the last, then its parent's hold."""
        while image_id:
            with self.lock:
                if image_id not in self.refs:
                    return
                self.refs[image_id] -= 1
                if self.refs[image_id] > 0:
                    return
                del self.refs[image_id]
                parent = self.parent.pop(image_id, None)
                IMAGE_INFO.get(id(self.client), {}).pop(image_id, None)  # how it ran commands
            try:
                self.client.images.remove(image_id, force=True, noprune=False)
            except Exception:  # pragma: no cover - already gone
                pass
            image_id = parent

    def owned(self) -> int:
        """How many snapshot images are held."""
        with self.lock:
            return len(self.refs)


class ContainerHost(Protocol):
    """What a sandbox needs of the backend that made it (a ``ContainerHost``)."""

    client: Any
    images: ImageRefs
    limits: Limits
    user: str
    snapshot_mode: str
    #: The overlay mode's host side (``docker_overlay.OverlayLayers``); None otherwise.
    overlay: Any

    def default_env(self) -> dict[str, str]:
        """The environment a new shell starts with."""
        ...

    def run_options(self) -> dict[str, Any]:
        """``containers.run`` keywords: least privilege and the resource limits."""
        ...

    def image_info(self, image_id: str) -> ImageInfo:
        """How containers of ``image_id`` run commands."""
        ...

    def later(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` in the background (container and image removals)."""
        ...

    def cgroup_counts(self, container_id: str) -> dict[str, int]:
        """The container's cgroup event counters (OOM kills, pids limit hits)."""
        ...

    def commit(self, box: Container) -> str:
        """A snapshot image of ``box``'s container; its id."""
        ...

    def from_snapshot(self, snap: SandboxSnapshot) -> DockerSandbox:
        """A new sandbox in ``snap``'s state."""
        ...


#: Shell code that resolves "$1" (links followed) into $p and exits 3 if it leaves /testbed.
INSIDE_WORKDIR = (
    'p=$(realpath -m -- "$1") || exit 1; case "$p" in /testbed|/testbed/*) ;; *) exit 3;; esac; '
)


# ------------------------------------------------------------------- git mode code

# The snapshot code is the git backend's own (gitsnap: nested repositories, FIFOs, hard
# links, .git files, modes and times), run by the container's python3 as root.
_GIT_DRIVER = r"""
import subprocess, sys
S = "/var/lib/branchgym"
def git(*a, work, index=None, stdin=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_DIR=S + "/snap.git", GIT_WORK_TREE=work,
               GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL="/dev/null")
    if index is not None:
        env["GIT_INDEX_FILE"] = index
    r = subprocess.run(["git", *a], cwd=work, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, input=None if stdin is None else stdin.encode())
    if r.returncode:
        sys.exit("git " + " ".join(a) + ": " + r.stderr.decode(errors="replace"))
    return r.stdout.decode(errors="surrogateescape")
if not os.path.isdir(S + "/snap.git"):
    os.makedirs(S + "/m", exist_ok=True)
    os.makedirs(S + "/idx", exist_ok=True)
    os.chmod(S, 0o700)
    subprocess.run(["git", "init", "-q", "--bare", S + "/snap.git"], check=True)
    subprocess.run(["git", "--git-dir", S + "/snap.git", "config", "gc.auto", "0"], check=True)
if sys.argv[1] == "snapshot":
    trees, man = snapshot("/testbed", git, S + "/idx")
    blob = json.dumps({"trees": trees, "manifest": man}, sort_keys=True)
    mid = hashlib.sha1(blob.encode()).hexdigest()
    with open(S + "/m/" + mid + ".json", "w") as f:
        f.write(blob)
    print(mid)
else:
    with open(S + "/m/" + sys.argv[2] + ".json") as f:
        m = json.load(f)
    restore("/testbed", m["trees"], m["manifest"], git, S + "/idx")
    # read-tree ran as root: what it wrote belongs to root; give it back to the agent.
    uid, _, gid = sys.argv[3].partition(":")
    uid, gid = int(uid), int(gid or uid)
    for top, ds, fs in os.walk("/testbed"):
        for name in [top] + [os.path.join(top, n) for n in ds + fs]:
            st = os.lstat(name)
            if (st.st_uid, st.st_gid) != (uid, gid):
                os.lchown(name, uid, gid)
"""
_GIT_SNAPSHOT = GITSNAP_SOURCE + _GIT_DRIVER


# --------------------------------------------------------------------- snapshots


class DockerSnapshot(SandboxSnapshot):
    """A committed image (``commit`` mode)."""

    kind = "container"
    backend = "docker"

    def __init__(self, images: ImageRefs, image_id: str, client: Any) -> None:
        """Hold ``image_id`` until released."""
        images.hold(image_id)
        self.image_id = image_id
        super().__init__(lambda: images.drop(image_id), lambda: _layer_size(client, image_id))


def _layer_size(client: Any, image_id: str) -> int:
    try:
        return int(client.api.history(image_id)[0].get("Size", 0))
    except Exception:
        return 0


class Container:
    """A container with a reference count (the sandbox, and git snapshots taken in it)."""

    def __init__(self, backend: ContainerHost, image_id: str, **run: Any) -> None:
        """Start it; ``run``: more ``containers.run`` keywords (the overlay mode's mounts)."""
        self.backend = backend
        self.image_id = image_id
        backend.images.hold(image_id)
        try:
            self.c = backend.client.containers.run(
                image_id,
                ["sleep", "infinity"],
                detach=True,
                network_mode="none",
                working_dir=WORKDIR,
                hostname="sandbox",
                labels=owner_labels(),
                **{**backend.run_options(), **run},
            )
        except Exception:
            backend.images.drop(image_id)
            raise
        self.refs = 1
        self.lock = threading.Lock()
        self.info = backend.image_info(image_id)
        #: The container's ``sleep`` (pid in its namespace), which a root command's
        #: clean-up must spare: ``kill -9 -1`` as root would stop the container.
        self.main_pid = 0
        if self.info.user.split(":")[0] == "0":
            self.main_pid = self._main_pid()

    def _main_pid(self) -> int:
        api = self.backend.client.api
        # Right after the start, init's only child (kernels without the children file:
        # the process whose parent is init, found in /proc/*/stat).
        script = (
            "cat /proc/1/task/1/children 2>/dev/null && exit; for d in /proc/[0-9]*; do "
            'read -r pid comm state ppid rest < "$d/stat" && [ "$ppid" = 1 ] && echo "$pid"; '
            "done; true"
        )
        argv = ["bash", "-c", script]
        ex = api.exec_create(self.c.id, argv, stdout=True, stderr=False, user="0")
        words = api.exec_start(ex["Id"]).split()
        if len(words) != 1 or not words[0].isdigit():
            self.drop()
            raise SandboxError(
                f"cannot find the container's main process (pid 1's children: {words!r})"
            )
        return int(words[0])

    def hold(self) -> None:
        """One more holder (a git snapshot taken in it)."""
        with self.lock:
            self.refs += 1

    def drop(self) -> None:
        """One holder fewer; the last one removes the container (in the background)."""
        with self.lock:
            self.refs -= 1
            gone = self.refs == 0
        if gone:
            self.backend.later(self._remove)

    def _remove(self) -> None:
        try:
            self.c.remove(force=True)
        finally:
            self.backend.images.drop(self.image_id)


class DockerGitSnapshot(SandboxSnapshot):
    """Trees inside a container (``git`` mode); keeps that container alive."""

    kind = "container+git"
    backend = "docker-git"

    def __init__(self, container: Container, manifest_id: str) -> None:
        """Hold ``container`` until released."""
        container.hold()
        self.container = container
        self.manifest_id = manifest_id
        super().__init__(container.drop, lambda: 0)


# ----------------------------------------------------------------------- sandbox


class DockerSandbox(Sandbox):
    """A container with the repository at /testbed; see the module docstring."""

    def __init__(self, backend: ContainerHost, image_id: str) -> None:
        """Start a container from ``image_id``."""
        super().__init__()
        self.b = backend
        self.kind = "container+git" if backend.snapshot_mode == "git" else "container"
        self.backend = "docker-git" if backend.snapshot_mode == "git" else "docker"
        self.box = Container(backend, image_id)

    @property
    def base_ref(self) -> str | None:
        """The commit ``/testbed`` was at in a SWE-bench image (None: the task's base commit).

        SWE-bench's images hold the task's base commit plus a setup commit of their own
        (what installing the repository changed); a submission is the diff against it.
        """
        return self.box.info.head

    def default_env(self) -> dict[str, str]:
        """The environment a new shell starts with: the image's (``testbed`` active) or ours."""
        if self.box.info.env is not None:
            return dict(self.box.info.env)
        return self.b.default_env()

    # -- commands -----------------------------------------------------------------
    def exec(
        self,
        command: str,
        *,
        cwd: str = WORKDIR,
        env: Mapping[str, str] | None = None,
        timeout: float | None = 60.0,
    ) -> ExecResult:
        """Run ``bash -c`` through ``docker exec`` (``timeout`` kills it inside the container)."""
        self._check_open()
        env = dict(self.default_env() if env is None else env)
        script = f"cd -- {shlex.quote(cwd)} || exit 1\n{command}"
        run = (
            "timeout -k 5 " + f"{timeout:g}" + ' bash -c "$1"'
            if timeout is not None
            else 'bash -c "$1"'
        )
        # When the command ends (or times out), everything it left running dies with it.
        kill = "kill -9 -1 2>/dev/null"
        if self.box.main_pid:  # root: every process but init, the container's sleep and us
            kill = (
                "for _ in 1 2 3; do for d in /proc/[0-9]*; do p=${d#/proc/}; case $p in "
                f"1|{self.box.main_pid}|$$) ;; *) kill -9 $p 2>/dev/null;; esac; done; done"
            )
        # One stream, merged where it is written, as the local backends' one pipe: docker
        # exec copies stdout and stderr in separate frames, so a stderr line could land in
        # the middle of a stdout line (seen under load: a test's PASSED line cut in two by
        # the eval script's `set -x` trace, and a log parser missing that test).
        wrapper = f"exec 2>&1; {run}; rc=$?; {kill}; exit $rc"
        argv = ["env", "-i", *(f"{k}={v}" for k, v in env.items())]
        argv += ["bash", "-c", wrapper, "branchgym", script]
        before = self.b.cgroup_counts(self.box.c.id)
        res = self._exec(argv, timeout, user=self.box.info.user)
        return dataclasses.replace(res, limit=self._limit_hit(res, before))

    def _limit_hit(self, res: ExecResult, before: dict[str, int]) -> str:
        after = self.b.cgroup_counts(self.box.c.id)
        return self.b.limits.explain(
            res.exit_code,
            res.output,
            oom=after.get("oom_kill", 0) > before.get("oom_kill", 0),
            pids_max=after.get("pids_max", 0) > before.get("pids_max", 0),
            enospc="disk",  # /tmp is part of the container's writable layer
        )

    def _exec(
        self, argv: list[str], timeout: float | None, stderr: bool = True, user: str = "0"
    ) -> ExecResult:
        """Run ``argv`` in the container as ``user`` (root for branchgym's own commands)."""
        api = self.b.client.api
        t0 = time.perf_counter()
        ex = api.exec_create(self.box.c.id, argv, stdout=True, stderr=stderr, user=user)
        chunks, size, dropped = [], 0, 0
        cap = self.b.limits.output
        for chunk in api.exec_start(ex["Id"], stream=True):
            if size < cap:
                chunks.append(chunk)
                size += len(chunk)
            else:
                dropped += len(chunk)
        rc = api.exec_inspect(ex["Id"])["ExitCode"]
        seconds = time.perf_counter() - t0
        timed_out = timeout is not None and rc in (124, 137) and seconds >= timeout * 0.95
        return ExecResult(
            b"".join(chunks), int(rc if rc is not None else -1), timed_out, dropped, seconds
        )

    def read(self, path: str) -> bytes:
        """A file's bytes (``cat`` in the container; links must stay inside /testbed)."""
        self._check_open()
        full = f"{WORKDIR}/{inside_workdir(path)}"
        res = self._exec(
            ["bash", "-c", INSIDE_WORKDIR + 'cat -- "$p"', "read", full], 60.0, stderr=False
        )
        if res.exit_code == 3:
            raise SandboxError(f"{path!r} resolves outside the repository (through a symlink)")
        if res.exit_code != 0:
            raise SandboxError(f"cannot read {path!r} in the container")
        return res.output

    def write(self, path: str, data: bytes, mode: int | None = None) -> None:
        """Create or replace a file (a tar archive put into the container)."""
        self._check_open()
        if not isinstance(data, bytes | bytearray):
            raise SandboxError(f"write() takes bytes, got {type(data).__name__}")
        rel = inside_workdir(path)
        parent, name = os.path.split(f"{WORKDIR}/{rel}")
        check = (
            'mkdir -p -- "$1" || exit 1; ' + INSIDE_WORKDIR + '[ ! -L "$p/$2" ] || '
            '{ t=$(realpath -m -- "$p/$2"); case "$t" in /testbed/*) ;; *) exit 3;; esac; }'
        )
        argv = ["bash", "-c", check, "write", parent, name]
        res = self._exec(argv, 60.0, user=self.box.info.user)
        if res.exit_code == 3:
            raise SandboxError(f"{path!r} resolves outside the repository (through a symlink)")
        if res.exit_code != 0:
            raise SandboxError(f"cannot write {path!r} in the container: {res.text[-300:]}")
        buf = io.BytesIO()
        uid, _, gid = self.box.info.user.partition(":")
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(name)
            info.uid, info.gid = int(uid or 0), int(gid or uid or 0)
            info.size = len(data)
            info.mode = 0o644 if mode is None else mode
            info.mtime = int(time.time())
            tar.addfile(info, io.BytesIO(bytes(data)))
        if not self.box.c.put_archive(parent, buf.getvalue()):
            raise SandboxError(f"could not write {path!r} into the container")

    def tree_digest(self) -> str:
        """Hash of /testbed, by the same code as the local backends."""
        self._check_open()
        code = TREE_DIGEST_SOURCE + f"\nprint(tree_digest({WORKDIR!r}))\n"
        res = self._exec(["python3", "-c", code], 300.0)
        if res.exit_code != 0:
            raise SandboxError(f"tree digest failed in the container: {res.text[-500:]}")
        return res.text.strip()

    # -- snapshots --------------------------------------------------------------
    def snapshot(self) -> SandboxSnapshot:
        """``commit`` the container, or record git trees inside it."""
        self._check_open()
        if self.b.snapshot_mode == "git":
            res = self._exec(["python3", "-c", _GIT_SNAPSHOT, "snapshot"], 600.0)
            if res.exit_code != 0:
                raise SandboxError(f"in-container git snapshot failed: {res.text[-1000:]}")
            return DockerGitSnapshot(self.box, res.text.strip().splitlines()[-1])
        return DockerSnapshot(self.b.images, self.b.commit(self.box), self.b.client)

    def restore(self, snap: SandboxSnapshot) -> None:
        """A container from the snapshot's image (old one removed in the background)."""
        self._check_open()
        if isinstance(snap, DockerGitSnapshot) and self.b.snapshot_mode == "git":
            snap.check()
            if snap.container is not self.box:
                image = self.b.commit(snap.container)
                self._swap(image)
            self._git_restore(snap.manifest_id)
            return
        if isinstance(snap, DockerSnapshot) and self.b.snapshot_mode == "commit":
            snap.check()
            self._swap(snap.image_id)
            return
        raise SandboxError(f"a {self.kind} sandbox cannot restore a {snap.kind} snapshot")

    def _git_restore(self, manifest_id: str) -> None:
        argv = ["python3", "-c", _GIT_SNAPSHOT, "restore", manifest_id, self.box.info.user]
        res = self._exec(argv, 600.0)
        if res.exit_code != 0:
            raise SandboxError(f"in-container git restore failed: {res.text[-1000:]}")

    def _swap(self, image_id: str) -> None:
        old = self.box
        self.box = Container(self.b, image_id)
        old.drop()

    def fork(self, snap: SandboxSnapshot | None = None) -> DockerSandbox:
        """A new container in ``snap``'s state (default: this one's state now)."""
        self._check_open()
        if snap is None:
            with self.snapshot() as now:
                return self.fork(now)
        return self.b.from_snapshot(snap)

    def close(self) -> None:
        """Remove the container (in the background; ``backend.wait_idle()`` waits)."""
        if self.closed:
            return
        self.closed = True
        self.box.drop()

    def resources(self) -> dict[str, int]:
        """Snapshot images this process owns."""
        return {"images": self.b.images.owned()}
