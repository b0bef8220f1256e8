"""The work store: a per-process folder of frozen layers and sandbox folders.

The git backend's private snapshot repository (:class:`GitStore`) lives here too, under
the store it belongs to (``Store.git``), so the store needs nothing from the sandboxes
built on it.

Layers are reference-counted (snapshots and live mounts hold them) and deleted with their
last holder, by a background thread (:class:`Reaper`); whatever a killed process leaves,
the next process's store removes.
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import os
import shutil
import subprocess
import threading
import uuid
from pathlib import Path

from branchgym.envs.swebench.limits import pid_alive
from branchgym.envs.swebench.mounts import list_local_mounts, umount, work_root
from branchgym.error import SandboxError

__all__ = [
    "GitStore",
    "Reaper",
    "Store",
    "wait_for_cleanup",
]

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
                umount(Path(point))
            except OSError:
                pass
        if not list_local_mounts(entry):
            shutil.rmtree(entry, ignore_errors=True)


class Reaper:
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


class Store:
    """Per-process folder of frozen layers and sandbox directories, with layer refcounts."""

    _instances: dict[str, Store] = {}
    _lock = threading.Lock()

    def __init__(self, root: Path) -> None:
        self.root = root / f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.layers = self.root / "l"
        self.boxes = self.root / "s"
        self.layers.mkdir(parents=True)
        self.boxes.mkdir()
        (self.root / "trash").mkdir()
        self.reaper = Reaper(self.root / "trash")
        self.refs: dict[str, int] = {}
        self.links: dict[str, list[tuple[str, ...]]] = {}  # frozen layer -> hard links
        self.lock = threading.RLock()
        self._ids = itertools.count()
        self.git: GitStore | None = None

    @classmethod
    def get(cls, root: Path | None = None) -> Store:
        """This process's store under ``root`` (default: the work root), made on first use."""
        root = Path(root or work_root())
        with cls._lock:
            st = cls._instances.get(str(root))
            # A forked child process must not share its parent's store folder.
            if st is None or not st.root.name.startswith(f"{os.getpid()}-"):
                root.mkdir(parents=True, exist_ok=True)
                _cleanup_stale(root)
                st = cls._instances[str(root)] = Store(root)
            return st

    def new_id(self) -> str:
        """A fresh name, unique within this store."""
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
        """The path of a fresh frozen layer (not yet made)."""
        return self.layers / self.new_id()

    def acquire(self, stack: tuple[str, ...]) -> None:
        """Hold each layer of ``stack`` that lives in this store."""
        with self.lock:
            for layer in stack:
                if layer.startswith(str(self.layers) + "/"):
                    self.refs[layer] = self.refs.get(layer, 0) + 1

    def release(self, stack: tuple[str, ...]) -> None:
        """Let go of ``stack``'s layers; delete those with no holder left."""
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
                umount(root)
            except OSError:
                pass
        self.reaper.discard(root)

    def live_layers(self) -> int:
        """How many frozen layers are held."""
        with self.lock:
            return len(self.refs)


class GitStore:
    """A private bare repository holding snapshot trees; deleted with its last user."""

    def __init__(self, path: Path, reaper: Reaper) -> None:
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
        """Run ``git`` on the private store (``work``/``index``: a work tree and index)."""
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
        """Count one more user; make the bare repository for the first."""
        with self.lock:
            if self.users == 0 and not self.path.exists():
                subprocess.run(["git", "init", "-q", "--bare", str(self.path)], check=True)
                # Snapshot trees are unreachable objects: never let git prune them.
                self.git("config", "gc.auto", "0")
                self.git("config", "core.fsyncMethod", "batch")
            self.users += 1

    def drop(self) -> None:
        """Count one user less; discard the repository with the last."""
        with self.lock:
            self.users -= 1
            if self.users == 0:
                self.reaper.discard(self.path)
                self.base_trees.clear()


def wait_for_cleanup() -> None:
    """Wait until every folder discarded by local sandboxes of this process is deleted."""
    for store in list(Store._instances.values()):
        store.reaper.wait()


def _at_exit() -> None:
    """Finish deletions, and remove this process's folder when nothing is left in it."""
    wait_for_cleanup()
    for store in list(Store._instances.values()):
        if not any(store.boxes.iterdir()) and not any(store.layers.iterdir()):
            shutil.rmtree(store.root, ignore_errors=True)


# Whatever a killed process leaves, the next one removes (_cleanup_stale).
atexit.register(_at_exit)
