"""Stable, process-independent hashing of environment state.

``stable_hash`` feeds a canonical byte encoding of a value to BLAKE2b, so the same
state gives the same digest in any process, on any run (unlike ``hash()``, which is
salted per process for ``str``). It is what ``state_digest()`` implementations and the
spec hash of a :class:`~branchgym.core.Snapshot` are built from.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import struct
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["stable_hash", "canonical_bytes"]


def stable_hash(*values: Any, size: int = 16) -> str:
    """Hex digest of the canonical encoding of ``values``.

    Args:
        *values: Any mix of None, bool, int, float, str, bytes, lists, tuples, dicts,
            sets, deques, dataclasses, enums, NumPy arrays, scalars and generators, and
            objects that define ``__branchgym_state__()`` returning one of those.
        size: Digest size in bytes (hex string is twice as long).

    Raises:
        TypeError: a value has no canonical encoding; the message names its type.
    """
    h = hashlib.blake2b(digest_size=size)
    for v in values:
        _encode(v, h.update)
    return h.hexdigest()


def canonical_bytes(value: Any) -> bytes:
    """The canonical encoding itself (for tests and debugging)."""
    parts: list[bytes] = []
    _encode(value, parts.append)
    return b"".join(parts)


def _encode(v: Any, out) -> None:  # noqa: C901 - one flat type switch reads best
    if v is None:
        out(b"N")
    elif v is True or v is False:
        out(b"T" if v else b"F")
    elif isinstance(v, enum.Enum):
        out(b"E")
        _encode(type(v).__qualname__, out)
        _encode(v.value, out)
    elif isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_):
        s = str(int(v)).encode()
        out(b"i" + struct.pack("<I", len(s)) + s)
    elif isinstance(v, float | np.floating):
        out(b"f" + struct.pack("<d", float(v)))
    elif isinstance(v, np.bool_):
        out(b"T" if bool(v) else b"F")
    elif isinstance(v, str):
        b = v.encode("utf-8", "surrogatepass")
        out(b"s" + struct.pack("<Q", len(b)) + b)
    elif isinstance(v, bytes | bytearray | memoryview):
        b = bytes(v)
        out(b"b" + struct.pack("<Q", len(b)) + b)
    elif isinstance(v, np.ndarray):
        arr = np.ascontiguousarray(v)
        if arr.dtype == object:
            out(b"O" + struct.pack("<I", arr.ndim) + struct.pack(f"<{arr.ndim}Q", *arr.shape))
            for item in arr.ravel():
                _encode(item, out)
        else:
            header = f"{arr.dtype.str}|{arr.shape}".encode()
            out(b"A" + struct.pack("<I", len(header)) + header)
            data = arr.tobytes()
            out(struct.pack("<Q", len(data)) + data)
    elif isinstance(v, np.random.Generator):
        out(b"G")
        _encode(v.bit_generator.state, out)
    elif isinstance(v, np.random.RandomState):
        out(b"R")
        _encode(v.get_state(legacy=False), out)
    elif hasattr(v, "__branchgym_state__"):
        out(b"S")
        _encode(type(v).__qualname__, out)
        _encode(v.__branchgym_state__(), out)
    elif dataclasses.is_dataclass(v) and not isinstance(v, type):
        out(b"D")
        _encode(type(v).__qualname__, out)
        for f in dataclasses.fields(v):
            _encode(f.name, out)
            _encode(getattr(v, f.name), out)
        out(b"d")
    elif isinstance(v, Mapping):
        items = sorted((canonical_bytes(k), val) for k, val in v.items())
        out(b"M" + struct.pack("<Q", len(items)))
        for kb, val in items:
            out(kb)
            _encode(val, out)
    elif isinstance(v, list | tuple | deque):
        tag = b"L" if isinstance(v, list) else b"U" if isinstance(v, tuple) else b"Q"
        out(tag + struct.pack("<Q", len(v)))
        for item in v:
            _encode(item, out)
    elif isinstance(v, set | frozenset):
        enc = sorted(canonical_bytes(x) for x in v)
        out(b"X" + struct.pack("<Q", len(enc)))
        for e in enc:
            out(e)
    else:
        raise TypeError(
            f"cannot hash a {type(v).__module__}.{type(v).__qualname__} stably; "
            "convert it to plain data or give it a __branchgym_state__() method"
        )
