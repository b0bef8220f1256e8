"""branchgym inside other trainers: each module adapts one (``trl``, ``verl``), behind its extra."""
