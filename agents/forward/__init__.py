"""Rollout trees as token rows, and the packed forward passes that read them.

* :mod:`.rows`: trees -> :class:`~.rows.Decision`, :class:`~.rows.Row`,
  :class:`~.rows.Batch`, :class:`~.rows.Chunk`: what a loss reads;
* :mod:`.pack`: :class:`~.pack.Pack`, one sequence of a packed pass;
* :mod:`.packed`: log-probs with gradients in padded passes with 4-D masks, and tree
  packing (:func:`~.packed.pack_trees`, :func:`~.packed.plan_packs`);
* :mod:`.flat`: the unpadded read (every token once, attention per piece);
* :mod:`.levels`: the read in a few calls over a key/value cache;
* :mod:`.target_logprobs`: target log-probs through the output layer in chunks.

Imports: the engine and :mod:`branchgym.agents.policies`; never a learner, the run or
an estimator.
"""
