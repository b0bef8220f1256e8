"""Fault injection: sandboxes that fail to restore, hang for good, or own their snapshots.

Every scheduled sibling either runs or is recorded with why it did not; a hung sandbox
never hangs the tree, the executor or the interpreter's exit; a killed driver takes its
stuck workers with it.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import cloudpickle
import gymnasium as gym
import pytest

import branchgym
from branchgym.agents.policies.policy import TextPolicy
from branchgym.envs.toy.text_tree_mdp import TextTreeMDP
from branchgym.rollout.executor_base import EnvRecipe
from branchgym.rollout.executors import InProcessExecutor, ThreadExecutor
from branchgym.rollout.grow import grow_tree
from branchgym.rollout.process import ProcessExecutor

cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS = {"gap_unit": "steps"}
TEXT = EnvRecipe("branchgym/TextTreeMDP-v0")


class Faulty(TextTreeMDP):
    """A maze whose restored copies (the siblings) fail as ``mode`` says."""

    default_env_id = "test/Faulty-v0"

    def __init__(self, mode="restore", **kwargs):
        super().__init__(**kwargs)
        self.mode = mode
        self.armed = False

    def _set_state(self, state):
        self.armed = True
        if self.mode == "restore":
            raise RuntimeError("restore failed: the sandbox image is gone")
        return super()._set_state(state)

    def step(self, action):
        if self.armed and self.mode == "forever":
            time.sleep(30)
        if self.armed and self.mode == "crash" and action == "go south":
            raise RuntimeError("sandbox crashed")
        if self.armed and self.mode == "slow":
            time.sleep(0.25)
        return super().step(action)


class Owner(Faulty):
    """Like a SWE-bench env: closing it releases every snapshot it took."""

    def __init__(self, **kwargs):
        super().__init__(mode="crash", **kwargs)
        self.taken = []

    def snapshot(self):
        snap = super().snapshot()
        self.taken.append(snap)
        return snap

    def live_resources(self):
        return {"snapshots": sum(1 for s in self.taken if not s.released)}

    def close(self):
        for s in self.taken:
            s.release()
        super().close()


def spec_of(cls, **kw):
    def make():
        return branchgym.core.SnapshotAPI(gym.wrappers.TimeLimit(cls(**kw), 20))

    return EnvRecipe(f"{cls.__name__}-{kw}", factory=make)


def grow(spec, executor, schedule="entropy", **kw):
    options = STEPS if schedule == "entropy" else {"depths": (0, 2)}
    kw = {"m": 2, "k": 4, "seed": 0, "rng": 3, "schedule_options": options, **kw}
    return grow_tree(spec, TextPolicy(), schedule, executor=executor, **kw)


# entropy: siblings after the backbone; depths: siblings overlapped with it
SCHEDULES = pytest.mark.parametrize("schedule", ["entropy", "depths"])


@pytest.mark.parametrize(
    "make",
    [
        lambda: InProcessExecutor(max_instances=1),
        lambda: InProcessExecutor(max_instances=2),
        lambda: ThreadExecutor(2),
        lambda: ProcessExecutor(1),
    ],
    ids=["inprocess-1", "inprocess-2", "thread", "process"],
)
@pytest.mark.parametrize("max_concurrent", [1, 2, None])
@SCHEDULES
def test_failed_restores_never_drop_waiting_siblings(make, max_concurrent, schedule):
    with make() as ex:
        spec = spec_of(Faulty, mode="restore")
        tree = grow(spec, ex, schedule, max_concurrent=max_concurrent)
        live = ex.live_snapshots().count
    failed = [n for n in tree if n.error]
    # 2 branch points x 3 siblings: every one is in the tree, with the reason.
    assert len(failed) == 6 and tree.stats.rollouts == 7, [n.error for n in failed]
    assert all("restore failed" in n.error for n in failed)
    assert {n.sibling for n in failed} == {2, 3, 4}
    assert not any(tree[i].error for i in tree.backbone)
    assert live == 0 and branchgym.live_snapshots().count == 0


@pytest.mark.parametrize("mode", ["restore", "crash"])
def test_overlapped_siblings_fail_as_backbone_first_ones_do(mode):
    # a failed restore's leaf is added before the backbone's node at its step: the tree's
    # numbering (and so its backbone and sibling marks) must not depend on that
    def nodes(**kw):
        with ThreadExecutor(2) as ex:
            tree = grow(spec_of(Faulty, mode=mode), ex, "depths", **kw)
        return [(n.id, n.parent, n.step, n.sibling, n.action, n.error) for n in tree]

    overlapped, first = nodes(), nodes(overlap=False)
    assert overlapped == first and any(error for *_, error in first)


@SCHEDULES
def test_a_crashed_instance_keeps_the_snapshots_other_siblings_need(schedule):
    # One instance took the backbone's fork snapshots; a sibling crashes in it. Closing
    # it would release those snapshots, and every later sibling would fail to restore.
    with InProcessExecutor(max_instances=1) as ex:
        tree = grow(spec_of(Owner), ex, schedule)
    errors = [n.error for n in tree if n.error]
    assert errors and all("sandbox crashed" in e for e in errors), errors
    assert tree.stats.rollouts == 7
    ok = [tree[p[-1]] for p in tree.paths() if not tree[p[-1]].error]
    assert len(ok) == 7 - len(errors) and all(n.terminated for n in ok)
    assert branchgym.live_snapshots().count == 0


def test_a_thread_executor_whose_threads_are_all_stuck_still_times_out():
    ex = ThreadExecutor(2, max_instances=3, timeout=0.5)
    t0 = time.perf_counter()
    tree = grow(spec_of(Faulty, mode="forever"), ex)
    took = time.perf_counter() - t0
    failed = [n for n in tree if n.error]
    assert len(failed) == 6 and all(n.error.startswith("timeout") for n in failed)
    assert tree.stats.rollouts == 7
    assert took < 20, f"grow_tree took {took:.1f} s with every thread stuck"
    # The stuck instances no longer count as busy, and fresh threads replaced stuck ones.
    ref = grow(TEXT, InProcessExecutor(max_instances=3))
    again = grow(TEXT, ex)
    assert [n.observation for n in again] == [n.observation for n in ref]
    ex.shutdown()


@pytest.mark.parametrize(
    "make", [lambda: InProcessExecutor(max_instances=1), lambda: ThreadExecutor(2)]
)
@SCHEDULES
def test_a_tree_past_its_budget_is_cut_and_says_so(make, schedule):
    t0 = time.perf_counter()
    with make() as ex:
        spec = spec_of(Faulty, mode="slow")
        tree = grow(spec, ex, schedule, max_concurrent=1, tree_timeout=1.0)
    took = time.perf_counter() - t0
    assert took < 6, took
    assert tree.stats.rollouts == 7  # every scheduled sibling is in the tree
    cut = [n for n in tree if n.error]
    assert cut and all("tree timeout" in n.error for n in cut)
    assert any(n.error.startswith("not run") for n in cut)  # some never started
    assert not any(tree[i].error for i in tree.backbone)
    assert branchgym.live_snapshots().count == 0
    from branchgym.rollout.grow import group_rollouts

    with make() as ex:
        group = group_rollouts(
            spec_of(Faulty, mode="slow"), TextPolicy(), 5, seed=0, executor=ex, tree_timeout=1e-3
        )
    assert group.stats.rollouts == 5 and all("tree timeout" in n.error for n in group if n.error)


HANG_SCRIPT = """
import sys, time, cloudpickle, gymnasium as gym
sys.path.insert(0, {tests!r})
import branchgym
from branchgym.agents.policies.policy import TextPolicy
from {module} import {executor}
from branchgym.rollout.grow import grow_tree
from test_faults import spec_of, Faulty, grow
cloudpickle.register_pickle_by_value(sys.modules["test_faults"])
ex = {executor}(1, timeout={timeout})
if hasattr(ex, "pids"):
    print("worker", ex.pids[0], flush=True)
