"""``branchgym bench trl``: branchgym's learners against TRL's ``GRPOTrainer``, step by step.

One run trains the same model (same initial weights) with the same prompts, sampling and
loss settings in five trainers, ``--steps`` steps each, on two workloads of the
TextTreeMDP maze (``n_actions = 3``, Bernoulli rewards):

* **single turn** (``depth = 1``: one reply per episode, the workload TRL's
  ``GRPOTrainer`` runs as it is): ``--prompts`` prompts x N = 1 + M(K - 1) completions
  per step, in

  - ``branchgym grpo``: :mod:`branchgym.agents.learners.grpo` (the ``generate`` policy on
    :class:`~branchgym.agents.engines.hf.HFEngine`, tree packing on);
  - ``TRL GRPOTrainer``: ``trl.GRPOTrainer`` with the same prompt text (the chat head
    branchgym's policy writes), ``num_generations = N`` and a reward function that
    plays the completion in a fresh env reset with the prompt's seed;

* **multi turn** (``depth = 2``, two decisions per episode): the same prompts, in

  - ``branchgym grpo``: N independent rollouts per prompt;
  - ``branchgym bpo``: one backbone per prompt, M branch points of K siblings (schedule
    ``even``): N leaves;
  - ``branchgym bpo depths``: the same trees with the points fixed in advance (schedule
    ``depths`` at the steps ``even`` picks on a backbone that runs to the horizon, which
    every backbone here does), so each point's siblings decode in the backbone's engine
    calls (``grow_tree``'s overlap) instead of after it;
  - ``TRL BranchingGRPOTrainer``: :class:`branchgym.integrations.trl.BranchingGRPOTrainer`
    (TRL's ``GRPOTrainer`` on the same bpo trees and credit, TRL's own loss and update).

Every trainer uses ``beta = 0.05`` (a frozen reference model, Schulman's k3 KL), PPO clip
0.2, one optimizer update per step, learning rate 1e-5 and float32; GRPO rows aggregate as
GRPO does (TRL ``loss_type="grpo"``, branchgym ``seq-mean-token-mean``), tree rows as bpo
does (``"dapo"``, ``token-mean``).

Per trainer the report gives the median step time (wall clock from the step's start to
the end of its optimizer step; step 1 is a warm-up and left out), its split into
**generation** (sampling and env steps; TRL: ``_generate`` and the reward function, or
the tree growing), **reference** (the frozen model's forward for the KL term), **update**
(the policy's forward, backward and optimizer step; TRL: everything after its rollout
hook) and **other** (the rest of the step: advantages, padding, bookkeeping), and the
tokens of a step: generated, read by the learner's forward passes (TRL: the rows'
non-padding prompt and completion tokens), and unique (each group's or tree's rows in a
token trie, every shared prefix once: what a learner that shares prefixes must read).

TRL is optional (the ``trl`` extra): without it the study says so and times branchgym's
learners only.

``--malloc`` picks glibc's allocator settings for the whole run (every trainer alike):
``glibc`` leaves its defaults, under which every block above the mmap threshold (128 KB,
rising with use to at most 32 MB) is a fresh ``mmap`` whose pages the kernel zeroes on
first touch and which is unmapped again when freed; ``keep`` (:func:`keep_freed_memory`)
serves every block from the heap and keeps freed memory for reuse, which is what
``MALLOC_MMAP_MAX_=0`` and a ``MALLOC_TRIM_THRESHOLD_`` larger than any heap
(``68719476736``) in the environment do for any program. A trainer whose step
allocates and frees large tensors (vocabulary-sized logits for every row) pays the
kernel for its pages again every step under the defaults, so the ratio between trainers
depends on this setting, and the report says which was used.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import importlib.util
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from branchgym.bench.common import Report, positive_int
from branchgym.error import OptionError
from branchgym.rollout.schedules import even_schedule

__all__ = ["configure", "main", "unique_tokens", "keep_freed_memory"]

ENV = "branchgym/TextTreeMDP-v0"
BETA = 0.05
LR = 1e-5
#: workload -> TextTreeMDP keywords and the episode cap.
WORKLOADS: dict[str, dict[str, Any]] = {
    "single turn": {
        "env_kwargs": {"depth": 1, "n_actions": 3, "reward_kind": "bernoulli", "structure_seed": 2},
        "max_episode_steps": 1,
    },
    "multi turn": {
        "env_kwargs": {"depth": 2, "n_actions": 3, "reward_kind": "bernoulli", "structure_seed": 2},
        "max_episode_steps": 2,
    },
}
PHASES = ("generation", "reference", "update")
#: --malloc choices, as the report describes them.
MALLOC = {
    "glibc": "glibc's defaults (blocks above the mmap threshold, at most 32 MB, mapped fresh "
    "and unmapped when freed)",
    "keep": "every block from the heap, freed memory kept (mallopt: no mmap, no trimming, "
    "as MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 in the environment)",
}
# mallopt(3) parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4


def configure(parser: argparse.ArgumentParser) -> None:
    """Add this study's options."""
    parser.add_argument("--out", default="results", help="results folder (default: results)")
    parser.add_argument("--model", default="tiny", help="tiny, smollm2 or a model folder")
    parser.add_argument("--steps", type=positive_int, default=3, help="steps per trainer (3)")
    parser.add_argument("--prompts", type=positive_int, default=4, help="prompts per step (4)")
    parser.add_argument("--m", type=positive_int, default=2, help="branch points M (2)")
    parser.add_argument("--k", type=positive_int, default=4, help="siblings K (4)")
    parser.add_argument(
        "--max-new-tokens", type=positive_int, default=32, help="reply cap in tokens (32)"
    )
    parser.add_argument("--threads", type=positive_int, default=2, help="torch CPU threads (2)")
    parser.add_argument(
        "--workloads",
        default="single turn,multi turn",
        help="comma-separated: 'single turn', 'multi turn' (both)",
    )
    parser.add_argument("--quick", action="store_true", help="2 steps, 1 prompt, 8 tokens")
    parser.add_argument(
        "--malloc",
        choices=sorted(MALLOC),
        default="glibc",
        help="allocator settings for every trainer: glibc's defaults (glibc) or every block "
        "from the heap with freed memory kept (keep); default glibc",
    )


