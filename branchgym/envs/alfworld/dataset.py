"""ALFWorld's real data, found and filtered the way ALFWorld's own environment does it.

ALFWorld's data (``$ALFWORLD_DATA/json_2.1.1``) has one folder per split (``train``,
``valid_seen``, ``valid_unseen``, ``valid_train``), then one folder per task and trial::

    json_2.1.1/valid_seen/pick_heat_then_place_in_recep-Mug-None-CounterTop-7/
        trial_T20190909_041538_235934/
            traj_data.json      # ALFRED's trajectory record: task_type, ...
            game.tw-pddl        # the text game: pddl_domain, grammar, pddl_problem, solvable

ALFWorld's ``AlfredTWEnv.collect_game_files`` walks a split's folder bottom-up
(``os.walk(..., topdown=False)``) and keeps a trial folder's game when, in this order:

1. the folder has a ``traj_data.json``;
2. its path contains neither ``movable`` nor ``Sliced`` (movable receptacles and sliced
   objects are not supported by the text engine);
3. the trajectory's ``task_type`` is one of the configured task types (all six by default);
4. a ``game.tw-pddl`` exists beside it;
5. the game has a ``solvable`` key, and it is true.

:func:`collect_game_files` applies the same rules in the same order and walks in the
same order (so on the same file system it lists the same games in the same order as
ALFWorld: ``os.walk`` order is the directory order of the file system, not sorted), and
returns what it skipped and why. ``order="sorted"`` gives a machine-independent order.
``num_games`` keeps the first N games, as ALFWorld's ``num_train_games`` /
``num_eval_games`` do.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

from branchgym.envs.alfworld.problems import load_tw_pddl
from branchgym.envs.alfworld.tasks import Problem
from branchgym.error import DataError

__all__ = [
    "DATA_SPLITS",
    "TASK_TYPE_IDS",
    "GameFiles",
    "SKIP_RULES",
    "collect_game_files",
    "load_split",
]

#: ALFWorld's split folders under ``json_2.1.1`` (``valid_seen`` is its in-distribution
#: evaluation set, ``valid_unseen`` its out-of-distribution one).
DATA_SPLITS: tuple[str, ...] = ("train", "valid_seen", "valid_unseen", "valid_train")

#: ALFWorld's task-type ids (its config's ``env.task_types``: ``[1, 2, 3, 4, 5, 6]``).
TASK_TYPE_IDS: dict[int, str] = {
    1: "pick_and_place_simple",
    2: "look_at_obj_in_light",
    3: "pick_clean_then_place_in_recep",
    4: "pick_heat_then_place_in_recep",
    5: "pick_cool_then_place_in_recep",
    6: "pick_two_obj_and_place",
}


#: Why a trial folder is left out, in the order the rules apply.
SKIP_RULES: tuple[str, ...] = (
    "movable_or_sliced",
    "task_type",
    "missing_game",
    "missing_solvable",
    "unsolvable",
)


@dataclasses.dataclass(frozen=True)
class GameFiles:
    """The games of a split and the trial folders left out, with the rule that left each.

    Attributes:
        games: ``game.tw-pddl`` paths, in ALFWorld's order (or sorted).
        skipped: Rule -> trial folders: ``movable_or_sliced``, ``task_type``,
            ``missing_game``, ``missing_solvable``, ``unsolvable``.
        root: The split folder that was walked.
    """

    games: tuple[Path, ...]
    skipped: dict[str, tuple[Path, ...]]
    root: Path

    def summary(self) -> str:
        """One line: how many games were kept and why the others were not."""
        left = ", ".join(f"{len(v)} {k}" for k, v in self.skipped.items() if v) or "none"
        return f"{len(self.games)} games in {self.root} (skipped: {left})"


def _split_folder(data_dir: str | os.PathLike[str], split: str) -> Path:
    if split not in DATA_SPLITS:
        raise DataError(f"ALFWorld split {split!r}: choose one of {list(DATA_SPLITS)}")
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise DataError(
            f"ALFWorld data_dir {str(data_dir)!r} is not a folder; point it at json_2.1.1 "
            "(the folder holding train/, valid_seen/, valid_unseen/), e.g. "
            "$ALFWORLD_DATA/json_2.1.1 after `alfworld-download` on a connected machine."
        )
    folder = root / split
    if not folder.is_dir():
        found = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise DataError(
            f"ALFWorld data_dir {str(root)!r} has no {split}/ folder (found: {found or 'none'}); "
            "point data_dir at json_2.1.1 itself."
        )
    return folder


def _task_types(task_types: Sequence[int | str] | None) -> set[str]:
    if task_types is None:
        return set(TASK_TYPE_IDS.values())
    out = set()
    for t in task_types:
        name = TASK_TYPE_IDS.get(t) if isinstance(t, int) else t
        if name not in TASK_TYPE_IDS.values():
            raise DataError(
                f"unknown ALFWorld task type {t!r}: give ids 1-6 or names "
                f"{sorted(TASK_TYPE_IDS.values())}"
            )
        out.add(name)
    return out


def collect_game_files(
    data_dir: str | os.PathLike[str],
    split: str = "train",
    *,
    task_types: Sequence[int | str] | None = None,
    order: str = "upstream",
) -> GameFiles:
    """The games ALFWorld would play for ``split`` of ``data_dir`` (``json_2.1.1``).

    Args:
        data_dir: The ``json_2.1.1`` folder.
        split: One of :data:`DATA_SPLITS`.
        task_types: Task-type ids (1-6) or names to keep; default all six, as ALFWorld.
        order: ``upstream`` (``os.walk(topdown=False)`` order, as ALFWorld) or ``sorted``.

    Raises:
        DataError: no such folder or split, an unknown task type or order, an unreadable
            ``traj_data.json``/``game.tw-pddl``, or no game left after the filters.
    """
    if order not in ("upstream", "sorted"):
        raise DataError(f"order={order!r}: choose 'upstream' or 'sorted'")
    root = _split_folder(data_dir, split)
    wanted = _task_types(task_types)
    games: list[Path] = []
    skipped: dict[str, list[Path]] = {k: [] for k in SKIP_RULES}
    for here, _dirs, files in os.walk(root, topdown=False):
        if "traj_data.json" not in files:
            continue
        folder = Path(here)
        if "movable" in here or "Sliced" in here:
            skipped["movable_or_sliced"].append(folder)
            continue
        try:
            traj = json.loads((folder / "traj_data.json").read_text(encoding="utf-8"))
            task_type = traj["task_type"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{folder}/traj_data.json is not an ALFRED trajectory: {exc}") from exc
        if task_type not in wanted:
            skipped["task_type"].append(folder)
            continue
        game = folder / "game.tw-pddl"
        if not game.is_file():
            skipped["missing_game"].append(folder)
            continue
        try:
            data = json.loads(game.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise DataError(f"cannot read ALFWorld game {game}: {exc}") from exc
        if not isinstance(data, dict) or "solvable" not in data:
            skipped["missing_solvable"].append(folder)
            continue
        if not data["solvable"]:
            skipped["unsolvable"].append(folder)
            continue
        games.append(game)
    if order == "sorted":
        games.sort()
    out = GameFiles(tuple(games), {k: tuple(v) for k, v in skipped.items()}, root)
    if not games:
        raise DataError(f"no playable ALFWorld game: {out.summary()}")
    return out


def load_split(
    data_dir: str | os.PathLike[str],
    split: str = "train",
    *,
    task_types: Sequence[int | str] | None = None,
    num_games: int | None = None,
    order: str = "upstream",
) -> tuple[Problem, ...]:
    """The problems of a real ALFWorld split, filtered and ordered as ALFWorld does.

    ``num_games`` keeps the first N (ALFWorld's ``num_train_games``/``num_eval_games``;
    ``None`` or a value <= 0 keeps all). Each problem's ``gamefile`` is its game's path and
    its ``split`` the split's name.
    """
    files = collect_game_files(data_dir, split, task_types=task_types, order=order)
    games = files.games
    if num_games is not None and num_games > 0:
        games = games[:num_games]
    problems = []
    for game in games:
        problem = load_tw_pddl(game, files.root)
        if problem is not None:  # collect_game_files already dropped the unsolvable ones
            problems.append(dataclasses.replace(problem, split=split))
    return tuple(problems)
