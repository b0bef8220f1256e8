"""The wire format of ``branchgym serve``: a JSON codec, Gymnasium spaces and error codes.

Every message is one JSON text frame ``{"type": ..., "data": {...}}``, as in OpenEnv's
WebSocket protocol; branchgym's messages add an optional top-level ``"session"``.
Observations, actions and ``info`` dicts are Python values, so they are encoded with
:func:`encode` and decoded with :func:`decode` into exactly the values the env returned:
plain JSON stays plain (what a stock OpenEnv client reads), and the few values JSON cannot
hold travel as one-key tagged objects (``{"__ndarray__": ...}``, ``{"__tuple__": [...]}``).

This module imports nothing beyond NumPy and Gymnasium: the client and the server share it.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import gymnasium as gym
import numpy as np

__all__ = [
    "encode",
    "decode",
    "encode_space",
    "decode_space",
    "AnyText",
    "AnySpace",
    "ERROR_CODES",
    "PROTOCOL_VERSION",
]

#: Bumped when a message changes meaning; servers report theirs in ``info``.
PROTOCOL_VERSION = 1

#: Error codes of ``{"type": "error", "data": {"code": ...}}``. The first seven are
#: OpenEnv's ``WSErrorCode`` values; the rest are branchgym's extension.
ERROR_CODES = (
    "INVALID_JSON",
    "UNKNOWN_TYPE",
    "VALIDATION_ERROR",
    "EXECUTION_ERROR",
    "CAPACITY_REACHED",
    "FACTORY_ERROR",
    "SESSION_ERROR",
    "UNAUTHORIZED",
    "MESSAGE_TOO_LARGE",
    "UNKNOWN_SNAPSHOT",
    "FOREIGN_SNAPSHOT",
    "SNAPSHOT_LIMIT",
    "UNKNOWN_SESSION",
    "EPISODE_DONE",
    "IDLE_TIMEOUT",
)

_TAGS = (
    "__ndarray__",
    "__npscalar__",
    "__tuple__",
    "__bytes__",
    "__dict__",
    "__set__",
    "__float__",
    "__repr__",
)


def encode(value: Any) -> Any:
    """A JSON-ready copy of ``value`` that :func:`decode` turns back into an equal value.

    Values with no faithful encoding (arbitrary objects) become ``{"__repr__": repr}``:
    deterministic, so two equal states still encode equally, but not invertible.
    """
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int) and not isinstance(value, np.integer):
        return int(value)
    if isinstance(value, float) and not isinstance(value, np.floating):
        if math.isfinite(value):
            return float(value)
        return {"__float__": repr(float(value))}  # nan/inf: strict JSON has no literal
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "biufc":
            data = np.ascontiguousarray(value)
            return {
                "__ndarray__": {
                    "dtype": data.dtype.str,
                    "shape": list(data.shape),
                    "data": base64.b64encode(data.tobytes()).decode("ascii"),
                }
            }
        return {"__repr__": repr(value)}
    if isinstance(value, np.generic):
        return {"__npscalar__": {"dtype": value.dtype.str, "value": encode(value.item())}}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, bytes | bytearray):
        return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, set | frozenset):
        items = [encode(v) for v in value]
        return {"__set__": sorted(items, key=repr), "frozen": isinstance(value, frozenset)}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not (len(value) == 1 and _tagged(value)):
            return {k: encode(v) for k, v in value.items()}
        return {"__dict__": [[encode(k), encode(v)] for k, v in value.items()]}
    return {"__repr__": repr(value)}


def _tagged(d: dict) -> bool:
    return next(iter(d)) in _TAGS


def decode(value: Any) -> Any:
    """The inverse of :func:`encode`."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if value and next(iter(value)) in _TAGS and (len(value) == 1 or "__set__" in value):
        tag, body = next(iter(value.items()))
        if tag == "__ndarray__":
            raw = base64.b64decode(body["data"])
            arr = np.frombuffer(raw, dtype=np.dtype(body["dtype"])).reshape(body["shape"])
            return arr.copy()
        if tag == "__npscalar__":
            return np.dtype(body["dtype"]).type(decode(body["value"]))
        if tag == "__tuple__":
            return tuple(decode(v) for v in body)
        if tag == "__bytes__":
            return base64.b64decode(body)
        if tag == "__dict__":
            return {_hashable(decode(k)): decode(v) for k, v in body}
        if tag == "__set__":
            items = {_hashable(decode(v)) for v in body}
            return frozenset(items) if value.get("frozen") else items
        if tag == "__float__":
            return float(body)
        if tag == "__repr__":
            return body
    return {k: decode(v) for k, v in value.items()}


