"""``kvtier serve`` end to end: a real uvicorn server on 127.0.0.1, driven by the official
``openai`` client and by httpx for what a well-behaved client never sends.

The server is started once for the module (the model loads once) and stopped by its
pid at the end. Outputs are checked against the library (``kvtier.generate``) in
this process; capacity is checked through ``/health`` and ``/metrics``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError, NotFoundError, OpenAI

from kvtier.config import KVCacheConfig
from kvtier.generate import GenerationConfig, generate
from server_support import metrics, running_server, settle

NUM_BLOCKS, MAX_NUM_SEQS, MAX_WAITING, MAX_REQUEST_MB = 128, 8, 16, 1
SYSTEM = ("You are a terse assistant for a hardware shop. Answer in one sentence, name a tool when "
          "one helps, and never apologise. ") * 3


@pytest.fixture(scope="module")
def server_log(tmp_path_factory) -> Path:
    return Path(tmp_path_factory.mktemp("serve")) / "serve.log"


@pytest.fixture(scope="module")
def server(server_log):
    """Base URL of the module's ``kvtier serve`` (warmed up, as it is by default on CUDA)."""
    with running_server(server_log, "--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", str(MAX_NUM_SEQS),
                        "--max-waiting", str(MAX_WAITING), "--max-batched-tokens", "256",
                        "--max-request-mb", str(MAX_REQUEST_MB), "--warmup") as url:
        yield url


def test_models_and_health(server, model) -> None:
    h = httpx.get(f"{server}/health").json()
    assert h["status"] == "ok" and h["num_blocks"] == NUM_BLOCKS
    assert model == "SmolLM2-135M-Instruct.Q4_1"
    listed = httpx.get(f"{server}/v1/models").json()["data"][0]
    assert listed["max_model_len"] == h["max_model_len"] == NUM_BLOCKS * 16
    client = OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve(model).model_dump(exclude_none=True) == listed  # before: 404
    with pytest.raises(NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-9")
    assert httpx.head(f"{server}/health").status_code == 200  # load balancers' probe; before: 405


def test_the_banner_names_the_port_it_listens_on_and_a_taken_port_is_refused(server, server_log) -> None:
    from kvtier.serve.cli import _listen

    port = server.rsplit(":", 1)[1]
    assert f"on http://127.0.0.1:{port}/v1" in server_log.read_text()
    with _listen("127.0.0.1", 0) as sock:  # port 0: the system's pick, which the banner shows
        assert sock.getsockname()[1] > 0
    with pytest.raises(ValueError, match=rf"cannot listen on 127.0.0.1:{port} \(.*\); choose another --port"):
        _listen("127.0.0.1", int(port))  # before: the banner said serving, then uvicorn exited 3


def test_warm_up_leaves_nothing_behind(server, server_log) -> None:
    """The start-up warm-up ran its made-up requests (a prompt chunked over two steps of 256
    tokens among them) and left every block free, no prefix cached, no token counted."""
    line = next(x for x in server_log.read_text().splitlines() if "warmed up" in x)
    assert "7 made-up requests" in line, line
    h = httpx.get(f"{server}/health").json()
    assert h["free_blocks"] == NUM_BLOCKS and h["cached_blocks"] == 0 and h["running"] == h["waiting"] == 0
    m = metrics(server)  # these four are the engine's own counters
    assert m["kvtier_prompt_tokens_total"] == m["kvtier_prefix_cache_queries_total"] == 0
    assert m["kvtier_prefix_cache_hits_total"] == m["kvtier_preemptions_total"] == 0


def test_completion_text_usage_and_stop(client, model, lm) -> None:
    ids = lm.tokenizer.encode("1, 2, 3, 4,")
    r = client.completions.create(model=model, prompt=ids, max_tokens=12, temperature=0, stop=[" 8"])
    want = generate(lm.model, lm.tokenizer, ids, GenerationConfig(max_tokens=12, stop=(" 8",)),
                    cache_config=KVCacheConfig())
    assert r.choices[0].text == want and " 8" not in want
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(ids) and 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streams_what_it_answers_whole(client, model) -> None:
    kw = dict(model=model, messages=[{"role": "user", "content": "Name three colours."}],
              max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    assert whole.choices[0].message.role == "assistant"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    # vLLM's continuous_usage_stats: each chunk of an output with the usage so far
    counted = list(client.chat.completions.create(**kw, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}))
    outs = [c for c in counted if c.choices and c.choices[0].delta.role is None]
    done = [c.usage.completion_tokens for c in outs]
    assert done == sorted(done) and done[-1] == whole.usage.completion_tokens and len(set(done)) > 1
    assert all(c.usage.prompt_tokens == whole.usage.prompt_tokens for c in outs)
    assert not any(c.usage for c in chunks[:-1])  # (without it, the last chunk alone)


def test_raw_sse_ends_with_done(server, model) -> None:
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_seed_makes_sampling_reproducible(client, model) -> None:
    kw = dict(model=model, messages=[{"role": "user", "content": "Invent a word."}], max_tokens=12,
              temperature=1.0, top_p=0.95, seed=1234)
    a, b = (client.chat.completions.create(**kw).choices[0].message.content for _ in range(2))
    assert a == b


def test_n_choices_are_the_requests_of_seeds_seed_plus_i(client, model) -> None:
    # before: 400 "n > 1 is not supported"
    kw = dict(model=model, prompt="My favourite animal is", max_tokens=8, temperature=1.0,
              extra_body={"ignore_eos": True})
    r = client.completions.create(n=3, seed=7, **kw)
    singles = [client.completions.create(seed=7 + i, **kw) for i in range(3)]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles]
    assert len({c.text for c in r.choices}) > 1  # the choices differ
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens  # the prompt once
    assert r.usage.completion_tokens == 3 * 8 and r.usage.total_tokens == r.usage.prompt_tokens + 24
    greedy = client.completions.create(n=2, **{**kw, "temperature": 0})
    assert greedy.choices[0].text == greedy.choices[1].text


