"""Branching rollout trees inside verl (extra ``verl``; docs/integrations.md, verl).

verl's PPO trainer asks an *agent loop* for each prompt's rollouts through its async LLM
server manager, then an *advantage estimator* turns the rewards into per-token
advantages. This module plugs branchgym into both registries:

* :class:`BranchingAgentLoop` (agent-loop name ``branchgym_tree``): grows one branchgym
  rollout tree per prompt (a backbone, M branch points, K-1 siblings restored from
  environment snapshots, algorithms.md §1) through verl's server manager
  (:class:`ServerEngine`, an engine for branchgym's
  :class:`~branchgym.agents.policies.policy.LLMPolicy`),
  and returns one :class:`AgentLoopOutput` per root-to-leaf path: the path's dialogue
  as ``response_ids``, a ``response_mask`` that is 1 only on the action tokens this path
  *owns* (observation tokens and a shared prefix owned by another path are 0, so every
  generated token is counted once, as branchgym's own rows), the behaviour log-probs,
  and the per-token advantages of branchgym's estimators
  (:data:`branchgym.agents.estimators.advantages.ADVANTAGES`: eq. 4-5 and the variants of
  docs/estimators.md) in ``extra_fields["branchgym_advantages"]``.
* ``branchgym`` in verl's advantage-estimator registry (:func:`tree_advantage`): hands
  those per-token advantages to the actor unchanged. They reach it as the batch's
  token-level scores (``rm_scores``: :meth:`PathOutput.as_dict` writes them there),
  because verl gives an estimator the token-level rewards, the response mask, the group
  ids and its config, and nothing else of the batch.

verl 0.9.1's default trainer (``trainer.use_v1=True``) stores every output of an agent
loop as its own row, so a tree's paths are rows as they are (``rollout.n`` = trees per
prompt, 1 for the spec). Its legacy trainer (``use_v1=False``) sends every prompt
``rollout.n`` times and expects ``rollout.n`` rows back per prompt:
:class:`BranchingAgentLoopManager` (``agent_loop_manager_class``) then grows one tree per
prompt, not one per copy, and its :class:`BranchingAgentLoopWorker` returns the paths as
those rows, padded with rows whose mask is all zero when a tree has fewer paths (a
backbone shorter than M decisions); ``rollout.n`` must be at least ``N = 1 + M(K - 1)``.

The server gives the log-prob of each sampled token but not the full distribution, so
the entropy of each token (the ``entropy`` schedule's eq. 3 input) is its surprisal
``-log mu(token)``, whose expectation over the sample is the entropy. The loop needs
``actor_rollout_ref.rollout.calculate_log_probs=True``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any
from uuid import uuid4

import numpy as np

from branchgym.error import DependencyMissingError, TrainingConfigError

try:
    import ray
    import torch
    from verl.experimental.agent_loop.agent_loop import (
        AgentLoopBase,
        AgentLoopManager,
        AgentLoopMetrics,
        AgentLoopOutput,
        AgentLoopWorker,
        register,
    )
    from verl.protocol import DataProto
    from verl.trainer.ppo.core_algos import register_adv_est
    from verl.utils.ray_utils import auto_await
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise DependencyMissingError.for_extra("branchgym.integrations.verl", "verl", "verl") from exc

from branchgym.rollout.executor_base import EnvRecipe
from branchgym.rollout.grow import grow_tree
from branchgym.rollout.policy import Context
from branchgym.rollout.tree import RolloutTree

__all__ = [
    "AGENT_NAME",
    "ESTIMATOR_NAME",
    "BranchingAgentLoop",
    "BranchingAgentLoopManager",
    "BranchingAgentLoopWorker",
    "PathOutput",
    "ServerEngine",
    "first_copies",
    "tree_advantage",
    "tree_metrics",
]

#: Name of the agent loop in verl's registry (``data.agent_name`` / ``default_agent_loop``).
AGENT_NAME = "branchgym_tree"
#: Name of the estimator in verl's registry (``algorithm.adv_estimator``).
ESTIMATOR_NAME = "branchgym"
#: Extra field of each output: its per-token advantages (0 where the mask is 0).
ADVANTAGES_FIELD = "branchgym_advantages"


@dataclasses.dataclass
class _Sampled:
    """One completion in the shape :class:`~branchgym.agents.policies.policy.LLMPolicy` reads."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    entropies: np.ndarray
    prefix_len: int
    entropies_top20: np.ndarray | None = None


