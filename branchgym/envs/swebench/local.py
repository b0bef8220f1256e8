"""Local sandboxes for machines without Docker: overlayfs layer stacks, or git trees.

**Overlay** (:class:`OverlaySandbox`, snapshot kind ``overlay``). The repository checkout
is the bottom, read-only layer. A sandbox is an overlay mount of a fresh upper directory
(on a tmpfs of its own, sized by the disk quota) over a stack of frozen layers.
``snapshot()`` unmounts, moves the upper layer's tmpfs mount into the layer store (no data
is copied), remounts it read-only as a new frozen layer and mounts again with a fresh,
empty tmpfs on top; ``restore()`` remounts over the snapshot's stack with a fresh upper
(the discarded changes go with their tmpfs); ``fork()`` mounts a new upper over the same
stack. Cost is a few system calls, independent of repository size. Layers are
reference-counted (snapshots and live mounts hold them) and deleted with their last
holder. Stacks deeper than ``max_layers`` are squashed (the frozen layers above the
checkout are copied into one, whiteouts, opaque directories, renamed directories, FIFOs
and hard links kept), so the kernel's layer and option-length limits are never reached.
Where the kernel allows, mounts use ``redirect_dir=on`` (a directory from a frozen layer
can be renamed) and, over layers holding hard links, ``index=on`` (a write through one
name of a frozen hard link shows through the others); docs/swebench.md, "Snapshots".

**Git** (:class:`GitSandbox`, kind ``git``), where mounting is not allowed (no
``CAP_SYS_ADMIN``, or no overlayfs). The repository is a plain directory. A snapshot
records, in a private object store, a tree per unit (``GIT_INDEX_FILE=<private index>
git add -A -f; git write-tree``; the units are the folder, each nested repository and
each ``.git`` folder) and a manifest of what git does not keep (folders, modes, times,
FIFOs, ``.git`` files, hard links): :mod:`~branchgym.envs.swebench.gitsnap`, which the
docker-git backend runs too. ``restore()`` refreshes the private indexes and runs ``git
read-tree --reset -u`` per unit, which rewrites only the files that differ, then applies
the manifest. Both steps are incremental: git re-hashes only files whose stat data
changed.

Rejected approaches (tests show why): ``git stash create`` ignores untracked files, so a
restore keeps files created after the snapshot and loses untracked files from before it;
hard-link copies (``cp -al``) share inodes with the live tree, so an in-place append
(``echo >> f``) changes the snapshot too.

Commands run under **bubblewrap** with least privilege: uid 1000 in a user namespace of
their own with every capability dropped and no nested user namespaces (mount, umount and
remount fail), no network (``--unshare-net``), their own PID namespace (nothing outlives a
command), only ``/usr``, a list of ``/etc`` files without secrets, the toolchain (the
interpreter's installation) read-only, the repository at ``/testbed`` read-write and a
private size-limited ``/tmp``. The host's home folders, the project, the branchgym cache
(gold patches, pristine checkouts), ``repos_dir`` and the sandbox store are not in the
sandbox at all. Each command runs in memory and pids cgroups of its own, with CPU-time and
file-size rlimits (:mod:`~branchgym.envs.swebench.limits`); an overlay sandbox's upper
layer is a tmpfs of the disk quota. The threat model is in docs/swebench.md.
"""

from __future__ import annotations

import atexit
import copy
import ctypes
import ctypes.util
import dataclasses
import errno
import functools
import hashlib
import itertools
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from branchgym.envs.swebench.gitsnap import gitsnap
from branchgym.envs.swebench.limits import Limits, cgroups, pid_alive
from branchgym.envs.swebench.repo_env import (
    RepoEnvironment,
    installable,
    repo_environment,
    resolve_python_env,
)
from branchgym.envs.swebench.sandbox import (
    WORKDIR,
    ExecResult,
    Sandbox,
    SandboxSnapshot,
    default_env,
    du_bytes,
    inside_workdir,
    run_captured,
    tree_digest,
)
from branchgym.envs.swebench.tasks import SWEBenchTask, cache_root
from branchgym.error import (
    SandboxConfigError,
    SandboxError,
    SandboxSetupError,
    SandboxUnavailableError,
)

__all__ = [
    "wait_for_cleanup",
    "LocalBackend",
    "OverlaySandbox",
    "GitSandbox",
    "overlay_support",
    "redirect_dir_support",
    "index_support",
    "bwrap_support",
    "work_root",
    "list_local_mounts",
]

