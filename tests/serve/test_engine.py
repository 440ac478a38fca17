"""LLMEngine on the default model: continuous batching, prefix caching and preemption give
each request the tokens it gets alone through kvtier.generate (the library behind
``kvtier generate``); no block outlives its requests."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier import cli
from kvtier.config import KVCacheConfig
from kvtier.generate import GenerationConfig, stream_generate
from kvtier.kernels.cpu_attention import load_kernels
from kvtier.model import cpu_step
from kvtier.sampling import SamplingParams
from kvtier.serve.engine import PROMPT_LOGITS_BYTES, EngineConfig, LLMEngine
from kvtier.serve.params import RequestParams
from kvtier.serve.scheduler import QueueFull

WORDS = ("river", "stone", "cloud", "lamp", "garden", "paper", "violin", "mountain", "orange",
         "window", "silver", "thunder", "candle", "harbor", "meadow")
SYSTEM = ("You are a careful assistant. Answer in one short sentence, use plain words, "
          "and never repeat the question back. ") * 3


def prompt(tok, i: int) -> list[int]:
    """A chat prompt whose user message has 2 to ~100 words, different for every ``i``."""
    words = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(2 + (i * 37) % 100))
    return chat(tok, f"Continue this list: {words}")


def chat(tok, user: str, system: str | None = None) -> list[int]:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return tok.encode(tok.apply_chat_template(msgs), add_bos=False)


def solo(lm, ids: list[int], max_tokens: int, **gen) -> list[int]:
    """The request alone through kvtier.generate (default tier)."""
    cfg = GenerationConfig(max_tokens=max_tokens, **gen)
    return [r.token for r in stream_generate(lm.model, lm.tokenizer, ids, cfg,
                                             cache_config=KVCacheConfig())]


def drain(engine: LLMEngine, arrivals: dict[int, list[tuple[list[int], RequestParams]]]) -> dict:
    """Step the engine, adding ``arrivals[step]`` before that step; tokens per request id."""
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished() or any(k >= step for k in arrivals):
        for ids, params in arrivals.get(step, []):
            tokens[engine.add_request(ids, params)] = []
        for out in engine.step():
            tokens[out.request_id] += list(out.token_ids)
        step += 1
        assert step < 2000
    return tokens


def paged_steps(monkeypatch) -> list:
    """The results of the one-call decode steps over the pages, as they run (None: one declined)."""
    steps, real = [], cpu_step.DecodeStep.run_paged

    def run_paged(*a, **kw):
        steps.append(real(*a, **kw))
        return steps[-1]

    monkeypatch.setattr(cpu_step.DecodeStep, "run_paged", run_paged)
    return steps


def test_continuous_batching_equals_each_request_alone(lm, monkeypatch) -> None:
    tok = lm.tokenizer
    steps = paged_steps(monkeypatch)
    reqs = [(prompt(tok, i), RequestParams(max_tokens=4 + i % 5)) for i in range(16)]
    # 8 rows at most, 48 tokens a step: requests wait, join mid-run, prefill in chunks beside decodes
    engine = LLMEngine(lm.model, tok, EngineConfig(num_blocks=160, max_num_seqs=8,
                                                   max_batched_tokens=48))
    start = engine.stats()["free_blocks"]
    got = drain(engine, {0: reqs[:10], 3: reqs[10:13], 7: reqs[13:]})
    for (ids, params), (rid, tokens) in zip(reqs, got.items()):
        assert tokens == solo(lm, ids, params.max_tokens), rid
    s = engine.stats()
    assert s["free_blocks"] == start and s["running"] == s["waiting"] == 0
    calls = engine.runner.caches[0].paged_stats()["attention_calls_by_backend"]
    assert calls["torch"] > 0, calls  # prompt chunks through SDPA
    if cpu_step.load_kernels() is not None:  # decode steps in one C call each, reading the pages in place
        assert len(steps) > 20 and all(s is not None for s in steps)
    elif load_kernels() is not None:  # else the layered forward's attention kernel reads them
        assert calls["cpu"] > 0, calls


def test_prefix_cache_reuses_a_long_system_prompt(lm) -> None:
    tok = lm.tokenizer
    engine = LLMEngine(lm.model, tok, EngineConfig(num_blocks=64))
    first = chat(tok, "Name a colour.", SYSTEM)
    second = chat(tok, "Name a fruit.", SYSTEM)
    params = RequestParams(max_tokens=6)
    a = engine.generate([first], params)[0]
    assert a.cached_tokens == 0
    b = engine.generate([second], params)[0]
    common = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
    assert b.cached_tokens == common // 16 * 16 >= 64
    assert engine.stats()["prefix_hits"] == b.cached_tokens
    assert list(b.token_ids) == solo(lm, second, 6)
    again = engine.generate([first], params)[0]  # all but the last block cached
    assert list(again.token_ids) == list(a.token_ids) == solo(lm, first, 6)
    assert engine.stats()["free_blocks"] == 64


def test_quantised_pages_share_their_prefix(lm, monkeypatch) -> None:
    tok = lm.tokenizer
    steps = paged_steps(monkeypatch)
    ids = chat(tok, "Name a fruit.", SYSTEM)
    params = RequestParams(max_tokens=5)
    warm = LLMEngine(lm.model, tok, EngineConfig(num_blocks=64, kv_quant="q8"))
    warm.generate([chat(tok, "Name a colour.", SYSTEM)], params)
    shared = warm.generate([ids], params)[0]
    assert warm.stats()["kv_storage"] == "q8" and shared.cached_tokens >= 64
    # q8 rounding amplifies the last-bit differences of other matmul shapes, so the reference
    # computes the prefix as its own chunk too: the same shapes, hence the same pages
    fresh = LLMEngine(lm.model, tok, EngineConfig(num_blocks=64, kv_quant="q8",
                                                  max_batched_tokens=shared.cached_tokens))
    assert shared.token_ids == fresh.generate([ids], params)[0].token_ids
    if cpu_step.load_kernels() is not None:  # q8 pages too: decode steps in one C call each
        assert len(steps) >= 8 and all(s is not None for s in steps)
    elif load_kernels() is not None:  # else read in place by the layered forward's attention kernel
        assert warm.runner.caches[0].paged_stats()["attention_calls_by_backend"]["cpu"] > 0


def test_turboquant_pages_serve_as_generate_reads_them(lm) -> None:
    """`kvtier serve --turboquant K,V`: the engine's pages take the codec, and each request
    (alone: the same matmul shapes) gets the tokens generate gives over the same pages."""
    from kvtier.quant.modes import parse_turboquant
    from kvtier.serve.cli import configs_from_args

    args = cli.build_parser().parse_args(["serve", "--turboquant", "q8_0,q3_0", "--num-blocks", "64"])
    config, _ = configs_from_args(args)
    tq = parse_turboquant("q8_0,q3_0")
    assert config.turboquant == tq and config.kv_quant is None
    engine = LLMEngine(lm.model, lm.tokenizer, config)
    cache = KVCacheConfig(tier="paged", turboquant=tq, paged_num_blocks=64)
    for i in (1, 5):
        ids = prompt(lm.tokenizer, i)
        got = engine.generate([ids], RequestParams(max_tokens=6))[0]
        ref = [r.token for r in stream_generate(lm.model, lm.tokenizer, ids, GenerationConfig(max_tokens=6),
                                                cache_config=cache)]
        assert list(got.token_ids) == ref
    assert engine.stats()["kv_storage"].startswith("turboquant"), engine.stats()["kv_storage"]
    with pytest.raises(ValueError, match="drop one of them"):
        configs_from_args(cli.build_parser().parse_args(["serve", "--turboquant", "q8_0,q3_0", "--kv-quant", "q8"]))


def test_generate_from_several_threads_runs_each_call_alone(lm) -> None:
    """Four threads call generate() at once: each gets its prompts' tokens (the calls
    interleaved inside the engine before, failing on each other's rows)."""
    from concurrent.futures import ThreadPoolExecutor

    tok = lm.tokenizer
    engine = LLMEngine(lm.model, tok, EngineConfig(num_blocks=128))
    prompts = [prompt(tok, i) for i in range(4)]
    params = RequestParams(max_tokens=5)
    want = [list(engine.generate([p], params)[0].token_ids) for p in prompts]
    with ThreadPoolExecutor(4) as pool:  # (a call's error is raised here)
        got = list(pool.map(lambda p: list(engine.generate([p], params)[0].token_ids), prompts, timeout=120))
    assert got == want
    s = engine.stats()
    assert s["running"] == s["waiting"] == 0 and s["free_blocks"] == 128


