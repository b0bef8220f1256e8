"""Branching rollout trees inside TRL: :class:`BranchingGRPOTrainer`, a ``trl.GRPOTrainer``.

For each prompt (an env reset seed) of a generation batch, the trainer grows branchgym
rollout trees on a branchgym env through its own model (an
:class:`~branchgym.agents.engines.hf.HFEngine` and
:class:`~branchgym.agents.policies.policy.LLMPolicy` over the trainer's model, so the sampler is
the model being trained), computes per-token advantages with one of branchgym's
estimators (:data:`ESTIMATORS`), and hands TRL one row per root-to-leaf path:

* the prompt is the opening of the path's dialogue, cut at the same length in every row
  (the earliest first owned token, so no prompt is left-padded and every token keeps its
  sampling position); the completion is the rest of the path (replies and the env's
  observation turns between them);
* ``tool_mask`` (TRL's multi-turn loss mask) is 1 on the tokens the path owns, so
  observation tokens are masked out and a shared prefix is counted once, by the path that
  owns it (the ownership masks of :class:`~branchgym.agents.forward.rows.Batch`);
* ``advantages`` are ``(rows, tokens)``, each decision's advantage on its tokens;
* ``old_per_token_logps`` are the sampler's log-probs (the behaviour policy of the tree),
  so the PPO ratio is the one branchgym's learners use.

TRL's own loss (``GRPOTrainer._compute_loss``) then trains on them. Its aggregations that
match branchgym's (:data:`LOSS_AGGREGATIONS`): ``loss_type="dapo"`` is ``token-mean``
(branchgym's ``bpo`` default, eq. 6), ``"grpo"`` is ``seq-mean-token-mean`` and
``"luspo"`` is ``seq-mean-token-sum``; the tests check the gradients equal the ``bpo``
learner's. ``bnpo`` is ``token-mean`` per micro-batch and ``dr_grpo`` divides by a constant,
which branchgym has no name for.

TRL has no public hook for rollouts that are not one completion per prompt copy, so the
trainer overrides the private ``GRPOTrainer._generate_and_score_completions`` (the
extension point TRL's maintainers suggest, trl#4525), in this one place.
:func:`check_hook` verifies, when a trainer is built, that the installed TRL still has
the hook and loss this module was written against (:data:`TRL_VERSIONS`), and says which
TRL version differs if not.

Requires the ``trl`` extra (``pip install 'branchgym[trl]'``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from branchgym.agents.estimators import advantages
from branchgym.agents.forward.rows import Batch
from branchgym.agents.learners import bpo, grpo
from branchgym.agents.policies.policy import LLMPolicy
from branchgym.agents.training.metrics import advantage_metrics, rollout_metrics
from branchgym.agents.training.policy_kinds import PolicyKind
from branchgym.error import DependencyMissingError, IntegrationError, TrainingConfigError
from branchgym.rollout.batch import run_batched
from branchgym.rollout.executor_base import EnvRecipe, Executor
from branchgym.rollout.grow import group_rollouts, grow_tree
from branchgym.rollout.tree import RolloutTree

try:
    import torch
    import trl
    from packaging.version import Version
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import use_adapter
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra(
        "branchgym.integrations.trl", "trl", exc.name or "trl"
    ) from exc

__all__ = [
    "ESTIMATORS",
    "HOOK",
    "HOOK_OUTPUT_KEYS",
    "LOSS_AGGREGATIONS",
    "TRL_VERSIONS",
    "BranchingArgs",
    "BranchingGRPOTrainer",
    "check_hook",
    "check_hook_output",
    "reset_seeds",
]

#: TRL versions this module was written against (the ``trl`` extra's pin).
TRL_VERSIONS = (Version("1.16"), Version("1.17"))
#: The private GRPOTrainer method the trainer overrides, and its parameters.
HOOK = "_generate_and_score_completions"
HOOK_PARAMETERS = ("self", "inputs")
#: Keys of the hook's output that TRL's loss reads (``_compute_loss``) in the pinned TRL.
HOOK_OUTPUT_KEYS = (
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "advantages",
    "num_items_in_batch",
)
#: What ``_compute_loss`` must still read: per-token advantages, loss mask, behaviour log-probs.
_LOSS_READS = (
    'inputs["advantages"]',
    "advantages.dim() == 1",
    '"tool_mask"',
    '"old_per_token_logps"',
)
#: TRL loss_type -> the branchgym aggregation (``losses.AGGREGATIONS``) it computes.
LOSS_AGGREGATIONS = {
    "dapo": "token-mean",
    "grpo": "seq-mean-token-mean",
    "luspo": "seq-mean-token-sum",
}
#: Estimator -> (learner, credit or advantage): ``bpo*`` trees, ``grpo``/``rloo`` N rollouts.
ESTIMATORS = {
    "bpo": ("bpo", "lambda"),
    "bpo-root": ("bpo", "root"),
    "bpo-value_diff": ("bpo", "value_diff"),
    "grpo": ("grpo", "grpo"),
    "rloo": ("grpo", "rloo"),
}


def _version_note() -> str:
    lo, hi = TRL_VERSIONS
    return (
        f"branchgym.integrations.trl wraps TRL's private GRPOTrainer.{HOOK}, written "
        f"against trl>={lo},<{hi}; the installed trl is {trl.__version__}. Install a "
        f"supported version (pip install 'branchgym[trl]') or update this module."
    )


def check_hook(trainer_class: type = GRPOTrainer) -> None:
    """Raise :class:`IntegrationError` unless ``trainer_class`` has the hook this module wraps.

    Checks the installed TRL's version against :data:`TRL_VERSIONS`, the hook's
    parameters (:data:`HOOK_PARAMETERS`), and that ``_compute_loss`` still reads
    per-token advantages, ``tool_mask`` and ``old_per_token_logps`` from it.
    """
    lo, hi = TRL_VERSIONS
    version = Version(trl.__version__)
    if not lo <= version < hi:
        raise IntegrationError(f"unsupported TRL version. {_version_note()}")
    hook = getattr(trainer_class, HOOK, None)
    if hook is None or not callable(hook):
        raise IntegrationError(f"GRPOTrainer has no method {HOOK}. {_version_note()}")
    params = tuple(inspect.signature(hook).parameters)
    if params != HOOK_PARAMETERS:
        raise IntegrationError(
            f"GRPOTrainer.{HOOK} takes {params}, not {HOOK_PARAMETERS}. {_version_note()}"
        )
    loss = getattr(trainer_class, "_compute_loss", None)
    source = inspect.getsource(loss) if loss is not None else ""
    missing = [s for s in _LOSS_READS if s not in source]
    if missing:
        raise IntegrationError(
            f"GRPOTrainer._compute_loss no longer reads {missing} from the hook's output. "
            f"{_version_note()}"
        )


def check_hook_output(output: dict[str, Any]) -> None:
    """Raise :class:`IntegrationError` unless a hook output has :data:`HOOK_OUTPUT_KEYS`."""
    missing = [k for k in HOOK_OUTPUT_KEYS if k not in output]
    if missing:
        raise IntegrationError(
            f"GRPOTrainer.{HOOK} no longer returns {missing} (it returns {sorted(output)}). "
            f"{_version_note()}"
        )


def reset_seeds(n: int, seed: int = 0) -> Any:
    """A train set of ``n`` env reset seeds (``seed``; ``prompt`` only names it in logs)."""
    import datasets

    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise TrainingConfigError(f"reset_seeds needs n >= 1 prompts; got {n!r}.")
    seeds = [int(s) for s in np.random.default_rng(seed).integers(0, 2**31 - 1, size=n)]
    return datasets.Dataset.from_dict({"prompt": [f"reset seed {s}" for s in seeds], "seed": seeds})


#: BranchingArgs fields that are bpo.Args options of the same name.
_BPO_OPTIONS = (
    "m", "k", "schedule", "entropy_reduce", "min_gap", "gap_unit", "fill", "lam", "tail",
    "keep", "env_noise", "fallback_n", "backbone_credit", "backbones", "depth_weight",
)  # fmt: skip


@dataclasses.dataclass
class BranchingArgs:
    """How the trainer grows trees and credits their tokens (a learner's rollout options).

    Defaults are branchgym's ``bpo`` learner's (docs/algorithms.md §1) with shorter replies.
    """

    estimator: str = "bpo"
    """A key of :data:`ESTIMATORS`: ``bpo`` (eq. 4-5, the spec), ``bpo-root`` and
    ``bpo-value_diff`` (docs/estimators.md's unbiased credit), ``grpo`` or ``rloo``."""
    m: int = 2
    """Branch points M per backbone (``bpo*``); with ``grpo``/``rloo`` only the default N."""
    k: int = 4
    """Siblings K per branch point, the backbone's own included."""
    n: int | None = None
    """Rollouts per prompt N of ``grpo``/``rloo``; default ``1 + M(K - 1)``."""
    schedule: str = "entropy"
    """Branch schedule (``bpo``'s ``schedule`` option)."""
    entropy_reduce: str = "mean"
    """H_t of an action from its tokens' entropies: ``mean``, ``first`` or ``sum``."""
    min_gap: int | None = None
    """Delta_min between branch points (``bpo``'s default when None)."""
    gap_unit: str = "auto"
    """Unit of ``min_gap``: ``tokens``, ``steps`` or ``auto``."""
    fill: bool = False
    """Top up to M branch points when the gap rule leaves fewer."""
    lam: float = 0.95
    """lambda of eq. (5)."""
    tail: str = "last"
    """Steps after a path's last branch point: ``last`` or ``zero``."""
    backbones: int = 1
    """Backbones G per prompt (``bpo-root``/``bpo-value_diff`` need 2 or more)."""
    backbone_credit: str = "include"
    """``include`` (spec) or ``exclude`` (the backbone's own decisions get 0)."""
    depth_weight: bool = False
    """Scale advantages by N / n_t (docs/estimators.md)."""
    keep: str = "snapshot"
    """How candidate branch states are kept: ``snapshot`` or ``replay``."""
    env_noise: str = "fresh"
    """``fresh`` or ``shared`` env randomness of siblings after a restore."""
    fallback_n: int = 7
    """Independent backbones per prompt when M = 0 or K = 1 (RLOO baseline)."""
    max_new_tokens: int = 48
    """Cap on tokens per reply."""
    max_episode_steps: int | None = None
    """Truncate episodes after this many decisions (default: the env's limit)."""
    success_threshold: float = 1.0
    """Return at or above which a rollout counts as a success (``charts/success``)."""

    def learner_args(self) -> bpo.Args | grpo.Args:
        """The branchgym learner's Args these options stand for, checked."""
        if self.estimator not in ESTIMATORS:
            raise TrainingConfigError(
                f"no estimator called {self.estimator!r}; use one of {', '.join(ESTIMATORS)}."
            )
        learner, variant = ESTIMATORS[self.estimator]
        common = {
            "max_new_tokens": self.max_new_tokens,
            "max_episode_steps": self.max_episode_steps,
            "success_threshold": self.success_threshold,
            "beta": 0.0,  # the KL term is TRL's (GRPOConfig.beta)
        }
        if learner == "grpo":
            args: bpo.Args | grpo.Args = grpo.Args(
                advantage=variant, n=self.n, m=self.m, k=self.k, **common
            )
        else:
            tree = {f: getattr(self, f) for f in _BPO_OPTIONS}
            args = bpo.Args(credit=variant, **tree, **common)
        args.check()
        return args


def _env_return(prompts: Any, completions: Any, **kwargs: Any) -> list[float]:
    """GRPOTrainer's reward function slot; the env's returns are the reward here.

    The branching hook reads rewards from the trees and never calls reward functions, so
    this runs only if TRL scored completions itself, i.e. bypassed the hook.
    """
    raise IntegrationError(
        f"TRL called a reward function, so it did not go through the branching hook. "
        f"{_version_note()}"
    )


_env_return.__name__ = "env_return"  # TRL's logs name rewards after their function


class BranchingGRPOTrainer(GRPOTrainer):
    """A ``trl.GRPOTrainer`` that trains on branchgym rollout trees.

    Each generation batch holds ``generation_batch_size / num_generations`` distinct
    prompts (TRL repeats each ``num_generations`` times; here one copy stands for the
    prompt): each grows its trees (:class:`BranchingArgs`), and the rows TRL trains on
    are the trees' root-to-leaf paths (module docstring).

    Args:
        model: A causal LM (or its name/folder, as ``GRPOTrainer`` takes it).
        env: A registered env id (with ``env_kwargs``), an :class:`EnvRecipe`, or a
            zero-argument factory returning the env.
        env_kwargs: Keyword arguments of ``gym.make`` for an env id.
        branching: Tree and estimator options (default: ``bpo``'s).
        args: TRL's ``GRPOConfig``; ``temperature`` must be 1 and ``top_p``, ``top_k``,
            ``min_p`` and ``repetition_penalty`` off (the trees sample the whole distribution
            at temperature 1, refused with a typed error otherwise), and ``use_vllm`` off
            (the trainer's model samples).
        train_dataset: Rows with an integer ``seed`` column (default :func:`reset_seeds`).
        processing_class: The model's tokenizer.
        prompt: A :class:`~branchgym.agents.policies.prompts.PromptBuilder` (default: the one
            registered for the env id).
        prompts: Prompts of the default train set.
        executor: Where sandboxes run: a name (``inprocess``, ``thread``, ``process``) or
            an :class:`~branchgym.rollout.executor_base.Executor` the caller owns.
        **kwargs: Passed to ``GRPOTrainer`` (callbacks, peft_config, ...).
    """

    def __init__(
        self,
        model: Any,
        env: str | EnvRecipe | Callable[[], Any],
        *,
        env_kwargs: dict[str, Any] | None = None,
        branching: BranchingArgs | None = None,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        prompt: Any = None,
        prompts: int = 256,
        executor: str | Executor = "inprocess",
        **kwargs: Any,
    ) -> None:
        """Check TRL's hook and the options, then set up GRPOTrainer."""
        check_hook(GRPOTrainer)  # the parent's hook and loss, which this class builds on
        self.branching = branching or BranchingArgs()
        self.learner_args = self.branching.learner_args()
        self.recipe = _recipe(env, env_kwargs)
        if args is not None:
            if args.temperature != 1.0:
                raise TrainingConfigError(
                    f"GRPOConfig.temperature={args.temperature}: the trees sample at temperature "
                    "1 (the distribution branchgym's losses treat as pi_old); set temperature=1.0."
                )
            offs = {"top_p": (1.0,), "top_k": (0,), "min_p": (0.0,), "repetition_penalty": (1.0,)}
            truncated = {k: getattr(args, k, None) for k in offs}
            truncated = {k: v for k, v in truncated.items() if v not in (None, *offs[k])}
            if truncated:
                raise TrainingConfigError(
                    f"GRPOConfig {truncated}: the trees sample the model's whole distribution "
                    "(what branchgym's losses treat as pi_old, and the log-probs they record); "
                    "a truncated or penalised sampler would train on another policy's samples. "
                    "Set top_p=1.0, top_k=0, min_p=None and repetition_penalty=1.0."
                )
            named = isinstance(model, str) or getattr(model.config, "_name_or_path", "")
            if args.beta != 0 and not named and kwargs.get("peft_config") is None:
                raise TrainingConfigError(
                    f"GRPOConfig.beta={args.beta}: TRL loads its KL reference from the model's "
                    "name or folder, and this model has none; save it (save_pretrained) and "
                    "pass the folder, or set beta=0."
                )
            if args.use_vllm:
                raise TrainingConfigError(
                    "GRPOConfig.use_vllm: BranchingGRPOTrainer grows trees through the "
                    "trainer's own model (HFEngine); set use_vllm=False."
                )
        if train_dataset is None:
            train_dataset = reset_seeds(prompts, seed=args.seed if args is not None else 0)
        kwargs.setdefault("reward_funcs", [_env_return])
        self.prompt = prompt
        self.executor = executor
        self._policy: LLMPolicy | None = None
        super().__init__(
            model,
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            **kwargs,
        )

    # ------------------------------------------------------------------ the sampler
    def branch_policy(self) -> LLMPolicy:
        """The policy trees grow with: an LLMPolicy on an HFEngine over the trainer's model."""
        if self._policy is None:
            from branchgym.agents.engines.hf import HFEngine

            model = self.accelerator.unwrap_model(self.model)
            param = next(model.parameters())
            was_training = model.training
            engine = HFEngine(
                model,
                self.processing_class,
                device=str(param.device),
                dtype=param.dtype,
                max_new_tokens=self.branching.max_new_tokens,
            )
            model.train(was_training)  # HFEngine switches the model to eval
            self._policy = LLMPolicy(
                engine, self.prompt, max_new_tokens=self.branching.max_new_tokens
            )
        return self._policy

    def _rng(self, *key: int) -> np.random.Generator:
        """Randomness keyed by (seed, step, process, prompt, backbone): a step replays."""
        return np.random.default_rng(
            [self.args.seed, self.state.global_step, self.accelerator.process_index, *key]
        )

    def grow(self, seeds: Sequence[int]) -> tuple[list[RolloutTree], list[int]]:
        """Grow each prompt's trees with the current model: ``(trees, prompt of each tree)``."""
        la = self.learner_args
        jobs: list[Callable[..., Any]] = []
        groups: list[int] = []
        for i, s in enumerate(seeds):
            if isinstance(la, grpo.Args) or not la.branching:
                n = la.group_size if isinstance(la, grpo.Args) else la.fallback_n
                jobs.append(
                    functools.partial(
                        group_rollouts,
                        self.recipe,
                        n=n,
                        seed=s,
                        rng=self._rng(i),
                        max_steps=la.max_episode_steps,
                    )
                )
                groups.append(i)
                continue
            given = {
                "reduce": la.entropy_reduce,
                "min_gap": la.min_gap,
                "gap_unit": la.gap_unit,
                "fill": la.fill,
            }
            for j in range(la.backbones):
                jobs.append(
                    functools.partial(
                        grow_tree,
                        self.recipe,
                        schedule=bpo.LOCAL_SCHEDULES.get(la.schedule, la.schedule),
                        m=la.m,
                        k=la.k,
                        seed=s,
                        rng=self._rng(i) if j == 0 else self._rng(i, j),
                        keep=la.keep,
                        max_steps=la.max_episode_steps,
                        schedule_options={k: given[k] for k in bpo.SCHEDULE_OPTIONS[la.schedule]},
                        env_noise=la.env_noise,
                    )
                )
                groups.append(i)
        policy = self.branch_policy()
        policy.engine.clear_cache()  # its prefix KV cache holds activations of old weights
        model = self.accelerator.unwrap_model(self.model)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), self.accelerator.autocast():
                trees = run_batched(jobs, policy, self.executor)
        finally:
            model.train(was_training)
        return trees, groups

    # ------------------------------------------------------------------ credit
    def score(
        self, trees: Sequence[RolloutTree], groups: Sequence[int]
    ) -> tuple[Batch, dict[str, float]]:
        """Rows of the trees with their per-token advantages, and the tree metrics."""
        la = self.learner_args
        trees = list(trees)
        options = advantages.AdvantageOptions.of(la)
        if isinstance(la, grpo.Args) or not la.branching:
            # a group baseline over each tree's independent rollouts (bpo's K = 1: rloo)
            name = la.advantage if isinstance(la, grpo.Args) else "rloo"
            per_tree, skipped, _ = advantages.per_prompt(name, trees, range(len(trees)), options)
            n_bp = n_degenerate = 0
        else:  # eq. 4-5, or a credit variant of docs/estimators.md, per prompt's trees
            name = advantages.CREDITS[la.credit]
            per_tree, n_degenerate, n_bp = advantages.per_prompt(name, trees, groups, options)
            skipped = sum(all(v == 0 for v in a.values()) for a in per_tree)
        batch = Batch(trees, list(groups), success_threshold=la.success_threshold)
        batch.set_advantages(lambda row, d: per_tree[row.tree][d.node])
        counted = list(batch.decisions())
        generated = sum(t.stats.generated_tokens for t in trees)
        independent = sum(t.stats.independent_tokens for t in trees)
        metrics = {
            **rollout_metrics(batch),
            **advantage_metrics([d.advantage for d in counted], [d.tree for d in counted]),
            "groups/skipped": float(skipped),
            "groups/total": float(len(trees)),
            "branching/degenerate_points": float(n_degenerate),
            "branching/tokens_saved": 1.0 - generated / independent if independent else 0.0,
            "branching/rows": float(len(batch.rows)),
        }
        return batch, metrics

    # ------------------------------------------------------------------ TRL rows
    def to_inputs(self, batch: Batch, *, multiple_of: int = 1) -> dict[str, Any]:
        """TRL's hook output for ``batch``: one row per path, owned tokens in ``tool_mask``.

        Rows are padded with empty ones (no counted token) to a multiple of
        ``multiple_of`` (TRL splits a generation batch into ``steps_per_generation``
        equal parts).
        """
        policy = self.branch_policy()
        device = self.accelerator.device
        pieces: list[tuple[list[int], list[tuple[int, int]], list[Any]]] = []
        split = 0
        for row in batch.rows:
            if not row.decisions:
                continue
            runs = PolicyKind.runs(policy, row)  # a dialogue longer than the context splits
            split += len(runs) - 1
            for run in runs:
                seq, spans = PolicyKind.sequence(policy, run)
                pieces.append((seq, spans, run.decisions))
        pad_id = self.processing_class.pad_token_id
        if pad_id is None:
            pad_id = self.processing_class.eos_token_id
        # Every row's prompt is cut at the same length, the earliest first owned token
        # (the tokens between it and a row's own first decision are masked out): prompts
        # then need no left padding, so every token keeps the position it had when it was
        # sampled (TRL passes no position ids; RoPE in float32 at shifted positions
        # changes log-probs by ~1e-5).
        cut = min([spans[0][0] for _, spans, _ in pieces], default=1)
        rows: list[tuple[list[int], list[int], np.ndarray, np.ndarray, np.ndarray]] = []
        for seq, spans, decisions in pieces:
            width = len(seq) - cut
            mask = np.zeros(width, dtype=np.int64)
            adv = np.zeros(width, dtype=np.float32)
            old = np.zeros(width, dtype=np.float32)
            for d, (a, b) in zip(decisions, spans, strict=True):
                mask[a - cut : b - cut] = (np.asarray(d.mask) > 0).astype(np.int64)
                adv[a - cut : b - cut] = d.advantage
                old[a - cut : b - cut] = d.old_logp
            rows.append((seq[:cut], seq[cut:], mask, adv, old))
        head = rows[0][0] if rows else [pad_id]
        while not rows or len(rows) % max(1, multiple_of):
            # a row with no counted token: it adds nothing to a token-sum loss
            empty = np.zeros(1, np.float32)
            rows.append((head, [pad_id], np.zeros(1, np.int64), empty, empty))
        p_len = max(len(r[0]) for r in rows)
        c_len = max(len(r[1]) for r in rows)
        n = len(rows)
        prompt_ids = torch.full((n, p_len), pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((n, p_len), dtype=torch.long)
        completion_ids = torch.full((n, c_len), pad_id, dtype=torch.long)
        completion_mask = torch.zeros((n, c_len), dtype=torch.long)
        tool_mask = torch.zeros((n, c_len), dtype=torch.long)
        advantages = torch.zeros((n, c_len), dtype=torch.float32)
        old_logps = torch.zeros((n, c_len), dtype=torch.float32)
        for i, (p, c, mask, adv, old) in enumerate(rows):
            prompt_ids[i, p_len - len(p) :] = torch.tensor(p)  # all of one length (above)
            prompt_mask[i, p_len - len(p) :] = 1
            completion_ids[i, : len(c)] = torch.tensor(c)
            completion_mask[i, : len(c)] = 1
            tool_mask[i, : len(c)] = torch.from_numpy(mask)
            advantages[i, : len(c)] = torch.from_numpy(adv)
            old_logps[i, : len(c)] = torch.from_numpy(old)
        out: dict[str, Any] = {
            "prompt_ids": prompt_ids.to(device),
            "prompt_mask": prompt_mask.to(device),
            "completion_ids": completion_ids.to(device),
            "completion_mask": completion_mask.to(device),
            "tool_mask": tool_mask.to(device),
            "advantages": advantages.to(device),
            "old_per_token_logps": old_logps.to(device),
        }
        out["num_items_in_batch"] = self.accelerator.gather(out["tool_mask"].sum()).sum()
        if self.beta != 0.0:
            out["ref_per_token_logps"] = self._reference_logps(out)
        out["split_rows"] = split
        return out

    @torch.no_grad()
    def _reference_logps(self, out: dict[str, Any]) -> Any:
        """The KL term's reference log-probs of the completion tokens (as GRPOTrainer's)."""
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        keep = out["completion_ids"].size(1)
        size = self.args.per_device_train_batch_size
        if self.ref_model is not None:
            lp, _, _ = self._get_per_token_logps_and_entropies(
                self.ref_model, ids, attention, keep, batch_size=size
            )
            return lp
        model = self.accelerator.unwrap_model(self.model)  # PEFT: the base model
        with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
            lp, _, _ = self._get_per_token_logps_and_entropies(
                self.model, ids, attention, keep, batch_size=size
            )
        return lp

    def tree_loss(self, batch: Batch) -> Any:
        """TRL's training loss on ``batch`` (one accumulation window), outside ``train()``.

        What one ``training_step`` computes on these rows: gradients and the equivalence
        tests read it without a training loop.
        """
        if not hasattr(self, "current_gradient_accumulation_steps"):
            # set by Trainer.train for each window; one window here
            self.current_gradient_accumulation_steps = self.args.gradient_accumulation_steps
        inputs = self.to_inputs(batch, multiple_of=self.args.steps_per_generation)
        self.model.train()
        with self.compute_loss_context_manager():
            return self.compute_loss(self.model, inputs)

    # ------------------------------------------------------------------ the hook
    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's rollout hook (the one private method this module wraps): trees, not copies."""
        mode = "train" if self.model.training else "eval"
        copies = self.num_generations if mode == "train" else self.num_generations_eval
        seeds = [_seed_of(x) for x in inputs[:: max(1, copies or 1)]]
        trees, groups = self.grow(seeds)
        batch, metrics = self.score(trees, groups)
        multiple = self.args.steps_per_generation if mode == "train" else 1
        out = self.to_inputs(batch, multiple_of=multiple)
        metrics["branching/split_rows"] = float(out.pop("split_rows"))
        returns = [r.reward for r in batch.rows]
        metrics["reward"] = float(np.mean(returns)) if returns else 0.0
        metrics["reward_std"] = float(np.std(returns)) if returns else 0.0
        for key, value in metrics.items():
            self._metrics[mode][key].append(float(value))
        return out


def _seed_of(example: dict[str, Any]) -> int:
    seed = example.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise TrainingConfigError(
            f"a train_dataset row needs an integer 'seed' column (the env's reset seed); got "
            f"{seed!r}. Build the train set with branchgym.integrations.trl.reset_seeds(n)."
        )
    return int(seed)


def _recipe(
    env: str | EnvRecipe | Callable[[], Any], env_kwargs: dict[str, Any] | None
) -> EnvRecipe:
    """The env as an :class:`EnvRecipe` (what the rollout jobs build sandboxes from)."""
    if isinstance(env, EnvRecipe):
        if env_kwargs:
            raise TrainingConfigError("give env_kwargs in the EnvRecipe, not beside it.")
        return env
    if isinstance(env, str):
        import gymnasium as gym

        import branchgym

        try:
            gym.spec(env)
        except gym.error.Error:
            branchgym.make(env)  # raises UnknownEnvError with "did you mean"
        return EnvRecipe(env, dict(env_kwargs or {}))
    if callable(env):
        if env_kwargs:
            raise TrainingConfigError("an env factory takes no env_kwargs; bind them in it.")
        name = getattr(env, "__name__", type(env).__name__)
        return EnvRecipe(name, {}, factory=env)
    raise TrainingConfigError(
        f"env must be an env id, an EnvRecipe or a factory; got {type(env).__name__}."
    )
