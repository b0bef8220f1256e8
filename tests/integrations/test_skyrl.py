"""branchgym envs in skyrl-gym's registry, checked against skyrl-gym's BaseTextEnv contract."""

import json

import gymnasium as gym
import pytest

skyrl_gym = pytest.importorskip("skyrl_gym")

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput  # noqa: E402

import branchgym  # noqa: E402
from branchgym.error import InvalidActionError, SnapshotMismatchError  # noqa: E402
from branchgym.integrations.skyrl import (  # noqa: E402
    BranchgymTextEnv,
    register_skyrl_envs,
)

TEXT = "branchgym/TextTreeMDP-v0"
PROMPT = [{"role": "system", "content": "You are in a maze. Answer with one exit."}]


@pytest.fixture(scope="module", autouse=True)
def registered():
    return register_skyrl_envs()


def check_messages(messages):
    assert isinstance(messages, list)
    for m in messages:
        assert set(m) == {"role", "content"} and isinstance(m["content"], str)


def check_output(out):
    assert set(out) <= set(BaseTextEnvStepOutput.__annotations__)
    assert {"observations", "reward", "done", "metadata"} <= set(out)
    check_messages(out["observations"])
    assert isinstance(out["reward"], float) and isinstance(out["done"], bool)
    assert isinstance(out["metadata"], dict)


def play(env, actions_of):
    conversation, meta = env.init(PROMPT)
    info = meta["info"]
    outs = []
    while True:
        out = env.step(actions_of(info))
        check_output(out)
        outs.append(out)
        info = out["metadata"]["info"]
        if out["done"]:
            return conversation, outs


def test_every_branchgym_env_is_registered_with_a_json_spec(registered):
    ids = [s.id for s in branchgym.branch_specs()]
    assert registered == ids
    for env_id in ids:
        spec = skyrl_gym.spec(env_id)
        assert spec.entry_point == "branchgym.integrations.skyrl:BranchgymTextEnv"
        assert json.loads(spec.to_json())["kwargs"] == {"env_id": env_id}
    assert register_skyrl_envs() == ids  # idempotent


def test_an_episode_through_skyrl_gym_matches_the_gymnasium_env():
    env = skyrl_gym.make(TEXT, env_config={}, extras={"seed": 4})
    assert isinstance(env, BaseTextEnv) and isinstance(env, skyrl_gym.Env)
    assert env.spec.id == TEXT
    conversation, outs = play(env, lambda info: info["admissible_actions"][-1])
    check_messages(conversation)
    assert conversation[: len(PROMPT)] == PROMPT and "maze" in conversation[-1]["content"]
    assert outs[-1]["observations"] == [] and outs[-1]["done"]
    # the same actions in the Gymnasium env give the same rewards and observations
    ref = gym.make(TEXT)
    obs, info = ref.reset(seed=4)
    assert conversation[-1]["content"] == obs
    for out in outs:
        obs, reward, term, trunc, info = ref.step(info["admissible_actions"][-1])
        assert out["reward"] == float(reward)
        assert out["observations"] == ([] if term or trunc else [{"role": "user", "content": obs}])
    metrics = env.get_metrics()
    assert metrics["turns"] == len(outs)
    assert set(BaseTextEnv.aggregate_metrics([metrics, metrics])) >= {"turns", "return"}
    env.close()


def test_snapshot_and_restore_pass_through():
    env = skyrl_gym.make(TEXT, env_config={"transition_noise": 0.5}, extras={"seed": 1})
    conversation, meta = env.init([])
    first = env.step(meta["info"]["admissible_actions"][0])
    with env.snapshot() as snap:
        assert snap.turns == 1

        def rest():
            outs, info = [], first["metadata"]["info"]
            while not (outs and outs[-1]["done"]):
                outs.append(env.step(info["admissible_actions"][0]))
                info = outs[-1]["metadata"]["info"]
            return outs

        a = rest()
        restored = env.restore(snap)
        assert restored == first["observations"] and env.turns == 1
        assert rest() == a
    with pytest.raises(SnapshotMismatchError):
        env.restore(object())
    env.close()


def test_discrete_envs_take_integer_text_and_refuse_the_rest():
    env = skyrl_gym.make("branchgym/TreeMDP-v0", env_config={}, extras={"seed": 0, "max_turns": 2})
    conversation, _ = env.init([])
    assert conversation[-1]["content"].isdigit()
    check_output(env.step(" 1 "))
    with pytest.raises(InvalidActionError, match="integers"):
        env.step("north")
    out = env.step("0")
    assert out["done"]  # max_turns from extras
    env.close()


def test_webshop_through_skyrl_gym():
    env = skyrl_gym.make("branchgym/WebShop-v0", env_config={}, extras={"seed": 2, "max_turns": 4})
    conversation, meta = env.init(PROMPT)
    assert "Instruction" in conversation[-1]["content"]
    out = env.step("search[hoodie]")
    check_output(out)
    assert out["metadata"]["info"]["page"] == "results"
    env.close()


def test_bad_configs_are_typed_errors():
    from branchgym.error import OptionError, UnknownEnvError

    with pytest.raises(OptionError):
        BranchgymTextEnv(env_config=[1, 2], env_id=TEXT)
    with pytest.raises(OptionError):
        BranchgymTextEnv(env_config={})
    with pytest.raises(UnknownEnvError):
        register_skyrl_envs(["branchgym/NoSuch-v0"])
