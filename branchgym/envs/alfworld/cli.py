"""``branchgym alfworld``: generate problems, check the shipped sets, run the planner expert.

branchgym alfworld generate --n 50 --seed 1 --out games/      ALFWorld .tw-pddl game folders
branchgym alfworld generate --n 50 --out train.jsonl.gz       a problem file for the env
branchgym alfworld solve in_distribution                      the planner expert on every problem
branchgym alfworld solve thor_unseen --expert handcoded        the hand-coded (searching) expert
branchgym alfworld sets --check                               rebuild the shipped sets, compare
branchgym alfworld stats thor_seen thor_unseen                rooms, plans, task mix, random agent
"""

from __future__ import annotations

import argparse
import collections
import sys

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Sub-commands of ``branchgym alfworld``."""
    from branchgym.envs.alfworld.tasks import LAYOUTS, TASK_TYPES

    sub = parser.add_subparsers(dest="alfworld_command", metavar="COMMAND", required=True)
    gen = sub.add_parser("generate", help="generate validated problems with the seeded generator")
    gen.add_argument("--n", type=int, default=10, help="number of problems")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--layouts", nargs="*", choices=sorted(LAYOUTS), default=None)
    gen.add_argument("--tasks", nargs="*", choices=TASK_TYPES, default=None)
    gen.add_argument(
        "--out",
        required=True,
        help="a .jsonl/.jsonl.gz problem file, or a folder for ALFWorld game.tw-pddl files",
    )
    solve = sub.add_parser("solve", help="play every problem with an expert")
    solve.add_argument("problems", nargs="?", default="in_distribution", help="set name or path")
    solve.add_argument("--limit", type=int, default=None, help="only the first N problems")
    solve.add_argument(
        "--expert",
        choices=("planner", "handcoded"),
        default="planner",
        help="planner: fast-downward from the true state; handcoded: searches from observations",
    )
    solve.add_argument(
        "--max-steps", type=int, default=None, help="step budget (planner 100, handcoded 50)"
    )
    sets = sub.add_parser("sets", help="rebuild the shipped problem sets from their seed")
    sets.add_argument("--out", default=None, help="write the rebuilt sets to this folder")
    sets.add_argument("--check", action="store_true", help="exit 1 unless equal to the shipped")
    stats = sub.add_parser(
        "stats", help="statistics of problem sets beside their real floor plans; random agent"
    )
    stats.add_argument(
        "sets",
        nargs="*",
        default=["thor_seen", "thor_unseen", "in_distribution", "out_of_distribution"],
    )
    stats.add_argument(
        "--random-episodes", type=int, default=50, help="random-agent episodes per set (40 steps)"
    )
    stats.add_argument(
        "--handcoded",
        action="store_true",
        help="also play every problem with the hand-coded expert (50 steps): success, steps",
    )
    stats.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    """Run the chosen sub-command."""
    commands = {"generate": _generate, "solve": _solve, "sets": _sets, "stats": _stats}
    return commands[args.alfworld_command](args)


def _generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from branchgym.envs.alfworld.problems import export_tw_pddl, generate_problems, save_problems

    problems = generate_problems(
        args.n, args.seed, layouts=args.layouts, task_types=args.tasks, split="generated"
    )
    out = Path(args.out)
    if out.name.endswith((".jsonl", ".jsonl.gz")):
        save_problems(problems, out)
    else:
        for p in problems:
            export_tw_pddl(p, out)
    lengths = [p.expert_plan_length or 0 for p in problems]
    print(f"{len(problems)} problems -> {out} (expert plan length {min(lengths)}-{max(lengths)})")
    return 0


def _solve(args: argparse.Namespace) -> int:
    import gymnasium as gym
    from tqdm import tqdm

    from branchgym.envs.alfworld.expert import solve
    from branchgym.envs.alfworld.handcoded import play
    from branchgym.tables import markdown_table

    handcoded = args.expert == "handcoded"
    max_steps = args.max_steps or (50 if handcoded else 100)
    env = gym.make("branchgym/ALFWorld-v0", problems=args.problems, max_episode_steps=max_steps)
    problems = env.unwrapped.problems[: args.limit]
    by_type: dict[str, list[tuple[bool, int]]] = collections.defaultdict(list)
    failed = []
    try:
        for i, p in enumerate(tqdm(problems, desc=f"{args.expert} expert", unit="game")):
            if handcoded:
                result = play(env, i, max_steps=max_steps)
            else:
                result = solve(env, i, max_steps=max_steps)
            by_type[p.task_type].append((result.won, result.steps))
            if not result.won:
                failed.append(p.name)
    finally:
        env.close()
    rows = [
        [t, len(v), sum(w for w, _ in v), f"{sum(s for _, s in v) / len(v):.1f}"]
        for t, v in sorted(by_type.items())
    ]
    print(markdown_table(["task type", "games", "won", "mean steps"], rows))
    for name in failed:
        print(f"not solved: {name}", file=sys.stderr)
    return 1 if failed else 0


def _sets(args: argparse.Namespace) -> int:
    from pathlib import Path

    from branchgym.envs.alfworld.problems import (
        SPLITS,
        generate_split,
        load_problem_set,
        save_problems,
    )

    same = True
    for split, filename in SPLITS.items():
        rebuilt = generate_split(split)
        if args.out:
            save_problems(rebuilt, Path(args.out) / filename)
        equal = [p.to_json() for p in rebuilt] == [p.to_json() for p in load_problem_set(split)]
        print(f"{split}: {len(rebuilt)} problems, {'equal to' if equal else 'DIFFER from'} shipped")
        same = same and equal
    return 0 if same or not args.check else 1


#: Short column names of the task types, in TASK_TYPES order.
_SHORT = {
    "pick_and_place_simple": "simple",
    "look_at_obj_in_light": "light",
    "pick_clean_then_place_in_recep": "clean",
    "pick_heat_then_place_in_recep": "heat",
    "pick_cool_then_place_in_recep": "cool",
    "pick_two_obj_and_place": "two",
}


def _span(d: dict[str, float], fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(d['mean'])} ({d['min']:.0f}-{d['max']:.0f})"


def _random_success(problems: str, episodes: int, seed: int) -> float:
    """Success of a uniformly random agent over the admissible commands, 40 steps."""
    import gymnasium as gym
    import numpy as np
    from tqdm import tqdm

    env = gym.make("branchgym/ALFWorld-v0", problems=problems, max_episode_steps=40)
    rng = np.random.default_rng(seed)
    won = 0
    try:
        for ep in tqdm(range(episodes), desc=f"random agent on {problems}", unit="ep"):
            _, info = env.reset(seed=seed + ep)
            done = False
            while not done:
                acts = info["admissible_actions"]
                _, _, term, trunc, info = env.step(acts[int(rng.integers(len(acts)))])
                done = term or trunc
            won += bool(info["won"])
    finally:
        env.close()
    return won / max(episodes, 1)


def _handcoded_success(problems: str) -> tuple[float, float]:
    """Success of the hand-coded expert on every problem of a set (50 steps), mean steps won."""
    import gymnasium as gym
    from tqdm import tqdm

    from branchgym.envs.alfworld.handcoded import play

    env = gym.make("branchgym/ALFWorld-v0", problems=problems, max_episode_steps=50)
    results = []
    try:
        for i in tqdm(range(len(env.unwrapped.problems)), desc=f"hand-coded on {problems}"):
            results.append(play(env, i, max_steps=50))
    finally:
        env.close()
    won = [r.steps for r in results if r.won]
    return len(won) / max(len(results), 1), sum(won) / max(len(won), 1)


def _stats(args: argparse.Namespace) -> int:
    from branchgym.envs.alfworld import floorplans
    from branchgym.envs.alfworld.problems import load_problems
    from branchgym.envs.alfworld.tasks import TASK_TYPES, THOR_SPLITS
    from branchgym.tables import markdown_table

    rooms = ("Kitchen", "LivingRoom", "Bedroom", "Bathroom")
    rows = []
    for name in args.sets:
        problems = load_problems(name)
        st = floorplans.set_statistics(problems)
        by_room = st["receptacles_by_room"]
        shipped_rooms = [_span(by_room[r]) if r in by_room else "-" for r in rooms]
        if name in THOR_SPLITS:
            real = floorplans.floor_plan_statistics(name)
            real_rooms = [_span(real["receptacles_by_room"][r]) for r in rooms]
            label = f"{name}: its {real['floor_plans']} real floor plans"
            rows.append([label, *real_rooms, "", ""])
        success = (
            f"{_random_success(name, args.random_episodes, args.seed):.2f}"
            if args.random_episodes > 0
            else ""
        )
        mix = "/".join(str(n) for n in st["task_mix"])
        plan = _span(st["expert_plan_length"])
        label = f"{name}: {st['problems']} problems"
        extra = []
        if args.handcoded:
            rate, steps = _handcoded_success(name)
            extra = [f"{rate:.2f} ({steps:.1f} steps)"]
        rows.append([label, *shipped_rooms, plan, f"{mix}; {success}", *extra])
    print(
        markdown_table(
            [
                "set",
                *(f"receptacles, {r}" for r in rooms),
                "expert plan length",
                f"task mix ({', '.join(_SHORT[t] for t in TASK_TYPES)}); random success",
                *(["hand-coded expert success (mean steps when won)"] if args.handcoded else []),
            ],
            [r if len(r) == 7 + args.handcoded else [*r, ""] for r in rows],
        )
    )
    return 0
