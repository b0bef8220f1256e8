import gymnasium as gym
import pytest

import branchgym  # noqa: F401  (registers the envs)


@pytest.fixture
def tree_env():
    env = gym.make("branchgym/TreeMDP-v0")
    yield env
    env.close()


@pytest.fixture
def text_env():
    env = gym.make("branchgym/TextTreeMDP-v0")
    yield env
    env.close()
