"""A hand-coded ALFWorld expert that plays from what the agent sees, like ALFWorld's own.

:class:`~branchgym.envs.alfworld.expert.PlannerExpert` asks fast-downward for a plan from
the true state: it walks straight to the fridge that holds the lettuce. That is the right
reference for branching studies, but as SFT data it teaches a policy to know things no
agent can know. ALFWorld ships a second expert for this (its "handcoded" expert): it
reads the goal, searches the room receptacle by receptacle (the likely ones first),
opens what is closed, remembers what it saw, and only then takes, transforms and places.

:class:`HandCodedExpert` is that kind of expert, written for this package from the same
rules (see docs/alfworld.md, "Experts"). Everything it uses is in the text the agent
gets: the welcome text (the receptacles), the goal sentence (parsed with ALFWorld's own
goal templates), each observation and the admissible commands. It never reads the PDDL
state, the problem's name or the planner. Its only prior is ALFWorld's affordance table
(which receptacle types can hold which object types), which ALFWorld's expert also uses.

It is a deterministic state machine: the same episode gives the same actions. It can
fail (a long search in a big room runs out of steps); :func:`play` reports how often.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym

from branchgym.error import InvalidActionError

__all__ = ["Goal", "HandCodedExpert", "parse_goal", "parse_receptacles", "play", "PlayResult"]

#: Where each task type transforms the object, as receptacle classes (first present wins).
_APPLIANCES: dict[str, tuple[str, ...]] = {
    "pick_heat_then_place_in_recep": ("microwave",),
    "pick_cool_then_place_in_recep": ("fridge",),
    "pick_clean_then_place_in_recep": ("sinkbasin", "bathtubbasin"),
}
_VERB = {
    "pick_heat_then_place_in_recep": "heat",
    "pick_cool_then_place_in_recep": "cool",
    "pick_clean_then_place_in_recep": "clean",
}


@dataclasses.dataclass(frozen=True)
class Goal:
    """A goal sentence, parsed: the task type and the classes it names (lower case)."""

    task_type: str
    obj: str
    target: str
    """The receptacle class to put the object in, or the lamp class for look tasks."""

    @property
    def count(self) -> int:
        """Objects to place: two for ``pick_two_obj_and_place``, else one."""
        return 2 if self.task_type == "pick_two_obj_and_place" else 1


@functools.lru_cache(maxsize=1)
def _goal_patterns() -> list[tuple[str, re.Pattern[str], tuple[str, ...]]]:
    from branchgym.envs.alfworld.tasks import alfworld_constants

    alfworld_constants()  # the engine check: the templates come with it
    import alfworld.gen.goal_library as goal_library

    out = []
    for task_type, entry in goal_library.gdict.items():
        for template in entry["templates"]:
            fields = tuple(re.findall(r"\{(\w+)\}", template))
            pattern = re.escape(template)
            for f in set(fields):
                pattern = pattern.replace(re.escape("{" + f + "}"), rf"(?P<{f}>\S+)")
            out.append((task_type, re.compile(rf"^{pattern}\.?$"), fields))
    return out


@functools.cache
def _likely_receptacles(cls: str) -> frozenset[str]:
    """Receptacle classes ALFWorld's affordance table lets hold objects of class ``cls``."""
    from branchgym.envs.alfworld.tasks import alfworld_constants

    table = alfworld_constants().VAL_RECEPTACLE_OBJECTS
    return frozenset(r.lower() for r, objs in table.items() if cls in {o.lower() for o in objs})


def parse_goal(text: str) -> Goal:
    """Parse a goal sentence with ALFWorld's goal templates.

    Args:
        text: The goal as the agent reads it (``put a hot mug in countertop``), with or
            without the leading ``Your task is to:``.

    Raises:
        InvalidActionError: No template of ALFWorld's goal library matches ``text``.
    """
    goal = text.strip().split("Your task is to:")[-1].strip().rstrip(".").strip().lower()
    for task_type, pattern, _fields in _goal_patterns():
        m = pattern.match(goal)
        if m is None:
            continue
        groups = m.groupdict()
        target = groups.get("toggle") or groups.get("recep") or ""
        if groups.get("obj") and target:
            return Goal(task_type, groups["obj"], target)
    raise InvalidActionError(
        f"no ALFWorld goal template matches {text!r}; the hand-coded expert plays goals "
        "written with alfworld's goal library (alfworld.gen.goal_library)."
    )


def parse_receptacles(welcome: str) -> list[str]:
    """The receptacles the welcome text lists, in its order (``cabinet 10``, ...)."""
    m = re.search(r"you see (.*?)\.\s*(?:\n|$)", welcome, flags=re.IGNORECASE | re.DOTALL)
    return _names(m.group(1)) if m else []


