"""Resource limits for sandbox commands, and the kernel mechanisms that enforce them.

Every command an agent runs gets the limits of one :class:`Limits` (defaults below; any of
them can be changed or turned off with ``None``):

========== ========== ======================================================================
limit      default    enforced by
========== ========== ======================================================================
memory     2 GiB      a memory cgroup per command (v2 ``memory.max`` or v1
                      ``memory.limit_in_bytes``, swap included); tmpfs pages count too
pids       256        a pids cgroup per command (``pids.max``): a fork bomb gets EAGAIN
cpu        300 s      ``RLIMIT_CPU`` (CPU seconds per process; the wall-clock timeout of the
                      command bounds the rest)
disk       1 GiB      overlay backend: the writable layer is a tmpfs of this size; git
                      backend and Docker without a quota-capable storage driver: only
                      ``RLIMIT_FSIZE`` (no single file larger than this)
tmp        256 MiB    the sandbox's private ``/tmp`` is a tmpfs of this size
output     2 MiB      bytes of command output kept (head; the last 256 KiB are kept too)
========== ========== ======================================================================

Where cgroups cannot be created (not root, no writable cgroup file system), memory falls
back to ``RLIMIT_AS`` and the process limit is not enforced; :attr:`Cgroups.reason` says
so, and ``SWEBenchEnv.info`` reports what is enforced.

When a command hits a limit its :class:`~branchgym.envs.swebench.sandbox.ExecResult`
names it (``limit="memory limit 2 GiB"``) and the env's observation says
``[killed: memory limit 2 GiB]`` (or ``[fork failed: process limit 256]``, ...).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from branchgym.error import SandboxConfigError

__all__ = [
    "Limits",
    "parse_size",
    "format_size",
    "Cgroups",
    "CommandGroup",
    "cgroups",
    "pid_alive",
]

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(value: Any, what: str = "size") -> int:
    """Bytes from an int or a string such as ``"512M"``, ``"2GiB"``, ``"1.5g"`` (powers of 1024).

    Raises:
        SandboxConfigError: not a positive size.
    """
    if isinstance(value, bool):
        raise SandboxConfigError(
            f"{what} must be a size such as 2147483648 or '2GiB', not {value!r}"
        )
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str) and (m := _SIZE.match(value)):
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise SandboxConfigError(
            f"{what} must be a size such as 2147483648 or '2GiB' (units K, M, G, T), not {value!r}"
        )
    if n <= 0:
        raise SandboxConfigError(f"{what} must be positive (or None for no limit), not {value!r}")
    return n


def format_size(n: int) -> str:
    """``2147483648`` -> ``'2 GiB'``; ``1536`` -> ``'1.5 KiB'``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            v = n / size
            return f"{v:g} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-command resource limits (``None`` turns one off).

    Attributes:
        memory: Bytes of memory (and swap) for all processes of one command.
        pids: Processes and threads alive at once in one command.
        cpu: CPU seconds per process (``RLIMIT_CPU``).
        disk: Bytes of the sandbox's writable layer (``/testbed``'s changes).
        tmp: Bytes of the sandbox's private ``/tmp``.
        output: Bytes of command output kept (head), besides a 256 KiB tail.
    """

    memory: int | None = 2 << 30
    pids: int | None = 256
    cpu: int | None = 300
    disk: int | None = 1 << 30
    tmp: int | None = 256 << 20
    output: int = 2 << 20

    def __post_init__(self) -> None:
        for name in ("memory", "disk", "tmp", "output"):
            v = getattr(self, name)
            if v is None and name == "output":
                raise SandboxConfigError("limits.output cannot be None: output is always capped")
            if v is not None:
                object.__setattr__(self, name, parse_size(v, f"limits.{name}"))
        for name in ("pids", "cpu"):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int | float) or v != v or v < 1:
                raise SandboxConfigError(
                    f"limits.{name} must be a whole number >= 1 (or None for no limit), not {v!r}"
                )
            if not float(v).is_integer():
                raise SandboxConfigError(f"limits.{name} must be a whole number, not {v!r}")
            object.__setattr__(self, name, int(v))
        if self.pids is not None and self.pids < 8:
            raise SandboxConfigError(
                f"limits.pids={self.pids} leaves no room for the shell and its pipes; use 8 or more"
            )

    @classmethod
    def of(cls, value: Limits | Mapping[str, Any] | None) -> Limits:
        """``None`` -> the defaults; a mapping -> the defaults with those fields changed."""
        if value is None:
            return cls()
        if isinstance(value, Limits):
            return value
        if not isinstance(value, Mapping):
            raise SandboxConfigError(
                f"limits must be a Limits, a dict of its fields or None, not {type(value).__name__}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise SandboxConfigError(
                f"unknown limit(s) {', '.join(map(repr, unknown))}; the limits are "
                f"{', '.join(sorted(names))}"
            )
        return cls(**dict(value))

    def describe(self, name: str) -> str:
        """``'memory limit 2 GiB'``, ``'process limit 256'``, ``'CPU time limit 300 s'``, ..."""
        v = getattr(self, name)
        if name == "pids":
            return f"process limit {v}"
        if name == "cpu":
            return f"CPU time limit {v} s"
        label = {"disk": "disk quota", "tmp": "/tmp quota", "output": "output limit"}
        return f"{label.get(name, name + ' limit')} {format_size(v)}"

    def explain(
        self,
        exit_code: int,
        output: bytes,
        *,
        oom: bool = False,
        pids_max: bool = False,
        layer_full: bool = False,
        enospc: str = "tmp",
    ) -> str:
        """The limit a finished command hit, as the observation names it ('' for none).

        Args:
            exit_code: The command's exit status (128 + SIGXCPU / SIGXFSZ name rlimits).
            output: Its output (the kernel's "No space left on device", bash's "File size
                limit exceeded").
            oom: Its memory cgroup killed a process.
            pids_max: Its pids cgroup refused a fork.
            layer_full: The writable layer's quota mount filled up during it.
            enospc: The limit an unexplained ENOSPC belongs to (``tmp`` where ``/tmp`` is a
                sized tmpfs of its own, ``disk`` where it is part of the writable layer).
        """
        if oom and self.memory is not None:
            return self.describe("memory")
        if exit_code == 128 + signal.SIGXCPU and self.cpu is not None:
            return self.describe("cpu")
        if pids_max and self.pids is not None:
            return self.describe("pids")
        if self.disk is not None:
            if layer_full:
                return self.describe("disk")
            if exit_code == 128 + signal.SIGXFSZ or b"File size limit exceeded" in output:
                return self.describe("disk") + " (file size)"
        if b"No space left on device" in output and getattr(self, enospc) is not None:
            return self.describe(enospc)
        return ""

    def ulimit_prefix(self, *, memory_rlimit: bool) -> str:
        """``ulimit`` lines (soft and hard) that start a command's script."""
        parts = []
        if self.cpu is not None:
            parts.append(f"-t {self.cpu}")
        if self.disk is not None:
            parts.append(f"-f {max(1, self.disk // 1024)}")
        if memory_rlimit and self.memory is not None:
            parts.append(f"-v {max(1, self.memory // 1024)}")
        return f"ulimit {' '.join(parts)} || exit 125\n" if parts else ""


# ------------------------------------------------------------------------- cgroups


class CommandGroup:
    """The cgroup(s) of one command: created with its limits, removed after it ends."""

    def __init__(self, owner: Cgroups, dirs: dict[str, Path]) -> None:
        """``dirs``: controller (``memory``, ``pids`` or ``unified``) -> its group folder."""
        self.owner = owner
        self.dirs = dirs
        self._base = self._counts()

    def argv_prefix(self) -> list[str]:
        """A ``sh`` that joins the groups and ``exec``s the rest of the argv."""
        files = [str(d / "cgroup.procs") for d in dict.fromkeys(self.dirs.values())]
        script = (
            'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; '
            'n=$((n-1)); done; exec "$@"'
        )
        return ["/bin/sh", "-c", script, "sh", str(len(files)), *files]

    def _read(self, controller: str, name: str) -> str:
        d = self.dirs.get(controller)
        if d is None:
            return ""
        try:
            return (d / name).read_text()
        except OSError:
            return ""

    def _counts(self) -> dict[str, int]:
        if "unified" in self.dirs:
            mem = _field(self._read("unified", "memory.events"), "oom_kill")
            pids = _field(self._read("unified", "pids.events"), "max")
        else:
            mem = _field(self._read("memory", "memory.oom_control"), "oom_kill")
            pids = _field(self._read("pids", "pids.events"), "max")
        return {"oom_kill": mem, "pids_max": pids}

    def hit(self) -> dict[str, int]:
        """How often each limit was hit during the command (``oom_kill``, ``pids_max``)."""
        now = self._counts()
        return {k: now[k] - self._base.get(k, 0) for k in now}

    def close(self) -> None:
        """Kill whatever is still in the groups, then remove them."""
        for d in dict.fromkeys(self.dirs.values()):
            _kill_and_remove(d)


def _field(text: str, key: str) -> int:
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if k == key and v.strip().isdigit():
            return int(v)
    return 0


def _kill_and_remove(d: Path) -> None:
    deadline = time.monotonic() + 5.0
    while True:
        try:
            pids = [int(p) for p in (d / "cgroup.procs").read_text().split()]
        except OSError:
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.rmdir(d)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return  # left for _cleanup_stale of a later process
            time.sleep(0.01)


class Cgroups:
    """Creates per-command cgroups under ``branchgym/`` (cgroup v2, or v1 memory + pids).

    Attributes:
        available: Groups can be created here.
        version: ``2``, ``1`` or ``0`` (none).
        reason: Why not, when unavailable; which hierarchy is used, otherwise.
    """

    def __init__(self, mount: str | os.PathLike[str] = "/sys/fs/cgroup") -> None:
        """Find a writable hierarchy and make the ``branchgym`` parent group."""
        self.mount = Path(mount)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.parents: dict[str, Path] = {}
        self.version = 0
        self.available = False
        self.reason = ""
        try:
            self._setup()
        except OSError as exc:
            self.parents = {}
            self.version = 0
            self.reason = f"cannot create cgroups under {self.mount}: {exc.strerror or exc}"
        else:
            self.available = bool(self.parents)

    def _setup(self) -> None:
        name = "branchgym"
        unified = self.mount / "cgroup.controllers"
        if unified.exists():
            controllers = unified.read_text().split()
            if not {"memory", "pids"} <= set(controllers):
                self.reason = f"cgroup v2 at {self.mount} lacks the memory or pids controller"
                return
            parent = self.mount / name
            parent.mkdir(exist_ok=True)
            (self.mount / "cgroup.subtree_control").write_text("+memory +pids")
            (parent / "cgroup.subtree_control").write_text("+memory +pids")
            self.parents = {"unified": parent}
            self.version = 2
            self.reason = f"cgroup v2 ({parent})"
        else:
            found = {}
            for ctl in ("memory", "pids"):
                base = self.mount / ctl
                if not (base / "cgroup.procs").exists():
                    self.reason = f"no cgroup v1 {ctl} hierarchy at {base}"
                    return
                (base / name).mkdir(exist_ok=True)
                found[ctl] = base / name
            self.parents = found
            self.version = 1
            self.reason = f"cgroup v1 ({', '.join(map(str, found.values()))})"
        self._cleanup_stale()

    def _cleanup_stale(self) -> None:
        for parent in self.parents.values():
            for d in parent.iterdir():
                pid, _, _ = d.name.partition("-")
                if d.is_dir() and pid.isdigit() and not pid_alive(int(pid)):
                    _kill_and_remove(d)

    def create(self, limits: Limits) -> CommandGroup | None:
        """Groups for one command with ``limits``' memory and pids, or None if unavailable."""
        if not self.available or (limits.memory is None and limits.pids is None):
            return None
        with self._lock:
            gid = f"{os.getpid()}-{threading.get_ident() % 100000}-{next(self._ids)}"
        dirs: dict[str, Path] = {}
        try:
            if self.version == 2:
                d = self.parents["unified"] / gid
                d.mkdir()
                dirs["unified"] = d
                if limits.memory is not None:
                    (d / "memory.max").write_text(str(limits.memory))
                    if (d / "memory.swap.max").exists():
                        (d / "memory.swap.max").write_text("0")
                if limits.pids is not None:
                    (d / "pids.max").write_text(str(limits.pids))
            else:
                if limits.memory is not None:
                    d = self.parents["memory"] / gid
                    d.mkdir()
                    dirs["memory"] = d
                    (d / "memory.limit_in_bytes").write_text(str(limits.memory))
                    if (d / "memory.memsw.limit_in_bytes").exists():
                        (d / "memory.memsw.limit_in_bytes").write_text(str(limits.memory))
                if limits.pids is not None:
                    d = self.parents["pids"] / gid
                    d.mkdir()
                    dirs["pids"] = d
                    (d / "pids.max").write_text(str(limits.pids))
        except OSError:
            for d in dirs.values():
                _kill_and_remove(d)
            raise
        return CommandGroup(self, dirs)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (a pid we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_CGROUPS: Cgroups | None = None
_CG_LOCK = threading.Lock()


def cgroups() -> Cgroups:
    """This process's :class:`Cgroups` (probed once)."""
    global _CGROUPS
    with _CG_LOCK:
        if _CGROUPS is None:
            _CGROUPS = Cgroups()
        return _CGROUPS