def keep_freed_memory() -> None:
    """Make glibc serve every block from its heap and keep freed memory for reuse.

    The same as starting the process with ``MALLOC_MMAP_MAX_=0``,
    ``MALLOC_TRIM_THRESHOLD_=68719476736`` and ``MALLOC_TOP_PAD_=268435456``, but from
    inside it (a trim threshold of -1 through ``mallopt`` means never give the heap's
    top back; the ``int`` it takes cannot say 64 GiB): large tensors then reuse pages
    already faulted in instead of mapping fresh ones (which the kernel zeroes) on every
    allocation. It affects the rest of the process and cannot be undone. Raises
    :class:`~branchgym.error.OptionError` where the C library has no ``mallopt`` (it is
    glibc's).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError) as exc:
        raise OptionError(
            "--malloc keep needs glibc's mallopt, which this C library lacks; run with "
            "--malloc glibc (or set your allocator's own options in the environment)"
        ) from exc
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    for param, value in ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1), (_M_TOP_PAD, 256 << 20)):
        if mallopt(param, value) != 1:
            raise OptionError(f"mallopt({param}, {value}) was refused; run with --malloc glibc")


# ------------------------------------------------------------------ unique tokens
def unique_tokens(groups: Sequence[Sequence[Sequence[int]]]) -> int:
    """Tokens of each group's sequences in a token trie (a shared prefix counted once).

    ``groups``: per group, the token ids of its rows; groups do not share with each
    other. The study passes a step's rows as one group, as branchgym's learners read
    them (``Run.token_counts``: one trie per mini-batch, across trees, so a prompt
    several groups start from counts once).
    """
    total = 0
    for rows in groups:
        nodes: set[tuple[int, ...]] = set()
        for seq in rows:
            seq = tuple(int(t) for t in seq)
            for end in range(1, len(seq) + 1):
                nodes.add(seq[:end])
        total += len(nodes)
    return total


# ------------------------------------------------------------------ branchgym learners
def _branchgym(
    algo: str, args: argparse.Namespace, workload: dict[str, Any], out: str
) -> dict[str, Any]:
    """One branchgym learner: per-step seconds, their split, and token counts."""
    from branchgym.agents.train import train

    tree = {"m": args.m, "k": args.k}
    if algo == "bpo":
        options = {**tree, "schedule": "even", "aggregation": "token-mean"}
    elif algo == "bpo depths":
        horizon = workload["max_episode_steps"]
        steps = [f.step for f in even_schedule(None, list(range(horizon)), args.m, None)]
        options = {**tree, "schedule": "depths", "branch_depths": tuple(steps)}
        options["aggregation"] = "token-mean"
        algo = "bpo"
    else:
        options = {**tree, "aggregation": "seq-mean-token-mean"}
    result = train(
        algo,
        model=args.folder,
        policy="generate",
        env_id=ENV,
        env_kwargs=workload["env_kwargs"],
        max_episode_steps=workload["max_episode_steps"],
        steps=args.steps,
        prompts_per_step=args.prompts,
        beta=BETA,
        max_new_tokens=args.max_new_tokens,
        lr=LR,
        lr_schedule="constant",
        threads=args.threads,
        progress=False,
        out_dir=out,
        eval_episodes=0,
        **options,
    )
    lines = [h for h in result.history if "time/step_s" in h]
    return {
        "step_s": [h["time/step_s"] for h in lines],
        **{p: [h.get(f"time/{p}_s", 0.0) for h in lines] for p in PHASES},
        "generated": [h.get("tokens/generated", float("nan")) for h in lines],
        "learner": [h.get("tokens/learner", float("nan")) for h in lines],
        "unique": [h.get("tokens/unique", float("nan")) for h in lines],
    }


# ------------------------------------------------------------------ TRL
class _Clock:
    """Per-step seconds of a TRL trainer, split by wrapping its methods on the instance."""

    def __init__(self) -> None:
        self.phase: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []
        self.tokens: dict[str, float] = {}
        self.token_steps: list[dict[str, float]] = []
        self._start = 0.0
        self.in_hook = False

    def begin(self) -> None:
        self.phase, self.tokens = {}, {}
        self._start = time.perf_counter()

    def end(self) -> None:
        self.steps.append({"step": time.perf_counter() - self._start, **self.phase})
        self.token_steps.append(dict(self.tokens))

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phase[phase] = self.phase.get(phase, 0.0) + time.perf_counter() - start

    def wrap(self, obj: Any, name: str, phase: str, *, only_in_hook: bool = False) -> None:
        """Time ``obj.<name>`` calls as ``phase`` (inside the rollout hook only, if asked)."""
        inner = getattr(obj, name)

        @functools.wraps(inner)
        def timed_call(*a: Any, **kw: Any) -> Any:
            if only_in_hook and not self.in_hook:
                return inner(*a, **kw)
            with self.timed(phase):
                return inner(*a, **kw)

        setattr(obj, name, timed_call)

    def wrap_hook(self, trainer: Any, count: Callable[[dict[str, Any]], dict[str, float]]) -> None:
        """Time the rollout hook and count the tokens of the rows it returns."""
        inner = trainer._generate_and_score_completions

        @functools.wraps(inner)
        def hook(*a: Any, **kw: Any) -> Any:
            self.in_hook = True
            try:
                with self.timed("hook"):
                    out = inner(*a, **kw)
            finally:
                self.in_hook = False
            for k, v in count(out).items():
                self.tokens[k] = self.tokens.get(k, 0.0) + v
            return out

        trainer._generate_and_score_completions = hook

    def result(self) -> dict[str, Any]:
        """Per step: total, generation, reference, update (after the hook) and tokens."""
        steps = self.steps
        out: dict[str, Any] = {
            "step_s": [s["step"] for s in steps],
            "generation": [s.get("generation", 0.0) for s in steps],
            "reference": [s.get("reference", 0.0) for s in steps],
            "update": [s["step"] - s.get("hook", 0.0) for s in steps],
        }
        for key in ("generated", "learner", "unique"):
            out[key] = [t.get(key, float("nan")) for t in self.token_steps]
        return out


def _rows(out: dict[str, Any]) -> list[list[int]]:
    """The rows of a TRL hook output as token lists (prompt and completion, no padding)."""
    rows = []
    for p, pm, c, cm in zip(
        out["prompt_ids"].tolist(),
        out["prompt_mask"].tolist(),
        out["completion_ids"].tolist(),
        out["completion_mask"].tolist(),
        strict=True,
    ):
        rows.append(
            [t for t, m in zip(p, pm, strict=True) if m]
            + [t for t, m in zip(c, cm, strict=True) if m]
        )
    return rows


def _config(args: argparse.Namespace, out: str, n: int, loss_type: str) -> Any:
    import torch
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=n * args.prompts,  # N copies of each prompt
        num_generations=n,
        max_completion_length=args.max_new_tokens,
        max_steps=args.steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        beta=BETA,
        epsilon=0.2,
        loss_type=loss_type,
        temperature=1.0,
        logging_steps=1,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        gradient_checkpointing=False,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )


def _train(trainer: Any, clock: _Clock) -> None:
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a: Any, **kw: Any) -> None:
            clock.begin()

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            clock.end()

    trainer.add_callback(StepClock())
    trainer.remove_callback(PrinterCallback)  # the report has the figures; no log dicts
    trainer.train()


def _trl_grpo(args: argparse.Namespace, workload: dict[str, Any], out: str) -> dict[str, Any]:
    """TRL's GRPOTrainer on the single-turn maze: same prompt text, env return as reward."""
    import datasets
    import gymnasium as gym
    import torch
    from trl import GRPOTrainer

    import branchgym  # noqa: F401 - registers the env ids
    from branchgym.agents.policies.chat_format import chat_format
    from branchgym.agents.policies.models import load_model
    from branchgym.agents.policies.prompts import prompt_for

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tok = load_model(args.folder)
    builder, chat = prompt_for(ENV), chat_format(tok)
    kwargs = workload["env_kwargs"]
    env = gym.make(ENV, **kwargs)
    seeds = [int(s) for s in np.random.default_rng(0).integers(0, 2**31 - 1, size=64)]
    prompts = []
    for s in seeds:
        obs, info = env.reset(seed=s)
        prompts.append(chat.head(builder.system_prompt(), builder.task_message(obs, info)))
    data = datasets.Dataset.from_dict({"prompt": prompts, "seed": seeds})

    def env_return(prompts: Any, completions: Any, seed: Any, **_: Any) -> list[float]:
        rewards = []
        for text, s in zip(completions, seed, strict=True):
            _, info = env.reset(seed=int(s))
            action = builder.parse(text, info).action
            _, reward, *_ = env.step(action)
            rewards.append(float(reward))
        return rewards

    n = 1 + args.m * (args.k - 1)
    trainer = GRPOTrainer(
        model,
        reward_funcs=env_return,
        args=_config(args, out, n, "grpo"),
        train_dataset=data,
        processing_class=tok,
    )
    clock = _Clock()
    clock.wrap(trainer, "_generate", "generation")
    clock.wrap(trainer, "_calculate_rewards", "generation")
    clock.wrap(trainer, "_get_per_token_logps_and_entropies", "reference", only_in_hook=True)

    def count(o: dict[str, Any]) -> dict[str, float]:
        rows = _rows(o)
        return {
            "generated": float(o["completion_mask"].sum()),
            "learner": float(sum(map(len, rows))),
            "unique": float(unique_tokens([rows])),  # the step's rows in one trie
        }

    clock.wrap_hook(trainer, count)
    _train(trainer, clock)
    return clock.result()


