"""Attribution where the truth is known: scripted experts with an injected mistake.

    python scripts/attribution_demo.py [--out results/attribution] [--tasks 60]

WebShop: the shopper, except that at step 2 (an item page) it buys at once with
probability 0.5, before choosing the options the goal names: an unrecoverable mistake.
Its failed episodes should be attributed to step 2 (a purchase). ALFWorld: the planner,
except that at step 2 it goes to a wrong place with probability 0.5, with the step cap at
the planner's own episode length (no ALFWorld action is irreversible: the budget makes the
wasted step unrecoverable); its failed episodes should be attributed to step 2. Prints
each run's attribution report (``branchgym eval attribute``'s), and writes the run folders
with their value-curve plots.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from branchgym.bench.eval_states import mistaken_expert
from branchgym.evaluation.agents import Agent, make_agent
from branchgym.evaluation.attribution_run import attribute_run
from branchgym.evaluation.protocols import get_protocol
from branchgym.evaluation.runner import EvalOptions, read_episodes, run_eval


def main() -> None:
    """Run both experiments and print their reports."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/attribution")
    p.add_argument("--tasks", type=int, default=60)
    p.add_argument("--forks", type=int, default=16)
    p.add_argument("--envs", default="webshop,alfworld", help="which experiments")
    args = p.parse_args()
    out = Path(args.out)
    if "webshop" in args.envs:
        webshop(out, args)
    if "alfworld" in args.envs:
        alfworld(out, args)


def webshop(out: Path, args: argparse.Namespace) -> None:
    """The shopper that buys early at step 2."""
    web = get_protocol("webshop-test").resolve(tasks=args.tasks)
    run_eval(web, make_agent("expert", web.env_id), out / "webshop-expert",
             EvalOptions(progress=False, resume=(out / "webshop-expert/run.json").exists()))
    eps = read_episodes(out / "webshop-expert" / "episodes.jsonl")
    ids = [t for (t, _), r in eps.items() if r["success"] and len(r["actions"]) >= 4
           and r["actions"][2] != "click[buy now]"]
    sub = get_protocol("webshop-test").resolve(tasks=ids)
    slip = Agent("shopper buying early at step 2 (p 0.5)", "expert", None,
                 mistaken_expert(web.env_id, 2, 0.5), {"kind": "mistaken", "step": 2, "p": 0.5})
    run_eval(sub, slip, out / "webshop-slip", EvalOptions(episodes_per_task=2, progress=False))
    attribute_run(out / "webshop-slip", forks=args.forks, agent=slip, progress=False)
    print((out / "webshop-slip" / "attribution.md").read_text())


def alfworld(out: Path, args: argparse.Namespace) -> None:
    """The planner that goes to a wrong place at step 2, with no step to spare."""
    proto = get_protocol("alfworld-thor-unseen")
    every = proto.resolve().tasks
    ids = [t.id for t in every[:: max(1, len(every) // args.tasks)]][: args.tasks]
    alf = proto.resolve(tasks=ids)
    run_eval(alf, make_agent("expert", alf.env_id), out / "alfworld-expert",
             EvalOptions(progress=False, resume=(out / "alfworld-expert/run.json").exists()))
    # the step cap at the planner's own episode length: the one wasted step loses
    lengths: dict[int, list[str]] = {}
    for (task, _), rec in read_episodes(out / "alfworld-expert" / "episodes.jsonl").items():
        if rec["success"]:
            lengths.setdefault(len(rec["actions"]), []).append(task)
    slip = Agent("planner going astray at step 2 (p 0.5)", "expert", None,
                 mistaken_expert(alf.env_id, 2, 0.5), {"kind": "mistaken", "step": 2, "p": 0.5})
    for cap, tasks in sorted(lengths.items()):
        sub = proto.resolve(tasks=tasks, max_steps=cap)
        run = out / f"alfworld-slip-cap{cap}"
        run_eval(sub, slip, run, EvalOptions(episodes_per_task=2, progress=False))
        attribute_run(run, forks=args.forks, agent=slip, progress=False)
        print((run / "attribution.md").read_text())


if __name__ == "__main__":
    main()
