"""The wire codec of `branchgym serve` and the command's argument checks (no server runs)."""

import json

import gymnasium as gym
import numpy as np
import pytest

from branchgym.cli import main
from branchgym.error import OptionError
from branchgym.remote import raise_remote_error, ws_url
from branchgym.serve.wire import AnySpace, AnyText, decode, decode_space, encode, encode_space

VALUES = [
    None, True, 0, -3, 2**70, 1.5, float("inf"), "text ü", [1, [2, (3, "x")]], (1, 2.5),
    {"a": 1, "b": [None]}, {1: "int key", (2, 3): "tuple key"}, {"__tuple__": "looks tagged"},
    np.int64(7), np.float32(0.25), np.bool_(False), np.arange(6, dtype=np.int16).reshape(2, 3),
    np.zeros((0, 4)), b"\x00\xffbytes", {3, 4}, frozenset({"a"}),
]  # fmt: skip


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_values_survive_strict_json(value):
    text = json.dumps(encode(value), allow_nan=False)  # strict JSON: no NaN literals
    back = decode(json.loads(text))
    assert type(back) is type(value)
    if isinstance(value, np.ndarray):
        assert back.dtype == value.dtype and np.array_equal(back, value)
    else:
        assert back == value


def test_nan_and_unknown_objects():
    assert np.isnan(decode(json.loads(json.dumps(encode(float("nan")), allow_nan=False))))
    obj = object()
    assert decode(encode(obj)) == repr(obj)  # deterministic, not invertible


def test_plain_json_stays_plain():
    value = {"observation": "room 3", "info": {"admissible_actions": ["go north"], "won": False}}
    assert encode(value) == value


SPACES = [
    gym.spaces.Discrete(5, start=-1),
    gym.spaces.Box(-1.0, 2.0, shape=(3,), dtype=np.float32),
    gym.spaces.Text(12, min_length=1, charset="abc"),
    gym.spaces.MultiDiscrete([3, 4]),
    gym.spaces.MultiBinary(4),
    gym.spaces.Dict({"a": gym.spaces.Discrete(2), "b": gym.spaces.Tuple([gym.spaces.Discrete(3)])}),
]


@pytest.mark.parametrize("space", SPACES, ids=lambda s: type(s).__name__)
def test_spaces_survive_the_wire(space):
    back = decode_space(json.loads(json.dumps(encode_space(space))))
    assert back == space or repr(back) == repr(space)
    assert back.contains(space.sample())


def test_text_spaces_that_accept_any_unicode_stay_that_way():
    env = gym.make("branchgym/WebShop-v0")
    back = decode_space(encode_space(env.observation_space))
    assert isinstance(back, AnyText) and back.contains("ü title")
    env.close()
    weird = decode_space({"type": "Graph", "repr": "Graph(...)"})
    assert isinstance(weird, AnySpace) and weird.contains(object())


def test_urls_and_error_mapping():
    assert ws_url("http://h:1") == "ws://h:1/ws" == ws_url("ws://h:1/ws/")
    assert ws_url("https://h") == "wss://h/ws"
    with pytest.raises(OptionError):
        ws_url("h:1")
    from branchgym.error import (
        ForeignSnapshotError,
        InvalidActionError,
        RemoteAuthError,
        RemoteError,
        ResetNeededError,
    )

    cases = {
        "UNAUTHORIZED": RemoteAuthError, "FOREIGN_SNAPSHOT": ForeignSnapshotError,
        "UNKNOWN_SNAPSHOT": ForeignSnapshotError, "EPISODE_DONE": ResetNeededError,
        "CAPACITY_REACHED": RemoteError,
    }  # fmt: skip
    for code, cls in cases.items():
        with pytest.raises(cls):
            raise_remote_error({"code": code, "message": "m"})
    with pytest.raises(InvalidActionError):  # the env's own branchgym error, typed again
        raise_remote_error({"code": "EXECUTION_ERROR", "error_type": "InvalidActionError"})
    with pytest.raises(RemoteError) as err:  # a name that is not a branchgym error
        raise_remote_error({"code": "EXECUTION_ERROR", "error_type": "SystemExit"})
    assert err.value.code == "EXECUTION_ERROR"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--env-kwargs", "[1]"], "JSON object"),
        (["--env-kwargs", "{bad"], "JSON object"),
        (["--host", "0.0.0.0"], "without a token"),
    ],
)
def test_serve_refuses_bad_arguments(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("BRANCHGYM_SERVE_TOKEN", raising=False)
    assert main(["serve", "branchgym/TextTreeMDP-v0", "--port", "0", *argv]) == 1
    assert message in capsys.readouterr().err


def test_remote_env_without_a_server(monkeypatch):
    from branchgym.error import RemoteError
    from branchgym.remote import RemoteEnv

    monkeypatch.delenv("BRANCHGYM_REMOTE_URL", raising=False)
    with pytest.raises(OptionError, match="BRANCHGYM_REMOTE_URL"):
        RemoteEnv()
    with pytest.raises(RemoteError) as err:
        RemoteEnv("ws://127.0.0.1:1", connect_timeout=2)
    assert err.value.code == "CONNECTION_FAILED" and "branchgym serve" in str(err.value)
