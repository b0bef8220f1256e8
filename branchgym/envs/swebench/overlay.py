"""Overlay sandboxes: a repository in an overlayfs layer stack.

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
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import time
import weakref
from collections.abc import Callable
from pathlib import Path

from branchgym.envs.swebench.layers import Store
from branchgym.envs.swebench.mounts import (
    bind_shared,
    mount_overlay,
    mount_tmpfs,
    move_mount,
    umount,
)
from branchgym.envs.swebench.runner import LocalSandbox, Runner
from branchgym.envs.swebench.sandbox import (
    SandboxSnapshot,
    du_bytes,
)
from branchgym.error import (
    SandboxError,
)

__all__ = [
    "OverlaySnapshot",
    "OverlaySandbox",
]

# ------------------------------------------------------------------------ overlay


class OverlaySnapshot(SandboxSnapshot):
    """A frozen layer stack (topmost first, checkout last)."""

    kind = "overlay"
    backend = "overlay"

    def __init__(self, store: Store, stack: tuple[str, ...], top: str | None) -> None:
        """Hold ``stack``; ``top`` is the layer this snapshot created (its disk cost)."""
        store.acquire(stack)
        self.stack = stack
        self.store = store
        super().__init__(lambda: store.release(stack), lambda: du_bytes(top) if top else 0)


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


class OverlaySandbox(LocalSandbox):
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
        store: Store,
        runner: Runner,
        stack: tuple[str, ...],
        *,
        max_layers: int = 32,
        redirect_dir: bool = False,
        index: bool = False,
        shared: bool = False,
        before_mount: Callable[[Path], None] | None = None,
        root_owner: tuple[int, int, int] | None = None,
    ) -> None:
        """Mount a fresh upper layer over ``stack`` (topmost first, checkout last).

        ``redirect_dir``: mount with ``redirect_dir=on`` (rename(2) of folders from
        lower layers works; without it, EXDEV, as in Docker's overlay2). ``index``:
        mount with ``index=on`` and link hard links up at snapshot time, so names of one
        inode stay one inode across snapshots (without it, a write after a snapshot
        goes to the written name only). ``shared``: the merged folder is first made a
        shared mount point, so that every later overlay mount on it propagates to its
        bind mounts; ``before_mount(merged)`` runs before the first overlay mount (a
        container binding the folder starts there). ``root_owner``: ``(uid, gid,
        mode)`` of every fresh upper layer's root (the merged root takes it: it must be
        the bottom layer's, or commands lose their write permission at the top).
        """
        super().__init__(store, runner)
        self.root_owner = root_owner
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
        state = {"stack": (), "mounted": False, "rw": False, "bound": False}
        self._state = state  # shared with the finalizer, which must not refer to self
        self._finalizer = weakref.finalize(self, _overlay_cleanup, store, self.dir, state)
        try:
            self._new_rw()
            if shared:
                bind_shared(self.merged)
                state["bound"] = True
            if before_mount is not None:
                before_mount(self.merged)
            self._mount(stack)
        except BaseException:
            self._finalizer()
            raise

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
        mount_tmpfs(self.rw, self.runner.limits.disk)
        self._state["rw"] = True
        self.upper.mkdir()
        self.work.mkdir()
        if self.root_owner is not None:
            uid, gid, mode = self.root_owner
            os.chown(self.upper, uid, gid)
            os.chmod(self.upper, mode)

    def _mount(self, stack: tuple[str, ...]) -> None:
        self.store.acquire(stack)
        # index=on only over layers with hard links: it makes the kernel refuse a
        # frozen layer for a few ms after a command (EBUSY below), a cost only they pay.
        index = self.index and any(layer in self.store.links for layer in stack)
        try:
            for wait in (0.001, 0.004, 0.016, 0.064, 0.25, 1.0, None):
                try:
                    lowers = tuple(map(self.store.option_path, stack))
                    mount_overlay(
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
        umount(self.merged)
        self._state["mounted"] = False

    def _upper_empty(self) -> bool:
        with os.scandir(self.upper) as it:
            return next(it, None) is None

    def _fresh_upper(self) -> None:
        """Throw the upper layer away: unmount its tmpfs and mount an empty one."""
        # With index=on the upper root remembers its lower stack (an origin xattr): a
        # mount over another stack needs a new one even when nothing was written.
        if self._index_on or not self._upper_empty():
            umount(self.rw)
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
        move_mount(self.rw, layer_root)
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
                    # Only a name reached without links: a folder the agent swapped for a
                    # link would make this chown (which clears set-uid bits) a host file.
                    if os.path.realpath(p) != str(p):
                        continue
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


def _overlay_cleanup(store: Store, box: Path, state: dict) -> None:
    for flag, sub in (("mounted", "m"), ("rw", "rw"), ("bound", "m")):
        if state[flag]:
            try:
                umount(box / sub)
            except OSError:
                pass
            state[flag] = False
    store.reaper.discard(box)
    store.release(state["stack"])
    state["stack"] = ()
