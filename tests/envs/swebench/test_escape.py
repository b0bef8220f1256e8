"""The escape suite: what an adversarial agent tries, through ``env.step``, on every backend.

An RL agent optimises whatever raises its reward, so each known way out of the sandbox or
into the grader is tried here as an agent would (one bash command per step). Each must
fail, and the env must keep working afterwards. The threat model is in docs/swebench.md.

Network probes go to loopback only: a listener this test opens on the host's 127.0.0.1,
which a sandbox in its own network namespace must not reach.
"""

import os
import socket
import threading
from pathlib import Path

import gymnasium as gym
import pytest

from branchgym.envs.swebench.layers import wait_for_cleanup
from branchgym.envs.swebench.limits import Limits
from branchgym.envs.swebench.mounts import list_local_mounts, work_root
from branchgym.envs.swebench.tasks import cache_root, verify_checkout
from branchgym.error import SandboxError

pytestmark = pytest.mark.slow

#: Small limits, so that each bomb hits its limit in a fraction of a second.
LIMITS = Limits(memory=256 << 20, pids=64, cpu=30, disk=32 << 20, tmp=16 << 20)
TASK = "branchgym__textstats-1"

#: A conftest.py that reports every test as passed: the classic grader hack.
FORCE_PASS = (
    "import pytest\n"
    "@pytest.hookimpl(hookwrapper=True)\n"
    "def pytest_runtest_makereport(item, call):\n"
    "    out = yield\n"
    "    out.get_result().outcome = 'passed'\n"
)


@pytest.fixture(scope="module")
def env(backend_name):
    e = gym.make("branchgym/SWEBench-v0", backend=backend_name, limits=LIMITS, command_timeout=20)
    yield e
    e.close()
    wait_for_cleanup()


@pytest.fixture
def fresh(env):
    env.reset(options={"instance_id": TASK})
    yield env
    if env.unwrapped.done:  # submitted: the next episode must work
        env.reset(options={"instance_id": TASK})
    alive(env)


def step(env, cmd):
    obs, reward, term, trunc, info = env.step(cmd)
    return obs, info


def alive(env):
    """The env still works: a command runs, its output comes back."""
    obs, info = step(env, "echo alive; pwd")
    assert obs == "alive\n/testbed\n", obs
    assert info["exit_code"] == 0


def backend_of(env):
    return env.unwrapped.backend_name


# ------------------------------------------------------------ privileges and mounts


def test_no_capabilities_so_mount_umount_remount_fail(fresh):
    obs, _ = step(fresh, "grep -E '^Cap(Eff|Prm)' /proc/self/status")
    assert obs.split() == ["CapPrm:", "0000000000000000", "CapEff:", "0000000000000000"], obs
    for cmd in (
        "mount -o remount,bind,rw /usr",
        "mount -t tmpfs none /testbed",
        "umount /tmp",
        "umount -l /testbed",
        "touch /usr/branchgym-probe",
        "unshare -rm true",  # a nested user namespace to regain capabilities
    ):
        obs, info = step(fresh, cmd)
        assert info["exit_code"] != 0, f"{cmd!r} succeeded: {obs}"
    assert not Path("/usr/branchgym-probe").exists()
    obs, _ = step(fresh, "id -u")
    assert obs.strip() != "0" or backend_of(fresh) == "docker-root"


def test_host_files_outside_the_task_are_not_there(fresh, tmp_path):
    secret = Path.home() / f".branchgym-secret-{os.getpid()}"
    secret.write_text("host secret\n")
    project = Path(__file__).resolve()
    try:
        for path in (secret, project, cache_root(), work_root()):
            obs, info = step(fresh, f"cat {path} 2>&1 || ls -A {path} 2>&1")
            assert "host secret" not in obs and "def test_" not in obs, path
            assert info["exit_code"] != 0 or obs.strip() == "", (path, obs)
        host_shadow = Path("/etc/shadow").read_text().splitlines()[0]
        obs, _ = step(fresh, "cat /etc/shadow; true")
        assert host_shadow not in obs
        obs, _ = step(fresh, "ls -A /root /home 2>/dev/null; true")
        assert secret.name not in obs
        # Of the project, at most its virtual environment (the toolchain) shows.
        repo = project.parents[2]
        obs, _ = step(fresh, f"ls -A {repo} 2>/dev/null; true")
        assert set(obs.split()) <= {".venv", "(no", "output)"}, obs
        # The task file, with its gold patch, is in the cache: absent too.
        task = fresh.unwrapped.task
        gold = next(ln for ln in task.patch.splitlines() if ln.startswith("+") and len(ln) > 8)
        where = "/testbed /tmp /etc /home /var /run /srv /opt /mnt"
        obs, _ = step(fresh, f"grep -rlF -- {gold[1:]!r} {where} 2>/dev/null; true")
        assert obs == "(no output)", obs
    finally:
        secret.unlink()