def test_n_choices_stream_interleaved_with_their_index(client, model, server) -> None:
    kw = dict(model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=10,
              temperature=0.9, seed=11, n=3, logprobs=True)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts, finish, roles, logprobs = {}, {}, {}, {}
    for c in chunks:
        for ch in c.choices:
            roles.setdefault(ch.index, ch.delta.role)  # each choice's first chunk names the role
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            logprobs[ch.index] = logprobs.get(ch.index, 0) + len(ch.logprobs.content if ch.logprobs else [])
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices} and len(texts) == 3
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    assert logprobs == {c.index: len(c.logprobs.content) for c in whole.choices}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == sum(logprobs.values())
    one = client.chat.completions.create(**{**kw, "n": 1})  # the prompt counted once (was n times)
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens == one.usage.prompt_tokens
    h = settle(server)
    assert h["running"] == h["waiting"] == 0 and h["free_blocks"] == NUM_BLOCKS


def test_penalties_reach_the_engine(client, model, lm) -> None:
    # before: 400 "penalties are not supported"
    from kvtier.serve.engine import EngineConfig, LLMEngine
    from kvtier.serve.params import RequestParams

    prompt = "Say it again and again: apple apple apple apple apple"
    kw = dict(model=model, prompt=prompt, max_tokens=10, temperature=0)
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    asked = dict(presence_penalty=0.4, frequency_penalty=1.2)
    r = client.completions.create(**kw, **asked, extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
    ids = lm.tokenizer.encode(prompt)
    want = LLMEngine(lm.model, lm.tokenizer, EngineConfig(num_blocks=16)).generate(
        [ids], RequestParams(max_tokens=10, ignore_eos=True, repetition_penalty=1.3, **asked))[0]
    assert r.choices[0].text == want.text != plain
    # logit_bias: -100 all but bans the greedy first token; +-1.5 on others moves them
    first = lm.tokenizer.encode(plain)[0]
    bias = {str(first): -100.0, "28": 1.5, "30": -1.5}
    r = client.completions.create(**kw, logit_bias=bias, extra_body={"ignore_eos": True})
    want = LLMEngine(lm.model, lm.tokenizer, EngineConfig(num_blocks=16)).generate(
        [ids], RequestParams(max_tokens=10, ignore_eos=True, logit_bias=((first, -100.0), (28, 1.5), (30, -1.5))))[0]
    assert r.choices[0].text == want.text and want.token_ids[0] != first


def test_choice_seeds() -> None:
    from kvtier.sampling import SamplingParams
    from kvtier.serve.api import choice_params
    from kvtier.serve.params import RequestParams

    seeded = RequestParams(max_tokens=4, sampling=SamplingParams(temperature=1.0, seed=2**63 - 1))
    assert [choice_params(seeded, i).sampling.seed for i in range(3)] == [2**63 - 1, 2**63, 2**63 + 1]
    assert choice_params(seeded, 2).max_tokens == 4
    unseeded = RequestParams(sampling=SamplingParams(temperature=1.0))
    assert choice_params(unseeded, 5) is unseeded


def test_logprobs_shapes(client, model) -> None:
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob == pytest.approx(item.top_logprobs[0].logprob)


def test_logprobs_of_tokens_holding_part_of_a_character(server, client, model) -> None:
    """Byte-level tokens of an emoji: each token's bytes are its own (joined, they are the text),
    written bytes:\\x.. where they are no character alone; completions' top_logprobs keep
    their N entries and the chosen token's own logprob (before: every such token was U+FFFD,
    the dict lost entries and showed another token's logprob, the offsets ran past the text)."""
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Emoji: 🎉🎉🎉 🍕"}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    text, content = r.choices[0].message.content, r.choices[0].logprobs.content
    assert bytes(b for item in content for b in item.bytes).decode("utf-8") == text
    assert any(item.token.startswith("bytes:\\x") for item in content)
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "Emoji: 🎉🎉🎉 🍕", "max_tokens": 6,
                                                      "temperature": 0, "logprobs": 5}, timeout=60).json()
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert [len(top) for top in lp["top_logprobs"]] == [5] * 6
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[token] == pytest.approx(logprob)  # greedy: the chosen token is among the top
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] <= len(choice["text"])


