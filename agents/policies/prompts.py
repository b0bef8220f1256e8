"""ReAct-style prompt builders and action parsers, one per environment.

A :class:`PromptBuilder` turns a :class:`~branchgym.agents.policies.policy.Context` into chat
messages (system, the task with the first observation, then one user message per
observation) and turns the model's reply into an env action. Replies follow ReAct::

    Thought: the blue mug is on the counter, take it.
    Action: take mug 1 from countertop 1

The parser takes the last ``Action:`` line (or, for SWE-bench, the last fenced shell
block). Where the env lists its admissible actions, the parsed text is matched to one
of them (case and spacing ignored); text that matches nothing is still sent to the env,
unchanged, so the env answers with its own invalid-action feedback, and the
:class:`ParsedAction` says why it was not valid.

Builders: :class:`TextTreePrompt` (TextTreeMDP), :class:`WebShopPrompt` (``search[...]``,
``click[...]``, observations with `` [SEP] `` separators), :class:`ALFWorldPrompt` (text
commands, ``Nothing happens.`` for invalid ones, admissible commands in info) and
:class:`SWEBenchPrompt` (shell commands and ``submit``). Pick one by env id with
:func:`prompt_for`; register yours in :data:`PROMPTS`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from branchgym.rollout.policy import Context, admissible_actions

__all__ = [
    "ParsedAction",
    "PromptBuilder",
    "TextTreePrompt",
    "WebShopPrompt",
    "ALFWorldPrompt",
    "SWEBenchPrompt",
    "PROMPTS",
    "prompt_for",
    "normalize",
]


@dataclasses.dataclass(frozen=True)
class ParsedAction:
    """What the parser made of a reply.

    Attributes:
        action: The text to send to the env (the canonical admissible spelling when one
            matched, else the raw parsed text).
        valid: Whether it matched the env's grammar / admissible actions.
        error: Why it did not, else ``None``.
    """

    action: str
    valid: bool
    error: str | None = None


_ACTION_LINE = re.compile(r"^\s*(?:\*\*)?action(?:\*\*)?\s*[:：]\s*(.*?)\s*$", re.I | re.M)


def normalize(text: str) -> str:
    """Lower case, single spaces, no surrounding quotes, backticks or final period."""
    t = " ".join(str(text).strip().split()).lower()
    t = t.strip("`'\" ")
    return t[:-1].rstrip() if t.endswith(".") else t


def _react_action(text: str) -> str:
    found = _ACTION_LINE.findall(text)
    if found:
        return found[-1].strip()
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


class PromptBuilder:
    """ReAct prompts and parsing for one env; subclasses set the text and the grammar."""

    #: Env ids this builder serves.
    env_ids: tuple[str, ...] = ()
    #: What the agent is, in the system prompt.
    role: str = "You are an agent acting in a text environment."
    #: How to answer, in the system prompt.
    answer_format: str = (
        "Answer with one line 'Thought: <your reasoning>' followed by one line 'Action: <action>'."
    )

    def system_prompt(self) -> str:
        """The system message."""
        return f"{self.role} {self.answer_format}"

    def render_observation(self, observation: Any, info: dict[str, Any]) -> str:
        """The observation as the model reads it, with the admissible actions if given."""
        text = str(observation).strip()
        acts = admissible_actions(info)
        if acts:
            text += "\nAvailable actions: " + ", ".join(acts)
        return text

    def task_message(self, observation: Any, info: dict[str, Any]) -> str:
        """The first user message: the task and the first observation."""
        return self.render_observation(observation, info)

    def observation_message(self, observation: Any, info: dict[str, Any]) -> str:
        """A later user message: the observation that answered the last action."""
        return "Observation: " + self.render_observation(observation, info)

    def messages(self, context: Context) -> list[dict[str, str]]:
        """The whole dialogue as chat messages (system, user, assistant, user, ...)."""
        msgs = [
            {"role": "system", "content": self.system_prompt()},
            {"role": "user", "content": self.task_message(context.observation, context.info)},
        ]
        for turn in context.turns:
            msgs.append({"role": "assistant", "content": turn.text})
            msgs.append(
                {"role": "user", "content": self.observation_message(turn.observation, turn.info)}
            )
        return msgs

    def extract(self, text: str) -> str:
        """The action part of a reply (ReAct: the last ``Action:`` line)."""
        return _react_action(text)

    def check(self, action: str, info: dict[str, Any]) -> ParsedAction:
        """Match an extracted action to the admissible ones, when the env lists them."""
        if not action:
            return ParsedAction("", False, "the reply contains no action")
        acts = admissible_actions(info)
        if acts is None:
            return ParsedAction(action, True)
        table = {normalize(a): a for a in acts}
        hit = table.get(normalize(action))
        if hit is not None:
            return ParsedAction(hit, True)
        return ParsedAction(action, False, f"{action!r} is not an admissible action")

    def parse(self, text: str, info: dict[str, Any] | None = None) -> ParsedAction:
        """Reply text -> the action to send and whether it is valid."""
        return self.check(self.extract(text), info or {})

    def examples(self) -> list[str]:
        """Sample replies and observations (tokenizer training text and documentation)."""
        return []


class TextTreePrompt(PromptBuilder):
    """TextTreeMDP: a maze; actions are exit names (``go north``), listed in info."""

    env_ids = ("branchgym/TextTreeMDP-v0",)
    role = (
        "You walk through a maze of rooms. Each move takes you deeper; at the exit you are "
        "scored. Choose exits that lead to a high score."
    )

    def examples(self) -> list[str]:
        """Sample replies."""
        return ["Thought: east looked promising.\nAction: go east", "Action: go west"]


class WebShopPrompt(PromptBuilder):
    """WebShop: ``search[query]`` and ``click[target]``; pages are `` [SEP] ``-separated."""

    env_ids = ("branchgym/WebShop-v0",)
    role = (
        "You are shopping on a web site for the product the instruction describes. Use "
        "search[<query>] to search and click[<button or product>] to click; buy the best "
        "match with click[Buy Now]."
    )
    _GRAMMAR = re.compile(r"^\s*(search|click)\s*\[(.*)\]\s*$", re.I | re.S)

    def render_observation(self, observation: Any, info: dict[str, Any]) -> str:
        """Split the page on `` [SEP] `` into one element per line."""
        parts = [p.strip() for p in str(observation).split("[SEP]")]
        text = "\n".join(p for p in parts if p)
        acts = admissible_actions(info)
        if acts:
            text += "\nAvailable actions: " + ", ".join(acts)
        return text

    def check(self, action: str, info: dict[str, Any]) -> ParsedAction:
        """Enforce the ``search[...]`` / ``click[...]`` grammar, then the admissible set."""
        m = self._GRAMMAR.match(action or "")
        if m is None:
            return ParsedAction(
                action, False, f"{action!r} is neither search[<query>] nor click[<target>]"
            )
        verb, arg = m.group(1).lower(), m.group(2).strip()
        if not arg:
            return ParsedAction(action, False, f"{verb}[] needs an argument")
        canonical = f"{verb}[{arg}]"
        acts = admissible_actions(info)
        if acts is None:
            return ParsedAction(canonical, True)
        if verb == "search":
            if any(a.lower().startswith("search[") for a in acts):
                return ParsedAction(canonical, True)
            return ParsedAction(canonical, False, "this page has no search bar")
        table = {}
        for a in acts:
            am = self._GRAMMAR.match(a)
            if am and am.group(1).lower() == "click":
                table[normalize(am.group(2))] = a
        hit = table.get(normalize(arg))
        if hit is not None:
            return ParsedAction(hit, True)
        return ParsedAction(canonical, False, f"nothing clickable is called {arg!r} here")

    def examples(self) -> list[str]:
        """Sample replies and a page."""
        return [
            "Thought: search first.\nAction: search[red cotton t-shirt under 20 dollars]",
            "Action: click[B07XYZ1234]",
            "Action: click[Buy Now]",
            "WebShop [SEP] Instruction: [SEP] i need a red t-shirt [SEP] Search",
            "Back to Search [SEP] Page 1 (Total results: 50) [SEP] Next > [SEP] B07XYZ1234 "
            "[SEP] Red Cotton T-Shirt [SEP] $15.99",
        ]


class ALFWorldPrompt(PromptBuilder):
    """ALFWorld: household text commands; invalid ones get ``Nothing happens.``."""

    env_ids = ("branchgym/ALFWorld-v0",)
    role = (
        "You are in a household and must complete the task described. Use commands such "
        "as 'go to countertop 1', 'take mug 1 from countertop 1', 'put mug 1 in/on "
        "coffeemachine 1', 'open fridge 1', 'heat potato 1 with microwave 1', 'look', "
        "'inventory'."
    )

    def extract(self, text: str) -> str:
        """The ``Action:`` line, without a leading ``>`` prompt mark."""
        return _react_action(text).lstrip(">").strip()

    def examples(self) -> list[str]:
        """Sample replies and observations."""
        return [
            "Thought: the mug is probably on a countertop.\nAction: go to countertop 1",
            "Action: take mug 1 from countertop 1",
            "Action: put mug 1 in/on coffeemachine 1",
            "On the countertop 1, you see a mug 1, and a knife 2.",
            "Nothing happens.",
        ]


class SWEBenchPrompt(PromptBuilder):
    """SWE-bench: one shell command per turn in a fenced block, or ``submit`` when done."""

    env_ids = ("branchgym/SWEBench-v0",)
    role = (
        "You are fixing an issue in a Python repository inside a sandbox. Each turn, run "
        "exactly one shell command to inspect or edit files or run tests. When the fix is "
        "complete, reply with the action submit."
    )
    answer_format = (
        "Answer with a line 'Thought: <your reasoning>' followed by the command in a "
        "```bash fenced block, or 'Action: submit'."
    )
    _FENCE = re.compile(r"```(?:bash|sh|shell|console)?[ \t]*\n(.*?)```", re.S | re.I)

    def render_observation(self, observation: Any, info: dict[str, Any]) -> str:
        """Command output (long outputs are the env's to truncate)."""
        return str(observation).rstrip()

    def extract(self, text: str) -> str:
        """The last fenced shell block, else the last ``Action:`` line."""
        blocks = self._FENCE.findall(text)
        if blocks:
            return blocks[-1].strip()
        return _react_action(text)

    def check(self, action: str, info: dict[str, Any]) -> ParsedAction:
        """``submit`` (any case) or a non-empty command."""
        if normalize(action) == "submit":
            return ParsedAction("submit", True)
        if not action.strip():
            return ParsedAction("", False, "the reply contains no command")
        if action.lstrip().startswith("$ "):
            action = action.lstrip()[2:]
        return ParsedAction(action.strip(), True)

    def examples(self) -> list[str]:
        """Sample replies."""
        return [
            "Thought: find the function.\n```bash\ngrep -rn 'def parse' src/\n```",
            "```bash\npython -m pytest tests/test_parser.py -x -q\n```",
            "Action: submit",
        ]


#: env id -> prompt builder; adapters add theirs.
PROMPTS: dict[str, PromptBuilder] = {}
for _cls in (TextTreePrompt, WebShopPrompt, ALFWorldPrompt, SWEBenchPrompt):
    for _id in _cls.env_ids:
        PROMPTS[_id] = _cls()


def prompt_for(env_id: str) -> PromptBuilder:
    """The builder registered for ``env_id``, else a generic ReAct builder."""
    if env_id in PROMPTS:
        return PROMPTS[env_id]
    base = env_id.split(":")[-1]
    for key, builder in PROMPTS.items():
        if key.split("/")[-1].split("-v")[0].lower() in base.lower():
            return builder
    return PromptBuilder()
