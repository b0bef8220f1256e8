"""Restores into another env instance (a branching sibling on a free pool instance).

Such an instance last ran another task, so the restore also switches it to the snapshot's
task environment. That switch used to start the base interpreter (to ask its prefixes)
once per instance and task: 100-200 ms on top of the restore, which is what made BPO's
restores in ``bench branching`` cost several times ``bench snapshot``'s. Now nothing is
started: the answer is kept per interpreter and process.
"""

import subprocess

import gymnasium as gym

import branchgym  # noqa: F401  (registers the env)
from branchgym.core import restore, snapshot
from branchgym.envs.swebench import repo_env

X, Y = "tkem__cachetools-1", "pytoolz__toolz-1"


def test_restoring_another_tasks_snapshot_into_a_pool_instance_starts_no_interpreter(
    monkeypatch,
):
    def make():
        return gym.make("branchgym/SWEBench-v0", backend="git", tasks="realistic")

    a, b = make(), make()
    try:
        a.reset(options={"instance_id": X})
        a.step("echo kept > notes.txt")
        b.reset(options={"instance_id": Y})
        started = []
        real_run = subprocess.run

        def run(argv, *args, **kw):
            if "-I" in argv:  # the interpreter asked for its prefixes
                started.append(argv)
            return real_run(argv, *args, **kw)

        monkeypatch.setattr(repo_env.subprocess, "run", run)
        with snapshot(a) as snap:
            restore(b, snap)
        assert started == []
        # b now runs X's tree in X's own environment.
        assert b.unwrapped.task.instance_id == X
        where = "python3 -c 'import cachetools; print(cachetools.__file__)'"
        obs, *_ = b.step(f"cat notes.txt; {where}")
        assert obs.startswith("kept\n/testbed/src/cachetools/__init__.py"), obs
    finally:
        a.close()
        b.close()
