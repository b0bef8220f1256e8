"""The branchgym cache anywhere: sandboxes bind what they need, or refuse with a typed error.

Each case runs a realistic task (its own venv under the cache, bound into every sandbox)
from the cache in that place: commands import the repository from ``/testbed`` and the
gold patch, applied by a command and submitted, resolves. The cache lives under
``/var/tmp`` (a usual scratch place on clusters), which a sandbox's own ``/var/tmp``
shadows.
"""

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from branchgym.envs.swebench.env import SWEBenchEnv
from branchgym.envs.swebench.generated import (
    generated_repos,
    generated_tasks,
    realistic_repos,
    realistic_tasks,
)
from branchgym.envs.swebench.local import LocalBackend
from branchgym.envs.swebench.repo_env import repo_environment
from branchgym.envs.swebench.tasks import ensure_checkout
from branchgym.error import CacheLocationError, SandboxSetupError

#: A realistic task with a ``src/`` layout: its tests import the editable install.
REAL = "tkem__cachetools-1"


@pytest.fixture(scope="module")
def var_tmp():
    """A fresh folder under /var/tmp, removed afterwards."""
    if not os.access("/var/tmp", os.W_OK):
        pytest.skip("/var/tmp is not writable here")
    d = Path(tempfile.mkdtemp(prefix="branchgym-cache-test-", dir="/var/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def var_tmp_cache(var_tmp):
    """A cache under /var/tmp with the realistic tasks and REAL's environment built."""
    cache = var_tmp / "cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BRANCHGYM_CACHE", str(cache))
        env = SWEBenchEnv(tasks="realistic", backend="git")
        env.reset(options={"instance_id": REAL})
        env.close()
    return cache


def _gold_resolves(backend: str = "local", **kw) -> str:
    """Run REAL from the cache BRANCHGYM_CACHE names; returns the venv's prefix it ran in."""
    env = SWEBenchEnv(tasks="realistic", backend=backend, **kw)
    try:
        env.reset(options={"instance_id": REAL})
        obs, *_ = env.step(
            "python3 -c 'import sys, cachetools; print(cachetools.__file__); print(sys.prefix)'"
        )
        assert "/testbed/src/cachetools/__init__.py" in obs, obs
        obs, *_ = env.step(f"git apply <<'EOF' && echo applied\n{env.task.patch}EOF")
        assert obs.startswith("applied"), obs
        _, reward, done, _, info = env.step("submit")
        assert done and reward == 1.0, info["report"]
        return obs
    finally:
        env.close()


def _prefix() -> str:
    env = SWEBenchEnv(tasks="realistic", backend="git")
    try:
        env.reset(options={"instance_id": REAL})
        obs, *_ = env.step("python3 -c 'import sys; print(sys.prefix)'")
        return obs.splitlines()[0]
    finally:
        env.close()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["overlay", "git"])
def test_cache_under_var_tmp(var_tmp_cache, monkeypatch, backend):
    # bwrap: Can't mkdir parents for /var/tmp/.../venv, on every command, before: the
    # sandbox's /var/tmp was a link to /tmp with an absolute target.
    monkeypatch.setenv("BRANCHGYM_CACHE", str(var_tmp_cache))
    _gold_resolves(backend)


@pytest.mark.slow
def test_cache_path_with_spaces_and_option_characters(var_tmp, monkeypatch):
    # Spaces, and ',' ':' '\' (overlayfs mount option separators) in the checkout's path;
    # ':' is the PATH separator, so only the venv-free generated tasks can live there.
    cache = var_tmp / "a cache, with\\odd:names"
    monkeypatch.setenv("BRANCHGYM_CACHE", str(cache))
    for backend in ("overlay", "git"):
        env = SWEBenchEnv(backend=backend)
        env.reset(options={"instance_id": "branchgym__rpn-1"})
        obs, *_ = env.step("pwd; grep -c pop rpn/core.py")
        assert obs.startswith("/testbed\n2\n"), obs
        env.close()
    monkeypatch.setenv("BRANCHGYM_CACHE", str(var_tmp / "with spaces, commas" / "cache"))
    _gold_resolves("overlay")


