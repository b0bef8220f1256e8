"""Docker sandboxes whose ``/testbed`` is a host-side overlay layer stack (``docker-overlay``).

``docker commit`` pays for a new container at every restore (about 290 ms here) and for
Docker API calls (about 95 ms each): over 700 ms for a snapshot and a restore at 1,000
changed files, where the overlay backend's layer stack costs about 40 ms. This mode runs
commands in a container as the ``docker`` backend does (same image, limits, user and
least privilege), but ``/testbed`` is the overlay backend's layer stack, mounted on the
host:

* the container's ``/testbed`` is a bind mount, with ``rslave`` propagation, of a host
  folder made a shared mount point (:func:`~branchgym.envs.swebench.mounts.bind_shared`)
  before the container starts. The overlay is mounted on that folder after the start, so
  every later host-side unmount and mount of it shows in the container at once;
* ``snapshot()`` freezes the upper layer and ``restore()`` remounts over the snapshot's
  stack (:class:`~branchgym.envs.swebench.overlay.OverlaySandbox`): a few system calls on
  the host, no Docker call, no new container. ``fork()`` starts a container from the same
  image over the snapshot's stack;
* the bottom layer is the image's own ``/testbed``, copied out of the image once per
  image (owners, modes and links kept), so SWE-bench's images work as they are.

What the state is: ``/testbed``, as in ``docker-git`` mode. The rest of the container's
file system is read-only (``read_only``), so nothing else can carry state from one
sibling to the next; ``/tmp`` (and the agent's home in branchgym-built images) are scratch
tmpfs mounts that ``restore()`` empties and a fork starts without: files left there at
snapshot time are not restored. Processes are not state either (as in every backend).

Needs: a local daemon that shares this process's mounts (a daemon in another mount
namespace, rootless or remote Docker cannot see the host folder: the backend refuses with
a typed error at the first sandbox) and permission to mount overlayfs (root).
"""

from __future__ import annotations

import os
import posixpath
import shutil
import tarfile
import tempfile
import threading
from pathlib import Path

from branchgym.envs.swebench.docker_sandbox import (
    AGENT_HOME,
    Container,
    ContainerHost,
    DockerSandbox,
    docker_sdk,
    owner_labels,
)
from branchgym.envs.swebench.layers import Store
from branchgym.envs.swebench.mounts import index_support, overlay_support, redirect_dir_support
from branchgym.envs.swebench.overlay import OverlaySandbox, OverlaySnapshot
from branchgym.envs.swebench.runner import Runner
from branchgym.envs.swebench.sandbox import WORKDIR, Sandbox, SandboxSnapshot, inside_workdir
from branchgym.error import SandboxError, SandboxUnavailableError

__all__ = ["DockerOverlaySnapshot", "DockerOverlaySandbox", "OverlayLayers"]


class DockerOverlaySnapshot(SandboxSnapshot):
    """A frozen layer stack of ``/testbed`` and the image its container ran."""

    kind = "container+overlay"
    backend = "docker-overlay"

    def __init__(self, layers: OverlaySnapshot, image_id: str, backend: ContainerHost) -> None:
        """Hold ``layers`` and ``image_id`` until released."""
        images = backend.images
        images.hold(image_id)
        self.layers = layers
        self.image_id = image_id

        def release() -> None:
            layers.release()
            images.drop(image_id)

        super().__init__(release, lambda: layers.nbytes)


class OverlayLayers:
    """What a Docker backend's overlay mode keeps on the host: the layer store and bases."""

    def __init__(self, backend: ContainerHost) -> None:
        """Check that this process can mount overlayfs; the daemon is checked at first use."""
        self.store = Store.get(None)
        ok, why = overlay_support(self.store.root.parent)
        if not ok:
            raise SandboxUnavailableError(
                f"the docker-overlay backend mounts overlayfs on the host, but {why}. Run as "
                "root, or use backend='docker' or 'docker-git'."
            )
        # Commands run in the container; the runner only sizes the writable layer's tmpfs.
        self.runner = Runner("none", backend.limits, etc_dir=self.store.root / "etc")
        self.redirect_dir = redirect_dir_support(self.store.root.parent)
        self.index = index_support(self.store.root.parent)
        self.backend = backend
        self.checked = False

    def base(self, image_id: str) -> tuple[str, tuple[int, int, int]]:
        """``/testbed`` of ``image_id`` as a host folder, and its root's (uid, gid, mode).

        Copied out once per image and process, then shared by every sandbox of it (the
        bottom layer of their stacks: never written, never removed while they live).
        """
        key = (str(self.store.root), image_id)
        with _BASES_LOCK:
            if key not in _BASES:
                _BASES[key] = self._extract(image_id)
            return _BASES[key]

    def _extract(self, image_id: str) -> tuple[str, tuple[int, int, int]]:
        bases = self.store.root / "bases"
        bases.mkdir(parents=True, exist_ok=True)
        target = Path(tempfile.mkdtemp(prefix=image_id.replace("sha256:", "")[:16], dir=bases))
        client = self.backend.client
        labels = owner_labels()
        box = client.containers.create(image_id, ["true"], network_disabled=True, labels=labels)
        try:
            chunks, _ = box.get_archive(WORKDIR)
            with tempfile.TemporaryFile(dir=self.store.root) as f:
                for chunk in chunks:
                    f.write(chunk)
                f.seek(0)
                with tarfile.open(fileobj=f) as tar:
                    root_owner = _extract_testbed(tar, target)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
        finally:
            box.remove(force=True)
        return str(target), root_owner