def _trl_branching(args: argparse.Namespace, workload: dict[str, Any], out: str) -> dict[str, Any]:
    """BranchingGRPOTrainer on the bpo trees of the multi-turn maze."""
    import torch

    from branchgym.agents.policies.models import load_model
    from branchgym.agents.training.policy_kinds import PolicyKind
    from branchgym.integrations.trl import BranchingArgs, BranchingGRPOTrainer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tok = load_model(args.folder)
    trainer = BranchingGRPOTrainer(
        model,
        ENV,
        env_kwargs=workload["env_kwargs"],
        branching=BranchingArgs(
            m=args.m,
            k=args.k,
            schedule="even",
            max_new_tokens=args.max_new_tokens,
            max_episode_steps=workload["max_episode_steps"],
        ),
        args=_config(args, out, 2, "dapo"),
        processing_class=tok,
        prompts=max(8, args.steps * args.prompts),
    )
    # one copy per prompt grows its trees: per_device_train_batch_size = 2 x prompts
    clock = _Clock()
    clock.wrap(trainer, "grow", "generation")
    clock.wrap(trainer, "_reference_logps", "reference")
    batches: list[Any] = []
    inner_score = trainer.score

    def score(*a: Any, **kw: Any) -> Any:
        batch, metrics = inner_score(*a, **kw)
        batches.append(batch)
        return batch, metrics

    trainer.score = score

    def count(o: dict[str, Any]) -> dict[str, float]:
        batch = batches.pop()
        policy = trainer.branch_policy()
        trees: dict[int, list[list[int]]] = {}
        for row in batch.rows:
            if row.decisions:
                for run in PolicyKind.runs(policy, row):
                    trees.setdefault(row.tree, []).append(PolicyKind.sequence(policy, run)[0])
        return {
            "generated": float(sum(t.stats.generated_tokens for t in batch.trees)),
            "learner": float(sum(map(len, _rows(o)))),
            "unique": float(unique_tokens([[r for rows in trees.values() for r in rows]])),
        }

    clock.wrap_hook(trainer, count)
    _train(trainer, clock)
    return clock.result()