def test_null_takes_the_default_as_openai_reads_it(server, client, model) -> None:
    """OpenAI types these fields "or null" and the official client sends null for a None
    argument: each takes its default (before: 400 for temperature, top_p, n, stream, ...)."""
    nulls = dict.fromkeys(("temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty"))
    body = {"prompt": "Hi", "seed": 3, "ignore_eos": True}
    got = httpx.post(f"{server}/v1/completions", json={**body, **nulls, "echo": None, "max_tokens": None},
                     timeout=60).json()
    want = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()
    assert got["usage"]["completion_tokens"] == 16  # completions' max_tokens: null is 16, as OpenAI's
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       temperature=None, top_p=None, logprobs=None, stream=None, n=None)
    assert r.usage.completion_tokens <= 2


def test_vllm_sampling_fields_are_served_or_refused(server, lm) -> None:
    paris, dot = lm.tokenizer.encode(" Paris.")
    body = {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0}
    r = httpx.post(f"{server}/v1/completions", json={**body, "stop_token_ids": [dot]}, timeout=60).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 2
    assert r["choices"][0]["text"] == " Paris"
    r = httpx.post(f"{server}/v1/completions", json={**body, "stop": ["."], "include_stop_str_in_output": True},
                   timeout=60).json()  # before: a 400
    assert r["choices"][0]["text"] == " Paris." and r["choices"][0]["finish_reason"] == "stop"
    for field, value in (("use_beam_search", True), ("guided_regex", ["a+"])):
        r = httpx.post(f"{server}/v1/completions", json={**body, field: value}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field  # before: ignored
    r = httpx.post(f"{server}/v1/completions", json={**body, "stop_token_ids": [10**6]}, timeout=60)
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]


