"""Models, policies, packed forward passes, estimators and the reference learners.

Imported as ``branchgym.agents``. Subpackages, each named for its job, from the bottom up;
a subpackage imports only the engine (``branchgym.core``, ``branchgym.rollout``, ...),
the envs, and the subpackages listed before it (``tests/test_architecture.py`` checks it):

* :mod:`~branchgym.agents.policies`: what acts: models (tiny random, SmolLM2, local Hub
  cache), prompts and chat templates, :class:`LLMPolicy` and the scoring policy;
* :mod:`~branchgym.agents.engines`: generation engines behind a policy (HF, vLLM);
* :mod:`~branchgym.agents.estimators`: advantages, losses and protocol-boundary repair,
  pure functions on arrays and tensors;
* :mod:`~branchgym.agents.forward`: rollout trees as token rows, and the packed forward
  passes that read them with gradients;
* :mod:`~branchgym.agents.training`: the training run every learner shares (set-up,
  update, checkpoints, logging, evaluation during training, memory plan, data parallel);
* :mod:`~branchgym.agents.learners`: one module per reference learner, each an ``Args``
  dataclass and a loop that reads like its paper; learners import the run, never each
  other.

Above them, two modules pick a learner by name: :mod:`~branchgym.agents.train`
(``branchgym train``, ``python -m branchgym.agents.train``) and
:mod:`~branchgym.agents.gradient_probe` (a learner's gradient noise at a frozen policy).
"""