def test_preemption_with_a_small_pool_still_gives_correct_outputs(lm) -> None:
    tok = lm.tokenizer
    reqs = [(prompt(tok, i), RequestParams(max_tokens=24)) for i in (1, 2, 5, 9, 11)]
    need = sum(len(ids) + 24 for ids, _ in reqs) // 16
    engine = LLMEngine(lm.model, tok, EngineConfig(num_blocks=need // 2, max_batched_tokens=64))
    got = drain(engine, {0: reqs})
    assert engine.stats()["preemptions"] > 0
    for (ids, params), tokens in zip(reqs, got.values()):
        assert tokens == solo(lm, ids, params.max_tokens)
    assert engine.stats()["free_blocks"] == need // 2


def test_the_priority_policy_runs_low_values_first_and_keeps_outputs_exact(lm) -> None:
    """``scheduling_policy="priority"``: one row at a time, requests queued together finish in
    priority order (ties by arrival); under a small pool with preemption the tokens stay each
    request's own; first come, first served refuses a priority and queues nothing."""
    tok = lm.tokenizer
    engine = LLMEngine(lm.model, tok, EngineConfig(num_blocks=64, max_num_seqs=1, scheduling_policy="priority"))
    prios = [5, 0, 1, 0, -3]
    rids = [engine.add_request(prompt(tok, i), RequestParams(max_tokens=3, priority=p)) for i, p in enumerate(prios)]
    done = []
    while engine.has_unfinished():
        done += [o.request_id for o in engine.step() if o.finished]
    assert done == [rids[4], rids[1], rids[3], rids[2], rids[0]]
    reqs = [(prompt(tok, i), RequestParams(max_tokens=24, priority=i % 3)) for i in (1, 2, 5, 9, 11)]
    need = sum(len(ids) + 24 for ids, _ in reqs) // 16
    small = LLMEngine(lm.model, tok, EngineConfig(num_blocks=need // 2, max_batched_tokens=64,
                                                  scheduling_policy="priority"))
    got = drain(small, {0: reqs})
    assert small.stats()["preemptions"] > 0
    for (ids, params), tokens in zip(reqs, got.values(), strict=True):
        assert tokens == solo(lm, ids, params.max_tokens)
    fcfs = LLMEngine(lm.model, tok, EngineConfig(num_blocks=16))
    with pytest.raises(ValueError, match="priority 1 needs the priority scheduling policy"):
        fcfs.add_request(prompt(tok, 0), RequestParams(max_tokens=2, priority=1))
    assert not fcfs.has_unfinished()


def test_seeded_sampling_repeats_whatever_the_batch(lm) -> None:
    tok = lm.tokenizer
    params = RequestParams(max_tokens=8, sampling=SamplingParams(temperature=0.9, top_p=0.9, seed=7))
    ids = chat(tok, "Tell me a story.")
    engine = LLMEngine(lm.model, tok, EngineConfig(num_blocks=64))
    alone = engine.generate([ids], params)[0]
    crowd = engine.generate([prompt(tok, 3), ids, prompt(tok, 4)],
                            [RequestParams(max_tokens=3), params, RequestParams(max_tokens=9)])[1]
    assert alone.token_ids == crowd.token_ids


def test_stop_strings_cut_the_text_like_generate(lm) -> None:
    tok = lm.tokenizer
    ids = tok.encode("1, 2, 3, 4, 5,")
    out = LLMEngine(lm.model, tok, EngineConfig(num_blocks=32)).generate(
        [ids], RequestParams(max_tokens=20, stop=(" 8",)))[0]
    cfg = GenerationConfig(max_tokens=20, stop=(" 8",))
    want = "".join(r.text for r in stream_generate(lm.model, tok, ids, cfg, cache_config=KVCacheConfig()))
    assert out.finish_reason == "stop" and out.text == want and " 8" not in out.text


def test_logprobs_come_from_the_model_distribution(lm) -> None:
    tok = lm.tokenizer
    ids = tok.encode("The capital of France is")
    out = LLMEngine(lm.model, tok, EngineConfig(num_blocks=32)).generate(
        [ids], RequestParams(max_tokens=2, logprobs=3))[0]
    with torch.inference_mode():
        caches = lm.model.make_caches(KVCacheConfig())
        want = torch.log_softmax(lm.model(torch.tensor([ids]), caches)[0, -1], -1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0] == int(want.argmax())
    assert first.logprob == pytest.approx(float(want.max()), abs=1e-4)
    assert [t for t, _ in first.top] == want.topk(3).indices.tolist()


def penalised_greedy(model, ids: list[int], n: int, presence: float = 0.0, frequency: float = 0.0,
                     repetition: float = 1.0, bias: tuple = (), *, allowed: tuple = (), bad_words: tuple = ()):
    """The reference: each token the argmax of the whole sequence's last logits in float64, the
    bias and the penalties written out (the bias; repetition over prompt and output; then
    frequency and presence), and the bans: ids outside ``allowed``, one-token bad words, and
    the last token of a longer one whose other tokens end the output."""
    out: list[int] = []
    device = model.tok_embeddings.weight.device
    with torch.inference_mode():
        for _ in range(n):
            caches = model.make_caches(KVCacheConfig())
            logits = model(torch.tensor([ids + out], device=device), caches)[0, -1].double().cpu()
            for token, b in bias:
                logits[token] += b
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).double()
            seen = counts > 0
            seen[ids] = True
            logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
            logits = logits - frequency * counts - presence * (counts > 0).double()
            if allowed:
                logits[[t for t in range(logits.numel()) if t not in allowed]] = float("-inf")
            for w in bad_words:
                if len(w) == 1 or out[len(out) - len(w) + 1:] == list(w[:-1]):
                    logits[w[-1]] = float("-inf")
            out.append(int(logits.argmax()))
    return out


_PENALISED: dict[tuple, list[int]] = {}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_give_the_reference_tokens(lm, async_scheduling) -> None:
    tok = lm.tokenizer
    count = tok.encode("Count from one to twenty in words, separated by commas: one, two,")
    apple = tok.encode("Say it again and again: apple apple apple apple apple")
    engine = LLMEngine(lm.model, tok, EngineConfig(num_blocks=32, async_scheduling=async_scheduling))
    (three,), (four,) = tok.encode(" three"), tok.encode(" four")
    no_three, four_up = ((three, -100.0),), ((four, 3.0), (three, -1.5))
    rows = [(count, (0.0, 0.0, 1.0)), (count, (0.0, 0.5, 1.0)), (count, (0.5, 0.0, 1.0)),
            (count, (0.3, 0.3, 1.1)), (apple, (0.0, 0.0, 1.0)), (apple, (0.0, 0.0, 1.3)),
            (count, (0.0, 0.0, 1.0, no_three)), (count, (0.0, 0.5, 1.2, four_up))]
    params = [RequestParams(max_tokens=16, ignore_eos=True, presence_penalty=k[0], frequency_penalty=k[1],
                            repetition_penalty=k[2], logit_bias=k[3] if len(k) > 3 else ())
              for _, k in rows]
    outs = engine.generate([ids for ids, _ in rows], params)  # one batch: each row its own penalties
    got = [list(o.token_ids) for o in outs]
    for ids, k in rows:  # (the reference is the same for both engines)
        if (tuple(ids), k) not in _PENALISED:
            _PENALISED[tuple(ids), k] = penalised_greedy(lm.model, ids, 16, *k)
    assert got == [_PENALISED[tuple(ids), k] for ids, k in rows]
    plain, frequency, presence, mixed, apples, repeated, banned, biased = got
    # each penalty moved the tokens, and frequency is not presence (a swap would show)
    assert frequency != plain and frequency != presence and mixed != plain and repeated != apples
    assert plain[0] == three and three not in banned and biased != plain
    # logprobs stay the model's own: the second token's (penalised: " apple" again would lose 2)
    # is its log-probability under the unpenalised logits
    out = engine.generate([apple], RequestParams(max_tokens=2, logprobs=0, frequency_penalty=2.0))[0]
    with torch.inference_mode():
        caches = lm.model.make_caches(KVCacheConfig())
        lp = torch.log_softmax(lm.model(torch.tensor([apple + [out.token_ids[0]]]), caches)[0, -1], -1)
    assert out.token_ids[1] != int(lp.argmax())  # the penalty moved the choice
    assert out.logprobs[1].logprob == pytest.approx(float(lp[out.token_ids[1]]), abs=1e-4)


def guided_greedy(model, ids: list[int], choices: tuple, stops: frozenset) -> list[int]:
    """The reference of guided_choice: each token the float64 argmax over the next tokens of the
    choices the answer still follows, and the stop ids once one is whole."""
    out: list[int] = []
    device = model.tok_embeddings.weight.device
    with torch.inference_mode():
        while not out or out[-1] not in stops:
            logits = model(torch.tensor([ids + out], device=device), model.make_caches(KVCacheConfig()))[0, -1]
            logits = logits.double().cpu()
            n = len(out)
            allow = {c[n] for c in choices if c[:n] == tuple(out) and len(c) > n}
            allow |= stops if tuple(out) in choices else set()
            out.append(max(allow, key=lambda t: float(logits[t])))
    return out


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_guided_choice_answers_one_of_the_choices(lm, async_scheduling) -> None:
    """Choices sharing a first token, one the prefix of another: the answer is a whole choice and
    a stop, the reference loop's tokens; a question whose free answer is no choice at all."""
    tok = lm.tokenizer
    engine = LLMEngine(lm.model, tok, EngineConfig(num_blocks=64, async_scheduling=async_scheduling))
    sky, france = chat(tok, "Is the sky blue? Answer yes or no."), chat(tok, "What is the capital of France?")
    asks = [(sky, ("yes", "no", "yes, it is")), (france, ("London", "Berlin", "Paris, France")),
            (sky, ("Blue", "Green"))]
    params = [RequestParams(max_tokens=16, guided_choice=tuple(tuple(tok.encode(c, add_bos=False)) for c in cs))
              for _, cs in asks]
    outs = engine.generate([ids for ids, _ in asks], params)
    free = engine.generate([france], RequestParams(max_tokens=16))[0].text
    assert free not in ("London", "Berlin", "Paris, France")  # (the constraint chose the answer)
    for (ids, cs), p, o in zip(asks, params, outs, strict=True):
        assert o.finish_reason == "stop" and o.text in cs, (o.text, cs)
        assert list(o.token_ids) == guided_greedy(lm.model, ids, p.guided_choice, engine.eos_ids)


_BANNED: dict = {}  # (bad words, allowed ids) -> the reference tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_allowed_ids_and_bad_words_give_the_reference_tokens(lm, async_scheduling) -> None:
    """One batch: a one-token bad word, a two-token one whose first token the plain answer
    repeats, both spellings of a word, and allowed ids; each row the reference loop's tokens."""
    tok = lm.tokenizer
    count = tok.encode("Count from one to twenty in words, separated by commas: one, two,")
    engine = LLMEngine(lm.model, tok, EngineConfig(num_blocks=32, async_scheduling=async_scheduling))
    (three,), (comma,), (five,), (six,) = (tok.encode(w) for w in (" three", ",", " five", " six"))
    words = [(), ((three,),), ((comma, five),), ((comma, five), (comma, six))]
    allowed = (three, comma, five, six, *engine.eos_ids)
    params = [RequestParams(max_tokens=12, ignore_eos=True, bad_words=w) for w in words]
    params.append(RequestParams(max_tokens=12, ignore_eos=True, allowed_token_ids=allowed, bad_words=((comma, five),)))
    got = [list(o.token_ids) for o in engine.generate([count] * len(params), params)]
    key = [(p.bad_words, p.allowed_token_ids) for p in params]
    for k in key:  # (the reference is the same for both engines)
        if k not in _BANNED:
            _BANNED[k] = penalised_greedy(lm.model, count, 12, bad_words=k[0], allowed=k[1])
    assert got == [_BANNED[k] for k in key]
    plain, no_three, no_five, neither, only = got
    assert three in plain and three not in no_three and (comma, five) in zip(plain, plain[1:])
    assert no_five != plain and not {(comma, five), (comma, six)} & set(zip(neither, neither[1:]))
    assert set(only) <= set(allowed) and (comma, five) not in zip(only, only[1:])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_min_tokens_holds_back_the_stops(lm, async_scheduling) -> None:
    tok = lm.tokenizer
    engine = LLMEngine(lm.model, tok, EngineConfig(num_blocks=32, async_scheduling=async_scheduling))
    ids = chat(tok, "What is 2+2?")
    plain, held = engine.generate([ids, ids], [RequestParams(max_tokens=40),
                                               RequestParams(max_tokens=40, min_tokens=24)])
    (eos,) = engine.eos_ids
    k = len(plain.token_ids) - 1  # plain ends with the end-of-sequence token, early
    assert plain.finish_reason == "stop" and plain.token_ids[-1] == eos and k < 24
    assert held.token_ids[:k] == plain.token_ids[:k] and eos not in held.token_ids[:24]
    assert len(held.token_ids) >= 24 and held.text.startswith(plain.text)
    with torch.inference_mode():  # where plain stopped, held takes the best token but the end
        logits = lm.model(torch.tensor([ids + list(plain.token_ids[:k])]),
                          lm.model.make_caches(KVCacheConfig()))[0, -1].clone()
        logits[eos] = float("-inf")
    assert held.token_ids[k] == int(logits.argmax())
    # a stop string found before min_tokens stays in the text; the next one ends it
    count = tok.encode("1, 2, 3, 4,")
    early, late = engine.generate([count, count], [RequestParams(max_tokens=12, stop=(",",)),
                                                   RequestParams(max_tokens=12, stop=(",",), min_tokens=4)])
    assert (early.text, early.finish_reason) == (" 5", "stop")
    assert (late.text, late.finish_reason) == (" 5, 6", "stop")
    kept = engine.generate([count], RequestParams(max_tokens=12, stop=(",",), include_stop_str_in_output=True))[0]
    assert (kept.text, kept.finish_reason) == (" 5,", "stop")  # vLLM's: the stop string stays at the end
    with pytest.raises(ValueError, match=r"min_tokens must be an int in \[0, max_tokens\], got 5"):
        RequestParams(max_tokens=4, min_tokens=5)


def prompt_reference(lm, ids: list[int]) -> torch.Tensor:
    """Log-probabilities ``[T, V]`` of the whole prompt's forward, in float64."""
    with torch.inference_mode():
        logits = lm.model(torch.tensor([ids]), lm.model.make_caches(KVCacheConfig()))[0]
    return torch.log_softmax(logits.double(), dim=-1)


def assert_prompt_logprobs(got, ids: list[int], want: torch.Tensor, top: int) -> None:
    """One entry a prompt token, ``None`` first; each the token's and its ``top`` best logprobs."""
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        assert got[i].token_id == ids[i]
        assert got[i].logprob == pytest.approx(float(want[i - 1, ids[i]]), abs=1e-4)
        assert [t for t, _ in got[i].top] == want[i - 1].topk(top).indices.tolist()
        assert [v for _, v in got[i].top] == pytest.approx(want[i - 1].topk(top).values.tolist(), abs=1e-4)


@pytest.mark.parametrize("mode", ["sync", "async", "packed"])
def test_prompt_logprobs_are_the_models_own(lm, mode) -> None:
    tok = lm.tokenizer
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 3)  # 31 tokens
    engine = LLMEngine(lm.model, tok, EngineConfig(num_blocks=64, max_batched_tokens=16, max_num_seqs=4,
                                                   async_scheduling=mode != "sync"))
    if mode == "packed":  # CUDA's ways: decode rows in the prompt chunks' forward, its LM head's rows padded
        engine.runner.decode_in_prompt_steps, engine.runner.logit_buckets = True, [1, 2, 4, 8]
    (plain,) = engine.generate([ids], RequestParams(max_tokens=3))  # its prefix cached
    asked, short, again = engine.generate([ids, ids[:7], ids], [
        RequestParams(max_tokens=3, prompt_logprobs=3), RequestParams(max_tokens=3, prompt_logprobs=0),
        RequestParams(max_tokens=3)])
    want = prompt_reference(lm, ids)
    assert_prompt_logprobs(asked.prompt_logprobs, ids, want, 3)  # chunked 16 tokens a step
    assert_prompt_logprobs(short.prompt_logprobs, ids[:7], prompt_reference(lm, ids[:7]), 0)
    # every position computed, not read from the cache; the tokens as without
    assert asked.cached_tokens == 0 and again.cached_tokens == 16 and again.prompt_logprobs is None
    assert asked.token_ids == again.token_ids == plain.token_ids and plain.prompt_logprobs is None
    # a step's prompt logits bounded in bytes: 256 MiB of float32 over this vocabulary
    assert engine.scheduler.config.max_prompt_logits == PROMPT_LOGITS_BYTES // (4 * 49152) == 1365
    with pytest.raises(ValueError, match=r"prompt_logprobs must be None or an int in \[0, 20\], got 21"):
        RequestParams(prompt_logprobs=21)


