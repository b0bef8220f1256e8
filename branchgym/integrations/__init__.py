"""branchgym inside other frameworks: one module each (trl, verl, skyrl), behind its extra."""