_MNT_DETACH = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p,) * 3 + (ctypes.c_ulong, ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


# ---------------------------------------------------------------------- mounting


def _mount_overlay(
    target: Path,
    lowers: tuple[str, ...],
    upper: Path,
    work: Path,
    redirect_dir: bool = False,
    index: bool = False,
) -> None:
    # metacopy off: full copy-ups, so a frozen upper layer holds every file it changed.
    # redirect_dir=on lets rename(2) move a folder of a lower layer (else EXDEV): the
    # upper layer records where it came from (an xattr the kernel follows when the layer
    # is frozen below another; _squash_into resolves it). index=on: a write to one name
    # of a hard link from a lower layer copies the inode up once, for every name.
    redirect = "on" if redirect_dir else "off"
    data = (
        f"lowerdir={':'.join(lowers)},upperdir={upper},workdir={work},"
        f"redirect_dir={redirect},index={'on' if index else 'off'},metacopy=off"
    ).encode()
    if _libc.mount(b"overlay", os.fsencode(target), b"overlay", 0, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount overlay on {target}: {os.strerror(err)}")


_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_MOVE = 1, 2, 4, 32, 8192


def _mount_tmpfs(target: Path, size: int | None) -> None:
    """A tmpfs of ``size`` bytes (None: the kernel's default, half of memory) at ``target``."""
    opts = "mode=755" + (f",size={size}" if size is not None else "")
    if (
        _libc.mount(b"tmpfs", os.fsencode(target), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts.encode())
        != 0
    ):
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs on {target}: {os.strerror(err)}")


def _move_mount(source: Path, target: Path) -> None:
    """Move the mount at ``source`` to ``target`` (the files stay where they are)."""
    if _libc.mount(os.fsencode(source), os.fsencode(target), None, _MS_MOVE, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"move mount {source} -> {target}: {os.strerror(err)}")
    # A frozen layer is never written again: make that a kernel guarantee.
    flags = _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV
    _libc.mount(b"tmpfs", os.fsencode(target), b"tmpfs", flags, None)


def _umount(target: Path) -> None:
    if _libc.umount2(os.fsencode(target), 0) == 0:
        return
    err = ctypes.get_errno()
    if err == errno.EINVAL:  # not mounted
        return
    # EBUSY: something still uses it (should not happen: commands die with their
    # namespace). Detach lazily so the sandbox can go on; the kernel frees it later.
    if _libc.umount2(os.fsencode(target), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err != errno.EINVAL:
            raise OSError(err, f"umount {target}: {os.strerror(err)}")


def list_local_mounts(prefix: str | os.PathLike[str] | None = None) -> list[str]:
    """Mount points (from /proc/self/mountinfo) under ``prefix`` (default: the work root)."""
    root = os.fspath(prefix or work_root())
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                point = line.split()[4].replace("\\040", " ")
                if point == root or point.startswith(root.rstrip("/") + "/"):
                    out.append(point)
    except OSError:
        pass
    return out


def work_root() -> Path:
    """Where sandboxes keep their layers and mount points (``$BRANCHGYM_SANDBOX_DIR``)."""
    env = os.environ.get("BRANCHGYM_SANDBOX_DIR")
    return Path(env) if env else Path("/tmp/branchgym-sandboxes")


_SUPPORT: dict[str, tuple[bool, str]] = {}


def overlay_support(root: Path | None = None) -> tuple[bool, str]:
    """Can this process mount overlayfs here? ``(ok, reason)``, cached per root.

    It tries for real (a tiny overlay in the work root): capabilities, user namespaces,
    seccomp filters and the file system under the work root all decide.
    """
    root = Path(root or work_root())
    key = f"overlay:{root}"
    if key in _SUPPORT:
        return _SUPPORT[key]
    probe = root / f"probe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    result = (True, "overlayfs mounts work")
    try:
        for d in ("l", "u", "w", "m"):
            (probe / d).mkdir(parents=True)
        (probe / "l" / "f").write_text("x")
        _mount_overlay(probe / "m", (str(probe / "l"),), probe / "u", probe / "w")
        try:
            ok = (probe / "m" / "f").read_text() == "x"
        finally:
            _umount(probe / "m")
        if not ok:
            result = (False, "an overlay mount did not show its lower layer")
    except OSError as exc:
        result = (False, f"cannot mount overlayfs in {root}: {exc.strerror or exc}")
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    _SUPPORT[key] = result
    return result


def _overlay_probe(root: Path | None, key: str, setup: str, trial: Callable[[Path], bool]) -> bool:
    """Mount a throwaway overlay (``setup`` dirs of ``l/u/w/m``), run ``trial``; cached."""
    root = Path(root or work_root())
    key = f"{key}:{root}"
    if key not in _SUPPORT:
        probe = root / f"probe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        ok = False
        try:
            for d in (setup, "u", "w", "m"):
                (probe / d).mkdir(parents=True)
            ok = trial(probe)
        except OSError:
            pass
        finally:
            shutil.rmtree(probe, ignore_errors=True)
        _SUPPORT[key] = (ok, "")
    return _SUPPORT[key][0]


def redirect_dir_support(root: Path | None = None) -> bool:
    """Can overlayfs here rename folders of lower layers (``redirect_dir=on``); cached."""

    def trial(probe: Path) -> bool:
        _mount_overlay(probe / "m", (str(probe / "l"),), probe / "u", probe / "w", True)
        try:
            os.rename(probe / "m" / "d", probe / "m" / "e")  # EXDEV without redirects
            return True
        except OSError:
            return False
        finally:
            _umount(probe / "m")

    return _overlay_probe(root, "redirect", "l/d", trial)


def index_support(root: Path | None = None) -> bool:
    """Does overlayfs here mount with ``index=on`` (hard links survive copy-up)? Cached."""

    def trial(probe: Path) -> bool:
        (probe / "l" / "a").write_text("a")
        os.link(probe / "l" / "a", probe / "l" / "b")
        _mount_overlay(probe / "m", (str(probe / "l"),), probe / "u", probe / "w", index=True)
        try:
            with open(probe / "m" / "a", "a") as f:
                f.write("b")
            return (probe / "m" / "b").read_text() == "ab"
        finally:
            _umount(probe / "m")

    return _overlay_probe(root, "index", "l", trial)


def _link_groups(root: str) -> list[tuple[str, ...]]:
    """Names (relative to ``root``) that share an inode, for files with several names."""
    groups: dict[int, list[str]] = {}
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(os.path.join(root, rel)) as it:
            for e in it:
                r = f"{rel}/{e.name}" if rel else e.name
                st = e.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    stack.append(r)
                elif stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                    groups.setdefault(st.st_ino, []).append(r)
    return [tuple(sorted(g)) for g in groups.values() if len(g) > 1]


def bwrap_support() -> tuple[bool, str]:
    """Does bubblewrap run here (installed, and allowed to create namespaces)?"""
    if "bwrap" in _SUPPORT:
        return _SUPPORT["bwrap"]
    exe = shutil.which("bwrap")
    if exe is None:
        res = (False, "bubblewrap is not installed (apt-get install bubblewrap)")
    else:
        out = subprocess.run(
            [exe, "--ro-bind", "/", "/", "--unshare-net", "--unshare-pid", "--", "true"],
            capture_output=True,
            text=True,
            check=False,
        )
        res = (out.returncode == 0, out.stderr.strip() or "bubblewrap works")
    _SUPPORT["bwrap"] = res
    return res


# ------------------------------------------------------------------ the work store


def _cleanup_stale(root: Path) -> None:
    """Remove what crashed processes left in the work root (their mounts, their folders)."""
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return
    for entry in entries:
        pid, _, _ = entry.name.partition("-")
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        for point in sorted(list_local_mounts(entry), key=len, reverse=True):
            try:
                _umount(Path(point))
            except OSError:
                pass
        if not list_local_mounts(entry):
            shutil.rmtree(entry, ignore_errors=True)


class _Reaper:
    """Deletes folders in a background thread.

    Deleting is slow on some file systems (online discard makes every unlink a device
    command): a restore or a release only renames what it discards into the trash, and
    this thread deletes it. :func:`wait_for_cleanup` (and ``env.close()``) waits for it.
    """

    def __init__(self, trash: Path) -> None:
        self.trash = trash
        self.pending = 0
        self.cond = threading.Condition()
        self.queue: list[Path] = []
        self.thread: threading.Thread | None = None

    def discard(self, path: str | Path) -> None:
        """Move ``path`` to the trash now; delete it soon."""
        dest = self.trash / uuid.uuid4().hex
        try:
            os.rename(path, dest)
        except FileNotFoundError:
            return
        except OSError:  # another file system: delete in place, in the thread
            dest = Path(path)
        with self.cond:
            self.queue.append(dest)
            self.pending += 1
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="branchgym-reaper")
                self.thread.daemon = True
                try:
                    self.thread.start()
                except RuntimeError:  # interpreter shutdown: no new threads; delete now
                    self.thread = None
                    self.queue.remove(dest)
                    self.pending -= 1
                    shutil.rmtree(dest, ignore_errors=True)
            self.cond.notify_all()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.queue:
                    if not self.cond.wait(timeout=5.0):
                        if not self.queue:
                            self.thread = None
                            return
                path = self.queue.pop()
            shutil.rmtree(path, ignore_errors=True)
            with self.cond:
                self.pending -= 1
                self.cond.notify_all()

    def wait(self) -> None:
        """Block until everything discarded so far is deleted."""
        with self.cond:
            while self.pending:
                self.cond.wait()


class _Store:
    """Per-process folder of frozen layers and sandbox directories, with layer refcounts."""

    _instances: dict[str, _Store] = {}
    _lock = threading.Lock()

    def __init__(self, root: Path) -> None:
        self.root = root / f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.layers = self.root / "l"
        self.boxes = self.root / "s"
        self.layers.mkdir(parents=True)
        self.boxes.mkdir()
        (self.root / "trash").mkdir()
        self.reaper = _Reaper(self.root / "trash")
        self.refs: dict[str, int] = {}
        self.links: dict[str, list[tuple[str, ...]]] = {}  # frozen layer -> hard links
        self.lock = threading.RLock()
        self._ids = itertools.count()
        self.git: _GitStore | None = None

    @classmethod
    def get(cls, root: Path | None = None) -> _Store:
        root = Path(root or work_root())
        with cls._lock:
            st = cls._instances.get(str(root))
            # A forked child process must not share its parent's store folder.
            if st is None or not st.root.name.startswith(f"{os.getpid()}-"):
                root.mkdir(parents=True, exist_ok=True)
                _cleanup_stale(root)
                st = cls._instances[str(root)] = _Store(root)
            return st

    def new_id(self) -> str:
        return f"{next(self._ids):x}"

    def option_path(self, path: str) -> str:
        """``path`` as overlayfs's mount options can hold it.

        ``,`` separates options and ``:`` lower layers, so a folder whose name has one
        (a checkout in a cache such as ``/data/a,b``) is named through a link in the
        store, which overlayfs follows.
        """
        if not any(c in path for c in ",:\\"):
            return path
        alias = self.root / "a" / hashlib.blake2b(os.fsencode(path), digest_size=8).hexdigest()
        alias.parent.mkdir(exist_ok=True)
        try:
            os.symlink(path, alias)
        except FileExistsError:
            pass
        return str(alias)

    def new_layer(self) -> Path:
        return self.layers / self.new_id()

    def acquire(self, stack: tuple[str, ...]) -> None:
        with self.lock:
            for layer in stack:
                if layer.startswith(str(self.layers) + "/"):
                    self.refs[layer] = self.refs.get(layer, 0) + 1

    def release(self, stack: tuple[str, ...]) -> None:
        dead = []
        with self.lock:
            for layer in stack:
                if layer in self.refs:
                    self.refs[layer] -= 1
                    if self.refs[layer] == 0:
                        del self.refs[layer]
                        self.links.pop(layer, None)
                        dead.append(layer)
        for layer in dead:
            self.drop_layer(layer)

    def drop_layer(self, layer: str) -> None:
        """Delete a frozen layer: ``<layers>/<id>/u`` on its own tmpfs, or a plain folder."""
        root = Path(layer)
        if root.parent != self.layers:
            root = root.parent
        if os.path.ismount(root):
            try:
                _umount(root)
            except OSError:
                pass
        self.reaper.discard(root)

    def live_layers(self) -> int:
        with self.lock:
            return len(self.refs)


# ------------------------------------------------------------------- command runner


def _hidden_paths() -> list[str]:
    """Host folders commands must never see: the cache and the sandboxes' layers.

    The cache holds gold patches and the pristine checkouts grading starts from. Neither
    is bound; where a bound folder (toolchain or system) contains one, a read-only tmpfs
    covers it (commands have no capability to unmount it).
    """
    return [os.path.realpath(p) for p in (cache_root(), work_root())]


#: Top-level system folders bound read-only (or recreated as the same symlinks).
_SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")

#: Files and folders of /etc that programs need and that hold no secrets (the host's
#: /etc also has shadow, ssh keys, ssl/private, passwords in config files: never bound).
_ETC_ALLOW = (
    "alternatives", "bash.bashrc", "debian_version", "host.conf", "hosts", "inputrc",
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "locale.alias", "localtime", "magic",
    "magic.mime", "mime.types", "nsswitch.conf", "os-release", "profile", "protocols",
    "python3", "python3.11", "python3.12", "python3.13", "services", "shells",
    "terminfo", "timezone",
)  # fmt: skip

#: The uid and gid commands run as, inside their own user namespace (no capabilities).
SANDBOX_UID = 1000

_PASSWD = (
    "root:x:0:0:root:/root:/usr/sbin/nologin\n"
    f"agent:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox user:/tmp:/bin/bash\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
)
_GROUP = f"root:x:0:\nagent:x:{SANDBOX_UID}:\nnogroup:x:65534:\n"


@functools.lru_cache(maxsize=8)
def _system_args(etc_dir: Path) -> tuple[str, ...]:
    """Bubblewrap arguments for the read-only system.

    /usr (and its merged-/usr links), the allowed /etc entries, and a passwd/group that
    name the sandbox user.
    """
    args: list[str] = []
    for name in _SYSTEM_DIRS:
        p = f"/{name}"
        if os.path.islink(p):
            # Relative, so bubblewrap can create mount points through it while it sets up
            # the new root (it resolves an absolute link target against its own root).
            args += ["--symlink", _relative_link(p), p]
        elif os.path.isdir(p):
            args += ["--ro-bind", p, p]
    for name in _ETC_ALLOW:
        p = f"/etc/{name}"
        if os.path.lexists(p):
            args += ["--ro-bind", p, p]
    etc_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("passwd", _PASSWD), ("group", _GROUP)):
        f = etc_dir / name
        if not f.exists():
            f.write_text(text)
        args += ["--ro-bind", str(f), f"/etc/{name}"]
    return tuple(args)  # computed once per store: every command starts with it


def interpreter_paths() -> list[str]:
    """The running interpreter's installation (venv and base), outside /usr.

    Commands and grading run pytest with this interpreter; it is bound read-only at the
    same paths (a venv's ``python`` links into its base installation).
    """
    out: list[str] = []
    for p in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix):
        for path in (p, os.path.realpath(p)):
            path = os.path.normpath(path)
            if path == "/usr" or path.startswith("/usr/") or path == "/":
                continue
            if os.path.isdir(path) and path not in out:
                out.append(path)
    return out


