"""ALFWorld problems: the shipped sets, a seeded generator, and real ``.tw-pddl`` games.

ALFWorld ships no game data that could be downloaded here, so branchgym authors its own
problems over ALFWorld's shipped ``alfred.pddl`` domain and ``alfred.twl2`` grammar. A
problem is a PDDL problem in ALFWorld's own conventions (object ids mangled from THOR ids,
``Mug|+01.20|+00.90|-00.35`` -> ``Mug_bar__plus_01_dot_20_bar__plus_00_dot_90_bar_...``,
sinks as ``Sink|...|SinkBasin``), the natural-language goal that ALFWorld's templates give
its task type, and the planner's expert plan.

* :func:`generate_problem` / :func:`generate_problems`: a seeded generator over the six
  task types of ALFWorld (pick and place, examine in light, clean, heat, cool, pick two)
  and a handful of room :data:`~branchgym.envs.alfworld.tasks.LAYOUTS` with 4 to 12
  receptacles. Object affordances (what fits where, what can be heated, cooled, cleaned)
  come from ALFWorld's own ``alfworld.gen.constants``; goals and their wording from
  ``alfworld.gen.goal_library``.
  Every problem is validated with fast-downward: it must load (an unsolvable goal crashes
  textworld's loader), its goal must not hold at the start, and the planner's plan must win
  when played through the engine.
* :func:`load_problem_set`: the fixed shipped sets, ``in_distribution`` (140 problems on
  the layouts the generator trains on, ALFWorld's ``valid_seen`` size and task mix) and
  ``out_of_distribution`` (134 problems on held-out layouts, ``valid_unseen``).
* :func:`load_problems`: a shipped set name, a ``.jsonl``/``.jsonl.gz`` problem file, or
  real ALFWorld ``game.tw-pddl`` files (a file, or a folder searched recursively).

The problem format (:class:`~branchgym.envs.alfworld.tasks.Problem`), the rooms and the
task tables are :mod:`~branchgym.envs.alfworld.tasks`, under this module and the floor
plans. Loading problems never needs the engine; generating and validating them does.

Why this module is over 600 lines: most of it is the generator's tables (affordances,
goal wording) next to the validation that keeps them consistent with the engine; the
loader reads what the generator writes.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from branchgym.envs.alfworld.tasks import (
    LAYOUTS,
    SPLIT_LAYOUTS,
    SPLIT_TASK_COUNTS,
    TASK_TYPES,
    THOR_SPLITS,
    Layout,
    Problem,
    alfworld_constants,
)
from branchgym.error import DataError

__all__ = [
    "SPLITS",
    "generate_from_plan",
    "generate_problem",
    "generate_problems",
    "generate_split",
    "load_problem_set",
    "load_problems",
    "load_tw_pddl",
    "save_problems",
    "export_tw_pddl",
    "mangle",
    "validate_problem",
    "InvalidProblemError",
]

#: The shipped sets and the file each lives in (package data, gzipped JSON lines).
SPLITS: dict[str, str] = {
    "in_distribution": "in_distribution.jsonl.gz",
    "out_of_distribution": "out_of_distribution.jsonl.gz",
    "thor_seen": "thor_seen.jsonl.gz",
    "thor_unseen": "thor_unseen.jsonl.gz",
}

#: Seed of the shipped sets; ``generate_split(split, seed=SHIPPED_SEED)`` rebuilds them.
SHIPPED_SEED = 20250105

# Which receptacle type each task needs present in the room (ALFWorld's GOALS_VALID says
# the same by room: heat and cool only in kitchens, clean in kitchens and bathrooms).
_TASK_APPLIANCE = {
    "pick_clean_then_place_in_recep": "SinkBasin",
    "pick_heat_then_place_in_recep": "Microwave",
    "pick_cool_then_place_in_recep": "Fridge",
}
_TASK_AFFORDANCE = {
    "pick_clean_then_place_in_recep": "Cleanable",
    "pick_heat_then_place_in_recep": "Heatable",
    "pick_cool_then_place_in_recep": "Coolable",
}
# Receptacles a desk lamp stands on (the lamp is toggled where it stands).
_LAMP_STANDS = ("Desk", "SideTable", "Dresser", "Shelf")


class InvalidProblemError(ValueError):
    """A generated problem failed validation (it is redrawn)."""


# Longest expert plan accepted: well inside the default 40-step limit.
MAX_PLAN_LENGTH = 30


# ------------------------------------------------------------------------ naming


def mangle(thor_id: str) -> str:
    """ALFWorld's PDDL spelling of a THOR id (``Mug|+01.20`` -> ``Mug_bar__plus_01_dot_20``)."""
    return (
        thor_id.replace("|", "_bar_")
        .replace("+", "_plus_")
        .replace("-", "_minus_")
        .replace(".", "_dot_")
        .replace(",", "_comma_")
    )