def _names(listing: str) -> list[str]:
    """``a lettuce 2, and a lettuce 1`` -> ``['lettuce 2', 'lettuce 1']``."""
    out = []
    for part in re.split(r",\s*(?:and\s+)?|\s+and\s+", listing.strip().rstrip(".")):
        part = re.sub(r"^(?:an?|some|the)\s+", "", part.strip())
        if part and part != "nothing":
            out.append(part)
    return out


def _cls(name: str) -> str:
    return name.rsplit(" ", 1)[0]


def _seen(obs: str) -> list[str] | None:
    """Objects an observation says are at the current receptacle (None: says nothing)."""
    m = re.search(r"(?:On the [^,]+|In it), you see (.*?)\.(?:\s|$)", obs)
    if m is None:
        return None
    return _names(m.group(1))


class HandCodedExpert:
    """Search, open, take, transform, place: from observations and admissible commands only.

    Use it as a policy, feeding every observation in order::

        expert = HandCodedExpert()
        obs, info = env.reset()
        while not done:
            obs, reward, terminated, truncated, info = env.step(expert(obs, info))

    A new episode starts when an observation holds ALFWorld's welcome text (or call
    :meth:`reset`). ``close_receptacles`` closes what it opened before it walks on, as
    ALFWorld's expert does; ``False`` saves those steps.
    """

    def __init__(self, *, close_receptacles: bool = True) -> None:
        """Make an expert with no episode yet."""
        self.close_receptacles = close_receptacles
        self.reset()

    def reset(self) -> None:
        """Forget the episode."""
        self.goal: Goal | None = None
        self.receptacles: list[str] = []
        self.contents: dict[str, set[str]] = {}
        self.checked: set[str] = set()
        self.opened_by_me: set[str] = set()
        self.closed: set[str] = set()
        self.at: str | None = None
        self.holding: str | None = None
        self.transformed = False
        self.placed: set[str] = set()
        self.target_instance: str | None = None
        self.failed: set[tuple[str | None, str]] = set()
        self.last_action: str | None = None
        self.done = False

    # ---------------------------------------------------------------- observing

    def observe(self, obs: str, info: Mapping[str, Any]) -> None:
        """Update the memory with the feedback of the last action (or the welcome text)."""
        if "Welcome to TextWorld" in obs or self.goal is None:
            self.reset()
            self.receptacles = parse_receptacles(obs)
            self.goal = parse_goal(str(info.get("task") or obs))
            return
        a = self.last_action
        if a is None:
            return
        if obs.strip().startswith("Nothing happens"):
            self.failed.add((self.at, a))
            return
        if a.startswith("go to "):
            self.at = a[len("go to ") :]
            if f"{self.at} is closed" in obs:
                self.closed.add(self.at)
        elif a.startswith("open "):
            self.closed.discard(self.at or "")
            if self.at:
                self.opened_by_me.add(self.at)
        elif a.startswith("close "):
            self.closed.add(a[len("close ") :])
            self.opened_by_me.discard(a[len("close ") :])
        elif a.startswith("take "):
            obj, _, recep = a[len("take ") :].partition(" from ")
            self.holding, self.transformed = obj, False
            self.contents.get(recep, set()).discard(obj)
        elif a.startswith("move "):
            obj, _, recep = a[len("move ") :].partition(" to ")
            self.holding = None
            self.contents.setdefault(recep, set()).add(obj)
            if self.goal and _cls(obj) == self.goal.obj and recep == self.target_instance:
                self.placed.add(obj)
        elif a.split(" ", 1)[0] in ("heat", "cool", "clean"):
            self.transformed = True
        elif a.startswith("use "):
            self.done = True
        seen = _seen(obs)
        if seen is not None and self.at is not None:
            self.contents[self.at] = set(seen)
            self.checked.add(self.at)

    # ---------------------------------------------------------------- acting

    def __call__(self, obs: str, info: Mapping[str, Any]) -> str:
        """The next action, after observing ``obs`` (``info`` holds the admissible list)."""
        self.observe(obs, info)
        admissible = list(info.get("admissible_actions") or info.get("admissible_commands") or [])
        action = self._decide(set(admissible))
        if action not in admissible or (self.at, action) in self.failed:
            action = self._fallback(admissible)
        self.last_action = action
        return action

    def _where(self, cls: str, exclude: set[str] = frozenset()) -> tuple[str, str] | None:
        """(object, receptacle) of a remembered object of class ``cls``, here first."""
        spots = sorted(self.contents.items(), key=lambda kv: kv[0] != self.at)
        for recep, objs in spots:
            for obj in sorted(objs):
                if _cls(obj) == cls and obj not in exclude:
                    return obj, recep
        return None

    def _search_order(self, cls: str) -> list[str]:
        """Receptacles not yet looked into: those whose type can hold ``cls`` first."""
        likely = _likely_receptacles(cls)
        todo = [r for r in self.receptacles if r not in self.checked]
        return [r for r in todo if _cls(r) in likely] + [r for r in todo if _cls(r) not in likely]

    def _go(self, recep: str, admissible: set[str]) -> str:
        """Walk to ``recep``, closing what this expert opened here first (if asked)."""
        if (
            self.close_receptacles
            and self.at in self.opened_by_me
            and f"close {self.at}" in admissible
        ):
            return f"close {self.at}"
        return f"go to {recep}"

    def _fetch(self, cls: str, admissible: set[str], exclude: set[str]) -> str:
        """Actions that end with an object of class ``cls`` in hand."""
        if self.at is not None and self.at in self.closed and self.at not in self.checked:
            return f"open {self.at}"
        found = self._where(cls, exclude)
        if found is not None:
            obj, recep = found
            if recep == self.at:
                return f"open {recep}" if recep in self.closed else f"take {obj} from {recep}"
            return self._go(recep, admissible)
        order = self._search_order(cls)
        if not order:
            return "look"
        return self._go(order[0], admissible)

    def _instance(self, cls: str) -> str | None:
        """The receptacle of class ``cls`` to use: the first the room lists."""
        same = [r for r in self.receptacles if _cls(r) == cls]
        return same[0] if same else None

    def _decide(self, admissible: set[str]) -> str:
        goal = self.goal
        if goal is None:
            return "look"
        if goal.task_type == "look_at_obj_in_light":
            return self._decide_look(goal, admissible)
        if self.holding is not None and _cls(self.holding) != goal.obj:
            return f"move {self.holding} to {self.at}" if self.at else "look"
        if self.target_instance is None:
            self.target_instance = self._instance(goal.target)
        target = self.target_instance
        if target is None:
            return "look"
        if self.holding is None:
            there = {o for o in self.contents.get(target, set()) if _cls(o) == goal.obj}
            self.placed |= there
            if len(self.placed) >= goal.count:
                return "look"
            return self._fetch(goal.obj, admissible, exclude=self.placed)
        if goal.task_type in _APPLIANCES and not self.transformed:
            appliance = next(
                (r for c in _APPLIANCES[goal.task_type] for r in self.receptacles if _cls(r) == c),
                None,
            )
            if appliance is None:
                return "look"
            if self.at != appliance:
                return self._go(appliance, admissible)
            return f"{_VERB[goal.task_type]} {self.holding} with {appliance}"
        if self.at != target:
            return self._go(target, admissible)
        if target in self.closed:
            return f"open {target}"
        return f"move {self.holding} to {target}"

    def _decide_look(self, goal: Goal, admissible: set[str]) -> str:
        if self.holding is None or _cls(self.holding) != goal.obj:
            if self.holding is not None:
                return f"move {self.holding} to {self.at}"
            return self._fetch(goal.obj, admissible, exclude=set())
        lamp = self._where(goal.target)
        if lamp is None:
            if self.at is not None and self.at in self.closed and self.at not in self.checked:
                return f"open {self.at}"
            order = self._search_order(goal.target)
            return self._go(order[0], admissible) if order else "look"
        obj, recep = lamp
        if recep != self.at:
            return self._go(recep, admissible)
        if recep in self.closed:
            return f"open {recep}"
        return f"use {obj}"

    def _fallback(self, admissible: Sequence[str]) -> str:
        """An admissible action when the plan's is not: the next unvisited place, else look."""
        for recep in self.receptacles:
            if recep not in self.checked and f"go to {recep}" in admissible:
                return f"go to {recep}"
        return "look" if "look" in admissible else (admissible[0] if admissible else "look")


@dataclasses.dataclass(frozen=True)
class PlayResult:
    """One hand-coded expert episode."""

    problem: str
    won: bool
    steps: int
    actions: tuple[str, ...]


def play(
    env: gym.Env,
    problem: int | str | None = None,
    *,
    max_steps: int = 50,
    close_receptacles: bool = True,
    seed: int | None = None,
) -> PlayResult:
    """Play one episode with the :class:`HandCodedExpert` (``max_steps``: ALFWorld's 50)."""
    options = None if problem is None else {"problem": problem}
    obs, info = env.reset(seed=seed, options=options)
    expert = HandCodedExpert(close_receptacles=close_receptacles)
    actions: list[str] = []
    won = False
    for _ in range(max_steps):
        action = expert(obs, info)
        obs, _, terminated, truncated, info = env.step(action)
        actions.append(action)
        won = bool(info["won"])
        if terminated or truncated:
            break
    return PlayResult(str(info["problem"]), won, len(actions), tuple(actions))
