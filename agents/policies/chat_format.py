"""Prompt text from the tokenizer's own chat template (``apply_chat_template``), ChatML as fallback.

:class:`~branchgym.agents.policies.policy.LLMPolicy` builds a prompt incrementally: the head
(system and task messages, then the assistant's generation prompt), then per turn the
sampled reply's token ids, the text that closes a reply, and the next user message with
the generation prompt. :class:`ChatFormat` gives those text pieces for any chat model:

* :meth:`ChatFormat.head` renders ``[system, user]`` with ``add_generation_prompt``;
* :attr:`ChatFormat.reply_end` (split into :attr:`~ChatFormat.stop_text`, what the model
  itself generates as its stop token, and :attr:`~ChatFormat.after_stop`) and
  :meth:`ChatFormat.user_turn` are cut out of renderings of a dialogue with placeholder
  contents, so they are exactly what the template writes between an assistant reply and
  the next generation prompt.

:func:`chat_format` derives them from a tokenizer's ``chat_template``. A tokenizer
without one, or a template that does not render a dialogue as a growing prefix (one that
rewrites earlier turns, e.g. drops past reasoning), gets ChatML (``<|im_start|>role ...
<|im_end|>``, what Qwen2 and SmolLM2 use), with a warning in the second case.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

__all__ = ["CHATML", "ChatFormat", "chat_format"]

_SYS, _TASK, _REPLY, _MSG = "\x01SYSTEM\x01", "\x01TASK\x01", "\x01REPLY\x01", "\x01USER\x01"


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """How prompts are written for one tokenizer.

    Attributes:
        source: ``template`` (the tokenizer's chat template) or ``chatml`` (the fallback).
        stop_text: The start of the reply's closing text that the model generates itself
            (its stop token, e.g. ``<|im_end|>``); appended only to a reply cut at
            ``max_new_tokens``.
        after_stop: The rest of the closing text (e.g. a newline).
        tokenizer: The tokenizer whose template renders :meth:`head` and :meth:`user_turn`
            (None for ChatML).
    """

    source: str
    stop_text: str
    after_stop: str
    tokenizer: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def reply_end(self) -> str:
        """The whole text between an assistant reply and the next user turn."""
        return self.stop_text + self.after_stop

    def head(self, system: str, task: str) -> str:
        """System and task messages, then the assistant's generation prompt."""
        if self.tokenizer is None:
            return (
                f"<|im_start|>system\n{system}<|im_end|>\n"
                f"<|im_start|>user\n{task}<|im_end|>\n<|im_start|>assistant\n"
            )
        return _render(self.tokenizer, _dialogue(system, task), True)

    def user_turn(self, message: str) -> str:
        """A user message after a closed reply, then the generation prompt."""
        if self.tokenizer is None:
            return f"<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"
        closed = _render(self.tokenizer, _dialogue(_SYS, _TASK, _REPLY), False)
        full = _render(self.tokenizer, _dialogue(_SYS, _TASK, _REPLY, message), True)
        return full[len(closed) :]


#: The fallback format (ChatML).
CHATML = ChatFormat("chatml", "<|im_end|>", "\n")


def _dialogue(system: str, task: str, *rest: str) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": task}]
    roles = ("assistant", "user")
    msgs += [{"role": roles[i % 2], "content": text} for i, text in enumerate(rest)]
    return msgs


def _render(tok: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )


def chat_format(tokenizer: Any, stop_texts: tuple[str, ...] = ()) -> ChatFormat:
    """The prompt format of ``tokenizer``: its chat template's, else ChatML.

    Args:
        tokenizer: A Hugging Face tokenizer (``chat_template`` may be None).
        stop_texts: Texts of the engine's stop tokens (the tokenizer's ``eos_token`` is
            always one): the part of the closing text a finished reply already ends with.
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return CHATML
    try:
        return _derive(tokenizer, stop_texts)
    except Exception as exc:  # noqa: BLE001 - any template failure falls back the same way
        warnings.warn(
            f"the tokenizer's chat template cannot be used incrementally ({exc}); prompts "
            "fall back to ChatML, which this model may not know.",
            stacklevel=2,
        )
        return CHATML


def _derive(tok: Any, stop_texts: tuple[str, ...]) -> ChatFormat:
    stops = tuple(s for s in (getattr(tok, "eos_token", None), *stop_texts) if s)
    head = _render(tok, _dialogue(_SYS, _TASK), True)
    closed = _render(tok, _dialogue(_SYS, _TASK, _REPLY), False)
    full = _render(tok, _dialogue(_SYS, _TASK, _REPLY, _MSG), True)
    if not closed.startswith(head + _REPLY):
        raise ValueError("a reply is not written right after the generation prompt")
    if not full.startswith(closed) or _MSG not in full[len(closed) :]:
        raise ValueError("a new user turn rewrites the earlier dialogue")
    end = closed[len(head) + len(_REPLY) :]
    for stop in sorted(stops, key=len, reverse=True):
        if end.startswith(stop):
            return ChatFormat("template", stop, end[len(stop) :], tokenizer=tok)
    return ChatFormat("template", "", end, tokenizer=tok)
