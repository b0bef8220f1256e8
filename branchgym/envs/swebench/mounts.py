"""Mount system calls and the probes of what this process may mount.

The overlayfs, tmpfs and move mounts the overlay sandbox stacks its layers with
(:mod:`~branchgym.envs.swebench.overlay`), the mount list of the work root, and cached
probes that try for real whether overlayfs (with ``redirect_dir`` and ``index``) and
bubblewrap work here (:class:`~branchgym.envs.swebench.local.LocalBackend` picks its mode
with them).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "mount_overlay",
    "mount_tmpfs",
    "move_mount",
    "bind_shared",
    "umount",
    "list_local_mounts",
    "work_root",
    "overlay_support",
    "redirect_dir_support",
    "index_support",
    "bwrap_support",
]

_MNT_DETACH = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p,) * 3 + (ctypes.c_ulong, ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


# ---------------------------------------------------------------------- mounting


def mount_overlay(
    target: Path,
    lowers: tuple[str, ...],
    upper: Path,
    work: Path,
    redirect_dir: bool = False,
    index: bool = False,
) -> None:
    """Mount overlayfs at ``target``: ``lowers`` (topmost first) under ``upper``."""
    # metacopy off: full copy-ups, so a frozen upper layer holds every file it changed.
    # redirect_dir=on lets rename(2) move a folder of a lower layer (else EXDEV): the
    # upper layer records where it came from (an xattr the kernel follows when the layer
    # is frozen below another; the overlay module's squash resolves it). index=on: a
    # write to one name of a hard link from a lower layer copies the inode up once, for
    # every name.
    redirect = "on" if redirect_dir else "off"
    data = (
        f"lowerdir={':'.join(lowers)},upperdir={upper},workdir={work},"
        f"redirect_dir={redirect},index={'on' if index else 'off'},metacopy=off"
    ).encode()
    if _libc.mount(b"overlay", os.fsencode(target), b"overlay", 0, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount overlay on {target}: {os.strerror(err)}")


_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_MOVE = 1, 2, 4, 32, 8192


def mount_tmpfs(target: Path, size: int | None) -> None:
    """A tmpfs of ``size`` bytes (None: the kernel's default, half of memory) at ``target``."""
    opts = "mode=755" + (f",size={size}" if size is not None else "")
    if (
        _libc.mount(b"tmpfs", os.fsencode(target), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts.encode())
        != 0
    ):
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs on {target}: {os.strerror(err)}")


def move_mount(source: Path, target: Path) -> None:
    """Move the mount at ``source`` to ``target`` (the files stay where they are)."""
    if _libc.mount(os.fsencode(source), os.fsencode(target), None, _MS_MOVE, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"move mount {source} -> {target}: {os.strerror(err)}")
    # A frozen layer is never written again: make that a kernel guarantee.
    flags = _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV
    _libc.mount(b"tmpfs", os.fsencode(target), b"tmpfs", flags, None)


_MS_BIND, _MS_SHARED = 4096, 1 << 20


def bind_shared(target: Path) -> None:
    """Make the folder ``target`` a shared mount point (a bind mount onto itself).

    A mount made on it later propagates to its peers and slaves: a container given it as
    a bind mount with ``rslave`` propagation sees a host-side overlay mounted (or
    unmounted) there at once (:mod:`~branchgym.envs.swebench.docker_overlay`).
    """
    path = os.fsencode(target)
    if _libc.mount(path, path, None, _MS_BIND, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bind mount {target}: {os.strerror(err)}")
    if _libc.mount(b"none", path, None, _MS_SHARED, None) != 0:
        err = ctypes.get_errno()
        _libc.umount2(path, _MNT_DETACH)
        raise OSError(err, f"make {target} a shared mount: {os.strerror(err)}")


def umount(target: Path) -> None:
    """Unmount ``target`` (nothing mounted there: a no-op; busy: detach lazily)."""
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
        mount_overlay(probe / "m", (str(probe / "l"),), probe / "u", probe / "w")
        try:
            ok = (probe / "m" / "f").read_text() == "x"
        finally:
            umount(probe / "m")
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
        mount_overlay(probe / "m", (str(probe / "l"),), probe / "u", probe / "w", True)
        try:
            os.rename(probe / "m" / "d", probe / "m" / "e")  # EXDEV without redirects
            return True
        except OSError:
            return False
        finally:
            umount(probe / "m")

    return _overlay_probe(root, "redirect", "l/d", trial)


def index_support(root: Path | None = None) -> bool:
    """Does overlayfs here mount with ``index=on`` (hard links survive copy-up)? Cached."""

    def trial(probe: Path) -> bool:
        (probe / "l" / "a").write_text("a")
        os.link(probe / "l" / "a", probe / "l" / "b")
        mount_overlay(probe / "m", (str(probe / "l"),), probe / "u", probe / "w", index=True)
        try:
            with open(probe / "m" / "a", "a") as f:
                f.write("b")
            return (probe / "m" / "b").read_text() == "ab"
        finally:
            umount(probe / "m")

    return _overlay_probe(root, "index", "l", trial)


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
