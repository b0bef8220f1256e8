"""Rollout trees as versioned JSON files (docs/engine.md, "Tree files").

:func:`tree_to_json` turns a :class:`~branchgym.rollout.tree.RolloutTree` into plain JSON data
and :func:`tree_from_json` builds the tree back; :func:`save_trees` and
:func:`load_trees` write and read a file holding a step's trees (gzip when the name
ends in ``.gz``). The round trip is exact: every node field comes back equal, arrays
with their dtype and bit for bit, and ``tree_to_json(tree_from_json(d)) == d``.

Per-node advantages are not a tree field: a learner computes them from the tree. They
travel as each node's ``advantage`` (``null`` where none was computed) and come back
as ``tree.meta["advantages"]`` (node id -> float).

Values whose type the tree does not fix (actions, observations, infos, ``meta``) are
written as JSON where they are JSON, and as tagged objects (``{"$type": ...}``) for
tuples, numpy arrays and scalars, bytes, non-finite floats and dicts with non-string
keys. Anything else (an object an env put in ``info``) is written as its ``repr``,
tagged ``opaque``, and read back as an :class:`Opaque` holding that text: the file
stays readable, and re-saving it writes the same bytes.

A file of another format version, or one that is not such a file, raises
:class:`~branchgym.error.TreeFormatError` saying what to do.
"""

from __future__ import annotations

import base64
import dataclasses
import gzip
import json
import math
import os
import uuid
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from branchgym.error import TreeFormatError
from branchgym.rollout.tree import ROOT, RolloutTree, TreeStats

__all__ = [
    "FORMAT",
    "VERSION",
    "Opaque",
    "TreeFile",
    "load_trees",
    "read_tree_file",
    "save_trees",
    "tree_from_json",
    "tree_to_json",
]

#: The ``format`` field of every tree file.
FORMAT = "branchgym.trees"
#: The format version this release writes; it reads this one.
VERSION = 1

_ARRAY_KINDS = "biuf"  # bool, signed, unsigned, float: the dtypes an array may have
_NODE_ARRAYS = ("token_ids", "logprobs", "entropies")
_OPTIONAL_ARRAYS = ("entropies_top20", "teacher_logprobs")


@dataclasses.dataclass(frozen=True)
class Opaque:
    """A value the format cannot write as data, kept as its type name and ``repr``.

    Attributes:
        type: The value's class, ``module.QualifiedName``.
        repr: ``repr(value)`` when the file was written.
    """

    type: str
    repr: str


@dataclasses.dataclass
class TreeFile:
    """What a tree file holds.

    Attributes:
        trees: The trees, in the order they were saved.
        meta: File-level facts (``step``, ``algo``, ...), as given to :func:`save_trees`.
        version: The file's format version.
    """

    trees: list[RolloutTree]
    meta: dict[str, Any]
    version: int = VERSION


# ----------------------------------------------------------------------------- values


def _number(x: Any) -> float | str:
    """A float as JSON: a number, or ``"nan"``, ``"inf"``, ``"-inf"`` (strict JSON has none)."""
    x = float(x)
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _array(a: np.ndarray) -> dict[str, Any]:
    a = np.ascontiguousarray(a)
    little = a.astype(a.dtype.newbyteorder("<"), copy=False)
    return {
        "$type": "ndarray",
        "dtype": little.dtype.str,
        "shape": list(a.shape),
        "data": base64.b64encode(little.tobytes()).decode("ascii"),
    }