def _covers(outer: str, inner: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def _relative_link(link: str) -> str:
    """``link``'s target, made relative to its folder when it is absolute."""
    target = os.readlink(link)
    if not target.startswith("/"):
        return target
    return os.path.relpath(target, os.path.dirname(link))


def _system_trees() -> list[str]:
    """Host paths the system part of every sandbox shows as they are (read-only)."""
    trees = [f"/{n}" for n in _SYSTEM_DIRS if not os.path.islink(f"/{n}")]
    trees = [t for t in trees if os.path.isdir(t)]
    return trees + [f"/etc/{n}" for n in _ETC_ALLOW if os.path.lexists(f"/etc/{n}")]


#: Paths every bubblewrap sandbox makes itself: a host link at one of them is not made.
_SANDBOX_MADE = ("/tmp", "/var/tmp", "/run", "/etc", WORKDIR)
#: Trees of the sandbox's own (kernel file systems, the repository): nothing is made there.
_SANDBOX_TREES = ("/proc", "/dev", WORKDIR)


def _link_chain(path: str) -> list[tuple[str, str]]:
    """The symbolic links the host follows to resolve ``path``, as (target, link) pairs.

    Each link's folder holds no link itself (the walk stops at the first link of a
    path and continues with its target), so the same link made in a sandbox resolves
    there as on the host.
    """
    out: list[tuple[str, str]] = []
    for _ in range(40):  # the kernel's own limit on links followed
        cur = ""
        parts = [part for part in path.split("/") if part]
        for i, name in enumerate(parts):
            cur += "/" + name
            if os.path.islink(cur):
                target = os.readlink(cur)
                out.append((target, cur))
                path = os.path.normpath(os.path.join(os.path.dirname(cur), target, *parts[i + 1 :]))
                break
        else:
            return out
    return out


def _mount_plan(paths: tuple[str, ...], hidden: tuple[str, ...]) -> tuple[str, ...]:
    """Bubblewrap arguments that show each of ``paths`` read-only at its host path.

    Each path is bound at its real path (no link in it, so bubblewrap can always create
    the mount point: nothing of the host's layout is assumed), and the links the host
    follows to reach it from the name given are made as the same links, so both names
    work, wherever the cache or the interpreter lives (``/var/tmp``, names with spaces,
    a home or cache folder that is a link). A ``hidden`` folder that a bound tree would
    show (the cache under a toolchain or system folder) gets an empty read-only tmpfs,
    and the paths inside it are bound again on top. Computed for every command (a few
    ``stat`` calls): a cache folder made later is hidden as soon as it exists.
    """
    system = _system_trees()
    reals = list(dict.fromkeys(os.path.realpath(p) for p in paths))
    # A path strictly inside a hidden folder (a venv in the cache) is bound after the
    # folder's tmpfs; one that is or holds a hidden folder, before it (the tmpfs wins).
    outside = [r for r in reals if not any(_covers(h, r) and r != h for h in hidden)]
    covered = [
        h for h in hidden if os.path.isdir(h) and any(_covers(t, h) for t in [*system, *outside])
    ]
    inside = [r for r in reals if r not in outside]
    args: list[str] = []
    for r in sorted(outside, key=len):  # parents first: a nested bind stays on top
        args += ["--ro-bind", r, r]
    for h in covered:
        args += ["--tmpfs", h]
    for r in sorted(inside, key=len):
        args += ["--ro-bind", r, r]
    for h in covered:
        args += ["--remount-ro", h]
    visible = [*system, *outside]
    links: dict[str, str] = {}
    for p in paths:
        for target, link in _link_chain(p):
            if link in _SANDBOX_MADE or any(_covers(m, link) for m in _SANDBOX_TREES):
                continue  # the sandbox's own /var/tmp, /proc ...: not the host's
            shown = any(_covers(t, link) for t in visible) and not any(
                _covers(h, link) for h in covered
            )
            if not shown:
                links.setdefault(link, target)
    for link, target in links.items():
        args += ["--symlink", target, link]
    return tuple(args)


#: Mount configurations a sandbox was started with in this process (``_Runner.check``).
_STARTED: set[tuple[object, ...]] = set()


class _Runner:
    """Runs ``bash -c`` with a host folder bound at ``/testbed``, isolated or not.

    Isolated (bubblewrap): an unprivileged user namespace (uid 1000, every capability
    dropped, so mount, umount and remount fail), no network, own PID/IPC/UTS namespaces
    (nothing outlives a command), the system read-only, the toolchain read-only,
    ``/testbed`` read-write, a private size-limited ``/tmp``, and nothing else of the
    host: not its home folders, the project, the branchgym cache, ``repos_dir`` or task
    files. Every command runs in its own memory and pids cgroups with :class:`Limits`.
    """

    def __init__(
        self,
        isolation: str,
        limits: Limits | None = None,
        toolchain: Sequence[str | os.PathLike[str]] = (),
        etc_dir: Path | None = None,
    ) -> None:
        if isolation not in ("auto", "bwrap", "none"):
            raise SandboxError(f"isolation must be 'auto', 'bwrap' or 'none', not {isolation!r}")
        if isolation in ("auto", "bwrap"):
            ok, why = bwrap_support()
            if not ok:
                raise SandboxUnavailableError(
                    f"commands run under bubblewrap (no network, read-only system), but {why}. "
                    "Install it (apt-get install bubblewrap), or pass isolation='none' to run "
                    "commands unisolated, with network, in the repository folder."
                )
            isolation = "bwrap"
        self.isolation = isolation
        self.limits = limits or Limits()
        self.cgroups = cgroups()
        self.toolchain = self._check_toolchain(list(map(os.fspath, toolchain)))
        self.etc_dir = etc_dir or Path(tempfile.mkdtemp(prefix="branchgym-etc-"))
        # The interpreter running branchgym (with pytest) comes first on PATH.
        self.path = f"{os.path.dirname(sys.executable)}:" + default_env()["PATH"]
        #: Source roots (relative) put on PYTHONPATH without isolation (see for_python).
        self.python_roots: tuple[str, ...] = ()
        self._checked = False  # check() passed

    def for_python(self, env: RepoEnvironment) -> _Runner:
        """This runner with a task's own environment: its venv first on PATH, bound read-only.

        Without isolation there is no /testbed for the editable install to point at: the
        repository's source roots go on PYTHONPATH instead.
        """
        runner = copy.copy(self)
        runner.toolchain = list(dict.fromkeys([*self.toolchain, *env.binds]))
        runner.path = f"{env.bin_dir}:{self.path}"
        runner.python_roots = env.roots
        runner._checked = False
        return runner

    @staticmethod
    def _check_toolchain(paths: list[str]) -> list[str]:
        out: list[str] = []
        home = os.path.realpath(os.path.expanduser("~"))
        for p in paths:
            real = os.path.realpath(p)
            if not os.path.isdir(real):
                raise SandboxConfigError(f"toolchain path {p!r} is not a folder")
            if real in ("/", home, "/home", "/root", "/etc", "/var", "/tmp"):
                raise SandboxConfigError(
                    f"toolchain path {p!r} would show a whole system or home folder to the "
                    "agent; name the toolchain's own folder (a venv or conda env)"
                )
            if real not in out:
                out.append(real)
        return out

    def enforced(self) -> dict[str, str]:
        """How each limit is enforced here (or why it is not)."""
        lim = self.limits
        cg = self.cgroups
        out = {}
        if lim.memory is not None:
            out["memory"] = cg.reason if cg.available else f"RLIMIT_AS ({cg.reason})"
        if lim.pids is not None:
            out["pids"] = cg.reason if cg.available else f"not enforced ({cg.reason})"
        if lim.cpu is not None:
            out["cpu"] = "RLIMIT_CPU"
        if lim.tmp is not None:
            out["tmp"] = (
                "tmpfs size" if self.isolation == "bwrap" else "not enforced (no isolation)"
            )
        return out

    def default_env(self) -> dict[str, str]:
        # /tmp is private to each command under bubblewrap; HOME lives there. branchgym's
        # own pytest plugin is not importable inside (the project is not bound).
        env = default_env(self.path, home="/tmp")
        env["PYTEST_ADDOPTS"] = "-p no:branchgym"
        return env

    def _bwrap_argv(self, host_dir: Path) -> list[str]:
        argv = ["bwrap", "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
        # No nested user namespaces either: no way back to capabilities, even over
        # mounts of its own.
        argv += ["--cap-drop", "ALL", "--disable-userns"]
        argv += ["--die-with-parent", "--new-session", "--unshare-net"]
        argv += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        argv += ["--hostname", "sandbox"]
        argv += _system_args(self.etc_dir)
        argv += ["--proc", "/proc", "--dev", "/dev"]
        if self.limits.tmp is not None:
            argv += ["--size", str(self.limits.tmp)]
        # /var/tmp is the same tmpfs; the link is relative so that bubblewrap can create
        # mount points through it (a venv in a cache under /var/tmp).
        argv += ["--tmpfs", "/tmp", "--tmpfs", "/run", "--symlink", "../tmp", "/var/tmp"]
        # After the private /tmp, so an interpreter installed under /tmp stays visible.
        toolchain = tuple(dict.fromkeys([*interpreter_paths(), *self.toolchain]))
        argv += _mount_plan(toolchain, tuple(_hidden_paths()))
        argv += ["--bind", str(host_dir), WORKDIR, "--chdir", WORKDIR]
        return argv

    def run(
        self,
        host_dir: Path,
        command: str,
        cwd: str,
        env: Mapping[str, str] | None,
        timeout: float | None,
        disk_dir: Path | None = None,
    ) -> ExecResult:
        env = dict(self.default_env() if env is None else env)
        if self.isolation == "none" and self.python_roots:
            roots = [os.path.normpath(host_dir / r) for r in self.python_roots]
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [*roots, env.get("PYTHONPATH")]))
        group = self.cgroups.create(self.limits)
        prefix = self.limits.ulimit_prefix(memory_rlimit=group is None)
        full_before = disk_dir is not None and _nearly_full(disk_dir)
        if self.isolation == "none":
            # No /testbed without a mount namespace: the working directory maps to the
            # host folder (commands naming /testbed themselves will not find it).
            if cwd == WORKDIR or cwd.startswith(WORKDIR + "/"):
                cwd = str(host_dir) + cwd[len(WORKDIR) :]
            argv = ["bash", "-c", f"{prefix}cd -- {_quote(cwd)} || exit 1\n{command}"]
        else:
            # The first thing the shell does inside the sandbox is write to this pipe (then
            # close it): no byte means bubblewrap (or the cgroup join) failed and nothing
            # of the command ran, which the command's own output could never fake.
            started_r, started_w = os.pipe()
            script = (
                f"printf 1 >&{started_w}; exec {started_w}>&-\n"
                f"{prefix}cd -- {_quote(cwd)} || exit 1\n{command}"
            )
            argv = [*self._bwrap_argv(host_dir), "--", "bash", "-c", script]
        if group is not None:
            argv = [*group.argv_prefix(), *argv]
        try:
            res = run_captured(
                argv,
                timeout=timeout,
                env=env,
                cwd=host_dir if self.isolation == "none" else None,
                head_cap=self.limits.output,
                pass_fds=() if self.isolation == "none" else (started_w,),
            )
            hit = group.hit() if group is not None else {}
        finally:
            if group is not None:
                group.close()
            if self.isolation != "none":
                os.close(started_w)
                os.set_blocking(started_r, False)
                try:
                    started = os.read(started_r, 1) == b"1"
                except BlockingIOError:
                    started = False
                os.close(started_r)
        if self.isolation != "none" and not started:
            raise self.setup_error(res)
        return dataclasses.replace(res, limit=self._limit_hit(res, hit, disk_dir, full_before))

    def setup_error(self, res: ExecResult) -> SandboxSetupError:
        """The error of a command whose sandbox did not start (``res``: what bwrap printed)."""
        said = res.text.strip()[-1000:] or f"exit code {res.exit_code}, no output"
        if res.timed_out:
            said = f"it did not start within the timeout ({said})"
        paths = list(dict.fromkeys([*interpreter_paths(), *self.toolchain]))
        return SandboxSetupError(
            f"the sandbox could not be set up, so nothing of the command ran: {said}. "
            f"Every command's sandbox binds these host folders read-only: {paths} (the "
            f"interpreter, the task's environment under the branchgym cache "
            f"{os.fspath(cache_root())!r}, the toolchain). Check that each exists and can "
            "be read, or point BRANCHGYM_CACHE at a local folder (e.g. ~/.cache/branchgym "
            "or /var/tmp/branchgym) and build the environments again."
        )

    def check(self) -> None:
        """Start one sandbox (``true``) unless this runner did already; refuse if it fails.

        Raises:
            SandboxSetupError: bubblewrap cannot set up sandboxes with these paths.
        """
        if self.isolation == "none" or self._checked:
            return
        # What the mounts depend on: runners of other env instances with the same paths
        # need no probe of their own (a pool instance meeting a task it has not run),
        # unless a bound folder has gone since.
        key = (tuple(self.toolchain), tuple(_hidden_paths()), self.limits.tmp)
        there = all(map(os.path.isdir, [*interpreter_paths(), *self.toolchain]))
        if key not in _STARTED or not there:
            probe = Path(tempfile.mkdtemp(prefix="branchgym-probe-"))
            try:
                self.run(probe, "true", WORKDIR, None, 60.0)
            finally:
                shutil.rmtree(probe, ignore_errors=True)
            _STARTED.add(key)
        self._checked = True

    def _limit_hit(
        self, res: ExecResult, hit: Mapping[str, int], disk_dir: Path | None, full_before: bool
    ) -> str:
        enospc = b"No space left on device" in res.output
        # Full now, and this command filled it (or ran into it): the quota is the news.
        full = (
            self.limits.disk is not None
            and disk_dir is not None
            and (enospc or not full_before)
            and _nearly_full(disk_dir)
        )
        return self.limits.explain(
            res.exit_code,
            res.output,
            oom=bool(hit.get("oom_kill")),
            pids_max=bool(hit.get("pids_max")),
            layer_full=full,
        )