# ------------------------------------------------------------------ report
def _median(values: Sequence[float]) -> float:
    rest = list(values[1:]) if len(values) > 1 else list(values)  # step 1 is a warm-up
    return float(np.median(rest)) if rest else float("nan")


def _other(r: dict[str, Any]) -> list[float]:
    """Per step, the time outside the timed phases.

    The report takes its median rather than subtracting the phases' medians from the
    step's: with an odd number of steps those differ, and the difference could come out
    negative.
    """
    return [s - sum(r[p][i] for p in PHASES) for i, s in enumerate(r["step_s"])]


def _row(name: str, r: dict[str, Any]) -> list[Any]:
    step = _median(r["step_s"])
    phases = [_median(r[p]) for p in PHASES]
    generated = _median(r["generated"])
    per_token = 1000 * phases[0] / generated if generated > 0 else float("nan")
    return [
        name,
        step,
        *phases,
        _median(_other(r)),
        *(_count(_median(r[k])) for k in ("generated", "learner", "unique")),
        per_token,
    ]


def _count(v: float) -> Any:
    return int(round(v)) if np.isfinite(v) else v


HEADERS = [
    "trainer",
    "step s",
    "generation s",
    "reference s",
    "update s",
    "other s",
    "generated tok",
    "learner tok",
    "unique tok",
    "gen ms/tok",
]


