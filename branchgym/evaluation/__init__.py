"""``branchgym eval``: measure any agent on pinned protocols, with intervals and paired comparisons.

* :mod:`.protocols`: named, versioned, hashed protocols (task ids, data digest, step cap,
  prompt format) so two runs say whether they are comparable;
* :mod:`.agents`: agent specs (``random``, ``expert``, ``module:attr``, a model folder or
  ``branchgym train`` checkpoint, an OpenAI-compatible endpoint) -> a policy;
* :mod:`.endpoint`: the OpenAI-compatible chat endpoint as a policy;
* :mod:`.stats`: intervals (bootstrap over tasks, clustered when K > 1), pass@k, pass^k,
  exact McNemar, paired differences;
* :mod:`.runner`: the run itself: episodes in lockstep batches, ``episodes.jsonl`` appended
  as each ends, resume, provenance in ``summary.json``, tree files for ``branchgym view``;
* :mod:`.compare`: two runs on the tasks both ran.

Imports: the engine, the envs and :mod:`branchgym.agents` (models, prompts, policies,
engines); nothing above (integrations, bench, the CLI).
"""
