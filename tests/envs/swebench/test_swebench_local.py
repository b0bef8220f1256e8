"""Local sandboxes: overlay layer stacks and git trees, under bubblewrap."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from branchgym.envs.swebench.layers import wait_for_cleanup
from branchgym.envs.swebench.local import LocalBackend
from branchgym.envs.swebench.mounts import list_local_mounts
from branchgym.envs.swebench.overlay import OverlaySandbox
from branchgym.error import SandboxError, SnapshotReleasedError

MUTATE = (
    "echo appended >> README.md; printf 'new\\n' > created.txt; rm .gitignore; "
    "chmod 600 textstats/core.py; mkdir -p empty/deeper; ln -s README.md link.md; "
    "chmod +x tests/test_textstats.py; git add -A && git commit -qm 'agent commit'"
)


def run(sb, cmd):
    res = sb.exec(cmd)
    assert res.exit_code == 0, res.text
    return res.text


def test_round_trip_files_permissions_dirs_links_and_git(sandbox):
    before = sandbox.tree_digest()
    head = run(sandbox, "git rev-parse HEAD")
    snap = sandbox.snapshot()
    run(sandbox, MUTATE)
    assert sandbox.tree_digest() != before
    assert run(sandbox, "git rev-parse HEAD") != head
    sandbox.restore(snap)
    assert sandbox.tree_digest() == before
    assert run(sandbox, "git rev-parse HEAD") == head
    assert run(sandbox, "git status --porcelain") == ""
    assert run(sandbox, "stat -c %a textstats/core.py tests/test_textstats.py") == "644\n644\n"
    assert run(sandbox, "ls -a") == ".\n..\n.git\n.gitignore\nREADME.md\ntests\ntextstats\n"
    # ... and forward again: a snapshot of the changed state restores it exactly.
    run(sandbox, MUTATE)
    changed = sandbox.tree_digest()
    snap2 = sandbox.snapshot()
    sandbox.restore(snap)
    sandbox.restore(snap2)
    assert sandbox.tree_digest() == changed
    assert run(sandbox, "stat -c %a textstats/core.py; test -d empty/deeper && readlink link.md")
    assert run(sandbox, "stat -c %a textstats/core.py") == "600\n"
    assert sandbox.read("created.txt") == b"new\n"
    snap.release()
    snap2.release()
    with pytest.raises(SnapshotReleasedError):
        sandbox.restore(snap)


def test_snapshot_does_not_alias_the_live_tree(sandbox):
    run(sandbox, "echo one > f.txt")
    snap = sandbox.snapshot()
    for _ in range(2):  # restoring twice gives the same state twice
        run(sandbox, "echo two >> f.txt; echo x > other.txt")
        sandbox.restore(snap)
        assert sandbox.read("f.txt") == b"one\n"
        assert run(sandbox, "ls other.txt 2>&1 || true").endswith("No such file or directory\n")
    snap.release()


def test_fork_is_independent_and_restores_across_sandboxes(sandbox):
    run(sandbox, "echo base > f.txt")
    snap = sandbox.snapshot()
    child = sandbox.fork(snap)
    other = sandbox.fork()  # from the current state
    try:
        run(child, "echo child >> f.txt")
        run(sandbox, "echo parent >> f.txt")
        assert child.read("f.txt") == b"base\nchild\n"
        assert sandbox.read("f.txt") == b"base\nparent\n"
        assert other.read("f.txt") == b"base\n"
        child_snap = child.snapshot()
        sandbox.restore(child_snap)  # a snapshot of another sandbox restores here
        assert sandbox.read("f.txt") == b"base\nchild\n"
        child_snap.release()
    finally:
        child.close()
        other.close()
        snap.release()
    with pytest.raises(SandboxError, match="closed"):
        child.exec("true")


def test_read_write_and_paths_that_escape(sandbox):
    sandbox.write("/testbed/pkg/new.py", b"print(1)\n", mode=0o755)
    assert sandbox.read("pkg/new.py") == b"print(1)\n"
    assert run(sandbox, "stat -c %a pkg/new.py; python3 pkg/new.py") == "755\n1\n"
    run(sandbox, "ln -s /etc/passwd passwd; ln -s ../../.. up")
    for bad in ("../outside", "/etc/passwd", "passwd", "up/etc/hostname"):
        with pytest.raises(SandboxError):
            sandbox.read(bad)
    with pytest.raises(SandboxError, match="outside"):
        sandbox.write("passwd", b"x")
    with pytest.raises(SandboxError):
        sandbox.write("x.txt", "text, not bytes")  # type: ignore[arg-type]


def test_isolation_no_network_read_only_system_hidden_cache(sandbox):
    code = (
        "import socket, errno\n"
        "s = socket.socket(); s.settimeout(2)\n"
        "print(errno.errorcode.get(s.connect_ex(('1.1.1.1', 80)), 'connected'))\n"
    )
    sandbox.write("net.py", code.encode())
    assert run(sandbox, "python3 net.py") in ("ENETUNREACH\n", "EHOSTUNREACH\n")
    res = sandbox.exec("touch /usr/branchgym-probe")
    assert res.exit_code != 0 and "Read-only file system" in res.text
    from branchgym.envs.swebench.tasks import cache_root

    # Gold patches and pristine checkouts are not there at all.
    assert run(sandbox, f"test -e {cache_root()} || echo absent") == "absent\n"
    # Each command has its own PID namespace: nothing it starts outlives it.
    run(sandbox, "sleep 30 & echo started")
    assert "sleep" not in run(sandbox, "ps -eo comm 2>/dev/null || ls /proc")


def test_timeout_kills_and_output_is_capped(sandbox):
    res = sandbox.exec("echo before; sleep 30; echo after", timeout=1)
    assert res.timed_out and res.exit_code == 124
    assert res.text == "before\n"
    big = sandbox.exec("head -c 5000000 /dev/zero | tr '\\0' a; echo END")
    assert big.dropped > 0 and len(big.output) < 3_000_000
    assert big.text.endswith("aaaaEND\n")  # the tail (where the shell state is) is kept


# ------------------------------------------------------------------------- overlay


def test_overlay_layers_are_shared_refcounted_and_squashed(task_by_name, checkout):
    task = task_by_name["intervals"]
    backend = LocalBackend("overlay", max_layers=3)
    sb = backend.create(task, checkout(task))
    assert isinstance(sb, OverlaySandbox)
    store = backend.store
    base_layers = store.live_layers()
    snaps, digests = [], []
    try:
        run(sb, "rm README.md")  # a whiteout, carried through the squash
        for i in range(6):
            run(sb, f"echo {i} >> log.txt; mkdir -p d{i}")
            snaps.append(sb.snapshot())
            digests.append(sb.tree_digest())
            assert len(sb.stack) - 1 <= 3 + 1
        same = sb.snapshot()  # nothing changed: no new layer
        assert same.stack == sb.stack
        same.release()
        for snap, digest in reversed(list(zip(snaps, digests, strict=True))):
            sb.restore(snap)
            assert sb.tree_digest() == digest
            assert "README.md" not in run(sb, "ls")
        assert snaps[-1].nbytes >= 0 and snaps[0].nbytes > 0
    finally:
        for s in snaps:
            s.release()
        sb.close()
    wait_for_cleanup()
    assert store.live_layers() == base_layers
    assert list_local_mounts(store.root) == []


def test_overlay_detection_falls_back_to_git_without_mount_rights(tmp_path):
    # Without capabilities (--cap-drop ALL), mount() fails for real.
    code = (
        "import json; from branchgym.envs.swebench.local import LocalBackend\n"
        "from branchgym.envs.swebench.mounts import overlay_support\n"
        "ok, why = overlay_support()\n"
        "b = LocalBackend('auto', isolation='none')\n"
        "print(json.dumps([ok, why, b.mode]))\n"
    )
    out = subprocess.run(
        ["bwrap", "--dev-bind", "/", "/", "--cap-drop", "ALL", "--", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, BRANCHGYM_SANDBOX_DIR=str(tmp_path)),
        cwd=os.getcwd(),
    )
    assert out.returncode == 0, out.stderr
    ok, why, mode = json.loads(out.stdout.splitlines()[-1])
    assert not ok and "cannot mount overlayfs" in why and mode == "git"
    with pytest.raises(SandboxError, match="mode must be"):
        LocalBackend("zfs")


# ------------------------------------------------------------- rejected approaches


def _naive_repo(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    g = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*g, "init", "-q"], cwd=repo, check=True)
    (repo / "tracked.txt").write_text("v1\n")
    subprocess.run([*g, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*g, "commit", "-qm", "base"], cwd=repo, check=True)
    (repo / "notes.txt").write_text("untracked work\n")  # untracked at snapshot time
    return repo, g


def test_git_stash_create_restores_wrongly(tmp_path):
    repo, g = _naive_repo(tmp_path)
    (repo / "tracked.txt").write_text("v2\n")
    stash = subprocess.run(
        [*g, "stash", "create"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()
    (repo / "notes.txt").unlink()
    (repo / "later.txt").write_text("created after the snapshot\n")
    # "restore": reset the tracked files and apply the stash.
    subprocess.run([*g, "reset", "-q", "--hard"], cwd=repo, check=True)
    subprocess.run([*g, "stash", "apply", "-q", stash], cwd=repo, check=True)
    assert (repo / "tracked.txt").read_text() == "v2\n"
    assert not (repo / "notes.txt").exists()  # the untracked file is lost
    assert (repo / "later.txt").exists()  # and a later file survives the "restore"


def test_hardlink_copies_restore_wrongly(tmp_path):
    repo, _ = _naive_repo(tmp_path)
    snap = tmp_path / "snap"
    subprocess.run(["cp", "-al", str(repo), str(snap)], check=True)
    with open(repo / "tracked.txt", "a") as f:  # an in-place append, like `echo >> f`
        f.write("appended later\n")
    assert (snap / "tracked.txt").read_text() == "v1\nappended later\n"  # snapshot changed


def test_both_backends_get_those_cases_right(sandbox):
    run(sandbox, "echo 'untracked work' > notes.txt")
    snap = sandbox.snapshot()
    run(sandbox, "echo 'appended later' >> README.md; rm notes.txt; echo x > later.txt")
    sandbox.restore(snap)
    assert sandbox.read("notes.txt") == b"untracked work\n"
    assert b"appended later" not in sandbox.read("README.md")
    assert "later.txt" not in run(sandbox, "ls")
    snap.release()


def test_unisolated_mode_runs_in_the_host_folder(task_by_name, checkout, tmp_path):
    task = task_by_name["rpn"]
    sb = LocalBackend("git", isolation="none").create(task, checkout(task))
    try:
        out = run(sb, "pwd; ls")
        assert out.splitlines()[0] == str(sb.host_dir) and "rpn" in out
        assert shutil.which("bash")
    finally:
        sb.close()


def test_an_interpreter_under_tmp_stays_visible(sandbox, tmp_path, monkeypatch):
    # A clone in /tmp has its .venv there; the sandbox's private /tmp must not hide it,
    # or grading finds no pytest.
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "marker").write_text("here\n")
    (tmp_path / "private.txt").write_text("host only\n")
    monkeypatch.setattr(sys, "prefix", str(venv))
    assert run(sandbox, f"cat {venv}/bin/marker") == "here\n"
    # Only the interpreter's folder shows: the rest of the host's /tmp stays hidden.
    assert run(sandbox, f"test -e {tmp_path}/private.txt || echo hidden") == "hidden\n"
    assert sandbox.exec(f"touch {venv}/bin/new").exit_code != 0  # and read-only