def _encode(x: Any) -> Any:
    """Any value as JSON data (tagged where JSON alone would lose its type)."""
    if isinstance(x, np.generic) and x.dtype.kind in _ARRAY_KINDS:
        # before float: np.float64 is a float subclass, and its type must survive
        value = x.item()
        return {
            "$type": "numpy",
            "dtype": x.dtype.newbyteorder("<").str,
            "value": _number(value) if isinstance(value, float) else value,
        }
    if x is None or isinstance(x, bool | str):
        return x
    if isinstance(x, int):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else {"$type": "float", "value": _number(x)}
    if isinstance(x, list):
        return [_encode(v) for v in x]
    if isinstance(x, tuple):
        return {"$type": "tuple", "items": [_encode(v) for v in x]}
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x) and "$type" not in x:
            return {k: _encode(v) for k, v in x.items()}
        return {"$type": "dict", "items": [[_encode(k), _encode(v)] for k, v in x.items()]}
    if isinstance(x, np.ndarray) and x.dtype.kind in _ARRAY_KINDS:
        return _array(x)
    if isinstance(x, bytes):
        return {"$type": "bytes", "data": base64.b64encode(x).decode("ascii")}
    if isinstance(x, Opaque):
        return {"$type": "opaque", "class": x.type, "repr": x.repr}
    cls = type(x)
    return {"$type": "opaque", "class": f"{cls.__module__}.{cls.__qualname__}", "repr": repr(x)}


