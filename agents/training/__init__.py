"""The training run every learner shares.

* :mod:`.run`: :class:`~.run.Run` and the one import for learner files (it re-exports
  what learners use); :class:`Run` is one object whose jobs live in three modules:
  :mod:`.setup` (model, engine, policy, envs, optimiser, output folder), :mod:`.update`
  (rescoring and the optimiser update over chunks) and :mod:`.saving` (checkpoints and
  exact resume);
* :mod:`.options`: :class:`~.options.TrainArgs` and CLI/JSON coercion;
  :mod:`.lr_schedules`;
* :mod:`.policy_kinds`: how a learner's model acts and rescores what it did;
* :mod:`.evaluation`: the fixed-seed evaluation set and exact values;
* :mod:`.metrics`, :mod:`.sinks`, :mod:`.plots`: diagnostics, where they go, curves;
* :mod:`.checkpoints`, :mod:`.distributed`, :mod:`.memory`, :mod:`.vllm_training`:
  checkpoint format, data parallel, the memory plan, vLLM generation.

Imports: the engine, the envs, :mod:`~branchgym.agents.policies`,
:mod:`~branchgym.agents.engines`, :mod:`~branchgym.agents.estimators` and
:mod:`~branchgym.agents.forward`; never a learner.
"""
