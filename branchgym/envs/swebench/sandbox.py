"""The ``Sandbox`` interface every SWE-bench backend implements, and what they share.

A sandbox is a repository at ``/testbed`` in which shell commands run without network
access. Its state can be saved (:meth:`Sandbox.snapshot`), brought back
(:meth:`Sandbox.restore`) and branched into an independent sibling (:meth:`Sandbox.fork`).
A :class:`SandboxSnapshot` owns whatever holds the saved state (overlay layers, git
trees, images) and frees it on :meth:`SandboxSnapshot.release`; a sandbox frees its own
resources (mounts, directories, containers) on :meth:`Sandbox.close`.

Backends: :mod:`~branchgym.envs.swebench.local` (overlayfs + bubblewrap, or git trees
where mounting is not allowed) and :mod:`~branchgym.envs.swebench.docker_backend`.
"""

from __future__ import annotations

import abc
import dataclasses
import os
import posixpath
import selectors
import signal
import stat
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from branchgym.error import SandboxError, SnapshotReleasedError

__all__ = [
    "ExecResult",
    "Sandbox",
    "SandboxSnapshot",
    "WORKDIR",
    "default_env",
    "tree_digest",
    "TREE_DIGEST_SOURCE",
    "run_captured",
    "inside_workdir",
]

#: Where the repository is inside every sandbox (SWE-bench's convention).
WORKDIR = "/testbed"

#: Bytes of command output kept from the start, and from the end, of a huge output.
CAPTURE_HEAD = 2 << 20
CAPTURE_TAIL = 256 << 10


@dataclasses.dataclass(frozen=True)
class ExecResult:
    """What one command did.

    Attributes:
        output: stdout and stderr, interleaved as written (capped: see ``dropped``).
        exit_code: The exit status (124 after a timeout, like coreutils ``timeout``).
        timed_out: The command ran past its timeout and was killed.
        dropped: Bytes dropped from the middle of an output larger than the capture cap.
        seconds: Wall-clock duration.
        limit: The resource limit the command hit (``"memory limit 2 GiB"``), if any.
    """

    output: bytes
    exit_code: int
    timed_out: bool = False
    dropped: int = 0
    seconds: float = 0.0
    limit: str = ""

    @property
    def text(self) -> str:
        """The output decoded as UTF-8 (undecodable bytes replaced)."""
        return self.output.decode("utf-8", errors="replace")


def default_env(path: str | None = None, home: str = "/root") -> dict[str, str]:
    """The environment commands start with: a predictable, non-interactive shell.

    Python writes no bytecode (so running tests adds no ``__pycache__`` to the state or
    the patch), pagers are off, and git has an identity so ``git commit`` works.
    """
    return {
        "PATH": path or "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": home,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TERM": "dumb",
        "PAGER": "cat",
        "GIT_PAGER": "cat",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "GIT_AUTHOR_NAME": "agent",
        "GIT_AUTHOR_EMAIL": "agent@sandbox.invalid",
        "GIT_COMMITTER_NAME": "agent",
        "GIT_COMMITTER_EMAIL": "agent@sandbox.invalid",
    }


def inside_workdir(path: str, workdir: str = WORKDIR) -> str:
    """Normalise ``path`` (absolute, or relative to ``workdir``) and check it stays inside.

    Returns:
        The path relative to ``workdir`` (``""`` for the root itself).

    Raises:
        SandboxError: the path leaves the repository.
    """
    if not isinstance(path, str) or not path or "\x00" in path:
        raise SandboxError(f"expected a file path inside {workdir}, got {path!r}")
    full = posixpath.normpath(path if path.startswith("/") else posixpath.join(workdir, path))
    if full != workdir and not full.startswith(workdir + "/"):
        raise SandboxError(
            f"{path!r} is outside the repository; read() and write() take paths inside "
            f"{workdir} (use exec() for anything else)."
        )
    return full[len(workdir) + 1 :] if full != workdir else ""