tree = grow(spec_of(Faulty, mode="forever"), ex)
print("grown", sum(1 for n in tree if n.error), flush=True)
"""


def _script(module, executor, timeout):
    tests = os.path.dirname(os.path.abspath(__file__))
    script = HANG_SCRIPT.format(tests=tests, module=module, executor=executor, timeout=timeout)
    return textwrap.dedent(script)


def test_stuck_threads_never_block_the_interpreters_exit():
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", _script("branchgym.rollout.executors", "ThreadExecutor", 0.5)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    took = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr[-2000:]
    assert "grown 6" in out.stdout
    assert took < 25, f"exit waited for the stuck threads ({took:.1f} s; each hangs 30 s)"


def test_a_killed_driver_takes_its_stuck_worker_with_it():
    proc = subprocess.Popen(
        [sys.executable, "-c", _script("branchgym.rollout.process", "ProcessExecutor", None)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.startswith("worker"), line + proc.stderr.read()
        worker = int(line.split()[1])
        time.sleep(3)  # the tree is growing; the sibling's step hangs in the worker
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(worker, 0)
            except ProcessLookupError:
                break
            with open(f"/proc/{worker}/stat") as f:
                if f.read().split()[2] == "Z":  # exited; its new parent reaps it
                    break
            time.sleep(0.2)
        else:
            os.kill(worker, signal.SIGKILL)
            pytest.fail("the worker outlived its killed driver")
    finally:
        if proc.poll() is None:
            proc.kill()


# ------------------------------------------------------------------------ bad values


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_concurrent": -1}, "max_concurrent must be a whole number >= 1 or None"),
        ({"max_concurrent": 0}, "max_concurrent"),
        ({"max_steps": 0}, "max_steps must be a whole number >= 1 or None"),
        ({"gamma": float("nan")}, "gamma must be a finite number in"),
        ({"gamma": 1.5}, "gamma"),
        ({"k": 0}, "k must be a whole number >= 1"),
        ({"m": -1}, "m must be a whole number >= 0"),
        ({"seed": -3}, "seed must be a whole number >= 0 or None"),
        ({"k": 2.5}, "k must be a whole number"),
        ({"tree_timeout": 0}, "tree_timeout must be positive seconds or None"),
    ],
)
def test_bad_run_options_are_refused_with_the_allowed_range(kwargs, match):
    from branchgym.error import OptionError
    from branchgym.rollout.grow import group_rollouts

    with pytest.raises(OptionError, match=match):
        grow(TEXT, None, **kwargs)
    if "k" not in kwargs and "m" not in kwargs:
        with pytest.raises(OptionError, match=match):
            group_rollouts(TEXT, TextPolicy(), 3, **kwargs)


def test_max_episode_steps_minus_one_means_no_limit_not_one_step():
    from branchgym.error import OptionError

    # Gymnasium's -1 is "no TimeLimit": rollouts must not be cut after one decision.
    spec = EnvRecipe("branchgym/TextTreeMDP-v0", {"max_episode_steps": -1})
    tree = grow(spec, None)
    assert max(len(p) for p in tree.paths()) > 1
    assert all(tree[p[-1]].terminated for p in tree.paths())
    with pytest.raises(OptionError, match="max_episode_steps must be a whole number >= 1"):
        grow(EnvRecipe("branchgym/TextTreeMDP-v0", {"max_episode_steps": 0}), None)


@pytest.mark.parametrize(
    "argv",
    [
        ["check", "branchgym/TreeMDP-v0", "--max-examples", "0"],
        ["check", "branchgym/TreeMDP-v0", "--seed", "-1"],
        ["check", "branchgym/TreeMDP-v0", "--seed", "two"],
    ],
)
def test_cli_refuses_bad_counts_and_seeds_at_parse_time(argv, capsys):
    from branchgym.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "must be at least" in err or "is not an integer" in err, err


# ------------------------------------------------------------------- reproducible trees


def _summary(tree):
    """The tree's rollouts as sorted paths: node ids depend on the play order, not these."""
    paths = [
        tuple((tree[i].step, tree[i].action, tree[i].observation, tree[i].reward,
               tree[i].done, tree[i].error, tree[i].sibling) for i in path)
        for path in tree.paths()
    ]  # fmt: skip
    return sorted(paths, key=repr)


