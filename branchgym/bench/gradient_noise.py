"""``branchgym bench gradient-noise``: each learner's gradient-estimator noise at a frozen policy.

``bench learning``'s "gradient-norm variance ratio" is Var(|g|) over training windows of
a moving policy: it mixes policy drift, the advantages' scale and degenerate groups,
and is no measure of how noisy an estimator is. This study measures that directly:

* freeze one policy: the tiny random Qwen2 with the scoring policy (``bench learning``'s
  starting point), optionally after ``--train-steps`` updates of ``--train-algo``, or
  the weights of a saved run (``--checkpoint``);
* for each learner (``grpo``, ``rloo``, ``bpo`` with ``bench learning``'s options;
  ``--learners`` takes any, with options: ``bpo:lam=0.9,tail=zero``), draw
  ``--batches`` independent batches by running the learner's own training step with the
  optimizer step replaced by a gradient read-out
  (:func:`branchgym.agents.gradient_probe.probe_learner`): its own rollouts and
  advantages (the entries of ``branchgym.agents.estimators.advantages.ADVANTAGES`` it picks:
  eq. 4/5 for Branching PO, the group baselines for GRPO/RLOO), its aggregation, ratio 1
  and beta 0;
* flatten each batch's surrogate gradient over all trainable parameters (no projection;
  only running sums are kept) and report tr Cov / |mean|^2 (noise-to-signal, NSR), the
  cosine between the means of two independent halves of the batches, and the signal
  corrected for the noise in the mean (|mean|^2 - tr Cov / n), at matched rollouts
  (every learner: N = 7 rollouts per prompt) and at matched tokens (NSR x tokens per
  batch / the reference learner's tokens per batch: the NSR it would have if its batches
  cost the reference's tokens, since NSR scales as 1 / batch size).

This study measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from branchgym.bench.common import Report, positive_int, seed_int
from branchgym.bench.runs import CI_MAZE, STUDY_MAZE
from branchgym.bench.variance import PAYS_BELOW
from branchgym.error import OptionError

__all__ = [
    "DEFAULT_LEARNERS",
    "LEARNER_DEFAULTS",
    "NOISE_BATCHES",
    "NOISE_PROMPTS",
    "NOISIER_ABOVE",
    "EstimatorNoise",
    "configure",
    "estimator_noise",
    "main",
    "measure",
    "table_rows",
]

#: The default env: the learning study's maze as text.
TEXT_MAZE = "branchgym/TextTreeMDP-v0"

#: The learners compared by default (labels; options may follow a colon).
DEFAULT_LEARNERS = ("grpo", "rloo", "bpo")

#: Options each algorithm gets unless the label overrides them: bench learning's main
#: comparison (N = 7 rollouts per prompt for everyone; BPO M = 2, K = 4).
LEARNER_DEFAULTS: dict[str, dict[str, Any]] = {
    "bpo": {"m": 2, "k": 4, "gap_unit": "steps"},
    "grpo": {"n": 7},
    "rloo": {"n": 7},
}

#: Defaults of the estimator-noise figure of ``branchgym diagnose``: small, so that the
#: command stays a quick check (the figure is rough: see its halves).
NOISE_BATCHES = 8
NOISE_PROMPTS = 2
#: BPO/RLOO noise-to-signal at matched tokens above which branching costs more noise.
NOISIER_ABOVE = 1.25


@dataclasses.dataclass
class EstimatorNoise:
    """``branchgym diagnose``'s estimator-level figure: BPO vs RLOO at one frozen policy.

    Attributes:
        model: The frozen policy's model.
        batches: Independent batches per learner.
        prompts: Prompts per batch.
        results: Per learner (``rloo``, ``bpo``), the summary of
            :func:`branchgym.bench.gradient_noise.measure` (``nsr``, ``nsr_tokens``, ...).
        error: Why there is no figure (e.g. the env does not take text actions).
    """

    model: str
    batches: int
    prompts: int
    results: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    error: str | None = None

    @property
    def ratio(self) -> float:
        """BPO/RLOO noise-to-signal at matched tokens (nan without a figure)."""
        if self.error or not self.results:
            return float("nan")
        b, r = self.results["bpo"]["nsr_tokens"], self.results["rloo"]["nsr_tokens"]
        return b / r if r > 0 and np.isfinite(b) else float("nan")

    def half_ratios(self) -> tuple[float, float]:
        """The BPO/RLOO ratio from the even and from the odd batches alone (its spread)."""
        if self.error or not self.results:
            return float("nan"), float("nan")
        b, r = self.results["bpo"], self.results["rloo"]
        scale = b["tokens_per_batch"] / r["tokens_per_batch"]
        return tuple(  # type: ignore[return-value]
            b[k] * scale / r[k] if r[k] > 0 else float("nan") for k in ("nsr_a", "nsr_b")
        )

    @property
    def verdict(self) -> str:
        """One line from the estimator-level figure."""
        if self.error:
            return f"no estimator figure: {self.error}"
        r = self.ratio
        if not np.isfinite(r):
            return "no verdict: a learner's mean gradient is zero (no signal at this policy)"
        a, b = self.half_ratios()
        sides = {x < 1.0 for x in (r, a, b) if np.isfinite(x)}
        if len(sides) > 1:
            return (
                f"no clear verdict: BPO/RLOO noise-to-signal per token is {r:.2f}, but the two "
                f"halves of the batches give {a:.2f} and {b:.2f}; rerun with more "
                "--noise-batches"
            )
        if r < PAYS_BELOW:
            return (
                f"branching pays at matched compute: BPO's gradient noise-to-signal per "
                f"token is {r:.2f}x RLOO's"
            )
        if r > NOISIER_ABOVE:
            return (
                f"branching does not pay at matched compute: BPO's gradient noise-to-signal "
                f"per token is {r:.2f}x RLOO's (noisier)"
            )
        return (
            f"branching about breaks even at matched compute: BPO's gradient "
            f"noise-to-signal per token is {r:.2f}x RLOO's"
        )


def estimator_noise(
    env_id: str,
    env_kwargs: dict[str, Any] | None = None,
    *,
    model: str = "random",
    batches: int = NOISE_BATCHES,
    prompts: int = NOISE_PROMPTS,
    seed: int = 0,
    progress: bool = True,
) -> EstimatorNoise:
    """BPO vs RLOO gradient noise at the frozen policy ``model`` on ``env_id``.

    Runs :func:`branchgym.bench.gradient_noise.measure` (each learner's own training step,
    the surrogate gradient read out instead of an update; N = 7 rollouts per prompt for
    both; BPO M = 2, K = 4, branch gap in steps). ``random`` and ``expert`` are not
    models with gradients: the tiny random Qwen2 with the scoring policy stands in.
    """
    from branchgym.error import Error as BranchgymError

    name = "tiny" if model in ("random", "expert") else model
    out = EstimatorNoise(name, batches, prompts)
    try:
        out.results = measure(
            ["rloo", "bpo"],
            batches,
            reference="rloo",
            progress=progress,
            desc=f"diagnose {env_id}: gradients",
            env_id=env_id,
            env_kwargs=dict(env_kwargs or {}),
            model=name,
            prompts_per_step=prompts,
            seed=seed,
            threads=1,
        )
    except (BranchgymError, ImportError, ValueError) as exc:
        out.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return out


HEAD = [
    "learner",
    "batches",
    "rollouts/batch",
    "tokens/batch",
    "NSR (matched rollouts)",
    "NSR halves A / B",
    "NSR corrected",
    "cosine (half vs half)",
    "signal ‖m‖² − trC/n",
    "NSR (matched tokens)",
    "Var‖g‖ (fixed policy)",
    "learner tokens/batch (plain / pack_trees)",
    "NSR (matched learner tokens, plain / pack_trees)",
]


def measure(
    learners: list[str],
    batches: int,
    *,
    reference: str | None = None,
    progress: bool = True,
    desc: str = "gradient-noise",
    **options: Any,
) -> dict[str, dict[str, float]]:
    """Per learner label, :meth:`NoiseStats.summary` plus ``nsr_tokens`` and ``seconds``.

    ``options`` go to every learner (env, model, prompts per step, seed, threads, ...);
    a label's own options (after a colon) and :data:`LEARNER_DEFAULTS` come first.
    ``nsr_tokens`` = NSR x tokens per batch / the ``reference`` learner's tokens per
    batch (default: the first learner).
    """
    from branchgym.agents.gradient_probe import NoiseStats, parse_learner, probe_learner

    parsed = [parse_learner(s) for s in learners]
    out: dict[str, dict[str, float]] = {}
    with tqdm(total=batches * len(parsed), desc=desc, unit="batch", disable=not progress) as bar:
        for label, algo, own in parsed:
            stats = NoiseStats()
            costs: list[tuple[float, float, float, float]] = []

            def on_batch(bg: Any, stats: Any = stats, costs: list = costs) -> None:
                stats.add(bg.grad, bg.tokens, bg.rollouts)
                costs.append((bg.learner_tokens, bg.packed_tokens, bg.decisions, bg.prompt_tokens))
                bar.update(1)

            t0 = time.perf_counter()
            opts = {**LEARNER_DEFAULTS.get(algo, {}), **options, **own}
            probe_learner(algo, batches, on_batch=on_batch, **opts)
            s = stats.summary()
            s["seconds"] = time.perf_counter() - t0
            c = np.asarray(costs, dtype=float).mean(axis=0)
            s["learner_tokens_per_batch"], s["packed_tokens_per_batch"] = c[0], c[1]
            s["decisions_per_batch"], s["prompt_tokens_per_row"] = c[2], c[3]
            out[label] = s
    ref = reference if reference in out else next(iter(out))
    r = out[ref]
    for s in out.values():
        # NSR scales as 1 / batch size: the NSR at the reference's cost in each unit
        for key, unit in (
            ("nsr_tokens", "tokens_per_batch"),
            ("nsr_learner_tokens", "learner_tokens_per_batch"),
            ("nsr_packed_tokens", "packed_tokens_per_batch"),
        ):
            s[key] = s["nsr"] * s[unit] / r[unit] if r[unit] else np.nan
        s["reference_tokens"] = r["tokens_per_batch"]
    return out


def table_rows(results: dict[str, dict[str, float]]) -> list[list[Any]]:
    """One row of :data:`HEAD` per learner."""
    return [
        [
            label,
            int(s["batches"]),
            f"{s['rollouts_per_batch']:.1f}",
            f"{s['tokens_per_batch']:.0f}",
            f"{s['nsr']:.3f}",
            f"{s['nsr_a']:.3f} / {s['nsr_b']:.3f}",
            f"{s['nsr_corrected']:.3f}",
            f"{s['cosine']:.3f}",
            f"{s['signal']:.4g}",
            f"{s['nsr_tokens']:.3f}",
            f"{s['norm_var']:.4g}",
            f"{s['learner_tokens_per_batch']:.0f} / {s['packed_tokens_per_batch']:.0f}",
            f"{s['nsr_learner_tokens']:.3f} / {s['nsr_packed_tokens']:.3f}",
        ]
        for label, s in results.items()
    ]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add this study's options."""
    parser.add_argument("--out", default="results", help="results folder (default: results)")
    parser.add_argument(
        "--learners",
        nargs="+",
        default=list(DEFAULT_LEARNERS),
        help="learners, each optionally with options: grpo rloo bpo 'bpo:lam=0.9,tail=zero'",
    )
    parser.add_argument(
        "--batches", type=positive_int, default=100, help="independent batches per learner (100)"
    )
    parser.add_argument("--prompts", type=positive_int, default=4, help="prompts per batch (4)")
    parser.add_argument("--seed", type=seed_int, default=0, help="first seed of the draws (0)")
    parser.add_argument(
        "--reference",
        default=None,
        help="learner whose tokens per batch the matched-token NSR uses (first learner)",
    )
    parser.add_argument(
        "--checkpoint", default=None, help="freeze these weights (a run's checkpoint folder)"
    )
    parser.add_argument(
        "--train-steps",
        type=int,
        default=0,
        help="train this many updates before freezing (0: the random tiny model)",
    )
    parser.add_argument("--train-algo", default="grpo", help="learner of those updates (grpo)")
    parser.add_argument("--lr", type=float, default=1e-4, help="their learning rate (1e-4)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--quick", action="store_true", help="CI: the depth-3 maze, 6 batches of 2 prompts"
    )
    parser.add_argument(
        "--maze",
        default="",
        help="TextTreeMDP options over the maze's, KEY=VALUE comma list, e.g. "
        "termination_prob=0.3 or end_actions=1 (episodes of variable length)",
    )
    parser.add_argument(
        "--env",
        default=TEXT_MAZE,
        help=f"env id (default {TEXT_MAZE}; e.g. branchgym/WebShop-v0, whose episodes end "
        "when the agent buys)",
    )
    parser.add_argument(
        "--env-kwargs",
        default="",
        help="options of --env, KEY=VALUE comma list (e.g. max_steps=10 for WebShop)",
    )