class _Reader:
    """Checks the shape of a parsed file and says where it is wrong."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, what: str) -> TreeFormatError:
        return TreeFormatError(
            f"{self.source}: {where}: {what}. The file is damaged or was not written by "
            "branchgym.tree_format.save_trees; write it again with save_trees."
        )

    def get(self, obj: Any, key: str, kinds: type | tuple[type, ...], where: str) -> Any:
        if not isinstance(obj, dict):
            raise self.fail(where, f"expected an object, got {type(obj).__name__}")
        if key not in obj:
            raise self.fail(where, f"the field {key!r} is missing")
        return self.check(obj[key], kinds, f"{where}.{key}")

    def check(self, value: Any, kinds: type | tuple[type, ...], where: str) -> Any:
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        ok = isinstance(value, kinds) and not (
            isinstance(value, bool) and bool not in kinds and int in kinds
        )
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise self.fail(where, f"expected {names}, got {json.dumps(value)[:60]}")
        return value

    def number(self, value: Any, where: str) -> float:
        if isinstance(value, str):
            if value in ("nan", "inf", "-inf"):
                return float(value)
            raise self.fail(where, f"expected a number, got {value!r}")
        return float(self.check(value, float, where))

    def array(self, value: Any, where: str) -> np.ndarray:
        if not isinstance(value, dict) or value.get("$type") != "ndarray":
            raise self.fail(where, "expected an ndarray object")
        dtype_s = self.get(value, "dtype", str, where)
        shape = self.get(value, "shape", list, where)
        data = self.get(value, "data", str, where)
        try:
            dtype = np.dtype(dtype_s)
        except TypeError as exc:
            raise self.fail(where, f"unknown dtype {dtype_s!r}") from exc
        if dtype.kind not in _ARRAY_KINDS:
            raise self.fail(where, f"dtype {dtype_s!r} is not a number or bool dtype")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise self.fail(where, f"shape {shape} is not a list of sizes")
        try:
            raw = base64.b64decode(data, validate=True)
        except ValueError as exc:
            raise self.fail(where, "data is not base64") from exc
        if len(raw) != dtype.itemsize * math.prod(shape):
            raise self.fail(where, f"{len(raw)} bytes do not make a {dtype_s} array of {shape}")
        # native byte order and a writable copy, like the arrays the engine makes
        return np.frombuffer(raw, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))

    def mapping(self, x: Any, where: str) -> dict[Any, Any]:
        out = self.value(x, where)
        if not isinstance(out, dict):
            raise self.fail(where, f"expected an object, got {type(out).__name__}")
        return out

    def value(self, x: Any, where: str) -> Any:
        if isinstance(x, list):
            return [self.value(v, f"{where}[{i}]") for i, v in enumerate(x)]
        if not isinstance(x, dict):
            return x
        tag = x.get("$type")
        if tag is None:
            return {k: self.value(v, f"{where}.{k}") for k, v in x.items()}
        if tag == "float":
            return self.number(x.get("value"), where)
        if tag == "tuple":
            items = self.get(x, "items", list, where)
            return tuple(self.value(v, f"{where}[{i}]") for i, v in enumerate(items))
        if tag == "dict":
            out = {}
            for i, pair in enumerate(self.get(x, "items", list, where)):
                if not isinstance(pair, list) or len(pair) != 2:
                    raise self.fail(f"{where}[{i}]", "expected a [key, value] pair")
                key = self.value(pair[0], f"{where}[{i}]")
                try:
                    out[key] = self.value(pair[1], f"{where}[{i}]")
                except TypeError as exc:  # an unhashable key
                    raise self.fail(f"{where}[{i}]", f"key {pair[0]!r} is not hashable") from exc
            return out
        if tag == "ndarray":
            return self.array(x, where)
        if tag == "numpy":
            dtype_s = self.get(x, "dtype", str, where)
            try:
                dtype = np.dtype(dtype_s)
            except TypeError as exc:
                raise self.fail(where, f"unknown dtype {dtype_s!r}") from exc
            if dtype.kind not in _ARRAY_KINDS:
                raise self.fail(where, f"dtype {dtype_s!r} is not a number or bool dtype")
            raw = x.get("value")
            v = self.number(raw, where) if dtype.kind == "f" else raw
            return dtype.newbyteorder("=").type(v)
        if tag == "bytes":
            try:
                return base64.b64decode(self.get(x, "data", str, where), validate=True)
            except ValueError as exc:
                raise self.fail(where, "data is not base64") from exc
        if tag == "opaque":
            return Opaque(self.get(x, "class", str, where), self.get(x, "repr", str, where))
        raise self.fail(where, f"unknown $type {tag!r}")


# ----------------------------------------------------------------------------- trees


def _advantages(tree: RolloutTree, advantages: dict[int, float] | None) -> dict[int, float]:
    given = advantages if advantages is not None else tree.meta.get("advantages")
    return {int(k): float(v) for k, v in (given or {}).items()}


def tree_to_json(tree: RolloutTree, advantages: dict[int, float] | None = None) -> dict[str, Any]:
    """The tree as JSON data (the ``trees[i]`` object of a tree file).

    Args:
        tree: The tree.
        advantages: Node id -> the advantage a learner gave it (default:
            ``tree.meta["advantages"]``, when present). Nodes left out get ``null``.
    """
    adv = _advantages(tree, advantages)
    nodes = []
    for n in tree.nodes:
        node = {
            "id": n.id,
            "parent": n.parent,
            "step": n.step,
            "action": _encode(n.action),
            "text": n.text,
            "n_tokens": n.n_tokens,
            "prefix_len": n.prefix_len,
            "token_ids": _array(n.token_ids),
            "logprobs": _array(n.logprobs),
            "entropies": _array(n.entropies),
            "entropies_top20": None if n.entropies_top20 is None else _array(n.entropies_top20),
            "teacher_logprobs": None if n.teacher_logprobs is None else _array(n.teacher_logprobs),
            "observation": _encode(n.observation),
            "reward": _number(n.reward),
            "terminated": bool(n.terminated),
            "truncated": bool(n.truncated),
            "info": _encode(n.info),
            "sibling": int(n.sibling),
            "rollout": int(n.rollout),
            "costs": {str(k): _number(v) for k, v in n.costs.items()},
            "error": n.error,
            "parse_error": n.parse_error,
            "advantage": _number(adv[n.id]) if n.id in adv else None,
        }
        nodes.append(node)
    meta = {k: v for k, v in tree.meta.items() if k != "advantages"}
    stats = {
        f.name: int(getattr(tree.stats, f.name))
        if f.type in ("int", int)
        else _number(getattr(tree.stats, f.name))
        for f in dataclasses.fields(TreeStats)
    }
    return {
        "env_id": tree.env_id,
        "seed": None if tree.seed is None else int(tree.seed),
        "gamma": _number(tree.gamma),
        "observation": _encode(tree.observation),
        "info": _encode(tree.info),
        "stats": stats,
        "fork_offsets": [[p, o] for p, o in sorted(tree.fork_offsets.items())],
        "meta": _encode(meta),
        # derived from the nodes, written for readers other than this module (and checked)
        "backbone": tree.backbone,
        "branch_points": _branch_points(tree),
        "nodes": nodes,
    }


def _branch_points(tree: RolloutTree) -> list[dict[str, Any]]:
    return [
        {
            "parent": b.parent,
            "step": b.step,
            "token_offset": b.token_offset,
            "k": b.k,
            "siblings": list(b.siblings),
            "returns": [_number(r) for r in b.returns],
        }
        for b in tree.branch_points()
    ]


def _tree(r: _Reader, d: Any, where: str) -> RolloutTree:
    env_id = r.get(d, "env_id", str, where)
    seed = r.get(d, "seed", (int, type(None)), where)
    gamma = r.number(r.get(d, "gamma", (float, str), where), f"{where}.gamma")
    observation = r.value(r.get(d, "observation", object, where), f"{where}.observation")
    tree = RolloutTree(env_id, seed, observation, None, gamma=gamma)
    tree.info = r.mapping(r.get(d, "info", dict, where), f"{where}.info")
    adv: dict[int, float] = {}
    for i, nd in enumerate(r.get(d, "nodes", list, where)):
        w = f"{where}.nodes[{i}]"
        if r.get(nd, "id", int, w) != i:
            raise r.fail(w, f"node ids must count from 0 in order; found {nd['id']} at {i}")
        parent = r.get(nd, "parent", int, w)
        if not (parent == ROOT or 0 <= parent < i):
            raise r.fail(w, f"parent {parent} is not an earlier node (or -1, the reset state)")
        fields: dict[str, Any] = {
            name: r.array(r.get(nd, name, dict, w), f"{w}.{name}") for name in _NODE_ARRAYS
        }
        for name in _OPTIONAL_ARRAYS:
            raw = r.get(nd, name, (dict, type(None)), w)
            fields[name] = None if raw is None else r.array(raw, f"{w}.{name}")
        info = r.mapping(r.get(nd, "info", dict, w), f"{w}.info")
        costs = r.get(nd, "costs", dict, w)
        try:
            node = tree.add(
                parent,
                action=r.value(r.get(nd, "action", object, w), f"{w}.action"),
                text=r.get(nd, "text", str, w),
                prefix_len=r.get(nd, "prefix_len", int, w),
                observation=r.value(r.get(nd, "observation", object, w), f"{w}.observation"),
                reward=r.number(r.get(nd, "reward", (float, str), w), f"{w}.reward"),
                terminated=r.get(nd, "terminated", bool, w),
                truncated=r.get(nd, "truncated", bool, w),
                info=info,
                sibling=r.get(nd, "sibling", int, w),
                rollout=r.get(nd, "rollout", int, w),
                costs={k: r.number(v, f"{w}.costs.{k}") for k, v in costs.items()},
                error=r.get(nd, "error", (str, type(None)), w),
                parse_error=r.get(nd, "parse_error", (str, type(None)), w),
                **fields,
            )
        except ValueError as exc:  # the tree's own checks: token counts, done parents
            raise r.fail(w, str(exc)) from exc
        if r.get(nd, "step", int, w) != node.step:
            raise r.fail(w, f"step {nd['step']} does not follow from its parent ({node.step})")
        a = r.get(nd, "advantage", (float, str, type(None)), w)
        if a is not None:
            adv[i] = r.number(a, f"{w}.advantage")
    stats = r.get(d, "stats", dict, where)
    for f in dataclasses.fields(TreeStats):
        if f.name in stats:
            value = stats[f.name]
            setattr(
                tree.stats,
                f.name,
                r.check(value, int, f"{where}.stats.{f.name}")
                if f.type in ("int", int)
                else r.number(value, f"{where}.stats.{f.name}"),
            )
    for j, pair in enumerate(r.get(d, "fork_offsets", list, where)):
        ok = isinstance(pair, list) and len(pair) == 2
        if not ok or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair):
            raise r.fail(f"{where}.fork_offsets[{j}]", "expected a [parent, offset] pair")
        tree.set_fork_offset(pair[0], pair[1])
    tree.meta = r.mapping(r.get(d, "meta", dict, where), f"{where}.meta")
    if adv:
        tree.meta["advantages"] = adv
    _check_derived(r, d, tree, where)
    return tree


def _check_derived(r: _Reader, d: dict[str, Any], tree: RolloutTree, where: str) -> None:
    """The file's backbone and branch points, when given, must be the tree's own."""
    if "backbone" in d and d["backbone"] != tree.backbone:
        raise r.fail(f"{where}.backbone", "does not match the nodes' parents")
    if "branch_points" in d:
        if d["branch_points"] != _branch_points(tree):
            raise r.fail(f"{where}.branch_points", "do not match the nodes (parents, rewards)")


def tree_from_json(data: dict[str, Any], *, source: str = "tree") -> RolloutTree:
    """Build the tree :func:`tree_to_json` wrote.

    Args:
        data: One tree object.
        source: What to call it in error messages (a file name).

    Raises:
        TreeFormatError: A field is missing, of the wrong type, or inconsistent.
    """
    return _tree(_Reader(source), data, "tree")


# ----------------------------------------------------------------------------- files


def save_trees(
    path: str | os.PathLike[str],
    trees: Sequence[RolloutTree],
    advantages: Sequence[dict[int, float] | None] | None = None,
    **meta: Any,
) -> Path:
    """Write a step's trees to one file (gzip when ``path`` ends in ``.gz``), atomically.

    Args:
        path: The file.
        trees: The trees.
        advantages: Per tree, node id -> advantage (default: each ``tree.meta``'s).
        **meta: File-level facts, JSON values (``step=10, algo="bpo"``).

    Returns:
        The path written.
    """
    path = Path(path)
    if advantages is not None and len(advantages) != len(trees):
        raise ValueError(f"{len(advantages)} advantage maps for {len(trees)} trees")
    import branchgym

    doc = {
        "format": FORMAT,
        "version": VERSION,
        "meta": _encode({"branchgym": branchgym.__version__, **meta}),
        "trees": [
            tree_to_json(t, None if advantages is None else advantages[i])
            for i, t in enumerate(trees)
        ],
    }
    raw = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    if path.suffix == ".gz":
        raw = gzip.compress(raw, compresslevel=6, mtime=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a unique name beside the target (the user's umask applies, unlike mkstemp's 0600)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial")
    try:
        with open(tmp, "xb") as fh:
            fh.write(raw)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_tree_file(path: str | os.PathLike[str]) -> TreeFile:
    """Read a file :func:`save_trees` wrote: its trees and file-level ``meta``.

    Raises:
        TreeFormatError: The file is missing, not JSON (or gzip of it), not a tree
            file, of another format version, or malformed.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TreeFormatError(
            f"cannot read the tree file {str(path)!r} ({exc.strerror or exc}); give the path "
            "of a file written by save_trees (or by train ... save_trees_every=N)."
        ) from exc
    return parse_tree_file(raw, source=str(path))


def parse_tree_file(raw: bytes, *, source: str = "<bytes>") -> TreeFile:
    """:func:`read_tree_file` on bytes already in memory."""
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise TreeFormatError(
                f"{source}: the gzip stream is damaged ({exc}); save the trees again."
            ) from exc
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TreeFormatError(
            f"{source} is not JSON ({exc}); a tree file is the JSON (or .json.gz) that "
            "save_trees writes."
        ) from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise TreeFormatError(
            f"{source} is not a branchgym tree file (format {got!r}, expected {FORMAT!r}); "
            "give a file written by save_trees."
        )
    version = doc.get("version")
    if version != VERSION:
        newer = isinstance(version, int) and not isinstance(version, bool) and version > VERSION
        fix = (
            "it was written by a newer branchgym: upgrade (pip install -U branchgym) to read it"
            if newer
            else "the version must be a whole number; the file is damaged: save it again"
        )
        raise TreeFormatError(
            f"{source} is tree format version {version!r}; this branchgym reads version "
            f"{VERSION} only, and {fix}."
        )
    r = _Reader(source)
    meta = r.mapping(r.get(doc, "meta", dict, "file"), "meta")
    trees = [_tree(r, t, f"trees[{i}]") for i, t in enumerate(r.get(doc, "trees", list, "file"))]
    return TreeFile(trees, meta, VERSION)


def load_trees(path: str | os.PathLike[str]) -> list[RolloutTree]:
    """The trees of a tree file (:func:`read_tree_file` for its ``meta`` too)."""
    return read_tree_file(path).trees
