"""A real ``kvtier serve`` started with two API keys: every route but /health and /metrics asks
for one (the official client's ``AuthenticationError`` without it); vLLM's ``allowed_token_ids``
and ``bad_words`` through it give the engine's reference tokens, and their bad values are 400s."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from test_engine import penalised_greedy

from server_support import metrics, running_server

KEYS = ("k-first-0123", "k-second-4567")
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("controls") / "serve.log"
    with running_server(log, "--num-blocks", "64", "--api-key", KEYS[0], "--api-key", KEYS[1]) as url:
        text = log.read_text()
        assert "| 2 API key(s) asked for" in text and not any(k in text for k in KEYS)  # (never the keys)
        yield url


@pytest.fixture(scope="module")
def client(server):  # (the folder's client, with a key)
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key=KEYS[1], max_retries=0, timeout=120)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_every_route_but_health_and_metrics_asks_for_a_key(server) -> None:
    before = metrics(server).get('kvtier_requests_rejected_total{status=401}', 0.0)
    asks = [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
            ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
            ("POST", "/tokenize", {"prompt": "x"}), ("GET", "/tokenizer_info", None),
            ("GET", "/v1/no-such-route", None)]  # (a 401, not a 404: no route is told apart)
    refused = 0
    for method, path, body in asks:
        for headers in ({}, bearer("k-wrong"), {"Authorization": f"Basic {KEYS[0]}"}, bearer(KEYS[0] + "x")):
            r = httpx.request(method, server + path, json=body, headers=headers, timeout=60)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (path, headers)
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and ("no API key" in err["message"]) == (not headers)
            refused += 1
    assert metrics(server)['kvtier_requests_rejected_total{status=401}'] - before == refused
    for key in KEYS:  # either key; the scheme's case does not matter
        for scheme in ("Bearer", "bearer"):
            r = httpx.get(f"{server}/v1/models", headers={"Authorization": f"{scheme} {key}"}, timeout=60)
            assert r.status_code == 200 and r.json()["data"]
    for path in ("/health", "/metrics"):
        assert httpx.get(server + path, timeout=60).status_code == 200


def test_the_official_client_with_and_without_the_key(server, client) -> None:
    import openai

    wrong = openai.OpenAI(base_url=f"{server}/v1", api_key="k-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.choices[0].text == " Paris."


def test_allowed_token_ids_and_bad_words_give_the_reference_tokens(client, lm) -> None:
    tok, model = lm.tokenizer, client.models.list().data[0].id
    ids = tok.encode(PROMPT)

    def complete(**extra) -> str:
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                         extra_body=extra).choices[0].text

    cities = [t for w in (" Rome", " London", " Berlin", ".") for t in tok.encode(w)]
    got = complete(allowed_token_ids=cities)
    assert re.fullmatch(r"( Rome| London| Berlin|\.)+", got)
    assert got == tok.decode(penalised_greedy(lm.model, ids, 8, allowed=tuple(cities)))
    plain = complete()
    assert plain.startswith(" Paris.")
    # "Paris" is banned as it is and after a space; "Paris." (two tokens) bans the stop after " Paris"
    for word, spelled in (("Paris", ("Paris", " Paris")), (" Paris.", ("Paris.", " Paris."))):
        got = complete(bad_words=[word])
        want = penalised_greedy(lm.model, ids, 8, bad_words=tuple(tuple(tok.encode(s)) for s in spelled))
        assert got == tok.decode(want) and word.strip() not in got and got != plain


def test_guided_choice_answers_one_of_the_choices(client, lm) -> None:
    from test_engine import guided_greedy

    tok, model = lm.tokenizer, client.models.list().data[0].id
    question = [{"role": "user", "content": "What is the capital of France?"}]
    choices = ["London", "Berlin", "Paris, France"]
    free = client.chat.completions.create(model=model, messages=question, max_tokens=16, temperature=0)
    r = client.chat.completions.create(model=model, messages=question, max_tokens=16, temperature=0,
                                       extra_body={"guided_choice": choices})
    got = r.choices[0]
    assert free.choices[0].message.content not in choices and got.finish_reason == "stop"
    ids = tok.encode(tok.apply_chat_template(question), add_bos=False)
    want = guided_greedy(lm.model, ids, tuple(tuple(tok.encode(c, add_bos=False)) for c in choices),
                         frozenset(tok.eos_token_ids))
    assert got.message.content == tok.decode(want, skip_special_tokens=True) and got.message.content in choices
    again = client.chat.completions.create(model=model, messages=question, max_tokens=16, temperature=0,
                                           extra_body={"structured_outputs": {"choice": choices}})  # vLLM 0.12's name
    assert again.choices[0].message.content == got.message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=question, max_tokens=16, temperature=0.8, seed=5, stream=True,
        extra_body={"guided_choice": choices}))
    assert streamed in choices  # sampled: any choice, but a whole one


def test_truncate_prompt_tokens_keeps_the_prompts_end(client, lm) -> None:
    tok, model = lm.tokenizer, client.models.list().data[0].id
    long = "Some words to drop before the end. " * 60_000 + "The capital of France is"  # 2.1 MB, 0.5M tokens
    last = tok.encode(long)[-5:]
    want = client.completions.create(model=model, prompt=last, max_tokens=4, temperature=0)
    for prompt in (long, tok.encode(long[-200:])):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                      extra_body={"truncate_prompt_tokens": 5})
        assert r.usage.prompt_tokens == 5 and r.choices[0].text == tok.decode(last) + want.choices[0].text
    question = [{"role": "user", "content": long[-2000:]}]
    r = client.chat.completions.create(model=model, messages=question, max_tokens=2, temperature=0,
                                       extra_body={"truncate_prompt_tokens": 9})
    assert r.usage.prompt_tokens == 9
    # -1: what the context (1,024 tokens here) leaves beside max_tokens (was the whole context: a 400)
    r = client.completions.create(model=model, prompt=long, max_tokens=4, temperature=0,
                                  extra_body={"truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == 1024 - 4 and r.usage.completion_tokens == 4
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": long[-20_000:]}],
                                       temperature=0, extra_body={"truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == 1024 - 1 and r.usage.completion_tokens == 1  # (beside one token)


@pytest.mark.parametrize("body, param, message", [
    ({"allowed_token_ids": []}, "allowed_token_ids", "at least 1 item"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids", "allowed_token_ids must be a tuple of ints >= 0"),
    ({"allowed_token_ids": [10**6]}, "allowed_token_ids", "outside the vocabulary"),
    ({"allowed_token_ids": [2], "min_tokens": 1}, "allowed_token_ids", "are stop ids [2]"),  # (the end)
    ({"allowed_token_ids": [104], "bad_words": ["x"]}, "allowed_token_ids", "each is a one-token bad word;"),
    ({"bad_words": ["   "]}, "bad_words", "nothing but spaces"),
    ({"bad_words": ["a\ud800"]}, "bad_words", "not valid Unicode"),  # (JSON may carry a lone surrogate)
    ({"guided_choice": ["a\ud800"]}, "guided_choice", "not valid Unicode"),
    ({"bad_words": ["x" * 200]}, "bad_words", "a word of at most 16 tokens"),
    ({"bad_words": ["w"] * 257}, "bad_words", "at most 256 items"),
    ({"bad_words": "Paris"}, "bad_words", "valid list"),
    ({"guided_choice": []}, "guided_choice", "at least 1 item"),
    ({"guided_choice": ["yes", ""]}, "guided_choice", "which is no text"),
    ({"guided_choice": ["yes"], "min_tokens": 1}, "guided_choice", "does not go with allowed_token_ids"),
    ({"guided_choice": ["yes"], "ignore_eos": True}, "guided_choice", "give stop_token_ids"),
    ({"guided_regex": "[a-"}, "guided_regex", "guided_regex: the regular expression does not compile"),
    ({"guided_choice": ["y" * 40_000, "n" * 30_000]}, "guided_choice", "70000 characters in all; at most 65536"),
    ({"bad_words": ["w" * 70_000]}, "bad_words", "70000 characters in all"),
    ({"structured_outputs": {"whitespace_pattern": "x"}}, "structured_outputs", "whitespace_pattern is not supported"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs", "must be a list of 1 to 256 strings"),
    ({"structured_outputs": {"choice": ["a"]}, "guided_choice": ["b"]}, "structured_outputs", "not both"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "would leave no prompt"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "greater than or equal to -1"),
    ({"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens", "over the context of 1024 tokens"),
    ({"truncate_prompt_tokens": -1, "max_tokens": 1024}, "max_tokens", "leaves beside max_tokens 1024, which is nothing"),
    ({"priority": 3}, "priority", "priority 3 needs the priority scheduling policy (kvtier serve --scheduling-policy"),
    ({"priority": 2**31}, "priority", "less than 2147483648"),
])
def test_bad_allowed_ids_and_bad_words_are_400s(server, lm, body, param, message) -> None:
    if "bad_words" in body and "allowed_token_ids" in body:  # (104 is "x", one token, in this vocabulary)
        assert lm.tokenizer.encode("x") == [104]
    r = httpx.post(f"{server}/v1/completions", content=json.dumps({"prompt": PROMPT, "max_tokens": 2, **body}),
                   headers={**bearer(KEYS[0]), "Content-Type": "application/json"}, timeout=60)  # (\ud800 escaped)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err
