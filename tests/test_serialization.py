"""Snapshot bytes run nothing: crafted payloads are refused before any of their code runs.

Each gadget, if it ran, would create a marker file; every test checks the file is absent.
"""

import os
import pickle
import subprocess

import gymnasium as gym
import pytest

import branchgym
from branchgym import serialization
from branchgym.core import _MAGIC, _MAGIC_V1, Snapshot, _rebuild_snapshot
from branchgym.error import SnapshotCorruptError, SnapshotUntrustedError
from branchgym.wrappers import PickleSnapshot


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "pwned"
    yield path
    assert not path.exists(), "a gadget ran"


class _Gadget:
    """Unpickling it would call ``fn(*args)``: the classic reduce gadget."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


class _Carrier:
    """A real snapshot header around a payload of the attacker's choice."""

    def __init__(self, cls, blob, tag=None):
        self.cls, self.blob, self.tag = cls, blob, tag

    def __reduce__(self):
        header = ("branchgym/TreeMDP-v0", "x", 0, "state", {})
        tag = self.tag if self.tag is not None else serialization.sign(self.blob)
        return (_rebuild_snapshot, (self.cls, header, self.blob, tag))


def envelope(body, key=None):
    return _MAGIC + serialization.sign(body, key) + body


def gadgets(marker):
    cmd = f"touch {marker}"
    return [
        _Gadget(os.system, cmd),
        _Gadget(subprocess.call, ["touch", str(marker)]),
        _Gadget(eval, f"__import__('os').system({cmd!r})"),
        _Gadget(exec, f"open({str(marker)!r}, 'w').close()"),
        {"state": [1, 2, _Gadget(os.system, cmd)]},  # nested inside allowed containers
    ]


def test_round_trip_still_works_and_is_signed():
    env = gym.make("branchgym/TreeMDP-v0")
    env.reset(seed=3)
    env.step(env.action_space.sample())
    with env.snapshot() as snap:
        data = snap.to_bytes()
    assert data.startswith(_MAGIC)
    copy = Snapshot.from_bytes(data)
    assert copy.foreign
    other = gym.make("branchgym/TreeMDP-v0")
    other.reset(seed=9)
    other.restore(copy)
    assert other.unwrapped.state_digest() == env.unwrapped.state_digest()


def test_header_only_and_truncated_bytes_are_refused():
    for data in (_MAGIC, _MAGIC + b"\0" * 32, _MAGIC + b"\0" * 31, b"garbage" * 10):
        with pytest.raises(SnapshotCorruptError):
            Snapshot.from_bytes(data)


@pytest.mark.parametrize("i", range(5))
def test_reduce_gadgets_as_the_whole_body_run_nothing(marker, i):
    body = pickle.dumps(gadgets(marker)[i], protocol=5)
    # Signed with the run's key (as if the key had leaked): the types still refuse.
    with pytest.raises(SnapshotUntrustedError, match="not an allowed snapshot type"):
        Snapshot.from_bytes(envelope(body))
    # Unsigned (the usual attacker): refused before anything is even parsed.
    with pytest.raises(SnapshotUntrustedError, match="signature"):
        Snapshot.from_bytes(_MAGIC + b"\0" * 32 + body)


@pytest.mark.parametrize("i", range(5))
def test_a_real_header_with_a_malicious_inner_payload_runs_nothing(marker, i):
    evil = pickle.dumps(gadgets(marker)[i], protocol=5)
    body = pickle.dumps(_Carrier(Snapshot, evil), protocol=5)
    snap = Snapshot.from_bytes(envelope(body))  # the header is fine: loads lazily
    with pytest.raises(SnapshotUntrustedError, match="not an allowed snapshot type"):
        _ = snap.payload
    env = gym.make("branchgym/TreeMDP-v0")
    env.reset(seed=0)
    with pytest.raises(SnapshotCorruptError):
        env.unwrapped.restore(Snapshot.from_bytes(envelope(body)))


def test_inner_payload_with_a_forged_signature_is_refused_at_load(marker):
    evil = pickle.dumps(_Gadget(os.system, f"touch {marker}"), protocol=5)
    body = pickle.dumps(_Carrier(Snapshot, evil, tag=b"\0" * 32), protocol=5)
    with pytest.raises(SnapshotUntrustedError, match="signature"):
        Snapshot.from_bytes(envelope(body))


