"""Durations such as 1h30m."""

import re

_UNITS = {"h": 3600, "m": 60}


def parse_duration(text):
    """``text`` in seconds."""
    total = 0
    for amount, unit in re.findall(r"(\d+)([a-z])", text):
        if unit not in _UNITS:
            raise ValueError(f"unknown unit {unit!r}")
        total += int(amount) * _UNITS[unit]
    return total
