"""``/v1/completions`` for scoring and batches, end to end on a real ``kvtier serve``: ``echo``
(the prompt before the completion, and with ``logprobs`` the prompt tokens' logprobs),
``max_tokens: 0`` with ``echo`` (the prompt alone, as evaluation harnesses ask for
log-likelihoods), vLLM's ``prompt_logprobs``, a batch of prompts in one request, and vLLM's
tokenizer routes. References: the model's own forward over the whole prompt, single
requests, the library's tokenizer."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from kvtier.config import KVCacheConfig
from server_support import running_server, settle

NUM_BLOCKS, MAX_WAITING = 64, 8
PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-scoring") / "serve.log"
    with running_server(log, "--num-blocks", str(NUM_BLOCKS), "--max-waiting", str(MAX_WAITING),
                        "--max-num-seqs", "8", "--max-batched-tokens", "16") as url:  # 16: prompts run in chunks
        yield url


def reference(lm, ids: list[int]) -> torch.Tensor:
    """Log-probabilities ``[T, V]`` of the whole prompt's forward (float64 of float32 logits)."""
    with torch.inference_mode():
        logits = lm.model(torch.tensor([ids]), lm.model.make_caches(KVCacheConfig()))[0]
    return torch.log_softmax(logits.double(), dim=-1)


def test_echo_with_no_new_tokens_scores_the_prompt(client, model, lm) -> None:
    tok = lm.tokenizer
    ids = tok.encode(PROMPT)
    r = client.completions.create(model=model, prompt=PROMPT, echo=True, max_tokens=0, logprobs=2)
    c, lp, want = r.choices[0], r.choices[0].logprobs, reference(lm, ids)
    assert c.text == PROMPT and c.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)
    assert lp.tokens == [tok.token_bytes(i).decode() for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first
    assert lp.token_logprobs[1:] == pytest.approx([float(want[i - 1, ids[i]]) for i in range(1, len(ids))], abs=1e-3)
    for i in range(1, len(ids)):
        best = want[i - 1].topk(2)
        assert lp.top_logprobs[i] == pytest.approx({tok.token_bytes(t).decode(): v for t, v in
                                                    zip(best.indices.tolist(), best.values.tolist())}, abs=1e-3)
    assert lp.text_offset == [len(tok.decode(ids[:i])) for i in range(len(ids))]
    streamed = list(client.completions.create(model=model, prompt=PROMPT, echo=True, max_tokens=0, logprobs=2,
                                              stream=True))
    assert "".join(s.choices[0].text for s in streamed) == PROMPT and streamed[-1].choices[0].finish_reason == "length"
    assert [t for s in streamed for t in s.choices[0].logprobs.tokens] == lp.tokens
    # the one token run behind max_tokens 0 is dropped, its end too: an end of text it drew is no stop
    eos = {str(lm.tokenizer.eos_token_id): 100}
    drew = client.completions.create(model=model, prompt=PROMPT, echo=True, max_tokens=0, logit_bias=eos)
    assert (drew.choices[0].text, drew.choices[0].finish_reason, drew.usage.completion_tokens) == (PROMPT, "length", 0)
    streamed = list(client.completions.create(model=model, prompt=PROMPT, echo=True, max_tokens=0, logit_bias=eos,
                                              stream=True))
    assert streamed[-1].choices[0].finish_reason == "length"


def test_echo_puts_the_prompt_before_the_completion(client, model, lm) -> None:
    kw = dict(model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1)
    plain = client.completions.create(**kw).choices[0]
    echoed = client.completions.create(**kw, echo=True).choices[0]
    n = len(lm.tokenizer.encode(PROMPT))
    assert echoed.text == PROMPT + plain.text and echoed.finish_reason == plain.finish_reason
    assert echoed.logprobs.tokens[n:] == plain.logprobs.tokens and len(plain.logprobs.tokens) == 4
    assert echoed.logprobs.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)
    assert echoed.logprobs.text_offset[n:] == [len(PROMPT) + o for o in plain.logprobs.text_offset]
    streamed = list(client.completions.create(**kw, echo=True, stream=True))
    assert streamed[0].choices[0].text.startswith(PROMPT)
    assert "".join(s.choices[0].text for s in streamed) == echoed.text
    assert [t for s in streamed for t in s.choices[0].logprobs.tokens] == echoed.logprobs.tokens
    # without logprobs: the text alone
    bare = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert bare.choices[0].text == echoed.text and bare.choices[0].logprobs is None