def _coord(rng: np.random.Generator) -> str:
    return f"{rng.uniform(-3.0, 3.0):+06.2f}"


def _thor_id(kind: str, rng: np.random.Generator, taken: set[str]) -> str:
    """A fresh THOR-style id; sinks and bathtubs carry their basin as ALFWorld's do."""
    while True:
        ident = f"{kind}|{_coord(rng)}|{_coord(rng)}|{_coord(rng)}"
        if kind in ("SinkBasin", "BathtubBasin"):
            base = kind.replace("Basin", "")
            ident = f"{base}|{_coord(rng)}|{_coord(rng)}|{_coord(rng)}|{kind}"
        if ident not in taken:
            taken.add(ident)
            return ident


def _location(rng: np.random.Generator, taken: set[str]) -> str:
    while True:
        x, z = (int(v) for v in rng.integers(-8, 9, size=2))
        rot = int(rng.integers(0, 4))
        horizon = int(rng.choice([-30, 0, 15, 30, 45, 60]))
        ident = f"loc|{x}|{z}|{rot}|{horizon}"
        if ident not in taken:
            taken.add(ident)
            return ident


# ------------------------------------------------------------------------ generator


def _goal_library() -> dict[str, Any]:
    import alfworld.gen.goal_library as goal_library

    return goal_library.gdict


def _can_contain(constants: Any, recep: str, obj: str) -> bool:
    return obj in constants.VAL_RECEPTACLE_OBJECTS.get(recep, ())


def _task_choices(layout: Layout, task_type: str, constants: Any) -> list[tuple[str, str]]:
    """Every (object type, target receptacle type) the task can use in this layout."""
    receps = sorted(set(layout.receptacles))
    if task_type == "look_at_obj_in_light":
        if not layout.lamp or not any(r in _LAMP_STANDS for r in receps):
            return []
        # The object must start somewhere it can be taken from.
        return [
            (obj, "DeskLamp")
            for obj in layout.objects
            if any(_can_contain(constants, r, obj) for r in receps)
        ]
    appliance = _TASK_APPLIANCE.get(task_type)
    if appliance is not None and appliance not in receps:
        return []
    affordance = _TASK_AFFORDANCE.get(task_type)
    out = []
    for obj in layout.objects:
        if affordance and obj not in constants.VAL_ACTION_OBJECTS[affordance]:
            continue
        for recep in receps:
            if recep == appliance or not _can_contain(constants, recep, obj):
                continue
            # The object must start in a receptacle of another type, or the goal may hold.
            if any(r != recep and _can_contain(constants, r, obj) for r in receps):
                out.append((obj, recep))
    return out


