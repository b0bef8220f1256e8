#!/usr/bin/env python
"""The reference results: SmolLM2-135M-Instruct on WebShop, warm-started, then each learner.

One command runs the whole recipe (docs/results.md, Reference results), stage by stage, and
picks up where it stopped: a stage whose result exists is skipped, a training run cut off
mid-way is resumed from its latest checkpoint (``branchgym train --resume``), an
evaluation cut off mid-way is finished (``branchgym eval --resume``)::

    python scripts/reference_results.py                  # everything, 2 jobs at a time
    python scripts/reference_results.py --seeds 0 1 --learners grpo bpo_rec
    python scripts/reference_results.py --dry-run        # print the commands only

Stages, each a ``branchgym`` command (printed before it runs):

1. ``sft``: supervised warm start on the scripted shopper's episodes of the ``train``
   goals, through the scoring policy (a cross-entropy over the admissible actions);
2. ``train``: each learner (:data:`LEARNERS`) from the SFT checkpoint, per seed, until
   the same env-step budget (``max_env_steps``), metrics to JSONL and TensorBoard;
3. ``eval``: ``branchgym eval`` on the ``webshop-small`` protocol (the first 200 ``test``
   goals, none of them trained on) of the zero-shot model, the SFT model and every
   learner's final checkpoint;
4. ``curve``: ``branchgym eval`` of every learner checkpoint kept besides the final one
   (``keep_checkpoints``: the last two, so one a run; ``--curve-every N`` keeps every
   N-th step's too, at 2.4 GB of disk each for SmolLM2), named
   ``<run>@<step>``: the held-out points of the learning curves between the SFT model
   (step 0) and the final checkpoint;
5. ``report``: the paired comparisons (``branchgym eval compare``: each learner against
   SFT, Branching PO against GRPO), learning curves (training return, and held-out
   success at the evaluated checkpoints, against env steps and learner tokens) and the
   table, copied with the small result files (metrics, eval episodes and summaries; no
   weights) to ``--out``, which the repository ships so that ``eval compare`` can put a
   user's agent beside them.

``--model`` and ``--device`` run the same recipe on another model folder or a GPU
(``scripts/gpu_learners.py --recipe`` does that with the GPU-sized defaults).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from branchgym.agents.training.checkpoints import (
    checkpoint_step,
    complete_checkpoints,
    latest_checkpoint,
)

ENV_ID = "branchgym/WebShop-v0"
#: The training env: WebShop's train goals, the protocol's 6-step cap.
ENV_KWARGS = {"max_steps": 6}
PROTOCOL = "webshop-small"

#: The warm start: 96 expert episodes of train goals, 8 per update, 8 updates (2/3 of an
#: epoch: the loss had fallen from 0.41 to under 0.2 by update 3).
SFT = {
    "steps": 8,
    "lr": 5e-5,
    "set": {"episodes": 96, "batch_episodes": 8},
}

#: Each learner's options (besides the shared ones in :func:`learner_command`). Rollout
#: shapes differ; the env-step budget (``--budget``) matches them.
LEARNERS: dict[str, dict[str, Any]] = {
    "grpo": {"algo": "grpo", "set": {"n": 8}},
    "rloo": {"algo": "rloo", "set": {"n": 8}},
    # the project's recommended unbiased Branching PO (docs/estimators.md): fixed branch
    # depth (the results page, where the product is chosen), value_diff credit, per-depth
    # weights; 2 backbones x 4 siblings = 8 lines per prompt
    "bpo_rec": {
        "algo": "bpo",
        "set": {
            "schedule": "depths",
            "branch_depths": "1",
            "m": 1,
            "k": 4,
            "backbones": 2,
            "credit": "value_diff",
            "depth_weight": True,
            "depth_count": "backbone",
            "gap_unit": "steps",
        },
    },
    "bellman_po": {"algo": "bellman_po", "set": {"g": 8}},
}

#: Shared options of every learner run.
COMMON = {
    "lr": 1e-5,
    "prompts": 2,
    "set": {
        "lr_schedule": "constant",
        "micro_batch_tokens": 2048,
        "checkpoint_every": 1,
        # the newest two (about 2.4 GB each): every step's would fill the disk
        "keep_checkpoints": 2,
        # bfloat16 weights and gradients, float32 master weights and AdamW state: the
        # forward is 1.7x faster in bfloat16 on an AVX512-BF16 CPU
        "precision": "bf16",
    },
}


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _sets(options: dict[str, Any]) -> list[str]:
    return [f"{k}={_fmt(v)}" for k, v in options.items()]


class Recipe:
    """The stages' commands for one configuration (paths, model, device, budget)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.runs = Path(args.runs)
        self.out = Path(args.out)
        self.bg = [sys.executable, "-m", "branchgym.cli"]

    def train_command(self, fixed: list[str], options: dict[str, Any], out: Path) -> list[str]:
        """``branchgym train`` with ``fixed`` arguments and one ``--set`` of ``options``.

        A run folder with a checkpoint resumes from its latest one; a run folder without
        one (stopped before its first checkpoint) starts again.
        """
        cmd = [*self.bg, "train", "--env", ENV_ID, "--env-kwargs", json.dumps(ENV_KWARGS),
               "--policy", "scoring", "--device", self.a.device, "--log", "jsonl,tensorboard",
               "--no-progress", *fixed, "--out", str(out)]  # fmt: skip
        ckpt = latest_checkpoint(out)
        if ckpt is not None:
            cmd += ["--resume", str(ckpt)]
        elif out.exists():
            options = {**options, "overwrite": True}
        return [*cmd, "--set", *_sets(options)]

    def sft_command(self) -> list[str]:
        """The warm start (:data:`SFT`) of ``--model``."""
        threads = self.run_threads("sft") or self.a.threads * self.a.jobs
        options = {"threads": threads, "micro_batch_tokens": 2048,
                   **SFT["set"], "checkpoint_every": self.a.sft_steps}  # fmt: skip
        fixed = ["--algo", "sft", "--model", self.a.model, "--steps", str(self.a.sft_steps),
                 "--lr", str(SFT["lr"]), "--seed", "0"]  # fmt: skip
        return self.train_command(fixed, options, self.runs / "sft")

    def run_threads(self, name: str) -> int | None:
        """The thread count that run ``name`` must use (None: ``--threads`` decides).

        Its own when it resumes, else the shipped run's of that name (a retrain). In
        bfloat16 the order of a matrix product's sums depends on the thread count, so only
        a retrain at the same count retraces the shipped run (and keeps its
        evaluation): Bellman PO s0 retrained on 2 threads, shipped from 1, sampled other
        replies from its first step. A resumed run keeps the count it started with.
        """
        local = self.runs / name
        for folder in ((local,) if latest_checkpoint(local) else ()) + (self.out / "train" / name,):
            path = folder / "args.json"
            if path.exists():
                threads = json.loads(path.read_text()).get("threads")
                return int(threads) if threads else None
        return None

    def sft_model(self) -> Path:
        """The SFT run's final checkpoint: every learner starts from it."""
        return self.runs / "sft" / f"checkpoint-{self.a.sft_steps:06d}"

    def learner_command(self, name: str, seed: int) -> list[str]:
        """Learner ``name`` (:data:`LEARNERS`) from the SFT model, to the env-step budget."""
        spec = LEARNERS[name]
        threads = self.run_threads(f"{name}-s{seed}") or self.a.threads
        options = {"threads": threads, **COMMON["set"], **spec["set"],
                   "max_env_steps": self.a.budget}  # fmt: skip
        if getattr(self.a, "curve_every", 0):  # more learning-curve points (stage curve)
            options["keep_checkpoint_every"] = self.a.curve_every
        fixed = ["--algo", spec["algo"], "--model", str(self.sft_model()),
                 "--steps", str(self.a.max_steps), "--prompts", str(self.a.prompts),
                 "--lr", str(COMMON["lr"]), "--seed", str(seed)]  # fmt: skip
        return self.train_command(fixed, options, self.runs / f"{name}-s{seed}")

    def eval_command(self, name: str, agent: str) -> list[str]:
        """``branchgym eval`` of ``agent`` on the protocol (finished if it was cut off)."""
        out = self.runs / "eval" / name
        cmd = [*self.bg, "eval", ENV_ID, "--protocol", PROTOCOL, "--agent", agent,
               "--no-progress", "--out", str(out)]  # fmt: skip
        if self.a.tasks:  # a deviation (tests, a quick look): the report says so
            cmd += ["--tasks", str(self.a.tasks)]
        if agent not in ("expert", "random"):  # a model: the scoring policy, in --eval-dtype
            cmd += ["--policy", "scoring", "--dtype", self.a.eval_dtype,
                    "--threads", str(self.a.threads)]  # fmt: skip
        if (out / "run.json").exists():
            cmd.append("--resume")
        return cmd

    # ------------------------------------------------------------------ done checks
    def train_done(self, out: Path) -> bool:
        """Whether a learner run reached its step cap or its env-step budget."""
        if out == self.runs / "sft":  # the warm start is done at its planned checkpoint
            return self.sft_model().is_dir()
        ckpt = latest_checkpoint(out)
        if ckpt is None:
            return False
        state = json.loads((ckpt / "trainer_state.json").read_text())
        args = state.get("args", {})
        budget = int(args.get("max_env_steps") or 0)
        return int(state["step"]) >= int(args.get("steps", 0)) or (
            budget > 0 and int(state.get("env_steps", 0)) >= budget
        )

    def eval_done(self, name: str, agent: str) -> bool:
        """Whether evaluation ``name`` finished every episode, here or in the shipped results.

        A shipped evaluation (``--out``, from an earlier sitting or machine) counts when it
        scored the same agent: a fixed agent (expert, random, the base model), or a model
        folder whose digest equals the shipped run's (a retrained SFT checkpoint counts
        only if its weights came out the same). A matching shipped evaluation is copied
        into ``--runs`` so the report and ``eval compare`` read it like a local one.
        """
        local = self.runs / "eval" / name
        if _complete(local):
            return True
        shipped = self.out / "eval" / name
        if not _complete(shipped):
            return False
        if agent not in ("expert", "random", self.a.model):  # a checkpoint of this recipe
            if not Path(agent).exists():  # not trained (again) yet: nothing to compare
                return False
            from branchgym.evaluation.agents import model_digest

            now = model_digest(agent)  # what eval would record, without loading the model
            then = json.loads((shipped / "run.json").read_text())["agent"]["config"].get("digest")
            if now != then and not self.same_training(Path(agent)):
                print(f"  {name}: the shipped evaluation scored another model ({then}, this "
                      f"one is {now}): evaluating again", flush=True)  # fmt: skip
                return False
        if not self.a.dry_run:
            if local.exists():  # an unfinished local run of the same agent: the shipped one wins
                shutil.rmtree(local)
            shutil.copytree(shipped, local)
        return True

    def same_training(self, agent: Path, rtol: float = 1e-4) -> bool:
        """Whether the run behind ``agent`` retraced the shipped run of the same name.

        A step's randomness derives from the seed and the step, so a rerun on another
        machine takes the same batches and the same samples; only the order of
        floating-point sums in the backward pass differs (the SmolLM2 warm start rerun on
        a new machine: the same first loss to all 16 digits, gradient norms equal to 7).
        A rerun whose every logged figure (losses, gradient norms, token and step counts)
        equals the shipped ``metrics.jsonl`` within ``rtol`` is taken as the same model;
        anything that changes what was trained (data, options, a code change that moves a
        loss) shows as a larger difference. Evaluations shipped before model digests
        hashed the weights recorded names and sizes only, so this is how they are matched.
        """
        import math

        run = agent if (agent / "metrics.jsonl").exists() else agent.parent
        shipped = self.out / "train" / run.name / "metrics.jsonl"
        if not (run / "metrics.jsonl").exists() or not shipped.exists():
            return False

        from branchgym.agents.training.saving import read_metrics

        def lines(path: Path) -> list[dict[str, Any]]:
            return [
                {k: v for k, v in d.items() if not k.startswith("time/")}
                for d in read_metrics(path)
            ]

        def close(a: Any, b: Any) -> bool:
            if isinstance(a, (int, float)) and isinstance(b, (int, float)):
                return math.isclose(a, b, rel_tol=rtol, abs_tol=1e-12)
            return a == b

        mine, theirs = lines(run / "metrics.jsonl"), lines(shipped)
        return (
            bool(mine)
            and len(mine) == len(theirs)
            and all(
                a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
                for a, b in zip(mine, theirs, strict=True)
            )
        )

    def curve_checkpoints(self, name: str) -> list[Path]:
        """The checkpoints of finished run ``name`` besides its final one, oldest first.

        The final checkpoint is the run's own evaluation (stage ``eval``); the others are
        the intermediate points of its learning curve. A run still training has none yet:
        its checkpoints are pruned as it goes.
        """
        run = self.runs / name
        return complete_checkpoints(run)[:-1] if self.train_done(run) else []

    def run_names(self) -> list[str]:
        """``<learner>-s<seed>`` of every learner run asked for."""
        return [f"{n}-s{s}" for n in self.a.learners for s in self.a.seeds]


