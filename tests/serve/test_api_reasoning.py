"""A reasoning model's answers through a real ``kvtier serve --reasoning-parser deepseek_r1``:
SmolLM2, shown two answers that think between ``<think>`` and ``</think>``, thinks too; the
chat's reasoning and content, whole and streamed, and the Responses API's reasoning item, against
the same prompt's raw completion; a structured answer held to its schema only after the
reasoning. (The server also schedules by priority: a request's ``priority`` is served; and it
speculates with n-gram drafts: every greedy answer here is drafted, and its own test compares a
copy with an engine that drafts nothing.)"""

from __future__ import annotations

import json

import httpx
import pytest

from server_support import running_server

SHOTS = [("What is 2 + 3?", "<think>\nTwo plus three makes five.\n</think>\n\nThe answer is 5."),
         ("What colour is the sky?", "<think>\nOn a clear day the sky looks blue.\n</think>\n\nThe sky is blue.")]
MESSAGES = [m for q, a in SHOTS for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
QUESTIONS = ("What is 4 + 4?", "What is the capital of France?")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("reasoning") / "serve.log"
    with running_server(log, "--num-blocks", "96", "--reasoning-parser", "deepseek_r1",
                        "--scheduling-policy", "priority", "--speculative-config",
                        '{"method": "ngram", "num_speculative_tokens": 4}') as url:
        assert "| n-gram drafts, 4 a step" in log.read_text()
        yield url


def split(text: str) -> tuple[str, str]:
    """The reference reading of a deepseek_r1 answer: before the first ``</think>`` (a leading
    ``<think>`` left out) its reasoning, after it (leading space left out) its content."""
    head, end, tail = text.partition("</think>")
    head = head.lstrip()
    head = head[len("<think>"):] if head.startswith("<think>") else head
    return (head, tail.lstrip()) if end else (head, "")


def test_reasoning_and_content_equal_the_raw_answer_split(server, client, model) -> None:
    question = QUESTIONS[0]  # (the other: the priority test's)
    messages = [*MESSAGES, {"role": "user", "content": question}]
    ids = httpx.post(f"{server}/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    done = client.completions.create(model=model, prompt=ids, max_tokens=40, temperature=0, logprobs=0).choices[0]
    raw, tokens = done.text, done.logprobs.tokens
    reasoning, content = split(raw)
    thought = next(k + 1 for k in range(len(tokens)) if "</think>" in "".join(tokens[: k + 1]))  # (its end's too)
    assert reasoning.strip() and content, raw  # (the model thinks first, then answers)
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": messages, "max_tokens": 40,
                                                          "temperature": 0}, timeout=60).json()
    msg = r["choices"][0]["message"]
    assert (msg["reasoning"], msg["reasoning_content"], msg["content"]) == (reasoning, reasoning, content), raw
    assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == thought
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thought
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    assert sum(bool(getattr(d, "reasoning", None)) for d in deltas) > 1  # (the reasoning as it comes)
    got = client.responses.create(model=model, input=messages, max_output_tokens=40, temperature=0)
    assert [o.type for o in got.output] == ["reasoning", "message"]
    assert got.output[0].content[0].text == reasoning and got.output_text == content
    assert got.usage.output_tokens_details.reasoning_tokens == thought
    again = client.responses.create(model=model, input=[got.output[0].model_dump(exclude_none=True), *messages],
                                    max_output_tokens=40, temperature=0)  # (a reasoning item sent back: left out)
    assert again.output_text == got.output_text
    with client.responses.stream(model=model, input=messages, max_output_tokens=40, temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert final.output[0].content[0].text == reasoning and final.output_text == content
    assert kinds.count("response.reasoning_text.done") == 1 and "response.reasoning_text.delta" in kinds


def test_a_structured_answer_is_held_to_its_schema_after_the_reasoning(server, client, model) -> None:
    """The grammar waits for ``</think>``: the reasoning is the free answer's own, the content JSON
    held to the schema (without the wait the answer could not think at all)."""
    messages = [*MESSAGES, {"role": "user", "content": QUESTIONS[0]}]
    free = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0)
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    held = client.chat.completions.create(model=model, messages=messages, max_tokens=60, temperature=0,
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "a", "schema": schema}})
    choice = held.choices[0]
    assert choice.message.reasoning == free.choices[0].message.reasoning and choice.finish_reason == "stop"
    assert set(json.loads(choice.message.content)) == {"answer"}