class SandboxSnapshot:
    """A saved sandbox state. It owns the resources that hold it until :meth:`release`.

    Attributes:
        kind: ``overlay``, ``git``, ``container`` or ``container+git``.
        backend: Name of the backend family that can restore it.
    """

    kind: str = "sandbox"
    backend: str = ""

    def __init__(self, release: Callable[[], None], nbytes: Callable[[], int]) -> None:
        """Wrap the backend's ``release`` and disk-cost functions.

        ``release`` must not refer to this object: it also runs if the snapshot is
        garbage-collected unreleased, or at interpreter exit, so resources never leak.
        """
        self._finalizer = weakref.finalize(self, release)
        self._nbytes = nbytes
        self._released = False
        self._lock = threading.Lock()

    @property
    def released(self) -> bool:
        """True once released."""
        return self._released

    def check(self) -> None:
        """Raise :class:`SnapshotReleasedError` if released."""
        if self._released:
            raise SnapshotReleasedError(
                f"this {self.kind} sandbox snapshot was released; take a new snapshot, and "
                "release snapshots only after their last restore or fork."
            )

    @property
    def nbytes(self) -> int:
        """Disk bytes this snapshot adds (its layer, new objects or image layer)."""
        return 0 if self._released else int(self._nbytes())

    def release(self) -> None:
        """Free the resources. Idempotent."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._finalizer()  # runs the backend's release exactly once

    def __enter__(self) -> SandboxSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Sandbox(abc.ABC):
    """A repository at ``/testbed`` where shell commands run, with snapshots.

    Every backend implements this interface; the SWE-bench env only uses it.
    Commands get exactly the environment they are given (no inherited variables) and
    no network.
    """

    #: Snapshot kind this sandbox produces.
    kind: str = "sandbox"
    #: Backend family name (snapshots restore only within their family).
    backend: str = ""
    #: The repository's path inside the sandbox.
    workdir: str = WORKDIR

    def __init__(self) -> None:
        """Start open."""
        self.closed = False

    @abc.abstractmethod
    def exec(
        self,
        command: str,
        *,
        cwd: str = WORKDIR,
        env: Mapping[str, str] | None = None,
        timeout: float | None = 60.0,
    ) -> ExecResult:
        """Run ``bash -c command`` in ``cwd`` with exactly ``env`` (default: :func:`default_env`).

        Output is stdout and stderr together. A command past ``timeout`` seconds is
        killed with everything it started, and the result says ``timed_out``.
        """

    @abc.abstractmethod
    def read(self, path: str) -> bytes:
        """The bytes of a file inside ``/testbed``."""

    @abc.abstractmethod
    def write(self, path: str, data: bytes, mode: int | None = None) -> None:
        """Create or replace a file inside ``/testbed`` (parents created)."""

    @abc.abstractmethod
    def snapshot(self) -> SandboxSnapshot:
        """Save the current state; the sandbox goes on unchanged."""

    @abc.abstractmethod
    def restore(self, snap: SandboxSnapshot) -> None:
        """Bring back ``snap``'s state (a snapshot of this backend family, any sandbox)."""

    @abc.abstractmethod
    def fork(self, snap: SandboxSnapshot | None = None) -> Sandbox:
        """A new, independent sandbox in ``snap``'s state (default: this one's state now)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free every resource this sandbox holds. Idempotent."""

    @abc.abstractmethod
    def tree_digest(self) -> str:
        """Hash of ``/testbed``: paths, types, permissions, link targets and contents."""

    def resources(self) -> dict[str, int]:
        """Counts of external resources held by this sandbox (for leak checks)."""
        return {}

    def _check_open(self) -> None:
        if self.closed:
            raise SandboxError(
                f"this {self.backend} sandbox is closed; create a new one (env.reset())."
            )

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------- tree digests

