"""scripts/gpu_learners.py, the GPU check of every learner, runs end to end on CPU (tiny)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_learners.py"


@pytest.mark.slow
def test_gpu_learners_script_runs_every_learner_on_cpu(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--device",
            "cpu",
            "--tiny",
            "--steps",
            "2",
            "--prompts",
            "1",
            "--max-new-tokens",
            "8",
            "--threads",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "gpu_learners.json").read_text())
    assert report["meta"]["vocab"] == report["meta"]["tokenizer_size"]
    assert report["meta"]["engines"] == ["hf"]
    algos = [r["algo"] for r in report["rows"]]
    assert algos == ["sft", "grpo", "rloo", "bpo", "bellman_po", "branch_opd", "opd", "opd_multi"]
    for row in report["rows"]:
        assert row["steps"] == 2 and row["step_s"] > 0 and row["peak_memory_gb"] > 0
        assert row["engine"] == "hf"
        if row["algo"] != "sft":
            assert row["tokens_per_step"] > 0 and row["generate_tokens_per_s"] > 0
    assert "| bpo |" in (out / "gpu_learners.md").read_text()


def test_gpu_learners_script_refuses_cuda_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "--device cpu --tiny" in proc.stderr


def _script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_learners", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_model_is_built_at_its_tokenizers_vocabulary(tmp_path):
    from branchgym.agents.policies.models import load_model

    facts = _script().build_model(tmp_path / "m", tiny=True, tok_name="tiny", seed=0)
    model, tok = load_model(tmp_path / "m")
    assert facts["vocab"] == model.config.vocab_size == len(tok) == facts["tokenizer_size"]
    # every id the model can sample decodes to text (the 151,936-row head of the old
    # script sampled ids past a 1,024-token tokenizer, which decode to nothing)
    assert tok.decode([len(tok) - 1]) != ""


def test_recipe_runs_the_reference_recipe_gpu_sized(monkeypatch, tmp_path):
    """--recipe MODEL is one command for the reference results on a GPU (larger budget)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_learners
        import reference_results
        import torch

        seen = []
        monkeypatch.setattr(reference_results, "main", lambda argv: seen.append(argv) or 0)
        if not torch.cuda.is_available():
            assert gpu_learners.main(["--recipe", "m", "--out", str(tmp_path)]) == 2
            monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert gpu_learners.main(["--recipe", "/models/qwen", "--out", str(tmp_path)]) == 0
    finally:
        sys.path.remove(str(SCRIPT.parent))
    (argv,) = seen
    opts = dict(zip(argv[::2], argv[1::2], strict=True))
    assert opts["--model"] == "/models/qwen" and opts["--device"] == "cuda"
    assert int(opts["--budget"]) > 240 and opts["--prompts"] == "8"
    assert opts["--runs"] == str(tmp_path / "recipe_runs")
    assert opts["--out"] == str(tmp_path / "recipe")
    # the argv parses as the recipe's own options
    cmd = [sys.executable, str(SCRIPT.parent / "reference_results.py"), *argv, "--dry-run"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--device cuda" in out.stdout and "max_env_steps=2400" in out.stdout