def test_prompt_logprobs_survive_a_preemption_half_way(lm) -> None:
    """The request is preempted after its first chunks and computes its prompt again: each
    prompt token's logprob comes once, equal to the model's."""
    tok = lm.tokenizer
    long_ids = tok.encode("Count the words: one two three four five six seven eight nine ten. " * 4)[:60]
    first = tok.encode("Write a story about a cat who lives in a big old house by the sea:")[:15]
    engine = LLMEngine(lm.model, tok, EngineConfig(num_blocks=5, max_batched_tokens=16, max_num_seqs=4))
    older, asked = engine.generate([first, long_ids], [RequestParams(max_tokens=40, ignore_eos=True),
                                                       RequestParams(max_tokens=3, prompt_logprobs=2)])
    assert engine.stats()["preemptions"] >= 1  # the older request's second block took the newer's
    assert_prompt_logprobs(asked.prompt_logprobs, long_ids, prompt_reference(lm, long_ids), 2)
    assert asked.token_ids == engine.generate([long_ids], RequestParams(max_tokens=3))[0].token_ids
    assert engine.stats()["free_blocks"] == 5


def test_bad_requests_are_refused_and_change_nothing(lm) -> None:
    tok = lm.tokenizer
    engine = LLMEngine(lm.model, tok, EngineConfig(num_blocks=8, max_waiting=1))  # 128 tokens
    assert engine.max_model_len == 128
    with pytest.raises(ValueError, match="context holds 128"):
        engine.add_request([1] * 128)
    with pytest.raises(ValueError, match="lower max_tokens to at most 28"):
        engine.add_request([1] * 100, RequestParams(max_tokens=29))
    with pytest.raises(ValueError, match=r"token ids in \[0, 49152\)"):
        engine.add_request([1, 49152])
    rid = engine.add_request([1, 2, 3], RequestParams(max_tokens=2))
    with pytest.raises(QueueFull):
        engine.add_request([1, 2, 3])
    assert engine.stats()["waiting"] == 1
    engine.step()
    assert engine.abort(rid) and not engine.has_unfinished()
    assert engine.stats()["free_blocks"] == 8


