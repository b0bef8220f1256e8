"""The bubblewrap command runner, and the host folder at /testbed both local sandboxes share.

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

import copy
import dataclasses
import functools
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from branchgym.envs.swebench.layers import Store
from branchgym.envs.swebench.limits import Limits, cgroups
from branchgym.envs.swebench.mounts import bwrap_support, work_root
from branchgym.envs.swebench.repo_env import (
    RepoEnvironment,
)
from branchgym.envs.swebench.sandbox import (
    WORKDIR,
    ExecResult,
    Sandbox,
    default_env,
    inside_workdir,
    run_captured,
    tree_digest,
)
from branchgym.envs.swebench.tasks import cache_root
from branchgym.error import (
    SandboxConfigError,
    SandboxError,
    SandboxSetupError,
    SandboxUnavailableError,
)

__all__ = [
    "SANDBOX_UID",
    "Runner",
    "LocalSandbox",
    "interpreter_paths",
]

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


#: Mount configurations a sandbox was started with in this process (``Runner.check``).
_STARTED: set[tuple[object, ...]] = set()


class Runner:
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

    def for_python(self, env: RepoEnvironment) -> Runner:
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
        """The environment commands get when none is given."""
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
        """Run ``bash -c command`` at ``cwd`` with ``host_dir`` as /testbed; see the class."""
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


class LocalSandbox(Sandbox):
    """What both local sandboxes share: a host folder bound at /testbed."""

    def __init__(self, store: Store, runner: Runner) -> None:
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