def _complete(folder: Path) -> bool:
    """Whether the evaluation in ``folder`` finished every episode."""
    summary = folder / "summary.json"
    return summary.exists() and json.loads(summary.read_text()).get("complete", False)


def run(cmd: list[str], log: Path, dry: bool) -> None:
    """Run one stage's command niced, its output to ``log``; raise if it fails."""
    text = shlex.join(cmd)
    print(f"$ {text}", flush=True)
    if dry:
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log, "a") as fh:
        fh.write(f"$ {text}\n")
        fh.flush()
        proc = subprocess.run(
            ["nice", "-n", "5", *cmd], stdout=fh, stderr=subprocess.STDOUT, check=False
        )
    minutes = (time.time() - t0) / 60
    print(f"  exit {proc.returncode} after {minutes:.1f} min ({log})", flush=True)
    threads = next((int(x.split("=")[1]) for x in cmd if x.startswith("threads=")), None)
    if threads is None and "--threads" in cmd:
        threads = int(cmd[cmd.index("--threads") + 1])
    with open(log.parent / "timings.jsonl", "a") as fh:  # wall time of each stage's command
        fh.write(json.dumps({"log": log.stem, "minutes": round(minutes, 2), "exit": proc.returncode,
                             "threads": threads or 1, "finished": time.strftime("%F %T")}) + "\n")
    if proc.returncode != 0:
        raise SystemExit(f"stage failed: {text}; see {log}")


