"""Reasoning answers (kvtier.serve.reasoning): the reasoning and content read as they stream,
where a prompt leaves the answer, and a structured answer's grammar waiting for the reasoning's
end."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.serve.reasoning import FORMATS, ReasoningReader, grammar_after, prompt_state

R1, QWEN3 = FORMATS["deepseek_r1"], FORMATS["qwen3"]

# (format, the prompt's state, answer, its reasoning, its content)
CASES = [
    (R1, "start", "<think>\nfour\n</think>\n\nIt is 4.", "\nfour\n", "It is 4."),
    (R1, "start", "four</think>It is </think> 4.", "four", "It is </think> 4."),  # (only the first end)
    (R1, "start", "  <think>still thinking", "still thinking", ""),  # (no end: reasoning alone)
    (R1, "start", "<thin", "<thin", ""),
    (R1, "reasoning", "<think>x</think>y", "<think>x", "y"),  # (opened by the prompt: a start is text)
    (R1, "content", "<think>x</think>y", "", "<think>x</think>y"),
    (QWEN3, "start", "\n<think>a <b></think>\n c", "a <b>", "c"),
    (QWEN3, "start", "No thought. </think> here", "", "No thought. </think> here"),
    (QWEN3, "start", "<thin", "", "<thin"),
    (QWEN3, "start", "", "", ""),
    (QWEN3, "reasoning", "a</think>", "a", ""),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, 40), max_size=8))
def test_reasoning_read_as_it_streams_equals_the_whole_answer(case, cuts) -> None:
    fmt, state, text, reasoning, content = CASES[case]
    assert ReasoningReader(fmt, state).feed(text, final=True) == (reasoning, content)
    reader, got = ReasoningReader(fmt, state), []
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    for a, b in zip(bounds, bounds[1:], strict=False):
        got.append(reader.feed(text[a:b]))
    got.append(reader.feed("", final=True))
    assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == (reasoning, content)


def test_reasoning_streams_as_it_comes() -> None:
    reader = ReasoningReader(R1)
    assert reader.feed("<th") == ("", "")  # (it may be a start)
    assert reader.feed("ink>So 2 + 2 ") == ("So 2 + 2 ", "")
    assert reader.feed("is 4.</th") == ("is 4.", "")  # (it may be the end)
    assert reader.feed("ink>\n\n") == ("", "")  # (the space after the end is left out)
    assert reader.feed("Four.") == ("", "Four.")


def test_the_prompt_says_where_the_answer_starts() -> None:
    assert prompt_state(QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n") == "content"  # (thinking off)
    assert prompt_state(R1, "<｜Assistant｜><think>\n") == "reasoning"
    assert prompt_state(QWEN3, "<|im_start|>assistant\n") == "start"
    assert grammar_after(R1, "content") is None and grammar_after(R1, "start") == grammar_after(QWEN3, "reasoning") == "</think>"


def test_the_flag_reaches_the_server_config_and_bad_names_are_refused(capsys) -> None:
    from kvtier import cli
    from kvtier.serve.api import ServerConfig
    from kvtier.serve.cli import configs_from_args

    parse = cli.build_parser().parse_args
    assert configs_from_args(parse(["serve", "--reasoning-parser", "qwen3"]))[1].reasoning_parser == "qwen3"
    assert configs_from_args(parse(["serve"]))[1].reasoning_parser is None
    with pytest.raises(SystemExit):
        parse(["serve", "--reasoning-parser", "granite"])
    assert "invalid choice: 'granite'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3 or None, got 'granite'"):
        ServerConfig(reasoning_parser="granite")
