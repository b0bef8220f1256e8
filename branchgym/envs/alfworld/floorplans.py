"""Rooms read from the real AI2-THOR floor plans that ALFWorld's package ships.

ALFWorld (``alfworld/gen/layouts/``) ships, for every ALFRED floor plan, the object types
of the scene (``FloorPlan<n>-objects.json``) and the receptacle instances the agent can
walk to, each with its THOR id and the pose it is seen from (``-openable.json``:
``"Cabinet|+00.68|+00.50|-02.20": [x, z, rotation, horizon]``). :func:`floor_plan_layout`
turns one floor plan into a :class:`~branchgym.envs.alfworld.tasks.Layout`:

* receptacles: every instance of ``-openable.json`` whose type is a static ALFWorld
  receptacle, under ALFWorld's names (``Sink`` -> ``SinkBasin``, ``Bathtub`` ->
  ``BathtubBasin``), with its real THOR id and a location from its pose; plus one
  instance of each static receptacle type the scene lists in ``-objects.json`` but
  ``-openable.json`` does not place (stove burners, coffee machines, toasters: their
  counts are not in the files, so one each);
* objects: the scene's pickupable object types (ALFWorld's receptacle/object table);
* a lamp when the scene has a desk lamp.

So a kitchen has its real 13-51 receptacles instead of a hand-written 4-12. Objects are
still placed by the seeded generator under ALFWorld's affordance rules.

Splits follow ALFRED: ``thor_unseen`` uses the held-out floor plans of ALFRED's
``valid_unseen`` split (:data:`UNSEEN_FLOOR_PLANS`, one per room type); ``thor_seen``
uses ALFRED's training floor plans (alfworld's ``TRAIN_SCENE_NUMBERS``) without those.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from branchgym.envs.alfworld.tasks import (
    LAYOUTS,
    SPLIT_TASK_COUNTS,
    TASK_TYPES,
    THOR_SPLITS,
    Layout,
    Problem,
    alfworld_constants,
)
from branchgym.error import DataError

__all__ = [
    "UNSEEN_FLOOR_PLANS",
    "floor_plan_layout",
    "floor_plans",
    "room_of",
    "set_statistics",
    "split_layouts",
]

#: ALFRED's ``valid_unseen`` floor plans: one kitchen, living room, bedroom, bathroom.
UNSEEN_FLOOR_PLANS: tuple[int, ...] = (10, 219, 308, 424)

_ALFWORLD_NAME = {"Sink": "SinkBasin", "Bathtub": "BathtubBasin"}
_ROOMS = (("Kitchen", 1), ("LivingRoom", 201), ("Bedroom", 301), ("Bathroom", 401))


def room_of(floor_plan: int) -> str:
    """ALFRED's room type of a floor plan number (1-30 kitchens, 201-230 living rooms, ...)."""
    for room, first in _ROOMS:
        if first <= floor_plan < first + 30:
            return room
    raise DataError(f"FloorPlan{floor_plan} is not an ALFRED floor plan (1-30, 201-230, ...)")


def _layouts_dir() -> Path:
    from branchgym.envs.alfworld.engine import require_engine

    require_engine("reading AI2-THOR floor plans")
    import alfworld

    return Path(alfworld.__file__).parent / "gen" / "layouts"