def test_rebuild_refuses_a_class_that_is_not_a_snapshot():
    body = pickle.dumps(_Carrier(dict, pickle.dumps(1)), protocol=5)
    with pytest.raises(SnapshotUntrustedError, match="not a Snapshot class"):
        Snapshot.from_bytes(envelope(body))


def test_another_runs_key_is_refused_unless_given():
    env = gym.make("branchgym/TreeMDP-v0")
    env.reset(seed=1)
    other_key = b"k" * 32
    with env.snapshot() as snap, serialization.signing_key(other_key):
        body = pickle.dumps(snap, protocol=5)  # payload signed with the other key
        data = envelope(body, other_key)
    with pytest.raises(SnapshotUntrustedError, match="another run's key"):
        Snapshot.from_bytes(data)
    copy = Snapshot.from_bytes(data, key=other_key)
    env.restore(copy)  # the nested (inner) payload is checked with the same key


def test_the_old_unsigned_format_is_refused():
    old = _MAGIC_V1 + b"\0" * 32 + pickle.dumps(1)
    with pytest.raises(SnapshotUntrustedError, match="older branchgym"):
        Snapshot.from_bytes(old)


def test_pickle_snapshot_of_a_foreign_process_loads_only_its_envs_types(marker):
    env = PickleSnapshot(gym.make("CartPole-v1"))
    env.reset(seed=0)
    env.step(0)
    with branchgym.snapshot(env) as snap:
        copy = Snapshot.from_bytes(snap.to_bytes())
    fresh = PickleSnapshot(gym.make("CartPole-v1"))
    fresh.reset(seed=5)
    branchgym.restore(fresh, copy)  # CartPole's own types (arrays, its generator) load
    assert (fresh.unwrapped.state == env.unwrapped.state).all()
    # A signed snapshot whose inner env blob is a gadget: refused, nothing runs.
    inner = snap_inner = None
    with branchgym.snapshot(env) as snap:
        inner = snap.inner if hasattr(snap, "inner") else snap
        blob, _ = inner.payload
        evil = pickle.dumps(_Gadget(os.system, f"touch {marker}"), protocol=5)
        snap_inner = Snapshot(
            env_id=inner.env_id, spec_hash=inner.spec_hash, step=inner.step, kind="pickle",
            payload=(evil, __import__("hashlib").sha256(evil).hexdigest()), picklable=True,
        )  # fmt: skip
        forged = Snapshot.from_bytes(snap_inner.to_bytes())
    with pytest.raises(SnapshotUntrustedError):
        fresh.restore(forged)


def test_register_snapshot_types_and_key_validation(monkeypatch):
    with pytest.raises(TypeError, match="module-level"):
        branchgym.register_snapshot_types(lambda: 0)
    monkeypatch.setenv(serialization.KEY_ENV, "abcd")
    with pytest.raises(SnapshotUntrustedError, match="at least 32 bytes"):
        serialization.run_key()
    monkeypatch.setenv(serialization.KEY_ENV, "ab" * 32)
    assert serialization.run_key() == bytes.fromhex("ab" * 32)


def test_snapshot_subclasses_load_and_unknown_modules_are_never_imported():
    import sys

    body = pickle.dumps(_Gadget(getattr, object, "x"), protocol=5)
    assert "antigravity" not in sys.modules
    evil = body.replace(b"builtins", b"antigravity").replace(b"getattr", b"geturl_x")
    with pytest.raises((SnapshotUntrustedError, pickle.UnpicklingError)):
        serialization.safe_loads(evil)
    assert "antigravity" not in sys.modules  # naming a module does not import it
    # A wrapper layer's own Snapshot subclass (scenarios.LayerSnapshot) rebuilds.
    from scenarios import SCENARIOS

    env = SCENARIOS["stale_obs_cache"].factory("branchgym/TreeMDP-v0")()
    env.reset(seed=0)
    with branchgym.snapshot(env) as snap:
        copy = Snapshot.from_bytes(snap.to_bytes())
    names, s = [], copy
    while s is not None:
        names.append(type(s).__name__)
        s = getattr(s, "inner", None) if type(s).__name__ == "StackSnapshot" else None
    assert "LayerSnapshot" in names or "LayerSnapshot" in repr(copy.payload), names
    branchgym.restore(env, copy)
