"""Supervised warm start from scripted experts (the sources initialise RL from SFT).

1. Play ``episodes`` episodes with the env's scripted expert
   (:data:`~branchgym.agents.policies.experts.EXPERTS`):
   TextTreeMDP's optimal policy (``TreeMDP.optimal_policy``), WebShop's scripted shopper,
   ALFWorld's planner. With probability ``noise`` a uniformly random admissible action
   is taken instead, so the data also shows states off the expert's path; those noisy
   steps stay in the dialogue as context but are not trained on, so every label is the
   expert's own action.
2. Each expert action is written as the reply the policy would give
   (``"Action: <action>"`` and the end-of-turn token) and spliced into the dialogue as
   tokens, exactly as rollouts are.
3. Minimise the negative log-likelihood of the labelled replies (token mean), through
   the same log-prob pass the RL learners use: for ``policy="generate"`` the tokens of
   the reply, for ``policy="scoring"`` the softmax over the admissible replies (a
   cross-entropy over actions).

The result is a model folder (``<out_dir>/checkpoint-NNNNNN``) to start RL from
(``--model``) or to serve as an OPD teacher (``--set teacher=``); with ``noise=0`` on
TextTreeMDP the model learns the optimal policy itself.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from tqdm import tqdm

from branchgym.agents.estimators import losses
from branchgym.agents.policies.experts import AUTO_EXPERTS, EXPERTS
from branchgym.agents.training.run import (
    Batch,
    Chunk,
    Run,
    TrainArgs,
    TrainResult,
    require,
    require_one_of,
    success_of,
)
from branchgym.error import TrainingConfigError
from branchgym.rollout.policy import admissible_actions
from branchgym.rollout.tree import RolloutTree

__all__ = ["AUTO_EXPERTS", "EXPERTS", "Args", "collect", "loss", "main"]

@dataclasses.dataclass
class Args(TrainArgs):
    """SFT options. ``steps`` counts optimizer updates of ``batch_episodes`` episodes each."""

    expert: str = "auto"
    """A key of :data:`EXPERTS`, or ``auto`` (by env id)."""
    episodes: int = 256
    """Expert episodes collected once, before training."""
    batch_episodes: int = 16
    """Episodes per optimizer update (epochs = steps * batch_episodes / episodes)."""
    noise: float = 0.1
    """Probability of a uniformly random admissible action instead of the expert's (the
    step is context, not a label); 0 follows the expert exactly."""
    steps: int = 64
    """Optimizer updates."""
    lr: float = 1e-5
    """AdamW learning rate (tiny random models need more, e.g. 3e-3)."""
    lr_schedule: str = "constant"
    """Learning-rate schedule."""
    prompts_per_step: int = 1
    """Unused by SFT (the batch is batch_episodes)."""

    def check(self) -> None:
        """Ranges of the SFT options."""
        super().check()
        require_one_of("expert", self.expert, ("auto", *EXPERTS))
        if self.expert == "auto" and self.env_id not in AUTO_EXPERTS:
            raise TrainingConfigError(
                f"no scripted expert is known for {self.env_id}; pass expert= one of "
                f"{', '.join(EXPERTS)} or add yours to branchgym.agents.policies.experts.EXPERTS."
            )
        require(self.episodes >= 1, f"episodes must be >= 1; got {self.episodes}.")
        require(self.batch_episodes >= 1, "batch_episodes must be >= 1.")
        require(0.0 <= self.noise < 1.0, f"noise must be in [0, 1); got {self.noise}.")


def collect(run: Run, args: Args) -> tuple[list[RolloutTree], dict[str, float]]:
    """Play the expert; one single-path tree per episode, unlabelled steps in ``meta``."""
    expert_name = AUTO_EXPERTS.get(args.env_id) if args.expert == "auto" else args.expert
    make_expert = EXPERTS[expert_name]
    stop = int(run.engine.stop_token_ids[0])
    encode = run.engine.encode
    env = run.spec.make()
    rng = np.random.default_rng([args.seed, 0x5F7])
    limit = args.max_episode_steps or 100
    trees, successes, unscorable = [], [], 0
    try:
        for _ in tqdm(range(args.episodes), desc="expert", disable=not args.progress, leave=False):
            seed = int(rng.integers(2**31 - 1))
            obs, info = env.reset(seed=seed)
            act = make_expert(env, rng)
            tree = RolloutTree(args.env_id, seed, obs, dict(info))
            tree.meta["unlabelled"] = set()
            parent, done, steps = -1, False, 0
            while not done and steps < limit:
                label = act(obs, info)
                acts = admissible_actions(info)
                action = label
                if acts and rng.random() < args.noise:
                    action = acts[int(rng.integers(len(acts)))]
                text = args.scoring_template.format(action=action)
                ids = [*encode(text), stop]
                obs, reward, terminated, truncated, info = env.step(action)
                node = tree.add(
                    parent,
                    action=action,
                    text=text,
                    token_ids=ids,
                    logprobs=np.zeros(len(ids)),
                    entropies=np.zeros(len(ids)),
                    observation=obs,
                    reward=float(reward),
                    terminated=bool(terminated),
                    truncated=bool(truncated),
                    info=dict(info),
                )
                scorable = run.kind.name != "scoring" or (acts is not None and label in acts)
                unscorable += int(action == label and not scorable)
                if action != label or not scorable:
                    tree.meta["unlabelled"].add(node.id)
                parent, done, steps = node.id, terminated or truncated, steps + 1
            trees.append(tree)
            path = tree.paths()[0] if tree.nodes else []
            successes.append(success_of(tree, path, args.success_threshold))
    finally:
        env.close()
    labelled = sum(len(t) - len(t.meta["unlabelled"]) for t in trees)
    return trees, {
        "sft/expert_success": float(np.mean(successes)) if successes else 0.0,
        "sft/labelled_steps": float(labelled),
        "sft/unscorable_steps": float(unscorable),
    }


def loss(c: Chunk) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the expert's reply tokens (token mean)."""
    nll = losses.aggregate(-c.logp, c.mask, "token-mean")
    return nll, {"losses/sft": float(nll.detach())}


def main(args: Args, algo: str = "sft") -> TrainResult:
    """Fine-tune the model on expert replies."""
    run = Run(args, algo)
    trees, data_metrics = collect(run, args)
    n = len(trees)
    for _ in run.loop():
        # the step's episodes: consecutive slices of a per-epoch permutation
        start = run.step * args.batch_episodes
        idx = []
        for pos in range(start, start + args.batch_episodes):
            epoch, at = divmod(pos, n)
            perm = np.random.default_rng([args.seed, 0xE0C, epoch]).permutation(n)
            idx.append(int(perm[at]))
        batch = Batch(
            [trees[i] for i in idx], keep=lambda tree, node: node not in tree.meta["unlabelled"]
        )

        run.log(run.updates(batch, loss))
        run.log({**data_metrics, "sft/epoch": (start + args.batch_episodes) / n})
    return run.close()
