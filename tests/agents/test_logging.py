"""``--log jsonl,tensorboard,wandb``: one run's metrics read back with each tool's own reader.

TensorBoard's EventAccumulator reads the event files; the W&B offline run's records are
read from its ``run-*.wandb`` file with W&B's own protobuf messages (the file is W&B's
LevelDB-style record log). No network: W&B runs offline.
"""

import builtins
import glob
import json
import struct

import pytest

pytest.importorskip("torch")
pytest.importorskip("tensorboard")
pytest.importorskip("wandb")

from branchgym.agents.training import sinks  # noqa: E402
from branchgym.cli import main as cli_main  # noqa: E402
from branchgym.error import DependencyMissingError, TrainingConfigError  # noqa: E402

ENV_KWARGS = {"depth": 3, "n_actions": 3, "reward_kind": "bernoulli", "structure_seed": 2}
TREE_KEYS = (
    "branching/tokens_saved",
    "branching/branch_points",
    "branching/degenerate_points",
    "branching/snapshot_ms",
    "branching/restore_ms",
)


def wandb_records(path):
    """Every record of a ``.wandb`` file (header, then 32 KiB blocks of chunked records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, records, parts = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too short for a header: the block's padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        parts += data[pos : pos + length]
        pos += length
        if kind in (1, 4):  # FULL, LAST
            r = pb.Record()
            r.ParseFromString(parts)
            records.append(r)
            parts = b""
        elif kind == 0:
            break
    return records


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory, monkeypatch_module):
    out = tmp_path_factory.mktemp("logged") / "run"
    monkeypatch_module.delenv("WANDB_MODE", raising=False)  # unset: offline
    monkeypatch_module.setenv("WANDB_SILENT", "true")
    code = cli_main(
        [
            "train",
            "--algo",
            "bpo",
            "--env-kwargs",
            json.dumps(ENV_KWARGS),
            "--model",
            "tiny",
            "--steps",
            "2",
            "--prompts",
            "1",
            "--lr",
            "1e-4",
            "--out",
            str(out),
            "--no-progress",
            "--log",
            "jsonl,tensorboard,wandb",
            "--set",
            "m=1",
            "k=2",
            "gap_unit=steps",
            "min_gap=1",
            "threads=1",
            "beta=0",
        ]
    )
    assert code == 0
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def jsonl_lines(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_tensorboard_event_files_hold_every_logged_key(run_folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lines = jsonl_lines(run_folder)
    acc = EventAccumulator(str(run_folder / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for key in ("losses/policy_loss", "charts/return", *TREE_KEYS):
        assert key in tags, key
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        want = [(x["step"], x[key]) for x in lines if key in x]
        assert [s for s, _ in got] == [s for s, _ in want] == [1, 2]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)
    # the options: a text table and the hparams plugin's session start
    assert "hparams/text_summary" in acc.Tags()["tensors"]
    table = acc.Tensors("hparams/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| lr | 0.0001 |" in table and "| algo | bpo |" in table
    plugins = acc.PluginTagToContent("hparams")
    from tensorboard.plugins.hparams import plugin_data_pb2

    start = plugin_data_pb2.HParamsPluginData.FromString(plugins["_hparams_/session_start_info"])
    hp = start.session_start_info.hparams
    assert hp["algo"].string_value == "bpo" and hp["k"].number_value == 2


@pytest.mark.slow
def test_wandb_offline_run_folder_holds_history_and_config(run_folder):
    runs = glob.glob(str(run_folder / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, "one offline W&B run in the run folder"
    records = wandb_records(runs[0])
    history = []
    config = {}
    for r in records:
        kind = r.WhichOneof("record_type")
        if kind == "history":
            history.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            )
        elif kind == "run":
            config.update(
                {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in r.run.config.update
                }
            )
            assert r.run.project == "branchgym"
        elif kind == "config":
            config.update(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.config.update}
            )
    lines = [x for x in jsonl_lines(run_folder) if "charts/return" in x]
    steps = [h["_step"] for h in history if "charts/return" in h]
    assert steps == [1, 2]
    for h, line in zip([h for h in history if "charts/return" in h], lines, strict=True):
        for key in ("losses/policy_loss", "charts/return", *TREE_KEYS):
            assert h[key] == pytest.approx(line[key], rel=1e-6), key
    value = {
        k: v["value"] if isinstance(v, dict) and "value" in v else v for k, v in config.items()
    }
    assert (
        value["algo"] == "bpo"
        and value["lr"] == 1e-4
        and value["log"] == ["jsonl", "tensorboard", "wandb"]
    )


def test_missing_packages_are_typed_errors_naming_the_extra(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def without(prefix):
        def fake(name, *args, **kwargs):
            if name.startswith(prefix):
                raise ImportError(f"No module named {name!r}")
            return real_import(name, *args, **kwargs)

        return fake

    for sink, module in (("wandb", "wandb"), ("tensorboard", "torch.utils.tensorboard")):
        monkeypatch.setattr(builtins, "__import__", without(module))
        with pytest.raises(DependencyMissingError, match=r"branchgym\[logging\]"):
            sinks.open_sinks([sink], tmp_path, {}, name="x")
        monkeypatch.setattr(builtins, "__import__", real_import)


def test_unknown_sink_names_are_refused(tmp_path):
    from branchgym.agents.train import make_args

    with pytest.raises(TrainingConfigError, match="tensorboard"):
        make_args("bpo", log="jsonl,tensorbord")
    assert make_args("bpo", log="jsonl,wandb").log == ("jsonl", "wandb")
    with pytest.raises(TrainingConfigError, match="log"):
        sinks.open_sinks(["csv"], tmp_path, {}, name="x")


def test_bench_log_reaches_the_runs_studies_train(tmp_path):
    import argparse

    from branchgym.bench.runs import CI_MAZE, run_learner, training_options
    from branchgym.cli import configure_bench

    parser = argparse.ArgumentParser()
    configure_bench(parser)
    assert parser.parse_args(["learning", "--log", "tensorboard"])._train_log == "tensorboard"
    with training_options(log="jsonl,tensorboard"):
        result = run_learner(
            "grpo",
            0,
            tmp_path,
            env_kwargs=CI_MAZE,
            steps=1,
            prompts_per_step=1,
            n=2,
            threads=1,
            model="tiny",
        )
    folder = tmp_path / "grpo-0"
    assert result.history and list((folder / "tensorboard").glob("events.out.tfevents.*"))
    # outside the context the option is gone again
    run_learner("grpo", 1, tmp_path, env_kwargs=CI_MAZE, steps=1, prompts_per_step=1, n=2)
    assert not (tmp_path / "grpo-1" / "tensorboard").exists()


def test_a_resumed_run_replaces_the_tensorboard_steps_after_its_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = sinks.TensorBoardSink(tmp_path, {"lr": 0.1})
    for step in (1, 2, 3):  # steps 2 and 3 were logged after the checkpoint at step 1
        first.write({"step": step, "charts/return": float(step)})
    first.close()
    resumed = sinks.TensorBoardSink(tmp_path, {"lr": 0.1}, start_step=1)
    resumed.write({"step": 2, "charts/return": 20.0})
    resumed.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("charts/return")] == [(1, 1.0), (2, 20.0)]
