"""Local sandboxes for machines without Docker: overlayfs layer stacks, or git trees.

:class:`LocalBackend` makes them: **overlay** (:mod:`~branchgym.envs.swebench.overlay`,
snapshot kind ``overlay``) where this process may mount overlayfs, **git**
(:mod:`~branchgym.envs.swebench.git_sandbox`, kind ``git``) elsewhere. Commands run under
bubblewrap with least privilege (:mod:`~branchgym.envs.swebench.runner`); mounts and the
probes of what mounting works are in :mod:`~branchgym.envs.swebench.mounts`, the layer
store in :mod:`~branchgym.envs.swebench.layers`. The threat model is in docs/swebench.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from branchgym.envs.swebench.git_sandbox import GitSandbox, GitSnapshot
from branchgym.envs.swebench.layers import Store
from branchgym.envs.swebench.limits import Limits
from branchgym.envs.swebench.mounts import index_support, overlay_support, redirect_dir_support
from branchgym.envs.swebench.overlay import OverlaySandbox, OverlaySnapshot
from branchgym.envs.swebench.repo_env import (
    installable,
    repo_environment,
    resolve_python_env,
)
from branchgym.envs.swebench.runner import Runner
from branchgym.envs.swebench.sandbox import (
    Sandbox,
    SandboxSnapshot,
)
from branchgym.envs.swebench.tasks import SWEBenchTask
from branchgym.error import (
    SandboxError,
    SandboxUnavailableError,
)

__all__ = [
    "LocalBackend",
]

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
        self.store = Store.get(Path(root) if root else None)
        ok, why = overlay_support(self.store.root.parent)
        if mode == "overlay" and not ok:
            raise SandboxUnavailableError(
                f"the overlay backend needs overlayfs mounts, but {why}. Run as root (or with "
                "CAP_SYS_ADMIN), or use mode='git' (chosen automatically with mode='auto')."
            )
        self.mode = mode if mode != "auto" else ("overlay" if ok else "git")
        self.reason = why if self.mode == "overlay" else f"git trees: {why}"
        self.limits = Limits.of(limits)  # type: ignore[arg-type]
        self.runner = Runner(isolation, self.limits, toolchain, etc_dir=self.store.root / "etc")
        self.max_layers = max_layers
        self.python_env = python_env
        self._task_runners: dict[str, Runner] = {}
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

    def runner_for(self, task: object, checkout: Path) -> Runner:
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
