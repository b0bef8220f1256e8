"""branchgym inside other frameworks: each module adapts one (``trl``, ``verl``, ``skyrl``), behind its extra."""
