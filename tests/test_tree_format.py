"""The tree file format: exact round trips, and typed errors for anything else."""

import gzip
import json

import gymnasium as gym
import numpy as np
import pytest

import branchgym
from branchgym.agents.policies.policy import TextPolicy
from branchgym.envs.toy.text_tree_mdp import TextTreeMDP
from branchgym.error import DataError, TreeFormatError
from branchgym.rollout.executor_base import EnvRecipe
from branchgym.rollout.executors import InProcessExecutor
from branchgym.rollout.grow import grow_tree
from branchgym.rollout.tree import RolloutTree
from branchgym.tree_format import (
    FORMAT,
    VERSION,
    Opaque,
    load_trees,
    parse_tree_file,
    read_tree_file,
    save_trees,
    tree_from_json,
    tree_to_json,
)


class RestoreFails(TextTreeMDP):
    """A maze whose restores fail every other time (a sandbox whose image comes and goes)."""

    restores = 0

    def _set_state(self, state):
        RestoreFails.restores += 1
        if RestoreFails.restores % 2 == 0:
            raise RuntimeError("restore failed: the overlay upper dir is gone")
        return super()._set_state(state)


def grown_tree():
    def make():
        return branchgym.core.SnapshotAPI(gym.wrappers.TimeLimit(RestoreFails(depth=4), 20))

    with InProcessExecutor(max_instances=1) as ex:
        return grow_tree(
            EnvRecipe("RestoreFails-v0", factory=make), TextPolicy(), "entropy", m=2, k=3,
            seed=5, rng=1, executor=ex, schedule_options={"gap_unit": "steps"},
        )  # fmt: skip


def hand_tree():
    """A tree with every kind of value a node may hold."""
    rng = np.random.default_rng(0)
    tree = RolloutTree("test/Hand-v0", 7, "reset obs \u00e9\u2028", {"k": (1, 2)}, gamma=0.9)
    special = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45, 3.4e38], dtype=np.float32)
    a = tree.add(
        -1,
        action="search[red shoes]",
        text="Thought: hm\nAction: search[red shoes]",
        token_ids=np.arange(7),
        logprobs=special,
        entropies=rng.random(7).astype(np.float32),
        entropies_top20=rng.random(7),
        prefix_len=2,
        observation="<html></script><!-- x -->",
        reward=np.float64(0.25),
        info={
            "admissible_actions": ["a", "b"],
            3: "int key",
            "arr": np.arange(3, dtype=np.int16),
            "score": np.float64(0.1),
            "flag": np.bool_(True),
        },
        costs={"generate": 0.5, "env_step": 1e-4},
    )
    tree.add(
        a.id,
        action=np.int64(2),
        observation={"$type": "not a tag"},
        reward=float("nan"),
        terminated=True,
        teacher_logprobs=np.zeros(0),
        parse_error="no Action: line",
    )
    tree.add(a.id, sibling=2, rollout=1, truncated=True, error="restore failed: gone")
    tree.set_fork_offset(a.id, 1)
    tree.meta["forks"] = [{"step": 1, "token_offset": 1, "score": 0.7}]
    tree.meta["blob"] = b"\x00\xff"
    tree.meta["when"] = complex(1, 2)  # no JSON form: kept as its repr
    tree.stats.env_steps, tree.stats.restore_s = 3, 0.125
    return tree


def same_tree(a, b):
    assert (a.env_id, a.seed, a.gamma, a.fork_offsets) == (
        b.env_id,
        b.seed,
        b.gamma,
        b.fork_offsets,
    )
    assert a.stats == b.stats and len(a) == len(b)
    assert repr(a.observation) == repr(b.observation) and repr(a.info) == repr(b.info)
    for x, y in zip(a.nodes, b.nodes, strict=True):
        for f in ("id", "parent", "step", "text", "prefix_len", "terminated", "truncated",
                  "sibling", "rollout", "costs", "error", "parse_error"):  # fmt: skip
            assert getattr(x, f) == getattr(y, f), f
        assert repr(x.action) == repr(y.action) and type(x.action) is type(y.action)
        assert repr(x.observation) == repr(y.observation) and repr(x.info) == repr(y.info)
        assert np.float64(x.reward).tobytes() == np.float64(y.reward).tobytes()
        for f in ("token_ids", "logprobs", "entropies", "entropies_top20", "teacher_logprobs"):
            u, v = getattr(x, f), getattr(y, f)
            assert (u is None) == (v is None), f
            if u is not None:  # bit for bit, dtype and all (NaN, -0.0, subnormals)
                assert u.dtype == v.dtype and u.shape == v.shape and u.tobytes() == v.tobytes(), f
    assert repr(a.branch_points()) == repr(b.branch_points()) and a.backbone == b.backbone


