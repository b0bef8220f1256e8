"""The docker-overlay backend: a container whose /testbed is a host-side overlay layer stack.

Against a real daemon (scripts/with_docker.sh starts one). The escape and reward-hack
suites run on it too (conftest.EVERY_BACKEND); here: exactness of its snapshots, what is
and is not state, that the host-side clean-up follows no link the agent planted, and that
nothing is left behind.
"""

import os
from pathlib import Path

import pytest

from branchgym.envs.swebench.mounts import list_local_mounts
from branchgym.error import SandboxError
from tests.envs.swebench.test_snapshot_exact import NESTED, NESTED_MUTATE, check_round_trip, run

pytestmark = pytest.mark.docker
ENV_ID = "branchgym/SWEBench-v0"


@pytest.fixture(scope="module")
def backend(docker_available):
    from branchgym.envs.swebench.docker_backend import DockerBackend

    return DockerBackend(snapshot_mode="overlay")


@pytest.fixture
def sandbox(backend, task_by_name, checkout):
    task = task_by_name["textstats"]
    sb = backend.create(task, checkout(task))
    yield sb
    sb.close()


def test_snapshots_are_exact_for_hostile_trees(sandbox):
    assert sandbox.kind == "container+overlay"
    run(sandbox, NESTED)
    run(sandbox, "mkfifo pipe && echo h > h1 && ln h1 h2 && ln -s /etc/passwd outside")
    run(sandbox, "mkdir -p m/n && chmod 750 m/n && touch -d @1000000000 README.md m/n")
    check_round_trip(
        sandbox,
        NESTED_MUTATE + " && rm pipe && echo s > h2.n && mv h2.n h2 && chmod 700 m/n && "
        "echo more >> README.md && mv m moved",
    )
    assert run(sandbox, "stat -c '%F %h' pipe h1 h2") == "fifo 1\nregular file 2\nregular file 2\n"
    assert run(sandbox, "echo v2 >> h1 && cat h2 && id -u") == "h\nv2\n1000\n"


def test_only_testbed_is_state_the_rest_is_read_only_or_scratch(sandbox):
    out = run(sandbox, "touch /etc/x 2>&1 || true; touch /usr/local/x 2>&1 || true")
    assert out.count("Read-only file system") == 2
    run(sandbox, "echo t > /tmp/t && mkdir -p /tmp/d/e && echo h > ~/h && echo a > a")
    snap = sandbox.snapshot()
    run(sandbox, "echo later > /tmp/later")
    sandbox.restore(snap)
    # Scratch does not survive a restore (nor reach a fork): no state crosses to a sibling.
    assert run(sandbox, "ls -A /tmp ~; cat a") == "/home/agent:\n\n/tmp:\na\n"
    child = sandbox.fork(snap)
    try:
        assert run(child, "ls -A /tmp; cat a") == "a\n"
    finally:
        child.close()
    snap.release()


def test_emptying_scratch_follows_no_link_the_agent_planted(sandbox, host_victim):
    # The host empties /tmp through /proc/<pid>/root, as root: an absolute link the agent
    # left there names a host path from the host's side.
    victim, outside = host_victim, host_victim.parent
    snap = sandbox.snapshot()
    run(
        sandbox,
        f"ln -s {outside} /tmp/link && mkdir -p /tmp/d && ln -s {outside} /tmp/d/link && "
        f"ln -s {victim} /tmp/file",
    )
    sandbox.restore(snap)
    assert sorted(os.listdir(outside)) == ["victim"] and victim.read_text() == "v"
    assert run(sandbox, "ls -A /tmp") == ""
    snap.release()


def test_writes_through_the_api_and_hard_links_across_snapshots(sandbox):
    sandbox.write("new/file.txt", b"data", mode=0o600)
    assert sandbox.read("new/file.txt") == b"data"
    assert run(sandbox, "stat -c '%a %u' new/file.txt") == "600 1000\n"
    run(sandbox, "echo v1 > a && ln a b")
    snap = sandbox.snapshot()
    run(sandbox, "echo v2 >> a")
    assert run(sandbox, "cat b") == "v1\nv2\n"
    sandbox.restore(snap)
    assert run(sandbox, "cat b; stat -c %h a") == "v1\n2\n"
    from branchgym.envs.swebench.local import LocalBackend

    local = LocalBackend("git").create(None, Path(sandbox.layers.stack[-1]))
    foreign = local.snapshot()
    try:
        with pytest.raises(SandboxError, match="cannot restore a git snapshot"):
            sandbox.restore(foreign)
        with pytest.raises(SandboxError, match="cannot restore a git snapshot"):
            sandbox.fork(foreign)
    finally:
        foreign.release()
        local.close()
    snap.release()


def test_close_leaves_no_mount_layer_or_container(backend, task_by_name, checkout):
    from branchgym.envs.swebench import docker_backend

    task = task_by_name["textstats"]
    before = set(list_local_mounts())
    sb = backend.create(task, checkout(task))
    run(sb, "echo x > x")
    snap = sb.snapshot()
    child = sb.fork(snap)
    assert len(set(list_local_mounts()) - before) >= 4  # two sandboxes: bind, overlay, tmpfs
    child.close()
    sb.close()
    snap.release()
    docker_backend.wait_idle()
    assert set(list_local_mounts()) - before == set()
    assert docker_backend.owned_resources(pid=os.getpid())["containers"] == []


def test_refused_with_the_alternatives_where_overlayfs_cannot_be_mounted(
    docker_available, monkeypatch
):
    from branchgym.envs.swebench import docker_overlay
    from branchgym.envs.swebench.docker_backend import DockerBackend
    from branchgym.error import SandboxUnavailableError

    monkeypatch.setattr(docker_overlay, "overlay_support", lambda root: (False, "no privilege"))
    with pytest.raises(SandboxUnavailableError, match="no privilege.*backend='docker' or"):
        DockerBackend(snapshot_mode="overlay")
    with pytest.raises(SandboxError, match="'commit', 'git' or 'overlay'"):
        DockerBackend(snapshot_mode="overlayfs")
