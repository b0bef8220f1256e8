"""Attribution where the truth is known: scripted experts with an injected mistake.

    python scripts/attribution_demo.py [--out results/attribution] [--tasks 60]

WebShop: the shopper, except that at step 2 (an item page) it buys at once with
probability 0.5, before choosing the options the goal names: an unrecoverable mistake.
Its failed episodes should be attributed to step 2 (a purchase). ALFWorld: the planner,
except that it takes a random admissible action with probability 0.7 at every step; its
failed episodes are attributed to wherever V fell. Prints each run's attribution report
(``branchgym eval attribute``'s), and writes the run folders with their value-curve plots.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from branchgym.bench.eval_states import faulty_expert
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
                 faulty_expert(web.env_id, 0.5), {"kind": "faulty", "slip": 0.5})
    run_eval(sub, slip, out / "webshop-slip", EvalOptions(episodes_per_task=2, progress=False))
    attribute_run(out / "webshop-slip", forks=args.forks, agent=slip, progress=False)
    print((out / "webshop-slip" / "attribution.md").read_text())


def alfworld(out: Path, args: argparse.Namespace) -> None:
    """The planner that takes random actions."""
    alf = get_protocol("alfworld-thor-unseen").resolve(tasks=min(args.tasks, 20))
    noisy = Agent("planner with random actions (p 0.7)", "expert", None,
                  faulty_expert(alf.env_id, 0.7), {"kind": "faulty", "slip": 0.7})
    run_eval(alf, noisy, out / "alfworld-noisy", EvalOptions(progress=False))
    attribute_run(out / "alfworld-noisy", forks=args.forks // 2, agent=noisy, progress=False)
    print((out / "alfworld-noisy" / "attribution.md").read_text())


if __name__ == "__main__":
    main()
