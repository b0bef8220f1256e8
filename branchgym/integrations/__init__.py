"""Adapters that put branchgym envs into other frameworks (skyrl-gym, ...)."""