def main(args: argparse.Namespace) -> int:
    """Run the study and write ``<out>/trl.md``."""
    if args.quick:
        args.steps, args.prompts, args.max_new_tokens = 2, 1, 8
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown or not names:
        raise SystemExit(f"--workloads: unknown {unknown}; use {', '.join(WORKLOADS)}")
    if args.malloc == "keep":
        keep_freed_memory()
    print(f"allocator (--malloc {args.malloc}): {MALLOC[args.malloc]}", flush=True)
    report = Report(args.out, "trl", "branchgym bench trl")
    have_trl = importlib.util.find_spec("trl") is not None
    n = 1 + args.m * (args.k - 1)
    report.add(
        f"Model `{args.model}`, {ENV}, {args.prompts} prompt(s) per step, N = {n} "
        f"completions per prompt (bpo: M = {args.m}, K = {args.k}, schedule even; bpo depths: "
        "the same points fixed in advance, siblings overlapped with the backbone), replies "
        f"<= {args.max_new_tokens} tokens, beta = {BETA}, one update per step, "
        f"{args.steps} steps each, {args.threads} torch thread(s), float32. Medians leave "
        f"out step 1 (warm-up). Allocator (`--malloc {args.malloc}`): {MALLOC[args.malloc]}."
    )
    if not have_trl:
        note = (
            "TRL is not installed (`pip install 'branchgym[trl]'`): only branchgym's learners "
            "were timed."
        )
        report.add(note)
        print(note, flush=True)
    plan: dict[str, list[tuple[str, Callable[..., dict[str, Any]]]]] = {
        "single turn": [("branchgym grpo", functools.partial(_branchgym, "grpo"))],
        "multi turn": [
            ("branchgym grpo", functools.partial(_branchgym, "grpo")),
            ("branchgym bpo", functools.partial(_branchgym, "bpo")),
            ("branchgym bpo depths", functools.partial(_branchgym, "bpo depths")),
        ],
    }
    if have_trl:
        plan["single turn"].append(("TRL GRPOTrainer", _trl_grpo))
        plan["multi turn"].append(("TRL BranchingGRPOTrainer", _trl_branching))
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        # one copy of the initial weights for every trainer (TRL loads its KL reference
        # from the policy's folder)
        from branchgym.agents.policies.models import load_model

        model, tok = load_model(args.model)
        args.folder = f"{tmp}/model"
        model.save_pretrained(args.folder)
        tok.save_pretrained(args.folder)
        del model
        for w in names:
            spec = WORKLOADS[w]
            runs[w] = {}
            for i, (label, fn) in enumerate(plan[w]):
                print(f"[{w}] {label}: {args.steps} steps ...", flush=True)
                t0 = time.perf_counter()
                runs[w][label] = fn(args, spec, f"{tmp}/{w.replace(' ', '_')}_{i}")
                print(f"[{w}] {label}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    lines = []
    for w in names:
        spec = WORKLOADS[w]
        report.add(
            f"### {w}: TextTreeMDP {spec['env_kwargs']}, episodes <= "
            f"{spec['max_episode_steps']} decision(s)"
        )
        rows = [_row(label, r) for label, r in runs[w].items()]
        print(f"\n{w}:")
        print(report.table(HEADERS, rows))
        trl = [r for r in rows if r[0].startswith("TRL")]
        for row in rows:
            if trl and not row[0].startswith("TRL"):
                lines.append(f"{w}: {row[0]} / {trl[0][0]} step time {row[1] / trl[0][1]:.2f}x")
        ours = {r[0]: r for r in rows}
        for label in ("branchgym bpo", "branchgym bpo depths"):
            if label in ours:
                ratio = ours[label][1] / ours["branchgym grpo"][1]
                lines.append(f"{w}: {label} / branchgym grpo step time {ratio:.2f}x")
    for line in lines:
        report.add(line)
        print(line)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 3.8), squeeze=False)
    for ax, w in zip(axes[0], names, strict=True):
        labels = list(runs[w])
        bottom = np.zeros(len(labels))
        for phase in (*PHASES, "other"):
            if phase == "other":
                vals = np.array([_median(_other(runs[w][x])) for x in labels])
            else:
                vals = np.array([_median(runs[w][x][phase]) for x in labels])
            ax.bar(labels, vals, bottom=bottom, label=phase)
            bottom += vals
        ax.set_ylabel("median step time (s)")
        ax.set_title(w)
        ax.tick_params(axis="x", labelrotation=15, labelsize=8)
    axes[0][0].legend()
    fig.tight_layout()
    report.figure(fig, "step_time", "Median step time per trainer, split by phase")
    report.data = runs
    path = report.save()
    print(f"\nreport: {path}")
    return 0