def test_sixteen_concurrent_greedy_requests_equal_generate(server, model, lm) -> None:
    tok = lm.tokenizer
    prompts = [tok.encode(" ".join(["word"] * (3 + 11 * i)) + f" {i}") for i in range(16)]

    async def all_at_once():
        async with AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0) as c:
            return await asyncio.gather(*(c.completions.create(
                model=model, prompt=p, max_tokens=4 + i % 4, temperature=0) for i, p in enumerate(prompts)))

    got = asyncio.run(all_at_once())
    for i, (p, r) in enumerate(zip(prompts, got)):
        want = generate(lm.model, tok, p, GenerationConfig(max_tokens=4 + i % 4),
                        cache_config=KVCacheConfig())
        assert r.choices[0].text == want, i


def test_prefix_cache_hits_show_in_metrics(client, model, server) -> None:
    kw = dict(model=model, max_tokens=6, temperature=0)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "I need to cut a pipe."}]
    before = metrics(server)["kvtier_prefix_cache_hits_total"]
    first = client.chat.completions.create(messages=msgs, **kw)
    second = client.chat.completions.create(messages=msgs, **kw)
    after = metrics(server)["kvtier_prefix_cache_hits_total"]
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 64 and after - before >= cached
    assert second.choices[0].message.content == first.choices[0].message.content