# -------------------------------------------------------------- cache and grading


def test_cache_and_pristine_checkout_cannot_be_written(fresh):
    unwrapped = fresh.unwrapped
    checkout = unwrapped._checkout(unwrapped.task)
    digest = verify_checkout(checkout)
    for cmd in (
        f"printf x > {checkout}/conftest.py",
        f"mkdir -p {checkout} && printf x > {checkout}/conftest.py && ls {checkout}",
        f"ls {work_root()}",
    ):
        step(fresh, cmd)
    assert not (checkout / "conftest.py").exists()
    assert verify_checkout(checkout) == digest


def test_a_changed_pristine_checkout_is_refused_before_grading(fresh, tmp_path):
    unwrapped = fresh.unwrapped
    checkout = unwrapped._checkout(unwrapped.task)
    planted = checkout / "conftest.py"
    planted.write_text(FORCE_PASS)  # what a sandbox escape would do, done from the host
    try:
        with pytest.raises(SandboxError, match="changed since it was made"):
            unwrapped.grade(unwrapped.task.patch)
    finally:
        planted.unlink()
    assert unwrapped.grade(unwrapped.task.patch).resolved


def test_planted_conftest_hidden_from_the_diff_scores_zero(fresh):
    fresh.unwrapped.sandbox.write("conftest.py", FORCE_PASS.encode())
    step(fresh, "echo conftest.py >> .git/info/exclude; git status --short")
    obs, info = step(fresh, "python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tail -1")
    assert "passed" in obs and "failed" not in obs  # the hack works inside the sandbox
    obs, reward, terminated, _, info = fresh.step("submit")
    assert terminated and reward == 0.0, obs
    assert info["patch"] == "" and "empty patch" in obs


def test_planted_conftest_in_the_diff_is_refused(fresh):
    fresh.unwrapped.sandbox.write("conftest.py", FORCE_PASS.encode())
    obs, reward, terminated, _, info = fresh.step("submit")
    assert terminated and reward == 0.0, obs
    assert "conftest.py: a conftest.py runs before any test" in obs
    assert info["rejected"] in obs
    # Without the guard it is graded as upstream grades it: the hack would win.
    report = fresh.unwrapped.__class__.grade
    fresh.unwrapped.harness_guard = False
    try:
        assert report(fresh.unwrapped, info["patch"]).resolved
    finally:
        fresh.unwrapped.harness_guard = True


# ---------------------------------------------------------------------- network


def test_no_network_even_to_the_hosts_loopback(fresh):
    hits = []
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            hits.append(1)
            conn.close()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        code = (
            "import socket, errno\n"
            "s = socket.socket(); s.settimeout(2)\n"
            f"print(errno.errorcode.get(s.connect_ex(('127.0.0.1', {port})), 'connected'))\n"
        )
        fresh.unwrapped.sandbox.write("net.py", code.encode())
        obs, _ = step(fresh, "python3 net.py")
        assert obs.strip() in ("ECONNREFUSED", "ENETUNREACH", "EHOSTUNREACH"), obs
        assert not hits
    finally:
        stop.set()
        t.join()
        srv.close()


# ---------------------------------------------------------------------- limits


def test_fork_bomb_is_bounded_by_the_pids_limit(fresh):
    code = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    while n < 10000:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(60); os._exit(0)\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    print('fork failed after', n, e.strerror)\n"
    )
    fresh.unwrapped.sandbox.write("bomb.py", code.encode())
    obs, info = step(fresh, "python3 bomb.py")
    assert "fork failed after" in obs, obs
    n = int(obs.split("fork failed after")[1].split()[0])
    assert n < LIMITS.pids
    assert info.get("limit") == "process limit 64", info
    assert "process limit 64" in obs
    obs, _ = step(fresh, "cat /proc/[0-9]*/comm 2>/dev/null | grep -c python3; true")
    assert obs.strip() == "0", obs  # the forked children died with the step


def test_memory_bomb_is_killed_at_the_memory_limit(fresh):
    obs, info = step(fresh, "python3 -c 'b = bytearray(1 << 30); print(len(b))'")
    assert info["exit_code"] != 0 and "1073741824" not in obs
    assert info.get("limit") == "memory limit 256 MiB", (obs, info)
    assert "[killed: memory limit 256 MiB" in obs


