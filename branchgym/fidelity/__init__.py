"""Snapshot fidelity: does ``restore(snapshot(s))`` behave exactly like ``s``?

One module per step of the check, so the layout reads at a glance:

* :mod:`~branchgym.fidelity.checks`: ``check_env``, Gymnasium's API checks plus the small
  ``check_*`` snapshot checks (``branchgym check``), and the helpers the others share.
* :mod:`~branchgym.fidelity.suite`: the property suite, ``check_snapshot_fidelity`` and
  ``fidelity_test`` (``branchgym fidelity``).
* :mod:`~branchgym.fidelity.machine`: the suite's Hypothesis state machine, its recorded
  programs, their replay and shrinking.
* :mod:`~branchgym.fidelity.permutation` and :mod:`~branchgym.fidelity.distributional`:
  the distribution phase for envs whose snapshots leave the RNG out.
* :mod:`~branchgym.fidelity.report`: what the suite returns, :class:`FidelityReport`.
* :mod:`~branchgym.fidelity.violation`: the one record every check (and the online
  wrapper, ``branchgym.wrappers.FidelityCheck``) returns.
* :mod:`~branchgym.fidelity.pytest_plugin`: the pytest plugin (``snapshot_fidelity``).

Import from the modules; this package's front door imports nothing, so importing the
violation record does not load Hypothesis.
"""