def _frozen_model(
    args: argparse.Namespace, env_id: str, maze: dict[str, Any], folder: Path
) -> str:
    """The model to freeze: a checkpoint, the random tiny model, or it after a few updates."""
    if args.checkpoint:
        return str(args.checkpoint)
    if args.train_steps <= 0:
        return "tiny"
    from branchgym.bench.runs import run_learner

    algo = args.train_algo.partition(":")[0]
    opts = {**LEARNER_DEFAULTS.get(algo, {})}
    run = run_learner(
        algo,
        args.seed,
        folder,
        label="warmup",
        env_id=env_id,
        env_kwargs=maze,
        steps=args.train_steps,
        prompts_per_step=args.prompts,
        lr=args.lr,
        threads=args.threads,
        **opts,
    )
    if run.checkpoint is None:
        raise RuntimeError("the warm-up run wrote no checkpoint")
    return str(run.checkpoint)


def _maze_options(text: str, flag: str = "--maze") -> dict[str, Any]:
    """``"termination_prob=0.3,depth=5"`` -> ``{"termination_prob": 0.3, "depth": 5}``."""
    out: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise OptionError(
                f"{flag} takes KEY=VALUE pairs (e.g. termination_prob=0.3); got {item!r}"
            )
        try:
            out[key.strip()] = int(value)
        except ValueError:
            try:
                out[key.strip()] = float(value)
            except ValueError:
                out[key.strip()] = value.strip()
    return out


