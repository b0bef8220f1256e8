"""The branching engine: from a snapshottable env and a policy to a rollout tree.

One module per step of the data path:

* :mod:`~branchgym.rollout.policy`: the policy protocol (``Policy.act``), all the engine
  knows of ``agents/``.
* :mod:`~branchgym.rollout.grow`: ``grow_tree`` and ``group_rollouts``, one tree or group.
* :mod:`~branchgym.rollout.batch`: many trees in lockstep (``grow_trees_batched``,
  ``run_batched``).
* :mod:`~branchgym.rollout.schedules`: where the tree branches (``SCHEDULES`` by name).
* :mod:`~branchgym.rollout.executors`: where sandboxes live (in process, threads,
  processes, Ray; ``EXECUTORS``, ``make_executor``) and
  :mod:`~branchgym.rollout.fleet`: servers of ``branchgym serve`` (``"fleet"``).
* :mod:`~branchgym.rollout.tree`: the rollout tree the engine returns.

Import from the modules; this package's front door imports nothing.
"""
