"""Where WebShop's generated catalogs and search indexes live on disk.

Both the catalogs (:mod:`~branchgym.envs.webshop.data`) and the search indexes
(:mod:`~branchgym.envs.webshop.search`) are cached under :func:`cache_dir`; this module
sits under both so that neither imports the other for it.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """Where generated catalogs and search indexes live: ``$BRANCHGYM_CACHE`` or ~/.cache."""
    root = os.environ.get("BRANCHGYM_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "branchgym"
