"""Built-in environments. Importing :mod:`branchgym` registers them under ``branchgym/``.

Registration must stay cheap: entry points are strings, so heavy adapters (WebShop's
index, ALFWorld's planner, Docker) load only when an env is made.
"""

from __future__ import annotations

from branchgym.registration import register

__all__ = ["register_builtin_envs"]


def register_builtin_envs() -> None:
    """Register every env this package ships (called once by ``import branchgym``)."""
    register(
        "branchgym/TreeMDP-v0",
        "branchgym.envs.toy.tree_mdp:TreeMDP",
        description="finite stochastic tree MDP with exact V, Q and Var(G) (discrete)",
    )
    register(
        "branchgym/TextTreeMDP-v0",
        "branchgym.envs.toy.text_tree_mdp:TextTreeMDP",
        description="TreeMDP as a text maze for LLM policies (admissible actions in info)",
    )
    register(
        "branchgym/WebShop-v0",
        "branchgym.envs.webshop.env:WebShopEnv",
        description="WebShop text shop: upstream pages, BM25 search and reward (generated "
        "catalog; data_dir= for the real one)",
        requires=(("Stemmer", "webshop"), ("thefuzz", "webshop")),
    )
    register(
        "branchgym/ALFWorld-v0",
        "branchgym.envs.alfworld.env:ALFWorldEnv",
        kind="pddl+fast",
        description="ALFWorld text games on the real engine (textworld + fast-downward)",
        requires=(
            ("alfworld", "alfworld"),
            ("textworld", "alfworld"),
            ("fast_downward", "alfworld"),
        ),
        # ALFWorld's own episode limit (its config's max_steps); the Branching PO paper's
        # ALFWorld runs use 40: pass max_episode_steps=40 to match them.
        max_episode_steps=50,
    )
    register(
        "branchgym/SWEBench-v0",
        "branchgym.envs.swebench.env:SWEBenchEnv",
        kind="overlay",
        picklable=False,
        max_episode_steps=50,
        description="repository tasks by shell commands + submit, SWE-bench grading "
        "(12 generated tasks; overlayfs or git sandboxes under bubblewrap)",
    )
