"""``branchgym/ALFWorld-v0``: ALFWorld's text household games on the real engine, snapshottable.

The agent reads ALFWorld's text (the first observation ends with ``Your task is to: ...``),
acts with ALFWorld's commands (``go to countertop 1``, ``heat mug 1 with microwave 1``),
listed in ``info["admissible_actions"]``; anything else is answered ``Nothing happens.``
and changes nothing, as in ALFWorld. Reward is 1 on the step that achieves the goal, which
ends the episode; the registered env stops after 40 steps (``max_episode_steps``) as the
source documents do.

Snapshots (``snapshot_mode``):

* ``auto`` (kind ``pddl+fast``): restoring into the instance that took the snapshot uses
  the fast path (fast-downward's state id plus a copy of textworld's Python side); restoring
  into any other instance, or after pickling, rebuilds the state from its facts (the
  portable path). Which path ran is counted in :attr:`ALFWorldEnv.restore_counts`.
* ``portable`` (kind ``pddl``): always the portable path.
* ``replay`` (kind ``replay``): reset and replay the actions; the fallback, also used if a
  rebuilt state cannot be translated. Its cost grows with depth.

Every snapshot pickles (a few KB: the problem's index and key, the facts that differ from
the game's initial facts, the last observation and the action history).
"""

from __future__ import annotations

import dataclasses
import os
import string
from collections import Counter
from collections.abc import Sequence
from typing import Any

import gymnasium as gym

from branchgym.core import Snapshot, SnapshottableEnv
from branchgym.digest import stable_hash
from branchgym.envs.alfworld.problems import load_problems
from branchgym.envs.alfworld.tasks import Problem
from branchgym.error import (
    DataError,
    GameLoadError,
    InvalidActionError,
    ResetNeededError,
    SnapshotCorruptError,
    SnapshotMismatchError,
)
from branchgym.serialization import register_snapshot_types

__all__ = ["ALFWorldEnv", "SNAPSHOT_MODES", "CHARSET"]

#: Snapshot modes and the kind of snapshot each produces.
SNAPSHOT_MODES = {"auto": "pddl+fast", "portable": "pddl", "replay": "replay"}
CHARSET = string.ascii_letters + string.digits + string.punctuation + " \n"
_NOTHING = "Nothing happens."