def _goal(task_type: str, obj: str, target: str, rng: np.random.Generator) -> tuple[str, str]:
    """(goal text, PDDL goal) from ALFWorld's goal library for this task."""
    entry = _goal_library()[task_type]
    template = entry["templates"][int(rng.integers(len(entry["templates"])))]
    if task_type == "look_at_obj_in_light":
        fill = {"obj": obj, "toggle": target, "recep": "", "mrecep": ""}
    else:
        fill = {"obj": obj, "recep": target, "toggle": "", "mrecep": ""}
    text = template.format(**{k: v.lower() for k, v in fill.items()})
    # The library writes '#' for the type dash and closes the problem's "(define" itself.
    pddl = entry["pddl"].replace("#", "-").format(**fill)
    return text, pddl


def generate_problem(
    layout: str | Layout,
    task_type: str,
    seed: int,
    *,
    name: str | None = None,
    split: str = "generated",
    validate: bool = True,
    max_attempts: int = 50,
) -> Problem:
    """Generate one problem of ``task_type`` in ``layout``, deterministically from ``seed``.

    Objects are placed where ALFWorld's affordance table allows, the target never starts in
    a receptacle of the goal's type, and (with ``validate``) the problem is loaded into the
    engine and solved by the planner; a problem that fails is redrawn (up to
    ``max_attempts`` times) from the same seed stream, so the result depends on ``seed`` only.

    Raises:
        ValueError: the task cannot be posed in this layout, or no valid problem was found.
    """
    lay = LAYOUTS[layout] if isinstance(layout, str) else layout
    if task_type not in TASK_TYPES:
        raise ValueError(f"unknown task type {task_type!r}; choose one of {TASK_TYPES}")
    constants = alfworld_constants()
    choices = _task_choices(lay, task_type, constants)
    if not choices:
        raise ValueError(
            f"task {task_type} cannot be posed in layout {lay.name} ({lay.room}); "
            "pick a layout with the appliance or lamp it needs."
        )
    rng = np.random.default_rng([int(seed), TASK_TYPES.index(task_type)])
    last_error = ""
    for attempt in range(max_attempts):
        obj, target = choices[int(rng.integers(len(choices)))]
        problem = _draw_problem(lay, task_type, obj, target, rng, constants, split, name, seed)
        if not validate:
            return problem
        try:
            return validate_problem(problem)
        except InvalidProblemError as exc:  # redraw from the same stream
            last_error = f"attempt {attempt}: {exc}"
    raise ValueError(f"no valid {task_type} problem in {lay.name} from seed {seed}: {last_error}")


def _draw_problem(
    lay: Layout,
    task_type: str,
    obj: str,
    target: str,
    rng: np.random.Generator,
    constants: Any,
    split: str,
    name: str | None,
    seed: int,
) -> Problem:
    taken: set[str] = set()
    if lay.instances:  # a real floor plan: its receptacles' THOR ids and locations
        receps = [(kind, rid) for kind, rid, _ in lay.instances]
        locations = {rid: loc for _, rid, loc in lay.instances}
        taken |= set(locations) | set(locations.values())
    else:
        receps = [(kind, _thor_id(kind, rng, taken)) for kind in lay.receptacles]
        locations = {rid: _location(rng, taken) for _, rid in receps}
    start = _location(rng, taken)

    placed: list[tuple[str, str, str]] = []  # (type, thor id, receptacle thor id)

    def place(kind: str, avoid: str | None) -> None:
        spots = [
            rid for rkind, rid in receps if _can_contain(constants, rkind, kind) and rkind != avoid
        ]
        if not spots:
            return
        where = spots[int(rng.integers(len(spots)))]
        placed.append((kind, _thor_id(kind, rng, taken), where))

    avoid = None if task_type == "look_at_obj_in_light" else target
    copies = (
        int(rng.integers(2, 4))
        if task_type == "pick_two_obj_and_place"
        else int(rng.integers(1, 3))
    )
    for _ in range(copies):
        place(obj, avoid)
    lamp = None
    if task_type == "look_at_obj_in_light" or (lay.lamp and rng.random() < 0.5):
        stands = [rid for rkind, rid in receps if rkind in _LAMP_STANDS]
        if stands:
            lamp = (
                "DeskLamp",
                _thor_id("DeskLamp", rng, taken),
                stands[int(rng.integers(len(stands)))],
            )
    others = [o for o in lay.objects if o != obj]
    n_other = int(rng.integers(3, 7))
    for kind in rng.choice(others, size=min(n_other, len(others)), replace=False):
        # Distractors never sit in the goal's receptacle type either: a distractor of the
        # target's type would make the goal hold at the start.
        place(str(kind), None)
    goal_text, goal_pddl = _goal(task_type, obj, target, rng)
    objects = placed + ([lamp] if lamp else [])
    pddl = _problem_pddl(
        f"branchgym_{task_type}_{seed}", receps, locations, start, objects, goal_pddl, constants
    )
    label = name or f"{task_type}-{obj}-None-{target}-{lay.name}-{seed}"
    return Problem(
        name=label,
        task_type=task_type,
        goal=goal_text,
        pddl_problem=pddl,
        layout=lay.name,
        split=split,
        num_receptacles=len(receps),
    )


