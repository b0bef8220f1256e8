"""Policies, generation engines, losses and learners (imported as ``branchgym.agents``)."""