@dataclasses.dataclass
class _State:
    """A snapshot's payload. The in-process parts are dropped when it is pickled."""

    problem_index: int
    problem_key: str
    step_index: int
    feedback: str
    last_command: str | None
    moves: int
    won: bool
    done: bool
    invalid: bool
    history: tuple[str, ...]
    rng: Any
    capture: Any = None  # EngineCapture: fast path, this process and engine only
    facts: Any = None  # _Facts: the Python-side facts, this process only
    delta: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None  # portable facts
    static: Any = None  # the game's initial facts, to compute the delta when pickling

    def portable_delta(self) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
        if self.delta is None and self.static is not None:
            facts = self.facts if self.facts is not None else getattr(self.capture, "facts", None)
            if facts is not None:
                from branchgym.envs.alfworld.engine import fact_delta

                self.delta = fact_delta(self.static, facts)
        return self.delta

    def __getstate__(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["delta"] = self.portable_delta()
        out["capture"] = out["facts"] = out["static"] = None
        return out


# Snapshot bytes may hold it (branchgym.serialization allows only registered types).
register_snapshot_types(_State)


class ALFWorldEnv(SnapshottableEnv[str, str]):
    """ALFWorld's text games (textworld + fast-downward), with fast and portable snapshots.

    Args:
        problems: ``in_distribution`` (default) or ``out_of_distribution`` (the shipped
            sets), the path of real ALFWorld ``.tw-pddl`` games (a file or a folder) or of
            a ``.jsonl(.gz)`` problem file, or a sequence of
            :class:`~branchgym.envs.alfworld.tasks.Problem`.
        data_dir: ALFWorld's real data (the ``json_2.1.1`` folder): plays the games of
            ``split`` that ALFWorld itself would, filtered and ordered as ALFWorld does
            (:mod:`branchgym.envs.alfworld.dataset`); replaces ``problems``.
        split: With ``data_dir``: ``train`` (default, as ALFWorld), ``valid_seen``,
            ``valid_unseen`` or ``valid_train``.
        task_types: With ``data_dir``: task-type ids 1-6 or names to keep (default all).
        num_games: With ``data_dir``: keep the first N games (ALFWorld's
            ``num_train_games``/``num_eval_games``; default all).
        game_order: With ``data_dir``: ``upstream`` (``os.walk`` order, as ALFWorld) or
            ``sorted`` (the same on every machine).
        snapshot_mode: ``auto``, ``portable`` or ``replay`` (see the module doc).
        expert_plan_in_info: Add the planner's plan from the current state to every info
            as ``expert_plan`` (what alfworld's planner expert provides; costs a search).
        render_mode: ``ansi`` (``render()`` returns the last text) or ``human`` (prints it).

    ``reset(seed=s)`` plays the problem ``np_random`` draws; ``reset(options={"problem": i})``
    plays problem ``i`` (an index or a name).
    """

    metadata = {"render_modes": ["ansi", "human"]}
    default_env_id = "branchgym/ALFWorld-v0"
    snapshot_kind = "pddl+fast"
    snapshot_picklable = True

    def __init__(
        self,
        problems: str | os.PathLike[str] | Sequence[Problem] = "in_distribution",
        *,
        data_dir: str | os.PathLike[str] | None = None,
        split: str | None = None,
        task_types: Sequence[int | str] | None = None,
        num_games: int | None = None,
        game_order: str = "upstream",
        snapshot_mode: str = "auto",
        expert_plan_in_info: bool = False,
        render_mode: str | None = None,
    ) -> None:
        """Load the problem list and start an engine (its own fast-downward copy)."""
        from branchgym.envs.alfworld.engine import Engine, require_engine

        if snapshot_mode not in SNAPSHOT_MODES:
            raise ValueError(
                f"snapshot_mode={snapshot_mode!r}; choose one of {sorted(SNAPSHOT_MODES)}"
            )
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode={render_mode!r}; choose 'ansi' or 'human'")
        require_engine()
        if data_dir is not None:
            if not (isinstance(problems, str) and problems == "in_distribution"):
                raise DataError(
                    "give either problems= or data_dir= (ALFWorld's json_2.1.1 with a split), "
                    "not both"
                )
            from branchgym.envs.alfworld.dataset import load_split

            self.problems: tuple[Problem, ...] = load_split(
                data_dir,
                split or "train",
                task_types=task_types,
                num_games=num_games,
                order=game_order,
            )
        elif split is not None or task_types is not None or num_games is not None:
            raise DataError(
                "split=, task_types= and num_games= select from ALFWorld's real data: give "
                "data_dir= (the json_2.1.1 folder) too, or choose a shipped set with problems="
            )
        else:
            self.problems = load_problems(problems)
        self._names = {p.name: i for i, p in enumerate(self.problems)}
        self.snapshot_mode = snapshot_mode
        self.snapshot_kind = SNAPSHOT_MODES[snapshot_mode]  # type: ignore[misc]
        self.expert_plan_in_info = bool(expert_plan_in_info)
        self.render_mode = render_mode
        self.observation_space = gym.spaces.Text(max_length=32768, charset=CHARSET)
        self.action_space = gym.spaces.Text(min_length=0, max_length=256, charset=CHARSET)
        self.engine = Engine()
        self.restore_counts: Counter[str] = Counter()
        self._index: int | None = None
        self._loaded: int | None = None
        self._history: list[str] = []
        self._done = False
        self._invalid = False
        self._text = ""
        self.step_index = 0

    # ------------------------------------------------------------------ episode
    @property
    def problem(self) -> Problem:
        """The problem of the current episode."""
        if self._index is None:
            raise ResetNeededError("no episode yet; call env.reset() first.")
        return self.problems[self._index]

    def _resolve(self, choice: Any) -> int:
        if isinstance(choice, str):
            if choice not in self._names:
                raise ValueError(
                    f"no problem named {choice!r} in this env's {len(self.problems)} problems; "
                    "use an index or one of env.unwrapped.problems[i].name"
                )
            return self._names[choice]
        if isinstance(choice, int) and not isinstance(choice, bool):
            if not 0 <= choice < len(self.problems):
                raise ValueError(f"problem index {choice} out of range [0, {len(self.problems)})")
            return int(choice)
        raise ValueError(f"options['problem'] must be an int index or a name, got {choice!r}")

    def _load(self, index: int) -> None:
        if self._loaded != index:
            self.engine.load(self.problems[index])
            self._loaded = index

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Start a problem: ``options["problem"]`` if given, else one drawn from ``np_random``."""
        super().reset(seed=seed)
        options = options or {}
        if "problem" in options:
            index = self._resolve(options["problem"])
        else:
            index = int(self.np_random.integers(len(self.problems)))
        self._index = index
        self._load(index)
        state = self.engine.reset()
        self._history = []
        self._done = False
        self._invalid = False
        self.step_index = 0
        self._text = state.feedback
        return self._text, self._info(state)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Play one ALFWorld command; anything not admissible gets ``Nothing happens.``."""
        if self._index is None:
            raise ResetNeededError("Cannot call step() before reset(); call env.reset() first.")
        if self._done:
            raise ResetNeededError(
                "the episode is over (the goal was achieved); call env.reset() to play again."
            )
        if not isinstance(action, str):
            raise InvalidActionError(
                f"ALFWorld actions are text commands like 'go to countertop 1', got "
                f"{type(action).__name__}; pick one of info['admissible_actions']."
            )
        valid = self.engine.state["_valid_commands"] or []
        state, _, done = self.engine.step(action)
        self._invalid = action.strip() not in valid
        self._history.append(action)
        self.step_index += 1
        won = bool(state["won"])
        self._done = bool(done)
        self._text = state.feedback
        return self._text, 1.0 if won else 0.0, self._done, False, self._info(state)

    def _info(self, state: Any) -> dict[str, Any]:
        problem = self.problem
        info = {
            "admissible_actions": list(state["admissible_commands"] or []),
            "won": bool(state["won"]),
            "task": problem.goal,
            "task_type": problem.task_type,
            "problem": problem.name,
            "gamefile": problem.gamefile or None,
            "invalid_action": self._invalid,
        }
        if self.expert_plan_in_info:
            info["expert_plan"] = [] if self._done else self.engine.replan()
        return info

    def expert_plan(self) -> list[str]:
        """The planner's plan from the current state (alfworld's planner expert)."""
        if self._index is None:
            raise ResetNeededError("no episode yet; call env.reset() first.")
        return [] if self._done else self.engine.replan()

    def render(self) -> str | None:
        """The last observation (``ansi``), or print it (``human``)."""
        if self.render_mode == "ansi":
            return self._text
        if self.render_mode == "human":
            print(self._text)
        return None

    def close(self) -> None:
        """Release the engine (its library copy goes back to the process pool)."""
        engine = self.__dict__.get("engine")
        if engine is not None:
            engine.close()
        super().close()

    # ------------------------------------------------------------------ snapshots
    def _snapshot_config(self) -> Any:
        config = dict(self.spec.kwargs) if self.spec is not None else {}
        config.pop("render_mode", None)  # rendering does not change the game
        config.pop("expert_plan_in_info", None)
        # The problems themselves, not how they were named: same games, same identity.
        config["problems"] = tuple(p.key for p in self.problems)
        # Every mode restores every other mode's snapshots (a replay snapshot replays).
        config.pop("snapshot_mode", None)
        return config

    def snapshot(self) -> Snapshot:
        """Save the current state (see the module doc for the kinds)."""
        if self._index is None:
            raise ResetNeededError("Cannot snapshot before reset(); call env.reset() first.")
        state = self.engine.state
        payload = _State(
            problem_index=self._index,
            problem_key=self.problem.key,
            step_index=self.step_index,
            feedback=self._text,
            last_command=state.get("last_command"),
            moves=self.engine.moves,
            won=bool(state["won"]),
            done=self._done,
            invalid=self._invalid,
            history=tuple(self._history),
            rng=self._rng_state(),
        )
        if self.snapshot_mode == "auto":
            payload.capture = self.engine.capture()
            payload.static = self.engine.static
        elif self.snapshot_mode == "portable":
            payload.facts = self.engine.current_facts()
            payload.static = self.engine.static
        return self._new_snapshot(payload, meta={"problem": self.problem.name})

    def restore(self, snapshot: Snapshot) -> tuple[str, dict[str, Any]]:
        """Restore: fast path in the instance that took it, else portable, else replay."""
        payload = self._open_snapshot(snapshot)
        if not isinstance(payload, _State):
            raise SnapshotCorruptError(
                f"ALFWorld snapshot payload is a {type(payload).__name__}, not a saved ALFWorld "
                "state; take a new snapshot with env.snapshot()."
            )
        index = payload.problem_index
        if not (isinstance(index, int) and 0 <= index < len(self.problems)):
            raise SnapshotCorruptError(f"ALFWorld snapshot names problem {index!r}: damaged")
        if self.problems[index].key != payload.problem_key:
            raise SnapshotMismatchError(
                f"the snapshot's problem {index} is not this env's problem {index} (the game "
                "files changed since); restore into an env built from the same games."
            )
        path = self._restore_engine(payload, index)
        self.restore_counts[path] += 1
        self._index = index
        self._history = list(payload.history)
        self.step_index = int(payload.step_index)
        self._done = bool(payload.done)
        self._invalid = bool(payload.invalid)
        self._text = payload.feedback
        if payload.rng is not None:
            self._set_rng_state(payload.rng)
        else:  # the snapshotted env had never drawn a problem at random: neither has this one
            self._np_random = None
        return self._text, self._info(self.engine.state)

    def _restore_engine(self, payload: _State, index: int) -> str:
        engine = self.engine
        if engine.can_restore_fast(payload.capture):
            engine.restore_fast(payload.capture)
            return "fast"
        if self.snapshot_mode != "replay":
            facts = payload.facts
            if facts is None and payload.capture is not None:
                facts = payload.capture.facts
            try:
                self._load(index)
                if facts is None and payload.delta is not None:
                    facts = engine.facts_from_delta(*payload.delta)
                if facts is not None:
                    engine.restore_facts(
                        facts,
                        feedback=payload.feedback,
                        last_command=payload.last_command,
                        moves=payload.moves,
                    )
                    return "portable"
            except GameLoadError:
                pass  # the rebuilt state does not translate: fall back to replay
            except (TypeError, ValueError, KeyError) as exc:
                raise SnapshotCorruptError(
                    f"ALFWorld snapshot facts are malformed ({exc}); take a new snapshot."
                ) from exc
        return self._replay(payload, index)

    def _replay(self, payload: _State, index: int) -> str:
        self._load(index)
        self.engine.reset()
        for i, command in enumerate(payload.history):
            if not isinstance(command, str):
                raise SnapshotCorruptError("ALFWorld snapshot history holds a non-text action")
            _, _, done = self.engine.step(command)
            if done and i != len(payload.history) - 1:
                raise SnapshotCorruptError(
                    f"replaying the snapshot's actions ended the game at action {i + 1} of "
                    f"{len(payload.history)}: the snapshot does not belong to this problem."
                )
        return "replay"

    def state_digest(self) -> str:
        """Hash of the game, its facts, the last text and the episode counters."""
        if self._index is None:
            return stable_hash(type(self).__qualname__, None)
        from branchgym.envs.alfworld.engine import fact_data

        state = self.engine.state
        facts = sorted(fact_data(p) for p in self.engine.current_facts().propositions())
        return stable_hash(
            type(self).__qualname__,
            self.problem.key,
            facts,
            self._text,
            list(state["admissible_commands"] or []),
            bool(state["won"]),
            self._done,
            self._invalid,
            self.step_index,
            self.engine.moves,
            self._rng_state(),
        )
