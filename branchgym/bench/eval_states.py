"""``branchgym bench eval-states``: what comparing two agents from identical states buys.

Two agents that differ a little: the env's scripted expert (A) and the same expert with
a fault (B): on WebShop it buys at once at step 2 with probability ``--slip`` (an
unrecoverable mistake); on ALFWorld it takes a uniformly random admissible action with
that probability at every step. Their difference in success is measured two ways:

* **independent runs**: each agent plays every task from its reset state; the interval of
  the difference of the two means (unpaired: their standard errors add in quadrature);
* **from identical states**: both agents are forked ``--forks`` times from the same
  snapshots along A's episodes (at ``--depths``), and the paired difference over states
  (:func:`branchgym.evaluation.from_states.compare_from_states`).

Each way's interval width is reported with the env steps it cost, and the independent
width is rescaled to the from-states run's env steps (standard errors shrink as one over
the square root of the episodes, at the same steps per episode), so the two are compared
at equal env steps. This study measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path
from typing import Any

from branchgym.bench.common import Report, positive_int

__all__ = ["configure", "faulty_expert", "main", "mistaken_expert"]

ENVS = {"webshop": "webshop-test", "alfworld": "alfworld-thor-unseen"}


def configure(parser: argparse.ArgumentParser) -> None:
    """Options of ``branchgym bench eval-states``."""
    parser.add_argument("--envs", default="webshop,alfworld", help="webshop,alfworld")
    parser.add_argument("--tasks", type=positive_int, default=40, help="tasks per env (40)")
    parser.add_argument("--forks", type=positive_int, default=4, help="forks per state (4)")
    parser.add_argument("--depths", default="0,0.5", help="fractions along A's episodes")
    parser.add_argument("--slip", type=float, default=0.3, help="B's fault probability (0.3)")
    parser.add_argument("--out", default="results", help="report folder")


def mistaken_expert(env_id: str, step: int, p: float) -> Any:
    """The env's expert making one known mistake at ``step`` with probability ``p``.

    WebShop: it buys at once (before choosing the options the goal names, which loses the
    episode). ALFWorld: it goes to a location other than one its plan needs next. No
    ALFWorld action is irreversible (every effect of its PDDL domain can be undone), so
    that mistake is unrecoverable only against the step budget: with the step cap at the
    planner's own episode length, the one wasted step loses the episode. Where the truth
    of attribution is known (``tests/evaluation/test_attribution.py``,
    ``scripts/attribution_demo.py``).
    """
    from branchgym.agents.policies.experts import alfworld_expert, webshop_expert

    if env_id == "branchgym/WebShop-v0":

        def make(env: Any, rng: Any) -> Any:
            act = webshop_expert(env, rng)
            return lambda obs, info: (
                "click[buy now]"
                if int(info.get("step", -1)) == step and rng.random() < p
                else act(obs, info)
            )

        return make

    def make_alf(env: Any, rng: Any) -> Any:
        act = alfworld_expert(env, rng)
        base = env.unwrapped  # ALFWorld's info has no step count; its env keeps one

        def mistake(obs: Any, info: dict[str, Any]) -> str:
            right = act(obs, info)
            if base.step_index != step or rng.random() >= p:
                return right
            wrong = [str(a) for a in info.get("admissible_actions") or []
                     if str(a).startswith("go to ") and str(a) != right]  # fmt: skip
            return wrong[int(rng.integers(len(wrong)))] if wrong else right

        return mistake

    return make_alf


def faulty_expert(env_id: str, slip: float) -> Any:
    """The env's expert with a fault (module notes), as an env agent factory."""
    from branchgym.agents.policies.experts import alfworld_expert

    if env_id == "branchgym/WebShop-v0":
        return mistaken_expert(env_id, 2, slip)

    def make_alf(env: Any, rng: Any) -> Any:
        act = alfworld_expert(env, rng)

        def step(obs: Any, info: dict[str, Any]) -> str:
            cands = info.get("admissible_actions") or []
            if cands and rng.random() < slip:
                return str(cands[int(rng.integers(len(cands)))])
            return act(obs, info)

        return step

    return make_alf


def main(args: argparse.Namespace) -> int:
    """Both ways on each env; write ``eval_states.md``."""
    from branchgym.evaluation.agents import Agent, make_agent
    from branchgym.evaluation.from_states import compare_from_states
    from branchgym.evaluation.protocols import get_protocol
    from branchgym.evaluation.runner import EvalOptions, run_eval

    depths = tuple(float(x) for x in args.depths.split(","))
    report = Report(args.out, "eval_states", "branchgym bench eval-states")
    rows = []
    data: dict[str, Any] = {"args": vars(args)}
    for name in args.envs.split(","):
        proto = get_protocol(ENVS[name]).resolve(tasks=args.tasks)
        a = make_agent("expert", proto.env_id)
        b = Agent("faulty expert", "expert", None, faulty_expert(proto.env_id, args.slip),
                  {"kind": "faulty", "slip": args.slip})  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="bench_states_") as tmp:
            sa = run_eval(proto, a, Path(tmp) / "a", EvalOptions(progress=False))
            sb = run_eval(proto, b, Path(tmp) / "b", EvalOptions(progress=False))
            res = compare_from_states(Path(tmp) / "a", Path(tmp) / "b", depths=depths,
                                      forks=args.forks, agents=(a, b), progress=False)  # fmt: skip
        ia, ib = sa["metrics"]["success"], sb["metrics"]["success"]
        se_ind = math.hypot(ia["se"], ib["se"])
        steps_ind = sa["cost"]["env_steps"] + sb["cost"]["env_steps"]
        steps_st = res["env_steps"]["a"] + res["env_steps"]["b"]
        d = res["a_minus_b"]
        se_ind_eq = se_ind * math.sqrt(steps_ind / steps_st)
        ratio = d["se"] / se_ind_eq if se_ind_eq > 0 else float("nan")
        rows.append([
            name, f"{ia['mean'] - ib['mean']:+.3f} ± {1.96 * se_ind:.3f}", steps_ind,
            f"{d['mean']:+.3f} ± {1.96 * d['se']:.3f}", steps_st, res["states"],
            f"{1.96 * se_ind_eq:.3f}", f"{ratio:.2f}",
        ])  # fmt: skip
        data[name] = {"independent": {"a": ia, "b": ib, "env_steps": steps_ind},
                      "from_states": res, "se_ratio_equal_steps": ratio}  # fmt: skip
    report.add(
        f"A = the scripted expert, B = the expert with a fault (p = {args.slip}); "
        f"{args.tasks} tasks per env; from-states: {args.forks} forks per state at depths "
        f"{list(depths)} of A's episodes. Half-widths are 1.96 standard errors."
    )
    print(report.table(
        ["env", "A - B independent", "env steps", "A - B from states (paired)", "env steps",
         "states", "independent half-width at the from-states env steps",
         "SE ratio from-states / independent, equal env steps"],
        rows,
    ))  # fmt: skip
    report.data = data
    print(f"report: {report.save()}")
    return 0