def _hashable(v: Any) -> Any:
    return tuple(_hashable(x) for x in v) if isinstance(v, list) else v


# ------------------------------------------------------------------------ spaces


class AnyText(gym.spaces.Text):
    """A served env's text space whose own ``contains`` accepts any string of a length.

    Gymnasium's ``Text`` has a fixed character set; envs whose text holds any Unicode
    (WebShop's ``TextSpace``) override ``contains``, and so does this client-side copy.
    """

    def contains(self, x: Any) -> bool:
        """Any ``str`` from ``min_length`` to ``max_length`` characters."""
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length


class AnySpace(gym.Space):
    """The client-side stand-in for a space the wire format cannot describe: holds anything."""

    def __init__(self, description: str = "") -> None:
        """Describe the remote space by its ``repr``."""
        super().__init__()
        self.description = description

    def contains(self, x: Any) -> bool:
        """Everything is an element (the server checks its own space)."""
        return True

    def sample(self, mask: Any = None, probability: Any = None) -> Any:
        """Cannot sample a space whose description did not survive the wire."""
        raise NotImplementedError(f"cannot sample the remote space {self.description}")

    def __repr__(self) -> str:
        return f"AnySpace({self.description})"


def encode_space(space: gym.Space) -> dict[str, Any]:
    """A JSON description of ``space`` (Discrete, Box, Text, Multi*, Dict, Tuple)."""
    s = gym.spaces
    if isinstance(space, s.Discrete):
        return {"type": "Discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, s.Box):
        return {
            "type": "Box",
            "low": encode(space.low),
            "high": encode(space.high),
            "dtype": np.dtype(space.dtype).str,
        }
    if isinstance(space, s.Text):
        # A subclass with its own contains() accepts more than its charset says.
        own = type(space).contains is not s.Text.contains and type(space) is not AnyText
        return {
            "type": "Text",
            "min_length": int(space.min_length),
            "max_length": int(space.max_length),
            "charset": None if own or isinstance(space, AnyText) else "".join(space.character_set),
        }
    if isinstance(space, s.MultiDiscrete):
        return {"type": "MultiDiscrete", "nvec": encode(space.nvec), "start": encode(space.start)}
    if isinstance(space, s.MultiBinary):
        return {"type": "MultiBinary", "n": encode(space.n)}
    if isinstance(space, s.Dict):
        return {"type": "Dict", "spaces": {k: encode_space(v) for k, v in space.spaces.items()}}
    if isinstance(space, s.Tuple):
        return {"type": "Tuple", "spaces": [encode_space(v) for v in space.spaces]}
    return {"type": "Any", "repr": repr(space)}


def decode_space(d: dict[str, Any]) -> gym.Space:
    """The inverse of :func:`encode_space` (an unknown space becomes :class:`AnySpace`)."""
    s = gym.spaces
    kind = d.get("type")
    if kind == "Discrete":
        return s.Discrete(d["n"], start=d.get("start", 0))
    if kind == "Box":
        low, high = decode(d["low"]), decode(d["high"])
        return s.Box(low=low, high=high, dtype=np.dtype(d["dtype"]))
    if kind == "Text":
        if d.get("charset") is None:
            return AnyText(d["max_length"], min_length=d["min_length"])
        return s.Text(d["max_length"], min_length=d["min_length"], charset=d["charset"])
    if kind == "MultiDiscrete":
        return s.MultiDiscrete(decode(d["nvec"]), start=decode(d["start"]))
    if kind == "MultiBinary":
        n = decode(d["n"])
        return s.MultiBinary(n.tolist() if isinstance(n, np.ndarray) else n)
    if kind == "Dict":
        return s.Dict({k: decode_space(v) for k, v in d["spaces"].items()})
    if kind == "Tuple":
        return s.Tuple(tuple(decode_space(v) for v in d["spaces"]))
    return AnySpace(str(d.get("repr", "")))
