"""Git sandboxes: a repository in a plain folder, snapshotted as git trees.

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
"""

from __future__ import annotations

import os
import shutil
import subprocess
import weakref
from pathlib import Path

from branchgym.envs.swebench.gitsnap import gitsnap
from branchgym.envs.swebench.layers import GitStore, Store
from branchgym.envs.swebench.runner import LocalSandbox, Runner
from branchgym.envs.swebench.sandbox import (
    SandboxSnapshot,
)
from branchgym.error import (
    SandboxError,
)

__all__ = [
    "GitSnapshot",
    "GitSandbox",
]


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
        store: GitStore,
        trees: dict[str, str],
        manifest: str,
        base: tuple[str, ...],
    ) -> None:
        """Hold the store (the trees live in it) until released."""
        store.hold()
        self.store, self.trees, self.manifest = store, trees, manifest
        super().__init__(store.drop, lambda: _git_cost(store, (*trees.values(), manifest), base))


def _git_cost(store: GitStore, objs: tuple[str, ...], base: tuple[str, ...]):
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


class GitSandbox(LocalSandbox):
    """A repository in a plain folder, snapshotted as git trees; see the module docstring."""

    kind = "git"
    backend = "git"

    def __init__(
        self,
        store: Store,
        runner: Runner,
        *,
        base: Path | None = None,
        snap: GitSnapshot | None = None,
    ) -> None:
        """Start from the checkout ``base``, or from ``snap``."""
        super().__init__(store, runner)
        if store.git is None:
            store.git = GitStore(store.root / "snap.git", store.reaper)
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


def _git_cleanup(store: Store, git: GitStore, box: Path) -> None:
    store.reaper.discard(box)
    git.drop()