def test_a_refused_call_queues_nothing(lm, monkeypatch) -> None:
    """A request whose set-up fails after its checks, and a batch with one bad prompt, leave
    nothing queued: before, the orphan made every later step raise KeyError, or ran unseen."""
    engine = LLMEngine(lm.model, lm.tokenizer, EngineConfig(num_blocks=8))
    with monkeypatch.context() as m:
        def refuse(*args):
            raise RuntimeError("no generator on this device")
        m.setattr("kvtier.serve.engine.make_generator", refuse)
        with pytest.raises(RuntimeError, match="no generator"):
            engine.add_request([1, 2, 3])
    assert engine.stats()["waiting"] == 0 and not engine.has_unfinished()
    with pytest.raises(ValueError, match="non-empty list"):
        engine.generate([[1, 2, 3], [4, 5], []], RequestParams(max_tokens=4))
    assert engine.stats()["waiting"] == 0 and not engine.has_unfinished()
    (out,) = engine.generate([[1, 2, 3]], RequestParams(max_tokens=2))
    assert len(out.token_ids) == 2 and engine.stats()["generation_tokens"] == 2


@pytest.mark.parametrize("gib", [0, -1, float("inf"), float("nan"), True, "1"])
def test_kv_memory_must_be_a_positive_number(gib) -> None:
    with pytest.raises(ValueError, match=r"kv_memory_gib \(--kv-memory\) must be a number of GiB > 0"):
        EngineConfig(kv_memory_gib=gib)