# Receptacle types the domain names as constants in its actions: declare them always.
_DOMAIN_RTYPES = ("SinkBasin", "Microwave", "Fridge")
_DOMAIN_OTYPES = ("Knife", "ButterKnife")


def _problem_pddl(
    problem_name: str,
    receps: list[tuple[str, str]],
    locations: dict[str, str],
    start: str,
    objects: list[tuple[str, str, str]],
    goal_pddl: str,
    constants: Any,
) -> str:
    """The PDDL problem text, laid out as ALFWorld's own game files are."""
    otypes = sorted({k for k, _, _ in objects} | set(_DOMAIN_OTYPES))
    rtypes = sorted({k for k, _ in receps} | set(_DOMAIN_RTYPES))
    lines = [f"(define (problem {problem_name})", "(:domain alfred)", "(:objects", "agent1 - agent"]
    lines += [f"        {t}Type - otype" for t in otypes]
    lines += [f"        {t}Type - rtype" for t in rtypes]
    lines += [f"        {mangle(i)} - object" for _, i, _ in sorted(objects, key=lambda o: o[1])]
    lines += [f"        {mangle(i)} - receptacle" for _, i in sorted(receps, key=lambda r: r[1])]
    locs = sorted(set(locations.values()) | {start})
    lines += [f"        {mangle(loc)} - location" for loc in locs]
    lines += ["        )", "", "(:init"]
    init: list[str] = []
    for kind, rid in receps:
        init.append(f"(receptacleType {mangle(rid)} {kind}Type)")
    for kind, oid, _ in objects:
        init.append(f"(objectType {mangle(oid)} {kind}Type)")
    kinds = sorted({k for k, _, _ in objects})
    for rkind in sorted({k for k, _ in receps}):
        for okind in kinds:
            if _can_contain(constants, rkind, okind):
                init.append(f"(canContain {rkind}Type {okind}Type)")
    affordances = constants.VAL_ACTION_OBJECTS
    for kind, oid, _ in objects:
        m = mangle(oid)
        if kind == "DeskLamp":
            init.append(f"(toggleable {m})")
            continue
        init.append(f"(pickupable {m})")
        if kind in constants.MOVABLE_RECEPTACLES_SET:
            init.append(f"(isReceptacleObject {m})")
        for pred, table in (
            ("cleanable", "Cleanable"),
            ("heatable", "Heatable"),
            ("coolable", "Coolable"),
            ("sliceable", "Sliceable"),
        ):
            if kind in affordances[table]:
                init.append(f"({pred} {m})")
    for kind, rid in receps:
        if kind in constants.OPENABLE_CLASS_SET:
            init.append(f"(openable {mangle(rid)})")
    init.append(f"(atLocation agent1 {mangle(start)})")
    for _, oid, rid in objects:
        init.append(f"(inReceptacle {mangle(oid)} {mangle(rid)})")
    for _, rid in receps:
        init.append(f"(receptacleAtLocation {mangle(rid)} {mangle(locations[rid])})")
    for _, oid, rid in objects:
        init.append(f"(objectAtLocation {mangle(oid)} {mangle(locations[rid])})")
    lines += [f"        {fact}" for fact in init]
    lines += ["        )", "", goal_pddl.strip(), ""]
    return "\n".join(lines)


