"""scripts/reference_results.py: the reference recipe end to end on the tiny model, resumable."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def recipe_module():
    """scripts/reference_results.py as a module (it is a script, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "reference_results", SCRIPTS / "reference_results.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def recipe(tmp_path, *extra):
    cmd = [sys.executable, str(SCRIPTS / "reference_results.py"), "--model", "tiny",
           "--device", "cpu", "--budget", "60", "--prompts", "1", "--seeds", "0",
           "--learners", "grpo", "bpo_rec", "--jobs", "1", "--sft-steps", "2", "--tasks", "12",
           "--runs",
           str(tmp_path / "runs"), "--out", str(tmp_path / "out"), *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1500, check=False)


@pytest.mark.slow
def test_the_recipe_runs_every_stage_ships_small_files_and_resumes(tmp_path):
    proc = recipe(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    for name in ("expert", "random", "zero-shot", "sft", "grpo-s0", "bpo_rec-s0"):
        summary = json.loads((out / "eval" / name / "summary.json").read_text())
        assert summary["complete"] and summary["counts"]["episodes"] == 12, name
        assert summary["protocol"]["name"] == "webshop-small"
        assert not (out / "eval" / name / "trees").exists()  # small files only
    for name in ("grpo-s0", "bpo_rec-s0"):
        lines = [json.loads(x) for x in (out / "train" / name / "metrics.jsonl").open()]
        spent = sum(x.get("env/steps", 0) for x in lines)
        assert 60 <= spent < 130, (name, spent)  # stopped at the step that reached it
        args = json.loads((out / "train" / name / "args.json").read_text())
        assert args["model"].endswith("checkpoint-000002") and args["policy"] == "scoring"
    assert not list(out.rglob("*.safetensors"))
    compared = json.loads((out / "compare" / "bpo_rec-s0_vs_grpo-s0.json").read_text())
    assert compared["shared_tasks"] == 12
    table = (out / "README.md").read_text()
    assert "| Branching PO (recommended, unbiased) | 0 |" in table and "McNemar" in table
    assert (out / "curves.png").stat().st_size > 10_000
    # the learning curves' intermediate points: each run's kept checkpoint before its last
    for name in ("grpo-s0", "bpo_rec-s0"):
        final = max(int(p.name[-6:]) for p in (tmp_path / "runs" / name).glob("checkpoint-*"))
        point = json.loads((out / "eval" / f"{name}@{final - 1}" / "summary.json").read_text())
        assert point["complete"] and point["counts"]["episodes"] == 12, name
        assert f"| {name}@{final - 1} | {final - 1} |" in table
    # another machine (no runs folder, the shipped results only): the warm start and the
    # learners train again, deterministically, so every shipped evaluation still holds and
    # none is run again; the timings of both sittings add up
    shutil.rmtree(tmp_path / "runs")
    proc = recipe(tmp_path, "--stages", "sft", "train", "eval", "report")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = [x for x in proc.stdout.splitlines() if x.startswith("$ ")]
    assert len(ran) == 3 and not [x for x in ran if " eval " in x], ran
    assert (tmp_path / "runs" / "eval" / "sft" / "summary.json").exists()
    logs = [json.loads(x)["log"] for x in (out / "timings.jsonl").read_text().splitlines()]
    assert logs.count("sft") == 2 and logs.count("eval-sft") == 1, logs
    # a second call finds every stage done: a lost local eval is found in the shipped
    # results; lost from both, it is run again, and nothing else
    shutil.rmtree(tmp_path / "runs" / "eval" / "grpo-s0")
    again = recipe(tmp_path, "--dry-run")
    assert not [x for x in again.stdout.splitlines() if x.startswith("$ ")], again.stdout
    shutil.rmtree(out / "eval" / "grpo-s0")
    again = recipe(tmp_path, "--dry-run")
    ran = [x for x in again.stdout.splitlines() if x.startswith("$ ")]
    assert len(ran) == 1 and "eval/grpo-s0" in ran[0], ran
    # a learner run stopped after its first checkpoint resumes from it
    ckpts = sorted((tmp_path / "runs" / "bpo_rec-s0").glob("checkpoint-*"))
    assert len(ckpts) >= 2, ckpts
    for p in ckpts[1:]:
        shutil.rmtree(p)
    ran = [x for x in recipe(tmp_path, "--dry-run").stdout.splitlines() if x.startswith("$ ")]
    resumed = [x for x in ran if "bpo_rec-s0" in x and " train " in x]
    assert len(resumed) == 1 and f"--resume {ckpts[0]}" in resumed[0], ran


def test_every_learner_of_the_recipe_accepts_its_options():
    """Each learner's options build its Args (the RLOO entry once asked GRPO for rloo)."""
    from branchgym.agents.train import make_args

    mod = recipe_module()
    assert set(mod.LEARNERS) == {"grpo", "rloo", "bpo_rec", "bellman_po"}
    for name, conf in mod.LEARNERS.items():
        options = {k: str(v) for k, v in {**mod.COMMON["set"], **conf["set"]}.items()}
        args = make_args(conf["algo"], **options)
        assert args.micro_batch_tokens == 2048, name
    assert make_args("rloo", n="8").advantage == "rloo"


def test_results_of_a_run_still_training_do_not_replace_the_shipped_ones(tmp_path):
    """The report copies a learner run's files only once it finished: a retrain under way
    (its checkpoint short of the budget) had emptied a shipped run's metrics."""
    import argparse

    mod = recipe_module()
    runs, out = tmp_path / "runs", tmp_path / "out"
    recipe = mod.Recipe(argparse.Namespace(runs=str(runs), out=str(out), sft_steps=8))
    shipped = out / "train" / "bellman_po-s0" / "metrics.jsonl"
    shipped.parent.mkdir(parents=True)
    shipped.write_text(
        "".join(json.dumps({"step": i, "env/steps": 70}) + "\n" for i in (1, 2, 3, 4))
    )
    run = runs / "bellman_po-s0"
    (run / "checkpoint-000001").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "env/steps": 64}) + "\n")

    def state(env_steps):
        (run / "checkpoint-000001" / "trainer_state.json").write_text(json.dumps(
            {"step": 1, "env_steps": env_steps, "args": {"steps": 100, "max_env_steps": 240}}
        ))  # fmt: skip

    state(64)  # under way
    before = shipped.read_text()
    mod.copy_results(recipe)
    assert shipped.read_text() == before
    state(250)  # finished, and not a retrace of the shipped run: its files replace them
    mod.copy_results(recipe)
    assert shipped.read_text() == (run / "metrics.jsonl").read_text()