def test_the_startup_heap_is_frozen_out_of_collections(lm) -> None:
    """After freeze_startup_heap a full collection walks none of the objects alive at start-up
    (the model's among them), and an engine still serves."""
    import gc

    from kvtier.serve.engine import freeze_startup_heap

    engine = LLMEngine(lm.model, lm.tokenizer, EngineConfig(num_blocks=32))
    try:
        freeze_startup_heap()
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # torch, the model, the engine: all of it
        assert not any(o is engine for o in gc.get_objects(generation=2))
        ids = lm.tokenizer.encode("The capital of France is")
        out = engine.generate([ids], RequestParams(max_tokens=3))[0]
        assert list(out.token_ids) == solo(lm, ids, 3)
    finally:
        gc.unfreeze()  # the rest of this test process collects as usual


def test_warm_up_runs_every_kind_of_step_and_leaves_the_engine_as_it_found_it() -> None:
    """A warm-up chunks a prompt over two steps, packs short prompts beside decode rows and
    reuses a cached prefix; afterwards the engine's stats are a fresh engine's and it serves
    the same tokens."""
    from kvtier.model import ModelArgs, build_random

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=300,
                     max_position_embeddings=512)
    model = build_random(args, dtype=torch.float32, device="cpu", std=0.2)
    config = EngineConfig(num_blocks=48, block_size=16, max_num_seqs=4, max_batched_tokens=64)
    warm, fresh = LLMEngine(model, None, config), LLMEngine(model, None, config)
    seen = {"rows": set(), "hits": None}
    execute = warm.runner.execute

    def spy(batch, pending=None):
        seen["rows"].add(tuple(sorted({len(r.token_ids) > 1 for r in batch.rows})))
        return execute(batch, pending)

    reset = warm.block_manager.reset_prefix_cache

    def spy_reset():
        seen["hits"] = warm.block_manager.prefix_hits
        return reset()

    warm.runner.execute, warm.block_manager.reset_prefix_cache = spy, spy_reset
    report = warm.warm_up()
    assert report["requests"] == 7 and report["prompt_tokens"] > 64 and report["steps"] > 4
    assert {(False,), (False, True)} <= seen["rows"]  # decode-only steps and mixed ones
    assert seen["hits"] >= 16  # the last request found its first block cached
    assert warm.stats() == fresh.stats()
    rng = random.Random(3)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (5, 70, 33)]
    params = RequestParams(max_tokens=6, ignore_eos=True)
    got = [o.token_ids for o in warm.generate(prompts, params)]
    assert got == [o.token_ids for o in fresh.generate(prompts, params)]
    steps = warm.stats()["steps"]
    warm.warm_up(new_tokens=2)  # after serving: its counters stand, its cached prefixes go
    assert warm.stats()["steps"] == steps and warm.stats()["cached_blocks"] == 0
    rid = warm.add_request([1, 2, 3], params)
    with pytest.raises(ValueError, match="warm_up\\(\\) runs before any request"):
        warm.warm_up()
    assert warm.has_unfinished() and warm.abort(rid)
    with pytest.raises(ValueError, match="new_tokens must be an int >= 1"):
        warm.warm_up(new_tokens=0)
    short = LLMEngine(model, None, EngineConfig(num_blocks=4, block_size=16, max_model_len=3))
    assert short.warm_up()["prompt_tokens"] == 1 and short.stats() == LLMEngine(
        model, None, EngineConfig(num_blocks=4, block_size=16, max_model_len=3)).stats()
    calls = []

    def failing(batch, pending=None):  # the third step fails: no made-up request is left behind
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a step failed")
        return execute(batch, pending)

    warm.runner.execute = failing
    with pytest.raises(RuntimeError, match="a step failed"):
        warm.warm_up()
    assert not warm.has_unfinished() and warm.stats()["free_blocks"] == 48


