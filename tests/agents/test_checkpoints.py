"""Checkpoints verify: damage and divergence are refused by name, stops and crashes keep the run."""

import json
import os
import signal

import pytest
import torch

from branchgym.agents.train import train
from branchgym.agents.training import run as training
from branchgym.agents.training.checkpoints import truncate_metrics, write_atomically
from branchgym.error import CheckpointError

ENV_KWARGS = {"depth": 3, "n_actions": 3, "reward_kind": "bernoulli", "structure_seed": 2}
SFT = {
    "env_kwargs": ENV_KWARGS,
    "episodes": 2,
    "batch_episodes": 2,
    "threads": 1,
    "progress": False,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    result = train("sft", out_dir=str(out / "s"), steps=1, **SFT)
    return result.checkpoint


def copy_of(checkpoint, tmp_path):
    import shutil

    dest = tmp_path / checkpoint.name
    shutil.copytree(checkpoint, dest)
    return dest


def test_a_checkpoint_records_a_digest_per_file(checkpoint):
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["version"] == 2
    assert {"model.safetensors", "optimizer.safetensors"} <= set(state["files"])
    assert not list(checkpoint.parent.glob("*.partial")) + list(checkpoint.parent.glob("*.old"))


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda c: (c / "model.safetensors").write_bytes(
            (c / "model.safetensors").read_bytes()[:1000]), "model.safetensors changed"),
        (lambda c: (c / "optimizer.safetensors").unlink(), "optimizer.safetensors is missing"),
        (lambda c: (c / "model.safetensors").write_bytes(
            (c / "optimizer.safetensors").read_bytes()), "model.safetensors changed"),
    ],
    ids=["truncated", "missing", "overwritten"],
)  # fmt: skip
def test_damaged_files_are_refused_with_the_file_and_the_fix(checkpoint, tmp_path, damage, match):
    bad = copy_of(checkpoint, tmp_path)
    damage(bad)
    with pytest.raises(CheckpointError, match=match) as exc:
        train("sft", resume=str(bad), out_dir=str(tmp_path / "r"), steps=2, **SFT)
    assert "earlier checkpoint" in str(exc.value)


def test_non_finite_weights_are_never_saved_nor_resumed(checkpoint, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    from branchgym.agents.training.checkpoints import file_digests

    # A checkpoint whose optimizer state holds NaN (digests recomputed: not "damage").
    bad = copy_of(checkpoint, tmp_path)
    tensors = load_file(str(bad / "optimizer.safetensors"))
    name = next(iter(tensors))
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(bad / "optimizer.safetensors"))
    state = json.loads((bad / "trainer_state.json").read_text())
    state["files"] = file_digests(bad)
    (bad / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match="holds NaN or infinity"):
        train("sft", resume=str(bad), out_dir=str(tmp_path / "r"), steps=2, **SFT)
    # A run that diverges: its end-of-run checkpoint is refused, nothing is written.
    real_save = training.Run.save

    def poison_then_save(self, folder=None):
        with torch.no_grad():
            next(self.model.parameters()).fill_(float("inf"))
        return real_save(self, folder)

    monkeypatch.setattr(training.Run, "save", poison_then_save)
    with pytest.raises(CheckpointError, match="cannot save step 1: .* holds NaN or infinity"):
        train("sft", out_dir=str(tmp_path / "d"), steps=1, **SFT)
    assert not list((tmp_path / "d").glob("checkpoint-*"))


def test_sigterm_stops_at_a_step_boundary_with_a_checkpoint_and_resume_continues(
    tmp_path, monkeypatch
):
    out = tmp_path / "run"
    real = training.Run.log_line

    def log_then_signal(self, line):
        real(self, line)
        if line.get("step") == 1 and "charts/lr" in line:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler or Ctrl-C would

    monkeypatch.setattr(training.Run, "log_line", log_then_signal)
    with pytest.raises(KeyboardInterrupt, match="SIGTERM: stopped after step 1"):
        train("sft", out_dir=str(out), steps=3, **SFT)
    assert (out / "checkpoint-000001").is_dir()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers put back
    monkeypatch.setattr(training.Run, "log_line", real)
    # Lines of a step the stopped run logged past its checkpoint would be written again.
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 2, "charts/lr": 0.0}) + "\n" + '{"step": 3, "cut')
    train("sft", out_dir=str(out), steps=3, resume=str(out / "checkpoint-000001"), **SFT)
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    lr_steps = [
        json.loads(x)["step"]
        for x in (out / "metrics.jsonl").read_text().splitlines()
        if "charts/lr" in json.loads(x)
    ]
    assert lr_steps == [1, 2, 3], steps  # every step once, in order


def test_an_exception_mid_run_leaves_a_crash_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "run"
    real = training.Run.log_line

    def fail_at_two(self, line):
        if line.get("step") == 2 and "charts/lr" in line:
            raise RuntimeError("a sandbox fell over")
        real(self, line)

    monkeypatch.setattr(training.Run, "log_line", fail_at_two)
    with pytest.raises(RuntimeError, match="fell over"):
        train("sft", out_dir=str(out), steps=3, **SFT)
    crash = out / "checkpoint-000002-crash"
    assert crash.is_dir() and (crash / "trainer_state.json").is_file()


def test_the_swap_keeps_a_whole_checkpoint_and_metrics_truncate(tmp_path):
    out = tmp_path / "checkpoint-000001"
    for version in ("first", "second"):
        tmp = tmp_path / "checkpoint-000001.partial"
        tmp.mkdir()
        (tmp / "f").write_text(version)
        write_atomically(tmp, out)
    assert (out / "f").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000001"]
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n{"step": 3\n')
    assert truncate_metrics(log, 1) == [{"step": 1}]
    assert log.read_text() == '{"step": 1}\n'


@pytest.mark.parametrize(
    ("opts", "match"),
    [
        ({"lr": float("inf")}, "lr must be a finite number > 0"),
        ({"lr": float("nan")}, "lr must be a finite number > 0"),
        ({"timeout": 0}, "timeout must be a finite number > 0"),
        ({"seed": -1}, "seed must be an integer >= 0"),
        ({"max_episode_steps": -1}, "max_episode_steps must be an integer >= 1"),
        ({"steps": 0}, "steps must be an integer >= 1"),
        ({"env_kwargs": {"depht": 3}}, "do not fit branchgym/TextTreeMDP-v0.*depht"),
        ({"env_kwargs": {"depth": "three"}}, "do not fit"),
    ],
)
def test_bad_training_options_are_refused_before_anything_runs(tmp_path, opts, match):
    from branchgym.error import TrainingConfigError

    kw = {**SFT, "out_dir": str(tmp_path / "r"), "steps": 1, **opts}
    with pytest.raises(TrainingConfigError, match=match):
        train("sft", **kw)


def test_an_out_dir_that_is_a_file_is_refused(tmp_path):
    from branchgym.error import TrainingConfigError

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(TrainingConfigError, match="not a writable folder"):
        train("sft", out_dir=str(blocker / "run"), steps=1, **SFT)