#: (layer store root, image id) -> (bottom layer folder, its root's uid, gid, mode).
_BASES: dict[tuple[str, str], tuple[str, tuple[int, int, int]]] = {}
_BASES_LOCK = threading.Lock()


def _inside(name: str) -> str | None:
    """``testbed/a/b`` -> ``a/b``; ``testbed`` -> ``""``; anything else -> None."""
    norm = posixpath.normpath(name)
    if norm == "testbed":
        return ""
    if not norm.startswith("testbed/") or ".." in norm.split("/"):
        return None
    return norm[len("testbed/") :]


def _extract_testbed(tar: tarfile.TarFile, target: Path) -> tuple[int, int, int]:
    """Unpack Docker's archive of ``/testbed`` into ``target``; its root's (uid, gid, mode)."""
    root = (0, 0, 0o755)
    members = []
    for m in tar.getmembers():
        rel = _inside(m.name)
        if rel is None:
            raise SandboxError(f"unexpected path {m.name!r} in the image's /testbed archive")
        if rel == "":
            root = (m.uid, m.gid, m.mode & 0o7777)
            continue
        if m.islnk():
            link = _inside(m.linkname)
            if not link:
                raise SandboxError(f"hard link {m.name!r} -> {m.linkname!r} leaves /testbed")
            m.linkname = link
        m.name = rel
        members.append(m)
    # Owners, modes (setgid and group-write bits too) and links exactly as in the image:
    # the names were checked above, and symlinks are only followed inside the container.
    tar.extractall(target, members=members, numeric_owner=True, filter="fully_trusted")
    os.chown(target, root[0], root[1])
    os.chmod(target, root[2])
    return root


