"""Branchgym inside other trainers: one module per trainer, each behind its own extra."""
