"""``branchgym/SWEBench-v0``: fix a repository with shell commands, graded as SWE-bench grades.

Each episode is one task. The observation at reset is the issue text; every action is one
bash command run in the sandbox's ``/testbed`` (observation: its output, cut to
``max_output_chars`` with a note, plus the exit code when non-zero, or a timeout note).
The working directory and exported variables carry over between commands: they are
tracked in Python (each command ends by reporting ``pwd`` and ``env``), so a snapshot
holds them with the file system. ``submit`` ends the episode: the diff of the working
tree against the base commit is graded in a fresh sandbox (test patch, tests, pytest log
parser); the reward is 1.0 when the task is resolved, else 0.0.

Snapshots are the sandbox's (``overlay``, ``git``, ``container`` or ``container+git``)
plus the tracked shell state; they do not pickle (they own layers or images). Closing
the env releases every snapshot it took and its sandbox.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shlex
import string
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym

from branchgym.core import Snapshot, SnapshottableEnv
from branchgym.digest import stable_hash
from branchgym.envs.swebench.grading import (
    GradeReport,
    grade,
    working_tree_patch,
)
from branchgym.envs.swebench.limits import Limits
from branchgym.envs.swebench.sandbox import WORKDIR, ExecResult, Sandbox, SandboxSnapshot
from branchgym.envs.swebench.tasks import (
    SWEBenchTask,
    ensure_checkout,
    load_tasks,
    parse_task,
    verify_checkout,
)
from branchgym.error import (
    DataError,
    ResetNeededError,
    SandboxError,
    SandboxUnavailableError,
    SnapshotCorruptError,
)

__all__ = [
    "SWEBenchEnv",
    "ShellCommandSpace",
    "AnyText",
    "EXAMPLE_COMMANDS",
    "PROBE_ACTIONS",
    "HOSTILE_ACTIONS",
    "BACKENDS",
]

#: Read-only commands that ``action_space.sample()`` draws from: uniformly random
#: strings are almost never meaningful shell commands.
EXAMPLE_COMMANDS = (
    "ls",
    "ls -a",
    "pwd",
    "git status --short",
    "git diff",
    "git log --oneline | head -5",
    "cat README.md",
    "find . -name '*.py' -not -path './.git/*' | sort",
    "cd tests",
    "cd /testbed",
    "echo $HOME",
)

#: Commands that create, edit, delete, change permissions, move around and export,
#: deterministically: give them as ``suggested_actions`` to run the fidelity checks on
#: every kind of state a sandbox holds (``submit`` included).
PROBE_ACTIONS = (
    "echo probe >> README.md",
    "printf 'x = 1\\n' > created.py",
    "rm -f .gitignore",
    "mkdir -p newdir/sub && cd newdir",
    "cd /testbed",
    "chmod 600 README.md; chmod +x created.py 2>/dev/null; stat -c '%a %s %n' README.md created.py",
    "export PROBE_VAR=${PROBE_VAR:-0}1; echo $PROBE_VAR",
    "git add -A && git commit -qm probe; git log --oneline | wc -l; git status --short",
    "ln -sf README.md link.md; readlink link.md",
    "mkdir -p emptydir; find . -path ./.git -prune -o -print | sort",
    "cat README.md | tail -3; ls -a",
    "python3 -c 'import os; print(sorted(os.listdir()))'",
    "submit",
)

#: What hostile or careless agents do to a work tree (docs/swebench.md, "Snapshots"):
#: nested repositories (with commits, unborn, cloned), an orphan branch, FIFOs, hard
#: links (written through one name, read through the other), dangling and outside
#: symlinks, rename(2) and deletion of folders made earlier, modes and explicit times.
#: Deterministic, so the fidelity suite's model replays them exactly.
HOSTILE_ACTIONS = (
    "git init -q sub && cd sub && echo s > s.txt && git add s.txt && "
    "git -c user.name=a -c user.email=a@a commit -qm s; cd /testbed; git -C sub log --format=%s",
    "git init -q unborn; echo u > unborn/u.txt; ls -a unborn",
    "rm -rf clone; git clone -q . clone 2>&1; ls clone | head -3",
    "git checkout -q --orphan orphan 2>&1; git status --short | head -3",
    "mkfifo pipe 2>&1; stat -c '%F %a' pipe",
    "ln -f README.md hard.md 2>&1; stat -c '%h' README.md",
    "echo via-hard >> hard.md; tail -1 README.md",
    "ln -sfn /nonexistent dangling; ln -sfn /etc/hostname outside; ls -l dangling outside | wc -l",
    "mkdir -p olddir/sub && echo o > olddir/sub/f && ls olddir",
    "python3 -c \"import os; os.rename('olddir', 'newdir')\" 2>&1 | tail -1; ls -d *dir",
    "rm -rf olddir newdir sub/.git; ls",
    "chmod 700 olddir 2>&1; touch -d @1000000000 README.md; stat -c '%a %Y %n' README.md",
)

#: backend name -> what it is.
BACKENDS = {
    "local": "overlayfs layers where mounts work, else git trees; bubblewrap isolation",
    "overlay": "overlayfs layers (needs mount permission); bubblewrap isolation",
    "git": "git trees in a private object store; bubblewrap isolation",
    "docker": "a container per sandbox; snapshot = docker commit",
    "docker-git": "a container per sandbox; snapshot = git trees inside the container",
    "docker-overlay": "a container per sandbox; /testbed = overlayfs layers on the host",
}

_CHARSET = string.printable


class AnyText(gym.spaces.Text):
    """Any string up to ``max_length`` characters (command output is arbitrary Unicode)."""

    def contains(self, x: Any) -> bool:
        """A ``str`` no longer than ``max_length``."""
        return isinstance(x, str) and len(x) <= self.max_length


class ShellCommandSpace(AnyText):
    """Shell commands; ``sample()`` draws from a list of example commands."""

    def __init__(self, max_length: int, examples: Sequence[str] = EXAMPLE_COMMANDS, **kw: Any):
        """Any command up to ``max_length`` characters; samples come from ``examples``."""
        super().__init__(max_length=max_length, min_length=1, charset=_CHARSET, **kw)
        self.examples = tuple(examples)

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        """One of the example commands, chosen with the space's seeded generator."""
        if mask is not None or probability is not None:
            return super().sample(mask=mask, probability=probability)
        return self.examples[int(self.np_random.integers(len(self.examples)))]