@functools.cache
def floor_plan_layout(floor_plan: int) -> Layout:
    """The room of ``FloorPlan<floor_plan>``, from alfworld's shipped layout files.

    Raises:
        DataError: the floor plan's files are not in the installed alfworld package.
    """
    room = room_of(floor_plan)
    folder = _layouts_dir()
    try:
        openable = json.loads((folder / f"FloorPlan{floor_plan}-openable.json").read_text())
        scene = json.loads((folder / f"FloorPlan{floor_plan}-objects.json").read_text())
    except (OSError, ValueError) as exc:
        raise DataError(
            f"FloorPlan{floor_plan}: cannot read alfworld's layout files: {exc}"
        ) from exc
    constants = alfworld_constants()
    static = set(constants.STATIC_RECEPTACLES) & set(constants.RECEPTACLES)
    instances: list[tuple[str, str, str]] = []
    for thor_id, pose in sorted(openable.items()):
        base = thor_id.split("|", 1)[0]
        kind = _ALFWORLD_NAME.get(base, base)
        if kind not in static:
            continue
        x, z, rotation, horizon = pose
        # ALFWorld's locations are grid cells of 0.25 m, rotation in quarter turns
        loc = f"loc|{round(x / 0.25)}|{round(z / 0.25)}|{round(rotation / 90) % 4}|{round(horizon)}"
        rid = f"{thor_id}|{kind}" if kind != base else thor_id
        instances.append((kind, rid, loc))
    placed = {k for k, _, _ in instances}
    for i, base in enumerate(sorted(set(scene))):
        kind = _ALFWORLD_NAME.get(base, base)
        if kind in static and kind not in placed and base not in _ALFWORLD_NAME:
            # in the scene, but not among the walk-to poses: one instance, its own cell
            instances.append((kind, f"{kind}|+00.00|+00.00|{i:+06.2f}", f"loc|{-20 - i}|0|0|30"))
    pickupable = {o for objs in constants.VAL_RECEPTACLE_OBJECTS.values() for o in objs}
    objects = tuple(
        sorted(
            o
            for o in set(scene)
            if o in pickupable and o not in static and "Sliced" not in o and o != "DeskLamp"
        )
    )
    return Layout(
        name=f"FloorPlan{floor_plan}",
        room=room,
        receptacles=tuple(k for k, _, _ in instances),
        objects=objects,
        lamp="DeskLamp" in scene,
        instances=tuple(instances),
    )


def floor_plans(split: str) -> tuple[int, ...]:
    """The floor plans of a THOR set: ALFRED's training rooms, or its unseen ones."""
    if split == "thor_unseen":
        return UNSEEN_FLOOR_PLANS
    if split == "thor_seen":
        train = tuple(int(n) for n in alfworld_constants().TRAIN_SCENE_NUMBERS)
        return tuple(n for n in train if n not in UNSEEN_FLOOR_PLANS)
    raise DataError(f"unknown THOR set {split!r}; choose one of {sorted(THOR_SPLITS)}")


def split_layouts(split: str) -> tuple[Layout, ...]:
    """The rooms a THOR set's problems are generated in."""
    return tuple(floor_plan_layout(n) for n in floor_plans(split))


def _describe(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, float)
    if a.size == 0:
        return {"mean": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"mean": float(a.mean()), "min": float(a.min()), "max": float(a.max())}


def _room(layout: str) -> str:
    """The room type of a problem's layout: a real floor plan or a hand-written room."""
    if layout.startswith("FloorPlan"):
        return room_of(int(layout[len("FloorPlan") :]))
    known = LAYOUTS.get(layout)
    return known.room if known is not None else "unknown"


def set_statistics(problems: tuple[Problem, ...] | list[Problem]) -> dict[str, Any]:
    """Receptacles per room by room type, expert plan length and task mix of a set."""
    by_room: dict[str, list[float]] = {}
    for p in problems:
        by_room.setdefault(_room(p.layout), []).append(p.num_receptacles)
    plans = [p.expert_plan_length for p in problems if p.expert_plan_length is not None]
    mix = Counter(p.task_type for p in problems)
    return {
        "problems": len(problems),
        "receptacles_by_room": {r: _describe(v) for r, v in sorted(by_room.items())},
        "expert_plan_length": _describe(plans),
        "task_mix": [mix.get(t, 0) for t in TASK_TYPES],
    }


def floor_plan_statistics(split: str) -> dict[str, Any]:
    """The same room statistics over the real floor plans of a set (no problems needed)."""
    by_room: dict[str, list[float]] = {}
    for n in floor_plans(split):
        lay = floor_plan_layout(n)
        by_room.setdefault(lay.room, []).append(len(lay.receptacles))
    return {
        "floor_plans": len(floor_plans(split)),
        "receptacles_by_room": {r: _describe(v) for r, v in sorted(by_room.items())},
        "task_mix": list(SPLIT_TASK_COUNTS[THOR_SPLITS[split]]),
    }