@pytest.mark.parametrize("body, status, param", [
    ("{not json", 400, None),
    ([1, 2], 400, None),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "n": 129}, 400, "n"),  # OpenAI's limit
    ({"prompt": "hi", "n": MAX_WAITING + 1}, 400, "n"),  # more than the server ever queues: not a 429
    ({"prompt": "hi", "n": 2.0}, 400, "n"),
    ({"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ({"prompt": "hi", "frequency_penalty": "1"}, 400, "frequency_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": "hi", "min_tokens": -1}, 400, "min_tokens"),
    ({"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ({"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"-5": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": "1"}}, 400, "logit_bias.5"),  # (the entry, as pydantic names it)
    ({"prompt": "hi", "logit_bias": {str(10**6): 1}}, 400, "logit_bias"),  # outside the vocabulary
    ({"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1025)}}, 400, "logit_bias"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ({"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    ({"max_tokens": 3}, 400, "prompt"),
    # strict types: a bool is not a token id nor a count, 3.0 is not a count, "yes" not a bool
    ({"prompt": [True, 2]}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 3.0}, 400, "max_tokens"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": "hi", "temperature": "0.5"}, 400, "temperature"),
    ({"prompt": "hi", "stop": 5}, 400, "stop"),
    ({"prompt": "hi", "stop": ["s"] * 129}, 400, "stop"),
    ({"prompt": "hi", "stop": ["x" * 5000]}, 400, "stop"),
    ({"prompt": "a\ud800b"}, 400, "prompt"),  # a lone surrogate: valid (escaped) JSON, not Unicode
    ({"prompt": "hi", "stop": ["a\ud800"]}, 400, "stop"),  # before: accepted
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),  # as OpenAI
    ("", 400, None),
    ("null", 400, None),
    ('{"prompt": "hi", "temperature": NaN}', 400, "temperature"),  # JSON that Python's parser takes
    ('{"prompt": "hi", "top_p": -Infinity}', 400, "top_p"),
    ('{"prompt": "hi", "min_p": Infinity}', 400, "min_p"),
])
def test_malformed_completions_get_openai_errors(server, body, status, param) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server}/v1/completions", content=content,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    if "NaN" in content or "Infinity" in content:
        assert "finite" in err["message"], err


def test_malformed_chat_and_routes(server, client, model) -> None:
    user = [{"role": "user", "content": "x"}]
    for body, param in (({"messages": []}, "messages"), ({"messages": [{"role": "wizard", "content": "x"}]},
                                                         "messages.0.role"),
                        ({"messages": user, "tools": [{"type": "function"}]}, "tools"),
                        ({"messages": user, "response_format": {"type": "structural_tag"}}, "response_format"),
                        ({"messages": user, "top_logprobs": 2}, "top_logprobs"),  # (without logprobs: true)
                        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                         "messages.0.content"),
                        ({"messages": [{"role": "user", "content": "\udfff"}]}, "messages"),
                        # were 200s (OpenAI's 400s): no content, no parts, a result of no call, a call of no function
                        ({"messages": [{"role": "user"}]}, "messages.0.content"),
                        ({"messages": [{"role": "user", "content": []}]}, "messages.0.content"),
                        ({"messages": [*user, {"role": "tool", "content": "4"}]}, "messages.1.tool_call_id"),
                        ({"messages": [*user, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]},
                         "messages.1.tool_calls"),
                        ({"messages": user, "tools": []}, "tools"),
                        ({"messages": user, "tools": [{"type": "function", "function": {
                            "name": "f", "parameters": {"type": "string"}}}]}, "tools"),
                        ({"messages": user, "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools")):
        r = httpx.post(f"{server}/v1/chat/completions", content=json.dumps(body),  # escapes the surrogate
                       headers={"content-type": "application/json"}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "invalid_request_error" and err["param"] == param, err
    assert httpx.get(f"{server}/v1/nothing").status_code == 404
    r = httpx.get(f"{server}/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["message"]  # (the Allow was lost)
    assert [httpx.head(f"{server}{p}").status_code for p in ("/metrics", "/v1/models", "/health")] == [200] * 3
    r = httpx.post(f"{server}/v1/completions/", json={"prompt": "x"})  # was a bare 307 to the route
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    with pytest.raises(NotFoundError):
        client.completions.create(model="gpt-9", prompt="x")


@pytest.mark.parametrize("content, headers, message", [
    (b'{"prompt": "\xff"}', {}, "the request body is not UTF-8 text (byte 0xff at offset 12)"),
    (b"[" * 5000 + b"]" * 5000, {}, "the request body's JSON nests deeper than the server reads"),
    (b'{"prompt": "hi"}', {"content-type": "text/plain"}, "the request's Content-Type is 'text/plain'"),
    (b'{"prompt": "hi", "stop": ["x", ""]}', {}, "stop holds an empty string, which no text can be cut at"),
])  # were "There was an error parsing the body", "not a JSON object" and "('x', '')"
def test_unreadable_bodies_say_why(server, content, headers, message) -> None:
    r = httpx.post(f"{server}/v1/completions", content=content,
                   headers={"content-type": "application/json", **headers}, timeout=30)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_prompt_longer_than_the_context_is_a_clear_400(client, model) -> None:
    with pytest.raises(BadRequestError) as e:
        client.completions.create(model=model, prompt=[1] * (NUM_BLOCKS * 16 + 5), max_tokens=2)
    err = e.value.body
    assert err["code"] == "context_length_exceeded" and "context holds 2048" in err["message"]


def test_oversized_bodies_get_413_and_overlong_text_a_400(server, model) -> None:
    limit = MAX_REQUEST_MB * 2**20
    big = json.dumps({"model": model, "prompt": "x" * (limit + 10)}).encode()

    def chunks():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    for content in (big, chunks()):
        r = httpx.post(f"{server}/v1/completions", content=content,
                       headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # under the body limit but far over the context: refused from a prefix, with the context named
    r = httpx.post(f"{server}/v1/completions", json={"model": model, "prompt": "word " * 150_000}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and "2048" in err["message"]
    assert httpx.get(f"{server}/health").json()["status"] == "ok"


def test_unicode_prompts_and_a_hundred_stop_strings(client, model, lm) -> None:
    prompt = "Emoji 🚀🔥 and 日本語, then « ünïcödé »:"
    stop = tuple(f"zz{i}" for i in range(99)) + (" the",)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stop=list(stop))
    ids = lm.tokenizer.encode(prompt)
    want = generate(lm.model, lm.tokenizer, ids, GenerationConfig(max_tokens=12, stop=stop),
                    cache_config=KVCacheConfig())
    assert r.choices[0].text == want and r.usage.prompt_tokens == len(ids)


def test_metrics_name_what_the_issue_lists(server, client, model) -> None:
    client.completions.create(model=model, prompt="Hello there", max_tokens=4, temperature=0)
    m = metrics(server)
    for name in ("kvtier_requests_running", "kvtier_requests_waiting", "kvtier_kv_blocks_free",
                 "kvtier_kv_blocks_total", "kvtier_prefix_cache_hit_rate", "kvtier_generation_tokens_total",
                 "kvtier_preemptions_total"):
        assert name in m, name
    assert m["kvtier_kv_blocks_total"] == NUM_BLOCKS and 0 <= m["kvtier_prefix_cache_hit_rate"] <= 1
    assert m["kvtier_time_to_first_token_seconds_count"] >= 1
    assert m["kvtier_time_per_output_token_seconds_count"] >= 1
    assert m["kvtier_e2e_request_latency_seconds_count"] >= 1
    assert m["kvtier_requests_finished_total{finish_reason=length}"] >= 1


def test_full_queue_answers_429_with_retry_after(server, model) -> None:
    async def burst():
        async with httpx.AsyncClient(timeout=300) as c:
            body = {"model": model, "prompt": "Tell me about the sea.", "max_tokens": 24}
            return await asyncio.gather(*(c.post(f"{server}/v1/completions", json=body)
                                          for _ in range(MAX_NUM_SEQS + MAX_WAITING + 8)))

    answers = asyncio.run(burst())
    codes = [r.status_code for r in answers]
    assert set(codes) <= {200, 429} and codes.count(429) >= 1 and codes.count(200) >= MAX_NUM_SEQS
    refused = next(r for r in answers if r.status_code == 429)
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert settle(server)["free_blocks"] == NUM_BLOCKS


@pytest.mark.parametrize("n", [1, 3])
def test_disconnects_abort_and_free_blocks(server, model, n) -> None:
    tokens = metrics(server)["kvtier_generation_tokens_total"]
    aborted = metrics(server).get("kvtier_requests_finished_total{finish_reason=abort}", 0)
    body = {"model": model, "prompt": "Write a long story about a lighthouse.", "max_tokens": 400,
            "ignore_eos": True, "n": n}
    with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        next(r.iter_lines())  # one event, then hang up
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        httpx.post(f"{server}/v1/completions", json=body, timeout=1.0)
    h = settle(server)
    assert h["running"] == h["waiting"] == 0 and h["free_blocks"] == NUM_BLOCKS
    assert metrics(server)["kvtier_generation_tokens_total"] - tokens < 2 * n * 400  # all were cut short
    # and all count as finished, for the reason abort (before: in no finished count at all); with
    # n choices, every one of them
    assert metrics(server)["kvtier_requests_finished_total{finish_reason=abort}"] - aborted == 2 * n


def test_n_over_the_free_queue_is_a_429_and_queues_nothing(server, model) -> None:
    # long requests (none finishes within the test) fill the running slots and some of the queue;
    # then n = MAX_WAITING choices cannot all be queued: 429, and those queued are taken back
    body = {"model": model, "prompt": "Tell me about the sea.", "max_tokens": 1500, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(timeout=300) as c:
            long = [asyncio.ensure_future(c.post(f"{server}/v1/completions", json=body))
                    for _ in range(MAX_NUM_SEQS + 4)]
            for _ in range(600):  # until every long request is running or waiting (at most 60 s)
                before = (await c.get(f"{server}/health")).json()
                if before["running"] + before["waiting"] == len(long):
                    break
                await asyncio.sleep(0.1)
            wide = await c.post(f"{server}/v1/completions", json={**body, "max_tokens": 4, "n": MAX_WAITING})
            for _ in range(30):  # the refused request's queued choices go at the next step (3 s at most)
                after = (await c.get(f"{server}/health")).json()
                if after["waiting"] <= before["waiting"]:
                    break
                await asyncio.sleep(0.1)
            for task in long:  # hang up: the long requests are aborted
                task.cancel()
            await asyncio.gather(*long, return_exceptions=True)
            return before, wide, after

    before, wide, after = asyncio.run(run())
    assert before["running"] + before["waiting"] == MAX_NUM_SEQS + 4 and before["waiting"] >= 4, before
    assert wide.status_code == 429 and wide.json()["error"]["code"] == "rate_limit_exceeded", wide.text
    assert after["waiting"] <= before["waiting"], (before, after)
    h = settle(server)
    assert h["running"] == h["waiting"] == 0 and h["free_blocks"] == NUM_BLOCKS


def test_bounded_load_with_bad_and_departing_clients(server, model) -> None:
    """200 requests from 32 clients: valid, malformed and departing. No 5xx, every valid request
    answered (429s retried), and the pool whole again afterwards."""
    start = settle(server)["free_blocks"]
    kinds = ["complete", "chat_stream", "malformed", "complete", "depart", "chat", "malformed_chat"]
    jobs = [kinds[i % len(kinds)] for i in range(200)]
    bad = {"malformed": ('{"prompt": 5', "/v1/completions"),
           "malformed_chat": (json.dumps({"messages": "hi"}), "/v1/chat/completions")}
    statuses: list[int] = []
    answered = {"valid": 0, "ok": 0}

    async def one(c: httpx.AsyncClient, i: int, kind: str) -> None:
        prompt = f"Request {i}: say something about the number {i}."
        chat = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 3}
        if kind in bad:
            content, path = bad[kind]
            r = await c.post(path, content=content, headers={"content-type": "application/json"})
            statuses.append(r.status_code)
            return
        if kind == "depart":
            async with c.stream("POST", "/v1/chat/completions", json={**chat, "stream": True,
                                                                     "max_tokens": 50}) as r:
                statuses.append(r.status_code)
            return  # closed before reading: the server aborts it
        answered["valid"] += 1
        for _ in range(200):  # retry 429s, as Retry-After asks (sooner: the test is bounded)
            if kind == "chat_stream":
                async with c.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
                    lines = [line async for line in r.aiter_lines() if line]
                ok = r.status_code == 200 and lines[-1] == "data: [DONE]"
            else:
                path, body = (("/v1/chat/completions", chat) if kind == "chat" else
                              ("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 3}))
                r = await c.post(path, json=body)
                ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
            statuses.append(r.status_code)
            if r.status_code != 429:
                answered["ok"] += ok
                return
            await asyncio.sleep(0.2)

    async def load():
        queue = asyncio.Queue()
        for i, kind in enumerate(jobs):
            queue.put_nowait((i, kind))

        async def worker():
            async with httpx.AsyncClient(base_url=server, timeout=300) as c:
                while not queue.empty():
                    await one(c, *queue.get_nowait())

        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(32))), timeout=600)

    asyncio.run(load())
    assert not [s for s in statuses if s >= 500]
    assert answered["ok"] == answered["valid"] == sum(k in ("complete", "chat", "chat_stream") for k in jobs)
    assert statuses.count(400) >= sum(k in bad for k in jobs)
    h = settle(server)
    assert h["free_blocks"] == start == NUM_BLOCKS