class DockerOverlaySandbox(DockerSandbox):
    """A container whose ``/testbed`` is a host-side overlay layer stack; see the module."""

    kind = "container+overlay"

    def __init__(
        self, backend: ContainerHost, image_id: str, stack: tuple[str, ...] | None = None
    ) -> None:
        """Start a container of ``image_id`` over ``stack`` (default: the image's /testbed)."""
        Sandbox.__init__(self)
        self.b = backend
        self.backend = "docker-overlay"
        self._start(image_id, stack)

    def _start(self, image_id: str, stack: tuple[str, ...] | None) -> None:
        """A container of ``image_id`` and ``/testbed``'s layers, mounted after its start."""
        backend = self.b
        hosts = backend.overlay
        bottom, owner = hosts.base(image_id)
        info = backend.image_info(image_id)
        scratch = {"/tmp": _tmpfs(backend.limits.tmp, 0o1777)}
        if info.user == backend.user and info.user.split(":")[0] != "0":  # branchgym-built
            uid, _, gid = info.user.partition(":")
            scratch[AGENT_HOME] = _tmpfs(backend.limits.tmp, 0o755, uid, gid or uid)
        boxes: list[Container] = []

        def start(merged: Path) -> None:
            docker = docker_sdk()
            mount = docker.types.Mount(WORKDIR, str(merged), type="bind", propagation="rslave")
            try:
                boxes.append(
                    Container(backend, image_id, mounts=[mount], read_only=True, tmpfs=scratch)
                )
            except SandboxError:
                raise
            except Exception as exc:
                raise SandboxUnavailableError(
                    f"the docker-overlay backend binds a host folder ({merged}) into the "
                    f"container, and the daemon refused: {exc}. It needs a local daemon "
                    "that shares this process's mounts; use backend='docker' or 'docker-git'."
                ) from exc

        try:
            self.layers = OverlaySandbox(
                hosts.store, hosts.runner, stack or (bottom,), redirect_dir=hosts.redirect_dir,
                index=hosts.index, shared=True, before_mount=start, root_owner=owner,
            )  # fmt: skip
        except BaseException:
            for box in boxes:
                box.drop()
            raise
        self.box = boxes[0]
        self._scratch = tuple(scratch)
        self._host_pid: int | None = None  # the container's init as the host sees it
        if not hosts.checked:
            self._check_mounts(hosts)

    def _check_mounts(self, hosts: OverlayLayers) -> None:
        """The container must see the host's overlay at ``/testbed`` (once per backend)."""
        res = self._exec(["stat", "-f", "-c", "%T", WORKDIR], 30.0)
        if res.exit_code != 0 or "overlay" not in res.text:
            self.close()
            raise SandboxUnavailableError(
                "the docker-overlay backend mounts /testbed's layers on the host, but the "
                f"container does not see them ({WORKDIR} is {res.text.strip()!r}): the daemon "
                "runs in another mount namespace (rootless, remote, or a service with "
                "private mounts). Use backend='docker' or 'docker-git'."
            )
        hosts.checked = True

    # -- files: on the host, through the merged mount (no Docker call) ------------------
    def read(self, path: str) -> bytes:
        """A file's bytes, read on the host (links that lead outside /testbed refused)."""
        self._check_open()
        return self.layers.read(path)

    def write(self, path: str, data: bytes, mode: int | None = None) -> None:
        """Create or replace a file on the host, owned by the container's user."""
        self._check_open()
        root = self.layers.host_dir
        target = root / inside_workdir(path)
        made = []  # the folders this write creates, which need the owner too
        parent = target.parent
        while parent != root and not os.path.lexists(parent):
            made.append(parent)
            parent = parent.parent
        self.layers.write(path, data, 0o644 if mode is None else mode)
        uid, _, gid = self.box.info.user.partition(":")
        owner = int(uid or 0), int(gid or uid or 0)
        os.chown(target, *owner)  # a link here leads inside /testbed (checked by write)
        for folder in made:
            os.lchown(folder, *owner)

    def tree_digest(self) -> str:
        """Hash of /testbed, computed on the host (the same code as in the container)."""
        self._check_open()
        return self.layers.tree_digest()

    # -- snapshots ----------------------------------------------------------------
    def snapshot(self) -> SandboxSnapshot:
        """Freeze ``/testbed``'s upper layer on the host (no Docker call)."""
        self._check_open()
        return DockerOverlaySnapshot(self.layers.snapshot(), self.box.image_id, self.b)

    def restore(self, snap: SandboxSnapshot) -> None:
        """Remount ``/testbed`` over the snapshot's stack and empty the scratch folders."""
        self._check_open()
        if not isinstance(snap, DockerOverlaySnapshot):
            raise SandboxError(f"a {self.kind} sandbox cannot restore a {snap.kind} snapshot")
        snap.check()
        if snap.image_id != self.box.image_id:  # from another image: a container of it
            old_box, old_layers = self.box, self.layers
            self._start(snap.image_id, snap.layers.stack)
            old_box.drop()
            old_layers.close()
            return
        self.layers.restore(snap.layers)
        self._empty_scratch()

    def _empty_scratch(self) -> None:
        """Delete what commands left in the scratch tmpfs mounts, from the host."""
        if self._host_pid is None:
            self.box.c.reload()  # once per container: run() returns it as created
            self._host_pid = int(self.box.c.attrs["State"]["Pid"])
        for folder in self._scratch:
            root = f"/proc/{self._host_pid}/root{folder}"
            # rmtree removes links, never what they point at (fd-based on Linux).
            with os.scandir(root) as it:
                for entry in it:
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path)
                    else:
                        os.unlink(entry.path)

    def close(self) -> None:
        """Remove the container (in the background) and unmount ``/testbed``'s layers."""
        if self.closed:
            return
        self.closed = True
        self.box.drop()
        self.layers.close()

    def resources(self) -> dict[str, int]:
        """Snapshot images this process owns, and host mounts and layers."""
        return {"images": self.b.images.owned(), **self.layers.resources()}


def _tmpfs(size: int | None, mode: int, uid: str = "0", gid: str = "0") -> str:
    opts = f"mode={mode:o},uid={uid},gid={gid},nosuid,nodev"
    return opts + (f",size={size}" if size is not None else "")