def test_disk_fill_is_bounded(fresh):
    obs, info = step(fresh, "dd if=/dev/zero of=big.bin bs=1M count=200 status=none; ls -s big.bin")
    written = int(step(fresh, "stat -c %s big.bin")[0])
    assert written <= LIMITS.disk, written
    assert "disk quota 32 MiB" in info.get("limit", ""), (obs, info)
    if backend_of(fresh) == "overlay":  # the whole writable layer is bounded, not one file
        step(fresh, "rm -f big.bin")
        script = "for i in 1 2 3 4 5 6; do head -c 10000000 /dev/zero > f$i.bin || break; done"
        obs, info = step(fresh, script)
        assert info.get("limit") == "disk quota 32 MiB", (obs, info)
        assert "No space left on device" in obs
        used = int(step(fresh, "du -sbc f*.bin | tail -1 | cut -f1")[0])
        assert used <= LIMITS.disk
        step(fresh, "rm -f f*.bin")
    if not backend_of(fresh).startswith("docker"):  # the private /tmp has its own quota
        obs, info = step(fresh, "head -c 100000000 /dev/zero > /tmp/fill; ls -s /tmp/fill")
        assert "No space left on device" in obs, obs
        assert "/tmp quota 16 MiB" in info.get("limit", ""), info


def test_background_processes_do_not_outlive_the_step(fresh):
    step(
        fresh,
        "setsid sleep 1000 & "
        "nohup sh -c 'while :; do date >> bg.txt; sleep 0.05; done' >/dev/null 2>&1 & "
        "sleep 0.3; echo started",
    )
    ps = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done 2>/dev/null"
    obs, _ = step(fresh, f"{ps} | grep -cE 'sleep 1[0]00|while [:]'; true")
    assert obs.strip() == "0", obs
    size1 = step(fresh, "wc -c < bg.txt")[0]
    size2 = step(fresh, "sleep 0.5; wc -c < bg.txt")[0]
    assert size1 == size2, "a background writer survived the step"
    # ... so a snapshot is quiesced: restoring it twice gives the same tree.
    sb = fresh.unwrapped.sandbox
    snap = sb.snapshot()
    digest = sb.tree_digest()
    step(fresh, "sleep 0.3")
    assert sb.tree_digest() == digest
    sb.restore(snap)
    assert sb.tree_digest() == digest
    snap.release()


def test_timeout_observation_shows_no_internal_marker(fresh):
    step(fresh, "cd tests")
    fresh.unwrapped.command_timeout = 1.0
    try:
        obs, info = step(fresh, "export LEAK=1; echo before; sleep 30")
    finally:
        fresh.unwrapped.command_timeout = 20.0
    assert info["timed_out"] and obs.startswith("before\n"), obs
    assert "__branchgym_state" not in obs and "PATH=" not in obs, obs
    assert info["cwd"] == "/testbed/tests"
    assert step(fresh, "echo ${LEAK:-unset}")[0] == "unset\n"
    step(fresh, "cd /testbed")


# --------------------------------------------------------------------- symlinks


def test_symlinks_do_not_lead_out_of_testbed(fresh):
    step(fresh, "ln -s / rootlink; ln -s /etc/shadow shadow.txt; ln -s .. up")
    sb = fresh.unwrapped.sandbox
    for path in ("rootlink/etc/passwd", "shadow.txt", "up/etc/hostname"):
        with pytest.raises(SandboxError):
            sb.read(path)
    with pytest.raises(SandboxError):
        sb.write("rootlink/tmp/x", b"x")
    obs, info = step(fresh, "cat shadow.txt")
    assert info["exit_code"] != 0  # not there, or not readable
    # Submitted, the links are graded in a fresh sandbox: nothing of the host leaks.
    obs, reward, *_ = fresh.step("submit")
    assert reward == 0.0


def test_no_mounts_or_cgroups_leak_after_the_suite(env):
    env.reset(options={"instance_id": TASK})
    for _ in range(3):
        step(env, "python3 -c 'b = bytearray(1 << 30)'")
    from branchgym.envs.swebench.limits import cgroups

    cg = cgroups()
    for parent in cg.parents.values():
        mine = [d for d in parent.iterdir() if d.is_dir() and d.name.startswith(f"{os.getpid()}-")]
        assert mine == [], mine
    if backend_of(env) == "overlay":
        mounts = list_local_mounts()
        box = str(env.unwrapped.sandbox.dir)
        assert sorted(m for m in mounts if m.startswith(box)) == [f"{box}/m", f"{box}/rw"]