def test_log_likelihoods_of_continuations_as_a_harness_asks(client, model, lm) -> None:
    """Context plus continuation as token ids, a batch of them in one request, the prompt
    alone: the continuation's logprobs sum to the model's log-likelihood, and the greedy
    check (each continuation token the best one) agrees with the model's."""
    tok = lm.tokenizer
    context = tok.encode("Question: what colour is the sky on a clear day? Answer:")
    options = [tok.encode(" blue"), tok.encode(" green with purple stripes")]
    prompts = [context + o for o in options]
    r = client.completions.create(model=model, prompt=prompts, echo=True, max_tokens=0, logprobs=1, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.prompt_tokens == sum(map(len, prompts))
    scores = []
    for c, ids in zip(r.choices, prompts, strict=True):
        want = reference(lm, ids)
        got = c.logprobs.token_logprobs[len(context):]
        expect = [float(want[i - 1, ids[i]]) for i in range(len(context), len(ids))]
        assert got == pytest.approx(expect, abs=1e-3)
        greedy = all(int(want[i - 1].argmax()) == ids[i] for i in range(len(context), len(ids)))
        tops = c.logprobs.top_logprobs[len(context):]
        assert greedy == all(max(t, key=t.get) == tok.token_bytes(ids[len(context) + j]).decode()
                             for j, t in enumerate(tops))
        scores.append(sum(got))
    assert scores[0] > scores[1] and all(math.isfinite(s) for s in scores)


def test_a_batch_of_prompts_gives_each_its_choices_in_order(client, model) -> None:
    prompts = ["1, 2, 3,", "The capital of France is", "Red, green,"]
    r = client.completions.create(model=model, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    singles = [client.completions.create(model=model, prompt=p, max_tokens=5, temperature=0) for p in prompts]
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles for _ in range(2)]
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert r.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)
    streamed = list(client.completions.create(model=model, prompt=prompts, max_tokens=5, temperature=0,
                                              stream=True))
    texts = ["", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [s.choices[0].text for s in singles]


def test_vllms_prompt_logprobs_with_ranks(server, lm) -> None:
    tok = lm.tokenizer
    ids, want = tok.encode(PROMPT), reference(lm, tok.encode(PROMPT))
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2, "echo": True, "logprobs": 1}
    c = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()["choices"][0]
    scored = c["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for i in range(1, len(ids)):
        row, best = want[i - 1], want[i - 1].topk(2)
        keys = [str(ids[i])] + [str(t) for t in best.indices.tolist() if t != ids[i]]
        assert list(scored[i]) == keys  # the prompt's token first, then the best two
        own = scored[i][str(ids[i])]
        assert own["logprob"] == pytest.approx(float(row[ids[i]]), abs=1e-3)
        assert own["rank"] == 1 + int((row > row[ids[i]]).sum()) and own["decoded_token"] == tok.token_bytes(ids[i]).decode()
        for r, t in enumerate(best.indices.tolist(), start=1):
            assert scored[i][str(t)]["rank"] == r
    assert all(len(t) == 1 for t in c["logprobs"]["top_logprobs"][1:])  # echo's: logprobs 1, not 2
    chat = httpx.post(f"{server}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in chat["prompt_logprobs"][1:])


def test_the_tokenizer_routes_are_the_models_tokenizer(server, client, model, lm) -> None:
    tok = lm.tokenizer
    post = lambda route, body: httpx.post(f"{server}{route}", json=body, timeout=60)  # noqa: E731
    r = post("/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(PROMPT) and r["count"] == len(r["tokens"])
    assert r["token_strs"] == [tok.id_to_token(i) for i in r["tokens"]]
    assert r["max_model_len"] == httpx.get(f"{server}/health").json()["max_model_len"]
    messages = [{"role": "user", "content": "What is 2+2?"}]
    chat = post("/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == tok.encode(tok.apply_chat_template(messages), add_bos=False)
    answered = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert chat["count"] == answered.usage.prompt_tokens  # what the chat route feeds
    bare = post("/tokenize", {"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    assert chat["tokens"][: len(bare)] == bare and len(bare) < chat["count"]
    assert post("/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": PROMPT}
    info = httpx.get(f"{server}/tokenizer_info").json()
    assert (info["eos_token"], info["bos_token"]) == (tok.special_tokens["eos_token"], tok.special_tokens["bos_token"])
    assert info["chat_template"] == tok.chat_template and info["vocab_size"] == tok.vocab_size
    for route, body, param in (("/detokenize", {"tokens": [1, 10**7]}, "tokens"),
                               ("/tokenize", {}, "prompt"),
                               ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                               ("/tokenize", {"prompt": 5}, "prompt")):
        got = post(route, body)
        assert got.status_code == 400 and got.json()["error"]["param"] == param, got.text
    assert post("/tokenize", {"prompt": "a", "model": "gpt-9"}).status_code == 404
    # a text far over the context is refused from its first characters, not tokenized whole
    long = post("/tokenize", {"prompt": "word " * 200_000})
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded", long.text
    lone = httpx.post(f"{server}/tokenize", content=b'{"prompt": "\\ud800"}', headers={"content-type": "application/json"})
    assert lone.status_code == 400 and "surrogate" in lone.json()["error"]["message"]


def test_best_of_returns_the_best_by_mean_token_logprob(client, model) -> None:
    """best_of 4, n 2, seeded: the two of the four seeded completions (each as a request of its own,
    seeds 31 to 34) of highest mean token logprob, best first, without logprobs (none asked);
    usage counts every completion made. (Seed 31: the best two are not the first two.)"""
    body = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    r = client.completions.create(**body, n=2, seed=31, best_of=4)
    answers = [client.completions.create(**body, seed=31 + i, logprobs=0) for i in range(4)]
    alone = [a.choices[0] for a in answers]
    ranked = sorted(alone, key=lambda c: -sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs))
    assert [c.text for c in r.choices] == [c.text for c in ranked[:2]] and [c.index for c in r.choices] == [0, 1]
    assert ranked[:2] != alone[:2] and all(c.logprobs is None for c in r.choices)
    assert r.usage.completion_tokens == 4 * 6 and r.usage.prompt_tokens == answers[0].usage.prompt_tokens


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens 0 generates nothing"),
    ({"prompt": ["a", ""]}, "prompt", "the prompt is empty (prompt 1 of the batch)"),
    ({"prompt": [[1, 2], []]}, "prompt", "the prompt is empty (prompt 1 of the batch)"),
    ({"prompt": ["a"] * 5, "n": 2}, "n", f"10 choices (5 prompts, n=2) are more than the {MAX_WAITING}"),
    ({"prompt": ["a"] * 9}, "prompt", f"9 choices (9 prompts, n=1) are more than the {MAX_WAITING}"),
    ({"prompt": [[1, 2], [3, 10**9]], "echo": True}, "prompt", "token ids in [0, "),
    ({"prompt": ["a"] * 2049}, "prompt", "2049 prompts in one request; at most 2048"),
    ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "prompt_logprobs is not streamed"),
    ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", "less than or equal to 20"),
    ({"prompt": "hi", "best_of": 1, "n": 2}, "best_of", "best_of 1 is below n 2"),
    ({"prompt": "hi", "best_of": 3, "stream": True}, "best_of", "best_of is not streamed"),
    ({"prompt": "hi", "best_of": 9}, "best_of", f"best_of=9 choices are more than the {MAX_WAITING}"),
])
def test_bad_batches_and_scoring_requests_are_400s(server, body, param, message) -> None:
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err
    h = settle(server)  # a batch refused part way: its queued prompts are taken back
    assert h["waiting"] == h["running"] == 0 and h["free_blocks"] == NUM_BLOCKS
