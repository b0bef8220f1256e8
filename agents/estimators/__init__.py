"""The estimators: advantages, losses and protocol-boundary repair.

* :mod:`.advantages`: every advantage estimator, in one registry (docs/estimators.md);
* :mod:`.losses`: PPO-clip, KL and distillation losses as pure functions on tensors;
* :mod:`.pbr`: protocol-boundary repair detectors for Branching OPD.

Imports: the engine only (arrays, trees, torch); no policy, forward pass or run.
"""
