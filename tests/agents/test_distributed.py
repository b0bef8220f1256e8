"""Data parallel training on gloo: two ranks equal one process, sharded checkpoints resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from branchgym.agents.training.distributed import (  # noqa: E402
    DataParallel,
    data_parallel,
    reduce_metrics,
)
from branchgym.error import CheckpointError, TrainingConfigError  # noqa: E402

WORKER = Path(__file__).with_name("dist_worker.py")


def test_shares_cover_every_prompt_once():
    for n in (2, 5, 7, 128):
        for world in (1, 2, 3):
            shares = [DataParallel(r, world).share(n) for r in range(world)]
            assert [i for s in shares for i in s] == list(range(n))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_one_process_is_not_distributed(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dp = data_parallel("auto", "cpu")
    assert (dp.rank, dp.world, dp.active) == (0, 1, False)
    assert reduce_metrics(dp, {"a": 1.0}) == {"a": 1.0}
    assert dp.all_sum([1.5, 2.0]) == [1.5, 2.0]
    with pytest.raises(TrainingConfigError, match="torchrun"):
        data_parallel("ddp", "cpu")


def test_distributed_option_is_checked():
    from branchgym.agents.training.run import TrainArgs

    with pytest.raises(TrainingConfigError, match="distributed"):
        TrainArgs(distributed="fsdp").check()


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _dcp_model(folder: Path, tmp: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{folder.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(str(folder), str(out))
    return torch.load(out)


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process_and_resume_from_shards(tmp_path):
    from safetensors.torch import load_file

    from branchgym.agents.policies.models import save_tiny_qwen2
    from branchgym.agents.train import train

    model = str(save_tiny_qwen2(tmp_path / "tiny"))  # one tokenizer build, not one per rank
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    done = subprocess.run(
        [*cmd, "2", str(WORKER), str(tmp_path), model],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]

    sys.path.insert(0, str(WORKER.parent))
    try:
        from dist_worker import OPTIONS
    finally:
        sys.path.remove(str(WORKER.parent))
    single = tmp_path / "single"
    train("grpo", **OPTIONS, model=model, distributed="off", out_dir=str(single))

    # the same batch, the same loss and gradient, step by step
    one, two = _lines(single / "metrics.jsonl"), _lines(tmp_path / "full" / "metrics.jsonl")
    assert [x["step"] for x in one] == [x["step"] for x in two] == [1, 2]
    for a, b in zip(one, two, strict=True):
        assert b["groups/total"] == a["groups/total"] == 2
        assert b["tokens/generated"] == a["tokens/generated"] > 0
        assert b["charts/return"] == pytest.approx(a["charts/return"], abs=1e-9)
        for key in ("losses/loss", "losses/kl", "grad/norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert two[0]["grad/norm"] > 0

    # the same updated weights
    ref = load_file(str(single / "checkpoint-000002" / "model.safetensors"))
    full = _dcp_model(tmp_path / "full" / "checkpoint-000002", tmp_path)
    start = load_file(str(single / "checkpoint-000001" / "model.safetensors"))
    moved = max(float((ref[k] - start[k]).abs().max()) for k in ref)
    assert moved > 1e-4  # the second update changed the weights
    for k, v in ref.items():
        torch.testing.assert_close(full["model"][k], v, rtol=1e-4, atol=1e-5)
    assert set(full) == {"model", "optim", "ref"}  # every rank's shards, KL reference too
    assert sorted(p.name for p in (tmp_path / "full" / "checkpoint-000002").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]

    # resuming the shards of step 1 continues exactly: same step-2 weights, same metrics
    resumed = _dcp_model(tmp_path / "resumed" / "checkpoint-000002", tmp_path)
    for part in ("model", "ref"):
        for k, v in full[part].items():
            assert torch.equal(resumed[part][k], v), (part, k)
    (again,) = _lines(tmp_path / "resumed" / "metrics.jsonl")
    def untimed(line):
        timing = ("tokens/per_second", "env/step_ms")
        return {k: v for k, v in line.items() if not k.startswith("time/") and k not in timing}

    assert untimed(again) == untimed(two[1])


def test_sharded_checkpoint_needs_its_world_size(tmp_path):
    from branchgym.agents.training.run import Run, TrainArgs

    ck = tmp_path / "checkpoint-000001"
    ck.mkdir()
    state = {"version": 2, "algo": "grpo", "step": 1, "sharded": True, "world_size": 2}
    (ck / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match="nproc-per-node 2"):
        Run(TrainArgs(resume=str(ck), out_dir=str(tmp_path / "run")), "grpo")


def test_data_parallel_refuses_what_it_cannot_do(tmp_path, monkeypatch):
    import branchgym.agents.training.setup as setup_module
    from branchgym.agents.training.run import Run, TrainArgs

    monkeypatch.setattr(setup_module, "data_parallel", lambda *a: DataParallel(0, 2))
    with pytest.raises(TrainingConfigError, match="precision=auto"):
        Run(TrainArgs(precision="bf16", out_dir=str(tmp_path)), "grpo")
    with pytest.raises(TrainingConfigError, match="one prompt per rank"):
        Run(TrainArgs(prompts_per_step=1, out_dir=str(tmp_path)), "grpo")
