"""ALFWorld's tasks as branchgym poses them: the problem format, rooms and task tables.

* :class:`Problem`: one game (a PDDL problem in ALFWorld's conventions, its goal text and
  the planner's expert plan), as the generator writes it and the loaders read it.
* :class:`Layout` and :data:`LAYOUTS`: the hand-written rooms the generator draws
  problems in (the real AI2-THOR rooms are :mod:`~branchgym.envs.alfworld.floorplans`).
* :data:`TASK_TYPES`, :data:`SPLIT_TASK_COUNTS`, :data:`SPLIT_LAYOUTS`,
  :data:`THOR_SPLITS`: ALFWorld's task types and the shipped sets' task mix and rooms.
* :func:`alfworld_constants`: ALFWorld's own affordance tables.

This module sits under the generator and loaders
(:mod:`~branchgym.envs.alfworld.problems`) and the floor plans, which both build on it.
Nothing here needs the engine until a problem is played (:meth:`Problem.game`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from branchgym.error import DataError

__all__ = [
    "TASK_TYPES",
    "THOR_SPLITS",
    "SPLIT_TASK_COUNTS",
    "Layout",
    "LAYOUTS",
    "SPLIT_LAYOUTS",
    "Problem",
    "alfworld_constants",
]

#: ALFWorld's six task types, in ALFWorld's numbering (1..6).
TASK_TYPES: tuple[str, ...] = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)

#: The sets generated on real AI2-THOR floor plans (:mod:`~branchgym.envs.alfworld.floorplans`):
#: ``thor_seen`` on ALFRED's training floor plans with ``valid_seen``'s task mix,
#: ``thor_unseen`` on its held-out ``valid_unseen`` floor plans with that split's mix.
THOR_SPLITS: dict[str, str] = {"thor_seen": "in_distribution", "thor_unseen": "out_of_distribution"}

#: Problems per task type in each shipped set: ALFWorld's ``valid_seen`` (140) and
#: ``valid_unseen`` (134) evaluation splits, in :data:`TASK_TYPES` order.
SPLIT_TASK_COUNTS: dict[str, tuple[int, ...]] = {
    "in_distribution": (35, 13, 27, 16, 25, 24),
    "out_of_distribution": (24, 18, 31, 23, 21, 17),
    "thor_seen": (35, 13, 27, 16, 25, 24),
    "thor_unseen": (24, 18, 31, 23, 21, 17),
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """A room: its receptacles and the object types that may appear in it.

    Attributes:
        name: Layout id (``kitchen_a``).
        room: ALFWorld's scene type: ``Kitchen``, ``LivingRoom``, ``Bedroom``, ``Bathroom``.
        receptacles: Receptacle types, one entry per receptacle (repeats allowed).
        objects: Object types that may be placed in this room.
        lamp: Whether a desk lamp stands in the room (needed by ``look_at_obj_in_light``).
        instances: For rooms read from a real floor plan: ``(type, THOR id, location)`` of
            each receptacle, in :attr:`receptacles` order (empty: ids and locations are
            drawn, as for the hand-written layouts).
    """

    name: str
    room: str
    receptacles: tuple[str, ...]
    objects: tuple[str, ...]
    lamp: bool = False
    instances: tuple[tuple[str, str, str], ...] = ()


_KITCHEN = (
    "Apple", "Bread", "Egg", "Lettuce", "Potato", "Tomato", "Mug", "Cup", "Bowl", "Plate",
    "Pan", "Pot", "Kettle", "Knife", "ButterKnife", "Fork", "Spoon", "Spatula", "Ladle",
    "DishSponge", "SaltShaker", "PepperShaker", "SoapBottle", "WineBottle",
)  # fmt: skip
_LIVING = (
    "Book", "Box", "CellPhone", "CreditCard", "KeyChain", "Laptop", "Newspaper", "Pillow",
    "RemoteControl", "Statue", "Vase", "Watch", "TissueBox", "Candle", "WateringCan",
)  # fmt: skip
_BEDROOM = (
    "AlarmClock", "Book", "CD", "CellPhone", "CreditCard", "KeyChain", "Laptop", "Pen",
    "Pencil", "Pillow", "BaseballBat", "TennisRacket", "BasketBall", "Mug", "Bowl", "Cloth",
    "Watch",
)  # fmt: skip
_BATHROOM = (
    "SoapBar", "SoapBottle", "SprayBottle", "ToiletPaper", "Cloth", "DishSponge", "HandTowel",
    "Candle", "TissueBox", "Plunger",
)  # fmt: skip

#: The room layouts. ``*_a``/``*_b`` are the in-distribution rooms (the generator's
#: training rooms), ``*_c``/``*_d`` the held-out rooms of the out-of-distribution set.
LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        Layout(
            "kitchen_a",
            "Kitchen",
            (
                "Cabinet",
                "Cabinet",
                "Cabinet",
                "CounterTop",
                "CounterTop",
                "Drawer",
                "Drawer",
                "Fridge",
                "Microwave",
                "SinkBasin",
                "StoveBurner",
                "CoffeeMachine",
            ),
            _KITCHEN,
        ),  # fmt: skip
        Layout(
            "kitchen_b",
            "Kitchen",
            (
                "Cabinet",
                "Cabinet",
                "CounterTop",
                "DiningTable",
                "Drawer",
                "Fridge",
                "Microwave",
                "SinkBasin",
                "GarbageCan",
            ),
            _KITCHEN,
        ),  # fmt: skip
        Layout(
            "livingroom_a",
            "LivingRoom",
            (
                "Sofa",
                "ArmChair",
                "CoffeeTable",
                "SideTable",
                "SideTable",
                "TVStand",
                "Drawer",
                "Shelf",
                "GarbageCan",
            ),
            _LIVING,
            lamp=True,
        ),  # fmt: skip
        Layout(
            "bedroom_a",
            "Bedroom",
            ("Bed", "Desk", "SideTable", "Drawer", "Drawer", "Dresser", "Shelf", "GarbageCan"),
            _BEDROOM,
            lamp=True,
        ),
        Layout(
            "bathroom_a",
            "Bathroom",
            (
                "Toilet",
                "SinkBasin",
                "Cabinet",
                "Cabinet",
                "CounterTop",
                "TowelHolder",
                "GarbageCan",
            ),
            _BATHROOM,
        ),  # fmt: skip
        Layout(
            "kitchen_c",
            "Kitchen",
            (
                "Cabinet",
                "Cabinet",
                "Cabinet",
                "Cabinet",
                "CounterTop",
                "Fridge",
                "Microwave",
                "SinkBasin",
                "Shelf",
                "StoveBurner",
                "Toaster",
            ),
            _KITCHEN,
        ),  # fmt: skip
        Layout(
            "kitchen_d", "Kitchen", ("CounterTop", "Fridge", "Microwave", "SinkBasin"), _KITCHEN
        ),
        Layout(
            "livingroom_c",
            "LivingRoom",
            ("Sofa", "CoffeeTable", "SideTable", "Shelf", "Shelf", "Cabinet"),
            _LIVING,
            lamp=True,
        ),
        Layout(
            "bedroom_c",
            "Bedroom",
            ("Bed", "Desk", "Shelf", "Shelf", "Drawer", "Safe"),
            _BEDROOM,
            lamp=True,
        ),
        Layout(
            "bathroom_c",
            "Bathroom",
            ("BathtubBasin", "SinkBasin", "Toilet", "Shelf", "GarbageCan"),
            _BATHROOM,
        ),
    )
}

#: Layouts of each shipped set.
SPLIT_LAYOUTS: dict[str, tuple[str, ...]] = {
    "in_distribution": ("kitchen_a", "kitchen_b", "livingroom_a", "bedroom_a", "bathroom_a"),
    "out_of_distribution": ("kitchen_c", "kitchen_d", "livingroom_c", "bedroom_c", "bathroom_c"),
}


@dataclasses.dataclass(frozen=True)
class Problem:
    """One ALFWorld game: a PDDL problem, its goal text and (when known) the expert plan.

    Attributes:
        name: Unique name, ALFWorld style (``pick_heat_then_place_in_recep-Mug-None-
            CounterTop-kitchen_a-0007``), or the game file's folder for real games.
        task_type: One of :data:`TASK_TYPES` (``unknown`` for games whose type is unknown).
        goal: The task as the agent reads it (``put a hot mug in countertop``).
        pddl_problem: The PDDL problem text.
        pddl_domain: Domain text; ``None`` means alfworld's shipped ``alfred.pddl``.
        grammar: The textworld grammar with the goal filled in; ``None`` means alfworld's
            shipped ``alfred.twl2`` with :attr:`goal` substituted for ``UNKNOWN GOAL``,
            as ALFWorld's own game generation does.
        expert_plan: The planner's plan from the initial state, or ``None`` if not computed.
        layout: The room layout it was generated on (empty for real games).
        split: The set it belongs to (``in_distribution``, ``generated``, a path, ...).
        num_receptacles: Receptacles in the room.
        gamefile: The ``game.tw-pddl`` it was loaded from (empty for generated problems).
    """

    name: str
    task_type: str
    goal: str
    pddl_problem: str
    pddl_domain: str | None = None
    grammar: str | None = None
    expert_plan: tuple[str, ...] | None = None
    layout: str = ""
    split: str = ""
    num_receptacles: int = 0
    gamefile: str = ""

    @property
    def expert_plan_length(self) -> int | None:
        """Number of actions in the expert plan (``None`` if not computed)."""
        return None if self.expert_plan is None else len(self.expert_plan)

    @property
    def key(self) -> str:
        """Stable hash of everything that defines the game (domain, grammar, problem)."""
        cached = self.__dict__.get("_key")
        if cached is None:
            h = hashlib.sha256()
            for part in (self.pddl_domain or "", self.grammar or "", self.goal, self.pddl_problem):
                h.update(part.encode("utf-8"))
                h.update(b"\x00")
            cached = h.hexdigest()[:24]
            object.__setattr__(self, "_key", cached)
        return cached

    def __branchgym_state__(self) -> Any:
        # Problems are part of env kwargs: hash by identity of the game, not by text.
        return ("alfworld.Problem", self.key)

    def game(self) -> dict[str, str]:
        """The game dict textworld's ``PddlEnv.load`` takes (domain, grammar, problem)."""
        from branchgym.envs.alfworld.engine import alfred_domain, alfred_grammar

        return {
            "pddl_domain": self.pddl_domain or alfred_domain(),
            "grammar": self.grammar or alfred_grammar().replace("UNKNOWN GOAL", self.goal),
            "pddl_problem": self.pddl_problem,
        }

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``expert_plan`` as a list)."""
        out = dataclasses.asdict(self)
        out["expert_plan"] = None if self.expert_plan is None else list(self.expert_plan)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Problem:
        """Inverse of :meth:`to_json`; malformed records raise :class:`DataError`."""
        if not isinstance(data, dict):
            raise DataError(f"a problem record must be a JSON object, got {type(data).__name__}")
        missing = [k for k in ("name", "task_type", "goal", "pddl_problem") if k not in data]
        if missing:
            raise DataError(
                f"problem record {data.get('name', '?')!r} lacks {missing}; regenerate the file "
                "with branchgym.envs.alfworld.problems.save_problems()."
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in fields}
        if kwargs.get("expert_plan") is not None:
            kwargs["expert_plan"] = tuple(kwargs["expert_plan"])
        return cls(**kwargs)


def alfworld_constants() -> Any:
    """The ``alfworld.gen.constants`` module (affordances, receptacle sets, ALFRED's scenes).

    Raises:
        DependencyMissingError: the ALFWorld engine is not installed (``make alfworld``).
    """
    from branchgym.envs.alfworld.engine import require_engine

    require_engine("generating ALFWorld problems")
    import alfworld.gen.constants as constants

    return constants