def _copy(src: Path, dest: Path, names: tuple[str, ...]) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        if (src / name).exists():
            shutil.copy2(src / name, dest / name)


def copy_results(recipe: Recipe) -> None:
    """Copy the small result files of every finished run to ``--out`` (no weights)."""
    out, runs = recipe.out, recipe.runs
    for folder in sorted(runs.glob("*")):
        if folder.name != "eval" and (folder / "metrics.jsonl").exists():
            if not recipe.train_done(folder):  # still training (or stopped): a shipped run
                continue  # of that name stays as it is until this one finishes
            if recipe.same_training(folder):  # a retrace of a shipped run: keep the original
                continue  # (its cost stays the first run's; the retrain's is in timings.jsonl)
            _copy(folder, out / "train" / folder.name, ("metrics.jsonl", "args.json", "curves.png"))
    timings = runs / "logs" / "timings.jsonl"
    known = set()  # stages timed already, here or in the shipped timings of earlier sittings
    for path in (timings, out / "timings.jsonl"):
        if path.exists():
            known |= {json.loads(x)["log"] for x in path.read_text().splitlines() if x.strip()}
    for folder in sorted((runs / "eval").glob("*")):
        summary = folder / "summary.json"
        if not summary.exists():
            continue
        _copy(folder, out / "eval" / folder.name,
              ("summary.json", "run.json", "episodes.jsonl", "report.md"))  # fmt: skip
        if f"eval-{folder.name}" in known:  # timed by run()
            continue
        # an eval run by hand: timed from its files
        started = json.loads((folder / "run.json").read_text())["started"]
        minutes = (summary.stat().st_mtime - dt.datetime.fromisoformat(started).timestamp()) / 60
        timings.parent.mkdir(parents=True, exist_ok=True)
        with open(timings, "a") as fh:
            fh.write(json.dumps({"log": f"eval-{folder.name}", "minutes": round(minutes, 2),
                                 "exit": 0, "threads": 1,
                                 "source": "run.json start to summary.json"}) + "\n")  # fmt: skip
    if timings.exists():  # added to the shipped timings (earlier sittings' lines stay)
        out.mkdir(parents=True, exist_ok=True)
        shipped = out / "timings.jsonl"
        lines = shipped.read_text().splitlines() if shipped.exists() else []
        lines += [x for x in timings.read_text().splitlines() if x.strip() and x not in lines]
        shipped.write_text("".join(x + "\n" for x in lines))