@pytest.mark.parametrize("make", [grown_tree, hand_tree], ids=["grown", "hand"])
def test_round_trip_is_exact(make, tmp_path):
    tree = make()
    adv = {n.id: 0.5 - n.id for n in tree.nodes if not n.error}
    data = tree_to_json(tree, adv)
    text = json.dumps(data, allow_nan=False)  # strict JSON: a browser's JSON.parse reads it
    back = tree_from_json(json.loads(text))
    same_tree(tree, back)
    assert back.meta.pop("advantages") == adv
    assert tree_to_json(back, adv) == data  # and back to the same JSON
    for name in ("trees.json", "trees.json.gz"):
        path = save_trees(tmp_path / name, [tree, back], [adv, adv], step=3, algo="bpo")
        loaded = read_tree_file(path)
        assert loaded.meta["step"] == 3 and loaded.meta["algo"] == "bpo"
        assert loaded.meta["branchgym"] == branchgym.__version__
        for t in loaded.trees:
            same_tree(tree, t)
            assert t.meta["advantages"] == adv
    assert gzip.decompress((tmp_path / "trees.json.gz").read_bytes()).startswith(b"{")
    # saving what was loaded writes the same bytes
    again = save_trees(tmp_path / "again.json.gz", load_trees(path), step=3, algo="bpo")
    assert again.read_bytes() == path.read_bytes()


def test_grown_tree_keeps_its_error_leaves_and_branch_points():
    tree = grown_tree()
    data = tree_to_json(tree)
    errors = [n for n in data["nodes"] if n["error"]]
    assert errors and all("overlay upper dir is gone" in n["error"] for n in errors)
    assert [b["k"] for b in data["branch_points"]] == [3, 3]
    assert data["backbone"] == tree.backbone and data["stats"]["errors"] == len(errors)
    assert all(n["advantage"] is None for n in data["nodes"])


def test_unrepresentable_values_become_opaque_and_stay_stable():
    tree = hand_tree()
    back = tree_from_json(tree_to_json(tree))
    assert back.meta["when"] == Opaque("builtins.complex", "(1+2j)")
    assert back.meta["blob"] == b"\x00\xff" and back.info == {"k": (1, 2)}
    assert back[0].info[3] == "int key" and back[0].info["arr"].dtype == np.int16
    assert type(back[0].info["score"]) is np.float64 and type(back[0].info["flag"]) is np.bool_
    assert back[1].observation == {"$type": "not a tag"}  # a dict that looks like a tag


def doc(tmp_path, mutate):
    data = {"format": FORMAT, "version": VERSION, "meta": {}, "trees": [tree_to_json(hand_tree())]}
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return path


def _set(path, value):
    def mutate(d):
        obj = d
        for key in path[:-1]:
            obj = obj[key]
        if value is KeyError:
            del obj[path[-1]]
        else:
            obj[path[-1]] = value

    return mutate


@pytest.mark.parametrize(
    "mutate, match",
    [
        (_set(["version"], 2), "version 2; this branchgym reads version 1 only.*upgrade"),
        (_set(["version"], "1"), "version '1'.*damaged"),
        (_set(["format"], "other"), "not a branchgym tree file"),
        (_set(["trees", 0, "nodes", 1, "parent"], 5), r"nodes\[1\].*not an earlier node"),
        (_set(["trees", 0, "nodes", 0, "reward"], "lots"), r"nodes\[0\].reward.*number"),
        (_set(["trees", 0, "nodes", 0, "id"], 4), "count from 0"),
        (_set(["trees", 0, "nodes", 0, "text"], KeyError), "'text' is missing"),
        (_set(["trees", 0, "nodes", 0, "terminated"], 1), r"terminated: expected bool"),
        (_set(["trees", 0, "nodes", 0, "logprobs", "data"], "AAAA"), "bytes do not make"),
        (_set(["trees", 0, "nodes", 0, "logprobs", "dtype"], "|O"), "not a number or bool"),
        (_set(["trees", 0, "nodes", 0, "entropies", "data"], "!!"), "not base64"),
        (_set(["trees", 0, "nodes", 0, "prefix_len"], 99), r"prefix_len 99 not in"),
        (_set(["trees", 0, "nodes", 2, "reward"], 1.0), "branch_points.*do not match"),
        (_set(["trees", 0, "meta"], {"$type": "tuple", "items": []}), "meta: expected an object"),
        (_set(["trees", 0, "info"], {"$type": "mystery"}), "unknown \\$type 'mystery'"),
    ],
)
def test_malformed_files_raise_typed_errors_that_say_the_fix(tmp_path, mutate, match):
    with pytest.raises(TreeFormatError, match=match) as info:
        read_tree_file(doc(tmp_path, mutate))
    assert isinstance(info.value, DataError)
    assert "save" in str(info.value) or "upgrade" in str(info.value)


def test_unreadable_files_raise_typed_errors(tmp_path):
    with pytest.raises(TreeFormatError, match="cannot read the tree file"):
        read_tree_file(tmp_path / "missing.json.gz")
    with pytest.raises(TreeFormatError, match="is not JSON"):
        parse_tree_file(b"{nope", source="x.json")
    with pytest.raises(TreeFormatError, match="gzip stream is damaged"):
        parse_tree_file(gzip.compress(b"{}")[:-6], source="x.json.gz")
    with pytest.raises(TreeFormatError, match="not a branchgym tree file"):
        parse_tree_file(b"[1, 2]")