def test_a_retrain_uses_the_shipped_runs_thread_count_and_a_resume_its_own(tmp_path):
    """bfloat16 sums depend on the thread count: a retrain on another count is another run."""
    import argparse

    mod = recipe_module()
    runs, out = tmp_path / "runs", tmp_path / "out"
    args = argparse.Namespace(runs=str(runs), out=str(out), sft_steps=8, threads=2, jobs=1,
                              device="cpu", budget=240, max_steps=100, prompts=2)  # fmt: skip
    recipe = mod.Recipe(args)

    def threads(cmd):
        return [x for x in cmd if x.startswith("threads=")]

    assert threads(recipe.learner_command("grpo", 0)) == ["threads=2"]  # nothing shipped
    (out / "train" / "grpo-s0").mkdir(parents=True)
    (out / "train" / "grpo-s0" / "args.json").write_text(json.dumps({"threads": 1}))
    assert threads(recipe.learner_command("grpo", 0)) == ["threads=1"]  # a retrain
    (runs / "grpo-s0" / "checkpoint-000001").mkdir(parents=True)
    (runs / "grpo-s0" / "args.json").write_text(json.dumps({"threads": 2}))
    assert threads(recipe.learner_command("grpo", 0)) == ["threads=2"]  # resumes as it began
    assert not [x for x in recipe.learner_command("grpo", 0) if "keep_checkpoint_every" in x]
    args.curve_every = 3  # more learning-curve points: every third step's checkpoint stays
    assert "keep_checkpoint_every=3" in recipe.learner_command("grpo", 0)


def test_the_curve_stage_scores_kept_checkpoints_of_finished_runs_and_the_report_plots_them(
    tmp_path,
):
    """Stage ``curve`` evaluates the checkpoints a finished run kept besides its final one;
    the report places each at the env steps and learner tokens spent to reach it."""
    import argparse

    mod = recipe_module()
    runs, out = tmp_path / "runs", tmp_path / "out"
    recipe = mod.Recipe(argparse.Namespace(runs=str(runs), out=str(out), sft_steps=8))

    def checkpoint(name, step, env_steps):
        ckpt = runs / name / f"checkpoint-{step:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text(json.dumps(
            {"step": step, "env_steps": env_steps, "args": {"steps": 100, "max_env_steps": 240}}
        ))  # fmt: skip
        return ckpt

    third = checkpoint("grpo-s0", 3, 180)
    checkpoint("grpo-s0", 4, 240)  # finished: its final checkpoint is stage eval's
    checkpoint("bpo_rec-s0", 1, 50)
    checkpoint("bpo_rec-s0", 2, 100)  # still training: no curve points yet
    crash = runs / "grpo-s0" / "checkpoint-000002-crash"  # not a complete checkpoint
    crash.mkdir()
    (crash / "trainer_state.json").write_text("{}")
    assert recipe.curve_checkpoints("grpo-s0") == [third]
    assert recipe.curve_checkpoints("bpo_rec-s0") == []
    assert recipe.curve_checkpoints("rloo-s0") == []  # never run

    sys.path.insert(0, str(SCRIPTS))
    try:
        from reference_report import curve_points, write_report
    finally:
        sys.path.remove(str(SCRIPTS))
    train = out / "train" / "grpo-s0"
    train.mkdir(parents=True)
    train.joinpath("metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "env/steps": 60, "tokens/learner": 1000 * i,
                    "charts/return": 0.5}) + "\n" for i in (1, 2, 3, 4)
    ))  # fmt: skip

    def scored(name, success):
        folder = out / "eval" / name
        folder.mkdir(parents=True)
        m = {"mean": success, "low": success - 0.05, "high": success + 0.05}
        score = {k: 100 * v for k, v in m.items()}  # WebShop's score is reported x100
        folder.joinpath("summary.json").write_text(
            json.dumps({"metrics": {"score": score, "success": m}})
        )

    scored("grpo-s0@3", 0.25)
    scored("grpo-s0", 0.3)
    points = curve_points(out, "grpo-s0")
    assert [(p["step"], p["env_steps"], p["learner_tokens"]) for p in points] == [
        (3, 180, 6000),  # 1000 + 2000 + 3000 tokens
        (4, 240, 10000),
    ]
    assert [p["success"]["mean"] for p in points] == [0.25, 0.3]
    write_report(runs, out, learners=["grpo"], seeds=[0])  # (no SFT row: nothing to pair)
    table = (out / "README.md").read_text()
    assert "| grpo-s0@3 | 3 | 180 | 6000 | 25.0 [20.0, 30.0] | 0.250 [0.200, 0.300] |" in table
    assert (out / "curves.png").stat().st_size > 10_000
