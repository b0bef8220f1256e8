"""Learning-rate schedules: the multiplier of the learning rate after warm-up, by name."""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["LR_SCHEDULES"]


def _constant(step: int, total: int) -> float:
    return 1.0


def _cosine(step: int, total: int) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * min(step, total) / max(total, 1)))


def _linear(step: int, total: int) -> float:
    return max(0.0, 1.0 - step / max(total, 1))


#: name -> multiplier of the learning rate after warm-up, ``f(step, total_steps)``.
LR_SCHEDULES: dict[str, Callable[[int, int], float]] = {
    "constant": _constant,
    "cosine": _cosine,
    "linear": _linear,
}