def _nearly_full(path: Path) -> bool:
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < max(st.f_blocks * st.f_frsize // 100, 1 << 16)


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def _host_path(root: Path, path: str, *, for_write: bool) -> Path:
    """Map a sandbox path to the host folder, refusing links that lead outside."""
    rel = inside_workdir(path)
    target = root / rel
    real_root = os.path.realpath(root)
    check = os.path.realpath(target.parent if for_write else target)
    if check != real_root and not check.startswith(real_root + "/"):
        raise SandboxError(f"{path!r} resolves outside the repository (through a symlink)")
    if for_write and target.is_symlink():
        real = os.path.realpath(target)
        if not real.startswith(real_root + "/"):
            raise SandboxError(f"{path!r} is a symlink that leads outside the repository")
    return target


class _LocalSandbox(Sandbox):
    """What both local sandboxes share: a host folder bound at /testbed."""

    def __init__(self, store: _Store, runner: _Runner) -> None:
        super().__init__()
        self.store = store
        self.runner = runner

    @property
    def host_dir(self) -> Path:
        """The host folder that commands see as ``/testbed``."""
        raise NotImplementedError

    def default_env(self) -> dict[str, str]:
        """The environment commands get when none is given."""
        return self.runner.default_env()

    def exec(
        self,
        command: str,
        *,
        cwd: str = WORKDIR,
        env: Mapping[str, str] | None = None,
        timeout: float | None = 60.0,
    ) -> ExecResult:
        """Run ``bash -c command`` in the sandbox."""
        self._check_open()
        return self.runner.run(self.host_dir, command, cwd, env, timeout, self.quota_dir)

    @property
    def quota_dir(self) -> Path | None:
        """A mount whose fill level is the disk quota's (None: only the per-file limit)."""
        return None

    def read(self, path: str) -> bytes:
        """A file's bytes."""
        self._check_open()
        target = _host_path(self.host_dir, path, for_write=False)
        try:
            return target.read_bytes()
        except (FileNotFoundError, IsADirectoryError) as exc:
            raise SandboxError(f"cannot read {path!r}: {exc.strerror}") from exc

    def write(self, path: str, data: bytes, mode: int | None = None) -> None:
        """Create or replace a file."""
        self._check_open()
        if not isinstance(data, bytes | bytearray):
            raise SandboxError(f"write() takes bytes, got {type(data).__name__}")
        target = _host_path(self.host_dir, path, for_write=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(bytes(data))
        if mode is not None:
            os.chmod(target, mode)

    def tree_digest(self) -> str:
        """Hash of /testbed."""
        self._check_open()
        return tree_digest(self.host_dir)


# ------------------------------------------------------------------------ overlay


class OverlaySnapshot(SandboxSnapshot):
    """A frozen layer stack (topmost first, checkout last)."""

    kind = "overlay"
    backend = "overlay"

    def __init__(self, store: _Store, stack: tuple[str, ...], top: str | None) -> None:
        """Hold ``stack``; ``top`` is the layer this snapshot created (its disk cost)."""
        store.acquire(stack)
        self.stack = stack
        self.store = store
        super().__init__(lambda: store.release(stack), lambda: du_bytes(top) if top else 0)


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _is_opaque(path: str) -> bool:
    try:
        return os.getxattr(path, "trusted.overlay.opaque", follow_symlinks=False) == b"y"
    except OSError:
        return False


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


_OPAQUE, _REDIRECT = "trusted.overlay.opaque", "trusted.overlay.redirect"


def _xattr(path: str, name: str) -> bytes | None:
    try:
        return os.getxattr(path, name, follow_symlinks=False)
    except OSError:
        return None


def _copy_entry(src: str, st: os.stat_result, dst: str, links: dict) -> None:
    """Copy one non-folder (file, symlink, FIFO, socket, whiteout) with its mode and times.

    Names of one inode (hard links) stay one inode: ``links`` maps source inodes to
    their first copy. Overlay's own xattrs (origin, ...) are not copied: they name
    inodes of the layer being squashed away.
    """
    key = (st.st_dev, st.st_ino)
    if st.st_nlink > 1 and key in links and os.path.lexists(links[key]):
        os.link(links[key], dst, follow_symlinks=False)
        return
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dst)
    elif stat.S_ISREG(st.st_mode):
        shutil.copyfile(src, dst, follow_symlinks=False)
        os.chmod(dst, stat.S_IMODE(st.st_mode))
        for name in os.listxattr(src, follow_symlinks=False):
            if not name.startswith("trusted.overlay."):
                os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False))
    else:  # FIFO, socket, whiteout (a 0/0 character device)
        os.mknod(dst, stat.S_IFMT(st.st_mode) | stat.S_IMODE(st.st_mode), st.st_rdev)
        os.chmod(dst, stat.S_IMODE(st.st_mode))
    if st.st_nlink > 1:
        links[key] = dst
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _squash_into(target: str, layers_oldest_first: list[str], bottom: str) -> None:
    """Merge frozen overlay layers into ``target`` (a layer just above ``bottom``).

    Whiteouts, opaque folders, FIFOs, hard links, modes and times are kept. Files are
    copied (layers live on tmpfs mounts of their own, so hard links cannot cross them).
    A folder a layer renamed (``redirect_dir``: an xattr naming where its lower content
    lives) keeps pointing into ``bottom`` when nothing above ``bottom`` changed that
    content; otherwise the folder as the layers below saw it is copied in, opaque.
    """
    links: dict = {}

    def lower_of(s_dir: str, c_default: str | None) -> str | None:
        """Where the bottom layer's part of ``target``'s folder ``s_dir`` lives."""
        if _is_opaque(s_dir):
            return None
        r = _xattr(s_dir, _REDIRECT)
        if r is not None:
            return os.path.join(bottom, os.fsdecode(r).lstrip("/"))
        return c_default

    def resolve(rel: str) -> tuple[str | None, str | None]:
        """(target path, bottom path) of folder ``rel`` as the layers merged so far show it."""
        s: str | None = target
        c: str | None = bottom
        for part in [p for p in rel.split("/") if p]:
            s_next = os.path.join(s, part) if s is not None else None
            c_next = os.path.join(c, part) if c is not None else None
            if s_next is not None and os.path.lexists(s_next):
                st = os.lstat(s_next)
                if not stat.S_ISDIR(st.st_mode):
                    return None, None  # a whiteout or a file: no folder there
                c_next = lower_of(s_next, c_next)
            else:
                s_next = None
            if c_next is not None and not (os.path.isdir(c_next) and not os.path.islink(c_next)):
                c_next = None
            s, c = s_next, c_next
        return s, c

    def copy_merged(s: str | None, c: str | None, dst: str) -> None:
        """A full copy of the folder the layers merged so far show at (s over c)."""
        top = s if s is not None else c
        assert top is not None
        os.mkdir(dst)
        names: dict[str, tuple[str, os.stat_result]] = {}
        if s is not None:
            for e in os.scandir(s):
                names[e.name] = (e.path, e.stat(follow_symlinks=False))
        if c is not None:
            for e in os.scandir(c):
                names.setdefault(e.name, (e.path, e.stat(follow_symlinks=False)))
        for name, (src, st) in names.items():
            d = os.path.join(dst, name)
            if _is_whiteout(st):
                continue
            if stat.S_ISDIR(st.st_mode):
                if s is not None and src == os.path.join(s, name):
                    child_s: str | None = src
                    child_c = lower_of(src, os.path.join(c, name) if c is not None else None)
                    if child_c is not None and not (
                        os.path.isdir(child_c) and not os.path.islink(child_c)
                    ):
                        child_c = None
                else:
                    child_s, child_c = None, src
                copy_merged(child_s, child_c, d)
            else:
                _copy_entry(src, st, d, links)
        st = os.lstat(top)
        os.chmod(dst, stat.S_IMODE(st.st_mode))
        os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))

    def redirects(src: str, rel: str, lower: str, out: list) -> None:
        """Folders of layer ``src`` that a rename moved: (rel, absolute lower path)."""
        for entry in os.scandir(src):
            if not entry.is_dir(follow_symlinks=False):
                continue
            r = f"{rel}/{entry.name}" if rel else entry.name
            low = f"{lower}/{entry.name}" if lower else entry.name
            red = _xattr(entry.path, _REDIRECT)
            if red is not None:
                red_s = os.fsdecode(red)
                low = red_s.lstrip("/") if red_s.startswith("/") else (
                    f"{lower}/{red_s}" if lower else red_s
                )  # fmt: skip
                out.append((r, low))
            if not _is_opaque(entry.path):
                redirects(entry.path, r, low, out)

    def merge_dir(src: str, dst: str, rel: str, staged: dict, c_dir: str | None) -> None:
        # c_dir: the bottom layer's folder under dst (None: nothing below it). Whiteouts
        # are kept only where they hide something of the bottom layer: the kernel lists
        # a folder with nothing below it as it is, whiteouts included.
        for entry in os.scandir(src):
            s, d = entry.path, os.path.join(dst, entry.name)
            r = f"{rel}/{entry.name}" if rel else entry.name
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                opaque = _is_opaque(s)
                moved = r in staged
                if (
                    opaque
                    or moved
                    or (os.path.lexists(d) and not (os.path.isdir(d) and not os.path.islink(d)))
                ):
                    _remove(d)
                if moved:
                    how, where = staged[r]
                    if how == "copy":
                        os.rename(where, d)
                        os.setxattr(d, _OPAQUE, b"y", follow_symlinks=False)
                    else:
                        os.mkdir(d)
                        os.setxattr(d, _REDIRECT, os.fsencode(where), follow_symlinks=False)
                elif not os.path.lexists(d):
                    os.mkdir(d)
                if opaque:
                    os.setxattr(d, _OPAQUE, b"y", follow_symlinks=False)
                os.chmod(d, stat.S_IMODE(st.st_mode))
                below = lower_of(d, os.path.join(c_dir, entry.name) if c_dir else None)
                if below is not None and not (os.path.isdir(below) and not os.path.islink(below)):
                    below = None
                merge_dir(s, d, r, staged, below)
                os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns))
            else:
                _remove(d)
                if _is_whiteout(st) and not (
                    c_dir is not None and os.path.lexists(os.path.join(c_dir, entry.name))
                ):
                    continue
                _copy_entry(s, st, d, links)

    os.mkdir(target)
    stage = target + ".stage"
    for layer in layers_oldest_first:
        moved: list[tuple[str, str]] = []
        redirects(layer, "", "", moved)
        staged: dict[str, tuple[str, str]] = {}
        for i, (r, low) in enumerate(moved):
            s, c = resolve(low)
            # Inside a copied (opaque) folder the kernel follows no redirect: copy too.
            copied_above = any(
                r.startswith(q + "/") and how == "copy" for q, (how, _) in staged.items()
            )
            if s is None and c is not None and not copied_above:
                staged[r] = ("redirect", "/" + os.path.relpath(c, bottom))
                continue
            os.makedirs(stage, exist_ok=True)
            where = os.path.join(stage, str(i))
            if s is None and c is None:  # the lower folder is gone: the layer's own entries
                os.mkdir(where)
            else:
                copy_merged(s, c, where)
            staged[r] = ("copy", where)
        merge_dir(layer, target, "", staged, bottom)
        shutil.rmtree(stage, ignore_errors=True)