def main(argv: list[str] | None = None) -> int:
    """Run the stages that are not done yet."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", nargs="+", default=["sft", "train", "eval", "curve", "report"],
                   choices=["sft", "train", "eval", "curve", "report"])  # fmt: skip
    p.add_argument("--learners", nargs="+", default=list(LEARNERS), choices=list(LEARNERS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--budget", type=int, default=240,
                   help="env steps per learner run (240)")  # fmt: skip
    p.add_argument("--max-steps", type=int, default=100,
                   help="cap on rollout batches (the budget stops runs first)")  # fmt: skip
    p.add_argument("--sft-steps", type=int, default=SFT["steps"],
                   help="SFT updates (8)")  # fmt: skip
    p.add_argument("--curve-every", type=int, default=0,
                   help="keep every N-th learner checkpoint for stage curve to evaluate "
                   "(0: the kept two only; each SmolLM2 checkpoint is about 2.4 GB)")  # fmt: skip
    p.add_argument("--tasks", type=int, default=None,
                   help="evaluate on the protocol's first N goals only (a deviation: the "
                   "runs' protocol hash says so; for tests and quick looks)")  # fmt: skip
    p.add_argument("--prompts", type=int, default=COMMON["prompts"],
                   help="prompts per learner step (2)")  # fmt: skip
    p.add_argument("--model", default="smollm2", help="the model to warm-start (smollm2)")
    p.add_argument("--device", default="auto")
    # float32: every shipped evaluation ran in it (those asking for bfloat16 too: until
    # 2026-12-07 the engine cast the weights back), so new points stay comparable
    p.add_argument("--eval-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="weight type of the models while evaluated (float32)")  # fmt: skip
    p.add_argument("--jobs", type=int, default=2, help="runs at once (2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (1)")
    p.add_argument("--runs", default="runs/reference", help="where runs and checkpoints go")
    p.add_argument("--out", default="reference/webshop-small",
                   help="where the shipped result files go")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    a = p.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    recipe = Recipe(a)
    logs = recipe.runs / "logs"
    dry = a.dry_run
    t0 = time.time()
    if "sft" in a.stages and not recipe.train_done(recipe.runs / "sft"):
        run(recipe.sft_command(), logs / "sft.log", dry)
    train_jobs: list[tuple[list[str], Path]] = []
    if "train" in a.stages:
        for name in recipe.run_names():
            if not recipe.train_done(recipe.runs / name):
                learner, _, seed = name.rpartition("-s")
                cmd = recipe.learner_command(learner, int(seed))
                train_jobs.append((cmd, logs / f"{name}.log"))
    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        list(pool.map(lambda j: run(j[0], j[1], dry), train_jobs))
    # evaluations after training: a learner's checkpoint decides whether a shipped
    # evaluation of it still holds
    eval_jobs: list[tuple[list[str], Path]] = []
    if "eval" in a.stages:
        evals = {"expert": "expert", "random": "random", "zero-shot": a.model,
                 "sft": str(recipe.sft_model())}  # fmt: skip
        evals.update({n: str(recipe.runs / n) for n in recipe.run_names()})
        for name, agent in evals.items():
            if not recipe.eval_done(name, agent):
                eval_jobs.append((recipe.eval_command(name, agent), logs / f"eval-{name}.log"))
    if "curve" in a.stages:  # the learning curves' intermediate checkpoints, after the ends
        for name in recipe.run_names():
            for ckpt in recipe.curve_checkpoints(name):
                point = f"{name}@{checkpoint_step(ckpt)}"
                if not recipe.eval_done(point, str(ckpt)):
                    eval_jobs.append((recipe.eval_command(point, str(ckpt)),
                                      logs / f"eval-{point}.log"))  # fmt: skip
    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        list(pool.map(lambda j: run(j[0], j[1], dry), eval_jobs))
    if "report" in a.stages and not dry:
        from reference_report import write_report

        copy_results(recipe)
        write_report(recipe.runs, recipe.out, learners=a.learners, seeds=a.seeds)
    print(f"done in {(time.time() - t0) / 3600:.2f} h")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