class ServerEngine:
    """A branchgym generation engine over verl's async server manager.

    :class:`~branchgym.agents.policies.policy.LLMPolicy` calls :meth:`generate` from the thread
    that grows the tree; each completion is one ``server_manager.generate`` coroutine,
    scheduled on the agent loop's event loop, so a branch point's K - 1 siblings are
    requested concurrently and other prompts' agent loops keep running meanwhile.

    Args:
        server_manager: verl's ``LLMServerClient`` (anything with its ``generate``).
        tokenizer: The policy model's tokenizer (verl's).
        loop: The event loop the server manager's coroutines run on.
        sampling_params: verl's sampling parameters for this prompt.
        max_positions: Prompt plus response tokens the run allows.
    """

    #: One seed per batch (the server samples; branchgym's seeds do not reach it).
    per_prompt_seeds = False

    def __init__(
        self,
        server_manager: Any,
        tokenizer: Any,
        loop: asyncio.AbstractEventLoop,
        sampling_params: dict[str, Any],
        max_positions: int,
    ) -> None:
        """Bind the server manager, the tokenizer and the loop the coroutines run on."""
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.loop = loop
        self.sampling_params = dict(sampling_params)
        self.max_positions = int(max_positions)
        eos = tokenizer.eos_token_id
        self.stop_token_ids = tuple(eos if isinstance(eos, list) else [eos])
        #: Completions requested so far, and seconds waited for them.
        self.calls = 0
        self.wait_s = 0.0

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` (special tokens dropped)."""
        return self.tokenizer.decode([int(t) for t in token_ids], skip_special_tokens=True)

    async def _one(self, prompt_ids: list[int], prefix: list[int], max_new_tokens: int) -> _Sampled:
        params = {**self.sampling_params, "max_tokens": int(max_new_tokens), "logprobs": True}
        out = await self.server_manager.generate(
            request_id=uuid4().hex, prompt_ids=prompt_ids + prefix, sampling_params=params
        )
        if out.log_probs is None or len(out.log_probs) != len(out.token_ids):
            raise TrainingConfigError(
                "verl's server returned no log-prob per sampled token; set "
                "actor_rollout_ref.rollout.calculate_log_probs=True (branchgym's trees need "
                "the behaviour log-probs)."
            )
        new = np.asarray(out.log_probs, dtype=np.float32)
        # copied prefix tokens (a fork inside a turn) are never counted: log-prob 0 there
        lp = np.concatenate([np.zeros(len(prefix), dtype=np.float32), new])
        return _Sampled(
            token_ids=np.asarray([*prefix, *out.token_ids], dtype=np.int64),
            logprobs=lp,
            entropies=-lp,  # surprisal: an unbiased one-sample estimate of the entropy
            prefix_len=len(prefix),
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        ns: Sequence[int],
        *,
        prefixes: Sequence[Sequence[int]] | None = None,
        max_new_tokens: int = 48,
        seed: int | None = None,
        seeds: Sequence[int] | None = None,
    ) -> list[list[_Sampled]]:
        """``ns[i]`` completions of each prompt (called from a thread, never the loop's own)."""
        prefixes = prefixes or [[] for _ in prompts]
        coros = [
            self._one(list(map(int, p)), list(map(int, pre)), max_new_tokens)
            for p, n, pre in zip(prompts, ns, prefixes, strict=True)
            for _ in range(n)
        ]
        t0 = time.perf_counter()
        flat = asyncio.run_coroutine_threadsafe(_gather(coros), self.loop).result()
        self.wait_s += time.perf_counter() - t0
        self.calls += len(coros)
        out, pos = [], 0
        for n in ns:
            out.append(flat[pos : pos + n])
            pos += n
        return out


async def _gather(coros: list[Any]) -> list[Any]:
    return list(await asyncio.gather(*coros))


def tree_metrics(tree: RolloutTree, degenerate: int) -> dict[str, float]:
    """A tree's ``branching/*`` figures, as branchgym's own trainer logs them."""
    s = tree.stats
    restores = max(0, len(tree.paths()) - 1) if tree.branch_points() else 0
    return {
        "branching/tokens_saved": float(s.tokens_saved),
        "branching/branch_points": float(len(tree.branch_points())),
        "branching/degenerate_points": float(degenerate),
        "branching/snapshot_ms": 1000.0 * s.snapshot_s / max(s.snapshots_taken, 1),
        "branching/restore_ms": 1000.0 * s.restore_s / max(restores, 1),
        "branching/paths": float(len(tree.paths())),
    }


class PathOutput(AgentLoopOutput):
    """One path of a tree as verl's :class:`AgentLoopOutput`; its token scores are advantages.

    verl's v1 trainer stores ``as_dict()`` of each output and reads its ``rm_scores`` as
    the token-level scores; here they are the path's per-token advantages (0 off the
    mask), which the ``branchgym`` estimator hands on unchanged.
    """

    def as_dict(self) -> dict[str, Any]:
        """The fields of verl, with ``rm_scores`` the per-token advantages."""
        out = super().as_dict()
        values = self.extra_fields.get(ADVANTAGES_FIELD)
        if values is not None:
            mask = out["response_mask"].to(torch.float32)
            out["rm_scores"] = torch.tensor(values, dtype=torch.float32) * mask
        return out


@register(AGENT_NAME)
class BranchingAgentLoop(AgentLoopBase):
    """One branchgym rollout tree per prompt; one output per root-to-leaf path.

    verl builds it with its own arguments (``trainer_config``, ``server_manager``,
    ``tokenizer``, ...); the keyword options below come from the agent-loop YAML file
    (``actor_rollout_ref.rollout.agent.agent_loop_config_path``), as in docs/integrations.md.
    The dataset row's ``extra_info`` may set ``seed`` (the task instance; default: the
    row's ``index``), ``env_id`` and ``env_kwargs``.

    Args:
        env_id: branchgym environment id.
        env_kwargs: Keyword arguments of ``gym.make``.
        m: Branch points M per tree.
        k: Siblings K per branch point (the backbone's action included).
        schedule: Branch schedule (``entropy``, ``random``, ``even``, ...).
        lam: lambda of eq. 5.
        tail: Steps after a path's last branch point: ``last`` or ``zero``.
        credit: ``lambda`` (eq. 5), ``root`` or ``value_diff`` (docs/estimators.md).
        backbone_credit: ``include`` or ``exclude``.
        depth_weight: Scale each decision's advantage by ``N / n_t``.
        max_new_tokens: Tokens per action.
        max_episode_steps: Decisions per rollout (default: the env's limit).
        min_gap: Delta_min between branch points (the schedule's default when None).
        gap_unit: Unit of ``min_gap``: ``tokens``, ``steps`` or ``auto``.
        **kwargs: verl's own arguments, passed to ``AgentLoopBase``.
    """

    def __init__(
        self,
        *args: Any,
        env_id: str = "branchgym/TextTreeMDP-v0",
        env_kwargs: dict[str, Any] | None = None,
        m: int = 2,
        k: int = 4,
        schedule: str = "entropy",
        lam: float = 0.95,
        tail: str = "last",
        credit: str = "lambda",
        backbone_credit: str = "include",
        depth_weight: bool = False,
        max_new_tokens: int = 48,
        max_episode_steps: int | None = None,
        min_gap: int | None = None,
        gap_unit: str = "auto",
        **kwargs: Any,
    ) -> None:
        """Check the tree options (a typed error names the bad one) and bind verl's pieces."""
        super().__init__(*args, **kwargs)
        from branchgym.agents.learners.bpo import SCHEDULE_OPTIONS, Args

        self.env_id = str(env_id)
        self.env_kwargs = _plain(env_kwargs or {})
        # bpo's Args checks every tree and estimator option with the trainer's own messages
        self.args = Args(
            env_id=self.env_id,
            m=int(m),
            k=int(k),
            schedule=str(schedule),
            lam=float(lam),
            tail=str(tail),
            credit=str(credit),
            backbone_credit=str(backbone_credit),
            depth_weight=bool(depth_weight),
            max_new_tokens=int(max_new_tokens),
            max_episode_steps=max_episode_steps,
            min_gap=min_gap,
            gap_unit=str(gap_unit),
        )
        self.args.check()
        if not self.args.branching:
            raise TrainingConfigError(
                f"the branchgym_tree agent loop grows trees: m and k must be >= 1 and >= 2 "
                f"(got m={m}, k={k}); for independent rollouts use verl's own agent loops."
            )
        given = {
            "reduce": "mean",
            "min_gap": self.args.min_gap,
            "gap_unit": self.args.gap_unit,
            "fill": False,
        }
        self.schedule_options = {key: given[key] for key in SCHEDULE_OPTIONS[self.args.schedule]}

    @property
    def paths_per_tree(self) -> int:
        """At most ``N = 1 + M(K - 1)`` paths per tree."""
        return 1 + self.args.m * (self.args.k - 1)

    def policy(self, sampling_params: dict[str, Any], loop: asyncio.AbstractEventLoop) -> Any:
        """The LLM policy of branchgym on verl's server (the tokenizer's chat template)."""
        from branchgym.agents.policies.policy import LLMPolicy

        rc = self.rollout_config
        engine = ServerEngine(
            self.server_manager,
            self.tokenizer,
            loop,
            sampling_params,
            max_positions=int(rc.prompt_length) + int(rc.response_length),
        )
        return LLMPolicy(engine, max_new_tokens=self.args.max_new_tokens)

    async def grow(self, sampling_params: dict[str, Any], **kwargs: Any) -> tuple[RolloutTree, Any]:
        """Grow this prompt's tree; returns it and the policy that grew it."""
        info = _plain(kwargs.get("extra_info") or {})
        seed = int(info.get("seed", kwargs.get("index", 0)))
        env_id = str(info.get("env_id", self.env_id))
        env_kwargs = {**self.env_kwargs, **_plain(info.get("env_kwargs") or {})}
        if self.args.max_episode_steps is not None:
            env_kwargs.setdefault("max_episode_steps", int(self.args.max_episode_steps))
        loop = asyncio.get_running_loop()
        policy = self.policy(sampling_params, loop)
        schedule = _schedule(self.args.schedule)
        # grow_tree is synchronous (env steps, snapshots); in a thread it leaves the loop
        # free to run the server manager's coroutines it waits on
        tree = await loop.run_in_executor(
            None,
            functools.partial(
                grow_tree,
                EnvRecipe(env_id, env_kwargs),
                policy,
                schedule,
                m=self.args.m,
                k=self.args.k,
                seed=seed,
                rng=seed,
                max_steps=self.args.max_episode_steps,
                schedule_options=self.schedule_options,
            ),
        )
        return tree, policy

    def outputs(self, tree: RolloutTree, policy: Any, rows: int | None = None) -> list[Any]:
        """One :class:`PathOutput` per path of ``tree``, then zero-mask rows up to ``rows``.

        ``rows=None`` (verl's v1 trainer, which stores every output of a loop as its own
        row) returns the paths alone.
        """
        from branchgym.agents.estimators import advantages
        from branchgym.agents.forward.rows import path_decisions

        paths = tree.token_masks()
        rows = len(paths) if rows is None else int(rows)
        if len(paths) > rows:
            raise TrainingConfigError(
                f"the tree has {len(paths)} paths but verl asked for {rows} rows per prompt; "
                f"set actor_rollout_ref.rollout.n >= 1 + M(K - 1) = {self.paths_per_tree}."
            )
        out = advantages.advantage(advantages.CREDITS[self.args.credit])(
            [tree], advantages.AdvantageOptions.of(self.args)
        )
        adv, degenerate = out.nodes[0], out.degenerate
        figures = tree_metrics(tree, degenerate)
        head = policy.prompt_ids(Context(tree.env_id, tree.observation, tree.info))
        prompt_length = int(self.rollout_config.prompt_length)
        response_length = int(self.rollout_config.response_length)
        if len(head) > prompt_length:
            raise TrainingConfigError(
                f"the task prompt has {len(head)} tokens; raise "
                f"actor_rollout_ref.rollout.prompt_length (now {prompt_length})."
            )
        out = []
        for j, (path, masks) in enumerate(paths):
            decisions = path_decisions(tree, path, 0, masks)
            last = decisions[-1]
            seq = policy.prompt_ids(last.context) + [int(t) for t in last.token_ids]
            response = seq[len(head) :]
            if len(response) > response_length:
                raise TrainingConfigError(
                    f"a path's dialogue has {len(response)} response tokens; raise "
                    f"actor_rollout_ref.rollout.response_length (now {response_length}) or "
                    "lower max_episode_steps / max_new_tokens (cutting it would drop counted "
                    "tokens and change the estimator's gradient)."
                )
            mask = np.zeros(len(response), dtype=np.int64)
            advantages = np.zeros(len(response), dtype=np.float64)
            logprobs = np.zeros(len(response), dtype=np.float64)
            for d in decisions:
                a = len(policy.prompt_ids(d.context)) - len(head)
                b = a + d.n_tokens
                if response[a:b] != [int(t) for t in d.token_ids]:
                    raise TrainingConfigError(
                        "a decision's tokens are not where its prompt puts them (the prompt "
                        "dropped earlier turns to fit the context); raise prompt_length + "
                        "response_length or lower max_episode_steps."
                    )
                mask[a:b] = d.mask.astype(np.int64)
                advantages[a:b] = adv[d.node] * d.mask
                logprobs[a:b] = d.old_logp
            ret = float(tree.path_returns_to_go(path)[0]) if path else 0.0
            out.append(
                self._output(head, response, mask, logprobs, advantages, ret, len(path), j, figures)
            )
        pad = [int(self.tokenizer.eos_token_id)]
        for j in range(len(paths), rows):  # a short tree: rows that count no token
            out.append(self._output(head, pad, [0], [0.0], [0.0], 0.0, 0, j, figures, padding=True))
        return out

    @staticmethod
    def _output(
        head: list[int],
        response: Sequence[int],
        mask: Sequence[int],
        logprobs: Sequence[float],
        advantages: Sequence[float],
        ret: float,
        turns: int,
        index: int,
        figures: dict[str, float],
        *,
        padding: bool = False,
    ) -> Any:
        return PathOutput(
            prompt_ids=list(head),
            response_ids=[int(t) for t in response],
            response_mask=[int(x) for x in mask],
            response_logprobs=[float(x) for x in logprobs],
            reward_score=float(ret),  # verl's reward loop is skipped: the tree has returns
            num_turns=2 * turns + 1,
            metrics=AgentLoopMetrics(),
            extra_fields={
                ADVANTAGES_FIELD: [float(x) for x in advantages],
                "branchgym_path": int(index),
                "branchgym_padding": bool(padding),
                "branchgym_metrics": dict(figures),
                "branchgym_return": float(ret),
                # verl's v1 worker copies the last output's reward info to the others:
                # each path's own return lives in branchgym_return instead
                "reward_extra_info": {},
                "turn_scores": [],
                "tool_rewards": [],
            },
        )

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> list[Any]:
        """Grow the tree of this prompt and return its paths (verl's agent-loop entry point).

        ``branchgym_rows`` (set by :class:`BranchingAgentLoopManager` for verl's legacy
        trainer) is how many rows the trainer expects for this prompt; without it (verl's
        v1 trainer) the outputs are the tree's paths.
        """
        t0 = time.perf_counter()
        tree, policy = await self.grow(sampling_params, **kwargs)
        rows = kwargs.get("branchgym_rows")
        outs = self.outputs(tree, policy, None if rows is None else int(rows))
        elapsed = time.perf_counter() - t0
        for o in outs:
            o.metrics.generate_sequences = elapsed / len(outs)
        return outs


@register_adv_est(ESTIMATOR_NAME)
def tree_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``branchgym`` estimator of verl: the tree's per-token advantages, unchanged.

    :class:`BranchingAgentLoopWorker` puts them in the token-level scores, so they arrive
    here as ``token_level_rewards``; they are returned masked (they are 0 off the mask
    already) as both advantages and returns. A KL penalty in the reward
    (``algorithm.use_kl_in_reward``) would have been subtracted from them on the way, so
    it is refused: use the actor's KL loss (``actor.use_kl_loss``) instead.
    """
    if config is not None and bool(_get(config, "use_kl_in_reward", False)):
        raise TrainingConfigError(
            "algorithm.adv_estimator=branchgym receives the tree's advantages as the token "
            "scores, and use_kl_in_reward would subtract a KL penalty from them; set "
            "algorithm.use_kl_in_reward=False (use actor_rollout_ref.actor.use_kl_loss=True)."
        )
    advantages = token_level_rewards * response_mask
    return advantages, advantages.clone()


class BranchingAgentLoopWorker(AgentLoopWorker):
    """verl's agent-loop worker, taking a list of outputs (one per path) from an agent loop.

    Each path is padded as verl pads any output; the rows of one prompt then stand in
    for its ``rollout.n`` copies, the prompt's dataset fields repeated for each, and the
    per-token advantages become the batch's token-level scores (``rm_scores``).
    """

    async def _agent_loop_postprocess(self, output: Any, validate: bool, **kwargs: Any) -> Any:
        parent = super()._agent_loop_postprocess
        if isinstance(output, list):
            return [await parent(o, validate, **kwargs) for o in output]
        return await parent(output, validate, **kwargs)

    def _postprocess(
        self,
        inputs: list[Any],
        input_non_tensor_batch: dict | None = None,
        validate: bool = False,
    ) -> DataProto:
        counts = [len(x) if isinstance(x, list) else 1 for x in inputs]
        flat = [o for x in inputs for o in (x if isinstance(x, list) else [x])]
        repeated = None
        if input_non_tensor_batch:
            repeated = {k: np.repeat(v, counts, axis=0) for k, v in input_non_tensor_batch.items()}
        tree_rows = [ADVANTAGES_FIELD in o.extra_fields for o in flat]
        if any(tree_rows) and not all(tree_rows):
            raise TrainingConfigError(
                "a batch mixes the branchgym_tree agent loop with other agent loops; the "
                "branchgym estimator needs every row's advantages: use one agent loop."
            )
        width = int(self.rollout_config.response_length)
        scores = torch.zeros(len(flat), width, dtype=torch.float32)
        if all(tree_rows):
            for i, o in enumerate(flat):
                values = o.extra_fields.pop(ADVANTAGES_FIELD)
                scores[i, : len(values)] = torch.tensor(values, dtype=torch.float32)
        out = super()._postprocess(flat, input_non_tensor_batch=repeated, validate=validate)
        if all(tree_rows):
            out.batch["rm_scores"] = scores * out.batch["response_mask"]
        return out


def first_copies(prompts: DataProto, n: int) -> DataProto:
    """The first of each prompt's ``n`` interleaved copies (verl's ``repeat(n, interleave)``).

    Raises :class:`TrainingConfigError` when the batch is not ``n`` copies of each prompt
    (their ``uid`` differs within a group).
    """
    if n < 1 or len(prompts) % n:
        raise TrainingConfigError(
            f"the rollout batch has {len(prompts)} rows, not a multiple of rollout.n={n}."
        )
    uid = prompts.non_tensor_batch.get("uid")
    if uid is not None:
        groups = np.asarray(uid, dtype=object).reshape(-1, n)
        if not all(len(set(g.tolist())) == 1 for g in groups):
            raise TrainingConfigError(
                "the rollout batch is not rollout.n interleaved copies of each prompt; the "
                "branchgym manager grows one tree per prompt and needs verl's repeat(n, "
                "interleave=True)."
            )
    firsts = prompts.select_idxs(np.arange(0, len(prompts), n))
    firsts.non_tensor_batch["branchgym_rows"] = np.full(len(firsts), n, dtype=np.int64)
    return firsts


class BranchingAgentLoopManager(AgentLoopManager):
    """verl's agent-loop manager with one tree per prompt (``agent_loop_manager_class``).

    The trainer sends each prompt ``n`` times (``rollout.n``, or ``val_kwargs.n`` when
    validating); the manager sends each prompt once to a
    :class:`BranchingAgentLoopWorker`, whose agent loop returns ``n`` rows for it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """The manager of verl, with branchgym's workers."""
        self.agent_loop_workers_class = ray.remote(BranchingAgentLoopWorker)
        super().__init__(*args, **kwargs)

    @auto_await
    async def generate_sequences(self, prompts: DataProto) -> DataProto:
        """One tree per prompt over the workers; ``n`` rows per prompt back, in order."""
        validate = prompts.meta_info.get("validate", False)
        rc = self.rollout_config
        n = int(rc.val_kwargs.n if validate else rc.n)
        if "priority" not in prompts.non_tensor_batch:
            prompts.non_tensor_batch["priority"] = np.arange(len(prompts), dtype=np.int64)
        firsts = first_copies(prompts, n)
        parts = np.array_split(
            np.arange(len(firsts)), min(len(self.agent_loop_workers), len(firsts))
        )
        outputs = await asyncio.gather(
            *[
                worker.generate_sequences.remote(firsts.select_idxs(idx))
                for worker, idx in zip(self.agent_loop_workers, parts, strict=False)
            ]
        )
        output = DataProto.concat(outputs)
        metrics = [o.meta_info.pop("metrics") for o in outputs]
        timing = self._performance_metrics(metrics, output)
        output.meta_info = {"timing": timing, **outputs[0].meta_info}
        return output


def _schedule(name: str) -> Any:
    from branchgym.agents.learners.bpo import LOCAL_SCHEDULES

    return LOCAL_SCHEDULES.get(name, name)


def _get(config: Any, key: str, default: Any) -> Any:
    getter = getattr(config, "get", None)
    return getter(key, default) if callable(getter) else getattr(config, key, default)


def _plain(value: Any) -> Any:
    """OmegaConf containers (hydra's arguments) and numpy objects as plain Python."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, DictConfig | ListConfig):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf comes with verl
        pass
    if isinstance(value, np.ndarray) and value.shape == ():
        return value.item()
    return dict(value) if isinstance(value, dict) else value
