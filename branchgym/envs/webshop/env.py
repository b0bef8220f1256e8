"""``branchgym/WebShop-v0``: upstream WebShop's text environment, snapshottable.

The agent reads an instruction ("i need a sulfate free shampoo ..., and price lower
than 30.00 dollars"), searches, opens products, picks options and buys; buying ends the
episode with upstream's reward (:mod:`branchgym.envs.webshop.reward`). Pages, navigation
and observations follow ``web_agent_site/envs/web_agent_text_env.py`` (see
:mod:`branchgym.envs.webshop.pages` for the renderings):

* search page -> ``search[q]`` -> results (top 50, 10 a page, ``Page p (Total results:
  T)``, ``< Prev`` after page 1, ``Next >`` always) -> ``click[asin]`` -> item page
  (options, title, price, rating, ``Description``/``Features``/``Reviews``, ``Buy Now``)
  -> sub-pages; ``< Prev`` goes sub-page -> item (options kept) -> results (options
  reset); ``Back to Search`` clears query, product, options and visited products;
  ``search[...]`` works from any page.
* An invalid action (unparseable, empty, not clickable here, not a string) changes
  nothing but the message: reward 0, not done, and the observation starts with
  ``Invalid action: ...`` (``invalid_action_obs="upstream"``: the page repeated
  unchanged, as upstream); it counts as a step, as in the common agent setups.
* ``num_prev_obs`` / ``num_prev_actions`` prepend the last observations and actions as
  upstream's text env does: ``o_-k [SEP] a_-k [SEP] ... o_-1 [SEP] a_-1 [SEP] o``.
* ``info`` carries ``split``, ``goal_index`` (index into the shuffled goal list:
  upstream's ``fixed_<i>`` session), ``split_index`` (position in the split) and
  ``won`` (a purchase with reward exactly 1, upstream's ``r_harsh``).
* ``info["admissible_actions"]`` always lists the valid clicks (``click[...]``) and, on
  the search page, one search (the instruction itself); any ``search[...]`` is valid.
* The episode is truncated after ``max_steps`` steps without a purchase (default 15).

Snapshots: the catalog, search index and goals are shared and immutable
(:class:`~branchgym.envs.webshop.data.Catalog`); the episode state is a small immutable
:class:`EpisodeState`, so a snapshot is a reference to it plus the RNG state, and
restore re-renders the page from it.
"""

from __future__ import annotations

import string
from typing import Any, NamedTuple

import gymnasium as gym

import branchgym.envs.webshop.pages as P
from branchgym.core import SnapshottableEnv
from branchgym.envs.webshop.actions import click_action, parse_action, search_action
from branchgym.envs.webshop.data import SPLITS, Catalog, load_catalog
from branchgym.envs.webshop.reward import get_reward, warn_if_heuristic_on_real_data
from branchgym.error import DataError, ResetNeededError, SnapshotCorruptError
from branchgym.serialization import register_snapshot_types

__all__ = ["WebShopEnv", "EpisodeState", "INVALID_ACTION_OBS", "OBSERVATION_MODES", "TextSpace"]

OBSERVATION_MODES = ("text", "text_rich", "html")
#: What an invalid action shows: our message above the page, or upstream's unchanged page.
INVALID_ACTION_OBS = ("message", "upstream")
_SUB_PAGES = {name.lower(): name for name in P.SUB_PAGES}
_MAX_ECHO = 120  # characters of an invalid action quoted back


class TextSpace(gym.spaces.Text):
    """Unicode text up to ``max_length`` characters; samples printable ASCII.

    Product titles and agent actions hold any Unicode character, which Gymnasium's
    ``Text`` space (a fixed character set) cannot describe.
    """

    def __init__(self, max_length: int, *, min_length: int = 0, seed: int | None = None):
        """A text space of ``min_length`` to ``max_length`` characters."""
        super().__init__(
            max_length, min_length=min_length, charset=string.printable.strip(), seed=seed
        )

    def contains(self, x: Any) -> bool:
        """Any ``str`` of an allowed length."""
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"TextSpace({self.min_length}, {self.max_length})"


