"""Resource limits: sizes, validation with typed errors, and how a hit reaches the agent."""

import gymnasium as gym
import pytest

from branchgym.envs.swebench.grading import harness_files
from branchgym.envs.swebench.limits import Cgroups, Limits, format_size, parse_size
from branchgym.envs.swebench.sandbox import ExecResult
from branchgym.error import SandboxConfigError, SandboxError


@pytest.mark.parametrize(
    ("text", "n"),
    [("512M", 512 << 20), ("2GiB", 2 << 30), ("1.5g", 3 << 29), ("64 KiB", 64 << 10),
     (4096, 4096), ("100", 100), ("1T", 1 << 40)],
)  # fmt: skip
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["", "lots", "-1G", "2 parsecs", 0, -5, True, 1.5, None, [1]])
def test_parse_size_refuses_what_is_not_a_size(bad):
    with pytest.raises(SandboxConfigError, match="size such as|positive"):
        parse_size(bad, "limits.memory")


def test_format_size():
    assert format_size(2 << 30) == "2 GiB"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(100) == "100 B"


def test_limits_of_dicts_defaults_and_bad_values():
    assert Limits.of(None) == Limits()
    lim = Limits.of({"memory": "4GiB", "pids": 512, "disk": None})
    assert (lim.memory, lim.pids, lim.disk, lim.tmp) == (4 << 30, 512, None, 256 << 20)
    assert Limits.of(lim) is lim
    with pytest.raises(SandboxConfigError, match="unknown limit.*'mem'.*the limits are"):
        Limits.of({"mem": "1G"})
    with pytest.raises(SandboxConfigError, match="whole number"):
        Limits(pids=2.5)
    with pytest.raises(SandboxConfigError, match="leaves no room"):
        Limits(pids=3)
    with pytest.raises(SandboxConfigError, match="output cannot be None"):
        Limits(output=None)
    with pytest.raises(SandboxConfigError, match="a Limits, a dict"):
        Limits.of("2G")
    assert isinstance(SandboxConfigError("x"), SandboxError | ValueError)


def test_describe_and_ulimit_prefix():
    lim = Limits(memory="256M", pids=64, cpu=30, disk="32M", tmp="16M")
    assert lim.describe("memory") == "memory limit 256 MiB"
    assert lim.describe("pids") == "process limit 64"
    assert lim.describe("cpu") == "CPU time limit 30 s"
    assert lim.describe("disk") == "disk quota 32 MiB"
    assert lim.describe("tmp") == "/tmp quota 16 MiB"
    assert lim.ulimit_prefix(memory_rlimit=False) == "ulimit -t 30 -f 32768 || exit 125\n"
    assert "-v 262144" in lim.ulimit_prefix(memory_rlimit=True)
    assert Limits(cpu=None, disk=None).ulimit_prefix(memory_rlimit=False) == ""


def test_cgroups_report_why_they_are_unavailable(tmp_path):
    cg = Cgroups(tmp_path / "no-cgroups-here")
    assert not cg.available and cg.version == 0
    assert "no cgroup v1 memory hierarchy" in cg.reason
    assert cg.create(Limits()) is None


def test_env_rejects_bad_limits_with_the_fix():
    with pytest.raises(SandboxConfigError, match="unknown limit"):
        gym.make("branchgym/SWEBench-v0", limits={"ram": "1G"})


@pytest.mark.parametrize(
    ("limit", "expected"),
    [
        ("memory limit 2 GiB", "[killed: memory limit 2 GiB; exit code 137"),
        ("process limit 256", "[fork failed: process limit 256 reached"),
        ("disk quota 1 GiB", "[disk quota 1 GiB is full"),
        ("", "[exit code 137]"),
    ],
)
def test_observation_names_the_limit(limit, expected):
    from branchgym.envs.swebench.env import SWEBenchEnv

    env = SWEBenchEnv.__new__(SWEBenchEnv)  # _observe needs only these two attributes
    env.max_output_chars, env.command_timeout = 10_000, 60.0
    obs = env._observe(ExecResult(b"partial output\n", 137, limit=limit))
    assert obs.startswith("partial output\n") and expected in obs, obs


def test_harness_files_of_a_patch():
    patch = (
        "diff --git a/conftest.py b/conftest.py\nnew file mode 100644\n--- /dev/null\n"
        "+++ b/conftest.py\n@@ -0,0 +1 @@\n+x\n"
        "diff --git a/src/lib.py b/src/lib.py\n--- a/src/lib.py\n+++ b/src/lib.py\n"
        "diff --git a/tests/sub/conftest.py b/tests/sub/conftest.py\n"
        "diff --git a/evil.pth b/evil.pth\n"
    )
    assert harness_files(patch) == ["conftest.py", "tests/sub/conftest.py", "evil.pth"]
    assert harness_files("diff --git a/src/conftest_helpers.py b/src/conftest_helpers.py\n") == []


def test_explain_names_the_limit_a_command_hit():
    lim = Limits(memory="256M", pids=64, cpu=30, disk="32M", tmp="16M")
    assert lim.explain(137, b"", oom=True) == "memory limit 256 MiB"
    assert lim.explain(128 + 24, b"") == "CPU time limit 30 s"  # SIGXCPU
    assert lim.explain(0, b"fork: retry", pids_max=True) == "process limit 64"
    assert lim.explain(1, b"No space left on device", layer_full=True) == "disk quota 32 MiB"
    assert lim.explain(153, b"") == "disk quota 32 MiB (file size)"  # SIGXFSZ
    assert lim.explain(1, b"No space left on device") == "/tmp quota 16 MiB"
    assert lim.explain(1, b"No space left on device", enospc="disk") == "disk quota 32 MiB"
    assert lim.explain(1, b"plain failure") == ""
    assert Limits(memory=None).explain(137, b"", oom=True) == ""