def test_ids_past_the_tokenizer_have_no_text_and_fail_nothing(lm) -> None:
    """A model whose vocabulary is padded past its tokenizer's (rows no text names) may sample
    a padded id: the request goes on, the id has no text, and its logprob entry is empty text
    (each raised before, failing every request of the step)."""
    from kvtier.model import ModelArgs, build_random
    from kvtier.serve.views import Completion

    tok = lm.tokenizer
    padded = tok.vocab_size + 128
    model = build_random(ModelArgs(dim=64, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=64, vocab_size=padded))
    engine = LLMEngine(model, tok, EngineConfig(num_blocks=32))
    ids = tok.encode("Hello")
    out = engine.generate([ids, ids], [RequestParams(max_tokens=3, logit_bias=((padded - 1, 100.0),), logprobs=1),
                                       RequestParams(max_tokens=3)])
    assert out[0].token_ids == (padded - 1,) * 3 and out[0].text == "" and out[0].finish_reason == "length"
    assert len(out[1].token_ids) == 3 and out[1].text == tok.decode(list(out[1].token_ids), skip_special_tokens=True)
    view = Completion(tok, "m", "x", chat=True)
    assert view.logprobs(list(out[0].logprobs), "")["content"][0]["token"] == ""
    with pytest.raises(ValueError, match="outside"):  # (the /detokenize route's 400 stays)
        tok.decode([padded - 1])
