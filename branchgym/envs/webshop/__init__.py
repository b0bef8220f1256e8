"""WebShop (Yao et al., 2022) as a snapshottable Gymnasium env: ``branchgym/WebShop-v0``.

A faithful re-implementation of upstream ``princeton-nlp/WebShop``'s text environment
(pages, navigation, observation modes, BM25 search, goals and the original reward),
with a seeded generated catalog in the upstream file schemas for tests and demos, and
loading of the real data from a folder the user points at.
"""

from branchgym.envs.webshop.data import SPLITS, Catalog, load_catalog
from branchgym.envs.webshop.env import EpisodeState, WebShopEnv
from branchgym.envs.webshop.expert import ScriptedExpert, run_expert
from branchgym.envs.webshop.reward import get_reward

__all__ = [
    "Catalog",
    "EpisodeState",
    "SPLITS",
    "ScriptedExpert",
    "WebShopEnv",
    "get_reward",
    "load_catalog",
    "run_expert",
]