class EpisodeState(NamedTuple):
    """Everything that determines the rest of an episode (besides the shared catalog).

    Immutable: every transition builds a new one, so a snapshot can hold a reference.
    """

    goal: int  # index into Catalog.goals
    page: str  # search, results, item, Description, Features, Reviews, Attributes, done
    keywords: str | None = None  # the current query (lowercased action argument)
    page_num: int = 1
    results: tuple[int, ...] = ()  # product positions of the current query's top 50
    item: int = -1  # product position of the item page, -1 for none
    options: tuple[tuple[str, str], ...] = ()  # chosen options, (name, value)
    visited: tuple[int, ...] = ()  # products clicked since the last Back to Search
    step: int = 0
    history: tuple[str, ...] = ()  # actions taken (as given; non-strings by repr)
    message: str | None = None  # invalid-action feedback shown above the page
    reward: float = 0.0  # reward of the purchase (done page)
    split: str | None = None  # the goal split of this episode (None: the env's)
    prev_obs: tuple[str, ...] = ()  # last num_prev_obs observations before this one


# Snapshot bytes may hold it (branchgym.serialization allows only registered types).
register_snapshot_types(EpisodeState)


class WebShopEnv(SnapshottableEnv[str, str]):
    """WebShop's text shop with upstream's pages, search and reward.

    Args:
        data_dir: Folder with upstream's data files; default ``$BRANCHGYM_WEBSHOP_DATA``,
            else the generated catalog.
        observation_mode: ``text`` (`` [SEP] ``-joined strings), ``text_rich`` (marked
            buttons) or ``html``.
        split: Goals to sample at reset: ``train`` (goals 1500+), ``eval`` (500-1499),
            ``test`` (0-499), ``all``, or ``agent_test`` (0-499 always). As upstream, with
            ``num_products`` set, ``train``/``eval``/``test`` are every goal.
        max_steps: Steps before the episode is truncated.
        num_products: Use only the first N products of the data file.
        human_goals: Human-instruction goals (upstream's benchmark) or synthetic ones.
        show_attrs: Show the ``Attributes`` sub-page button (upstream's ``--attrs``).
        generated_products: Size of the generated catalog when no data folder is given.
        generator_seed: Seed of the generated catalog.
        price_seed: Seed of the price draws (range prices, goal price bounds).
        products_file: Products file name in ``data_dir`` if several match.
        attributes_file: Attributes file name in ``data_dir`` if several match.
        data: Upstream release preset, ``"small"`` or ``"full"`` (see
            :func:`~branchgym.envs.webshop.data.load_catalog`).
        human_file: Human-instructions file name (default ``items_human_ins.json``).
        invalid_action_obs: ``message`` (default: ``Invalid action ...`` above the page)
            or ``upstream`` (the page unchanged).
        num_prev_obs: Previous observations prepended to each step's observation.
        num_prev_actions: Previous actions prepended likewise (upstream's format).
        render_mode: ``ansi`` (``render()`` returns the observation) or ``human``.
    """

    metadata = {"render_modes": ["ansi", "human"]}
    default_env_id = "branchgym/WebShop-v0"
    _restore_copies = False  # EpisodeState is immutable

    def __init__(
        self,
        data_dir: str | None = None,
        observation_mode: str = "text",
        split: str = "train",
        max_steps: int = 15,
        num_products: int | None = None,
        human_goals: bool = True,
        show_attrs: bool = False,
        generated_products: int = 1000,
        generator_seed: int = 0,
        price_seed: int = 0,
        products_file: str | None = None,
        attributes_file: str | None = None,
        render_mode: str | None = None,
        data: str | None = None,
        human_file: str | None = None,
        invalid_action_obs: str = "message",
        num_prev_obs: int = 0,
        num_prev_actions: int = 0,
    ) -> None:
        """Load (or share) the catalog and set up the spaces."""
        if observation_mode not in OBSERVATION_MODES:
            raise ValueError(
                f"observation_mode={observation_mode!r} is not supported; use one of "
                f"{', '.join(map(repr, OBSERVATION_MODES))}."
            )
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be a positive int, got {max_steps!r}")
        if render_mode not in (None, *self.metadata["render_modes"]):
            raise ValueError(f"render_mode={render_mode!r}; use None, 'ansi' or 'human'.")
        if invalid_action_obs not in INVALID_ACTION_OBS:
            raise ValueError(
                f"invalid_action_obs={invalid_action_obs!r}; use 'message' (feedback above "
                "the page) or 'upstream' (the page unchanged)."
            )
        for name, n in (("num_prev_obs", num_prev_obs), ("num_prev_actions", num_prev_actions)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"{name} must be an int >= 0, got {n!r}")
        self.catalog: Catalog = load_catalog(
            data_dir,
            num_products=num_products,
            generated_products=generated_products,
            generator_seed=generator_seed,
            price_seed=price_seed,
            human_goals=human_goals,
            products_file=products_file,
            attributes_file=attributes_file,
            data=data,
            human_file=human_file,
        )
        warn_if_heuristic_on_real_data(self.catalog.source, self.catalog.products)
        self.split = split
        self.split_goals = self.catalog.split_range(split)  # typed error if empty/unknown
        self.observation_mode = observation_mode
        self.max_steps = max_steps
        self.show_attrs = bool(show_attrs)
        self.render_mode = render_mode
        self.invalid_action_obs = invalid_action_obs
        self.num_prev_obs = num_prev_obs
        self.num_prev_actions = num_prev_actions
        self.observation_space = TextSpace(1_000_000)
        self.action_space = TextSpace(4096)
        self.state: EpisodeState | None = None
        self.step_index = 0
        self._page: P.Page | None = None
        self._obs = ""
        self._raw_obs = ""  # the page's observation, without the history

    # ------------------------------------------------------------------ gym API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Start at the search page with a goal.

        Args:
            seed: Seeds ``np_random``, which draws the goal when none is given.
            options: ``{"goal_index": i}`` picks goal ``i`` of the split (upstream's
                fixed session); ``{"split": "test"}`` overrides the env's split.
        """
        super().reset(seed=seed)
        options = dict(options or {})
        split = options.pop("split", self.split)
        goal_index = options.pop("goal_index", None)
        if options:
            raise ValueError(
                f"unknown reset options {sorted(options)}; WebShop takes 'goal_index' and 'split'."
            )
        rng = self._split_goals(split)
        if goal_index is None:
            goal = self._draw_goal(rng)
        else:
            if isinstance(goal_index, bool) or not isinstance(goal_index, int):
                raise ValueError(f"goal_index must be an int, got {goal_index!r}")
            if not -len(rng) <= goal_index < len(rng):
                raise DataError(
                    f"goal_index {goal_index} is outside the {split!r} split, which has "
                    f"{len(rng)} goals (0..{len(rng) - 1})."
                )
            goal = rng[goal_index]
        return self._enter(EpisodeState(goal=goal, page="search", split=split))

    def step(self, action: Any):
        """Apply ``search[query]`` or ``click[target]``; anything else is invalid feedback."""
        st = self._require_live()
        page = self._page
        if self.num_prev_obs:  # upstream's prev_obs: the observations before this step's
            st = st._replace(prev_obs=(st.prev_obs + (self._raw_obs,))[-self.num_prev_obs :])
        limit = self.action_space.max_length
        if isinstance(action, str) and len(action) > limit:
            # Outside the action space: refused, and only its head is kept in the state,
            # so one huge action cannot make every later snapshot huge.
            kept = f"{action[:_MAX_ECHO]}... ({len(action)} characters)"
            base = st._replace(step=st.step + 1, history=st.history + (kept,), message=None)
            why = (
                f"{action[:_MAX_ECHO]!r}...: the action has {len(action)} characters "
                f"(limit {limit})"
            )
            new, reward, terminated = self._invalid(base, why), 0.0, False
        else:
            history = st.history + (action if isinstance(action, str) else repr(action)[:limit],)
            base = st._replace(step=st.step + 1, history=history, message=None)
            new, reward, terminated = self._transition(base, page, action)
        truncated = not terminated and new.step >= self.max_steps
        obs, info = self._enter(new)
        return obs, reward, terminated, truncated, info

    def render(self) -> str | None:
        """The current observation (``ansi``), or print it (``human``)."""
        if self.render_mode == "ansi":
            return self._obs
        if self.render_mode == "human":
            print(self._obs)
        return None

    # --------------------------------------------------------------- transitions
    def _transition(
        self, st: EpisodeState, page: P.Page | None, action: Any
    ) -> tuple[EpisodeState, float, bool]:
        if not isinstance(action, str):
            why = f"{action!r:.{_MAX_ECHO}}: an action is text, search[query] or click[button]"
            return self._invalid(st, why), 0.0, False
        name, arg = parse_action(action)
        if arg is not None:
            arg = arg.lower()
        if name == "search" and arg:
            return self._search(st, arg, 1), 0.0, False
        clickables = page.clickables if page is not None else {}
        if name == "click" and arg is not None and arg in clickables and arg != "search":
            return self._click(st, arg, clickables[arg])
        if name == "click" and arg is not None:
            why = f"{arg[:_MAX_ECHO]!r} is not clickable on this page"
        else:
            why = "actions are search[query] or click[button]"
        return self._invalid(st, f"{action[:_MAX_ECHO]!r}: {why}"), 0.0, False

    @staticmethod
    def _invalid(st: EpisodeState, why: str) -> EpisodeState:
        return st._replace(message=f"Invalid action {why}; nothing happened.")

    def _search(self, st: EpisodeState, keywords: str, page_num: int) -> EpisodeState:
        results = self.catalog.index.search(keywords)
        return st._replace(
            page="results",
            keywords=keywords,
            page_num=page_num,
            results=results,
            item=-1,
            options=(),
        )

    def _click(
        self, st: EpisodeState, target: str, seg: P.Segment
    ) -> tuple[EpisodeState, float, bool]:
        if target == P.END_BUTTON.lower():
            reward = self._reward(st)
            return st._replace(page="done", reward=reward), reward, True
        if target == P.BACK_TO_SEARCH.lower():
            return (
                st._replace(
                    page="search", keywords=None, page_num=1, results=(), item=-1, options=(),
                    visited=(),
                ),
                0.0,
                False,
            )  # fmt: skip
        if target == P.NEXT_PAGE.lower() and st.page == "results":
            return st._replace(page_num=st.page_num + 1), 0.0, False
        if target == P.PREV_PAGE.lower() and st.page == "results":
            return st._replace(page_num=st.page_num - 1), 0.0, False
        if target == P.PREV_PAGE.lower() and st.page in _SUB_PAGES.values():
            return st._replace(page="item"), 0.0, False
        if target == P.PREV_PAGE.lower() and st.page == "item":
            return st._replace(page="results", item=-1, options=()), 0.0, False
        if target in _SUB_PAGES:
            return st._replace(page=_SUB_PAGES[target]), 0.0, False
        if seg.kind == "link":  # a product: options are kept, as upstream
            pos = self.catalog.asin_index[seg.text]
            visited = st.visited if pos in st.visited else st.visited + (pos,)
            return st._replace(page="item", item=pos, visited=visited), 0.0, False
        if seg.kind == "option":
            opts = dict(st.options)
            opts[seg.group or ""] = target
            return st._replace(page="item", options=tuple(opts.items())), 0.0, False
        return st._replace(page="item"), 0.0, False  # upstream re-renders the item page

    def _reward(self, st: EpisodeState, verbose: bool = False) -> Any:
        product = self.catalog.products[st.item]
        return get_reward(
            product,
            self.catalog.goals[st.goal],
            price=self.catalog.prices[st.item],
            options=dict(st.options),
            verbose=verbose,
        )

    # ------------------------------------------------------------------ pages
    def _draw_goal(self, rng: range) -> int:
        if self.catalog.human_goals:
            return rng[int(self.np_random.integers(len(rng)))]
        import numpy as np

        w = np.array([self.catalog.goals[i]["weight"] for i in rng], dtype=float)
        return rng[int(self.np_random.choice(len(rng), p=w / w.sum()))]

    def _build_page(self, st: EpisodeState) -> P.Page:
        instruction = self.catalog.goals[st.goal]["instruction_text"]
        products = self.catalog.products
        if st.page == "search":
            return P.search_page(instruction)
        if st.page == "results":
            lo = (st.page_num - 1) * P.PRODUCT_WINDOW
            shown = [products[i] for i in st.results[max(lo, 0) : lo + P.PRODUCT_WINDOW]]
            visited = {products[i]["asin"] for i in st.visited}
            return P.results_page(instruction, st.page_num, len(st.results), shown, visited)
        if st.page == "item":
            return P.item_page(instruction, products[st.item], dict(st.options), self.show_attrs)
        if st.page in _SUB_PAGES.values():
            return P.sub_page(instruction, products[st.item], st.page)
        if st.page == "done":
            return P.done_page(products[st.item]["asin"], dict(st.options), st.reward)
        raise SnapshotCorruptError(f"unknown WebShop page {st.page!r}; take a new snapshot.")

    def _enter(self, st: EpisodeState) -> tuple[str, dict[str, Any]]:
        """Make ``st`` current: build the page, the observation and the info."""
        page = self._build_page(st)
        self.state, self._page, self.step_index = st, page, st.step
        text = P.render(page, self.observation_mode)
        if st.message is not None and self.invalid_action_obs == "message":
            sep = " [SEP] " if self.observation_mode == "text" else "\n"
            text = st.message + sep + text
        self._raw_obs = text
        if self.num_prev_obs or self.num_prev_actions:
            text = self._with_history(st, text)
        self._obs = text
        return text, self._info(st, page)

    def _with_history(self, st: EpisodeState, ob: str) -> str:
        """Upstream's ``WebAgentTextEnv.step`` state: recent observations and actions."""
        parts = [ob]
        for i in range(1, 1 + max(self.num_prev_obs, self.num_prev_actions)):
            if len(st.history) >= i and self.num_prev_actions >= i:
                parts.append(st.history[-i])
            if len(st.prev_obs) >= i and self.num_prev_obs >= i:
                parts.append(st.prev_obs[-i])
        return " [SEP] ".join(reversed(parts))

    def _info(self, st: EpisodeState, page: P.Page) -> dict[str, Any]:
        goal = self.catalog.goals[st.goal]
        split = self.split if st.split is None else st.split
        clickables = [c for c in page.clickables if c != "search"]
        if page.has_search_bar:
            admissible = [search_action(goal["instruction_text"].lower())]
        elif st.page == "done" or st.step >= self.max_steps:
            admissible = []
        else:
            admissible = [click_action(c) for c in clickables]
        info: dict[str, Any] = {
            "admissible_actions": admissible,
            "available_actions": {
                "has_search_bar": page.has_search_bar,
                "clickables": list(page.clickables),
            },
            "instruction": goal["instruction_text"],
            "page": st.page,
            "goal_index": st.goal,
            "split": split,
            "split_index": st.goal - self._split_goals(split).start,
            "won": st.page == "done" and st.reward == 1,
            "step": st.step,
            "invalid_action": st.message is not None,
        }
        if st.page == "done":
            reward, details = self._reward(st, verbose=True)
            info["reward_info"] = details
            info["purchased"] = {
                "asin": self.catalog.products[st.item]["asin"],
                "options": dict(st.options),
                "price": self.catalog.prices[st.item],
            }
        return info

    def _split_goals(self, split: str) -> range:
        return self.split_goals if split == self.split else self.catalog.split_range(split)

    def _require_live(self) -> EpisodeState:
        st = self.state
        if st is None:
            raise ResetNeededError("Cannot call step() before reset(); call env.reset() first.")
        if st.page == "done" or st.step >= self.max_steps:
            raise ResetNeededError(
                "The episode is over (a purchase was made or the step limit reached); call "
                "env.reset() before step()."
            )
        return st

    # --------------------------------------------------------------- accessors
    @property
    def goal(self) -> dict[str, Any]:
        """The current goal dict (upstream's fields; privileged: not for the policy)."""
        if self.state is None:
            raise ResetNeededError("No goal before reset(); call env.reset() first.")
        return self.catalog.goals[self.state.goal]

    @property
    def page(self) -> P.Page:
        """The current page (its segments and clickables): what the observation shows."""
        if self._page is None:
            raise ResetNeededError("No page before reset(); call env.reset() first.")
        return self._page

    # --------------------------------------------------------------- snapshots
    def _get_state(self) -> EpisodeState:
        if self.state is None:
            raise ResetNeededError("Cannot snapshot before reset(); call env.reset() first.")
        return self.state

    def _set_state(self, state: Any) -> tuple[str, dict[str, Any]]:
        if (
            not isinstance(state, EpisodeState)
            or not 0 <= state.goal < len(self.catalog.goals)
            or not -1 <= state.item < len(self.catalog.products)
            or (state.page in ("item", "done", *_SUB_PAGES.values()) and state.item < 0)
            or any(not 0 <= i < len(self.catalog.products) for i in state.results)
            or not (state.split is None or state.split in SPLITS)
        ):
            raise SnapshotCorruptError(
                f"WebShop snapshot payload is malformed ({state!r:.100}); take a new snapshot "
                "from an env built on the same catalog."
            )
        return self._enter(state)

    def _snapshot_config(self) -> Any:
        return (
            self.catalog.fingerprint,
            self.observation_mode,
            self.max_steps,
            self.show_attrs,
            self.invalid_action_obs,
            self.num_prev_obs,
            self.num_prev_actions,
        )
