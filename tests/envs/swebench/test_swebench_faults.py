"""Fault injection on real SWE-bench sandboxes, on every executor: hostile commands, a
sandbox that dies mid-step, restores that fail. Every scheduled sibling runs or says why,
and nothing leaks: no mounts, no sandbox folders, no live snapshots, no containers.
"""

import sys
import time

import cloudpickle
import gymnasium as gym
import pytest

import branchgym
from branchgym.agents.policies.policy import TextPolicy
from branchgym.envs.swebench.layers import wait_for_cleanup
from branchgym.envs.swebench.mounts import list_local_mounts, work_root
from branchgym.error import SandboxError
from branchgym.rollout.executor_base import EnvRecipe
from branchgym.rollout.executors import InProcessExecutor, ThreadExecutor
from branchgym.rollout.grow import grow_tree
from branchgym.rollout.process import ProcessExecutor

cloudpickle.register_pickle_by_value(sys.modules[__name__])

ENV_ID = "branchgym/SWEBench-v0"
#: What an agent may try: work, hang past the command timeout, kill everything it can
#: see, wipe the checkout, and (``crash``) a sandbox that dies in the middle of a step.
COMMANDS = ["echo ok >> notes.txt", "sleep 600", "kill -9 -1", "rm -rf ./* && echo gone", "crash"]


def faulty_swebench(backend, fail_restore=False):
    env = gym.make(ENV_ID, backend=backend, command_timeout=1.5)
    inner = env.unwrapped
    real_step, real_restore = inner.step, inner.restore
    restored = []

    def step(action):
        if action == "crash" and restored:  # siblings only: the backbone gets bash's answer
            inner.sandbox.close()  # the container or overlay is gone mid-step
            raise SandboxError("sandbox died mid-step")
        return real_step(action)

    def restore(snapshot):
        if fail_restore:
            raise SandboxError("restore failed: the layer store is gone")
        restored.append(True)
        return real_restore(snapshot)

    inner.step, inner.restore = step, restore
    return env


def spec(backend, **kw):
    name = f"faulty-swebench-{backend}-{kw}"
    return EnvRecipe(name, factory=lambda: faulty_swebench(backend, **kw))


def _sandbox_dirs():
    root = work_root()
    return {d.name for d in root.iterdir()} if root.exists() else set()


def _our_containers(before):
    """Containers this test left: new ones owned by this process or by a dead one (a worker).

    Another branchgym process on the host (a second test run, a training job) owns live
    containers of its own: they are not this test's leak.
    """
    import os

    from branchgym.envs.swebench.docker_backend import docker_client, owner_dead
    from branchgym.envs.swebench.docker_sandbox import OWNER_LABEL

    def ours(labels):
        pid = labels.get("branchgym.pid", "")
        return not pid.isdigit() or int(pid) == os.getpid() or owner_dead(labels)

    listed = docker_client().api.containers(all=True, filters={"label": [OWNER_LABEL]})
    return [c["Id"] for c in listed if c["Id"] not in before and ours(c.get("Labels") or {})]


def _leftovers(before_dirs, backend, before_containers=()):
    """Mounts, non-empty sandbox folders and containers left behind (after a grace period).

    The test keeps its sandboxes under its own ``BRANCHGYM_SANDBOX_DIR``, so the mounts and
    folders of other branchgym processes running at the same time are not counted.
    """
    deadline = time.monotonic() + 15
    while True:
        wait_for_cleanup()
        root = work_root()
        mounts = list_local_mounts(root)
        busy = []
        for name in _sandbox_dirs() - before_dirs:
            d = root / name
            for sub in ("l", "s"):
                if (d / sub).exists() and any((d / sub).iterdir()):
                    busy.append(str(d / sub))
        containers = _our_containers(set(before_containers)) if backend == "docker" else []
        left = {"mounts": mounts, "folders": busy, "containers": containers}
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


EXECUTORS = {
    "inprocess-1": lambda: InProcessExecutor(max_instances=1),
    "thread": lambda: ThreadExecutor(2, timeout=120),
    "process": lambda: ProcessExecutor(2, timeout=120),
}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["overlay", pytest.param("docker", marks=pytest.mark.docker)])
@pytest.mark.parametrize("executor", list(EXECUTORS))
def test_hostile_siblings_and_dying_sandboxes_leave_a_complete_tree_and_nothing_behind(
    backend, executor, tasks, request, tmp_path, monkeypatch
):
    # its own sandbox root (inherited by the process executor's workers): another branchgym
    # process's sandboxes, mounted there at the same time, are not this test's leftovers
    monkeypatch.setenv("BRANCHGYM_SANDBOX_DIR", str(tmp_path / "sandboxes"))
    before_containers: list[str] = []
    if backend == "docker":
        request.getfixturevalue("docker_available")
        from branchgym.envs.swebench.docker_backend import owned_resources

        before_containers = owned_resources()["containers"]  # whoever owns them
    before_dirs, base_live = _sandbox_dirs(), branchgym.live_snapshots().count
    t0 = time.perf_counter()
    with EXECUTORS[executor]() as ex:
        for fail_restore in (False, True):
            tree = grow_tree(
                spec(backend, fail_restore=fail_restore),
                TextPolicy(candidates=COMMANDS, weights=lambda ctx, c: [1, 1, 1, 1, 3]),
                "random",
                m=2,
                k=3,
                seed=0,
                rng=1,
                executor=ex,
                max_steps=3,
                schedule_options={"gap_unit": "steps"},
            )
            # every scheduled rollout is in the tree: 1 backbone + 2 x 2 siblings
            assert tree.stats.rollouts == 5, tree.render()
            errors = [n.error for n in tree if n.error]
            assert all(
                "died mid-step" in e or "restore failed" in e or "timeout" in e for e in errors
            ), errors
            if fail_restore:
                assert sum("restore failed" in e for e in errors) == 4, errors
            else:
                assert any("died mid-step" in e for e in errors), tree.render()
            for node in tree:
                if node.error is None and node.action == "sleep 600":
                    assert node.info.get("timed_out") or "timed out" in str(node.observation)
    took = time.perf_counter() - t0
    assert branchgym.live_snapshots().count == base_live
    left = _leftovers(before_dirs, backend, before_containers)
    assert left == {"mounts": [], "folders": [], "containers": []}
    assert took < 300, f"{took:.0f} s"
