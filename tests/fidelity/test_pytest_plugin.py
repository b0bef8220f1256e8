"""The pytest plugin, loaded through its pytest11 entry point in a separate pytest run."""

import subprocess
import sys
import textwrap

import pytest

SANDBOX = """
from branchgym.envs.toy import TreeMDP


class Good(TreeMDP):
    pass


class Aliasing(TreeMDP):
    def reset(self, **kw):
        self.log = []
        return super().reset(**kw)

    def step(self, a):
        self.log.append(int(a))
        return super().step(a)

    def _get_state(self):
        return (super()._get_state(), self.log)

    def _set_state(self, s):
        self.log = s[1]
        return super()._set_state(s[0])
"""

TESTS = """
import branchgym.fidelity.suite
from sandbox import Aliasing, Good

test_good = branchgym.fidelity.suite.fidelity_test(Good, max_examples=10)


def test_fixture(snapshot_fidelity):
    report = snapshot_fidelity(Good, max_examples=10)
    assert report.ok
    snapshot_fidelity(Aliasing, max_examples=20, shrink_seconds=1)
"""


def test_fixture_is_available_in_this_session(snapshot_fidelity):
    report = snapshot_fidelity("branchgym/TreeMDP-v0", max_examples=10)
    assert report.ok and report.examples >= 10


@pytest.mark.slow
def test_plugin_adds_ini_tests_and_the_fixture(tmp_path):
    (tmp_path / "sandbox.py").write_text(SANDBOX)
    (tmp_path / "test_mine.py").write_text(TESTS)
    (tmp_path / "pyproject.toml").write_text(
        textwrap.dedent(
            """
            [tool.pytest.ini_options]
            branchgym_fidelity = ["sandbox:Good", "sandbox:Aliasing"]
            """
        )
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-rA",
            "--branchgym-max-examples",
            "15",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "2 failed, 2 passed" in text, text
    assert "PASSED ::branchgym-fidelity[sandbox:Good]" in text
    assert "FAILED ::branchgym-fidelity[sandbox:Aliasing]" in text
    assert "FAILED test_mine.py::test_fixture" in text
    # The report, with its program, is the failure message (no traceback into branchgym).
    # Counted above the short summary: with CI set, pytest repeats whole messages there.
    failures = text.split("short test summary info")[0]
    assert failures.count("branchgym.restore(env, s0)  # <- FAILS: state_digest") == 2
    assert "from sandbox import Aliasing as make" in text
    off = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:branchgym",
            "test_mine.py::test_good",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert off.returncode == 0 and "1 passed" in off.stdout, off.stdout + off.stderr
