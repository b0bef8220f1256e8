"""TextTreeMDP: TreeMDP's dynamics with text observations and text actions, for LLM policies.

The agent walks a maze whose rooms are the tree's nodes. Observations describe the room
and list the exits; actions are the exits' names (``go north``), also listed in
``info["admissible_actions"]``. Anything else is answered with invalid-action feedback
and changes nothing, as text benchmarks do.
"""

from __future__ import annotations

import string
from typing import Any

import gymnasium as gym

from branchgym.envs.toy.tree_mdp import TreeMDP, TreeStructure
from branchgym.error import SnapshotCorruptError

__all__ = ["TextTreeMDP", "action_names_for"]

_DIRECTIONS = ("north", "east", "south", "west", "up", "down", "left", "right")
CHARSET = string.ascii_letters + string.digits + string.punctuation + " \n"


def action_names_for(n_actions: int) -> list[str]:
    """The text of each action index: ``go north``, ``go east``, ... (``take path k`` beyond 8)."""
    if n_actions <= len(_DIRECTIONS):
        return [f"go {d}" for d in _DIRECTIONS[:n_actions]]
    return [f"take path {k}" for k in range(1, n_actions + 1)]


class TextTreeMDP(TreeMDP):
    """TreeMDP with text I/O. Same kwargs as :class:`TreeMDP`; exact values are the same."""

    default_env_id = "branchgym/TextTreeMDP-v0"

    def __init__(self, *args: Any, structure: TreeStructure | None = None, **kwargs: Any) -> None:
        """Build the tree and text spaces."""
        super().__init__(*args, structure=structure, **kwargs)
        self.actions = action_names_for(self.tree.n_actions)
        self._index = {a: i for i, a in enumerate(self.actions)}
        self.observation_space = gym.spaces.Text(max_length=1024, charset=CHARSET)
        self.action_space = gym.spaces.Text(min_length=0, max_length=256, charset=CHARSET)
        self.text = ""
        self.invalid = False

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Start at the entrance of the maze."""
        super().reset(seed=seed, options=options)
        self.text = (
            f"You stand at the entrance of a maze, in room 0. Each exit leads deeper; after "
            f"{self._moves()} moves you leave the maze and are scored. " + self._exits()
        )
        self.invalid = False
        return self.text, self._info()

    def step(self, action: Any):
        """Move through the exit named by ``action``; invalid text changes nothing."""
        node = self._require_live()
        key = " ".join(action.lower().split()) if isinstance(action, str) else None
        if key not in self._index:
            self.invalid = True
            # echo the action with characters of the observation space only
            shown = "".join(c if c in CHARSET else "?" for c in f"{action!r:.80}")
            self.text = (
                f"Invalid action: {shown}. Nothing happens. You are in room {node}. "
                + self._exits()
            )
            return self.text, 0.0, False, False, self._info()
        obs_node, reward, terminated, truncated, _ = super().step(self._index[key])
        self.invalid = False
        if terminated:
            self.text = (
                f"You {key} and arrive in room {obs_node}, an exit of the maze. "
                f"Your score: {reward:.3f}."
            )
        else:
            self.text = (
                f"You {key} and arrive in room {obs_node} (depth "
                f"{self.tree.depth[obs_node]} of {self.tree.max_depth}). " + self._exits()
            )
        return self.text, reward, terminated, truncated, self._info()

    def render(self) -> str | None:
        """The current observation text."""
        return self.text if self.render_mode == "ansi" else None

    # ---------------------------------------------------------------- snapshots
    def _get_state(self) -> tuple:
        return (*super()._get_state(), self.text, self.invalid)

    def _set_state(self, state: Any):
        if not isinstance(state, tuple) or len(state) != 5 or not isinstance(state[3], str):
            raise SnapshotCorruptError(
                f"TextTreeMDP snapshot payload is malformed ({state!r:.80}); take a new snapshot."
            )
        super()._set_state(state[:3])
        self.text, self.invalid = state[3], bool(state[4])
        return self.text, self._info()

    # ---------------------------------------------------------------- helpers
    def _moves(self) -> str:
        # a tree with leaves above its last level ends some episodes early
        leaf = self.tree.children[:, 0, 0] < 0
        short = bool(leaf.any() and self.tree.depth[leaf].min() < self.tree.max_depth)
        return f"at most {self.tree.max_depth}" if short else str(self.tree.max_depth)

    def _exits(self) -> str:
        return "Exits: " + ", ".join(self.actions) + "."

    def _info(self) -> dict[str, Any]:
        info = super()._info()
        done = self.node is not None and self.tree.is_terminal(self.node)
        info["admissible_actions"] = [] if done else list(self.actions)
        info["invalid_action"] = bool(getattr(self, "invalid", False))
        return info

    def action_names(self) -> list[str]:
        """The text of every action index."""
        return list(self.actions)
