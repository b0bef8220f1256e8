"""Run the verl integration's tests in the venv that has verl (``make verl-venv``).

verl 0.9.1 pins ``transformers<5.11`` and ``tensordict<=0.10``, older than the main venv's,
so verl gets its own venv, ``.venv-verl`` (as vLLM has ``.venv-vllm``). This test runs
``tests/integrations/verl_side`` with that venv's Python. Without the venv it skips with
the command that builds it, unless ``BRANCHGYM_REQUIRE_VERL=1`` (``make test`` sets it),
where it fails.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERL_PYTHON = Path(os.environ.get("BRANCHGYM_VERL_PYTHON", ROOT / ".venv-verl" / "bin" / "python"))


def _verl_python() -> Path:
    if not VERL_PYTHON.is_file():
        reason = f"no verl venv at {VERL_PYTHON}; build it with `make verl-venv`"
        if os.environ.get("BRANCHGYM_REQUIRE_VERL") == "1":
            pytest.fail(f"CI expects verl (BRANCHGYM_REQUIRE_VERL=1) but: {reason}")
        pytest.skip(reason)
    return VERL_PYTHON


@pytest.mark.slow
def test_verl_side_suite_passes_in_the_verl_venv():
    python = _verl_python()
    proc = subprocess.run(
        [
            str(python),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/integrations/verl_side",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"the verl-side tests failed:\n{tail}"
    summary = proc.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "skipped" not in summary, tail


def test_verl_is_not_importable_here_or_is_the_pinned_one():
    # The main venv must not carry verl (its pins would downgrade transformers); where it
    # does, it must be the version the integration is written against.
    try:
        import verl  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"branchgym\[verl\]"):
            import branchgym.integrations.verl  # noqa: F401
        return
    from importlib.metadata import version

    assert version("verl") == "0.9.1", sys.executable
