"""In-memory size of a Python object graph: the memory a live snapshot keeps to itself.

``pickle`` size undercounts memory by 3-10x for small states (object headers, dict
tables and per-object overhead are not in the pickle), and a plain deep ``getsizeof``
overcounts just as badly, because a state references objects it shares with the live
env and with other snapshots (interned strings, a game's static data, a product catalog).
:func:`owned_sizeof` counts what only the graph itself references: the bytes that
releasing it would free. :attr:`Snapshot.nbytes <branchgym.core.Snapshot.nbytes>` reports
it; the pickled size is :attr:`~branchgym.core.Snapshot.wire_nbytes`.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["owned_sizeof"]

#: Never part of one state: modules, classes, built-in functions, code objects (a Python
#: function is followed: a closure made for a state holds what it captured).
_SHARED = (type, types.ModuleType, types.BuiltinFunctionType, types.CodeType)


def _children(obj: Any) -> Iterator[Any]:
    if isinstance(obj, dict):
        yield from obj.keys()
        yield from obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        yield from obj
    elif isinstance(obj, types.FunctionType):  # a closure made for this state, or shared
        yield from obj.__closure__ or ()
        return
    elif isinstance(obj, types.CellType):
        try:
            yield obj.cell_contents
        except ValueError:  # an empty cell
            pass
        return
    elif isinstance(obj, np.ndarray):
        if obj.base is not None:
            yield obj.base
        elif obj.dtype == object:
            yield from obj.ravel().tolist()
        return
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        yield d
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                yield getattr(obj, name)


def owned_sizeof(root: Any, *, exclude: tuple[Any, ...] = ()) -> int:
    """Bytes that only ``root``'s object graph references, each object counted once.

    An object counts when every reference to it comes from inside the graph (CPython's
    reference count equals the graph's own references to it), so objects the graph shares
    with anything else (the live env, other snapshots, interned strings, small ints) and
    what hangs below them are left out. Types whose class sets
    ``__branchgym_shared__ = True`` are always left out, and so is each object of
    ``exclude`` (counted elsewhere). ``root`` itself always counts.

    An object found with more than one referrer is not walked into unless it turns out
    to be owned after all (all its referrers inside the graph), so the shared parts of a
    state (a game's fact objects, say) cost a reference count each, not a walk.
    """
    skip = {id(x) for x in exclude}
    objs: dict[int, Any] = {id(root): root}
    refs: dict[int, int] = {}
    kids: dict[int, list[int]] = {}
    waiting: set[int] = set()  # found with other referrers: walked only if owned
    todo, o, c = [root], root, None
    while True:
        while todo:
            o = todo.pop()
            mine = kids[id(o)] = []
            for c in _children(o):
                i = id(c)
                if (
                    i in skip
                    or isinstance(c, _SHARED)
                    or getattr(type(c), "__branchgym_shared__", False)
                ):
                    continue
                refs[i] = refs.get(i, 0) + 1
                mine.append(i)
                if i not in objs:
                    objs[i] = c
                    # a single referrer: its parent, plus ``objs``, ``c`` and the argument
                    if sys.getrefcount(c) > 4:
                        waiting.add(i)
                    else:
                        todo.append(c)
        o = c = None
        # References held here: ``objs`` (1) and getrefcount's argument (1); no loop
        # variable may hold the object while it is counted.
        owned = {i for i in list(objs) if sys.getrefcount(objs[i]) - 2 <= refs.get(i, 0)}
        owned.add(id(root))
        found = waiting & owned
        if not found:
            break
        waiting -= found
        todo = [objs[i] for i in found]
    total, seen, stack = 0, {id(root)}, [id(root)]
    while stack:
        i = stack.pop()
        try:
            total += sys.getsizeof(objs[i])
        except TypeError:
            pass
        for k in kids[i]:
            if k in owned and k not in seen:
                seen.add(k)
                stack.append(k)
    return total
