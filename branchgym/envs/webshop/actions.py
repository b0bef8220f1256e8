r"""WebShop's action grammar: ``search[query]`` and ``click[target]``.

Parsing is upstream's ``engine.parse_action``: ``re.match(r"(.+)\[(.+)\]", action)``,
so the name is everything before the last ``[`` whose remainder closes with ``]``,
text after the closing bracket is ignored, and the name is case-sensitive. The argument
is lowercased before use, as the upstream text env does.
"""

from __future__ import annotations

import re

__all__ = ["parse_action", "search_action", "click_action"]

_ACTION = re.compile(r"(.+)\[(.+)\]")


def parse_action(action: str) -> tuple[str, str | None]:
    """``(name, argument)``; the argument is None when ``action`` has no ``name[arg]`` form."""
    m = _ACTION.match(action)
    if m is None:
        return action, None
    return m.group(1), m.group(2)


def search_action(query: str) -> str:
    """The action text that searches for ``query``."""
    return f"search[{query}]"


def click_action(target: str) -> str:
    """The action text that clicks ``target`` (a button, ASIN or option value)."""
    return f"click[{target}]"