class OverlaySandbox(_LocalSandbox):
    """A repository in an overlayfs layer stack; see the module docstring.

    The writable (upper) layer is a tmpfs of ``disk`` bytes of its own, so a command
    that fills it gets ENOSPC without touching the host's disk or other sandboxes. A
    snapshot moves that tmpfs mount into the layer store (no data is copied), remounts
    it read-only and mounts a fresh, empty tmpfs as the new upper layer.
    """

    kind = "overlay"
    backend = "overlay"

    def __init__(
        self,
        store: _Store,
        runner: _Runner,
        stack: tuple[str, ...],
        *,
        max_layers: int = 32,
        redirect_dir: bool = False,
        index: bool = False,
    ) -> None:
        """Mount a fresh upper layer over ``stack`` (topmost first, checkout last).

        ``redirect_dir``: mount with ``redirect_dir=on`` (rename(2) of folders from
        lower layers works; without it, EXDEV, as in Docker's overlay2). ``index``:
        mount with ``index=on`` and link hard links up at snapshot time, so names of one
        inode stay one inode across snapshots (without it, a write after a snapshot
        goes to the written name only).
        """
        super().__init__(store, runner)
        self.redirect_dir = redirect_dir
        self.index = index
        self._index_on = False  # the current mount has index=on
        self.max_layers = max_layers
        self.dir = store.boxes / store.new_id()
        self.rw, self.merged = self.dir / "rw", self.dir / "m"
        self.upper, self.work = self.rw / "u", self.rw / "w"
        for d in (self.rw, self.merged):
            d.mkdir(parents=True)
        self.stack: tuple[str, ...] = ()
        state = {"stack": (), "mounted": False, "rw": False}
        self._state = state  # shared with the finalizer, which must not refer to self
        self._finalizer = weakref.finalize(self, _overlay_cleanup, store, self.dir, state)
        self._new_rw()
        self._mount(stack)

    @property
    def host_dir(self) -> Path:
        """The merged mount."""
        return self.merged

    @property
    def quota_dir(self) -> Path:
        """The writable layer's tmpfs (its fill level is the disk quota's)."""
        return self.rw

    # -- mount management --------------------------------------------------------
    def _new_rw(self) -> None:
        """An empty tmpfs (the disk quota) at ``rw`` holding the upper and work folders."""
        _mount_tmpfs(self.rw, self.runner.limits.disk)
        self._state["rw"] = True
        self.upper.mkdir()
        self.work.mkdir()

    def _mount(self, stack: tuple[str, ...]) -> None:
        self.store.acquire(stack)
        # index=on only over layers with hard links: it makes the kernel refuse a
        # frozen layer for a few ms after a command (EBUSY below), a cost only they pay.
        index = self.index and any(layer in self.store.links for layer in stack)
        try:
            for wait in (0.001, 0.004, 0.016, 0.064, 0.25, 1.0, None):
                try:
                    lowers = tuple(map(self.store.option_path, stack))
                    _mount_overlay(
                        self.merged, lowers, self.upper, self.work, self.redirect_dir, index
                    )
                    break
                except OSError as exc:
                    # index=on refuses a lower layer still marked in use as the upper
                    # layer of an overlay the kernel has not torn down yet (a command's
                    # mount namespace goes away just after the command).
                    if exc.errno != errno.EBUSY or not index or wait is None:
                        raise
                    time.sleep(wait)
        except OSError:
            self.store.release(stack)
            raise
        old = self.stack
        self.stack = stack
        self._index_on = index
        self._state.update(stack=stack, mounted=True)
        self.store.release(old)

    def _unmount(self) -> None:
        _umount(self.merged)
        self._state["mounted"] = False

    def _upper_empty(self) -> bool:
        with os.scandir(self.upper) as it:
            return next(it, None) is None

    def _fresh_upper(self) -> None:
        """Throw the upper layer away: unmount its tmpfs and mount an empty one."""
        # With index=on the upper root remembers its lower stack (an origin xattr): a
        # mount over another stack needs a new one even when nothing was written.
        if self._index_on or not self._upper_empty():
            _umount(self.rw)
            self._state["rw"] = False
            self._new_rw()

    # -- the protocol ----------------------------------------------------------------
    def snapshot(self) -> OverlaySnapshot:
        """Freeze the upper layer as a new lower layer; remount with an empty upper."""
        self._check_open()
        if self._upper_empty():  # nothing changed since the last freeze: share the stack
            return OverlaySnapshot(self.store, self.stack, None)
        self._link_up()
        self._unmount()
        # The index's links are not names: left in the frozen layer they would count.
        index_dir = self.work / "index"
        for entry in os.listdir(index_dir) if self._index_on and index_dir.is_dir() else ():
            _remove(str(index_dir / entry))
        layer_root = self.store.new_layer()
        layer_root.mkdir()
        _move_mount(self.rw, layer_root)
        self._state["rw"] = False
        self._new_rw()
        layer = layer_root / "u"
        stack = (str(layer), *self.stack)
        top: str | None = str(layer)
        if len(stack) - 1 > self.max_layers or len(":".join(stack)) > 3000:
            stack, top = self._squash(stack), None
            self.store.drop_layer(str(layer))  # merged into the squashed layer; no holder
        if self.index:
            groups = _link_groups(stack[0])
            if groups:
                self.store.links[stack[0]] = groups
        snap = OverlaySnapshot(self.store, stack, top)
        self._mount(stack)
        return snap

    def _link_up(self) -> None:
        """Give every name of a hard link from a lower layer its copy-up, once one has it.

        With ``index=on`` the kernel copies a lower hard link up once and links the other
        names to that copy when they are next looked up; names nobody looked up before
        the snapshot would keep the old inode below. A no-op chown of each such name
        links it up now. The groups come from each frozen layer (recorded at freeze).
        """
        if not self._index_on:
            return
        for layer in self.stack:
            for group in self.store.links.get(layer, ()):
                up = {r for r in group if os.path.lexists(self.upper / r)}
                seen = {r for r in group if os.path.lexists(self.merged / r)}
                if not up and seen == set(group):
                    continue  # untouched since the freeze
                # Written, replaced or deleted names: the others need their copy-up now
                # (a deleted name is counted in the lower inode's link count).
                for r in seen - up:
                    p = self.merged / r
                    if p.is_file() and not p.is_symlink():
                        st = os.lstat(p)
                        os.lchown(p, st.st_uid, st.st_gid)

    def _squash(self, stack: tuple[str, ...]) -> tuple[str, ...]:
        """Merge every frozen layer above the checkout into one (keeps the kernel happy)."""
        frozen = [s for s in stack[:-1]]
        target = str(self.store.new_layer())
        _squash_into(target, list(reversed(frozen)), stack[-1])
        # The new stack holds its own references; layers only the old stack held go away
        # once nothing else (another snapshot, another sandbox) holds them.
        return (target, stack[-1])

    def restore(self, snap: SandboxSnapshot) -> None:
        """Remount over ``snap``'s stack with an empty upper layer."""
        self._check_open()
        stack = self._stack_of(snap)
        if stack == self.stack and self._upper_empty():
            return
        self._unmount()
        self._fresh_upper()
        self._mount(stack)

    def _stack_of(self, snap: SandboxSnapshot) -> tuple[str, ...]:
        if not isinstance(snap, OverlaySnapshot):
            raise SandboxError(
                f"an overlay sandbox restores overlay snapshots, not {type(snap).__name__}"
            )
        snap.check()
        return snap.stack

    def fork(self, snap: SandboxSnapshot | None = None) -> OverlaySandbox:
        """A sibling sandbox: a new upper layer over ``snap``'s (or the current) stack."""
        self._check_open()
        if snap is None:
            with self.snapshot() as now:
                return OverlaySandbox(
                    self.store, self.runner, now.stack, max_layers=self.max_layers,
                    redirect_dir=self.redirect_dir, index=self.index,
                )  # fmt: skip
        return OverlaySandbox(
            self.store, self.runner, self._stack_of(snap), max_layers=self.max_layers,
            redirect_dir=self.redirect_dir, index=self.index,
        )  # fmt: skip

    def close(self) -> None:
        """Unmount and delete the upper layer; release the stack."""
        if self.closed:
            return
        self.closed = True
        self._finalizer()

    def resources(self) -> dict[str, int]:
        """Mounts held and live frozen layers of this process."""
        return {"mounts": int(self._state["mounted"]), "layers": self.store.live_layers()}


