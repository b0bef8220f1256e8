"""Exact snapshots under hostile agent behaviour (issue 18): nested repositories, unborn
HEADs, FIFOs, hard links, odd symlinks, directory renames, modes and times.

Each test compares a fingerprint stronger than ``tree_digest`` (times, link counts and
which names share an inode) before and after snapshot/restore/fork, on both local
backends; the fidelity suite at the end drives the same actions through Hypothesis.
"""

import hashlib
import inspect
import json
import os
import shlex
import shutil
import stat

import gymnasium as gym
import pytest

from branchgym.envs.swebench.env import HOSTILE_ACTIONS, PROBE_ACTIONS
from branchgym.envs.swebench.local import LocalBackend
from branchgym.fidelity.suite import check_snapshot_fidelity

GIT = "git -c user.name=a -c user.email=a@a"


def run(sb, cmd):
    res = sb.exec(cmd)
    assert res.exit_code == 0, res.text
    return res.text


def fingerprint(root):
    """Every entry: type, mode, times, content or target, link count, inode group."""
    out, first = [], {}
    for top, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(dirs + files):
            p = os.path.join(top, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            kind = stat.S_IFMT(st.st_mode)
            what = ""
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    what = hashlib.sha1(f.read()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                what = os.readlink(p)
            group = first.setdefault((st.st_ino, st.st_nlink), rel) if st.st_nlink > 1 else ""
            if stat.S_ISDIR(st.st_mode):
                group = ""
            out.append((rel, kind, stat.S_IMODE(st.st_mode), st.st_mtime_ns, what, group))
    return out


FINGERPRINT = f"""
import hashlib, json, os, stat
{inspect.getsource(fingerprint)}
print(json.dumps(fingerprint("/testbed")))
"""


def fingerprint_of(sb):
    """The fingerprint of /testbed: on the host for local sandboxes, else inside."""
    if hasattr(sb, "host_dir"):
        return fingerprint(sb.host_dir)
    out = run(sb, f"python3 -c {shlex.quote(FINGERPRINT)}")
    return [tuple(x) for x in json.loads(out)]


def check_round_trip(sb, mutate):
    """Snapshot, mutate, restore (and fork): the fingerprint comes back exactly."""
    before = fingerprint_of(sb)
    snap = sb.snapshot()
    assert fingerprint_of(sb) == before  # taking it changes nothing
    run(sb, mutate)
    after = fingerprint_of(sb)
    assert after != before
    snap2 = sb.snapshot()
    sb.restore(snap)
    assert fingerprint_of(sb) == before
    sb.restore(snap2)
    assert fingerprint_of(sb) == after
    child = sb.fork(snap)
    try:
        assert fingerprint_of(child) == before
    finally:
        child.close()
    sb.restore(snap)
    snap.release()
    snap2.release()


def test_nested_repositories_and_unborn_heads(sandbox):
    run(sandbox, NESTED)
    check_round_trip(sandbox, NESTED_MUTATE)
    assert run(sandbox, "git -C a/inner log --format=%s") == "one\n"
    assert run(sandbox, "git -C empty status --short; ls -a empty") == ".\n..\n.git\n"
    assert run(sandbox, "git -C clone status --porcelain") == ""


def test_a_folder_that_becomes_a_repository_after_the_snapshot(sandbox):
    run(sandbox, "mkdir -p lib/sub && echo a > lib/a.py && echo b > lib/sub/b.py")
    check_round_trip(sandbox, "cd lib && git init -q && echo c > c.py && rm a.py && rm -r sub")
    assert sandbox.read("lib/a.py") == b"a\n" and sandbox.read("lib/sub/b.py") == b"b\n"


def test_fifos_hard_links_and_symlinks(sandbox):
    run(
        sandbox,
        "mkfifo pipe && mkdir -p d && mkfifo -m 600 d/p2 && echo h > h1 && ln h1 h2 && "
        "ln h1 d/h3 && ln -s /nonexistent/x dangling && ln -s /etc/passwd outside && "
        "ln -s ../README.md d/rel",
    )
    check_round_trip(
        sandbox,
        "rm pipe d/p2 && mkfifo newpipe && echo split > h2.new && mv h2.new h2 && "
        "ln -f README.md h1 && rm dangling && ln -sfn /tmp outside && rm d/rel && ln h1 d/h4",
    )
    assert run(sandbox, "stat -c '%F %h %a' pipe d/p2 h1 h2 d/h3") == (
        "fifo 1 644\nfifo 1 600\nregular file 3 644\nregular file 3 644\nregular file 3 644\n"
    )
    assert (
        run(sandbox, "readlink dangling outside d/rel")
        == "/nonexistent/x\n/etc/passwd\n../README.md\n"
    )


def test_restore_follows_no_link_the_agent_planted(sandbox, host_victim):
    # Restore runs as root on the host (git) or in the container (docker-git): names the
    # agent swapped for symlinks to outside files must not make it write there.
    victim, outside = host_victim, host_victim.parent
    st = os.lstat(victim)
    before = (st.st_nlink, stat.S_IMODE(st.st_mode), "v")
    run(sandbox, "echo h > h1 && ln h1 h2 && mkdir -p d/e && mkfifo d/p && chmod 600 h1")
    fp = fingerprint_of(sandbox)
    snap = sandbox.snapshot()
    for name in ("h1", "h2", "d"):
        target = sandbox.host_dir / name
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink()
        os.symlink(outside if name == "d" else victim, target)
    sandbox.restore(snap)
    assert fingerprint_of(sandbox) == fp
    assert sorted(os.listdir(outside)) == ["victim"]
    st = os.lstat(victim)
    assert (st.st_nlink, stat.S_IMODE(st.st_mode), victim.read_text()) == before
    snap.release()


def test_linking_hard_links_up_touches_no_host_file_through_a_planted_link(sandbox, host_victim):
    # At a snapshot the overlay backend chowns (a no-op owner change, which clears set-uid
    # bits) the other names of a hard link one name of which was written; a folder on
    # the way to such a name swapped for a link to the host must not lead it there.
    victim, outside = host_victim, host_victim.parent
    os.chmod(victim, 0o4755)
    run(sandbox, "mkdir d && echo h > d/victim && ln d/victim h1")
    first = sandbox.snapshot()
    run(sandbox, f"rm -rf d && ln -s {shlex.quote(str(outside))} d")
    second = sandbox.snapshot()  # the link is frozen in a layer below the next writes
    run(sandbox, "echo x >> h1")
    third = sandbox.snapshot()
    assert stat.S_IMODE(os.lstat(victim).st_mode) == 0o4755 and victim.read_text() == "v"
    assert run(sandbox, "cat h1; readlink d") == f"h\nx\n{outside}\n"
    for snap in (first, second, third):
        snap.release()


def test_a_write_through_one_name_shows_through_the_others(sandbox):
    run(sandbox, "echo v1 > a && ln a b && mkdir d && ln a d/c && echo w > w1 && ln w1 w2")
    snap = sandbox.snapshot()
    sandbox.restore(snap)
    run(sandbox, "echo v2 >> a")
    snap2 = sandbox.snapshot()  # only a was written: b and d/c must follow it
    run(sandbox, "echo v3 >> d/c && echo x >> w2")
    if getattr(sandbox, "index", True):
        assert sandbox.read("b") == b"v1\nv2\nv3\n" and sandbox.read("w1") == b"w\nx\n"
        assert run(sandbox, "stat -c %h a b d/c w1") == "3\n3\n3\n2\n"
        sandbox.restore(snap2)
        assert sandbox.read("d/c") == b"v1\nv2\n"
        assert run(sandbox, "stat -c %h a b d/c w1") == "3\n3\n3\n2\n"
    else:
        # Stated limitation (docs/swebench.md, "Snapshots"): without index=on overlayfs
        # copies a file up on its first write after a snapshot, one name only.
        assert sandbox.read("b") == b"v1\n"
    snap.release()
    snap2.release()


def test_overlay_without_index_breaks_hard_links_on_write(task_by_name, checkout):
    task = task_by_name["textstats"]
    backend = LocalBackend("overlay")
    backend.index = False
    sb = backend.create(task, checkout(task))
    try:
        assert sb.index is False
        test_a_write_through_one_name_shows_through_the_others(sb)
    finally:
        sb.close()


def test_modes_and_modification_times(sandbox):
    run(
        sandbox,
        "mkdir -p m/n && chmod 700 m && chmod 750 m/n && echo x > m/n/f && chmod 640 m/n/f && "
        "touch -d @1000000000 m/n/f README.md && touch -h -d @1200000000 m/n",
    )
    check_round_trip(
        sandbox,
        "chmod 755 m && chmod 600 m/n/f && touch m/n/f && echo more >> README.md && "
        "rm -r m/n && touch -d @1300000000 tests",
    )
    assert run(sandbox, "stat -c '%a %Y' m/n m/n/f README.md") == (
        "750 1200000000\n640 1000000000\n644 1000000000\n"
    )


def test_renaming_a_directory_from_before_the_snapshot(sandbox):
    run(sandbox, "mkdir -p old/sub && echo f > old/sub/f && echo g > old/g")
    snap = sandbox.snapshot()
    # rename(2) itself, as git mv and os.rename do it (mv would fall back to copying).
    res = sandbox.exec(
        "python3 -c \"import os; os.rename('old', 'new'); os.rename('textstats', 'pkg')\""
    )
    if getattr(sandbox, "redirect_dir", True):
        assert res.exit_code == 0, res.text
        assert run(sandbox, "cat new/sub/f new/g; ls").startswith("f\ng\n")
        moved = fingerprint(sandbox.host_dir)
        snap2 = sandbox.snapshot()
        run(sandbox, "mv new/sub new/sub2 && rm -r pkg")
        sandbox.restore(snap2)
        assert fingerprint(sandbox.host_dir) == moved
    else:
        assert "Invalid cross-device link" in res.text
        run(sandbox, "mv old new")  # mv copies and deletes on EXDEV
    sandbox.restore(snap)
    assert run(sandbox, "cat old/sub/f; test ! -e new && test -d textstats && echo ok") == "f\nok\n"
    snap.release()


def test_overlay_without_redirect_dir_returns_exdev(task_by_name, checkout):
    task = task_by_name["textstats"]
    sb = LocalBackend("overlay", overlay_redirect_dir=False).create(task, checkout(task))
    try:
        assert sb.redirect_dir is False
        test_renaming_a_directory_from_before_the_snapshot(sb)
    finally:
        sb.close()


def test_squashing_keeps_renames_fifos_and_links(task_by_name, checkout):
    task = task_by_name["textstats"]
    backend = LocalBackend("overlay", max_layers=2)
    sb = backend.create(task, checkout(task))
    steps = [
        "mkdir -p a/b && echo 1 > a/b/f && mkfifo a/p && echo h > h1 && ln h1 a/h2",
        "mv a c && mv textstats pkg && echo 2 >> c/b/f && mkdir -p x/y && echo y > x/y/f",
        "mv c/b c/b2 && mv x z && mv pkg/core.py pkg/core2.py && echo 3 > c/b2/g",
        "mv z/y c/y && rm -r tests && echo 4 >> c/y/f",
    ]
    snaps, prints = [], []
    try:
        for cmd in steps:
            run(sb, cmd)
            snaps.append(sb.snapshot())
            prints.append(fingerprint(sb.host_dir))
        assert len(sb.stack) <= 3  # squashed at least once
        for snap, expect in zip(snaps, prints, strict=True):
            sb.restore(snap)
            assert fingerprint(sb.host_dir) == expect
    finally:
        for s in snaps:
            s.release()
        sb.close()


NESTED = (
    f"git init -q a/inner && cd a/inner && echo one > f.txt && {GIT} add f.txt && "
    f"{GIT} commit -qm one && mkdir -p deep && git init -q deep/er && cd /testbed && "
    "git init -q empty && git clone -q . clone && mkdir gf && "
    "echo 'gitdir: ../a/inner/.git' > gf/.git && echo w > gf/work.txt"
)
NESTED_MUTATE = (
    f"cd a/inner && echo two >> f.txt && {GIT} commit -qam two && echo u > untracked && "
    "cd /testbed && echo e > empty/e.txt && rm -rf clone && git init -q later && "
    "echo l > later/l.txt && mkdir plain && echo p > plain/p && git init -q plain && "
    "rm -rf a/inner/deep/er/.git && rm gf/.git && git checkout -q --orphan orphan"
)


@pytest.mark.docker
@pytest.mark.slow
def test_docker_git_snapshots_are_exact_too(docker_available, task_by_name, checkout):
    from branchgym.envs.swebench.docker_backend import DockerBackend

    task = task_by_name["textstats"]
    sb = DockerBackend(snapshot_mode="git").create(task, checkout(task))
    try:
        run(sb, NESTED)
        run(sb, "mkfifo pipe && echo h > h1 && ln h1 h2 && ln -s /nonexistent dangling")
        run(sb, "mkdir -p m/n && chmod 750 m/n && touch -d @1000000000 README.md m/n")
        check_round_trip(
            sb,
            NESTED_MUTATE + " && rm pipe && echo s > h2.n && mv h2.n h2 && chmod 700 m/n && "
            "echo more >> README.md",
        )
        assert run(sb, "stat -c '%F %h' pipe h1 h2") == "fifo 1\nregular file 2\nregular file 2\n"
        assert run(sb, "echo v2 >> h1 && cat h2 && id -u") == "h\nv2\n1000\n"
    finally:
        sb.close()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["overlay", "git"])
def test_fidelity_suite_with_hostile_actions(backend):
    report = check_snapshot_fidelity(
        lambda: gym.make(
            "branchgym/SWEBench-v0",
            backend=backend,
            suggested_actions=(*HOSTILE_ACTIONS, *PROBE_ACTIONS[:3]),
        ),
        mode="exact",
        max_examples=6,
        steps=12,
        seed=3,
        shrink_seconds=0,
    )
    assert report.ok, str(report)


@pytest.mark.slow
def test_fidelity_suite_finds_exdev_when_redirect_dir_is_off(monkeypatch):
    # The suite has the power to see an inexactness these actions expose: without
    # redirect_dir a folder made before a snapshot cannot be renamed after it.
    import branchgym.envs.swebench.local as local

    monkeypatch.setattr(local, "redirect_dir_support", lambda root=None: False)
    actions = (HOSTILE_ACTIONS[8], HOSTILE_ACTIONS[9], "ls")
    assert "olddir" in actions[0] and "os.rename" in actions[1]
    report = check_snapshot_fidelity(
        lambda: gym.make("branchgym/SWEBench-v0", backend="overlay", suggested_actions=actions),
        mode="exact",
        max_examples=25,
        steps=10,
        seed=3,
        shrink_seconds=0,
        reproduce=1,
    )
    assert not report.ok
    assert "Invalid cross-device link" in str(report)
