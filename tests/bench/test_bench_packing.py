"""The packing study runs end to end on the tiny model and writes its report (its timings
are measured by the study, never asserted here)."""

import json

import pytest

pytest.importorskip("torch")

from branchgym.bench import STUDIES  # noqa: E402
from branchgym.cli import main  # noqa: E402


def test_packing_study_runs_and_the_paths_agree(tmp_path):
    assert "packing" in STUDIES
    argv = ["bench", "packing", "--models", "tiny", "--rows", "3", "--prompt", "16"]
    argv += ["--completion", "4", "--short-prompt", "2", "--repeats", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    data = json.loads((tmp_path / "packing.json").read_text())
    rows = data["rows"]
    paths = ["rows, causal", "rows, 4-D mask", "tree, 4-D mask", "tree, KV cache"]
    assert [r["path"] for r in rows[:4]] == paths
    assert len(rows) == 8  # two workloads
    assert rows[2]["tokens"] == rows[3]["tokens"] == 16 + 3 * 4  # the prompt read once
    assert all(float(r["max abs dlogp"]) < 1e-4 for r in rows)  # the same log-probs
    # a 16-token prompt shared by 3 rows pays, read one way or the other
    assert rows[2]["plan picks"].startswith("1 pack(s), ")
    assert data["tiny"]["exact"]
