"""Injected-nondeterminism scenarios (imported as ``branchgym.scenarios``)."""