def _overlay_cleanup(store: _Store, box: Path, state: dict) -> None:
    for flag, sub in (("mounted", "m"), ("rw", "rw")):
        if state[flag]:
            try:
                _umount(box / sub)
            except OSError:
                pass
            state[flag] = False
    store.reaper.discard(box)
    store.release(state["stack"])
    state["stack"] = ()


# ---------------------------------------------------------------------------- git


class _GitStore:
    """A private bare repository holding snapshot trees; deleted with its last user."""

    def __init__(self, path: Path, reaper: _Reaper) -> None:
        self.path = path
        self.reaper = reaper
        self.users = 0
        self.lock = threading.Lock()
        self.base_trees: dict[str, tuple[dict[str, str], str]] = {}

    def git(
        self,
        *args: str,
        work: str | Path | None = None,
        index: str | Path | None = None,
        stdin: str | None = None,
    ) -> str:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        env.update(GIT_DIR=str(self.path), GIT_CONFIG_NOSYSTEM="1", LC_ALL="C")
        env["GIT_CONFIG_GLOBAL"] = "/dev/null"
        if work is not None:
            env["GIT_WORK_TREE"] = str(work)
        if index is not None:
            env["GIT_INDEX_FILE"] = str(index)
        out = subprocess.run(
            ["git", *args],
            cwd=work or self.path,
            env=env,
            capture_output=True,
            check=False,
            input=stdin.encode() if stdin is not None else None,
        )
        if out.returncode != 0:
            raise SandboxError(
                f"git {' '.join(args)} failed: {out.stderr.decode(errors='replace').strip()}"
            )
        return out.stdout.decode(errors="surrogateescape")

    def hold(self) -> None:
        with self.lock:
            if self.users == 0 and not self.path.exists():
                subprocess.run(["git", "init", "-q", "--bare", str(self.path)], check=True)
                # Snapshot trees are unreachable objects: never let git prune them.
                self.git("config", "gc.auto", "0")
                self.git("config", "core.fsyncMethod", "batch")
            self.users += 1

    def drop(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0:
                self.reaper.discard(self.path)
                self.base_trees.clear()


class GitSnapshot(SandboxSnapshot):
    """Trees of the folder's units in the private store, plus a manifest blob.

    A unit is the folder itself, each nested repository's folder and each ``.git``
    folder (:mod:`~branchgym.envs.swebench.gitsnap`); the manifest holds what git trees
    do not (folders, modes, times, FIFOs, ``.git`` files, hard links).
    """

    kind = "git"
    backend = "git"

    def __init__(
        self,
        store: _GitStore,
        trees: dict[str, str],
        manifest: str,
        base: tuple[str, ...],
    ) -> None:
        """Hold the store (the trees live in it) until released."""
        store.hold()
        self.store, self.trees, self.manifest = store, trees, manifest
        super().__init__(store.drop, lambda: _git_cost(store, (*trees.values(), manifest), base))


def _git_cost(store: _GitStore, objs: tuple[str, ...], base: tuple[str, ...]):
    """Disk bytes of the objects these trees add to the checkout's."""
    want = [t for t in objs if t]
    have = [f"^{t}" for t in base if t]
    objs = store.git("rev-list", "--objects", *want, *have)
    names = "\n".join(line.split()[0] for line in objs.splitlines() if line.strip())
    if not names:
        return 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["GIT_DIR"] = str(store.path)
    out = subprocess.run(
        ["git", "cat-file", "--batch-check=%(objectsize:disk)"],
        input=names + "\n",
        capture_output=True,
        text=True,
        env=env,
        check=False,
    ).stdout
    return sum(int(x) for x in out.split() if x.isdigit())


class GitSandbox(_LocalSandbox):
    """A repository in a plain folder, snapshotted as git trees; see the module docstring."""

    kind = "git"
    backend = "git"

    def __init__(
        self,
        store: _Store,
        runner: _Runner,
        *,
        base: Path | None = None,
        snap: GitSnapshot | None = None,
    ) -> None:
        """Start from the checkout ``base``, or from ``snap``."""
        super().__init__(store, runner)
        if store.git is None:
            store.git = _GitStore(store.root / "snap.git", store.reaper)
        self.git = store.git
        self.git.hold()
        self.dir = store.boxes / store.new_id()
        self.tree = self.dir / "t"
        self.index_dir = self.dir / "idx"
        self.tree.mkdir(parents=True)
        self.index_dir.mkdir()
        self._finalizer = weakref.finalize(self, _git_cleanup, store, self.git, self.dir)
        if snap is None:
            if base is None:
                raise SandboxError("a git sandbox starts from a checkout or a snapshot")
            snap = self._base_snapshot(base)
            try:
                self._checkout(snap)
            finally:
                snap.release()
        else:
            self._checkout(snap)
        self.base_trees = getattr(self, "base_trees", (*snap.trees.values(), snap.manifest))

    @property
    def host_dir(self) -> Path:
        """The repository folder."""
        return self.tree

    def _base_snapshot(self, base: Path) -> GitSnapshot:
        """Trees of the checkout, hashed once per process and reused."""
        key = str(base)
        cached = self.git.base_trees.get(key)
        if cached is None:
            idx = self.dir / "base-idx"
            idx.mkdir()
            cached = gitsnap.snapshot(str(base), self.git.git, str(idx))
            self.git.base_trees[key] = cached
            shutil.rmtree(idx, ignore_errors=True)
        trees, manifest = cached
        self.base_trees = (*trees.values(), manifest)
        return GitSnapshot(self.git, dict(trees), manifest, self.base_trees)

    def _checkout(self, snap: GitSnapshot) -> None:
        """Write ``snap`` into the (empty) tree with fresh private indexes."""
        gitsnap.restore(
            str(self.tree), snap.trees, snap.manifest, self.git.git, str(self.index_dir)
        )

    def snapshot(self) -> GitSnapshot:
        """Record the trees of every unit and the manifest of what git does not keep."""
        self._check_open()
        trees, manifest = gitsnap.snapshot(str(self.tree), self.git.git, str(self.index_dir))
        return GitSnapshot(self.git, trees, manifest, self.base_trees)

    def restore(self, snap: SandboxSnapshot) -> None:
        """``read-tree --reset -u`` each unit's tree, then apply the manifest."""
        self._check_open()
        snap = self._check_snap(snap)
        gitsnap.restore(
            str(self.tree), snap.trees, snap.manifest, self.git.git, str(self.index_dir)
        )

    def _check_snap(self, snap: SandboxSnapshot) -> GitSnapshot:
        if not isinstance(snap, GitSnapshot):
            raise SandboxError(f"a git sandbox restores git snapshots, not {type(snap).__name__}")
        snap.check()
        if snap.store is not self.git:
            raise SandboxError("this git snapshot belongs to another process's store")
        return snap

    def fork(self, snap: SandboxSnapshot | None = None) -> GitSandbox:
        """A new folder checked out from ``snap`` (or from the current state)."""
        self._check_open()
        if snap is None:
            with self.snapshot() as now:
                child = GitSandbox(self.store, self.runner, snap=now)
        else:
            child = GitSandbox(self.store, self.runner, snap=self._check_snap(snap))
        child.base_trees = self.base_trees
        return child

    def close(self) -> None:
        """Delete the folder; let go of the store."""
        if self.closed:
            return
        self.closed = True
        self._finalizer()

    def resources(self) -> dict[str, int]:
        """Sandbox folders of this process."""
        return {"folders": len(list(self.store.boxes.iterdir()))}


def _git_cleanup(store: _Store, git: _GitStore, box: Path) -> None:
    store.reaper.discard(box)
    git.drop()


# ------------------------------------------------------------------------ backend


class LocalBackend:
    """Makes local sandboxes: overlay where mounting works, git trees elsewhere.

    Args:
        mode: ``auto`` (overlay if this process can mount overlayfs, else git),
            ``overlay`` or ``git``.
        isolation: ``auto``/``bwrap`` (bubblewrap, required) or ``none`` (plain
            subprocesses in the repository folder: network allowed, no read-only system).
        root: Work folder (default ``$BRANCHGYM_SANDBOX_DIR`` or /tmp/branchgym-sandboxes).
        max_layers: Overlay stacks deeper than this are squashed at snapshot time.
        overlay_redirect_dir: Mount overlays with ``redirect_dir=on`` so rename(2) of a
            folder that existed at the last snapshot works as without snapshots. None
            (default): where the kernel allows it; False: never (such renames get
            EXDEV; ``mv`` copies instead, ``git mv`` and ``os.rename`` fail).
    """

    def __init__(
        self,
        mode: str = "auto",
        *,
        isolation: str = "auto",
        root: str | os.PathLike[str] | None = None,
        max_layers: int = 32,
        limits: Limits | Mapping[str, object] | None = None,
        toolchain: Sequence[str | os.PathLike[str]] = (),
        overlay_redirect_dir: bool | None = None,
        python_env: str | Mapping[str, str] | None = "auto",
    ) -> None:
        """Pick the mode (probing overlayfs once) and check isolation is possible."""
        if mode not in ("auto", "overlay", "git"):
            raise SandboxError(f"local mode must be 'auto', 'overlay' or 'git', not {mode!r}")
        self.store = _Store.get(Path(root) if root else None)
        ok, why = overlay_support(self.store.root.parent)
        if mode == "overlay" and not ok:
            raise SandboxUnavailableError(
                f"the overlay backend needs overlayfs mounts, but {why}. Run as root (or with "
                "CAP_SYS_ADMIN), or use mode='git' (chosen automatically with mode='auto')."
            )
        self.mode = mode if mode != "auto" else ("overlay" if ok else "git")
        self.reason = why if self.mode == "overlay" else f"git trees: {why}"
        self.limits = Limits.of(limits)  # type: ignore[arg-type]
        self.runner = _Runner(isolation, self.limits, toolchain, etc_dir=self.store.root / "etc")
        self.max_layers = max_layers
        self.python_env = python_env
        self._task_runners: dict[str, _Runner] = {}
        self.redirect_dir = self.mode == "overlay" and (
            redirect_dir_support(self.store.root.parent)
            if overlay_redirect_dir is None
            else bool(overlay_redirect_dir)
        )
        self.index = self.mode == "overlay" and index_support(self.store.root.parent)

    @property
    def kind(self) -> str:
        """Snapshot kind of the sandboxes it makes."""
        return self.mode

    def default_env(self) -> dict[str, str]:
        """The environment a new shell starts with."""
        return self.runner.default_env()

    def enforced_limits(self) -> dict[str, str]:
        """Each limit in force and what enforces it (or why it is not enforced)."""
        out = self.runner.enforced()
        if self.limits.disk is not None:
            out["disk"] = (
                "tmpfs writable layer" if self.mode == "overlay" else "RLIMIT_FSIZE (per file only)"
            )
        return out

    def runner_for(self, task: object, checkout: Path) -> _Runner:
        """The runner of ``task``'s sandboxes: in its repository's own environment.

        With ``python_env="auto"`` an installable repository (pyproject.toml, setup.py or
        setup.cfg) gets its per-repository venv (:mod:`branchgym.envs.swebench.repo_env`,
        built once, shared read-only); one without packaging metadata, or
        ``python_env="host"``, runs with branchgym's interpreter.
        """
        if not isinstance(task, SWEBenchTask):
            return self.runner
        if task.instance_id in self._task_runners:
            return self._task_runners[task.instance_id]
        base = resolve_python_env(self.python_env, task)
        named = self.python_env not in (None, "auto", "host")
        if base == "host" or (not named and not installable(checkout)):
            runner = self.runner
        else:
            runner = self.runner.for_python(repo_environment(task, checkout, base_python=base))
        self._task_runners[task.instance_id] = runner
        return runner

    def create(self, task: object, checkout: Path) -> Sandbox:
        """A sandbox whose /testbed starts as ``checkout`` (never modified)."""
        runner = self.runner_for(task, checkout)
        runner.check()  # refuse here, not at the first command, where sandboxes cannot start
        if self.mode == "overlay":
            return OverlaySandbox(
                self.store, runner, (str(checkout),), max_layers=self.max_layers,
                redirect_dir=self.redirect_dir, index=self.index,
            )  # fmt: skip
        return GitSandbox(self.store, runner, base=checkout)

    def from_snapshot(
        self, snap: SandboxSnapshot, task: object = None, checkout: Path | None = None
    ) -> Sandbox:
        """A new sandbox in ``snap``'s state (a snapshot of this backend).

        ``task`` and its ``checkout`` give the sandbox the task's own environment (see
        :meth:`runner_for`); without them commands run with branchgym's interpreter.
        """
        snap.check()
        runner = self.runner if checkout is None else self.runner_for(task, checkout)
        runner.check()
        if isinstance(snap, OverlaySnapshot) and self.mode == "overlay":
            return OverlaySandbox(
                self.store, runner, snap.stack, max_layers=self.max_layers,
                redirect_dir=self.redirect_dir, index=self.index,
            )  # fmt: skip
        if isinstance(snap, GitSnapshot) and self.mode == "git":
            return GitSandbox(self.store, runner, snap=snap)
        raise SandboxError(
            f"a {snap.kind} snapshot cannot be restored by the local {self.mode} backend"
        )


def wait_for_cleanup() -> None:
    """Wait until every folder discarded by local sandboxes of this process is deleted."""
    for store in list(_Store._instances.values()):
        store.reaper.wait()


def _at_exit() -> None:
    """Finish deletions, and remove this process's folder when nothing is left in it."""
    wait_for_cleanup()
    for store in list(_Store._instances.values()):
        if not any(store.boxes.iterdir()) and not any(store.layers.iterdir()):
            shutil.rmtree(store.root, ignore_errors=True)


# Whatever a killed process leaves, the next one removes (_cleanup_stale).
atexit.register(_at_exit)