def test_a_prompt_that_closes_the_reasoning_leaves_all_of_the_answer_content(server, client, model) -> None:
    """``continue_final_message`` after an assistant's ``<think>...</think>``: the prompt ends the
    reasoning, so the answer is content (the raw completion of the same prompt) and a structured
    answer is held from its first token."""
    closed = [*MESSAGES, {"role": "user", "content": QUESTIONS[0]},
              {"role": "assistant", "content": "<think>\nEasy: eight.\n</think>"}]
    how = {"continue_final_message": True, "add_generation_prompt": False}
    ids = httpx.post(f"{server}/tokenize", json={"messages": closed, **how}, timeout=60).json()["tokens"]
    raw = client.completions.create(model=model, prompt=ids, max_tokens=24, temperature=0).choices[0].text
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": closed, "max_tokens": 24, "temperature": 0, **how},
                   timeout=60).json()["choices"][0]["message"]
    assert r["reasoning"] is None and r["content"] == raw and raw.strip()
    held = httpx.post(f"{server}/v1/chat/completions", json={"messages": closed, "max_tokens": 24, "temperature": 0,
                                                             "response_format": {"type": "json_object"}, **how},
                      timeout=60).json()["choices"][0]
    assert held["message"]["reasoning"] is None and isinstance(json.loads(held["message"]["content"]), dict)
    bad = httpx.post(f"{server}/v1/chat/completions", json={"messages": closed, "continue_final_message": True},
                     timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"


def test_guided_choice_waits_for_the_reasoning_too(server, client, model) -> None:
    messages = [*MESSAGES, {"role": "user", "content": "Is 4 + 4 equal to 8?"}]
    free = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0).choices[0]
    choices = ["Yes, it is.", "No, it is not.", "Ça dépend \"x\""]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0,
                                       extra_body={"guided_choice": choices}).choices[0]
    assert r.message.reasoning == free.message.reasoning and r.message.reasoning
    assert r.message.content in choices and r.finish_reason == "stop"


def test_calls_after_the_reasoning_are_read_from_its_content(server, client, model) -> None:
    """tool_choice "auto" on a reasoning model: the reasoning is read first, then the calls out of
    the content (SmolLM2's template ignores tools: the server describes them in hermes' format)."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    history = []
    for i, city in enumerate(("Paris", "Berlin")):
        history += [{"role": "user", "content": f"What is the weather in {city}?"},
                    {"role": "assistant", "content": f"<think>\nI should look up {city}.\n</think>\n\n", "tool_calls": [
                        {"id": f"call_{i}", "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
                    {"role": "tool", "tool_call_id": f"call_{i}", "content": "sunny"},
                    {"role": "assistant", "content": f"<think>\nThe tool says sunny.\n</think>\n\nIt is sunny in {city}."}]
    asks = dict(model=model, messages=[*history, {"role": "user", "content": "What is the weather in Tokyo?"}],
                tools=[weather], max_tokens=60, temperature=0)
    r = client.chat.completions.create(**asks).choices[0]
    assert r.message.reasoning and "<think>" not in r.message.reasoning and r.finish_reason == "tool_calls", r
    assert [(c.function.name, json.loads(c.function.arguments)) for c in r.message.tool_calls] == [
        ("get_weather", {"city": "Tokyo"})] and r.message.content is None
    chunks = [c.choices[0] for c in client.chat.completions.create(**asks, stream=True) if c.choices]
    assert "".join(getattr(c.delta, "reasoning", None) or "" for c in chunks) == r.message.reasoning
    assert "".join(d.function.arguments or "" for c in chunks for d in c.delta.tool_calls or []) == (
        r.message.tool_calls[0].function.arguments)


def test_priorities_are_served_under_the_priority_policy(server, client, model) -> None:
    """``--scheduling-policy priority``: a request's ``priority`` (vLLM's) is taken, not refused,
    and changes when it runs, not what it answers."""
    messages = [*MESSAGES, {"role": "user", "content": QUESTIONS[1]}]
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    for priority in (-5, 7):
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                           extra_body={"priority": priority})
        assert r.choices[0].message == plain.choices[0].message


def test_drafted_answers_equal_the_undrafted_ones(server, client, model, lm) -> None:
    """A copy the model makes of its prompt: through the server, where greedy rows draft, the
    answer whole, streamed and with logprobs is that of an engine without drafts in this process;
    /metrics counts drafts kept."""
    from kvtier.serve.engine import EngineConfig, LLMEngine
    from kvtier.serve.params import RequestParams

    text = ("def area(width, height):\n    return width * height\n\n"
            "def volume(width, height, depth):\n    return area(width, height) * depth\n")
    messages = [{"role": "user", "content": f"Copy this code exactly.\n\n{text}"}]
    ids = httpx.post(f"{server}/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    (plain,) = LLMEngine(lm.model, lm.tokenizer, EngineConfig(num_blocks=64)).generate(
        [ids], RequestParams(max_tokens=60, logprobs=0))
    assert "return area(width, height) * depth" in plain.text  # (the model copies)
    before = httpx.get(f"{server}/metrics", timeout=30).text
    kw = {"model": model, "prompt": ids, "max_tokens": 60, "temperature": 0}  # (raw: no reasoning read)
    drafted = client.completions.create(**kw).choices[0]
    assert (drafted.text, drafted.finish_reason) == (plain.text, plain.finish_reason)
    scored = client.completions.create(**kw, logprobs=0).choices[0]
    assert scored.text == plain.text
    assert scored.logprobs.token_logprobs == pytest.approx([x.logprob for x in plain.logprobs], abs=1e-4)
    streamed = client.completions.create(**kw, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == plain.text

    def count(metrics: str, name: str) -> float:
        return float(next(ln.split()[-1] for ln in metrics.splitlines() if ln.startswith(name + " ")))

    after = httpx.get(f"{server}/metrics", timeout=30).text
    kept = "kvtier_spec_decode_num_accepted_tokens_total"
    assert count(after, kept) - count(before, kept) >= 30  # (the three answers')
    assert 0 < count(after, "kvtier_spec_decode_acceptance_rate") <= 1