def test_the_same_seeds_give_the_same_tree_on_every_executor_and_size():
    # Each rollout draws from its own stream (seed, branch point, sibling): batching,
    # capacity and scheduling order no longer change a tree.
    noisy = EnvRecipe("branchgym/TextTreeMDP-v0", {"transition_noise": 0.6, "reward_noise": 0.3})
    makers = [
        lambda: InProcessExecutor(max_instances=1),
        lambda: InProcessExecutor(max_instances=2),
        lambda: ThreadExecutor(1),
        lambda: ThreadExecutor(3),
        lambda: ProcessExecutor(1),
        lambda: ProcessExecutor(2, sessions_per_worker=3),
    ]
    for spec in (TEXT, noisy):
        ref = _summary(grow(spec, None))
        for make in makers:
            with make() as ex:
                for max_concurrent in (1, 2, None):
                    tree = grow(spec, ex, max_concurrent=max_concurrent)
                    assert _summary(tree) == ref, (spec.id, ex.name, max_concurrent)
    from branchgym.rollout.grow import group_rollouts

    groups = [
        _summary(group_rollouts(noisy, TextPolicy(), 5, seed=2, rng=7, executor=make()))
        for make in (lambda: InProcessExecutor(max_instances=1), lambda: ThreadExecutor(3))
    ]
    assert groups[0] == groups[1]