def main(args: argparse.Namespace) -> int:
    """Measure each learner's estimator noise; write ``gradient_noise.md``, PNG and JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    env_id = getattr(args, "env", TEXT_MAZE)
    maze_text = getattr(args, "maze", "")
    if args.quick:
        args.batches, args.prompts = min(args.batches, 6), min(args.prompts, 2)
    if env_id == TEXT_MAZE:
        maze = {**(CI_MAZE if args.quick else STUDY_MAZE), **_maze_options(maze_text)}
    elif maze_text:
        raise OptionError(
            f"--maze sets TextTreeMDP's options and --env is {env_id}; give that env's "
            "options with --env-kwargs KEY=VALUE,..."
        )
    else:
        maze = {}
    maze = {**maze, **_maze_options(getattr(args, "env_kwargs", ""), "--env-kwargs")}
    where = f"TextTreeMDP {maze}" if env_id == TEXT_MAZE else f"{env_id} {maze}"
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_gradient_noise_") as tmp:
        model = _frozen_model(args, env_id, maze, Path(tmp))
        if args.checkpoint:
            frozen = f"the weights of {args.checkpoint}"
        elif args.train_steps > 0:
            frozen = (
                f"the tiny random Qwen2 after {args.train_steps} {args.train_algo} updates "
                f"(lr {args.lr}, {args.prompts} prompts each, seed {args.seed})"
            )
        else:
            frozen = "the tiny random Qwen2 at initialisation (bench learning's start)"
        results = measure(
            list(args.learners),
            args.batches,
            reference=args.reference,
            env_id=env_id,
            env_kwargs=maze,
            model=model,
            policy="scoring",
            prompts_per_step=args.prompts,
            seed=args.seed,
            threads=args.threads,
        )
    wall = time.perf_counter() - t0
    ref = args.reference if args.reference in results else next(iter(results))
    report = Report(args.out, "gradient_noise", "branchgym bench gradient-noise")
    report.add(
        f"Setup: {where}, {frozen}, scoring policy, frozen (no optimizer step). "
        f"Per learner {args.batches} independent batches of {args.prompts} prompts (each "
        "batch: the learner's own rollouts and advantages, its aggregation, ratio 1, "
        "beta 0). Gradient: the surrogate policy gradient flattened over all trainable "
        "parameters (no projection). NSR = tr Cov / |mean|^2 per batch; *halves A / B*: the "
        "same from the even and from the odd batches alone; *corrected*: tr Cov / (|mean|^2 "
        "- tr Cov / n); *cosine*: between the mean of the even and of the odd batches; "
        f"*matched tokens*: NSR x tokens per batch / {ref}'s tokens per batch. Var‖g‖ is "
        "the variance of the gradient norm over batches at this fixed policy (the quantity "
        f"bench learning reports over a moving policy). Batch i of every learner uses the "
        "same prompts and sampling seeds (seed, i): GRPO and RLOO see identical rollouts and "
        f"differ only in their advantages. Wall time {wall:.0f} s."
    )
    print(report.table(HEAD, table_rows(results)))
    lines = []
    for label, s in results.items():
        if label == ref:
            continue
        r = results[ref]
        lines.append(
            f"{label} / {ref}: NSR at matched rollouts {s['nsr'] / r['nsr']:.2f}, at matched "
            f"generated tokens {s['nsr_tokens'] / r['nsr_tokens']:.2f}, at matched learner "
            f"tokens {s['nsr_learner_tokens'] / r['nsr_learner_tokens']:.2f} (plain) / "
            f"{s['nsr_packed_tokens'] / r['nsr_packed_tokens']:.2f} (pack_trees)"
        )
    for line in lines:
        print(line)
        report.add(f"- {line}")
    print(f"gradient-noise: {wall:.0f} s")

    labels = list(results)
    x = np.arange(len(labels))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    axes[0].bar(x - 0.2, [results[k]["nsr"] for k in labels], 0.4, label="matched rollouts")
    axes[0].bar(x + 0.2, [results[k]["nsr_tokens"] for k in labels], 0.4, label="matched tokens")
    axes[0].set_xticks(x, labels, fontsize=8)
    axes[0].set_ylabel("noise-to-signal tr Cov / |mean|^2")
    axes[0].set_title(f"per batch of {args.prompts} prompts")
    axes[0].legend(fontsize=8)
    cos = [results[k]["cosine"] for k in labels]
    axes[1].bar(x, cos, color="tab:green")
    for i, c in enumerate(cos):
        axes[1].annotate(f"{c:.3f}", (i, c), ha="center", va="bottom", fontsize=8)
    axes[1].set_xticks(x, labels, fontsize=8)
    finite = [c for c in cos if np.isfinite(c)] or [0.0]
    axes[1].set_ylim(max(-1.0, min(finite) - 0.1 * (1.0 - min(finite)) - 0.01), 1.0)
    axes[1].set_ylabel("cosine, mean of half A vs half B")
    axes[1].set_title(f"{args.batches // 2} + {args.batches - args.batches // 2} batches")
    report.figure(
        fig, "nsr", "Estimator noise at a frozen policy, per learner (lower NSR: less noise)"
    )
    report.data = {
        "args": vars(args),
        "env": env_id,
        "maze": maze,
        "frozen": frozen,
        "reference": ref,
        "wall_s": wall,
        "results": results,
    }
    path = report.save()
    print(f"report: {path}")
    return 0