def validate_problem(problem: Problem) -> Problem:
    """Load ``problem`` into the engine, solve it with the planner, replay the plan.

    Returns:
        The problem with its ``expert_plan`` filled in.

    Raises:
        InvalidProblemError: (a ``ValueError``) the problem does not load (unsolvable
            goal), its goal holds at the start, the planner finds no plan, the plan is
            longer than :data:`MAX_PLAN_LENGTH`, or playing the plan does not win.
    """
    from branchgym.envs.alfworld.engine import Engine, EngineLoadError

    engine = Engine()
    try:
        try:
            engine.load(problem)
        except EngineLoadError as exc:
            raise InvalidProblemError(f"does not load: {exc}") from exc
        state = engine.reset()
        if state["won"]:
            raise InvalidProblemError("the goal already holds in the initial state")
        plan = engine.replan()
        if not plan:
            raise InvalidProblemError("the planner found no plan")
        if len(plan) > MAX_PLAN_LENGTH:
            raise InvalidProblemError(f"expert plan has {len(plan)} steps (> {MAX_PLAN_LENGTH})")
        for i, command in enumerate(plan):
            state, _, done = engine.step(command)
            if state.feedback == "Nothing happens.":
                raise InvalidProblemError(f"plan step {i} {command!r} is not admissible")
            if done and i != len(plan) - 1:
                raise InvalidProblemError(f"plan won early at step {i}")
        if not state["won"]:
            raise InvalidProblemError("playing the expert plan does not win")
    finally:
        engine.close()
    return dataclasses.replace(problem, expert_plan=tuple(plan))


