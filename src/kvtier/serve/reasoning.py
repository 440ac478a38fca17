"""Reasoning in chat answers (``kvtier serve --reasoning-parser``): the text a reasoning model
writes between ``<think>`` and ``</think>`` goes out as the message's ``reasoning`` (and
``reasoning_content``, its older name, as vLLM and DeepSeek's API give it), the rest as its
``content``.

- ``deepseek_r1`` (DeepSeek-R1 and its distillations, QwQ): the answer starts in its reasoning,
  whether or not it writes ``<think>`` (the chat template often writes it), up to ``</think>``;
  an answer without ``</think>`` is reasoning alone;
- ``qwen3`` (Qwen3): the answer reasons only where it starts with ``<think>``.

A prompt that ends with ``</think>`` (Qwen3's ``enable_thinking: false`` writes an empty block)
closes the reasoning before the answer starts: all of it is content; one that ends with
``<think>`` opens it. Structured outputs and tool calls apply to the content: their grammar holds
the answer from the end of its reasoning on (:func:`grammar_after`).

Example::

    >>> reader = ReasoningReader(FORMATS["deepseek_r1"])
    >>> reader.feed("<think>\\n2 + 2 is 4.\\n</thi"), reader.feed("nk>\\n\\nIt is 4.", final=True)
    (('\\n2 + 2 is 4.\\n', ''), ('', 'It is 4.'))
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.generate import split_at_stop

__all__ = ["FORMATS", "ReasoningFormat", "ReasoningReader", "grammar_after", "prompt_state"]


@dataclass(frozen=True)
class ReasoningFormat:
    """How a model family writes its reasoning: between ``start`` and ``end``; ``implicit``: an
    answer is reasoning from its start even without ``start``."""

    name: str
    implicit: bool
    start: str = "<think>"
    end: str = "</think>"


#: the reasoning formats ``--reasoning-parser`` reads, by name (vLLM's names)
FORMATS = {"deepseek_r1": ReasoningFormat("deepseek_r1", implicit=True),
           "qwen3": ReasoningFormat("qwen3", implicit=False)}


def prompt_state(fmt: ReasoningFormat, prompt: str) -> str:
    """Where a rendered chat ``prompt`` leaves the answer: ``"content"`` (the prompt closed the
    reasoning), ``"reasoning"`` (it opened it) or ``"start"`` (the answer's own start decides)."""
    tail = prompt.rstrip()
    return "content" if tail.endswith(fmt.end) else "reasoning" if tail.endswith(fmt.start) else "start"


def grammar_after(fmt: ReasoningFormat, state: str) -> str | None:
    """The text after which a structured answer's grammar applies (``None``: from the start)."""
    return None if state == "content" else fmt.end


class ReasoningReader:
    """Splits an answer, as it streams, into its reasoning and its content: :meth:`feed` holds back
    an end that may begin ``start`` or ``end`` until it is decided; ``final`` gives out the rest.
    The whitespace between the reasoning's end and the content is dropped."""

    def __init__(self, fmt: ReasoningFormat, state: str = "start"):
        self.fmt, self.state, self.held = fmt, state, ""
        self.tokens = 0  # texts fed while the answer was in its reasoning (its start and end included)
        self._undecided = 0  # texts fed while it was not known whether the answer starts reasoning

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """``(reasoning, content)`` of what ``text`` completes. Fed one token's text at a time,
        :attr:`tokens` counts the reasoning's tokens."""
        self.held += text
        reasoning = content = ""
        thought = bool(text) and self.state == "reasoning"
        self._undecided += bool(text) and self.state == "start"
        while self.held:
            if self.state == "start":  # a leading start (after whitespace) opens the reasoning
                head = self.held.lstrip()
                if head.startswith(self.fmt.start):
                    self.held, self.state = head[len(self.fmt.start):], "reasoning"
                elif (not head or self.fmt.start.startswith(head)) and not final:
                    break
                else:
                    self.state = "reasoning" if self.fmt.implicit else "content"
                if self.state == "reasoning":  # (the texts fed while undecided were the reasoning's)
                    self.tokens += self._undecided
                self._undecided = 0
            elif self.state == "reasoning":
                before, _, found = split_at_stop(self.held, (self.fmt.end,), hold=not final)
                reasoning += before
                self.held = self.held[len(before) + (len(self.fmt.end) if found else 0):]
                if not found:
                    break
                self.state = "gap"
            elif self.state == "gap":  # whitespace between the reasoning and the content
                self.held = self.held.lstrip()
                if self.held:
                    self.state = "content"
            else:
                content, self.held = content + self.held, ""
        self.tokens += thought
        return reasoning, content

