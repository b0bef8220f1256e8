"""A scripted WebShop shopper: search, open the best match, pick the options, buy.

It searches with the instruction, opens the result whose title shares the most words
with it, clicks the option values the instruction names, and buys.

It sees only what a policy sees: the instruction and the current page (its visible
strings and clickables), never the goal's ASIN, attributes or options. Its mean reward
on the test goals shows that the goals are solvable and the reward is sane; it is also
a baseline for learners.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

import branchgym.envs.webshop.pages as P
from branchgym.envs.webshop.actions import click_action, search_action
from branchgym.envs.webshop.search import analyze

__all__ = ["ScriptedExpert", "ExpertResult", "run_expert", "split_instruction"]

_PRICE_CLAUSE = re.compile(r",? and price lower than ([\d.]+) dollars\s*$")
_PRICE = re.compile(r"\$([\d.]+)")


def split_instruction(instruction: str) -> tuple[str, float | None]:
    """``(request, budget)``: the instruction without its price clause, and the bound."""
    m = _PRICE_CLAUSE.search(instruction)
    if m is None:
        return instruction.strip(), None
    return instruction[: m.start()].strip(), float(m.group(1))


def _mentions(text: str, value: str) -> bool:
    """Whether ``value`` occurs in ``text`` as whole words (``small`` not in ``x-small``)."""
    pattern = rf"(?<![\w\-.]){re.escape(value)}(?![\w\-]|\.\d)"
    return re.search(pattern, text) is not None


class ScriptedExpert:
    """The scripted policy. Call :meth:`reset` per episode and :meth:`act` per step."""

    def __init__(self) -> None:
        """A fresh shopper."""
        self._opened: set[str] = set()

    def reset(self) -> None:
        """Forget the previous episode."""
        self._opened.clear()

    def act(self, page: P.Page, instruction: str) -> str:
        """The next action for ``page`` given the ``instruction``."""
        request, budget = split_instruction(instruction.lower())
        if page.name == "search":
            return search_action(request)
        if page.name == "results":
            best = self._best_result(page, request, budget)
            if best is None:  # nothing found: try the product words alone
                return click_action(P.BACK_TO_SEARCH.lower())
            self._opened.add(best)
            return click_action(best.lower())
        if page.name == "item":
            for value in self._options_to_pick(page, request):
                return click_action(value)
            return click_action(P.END_BUTTON.lower())
        return click_action(P.PREV_PAGE.lower())  # a sub-page: back to the item

    def _best_result(self, page: P.Page, request: str, budget: float | None) -> str | None:
        want = set(analyze(request))
        best, best_score = None, float("-inf")
        segs = page.segments
        rank = 0
        for i, s in enumerate(segs):
            if s.kind != "link" or i + 2 >= len(segs):
                continue
            title, price = segs[i + 1].text, segs[i + 2].text
            have = set(analyze(title))
            score = len(want & have) / max(1, len(want)) - 0.01 * rank
            m = _PRICE.search(price)
            if budget is not None and m is not None and float(m.group(1)) > budget:
                score -= 1.0  # over budget: only if nothing else fits
            if s.text in self._opened:
                score -= 0.5
            if score > best_score:
                best, best_score = s.text, score
            rank += 1
        return best

    @staticmethod
    def _options_to_pick(page: P.Page, request: str) -> Iterable[str]:
        groups: dict[str, list[P.Segment]] = {}
        for s in page.segments:
            if s.kind == "option" and s.group is not None:
                groups.setdefault(s.group, []).append(s)
        for segs in groups.values():
            named = [s for s in segs if _mentions(request, s.text)]
            if not named:
                continue
            pick = max(named, key=lambda s: len(s.text))  # "navy blue" over "blue"
            if not pick.selected:
                yield pick.text


@dataclasses.dataclass
class ExpertResult:
    """Rewards of the expert per goal, and their summary."""

    goal_indices: list[int]
    rewards: list[float]
    steps: list[int]
    exact: list[bool]  # bought the goal's own product

    @property
    def mean(self) -> float:
        """Mean reward."""
        return sum(self.rewards) / len(self.rewards) if self.rewards else float("nan")

    @property
    def success_rate(self) -> float:
        """Share of episodes with reward 1 (upstream's success)."""
        return sum(r == 1.0 for r in self.rewards) / len(self.rewards) if self.rewards else 0.0


def run_expert(
    env: Any, goal_indices: Iterable[int], *, split: str = "test", progress: bool = False
) -> ExpertResult:
    """Run :class:`ScriptedExpert` once per goal of ``split``; returns the rewards.

    Args:
        env: A WebShop env (``gym.make("branchgym/WebShop-v0")`` or the bare class).
        goal_indices: Goal positions within the split.
        split: ``test``, ``eval``, ``train`` or ``all``.
        progress: Show a progress bar.
    """
    base = env.unwrapped
    expert = ScriptedExpert()
    out = ExpertResult([], [], [], [])
    it: Iterable[int] = list(goal_indices)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc=f"webshop expert ({split})", unit="goal")
    for g in it:
        _, info = env.reset(options={"goal_index": int(g), "split": split})
        expert.reset()
        reward, steps, done = 0.0, 0, False
        while not done:
            action = expert.act(base.page, info["instruction"])
            _, reward, terminated, truncated, info = env.step(action)
            steps += 1
            done = terminated or truncated
        out.goal_indices.append(int(g))
        out.rewards.append(float(reward))
        out.steps.append(steps)
        purchased = info.get("purchased", {}).get("asin")
        out.exact.append(purchased is not None and purchased == base.goal["asin"])
    return out
