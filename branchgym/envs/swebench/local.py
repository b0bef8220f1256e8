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
checkout are copied into one, whiteouts and opaque directories kept), so the kernel's
layer and option-length limits are never reached.

**Git** (:class:`GitSandbox`, kind ``git``), where mounting is not allowed (no
``CAP_SYS_ADMIN``, or no overlayfs). The repository is a plain directory. A snapshot
records, in a private object store, the tree of the working directory
(``GIT_INDEX_FILE=<private index> git add -A -f; git write-tree``) and the tree of the
repository's own ``.git`` directory, plus the permission bits and directories git does
not track. ``restore()`` refreshes the private index and runs ``git read-tree --reset -u``,
which rewrites only the files that differ. Both steps are incremental: git re-hashes
only files whose stat data changed.

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
import ctypes
import ctypes.util
import dataclasses
import errno
import functools
import itertools
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import uuid
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

from branchgym.envs.swebench.limits import Limits, cgroups, pid_alive
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
from branchgym.envs.swebench.tasks import cache_root
from branchgym.error import SandboxConfigError, SandboxError, SandboxUnavailableError

__all__ = [
    "wait_for_cleanup",
    "LocalBackend",
    "OverlaySandbox",
    "GitSandbox",
    "overlay_support",
    "bwrap_support",
    "work_root",
    "list_local_mounts",
]

