"""The reference learners, one module each: an ``Args`` dataclass and a loop.

* :mod:`.bpo`: Branching Policy Optimization;
* :mod:`.grpo`: GRPO and RLOO;
* :mod:`.bellman_po`: Bellman Policy Optimization;
* :mod:`.branch_opd`: Branching On-Policy Distillation and its baselines (vanilla and
  multi-rollout OPD);
* :mod:`.sft`: the supervised warm start from scripted experts.

Imports: the run (:mod:`branchgym.agents.training.run`), the estimators, the forward
passes, policies and the engine; never another learner. Shared pieces move down.
"""
