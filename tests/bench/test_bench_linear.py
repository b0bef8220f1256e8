"""The linear study times both libraries on every shape and writes its report (the
timings are printed by the study, never asserted here)."""

import json

import pytest

pytest.importorskip("torch")

from branchgym.agents.engines.linear import onednn_available  # noqa: E402
from branchgym.bench import STUDIES  # noqa: E402
from branchgym.cli import main  # noqa: E402


@pytest.mark.skipif(not onednn_available(), reason="this PyTorch has no oneDNN")
def test_linear_study_runs_every_shape_and_both_libraries_agree(tmp_path):
    assert "linear" in STUDIES
    argv = ["bench", "linear", "--hidden", "32", "--intermediate", "48", "--vocab", "96"]
    argv += ["--rows", "1", "5", "--weights", "2", "--repeats", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "linear.json").read_text())["rows"]
    assert [(r[0], r[2]) for r in rows] == [
        (n, s) for n in (1, 5) for s in ("32 -> 32", "32 -> 48", "48 -> 32", "32 -> 96")
    ]
    for row in rows:
        assert float(row[3]) > 0 and float(row[4]) > 0
        assert float(row[6]) < 1e-4 and float(row[7]) < 1e-4  # both float32 products
    assert "MKL / oneDNN" in (tmp_path / "linear.md").read_text()