_MNT_DETACH = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p,) * 3 + (ctypes.c_ulong, ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


# ---------------------------------------------------------------------- mounting


def _mount_overlay(target: Path, lowers: tuple[str, ...], upper: Path, work: Path) -> None:
    # redirect_dir and metacopy off: every upper layer is then a self-contained diff
    # (full copy-ups, plain whiteouts) that stays valid when frozen as a lower layer.
    data = (
        f"lowerdir={':'.join(lowers)},upperdir={upper},workdir={work},redirect_dir=off,metacopy=off"
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
    is bound; where a toolchain path contains one, a tmpfs covers it (commands have no
    capability to unmount it).
    """
    out = []
    for p in (cache_root(), work_root()):
        p = p.resolve() if p.exists() else p
        out.append(str(p))
    return out


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
            args += ["--symlink", os.readlink(p), p]
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
        argv += ["--tmpfs", "/tmp", "--tmpfs", "/run", "--symlink", "/tmp", "/var/tmp"]
        # After the private /tmp, so an interpreter installed under /tmp stays visible.
        toolchain = list(dict.fromkeys([*interpreter_paths(), *self.toolchain]))
        for p in toolchain:
            argv += ["--ro-bind", p, p]
        for hidden in _hidden_paths():
            if any(_covers(p, hidden) for p in toolchain):
                argv += ["--tmpfs", hidden]
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
            script = f"{prefix}cd -- {_quote(cwd)} || exit 1\n{command}"
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
            )
            hit = group.hit() if group is not None else {}
        finally:
            if group is not None:
                group.close()
        return dataclasses.replace(res, limit=self._limit_hit(res, hit, disk_dir, full_before))

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


def _squash_into(target: str, layers_oldest_first: list[str]) -> None:
    """Merge frozen overlay layers into ``target``, keeping whiteouts and opaque dirs.

    Files are copied (layers live on tmpfs mounts of their own, so hard links cannot
    cross them); symlinks and whiteouts are recreated.
    """

    def merge_dir(src: str, dst: str) -> None:
        for entry in os.scandir(src):
            s, d = entry.path, os.path.join(dst, entry.name)
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                opaque = _is_opaque(s)
                if opaque or (
                    os.path.lexists(d) and not (os.path.isdir(d) and not os.path.islink(d))
                ):
                    _remove(d)
                if not os.path.lexists(d):
                    os.mkdir(d)
                if opaque:
                    os.setxattr(d, "trusted.overlay.opaque", b"y", follow_symlinks=False)
                os.chmod(d, stat.S_IMODE(st.st_mode))
                merge_dir(s, d)
            else:
                _remove(d)
                if _is_whiteout(st):
                    os.mknod(d, stat.S_IFCHR | 0o000, 0)
                elif stat.S_ISLNK(st.st_mode):
                    os.symlink(os.readlink(s), d)
                else:
                    shutil.copy2(s, d, follow_symlinks=False)

    os.mkdir(target)
    for layer in layers_oldest_first:
        merge_dir(layer, target)


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
    ) -> None:
        """Mount a fresh upper layer over ``stack`` (topmost first, checkout last)."""
        super().__init__(store, runner)
        for layer in stack:
            if "," in layer or ":" in layer:
                raise SandboxError(f"overlay layer paths cannot contain ',' or ':': {layer}")
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
        try:
            _mount_overlay(self.merged, stack, self.upper, self.work)
        except OSError:
            self.store.release(stack)
            raise
        old = self.stack
        self.stack = stack
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
        if not self._upper_empty():
            _umount(self.rw)
            self._state["rw"] = False
            self._new_rw()

    # -- the protocol ----------------------------------------------------------------
    def snapshot(self) -> OverlaySnapshot:
        """Freeze the upper layer as a new lower layer; remount with an empty upper."""
        self._check_open()
        if self._upper_empty():  # nothing changed since the last freeze: share the stack
            return OverlaySnapshot(self.store, self.stack, None)
        self._unmount()
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
        snap = OverlaySnapshot(self.store, stack, top)
        self._mount(stack)
        return snap

    def _squash(self, stack: tuple[str, ...]) -> tuple[str, ...]:
        """Merge every frozen layer above the checkout into one (keeps the kernel happy)."""
        frozen = [s for s in stack[:-1]]
        target = str(self.store.new_layer())
        _squash_into(target, list(reversed(frozen)))
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
                    self.store, self.runner, now.stack, max_layers=self.max_layers
                )
        return OverlaySandbox(
            self.store, self.runner, self._stack_of(snap), max_layers=self.max_layers
        )

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
        self.base_trees: dict[str, tuple[str, str | None, dict, Path]] = {}

    def git(self, *args: str, work: Path | None = None, index: Path | None = None) -> str:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        env.update(GIT_DIR=str(self.path), GIT_CONFIG_NOSYSTEM="1", LC_ALL="C")
        env["GIT_CONFIG_GLOBAL"] = "/dev/null"
        if work is not None:
            env["GIT_WORK_TREE"] = str(work)
        if index is not None:
            env["GIT_INDEX_FILE"] = str(index)
        out = subprocess.run(
            ["git", *args], cwd=work or self.path, env=env, capture_output=True, check=False
        )
        if out.returncode != 0:
            raise SandboxError(
                f"git {' '.join(args)} failed: {out.stderr.decode(errors='replace').strip()}"
            )
        return out.stdout.decode()

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


def _scan(root: Path) -> tuple[dict[str, int], dict[str, int]]:
    """(every directory -> mode, files/links whose mode git cannot restore -> mode)."""
    dirs: dict[str, int] = {}
    special: dict[str, int] = {}
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(root / rel if rel else root) as it:
            for e in it:
                r = f"{rel}/{e.name}" if rel else e.name
                st = e.stat(follow_symlinks=False)
                mode = stat.S_IMODE(st.st_mode)
                if stat.S_ISDIR(st.st_mode):
                    dirs[r] = mode
                    stack.append(r)
                elif stat.S_ISREG(st.st_mode) and mode not in (0o644, 0o755):
                    special[r] = mode
    return dirs, special


def _apply_manifest(root: Path, dirs: dict[str, int], special: dict[str, int]) -> None:
    """Make directories and permission bits match a snapshot after ``read-tree``."""
    now_dirs, now_special = _scan(root)
    for rel in sorted(set(now_dirs) - set(dirs), key=len, reverse=True):
        shutil.rmtree(root / rel, ignore_errors=True)  # created after the snapshot
    for rel in sorted(dirs, key=len):
        p = root / rel
        if rel not in now_dirs:
            p.mkdir(exist_ok=True)
        if now_dirs.get(rel) != dirs[rel]:
            os.chmod(p, dirs[rel])
    for rel, mode in special.items():
        if now_special.get(rel) != mode:
            os.chmod(root / rel, mode)
    for rel, mode in now_special.items():
        if rel not in special and (root / rel).exists():
            # git's two modes: owner-executable or not.
            os.chmod(root / rel, 0o755 if mode & 0o100 else 0o644)


class GitSnapshot(SandboxSnapshot):
    """Trees of the working directory and of ``.git`` in the private store, plus modes."""

    kind = "git"
    backend = "git"

    def __init__(
        self,
        store: _GitStore,
        tree: str,
        git_tree: str | None,
        dirs: dict[str, int],
        special: dict[str, int],
        base: tuple[str, str | None],
    ) -> None:
        """Hold the store (the trees live in it) until released."""
        store.hold()
        self.store, self.tree, self.git_tree = store, tree, git_tree
        self.dirs, self.special = dirs, special
        super().__init__(store.drop, lambda: _git_cost(store, (tree, git_tree), base))


def _git_cost(store: _GitStore, trees: tuple[str, str | None], base: tuple[str, str | None]):
    """Disk bytes of the objects these trees add to the checkout's."""
    want = [t for t in trees if t]
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
        self.index = self.dir / "index"
        self.gindex = self.dir / "gindex"
        self.tree.mkdir(parents=True)
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
        self.base_trees = getattr(self, "base_trees", (snap.tree, snap.git_tree))

    @property
    def host_dir(self) -> Path:
        """The repository folder."""
        return self.tree

    def _base_snapshot(self, base: Path) -> GitSnapshot:
        """Trees of the checkout, hashed once per process and reused."""
        key = str(base)
        cached = self.git.base_trees.get(key)
        if cached is None:
            idx = self.dir / "base-index"
            gidx = self.dir / "base-gindex"
            self.git.git("add", "-A", "-f", "--", ".", work=base, index=idx)
            tree = self.git.git("write-tree", work=base, index=idx).strip()
            git_tree = None
            if (base / ".git").is_dir():
                self.git.git("add", "-A", "-f", "--", ".", work=base / ".git", index=gidx)
                git_tree = self.git.git("write-tree", work=base / ".git", index=gidx).strip()
            dirs, special = _scan(base)
            cached = (tree, git_tree, dirs, special)
            self.git.base_trees[key] = cached  # type: ignore[assignment]
            idx.unlink(missing_ok=True)
            gidx.unlink(missing_ok=True)
        tree, git_tree, dirs, special = cached[:4]
        self.base_trees = (tree, git_tree)
        return GitSnapshot(self.git, tree, git_tree, dict(dirs), dict(special), (tree, git_tree))

    def _checkout(self, snap: GitSnapshot) -> None:
        """Write ``snap`` into the (empty) tree with fresh private indexes."""
        self.git.git("read-tree", "--reset", "-u", snap.tree, work=self.tree, index=self.index)
        if snap.git_tree:
            (self.tree / ".git").mkdir(exist_ok=True)
            self.git.git(
                "read-tree", "--reset", "-u", snap.git_tree, work=self.tree / ".git",
                index=self.gindex,
            )  # fmt: skip
        _apply_manifest(self.tree, snap.dirs, snap.special)

    def _add(self) -> None:
        """Bring the private indexes up to date with the folder (incremental)."""
        self.git.git("add", "-A", "-f", "--", ".", work=self.tree, index=self.index)
        if (self.tree / ".git").is_dir():
            self.git.git("add", "-A", "-f", "--", ".", work=self.tree / ".git", index=self.gindex)

    def snapshot(self) -> GitSnapshot:
        """Record the trees of the folder and of .git, and the modes git does not keep."""
        self._check_open()
        self._add()
        tree = self.git.git("write-tree", work=self.tree, index=self.index).strip()
        git_tree = None
        if (self.tree / ".git").is_dir():
            git_tree = self.git.git("write-tree", work=self.tree / ".git", index=self.gindex)
            git_tree = git_tree.strip()
        dirs, special = _scan(self.tree)
        return GitSnapshot(self.git, tree, git_tree, dirs, special, self.base_trees)

    def restore(self, snap: SandboxSnapshot) -> None:
        """``read-tree --reset -u`` both trees, then fix directories and modes."""
        self._check_open()
        snap = self._check_snap(snap)
        self._add()  # files created since the snapshot must be in the index to be removed
        self.git.git("read-tree", "--reset", "-u", snap.tree, work=self.tree, index=self.index)
        gdir = self.tree / ".git"
        if snap.git_tree:
            if not gdir.is_dir():
                _remove(str(gdir))
                gdir.mkdir()
                self.gindex.unlink(missing_ok=True)
            self.git.git("read-tree", "--reset", "-u", snap.git_tree, work=gdir, index=self.gindex)
        elif os.path.lexists(gdir):
            _remove(str(gdir))
        _apply_manifest(self.tree, snap.dirs, snap.special)

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

    def create(self, task: object, checkout: Path) -> Sandbox:
        """A sandbox whose /testbed starts as ``checkout`` (never modified)."""
        if self.mode == "overlay":
            return OverlaySandbox(
                self.store, self.runner, (str(checkout),), max_layers=self.max_layers
            )
        return GitSandbox(self.store, self.runner, base=checkout)

    def from_snapshot(self, snap: SandboxSnapshot) -> Sandbox:
        """A new sandbox in ``snap``'s state (a snapshot of this backend)."""
        snap.check()
        if isinstance(snap, OverlaySnapshot) and self.mode == "overlay":
            return OverlaySandbox(self.store, self.runner, snap.stack, max_layers=self.max_layers)
        if isinstance(snap, GitSnapshot) and self.mode == "git":
            return GitSandbox(self.store, self.runner, snap=snap)
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
