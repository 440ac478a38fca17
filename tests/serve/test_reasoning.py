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


def test_the_reasoning_tokens_are_counted_a_token_at_a_time() -> None:
    reader = ReasoningReader(R1)
    for piece in ("<th", "ink>", "So", " 4", ".</th", "ink>", "\n\n", "Four", "."):
        reader.feed(piece)
    reader.feed("", final=True)
    assert reader.tokens == 6  # (the start's two pieces, the reasoning's two, the end's two)
    reader = ReasoningReader(QWEN3)
    for piece in ("No", " thought", "</think>"):
        reader.feed(piece)
    assert reader.feed("", final=True) == ("", "") and reader.tokens == 0
    reader = ReasoningReader(R1, "content")
    assert reader.feed("<think>x</think>", final=True) == ("", "<think>x</think>") and reader.tokens == 0


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


TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if not enable_thinking %}<think></think>{% endif %}{% endif %}")


def test_the_chat_templates_switches_reach_it_and_a_final_message_is_continued() -> None:
    """vLLM's ``chat_template_kwargs`` (Qwen3's ``enable_thinking``), ``add_generation_prompt`` and
    ``continue_final_message``, on chat and tokenize requests alike; each misuse a 400 naming it."""
    from test_structured import byte_tokenizer

    from kvtier.serve.schemas import APIError, ChatCompletionRequest, TokenizeRequest, render_chat

    tok = byte_tokenizer()
    tok.set_chat_template(TEMPLATE)
    user = [{"role": "user", "content": "Hi"}]
    for kind in (ChatCompletionRequest, TokenizeRequest):
        def render(kind=kind, **fields) -> str:
            return render_chat(kind.model_validate({"messages": user, **fields}), tok)
        assert render() == "<user>Hi</user><assistant><think></think>"
        assert prompt_state(QWEN3, render()) == "content"
        assert render(chat_template_kwargs={"enable_thinking": True}) == "<user>Hi</user><assistant>"
        assert render(add_generation_prompt=False) == "<user>Hi</user>"
        user_and_start = [*user, {"role": "assistant", "content": "<think>So "}]
        req = kind.model_validate({"messages": user_and_start, "continue_final_message": True, "add_generation_prompt": False})
        assert render_chat(req, tok) == "<user>Hi</user><assistant><think>So"  # (its closing tag cut)
        assert prompt_state(QWEN3, render_chat(req, tok)) == "start"
        for fields, message in (({"continue_final_message": True}, "send add_generation_prompt false"),
                                ({"continue_final_message": True, "add_generation_prompt": False}, "the last is a 'user' message"),
                                ({"chat_template_kwargs": {"messages": [], "add_generation_prompt": False}},
                                 "may not set add_generation_prompt, messages"),
                                ({"chat_template_kwargs": {"raise_exception": 1}}, "may not set raise_exception")):
            with pytest.raises(APIError, match=message) as e:
                render(**fields)
            assert e.value.param == next(iter(fields)), fields
    tok.set_chat_template("{{ reasoning_effort }}|{{ x }}")  # (OpenAI's reasoning_effort, as vLLM gives it)
    effort = {"messages": user, "reasoning_effort": "low", "chat_template_kwargs": {"x": 1, "reasoning_effort": "high"}}
    assert render_chat(ChatCompletionRequest.model_validate(effort), tok) == "low|1"
    from kvtier.serve.responses import ResponsesRequest, chat_request
    assert render_chat(chat_request(ResponsesRequest.model_validate({"input": "Hi", "reasoning": {"effort": "medium"}}),
                                    []), tok) == "medium|"
    tok.set_chat_template("{{ n + 1 }}")  # (a value the template cannot take: a 400, not a failure)
    with pytest.raises(APIError, match="the chat template refused the messages") as e:
        render_chat(ChatCompletionRequest.model_validate({"messages": user, "chat_template_kwargs": {"n": "x"}}), tok)
    assert e.value.param == "messages"
    tok.set_chat_template("{% for m in messages %}{{ m.content | upper }}{% endfor %}")
    with pytest.raises(APIError, match="does not write the last message's text as given"):
        render_chat(ChatCompletionRequest.model_validate({"messages": [{"role": "assistant", "content": "abc"}],
                                                          "continue_final_message": True,
                                                          "add_generation_prompt": False}), tok)