#: Source of the digest function, so a backend can run the identical code remotely
#: (``python3 -c``) and digests agree across backends for identical trees.
TREE_DIGEST_SOURCE = r"""
import hashlib, os, stat, sys

def tree_digest(root):
    h = hashlib.blake2b(digest_size=16)
    stack = [""]
    while stack:
        rel = stack.pop()
        full = os.path.join(root, rel) if rel else root
        try:
            names = sorted(os.listdir(full))
        except OSError:
            continue
        for name in names:
            r = f"{rel}/{name}" if rel else name
            p = os.path.join(full, name)
            st = os.lstat(p)
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISDIR(st.st_mode):
                h.update(f"d {r} {mode:o}\0".encode("utf-8", "surrogateescape"))
                stack.append(r)
            elif stat.S_ISLNK(st.st_mode):
                h.update(f"l {r} {os.readlink(p)}\0".encode("utf-8", "surrogateescape"))
            elif stat.S_ISREG(st.st_mode):
                fh = hashlib.blake2b(digest_size=16)
                with open(p, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        fh.update(chunk)
                h.update(f"f {r} {mode:o} {fh.hexdigest()}\0".encode("utf-8", "surrogateescape"))
            else:
                h.update(f"o {r} {mode:o} {st.st_rdev}\0".encode("utf-8", "surrogateescape"))
    return h.hexdigest()
"""

_ns: dict[str, Any] = {}
exec(compile(TREE_DIGEST_SOURCE, "<tree_digest>", "exec"), _ns)  # noqa: S102 - our own code


def tree_digest(root: str | os.PathLike[str]) -> str:
    """Hash a directory tree: paths, types, permission bits, symlink targets, file contents.

    Times, owners and inode numbers are left out: they differ between faithful copies
    and do not change what commands print (other than ``ls -l``/``stat``).
    """
    return _ns["tree_digest"](os.fspath(root))


def du_bytes(root: str | os.PathLike[str]) -> int:
    """Disk usage of a tree (allocated blocks), without following links."""
    total = 0
    stack = [os.fspath(root)]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                for e in it:
                    st = e.stat(follow_symlinks=False)
                    total += st.st_blocks * 512
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(e.path)
        except FileNotFoundError:
            continue
    return total


# ------------------------------------------------------------------- local processes


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_captured(
    argv: Sequence[str],
    *,
    timeout: float | None,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    stdin: bytes | None = None,
    head_cap: int = CAPTURE_HEAD,
    pass_fds: Sequence[int] = (),
) -> ExecResult:
    """Run ``argv`` with stdout+stderr captured (head and tail kept past the cap).

    On timeout the whole process group is killed (and with it a bubblewrap sandbox's
    PID namespace, since bubblewrap dies with its parent). ``pass_fds`` stay open in
    the child (at the same numbers).
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(env) if env is not None else None,
        cwd=cwd,
        start_new_session=True,
        pass_fds=tuple(pass_fds),
    )
    if stdin is not None:
        assert proc.stdin is not None  # noqa: S101 - set by Popen above
        try:
            proc.stdin.write(stdin)
        except BrokenPipeError:
            pass
        proc.stdin.close()
    assert proc.stdout is not None  # noqa: S101 - set by Popen above
    head = bytearray()
    tail = bytearray()
    dropped = 0
    timed_out = False
    deadline = None if timeout is None else t0 + timeout
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    fd = proc.stdout.fileno()
    try:
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.perf_counter())
            if wait is not None and wait == 0.0:
                timed_out = True
                _kill_group(proc)
                deadline = None  # drain what is left after the kill
                continue
            if not sel.select(wait):
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            if len(head) < head_cap:
                take = head_cap - len(head)
                head += chunk[:take]
                chunk = chunk[take:]
            if chunk:
                tail += chunk
                if len(tail) > CAPTURE_TAIL:
                    cut = len(tail) - CAPTURE_TAIL
                    dropped += cut
                    del tail[:cut]
    finally:
        sel.close()
        proc.stdout.close()
    rc = proc.wait()
    if timed_out:
        rc = 124
    return ExecResult(bytes(head + tail), rc, timed_out, dropped, time.perf_counter() - t0)
