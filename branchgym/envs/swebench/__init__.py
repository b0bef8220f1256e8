"""SWE-bench: repository tasks in snapshottable sandboxes, graded as SWE-bench grades them.

* :mod:`~branchgym.envs.swebench.tasks`: the instance format and task-file loaders;
* :mod:`~branchgym.envs.swebench.generated`: twelve generated tasks (real git repos);
* :mod:`~branchgym.envs.swebench.grading`: patch application, the eval run, reports;
* :mod:`~branchgym.envs.swebench.harness`: the ``swebench`` package's specs, eval scripts and
  log grading, wrapped;
* :mod:`~branchgym.envs.swebench.sandbox`: the ``Sandbox`` interface; backends in
  :mod:`~branchgym.envs.swebench.local` (overlayfs / git trees, under bubblewrap: its
  sandboxes in :mod:`~branchgym.envs.swebench.overlay` and
  :mod:`~branchgym.envs.swebench.git_sandbox`, the bubblewrap runner in
  :mod:`~branchgym.envs.swebench.runner`, mounts in :mod:`~branchgym.envs.swebench.mounts`,
  the layer store in :mod:`~branchgym.envs.swebench.layers`) and
  :mod:`~branchgym.envs.swebench.docker_backend` (containers, ``docker`` extra);
* :mod:`~branchgym.envs.swebench.env`: ``branchgym/SWEBench-v0``.
"""