def generate_problems(
    n: int,
    seed: int = 0,
    *,
    layouts: Sequence[str] | None = None,
    task_types: Sequence[str] | None = None,
    split: str = "generated",
    validate: bool = True,
    progress: bool = True,
) -> list[Problem]:
    """``n`` problems cycling over ``task_types``, each on a layout where it can be posed.

    Problem ``i`` depends on ``(seed, i)`` only, so any prefix is reproducible.
    """
    layouts = list(layouts or SPLIT_LAYOUTS["in_distribution"])
    task_types = list(task_types or TASK_TYPES)
    plan = [(task_types[i % len(task_types)], i // len(task_types)) for i in range(n)]
    return generate_from_plan(plan, seed, layouts, split, validate=validate, progress=progress)


def generate_split(
    split: str,
    seed: int = SHIPPED_SEED,
    *,
    only: Sequence[int] | None = None,
    progress: bool = True,
) -> list[Problem]:
    """Rebuild a shipped set: ALFWorld's task mix for ``split`` on its layouts.

    Args:
        split: ``in_distribution`` or ``out_of_distribution``.
        seed: The set's seed (:data:`SHIPPED_SEED` rebuilds the shipped files).
        only: Positions to rebuild (default: all); each problem depends on its position
            and the seed only.
        progress: Show a progress bar.
    """
    if split not in SPLIT_TASK_COUNTS:
        raise ValueError(f"unknown split {split!r}; choose one of {sorted(SPLIT_TASK_COUNTS)}")
    plan = []
    for task_type, count in zip(TASK_TYPES, SPLIT_TASK_COUNTS[split], strict=True):
        plan += [(task_type, k) for k in range(count)]
    if split in THOR_SPLITS:
        from branchgym.envs.alfworld.floorplans import split_layouts

        layouts: list[str | Layout] = list(split_layouts(split))
    else:
        layouts = list(SPLIT_LAYOUTS[split])
    return generate_from_plan(plan, seed, layouts, split, progress=progress, only=only)


def generate_from_plan(
    plan: list[tuple[str, int]],
    seed: int,
    layouts: Sequence[str | Layout],
    split: str,
    *,
    validate: bool = True,
    progress: bool = True,
    only: Sequence[int] | None = None,
) -> list[Problem]:
    """Generate the problems of ``plan``: ``(task type, k)`` pairs, each from its own seed.

    Problem ``i`` goes on the ``k``-th layout that can pose its task type, from a seed
    derived from ``(seed, i)`` only. ``layouts`` are names of :data:`LAYOUTS` or
    :class:`Layout` objects (real floor plans, :mod:`branchgym.envs.alfworld.floorplans`).
    """
    from tqdm import tqdm

    constants = alfworld_constants()
    rooms = [LAYOUTS[x] if isinstance(x, str) else x for x in layouts]
    out = []
    positions = range(len(plan)) if only is None else [int(i) for i in only]
    for i in tqdm(positions, desc=f"generating {split}", disable=not progress):
        task_type, k = plan[i]
        usable = [lay for lay in rooms if _task_choices(lay, task_type, constants)]
        if not usable:
            raise ValueError(f"no layout among {[r.name for r in rooms]} can pose {task_type}")
        sub_seed = int(np.random.default_rng([seed, i]).integers(2**31 - 1))
        layout = usable[k % len(usable)]
        problem = generate_problem(layout, task_type, sub_seed, split=split, validate=validate)
        # ALFWorld-style name with the position in the set instead of the seed.
        out.append(dataclasses.replace(problem, name=f"{problem.name.rsplit('-', 1)[0]}-{i:04d}"))
    return out


# ------------------------------------------------------------------------ loading


def save_problems(problems: Iterable[Problem], path: str | os.PathLike[str]) -> Path:
    """Write problems as JSON lines (gzipped when the name ends in ``.gz``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(p.to_json(), sort_keys=True) + "\n" for p in problems)
    if path.suffix == ".gz":
        # mtime=0: the same problems give the same bytes.
        with (
            open(path, "wb") as raw,
            gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as f,
        ):
            f.write(text.encode("utf-8"))
    else:
        path.write_text(text, encoding="utf-8")
    return path


def _read_jsonl(path: Path, *, label: str) -> list[Problem]:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as f:
                lines = f.read().splitlines()
        else:
            lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read problem file {label}: {exc}") from exc
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{label} line {n} is not JSON ({exc}); the file is damaged") from exc
        out.append(Problem.from_json(record))
    if not out:
        raise DataError(f"problem file {label} holds no problems")
    return out


_SET_CACHE: dict[str, tuple[Problem, ...]] = {}


def load_problem_set(split: str) -> tuple[Problem, ...]:
    """The shipped set ``split`` (``in_distribution`` or ``out_of_distribution``)."""
    if split not in SPLITS:
        raise DataError(
            f"no shipped ALFWorld problem set {split!r}; the shipped sets are {sorted(SPLITS)}. "
            "For your own games pass a path to .tw-pddl files or a .jsonl problem file."
        )
    if split not in _SET_CACHE:
        ref = resources.files("branchgym.envs.alfworld").joinpath("data", SPLITS[split])
        with resources.as_file(ref) as path:
            if not path.is_file():
                raise DataError(
                    f"the shipped problem file {SPLITS[split]} is missing from the installed "
                    "package; reinstall branchgym (package data branchgym/envs/alfworld/data)."
                )
            _SET_CACHE[split] = tuple(_read_jsonl(path, label=SPLITS[split]))
    return _SET_CACHE[split]


_GOAL_IN_GRAMMAR = re.compile(r'"rhs":\s*"Your task is to: (.*?)\.?"')


def load_tw_pddl(path: Path, root: Path) -> Problem | None:
    """A real ALFWorld game file; ``None`` for games ALFWorld marks unsolvable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"cannot read ALFWorld game {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise DataError(f"{path} is not an ALFWorld game (expected a JSON object)")
    missing = [k for k in ("pddl_domain", "grammar", "pddl_problem") if k not in data]
    if missing:
        raise DataError(f"{path} is not an ALFWorld game: it lacks {missing}")
    if data.get("solvable") is False:
        return None
    grammar = data["grammar"]
    match = _GOAL_IN_GRAMMAR.search(grammar)
    goal = match.group(1) if match else ""
    rel = path.parent.relative_to(root) if path.parent != root else Path(path.stem)
    task_type = "unknown"
    traj = path.parent / "traj_data.json"
    if traj.is_file():
        try:
            task_type = json.loads(traj.read_text(encoding="utf-8")).get("task_type", task_type)
        except (OSError, json.JSONDecodeError):
            pass
    if task_type == "unknown":
        task_type = next((t for t in TASK_TYPES if str(rel).startswith(t)), "unknown")
    walkthrough = data.get("walkthrough")
    return Problem(
        name=str(rel),
        task_type=task_type,
        goal=goal,
        pddl_problem=data["pddl_problem"],
        pddl_domain=data["pddl_domain"],
        grammar=grammar,
        expert_plan=tuple(walkthrough) if walkthrough else None,
        split=str(root),
        gamefile=str(path),
    )


def load_problems(source: str | os.PathLike[str] | Sequence[Problem]) -> tuple[Problem, ...]:
    """Problems from a shipped set name, a problem file, ALFWorld game files, or a list.

    Args:
        source: ``in_distribution`` / ``out_of_distribution``; a ``.jsonl`` or
            ``.jsonl.gz`` file written by :func:`save_problems`; a real ALFWorld
            ``game.tw-pddl`` file, or a folder searched recursively for them (games whose
            ``solvable`` flag is false are skipped, as ALFWorld does); or problems.

    Raises:
        DataError: the path does not exist, holds no games, or a file is malformed.
    """
    if not isinstance(source, str | os.PathLike):
        problems = tuple(source)
        if not problems or not all(isinstance(p, Problem) for p in problems):
            raise DataError("problems must be a non-empty sequence of alfworld Problem objects")
        return problems
    if isinstance(source, str) and source in SPLITS:
        return load_problem_set(source)
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(
            f"ALFWorld problems {str(source)!r}: no such shipped set, file or folder. Shipped "
            f"sets: {sorted(SPLITS)}; or give the path of .tw-pddl games or a .jsonl file."
        )
    if path.is_dir():
        games = sorted(path.rglob("*.tw-pddl"))
        problems = tuple(p for g in games if (p := load_tw_pddl(g, path)) is not None)
        if not problems:
            raise DataError(f"no solvable ALFWorld .tw-pddl games under {path}")
        return problems
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        return tuple(_read_jsonl(path, label=str(path)))
    if path.suffix == ".tw-pddl":
        problem = load_tw_pddl(path, path.parent)
        if problem is None:
            raise DataError(f"{path} is marked unsolvable ('solvable': false)")
        return (problem,)
    raise DataError(
        f"{path}: expected a .tw-pddl game, a folder of them, or a .jsonl(.gz) problem file"
    )


def export_tw_pddl(problem: Problem, folder: str | os.PathLike[str]) -> Path:
    """Write ``problem`` as an ALFWorld ``game.tw-pddl`` (loadable by ALFWorld's own tools)."""
    folder = Path(folder) / problem.name
    folder.mkdir(parents=True, exist_ok=True)
    game = problem.game()
    game["solvable"] = True
    if problem.expert_plan is not None:
        game["walkthrough"] = list(problem.expert_plan)
    path = folder / "game.tw-pddl"
    path.write_text(json.dumps(game), encoding="utf-8")
    (folder / "traj_data.json").write_text(
        json.dumps({"task_type": problem.task_type, "goal": problem.goal}), encoding="utf-8"
    )
    return path