@dataclasses.dataclass
class _ShellState:
    cwd: str
    env: dict[str, str]


@dataclasses.dataclass(frozen=True)
class _Saved:
    """What an env snapshot holds besides the sandbox snapshot."""

    task_id: str
    sandbox: SandboxSnapshot
    cwd: str
    env: tuple[tuple[str, str], ...]
    step: int
    done: bool
    obs: str
    info: dict[str, Any]
    rng: dict[str, Any] | None
    base_ref: str = ""


#: Variables bash sets itself; they are not state the agent chose.
_SHELL_OWN = frozenset({"PWD", "SHLVL", "_", "OLDPWD"})


def _release_saved(saved: _Saved) -> None:
    saved.sandbox.release()


class SWEBenchEnv(SnapshottableEnv[str, str]):
    """Repository tasks: shell commands and ``submit``, in snapshottable sandboxes.

    Args:
        tasks: A task file (``.json``/``.jsonl``, SWE-bench format), a list of records or
            :class:`SWEBenchTask`, the name of a shipped task set (``"generated"``: twelve
            one-file toys; ``"realistic"``: twenty tasks from real PyPI projects; see
            docs/swebench.md), or ``None`` for the generated set.
        instance_ids: Keep only these instances.
        repos_dir: Folder of local clones (``owner__name``) for tasks from a file;
            ignored for the generated tasks, whose repositories are built locally.
        backend: One of :data:`BACKENDS` (default ``local``).
        command_timeout: Seconds per command before it is killed.
        grade_timeout: Seconds for the test run at ``submit``.
        max_output_chars: Observations longer than this keep their head and tail.
        max_command_chars: Longer actions are refused as invalid.
        isolation: Local backends: ``auto``/``bwrap``, or ``none`` (no isolation).
        docker_image: Docker backends: ``auto`` (default): SWE-bench's own image of the
            task where the daemon has it (``swebench/sweb.eval.x86_64.<id>:latest``,
            named by the ``swebench`` package; no clone needed, commands run in its
            conda ``testbed`` environment, the submission is diffed against its HEAD),
            else the branchgym base image plus the task's checkout; ``swebench``:
            SWE-bench's image only; ``branchgym``: the checkout only; or an image name
            or ``{instance_id}`` template. Images are never pulled (docs/swebench.md).
        max_layers: Overlay stacks deeper than this are squashed.
        suggested_actions: Commands to list in ``info["admissible_actions"]`` (for
            scripted agents and the fidelity checker; see :data:`PROBE_ACTIONS`).
        limits: Per-command resource limits: a
            :class:`~branchgym.envs.swebench.limits.Limits`, a dict of its fields
            (``{"memory": "4GiB", "pids": 512}``) or None for the defaults (2 GiB memory,
            256 processes, 300 CPU-seconds, 1 GiB writable layer, 256 MiB /tmp).
        toolchain: Local backends: extra folders commands see read-only (a venv or conda
            env with the repository's dependencies).
        python_env: Local backends: the Python commands and tests run with. ``"auto"``
            (default): an installable repository gets its own venv, built once per
            repository and version over branchgym's interpreter, with the repository
            installed as the harness does (``pip install -e .``); ``"host"``: branchgym's
            interpreter; or a mapping of instance id or ``owner/name`` (``"*"`` for the
            rest) to the interpreter each repository's venv is made from (one that has
            its dependencies). See :mod:`branchgym.envs.swebench.repo_env`. The Docker
            backends make the same install into an image per repository and version
            (:mod:`branchgym.envs.swebench.docker_env`) for tasks without SWE-bench's image.
        harness_guard: Grade from trusted configuration only (default): a patch that
            changes how the tests run (pytest's configuration files, conftests, start-up
            hooks, compiled code, package metadata, shadowing modules, test folders,
            symlinks) is not resolved, and pytest tasks are resolved only where pytest's
            own recorded reports confirm the log (:mod:`~branchgym.envs.swebench.guard`,
            :mod:`~branchgym.envs.swebench.outcomes`); ``info["rejected"]`` says why.
            ``False`` grades as upstream SWE-bench does, which such diffs game
            (docs/swebench.md, "Reward hacks").
        render_mode: ``"ansi"`` returns the last observation from ``render()``.
    """

    metadata = {"render_modes": ["ansi"]}
    snapshot_kind = "overlay"
    snapshot_picklable = False
    default_env_id = "branchgym/SWEBench-v0"

    def __init__(
        self,
        tasks: str | os.PathLike[str] | Sequence[SWEBenchTask | Mapping[str, Any]] | None = None,
        *,
        instance_ids: Sequence[str] | None = None,
        repos_dir: str | os.PathLike[str] | None = None,
        backend: str = "local",
        command_timeout: float = 60.0,
        grade_timeout: float = 600.0,
        max_output_chars: int = 10_000,
        max_command_chars: int = 100_000,
        isolation: str = "auto",
        docker_image: str | None = None,
        max_layers: int = 32,
        suggested_actions: Sequence[str] | None = None,
        render_mode: str | None = None,
        limits: Any = None,
        toolchain: Sequence[str | os.PathLike[str]] = (),
        harness_guard: bool = True,
        python_env: str | Mapping[str, str] | None = "auto",
    ) -> None:
        """Load the tasks and start the backend (no sandbox exists before ``reset``)."""
        # Docker with SWE-bench's (or a given) image needs no clone: a missing repos_dir
        # is an error only when a task turns out to need a checkout.
        images = str(backend).startswith("docker") and docker_image != "branchgym"
        self.tasks, self.repos_dir = self._load(tasks, instance_ids, repos_dir, images)
        self._by_id = {t.instance_id: t for t in self.tasks}
        if backend not in BACKENDS:
            raise SandboxError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if command_timeout <= 0 or grade_timeout <= 0 or max_output_chars < 100:
            raise ValueError("timeouts must be positive and max_output_chars at least 100")
        self.command_timeout = float(command_timeout)
        self.grade_timeout = float(grade_timeout)
        self.max_output_chars = int(max_output_chars)
        self.max_command_chars = int(max_command_chars)
        self.suggested_actions = list(suggested_actions) if suggested_actions else None
        self.render_mode = render_mode
        self.backend_name = backend
        self.harness_guard = bool(harness_guard)
        self.limits = Limits.of(limits)
        self.backend = _make_backend(
            backend, isolation, docker_image, max_layers, self.limits, tuple(toolchain), python_env
        )
        self.snapshot_kind = self.backend.kind  # type: ignore[misc]  # per instance
        self.observation_space = AnyText(max_length=10_000_000, charset=_CHARSET)
        self.action_space = ShellCommandSpace(self.max_command_chars)
        self.sandbox: Sandbox | None = None
        self.task: SWEBenchTask | None = None
        self._base_ref = ""
        self.shell = _ShellState(WORKDIR, {})
        self.done = False
        self.last_obs = ""
        self.last_info: dict[str, Any] = {}
        self.last_report: GradeReport | None = None
        self.last_exec: ExecResult | None = None
        self._snaps: weakref.WeakSet[Snapshot] = weakref.WeakSet()
        self._mark = f"__branchgym_state_{secrets.token_hex(8)}__"

    # ----------------------------------------------------------------- tasks
    @staticmethod
    def _load(
        tasks: Any, ids: Sequence[str] | None, repos_dir: Any, images: bool = False
    ) -> tuple[list, Path | None]:
        from branchgym.envs.swebench.generated import TASK_SETS, task_set

        if tasks is None or (isinstance(tasks, str) and tasks in TASK_SETS):
            path = task_set(tasks or "generated")
            return load_tasks(path, instance_ids=ids), path.parent / "repos"
        if isinstance(tasks, str | os.PathLike):
            loaded = load_tasks(tasks, instance_ids=ids)
        else:
            loaded = [t if isinstance(t, SWEBenchTask) else parse_task(t) for t in tasks]
            if ids is not None:
                loaded = [t for t in loaded if t.instance_id in set(ids)]
            if not loaded:
                raise DataError("no tasks given (the list is empty after instance_ids)")
        if repos_dir is None and images:
            return loaded, None
        if repos_dir is None:
            raise DataError(
                "tasks from a file need repos_dir: a folder with a local clone of each "
                "repository (named owner__name); branchgym never downloads repositories."
            )
        return loaded, Path(repos_dir)

    def _snapshot_config(self) -> Any:
        # Two instances are interchangeable when they hold the same tasks on the same
        # backend family: that is what a snapshot needs to restore.
        return (
            self.backend_name,
            [(t.instance_id, t.base_commit) for t in self.tasks],
            self.max_output_chars,
            self.command_timeout,
        )

    # --------------------------------------------------------------- episode
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Start a task: ``options={"instance_id": ...}``, or one chosen by the seeded RNG."""
        super().reset(seed=seed)
        options = options or {}
        if "instance_id" in options:
            if options["instance_id"] not in self._by_id:
                raise DataError(
                    f"no task {options['instance_id']!r}; this env has "
                    f"{', '.join(list(self._by_id)[:5])}{', ...' if len(self._by_id) > 5 else ''}"
                )
            task = self._by_id[options["instance_id"]]
        else:
            task = self.tasks[int(self.np_random.integers(len(self.tasks)))]
        self._close_sandbox()
        self.task = task
        self.sandbox = self.backend.create(task, self._checkout(task))
        # What the submission is diffed against: the task's base commit, or the HEAD of
        # SWE-bench's image (base commit + the image's setup commit).
        self._base_ref = getattr(self.sandbox, "base_ref", None) or task.base_commit
        self.shell = _ShellState(WORKDIR, self._base_env())
        self.step_index = 0
        self.done = False
        self.last_report = None
        self.last_obs = self._intro(task)
        self.last_info = self._info(exit_code=0)
        return self.last_obs, dict(self.last_info)

    def _checkout(self, task: SWEBenchTask) -> Path | None:
        needs = getattr(self.backend, "needs_checkout", None)
        if needs is not None and not needs(task):
            return None  # its image holds the repository
        if self.repos_dir is None:
            raise DataError(
                f"{task.instance_id} needs a local clone (no SWE-bench image of it is on the "
                "Docker daemon): pass repos_dir, a folder with a clone of each repository "
                "(named owner__name), or load its image (docs/swebench.md, Docker)."
            )
        return ensure_checkout(task, self.repos_dir)

    def _base_env(self) -> dict[str, str]:
        own = getattr(self.sandbox, "default_env", None)  # a SWE-bench image's environment
        return dict(own() if own is not None else self.backend.default_env())

    def _intro(self, task: SWEBenchTask) -> str:
        return (
            f"Task {task.instance_id} ({task.repo}, base commit {task.base_commit[:12]}).\n\n"
            f"{task.problem_statement.strip()}\n\n"
            f"The repository is checked out at {WORKDIR}. Each action is one bash command "
            f"run there; the working directory and exported variables carry over between "
            f"commands. A command may run {self.command_timeout:g} s; there is no network; "
            f"output past {self.max_output_chars} characters is cut. When your fix is done, "
            "send `submit`: the diff of the working tree against the base commit is graded "
            "by the repository's tests."
        )

    def step(self, action: Any) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Run one command, or ``submit``."""
        if self.sandbox is None or self.task is None:
            raise ResetNeededError("call env.reset() before env.step()")
        if self.done:
            raise ResetNeededError(
                "the episode ended with `submit`; call env.reset() (or restore a snapshot)"
            )
        problem = self._invalid(action)
        self.step_index += 1
        if problem:
            self.last_obs = f"Invalid action: {problem}"
            self.last_info = self._info(invalid=True)
            return self.last_obs, 0.0, False, False, dict(self.last_info)
        if action.strip() == "submit":
            return self._submit()
        res = self._run(action)
        self.last_obs = self._observe(res)
        self.last_info = self._info(exit_code=res.exit_code, timed_out=res.timed_out)
        if res.limit:
            self.last_info["limit"] = res.limit
        return self.last_obs, 0.0, False, False, dict(self.last_info)

    def _invalid(self, action: Any) -> str | None:
        if not isinstance(action, str):
            return (
                f"expected a shell command (a string), got {type(action).__name__}. Send one "
                "bash command per step, or `submit`."
            )
        if not action.strip():
            return "the command is empty. Send one bash command per step, or `submit`."
        if "\x00" in action:
            return "the command contains a NUL character, which bash cannot run."
        if len(action) > self.max_command_chars:
            return (
                f"the command has {len(action)} characters (limit {self.max_command_chars}); "
                "write long files in several steps."
            )
        return None

    def _run(self, command: str) -> ExecResult:
        """Run ``command`` in the tracked cwd/env, then read back the new cwd/env."""
        assert self.sandbox is not None  # noqa: S101 - checked in step()
        mark = self._mark
        script = (
            "exec {__bg_fd}>&1\nexec 2>&1\n"
            "__bg_state() { __bg_rc=$?; "
            f"printf '\\n%s\\n' {mark} >&$__bg_fd; pwd >&$__bg_fd; env -0 >&$__bg_fd; "
            "exit $__bg_rc; }\n"
            "trap __bg_state EXIT\n"
            f"cd -- {shlex.quote(self.shell.cwd)} 2>/dev/null || {{ echo "
            f"{shlex.quote(f'(the directory {self.shell.cwd} no longer exists; now in {WORKDIR})')}"
            f"; cd {WORKDIR}; }}\n"
            f"{command}\n"
        )
        res = self.sandbox.exec(
            script, cwd=WORKDIR, env=self.shell.env, timeout=self.command_timeout
        )
        self.last_exec = res
        out = res.output
        key = f"\n{mark}\n".encode()
        cut = out.rfind(key)
        if cut < 0:  # killed before reporting: the shell state stays
            return res
        if res.timed_out or res.limit.startswith(("memory", "CPU")):
            # The EXIT trap may have reported while the command was being killed: the
            # state is not trusted, and the report never reaches the observation.
            return dataclasses.replace(res, output=out[:cut])
        tail = out[cut + len(key) :]
        cwd, _, env_blob = tail.partition(b"\n")
        env = {}
        for item in env_blob.split(b"\x00"):
            k, sep, v = item.decode("utf-8", "surrogateescape").partition("=")
            if sep and k not in _SHELL_OWN:
                env[k] = v
        self.shell = _ShellState(cwd.decode("utf-8", "surrogateescape") or WORKDIR, env)
        return dataclasses.replace(res, output=out[:cut])

    def _observe(self, res: ExecResult) -> str:
        text = res.text
        note = ""
        if res.dropped:
            note = f"\n[{res.dropped} bytes of output were dropped in the middle]"
        if len(text) > self.max_output_chars:
            half = self.max_output_chars // 2
            omitted = len(text) - 2 * half
            text = (
                f"{text[:half]}\n[... {omitted} characters omitted (the output had "
                f"{len(text)}); narrow the command, e.g. with head, tail or grep ...]\n"
                f"{text[-half:]}"
            )
        if res.timed_out:
            note += (
                f"\n[the command timed out after {self.command_timeout:g} s and was killed; "
                "the working directory and environment are unchanged]"
            )
        elif res.limit.startswith("process limit"):
            note += f"\n[fork failed: {res.limit} reached; exit code {res.exit_code}]"
        elif "quota" in res.limit:
            note += f"\n[{res.limit} is full: writes fail with 'No space left on device']"
            if res.exit_code != 0:
                note += f"\n[exit code {res.exit_code}]"
        elif res.limit:
            note += (
                f"\n[killed: {res.limit}; exit code {res.exit_code}; the working directory "
                "and environment are unchanged]"
            )
        elif res.exit_code != 0:
            note += f"\n[exit code {res.exit_code}]"
        text = text + note
        return text if text.strip() else "(no output)"

    def _info(self, *, exit_code: int = 0, timed_out: bool = False, invalid: bool = False):
        assert self.task is not None  # noqa: S101 - set by reset()
        info: dict[str, Any] = {
            "instance_id": self.task.instance_id,
            "cwd": self.shell.cwd,
            "exit_code": int(exit_code),
            "timed_out": bool(timed_out),
            "invalid_action": bool(invalid),
        }
        if self.suggested_actions is not None:
            info["admissible_actions"] = [] if self.done else list(self.suggested_actions)
        return info

    # ------------------------------------------------------------------ grading
    def patch(self) -> str:
        """The diff of the working tree against the base commit (what ``submit`` grades).

        In SWE-bench's images the base is the image's HEAD at reset: the base commit plus
        the image's own setup commit, which is no part of the agent's change.
        """
        if self.sandbox is None or self.task is None:
            raise ResetNeededError("call env.reset() first")
        return working_tree_patch(self.sandbox, self._base_ref)

    def grade(self, patch: str | None = None) -> GradeReport:
        """Grade ``patch`` (default: the working tree) in a fresh sandbox; no state changes."""
        if self.task is None:
            raise ResetNeededError("call env.reset() first")
        if patch is None:
            patch = self.patch()
        checkout = self._checkout(self.task)
        # Grading starts from the pristine checkout: refuse it if anything changed it.
        if checkout is not None:
            verify_checkout(checkout)
        fresh = self.backend.create(self.task, checkout)
        try:
            return grade(
                fresh, self.task, patch, timeout=self.grade_timeout, guard=self.harness_guard
            )
        finally:
            fresh.close()

    def _submit(self) -> tuple[str, float, bool, bool, dict[str, Any]]:
        try:
            patch = self.patch()
        except SandboxUnavailableError:
            raise  # the sandbox did not start: no grade at all, never an empty patch
        except SandboxError as exc:  # the agent broke .git: graded empty, and info says so
            patch, problem = "", str(exc)
        else:
            problem = ""
        report = self.grade(patch)
        self.last_report = report
        self.done = True
        self.last_obs = f"Submitted. {report.summary()}" + (f"\n{problem}" if problem else "")
        info = self._info(exit_code=0)
        info.update(
            resolved=report.resolved,
            rejected=report.rejected,
            report=report.to_swebench()[report.instance_id],
            patch=patch,
        )
        if problem:
            info["patch_error"] = problem
        self.last_info = info
        return self.last_obs, float(report.resolved), True, False, dict(info)

    # ---------------------------------------------------------------- snapshots
    def snapshot(self) -> Snapshot:
        """Snapshot the sandbox and the tracked shell state."""
        if self.sandbox is None or self.task is None:
            raise ResetNeededError("call env.reset() before env.snapshot()")
        sbx = self.sandbox.snapshot()
        saved = _Saved(
            task_id=self.task.instance_id,
            sandbox=sbx,
            cwd=self.shell.cwd,
            env=tuple(sorted(self.shell.env.items())),
            step=self.step_index,
            done=self.done,
            obs=self.last_obs,
            info=dict(self.last_info),
            rng=self._rng_state(),
            base_ref=self._base_ref,
        )
        snap = self._new_snapshot(
            saved,
            kind=sbx.kind,
            picklable=False,
            nbytes=lambda: sbx.nbytes,
            on_release=_release_saved,
        )
        self._snaps.add(snap)
        return snap

    def restore(self, snapshot: Snapshot) -> tuple[str, dict[str, Any]]:
        """Bring back a snapshot of any instance made from the same spec."""
        saved = self._open_snapshot(snapshot)
        if not isinstance(saved, _Saved) or saved.task_id not in self._by_id:
            raise SnapshotCorruptError(
                "this snapshot's payload is not a SWE-bench env state of these tasks; take "
                "a new snapshot."
            )
        saved.sandbox.check()
        task = self._by_id[saved.task_id]
        if self.sandbox is not None and self.sandbox.backend == saved.sandbox.backend:
            self.sandbox.restore(saved.sandbox)
            if self.backend_name in _LOCAL and (self.task is None or self.task is not task):
                # Another task's state: its commands run in that task's environment.
                self.sandbox.runner = self.backend.runner_for(task, self._checkout(task))
        else:
            self._close_sandbox()
            if self.backend_name in _LOCAL:  # in the task's own environment (repo_env)
                self.sandbox = self.backend.from_snapshot(
                    saved.sandbox, task=task, checkout=self._checkout(task)
                )
            else:
                self.sandbox = self.backend.from_snapshot(saved.sandbox)
        self.task = self._by_id[saved.task_id]
        self._base_ref = saved.base_ref or self.task.base_commit
        self.shell = _ShellState(saved.cwd, dict(saved.env))
        self.step_index = saved.step
        self.done = saved.done
        self.last_obs = saved.obs
        self.last_info = dict(saved.info)
        self.last_report = None
        if saved.rng is not None:
            self._set_rng_state(saved.rng)
        return self.last_obs, dict(self.last_info)

    def state_digest(self) -> str:
        """Hash of /testbed, the shell state, the task and the episode flags."""
        if self.sandbox is None or self.task is None:
            return stable_hash("SWEBenchEnv", None)
        return stable_hash(
            "SWEBenchEnv",
            self.task.instance_id,
            self.sandbox.tree_digest(),
            self.shell.cwd,
            sorted(self.shell.env.items()),
            self.step_index,
            self.done,
            self._rng_state(),
        )

    def enforced_limits(self) -> dict[str, str]:
        """Each resource limit in force and what enforces it on this machine (or why not)."""
        return dict(self.backend.enforced_limits())

    def live_resources(self) -> dict[str, int]:
        """Unreleased snapshots this env took (each owns layers, trees or an image)."""
        return {"snapshots": sum(1 for s in list(self._snaps) if not s.released)}

    # ------------------------------------------------------------------- misc
    def render(self) -> str | None:
        """The last observation (``render_mode="ansi"``)."""
        return self.last_obs if self.render_mode == "ansi" else None

    def _close_sandbox(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None

    def close(self) -> None:
        """Release every snapshot this env took and close its sandbox."""
        for snap in list(self._snaps):
            snap.release()
        self._close_sandbox()
        super().close()


#: The local backends' names (their sandboxes run in each task's own environment).
_LOCAL = ("local", "overlay", "git")


def _make_backend(
    name: str,
    isolation: str,
    docker_image: str | None,
    max_layers: int,
    limits: Limits,
    toolchain: tuple[str | os.PathLike[str], ...],
    python_env: str | Mapping[str, str] | None = "auto",
) -> Any:
    if name in ("local", "overlay", "git"):
        from branchgym.envs.swebench.local import LocalBackend

        mode = {"local": "auto"}.get(name, name)
        return LocalBackend(
            mode,
            isolation=isolation,
            max_layers=max_layers,
            limits=limits,
            toolchain=toolchain,
            python_env=python_env,
        )
    from branchgym.envs.swebench.docker_backend import DockerBackend

    return DockerBackend(
        snapshot_mode={"docker-git": "git", "docker-overlay": "overlay"}.get(name, "commit"),
        image=docker_image,
        limits=limits,
    )