def _children_of(pid):
    """Live child processes of ``pid`` (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(d))
    return out


@pytest.mark.slow
def test_the_fault_suite_on_ray_actors():
    ray = pytest.importorskip("ray")
    from branchgym.rollout.ray import RayExecutor

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's own cloudpickle
    before = set(_children_of(os.getpid()))  # earlier tests' helpers are not Ray's
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        noisy = EnvRecipe("branchgym/TextTreeMDP-v0", {"transition_noise": 0.6})
        ref = _summary(grow(noisy, None))
        for n_workers in (1, 2):
            with RayExecutor(n_workers=n_workers, timeout=3) as ex:
                # the same seeds give the same tree as in-process, at every size
                for max_concurrent in (1, None):
                    assert _summary(grow(noisy, ex, max_concurrent=max_concurrent)) == ref
                # failed restores: every sibling recorded with its reason
                tree = grow(spec_of(Faulty, mode="restore"), ex, max_concurrent=1)
                failed = [n for n in tree if n.error]
                assert len(failed) == 6 and tree.stats.rollouts == 7
                assert all("restore failed" in n.error for n in failed)
                # a sandbox that hangs for good: timed out, the actor replaced
                t0 = time.perf_counter()
                tree = grow(spec_of(Faulty, mode="forever"), ex)
                took = time.perf_counter() - t0
                failed = [n for n in tree if n.error]
                assert tree.stats.rollouts == 7 and len(failed) == 6, tree.render()
                assert all("timeout" in n.error or "worker died" in n.error for n in failed)
                assert took < 60, f"{took:.0f} s with every sibling stuck"
                # the replaced actors still work
                assert _summary(grow(noisy, ex)) == ref
                assert ex.live_snapshots().count == 0
        assert branchgym.live_snapshots().count == 0
    finally:
        ray.shutdown()
    deadline = time.monotonic() + 20
    while set(_children_of(os.getpid())) - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert set(_children_of(os.getpid())) - before == set(), "Ray left processes behind"