@pytest.mark.slow
def test_cache_and_home_through_symlinks(var_tmp_cache, var_tmp, tmp_path, monkeypatch):
    link = tmp_path / "cache-link"
    link.symlink_to(var_tmp_cache)
    monkeypatch.setenv("BRANCHGYM_CACHE", str(link))
    _gold_resolves("overlay")
    real_prefix = _prefix()
    assert real_prefix.startswith(str(var_tmp_cache) + "/swebench/envs/")
    # A home folder that is a link (to /var/tmp), whose .cache is a link again.
    home = var_tmp / "home"
    (home / ".cache").mkdir(parents=True, exist_ok=True)
    if not (home / ".cache" / "branchgym").is_symlink():
        (home / ".cache" / "branchgym").symlink_to(var_tmp_cache)
    (tmp_path / "home").symlink_to(home)
    monkeypatch.delenv("BRANCHGYM_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    _gold_resolves("git")
    assert _prefix() == real_prefix


def _read_only_mount(src: Path, dest: Path) -> bool:
    """Bind ``src`` read-only at ``dest`` (needs CAP_SYS_ADMIN); False where not allowed."""
    dest.mkdir(parents=True, exist_ok=True)
    ok = subprocess.run(["mount", "--bind", str(src), str(dest)], capture_output=True).returncode
    if ok != 0:
        return False
    ro = ["mount", "-o", "remount,bind,ro", str(dest)]
    if subprocess.run(ro, capture_output=True).returncode != 0:
        subprocess.run(["umount", str(dest)], check=False)
        return False
    return True


@pytest.mark.slow
def test_read_only_cache_and_read_only_parent(var_tmp_cache, var_tmp, monkeypatch):
    empty = var_tmp / "empty"
    empty.mkdir(exist_ok=True)
    ro_cache, ro_parent = var_tmp / "ro-cache", var_tmp / "ro-parent"
    if not (_read_only_mount(var_tmp_cache, ro_cache) and _read_only_mount(empty, ro_parent)):
        subprocess.run(["umount", str(ro_cache)], capture_output=True, check=False)
        if os.geteuid() == 0:
            pytest.skip("cannot mount read-only here (no CAP_SYS_ADMIN), and root ignores modes")
        shutil.copytree(var_tmp_cache, ro_cache, symlinks=True, dirs_exist_ok=True)
        subprocess.run(["chmod", "-R", "a-w", str(ro_cache), str(empty)], check=True)
        ro_parent = empty
    try:
        # Built elsewhere, used read-only: nothing is written to the cache.
        monkeypatch.setenv("BRANCHGYM_CACHE", str(ro_cache))
        _gold_resolves("overlay")
        # Nothing built yet under a read-only parent: refused, saying what to change.
        monkeypatch.setenv("BRANCHGYM_CACHE", str(ro_parent / "cache"))
        with pytest.raises(CacheLocationError, match="Set BRANCHGYM_CACHE to a writable folder"):
            SWEBenchEnv(tasks="realistic")
    finally:
        for d in (ro_cache, ro_parent):
            subprocess.run(["umount", str(d)], capture_output=True, check=False)
        subprocess.run(["chmod", "-R", "u+w", str(var_tmp)], capture_output=True, check=False)


@pytest.mark.slow
@pytest.mark.parametrize("bound", ["parent", "cache"])
def test_cache_inside_a_bound_folder_stays_hidden(var_tmp_cache, monkeypatch, bound):
    # A toolchain folder that holds the cache, or is the cache: the cache is covered by an
    # empty tmpfs (the checkouts grading starts from stay out of reach), the venv in it
    # is bound again.
    monkeypatch.setenv("BRANCHGYM_CACHE", str(var_tmp_cache))
    tool = var_tmp_cache.parent if bound == "parent" else var_tmp_cache
    env = SWEBenchEnv(tasks="realistic", toolchain=[tool])
    try:
        env.reset(options={"instance_id": REAL})
        obs, *_ = env.step(
            f"ls {var_tmp_cache}/swebench; ls {var_tmp_cache}/swebench/checkouts; "
            f"touch {var_tmp_cache}/x; python3 -c 'import cachetools; print(cachetools.__file__)'"
        )
        assert "No such file or directory" in obs and "Read-only file system" in obs, obs
        assert obs.splitlines()[0] == "envs"
        assert "/testbed/src/cachetools/__init__.py" in obs
    finally:
        env.close()


def test_colon_in_the_environment_path_is_refused(var_tmp_cache, var_tmp, monkeypatch):
    monkeypatch.setenv("BRANCHGYM_CACHE", str(var_tmp_cache))
    task = next(t for t in realistic_tasks() if t.instance_id == REAL)
    checkout = ensure_checkout(task, realistic_repos())
    with pytest.raises(CacheLocationError, match="PATH separator"):
        repo_environment(task, checkout, root=var_tmp / "a:b")
    assert not (var_tmp / "a:b").exists()


@pytest.fixture
def rpn():
    task = next(t for t in generated_tasks() if t.instance_id == "branchgym__rpn-1")
    return task, ensure_checkout(task, generated_repos())


@pytest.mark.parametrize("mode", ["overlay", "git"])
def test_a_sandbox_that_cannot_start_raises(rpn, tmp_path, mode):
    task, checkout = rpn
    tool = tmp_path / "toolchain"
    tool.mkdir()
    backend = LocalBackend(mode, toolchain=[tool])
    sb = backend.create(task, checkout)
    try:
        # A command whose own output looks like bubblewrap's failure is a command result.
        res = sb.exec('echo "bwrap: Can\'t mkdir parents for /x: No such file"; exit 1')
        assert res.exit_code == 1 and res.text.startswith("bwrap:")
        tool.rmdir()  # a bound folder vanishes: bubblewrap cannot start the sandbox
        with pytest.raises(SandboxSetupError, match="nothing of the command ran"):
            sb.exec("true")
    finally:
        sb.close()
    # At construction: a new backend's first sandbox is refused, naming what is bound.
    tool.mkdir()
    backend = LocalBackend(mode, toolchain=[tool])
    tool.rmdir()
    with pytest.raises(SandboxSetupError, match=str(tool)):
        backend.create(task, checkout)


def test_submit_never_grades_a_failed_sandbox_as_an_empty_patch(tmp_path):
    tool = tmp_path / "toolchain"
    tool.mkdir()
    env = SWEBenchEnv(backend="git", toolchain=[tool])
    try:
        env.reset(options={"instance_id": "branchgym__rpn-1"})
        env.step(env.unwrapped.task.extra["branchgym_fix_command"])
        tool.rmdir()
        with pytest.raises(SandboxSetupError):
            env.step("ls")
        with pytest.raises(SandboxSetupError):
            env.step("submit")
        tool.mkdir()
        # An agent that breaks git gets the empty patch's reward, and info says why.
        env.reset(options={"instance_id": "branchgym__rpn-1"})
        env.step("rm -rf .git")
        _, reward, done, _, info = env.step("submit")
        assert done and reward == 0.0 and info["patch"] == ""
        assert "could not compute the working tree's diff" in info["patch_error"]
    finally:
        env.close()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["docker", "docker-git"])
def test_docker_backends_take_the_cache_anywhere(docker_available, var_tmp, tmp_path, backend):
    # Docker reads the checkout from the cache (the image is built from a tar of it) and
    # binds nothing: a cache behind a link, under /var/tmp, with a space, a comma and ":".
    cache = var_tmp / "docker cache, here: too"
    link = tmp_path / "link"
    link.symlink_to(cache)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BRANCHGYM_CACHE", str(link))
        env = SWEBenchEnv(backend=backend)
        try:
            env.reset(options={"instance_id": "branchgym__rpn-1"})
            obs, *_ = env.step("grep -c pop rpn/core.py")
            assert obs.startswith("2\n"), obs
            env.step(env.unwrapped.task.extra["branchgym_fix_command"])
            _, reward, done, _, info = env.step("submit")
            assert done and reward == 1.0, info["report"]
        finally:
            env.close()
    assert (cache / "swebench" / "checkouts").is_dir()
