import subprocess
import sys

import gymnasium as gym
import pytest

import branchgym
from branchgym.envs.toy import TreeMDP
from branchgym.error import RegistrationError, UnknownEnvError


def test_module_prefixed_make_works_without_import():
    code = (
        "import gymnasium as gym; env = gym.make('branchgym:branchgym/TreeMDP-v0');"
        "env.reset(seed=0); s = env.snapshot(); print(type(env).__name__, s.kind)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["SnapshotAPI", "state"]


def test_import_registers_everything_under_namespace():
    ids = [s.id for s in branchgym.branch_specs()]
    assert "branchgym/TreeMDP-v0" in ids and "branchgym/TextTreeMDP-v0" in ids
    for i in ids:
        assert i in gym.registry


def test_unknown_id_suggests_closest():
    with pytest.raises(UnknownEnvError, match="Did you mean 'branchgym/TreeMDP-v0'"):
        branchgym.make("branchgym/TreeMDP-v9")
    with pytest.raises(UnknownEnvError, match="branchgym list"):
        branchgym.branch_spec("nothing/like-this")


def test_register_user_sandbox():
    spec = branchgym.register(
        "mylab/Tree-v0",
        TreeMDP,
        kwargs={"depth": 2},
        description="a user sandbox",
        requires=(("no_such_mod_xyz", "foo"),),
    )
    assert spec.missing() == ["foo"]
    env = gym.make("mylab/Tree-v0")
    env.reset(seed=0)
    with env.snapshot() as s:
        assert s.env_id == "mylab/Tree-v0"


def test_register_rejects_unknown_strategy():
    with pytest.raises(RegistrationError, match="'pickle'"):
        branchgym.register("mylab/X-v0", TreeMDP, snapshot="magic")


def test_snapshot_identity_same_for_make_and_direct_construction():
    made = gym.make("branchgym/TreeMDP-v0")
    made.reset(seed=0)
    direct = TreeMDP()
    direct.reset(seed=5)
    with made.unwrapped.snapshot() as s:
        direct.restore(s)
    assert direct.state_digest() == made.unwrapped.state_digest()


def test_unregister_removes_an_env_from_both_registries():
    from branchgym.registration import unregister

    branchgym.register("mylab/Gone-v0", TreeMDP, kwargs={"depth": 2})
    assert "mylab/Gone-v0" in gym.registry
    unregister("mylab/Gone-v0")
    assert "mylab/Gone-v0" not in gym.registry
    assert "mylab/Gone-v0" not in [s.id for s in branchgym.branch_specs()]
    with pytest.raises(UnknownEnvError, match="branchgym list"):
        unregister("mylab/Gone-v0")
