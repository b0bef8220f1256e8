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
    paths = ["rows, causal", "rows, 4-D mask", "tree, 4-D mask", "tree, KV cache", "tree, flat"]
    assert [r["path"] for r in rows[:5]] == paths
    assert len(rows) == 10  # two workloads
    assert rows[2]["tokens"] == rows[3]["tokens"] == rows[4]["tokens"] == 16 + 3 * 4
    assert all(float(r["max abs dlogp"]) < 1e-4 for r in rows)  # the same log-probs
    # the tiny model is read flat: one trie, the prompt once
    assert rows[2]["plan picks"] == "1 pack(s), flat"
    assert data["tiny"]["exact"]
