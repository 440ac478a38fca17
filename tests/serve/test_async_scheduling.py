"""Asynchronous scheduling: the engine schedules and launches step N + 1 before step N's tokens
reach the host, feeding decode rows their tokens from the device. Every request must get what
the synchronous engine gives it (tokens, text, finish reason, logprobs, seeded samples), through
stops found one step late, preemption, prefix caching and aborts, and every block comes back."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.model import ModelArgs, build_random
from kvtier.sampling import SamplingParams
from kvtier.serve.engine import EngineConfig, LLMEngine
from kvtier.serve.params import RequestParams
from kvtier.serve.runner import PendingTokens, fill_pending
from kvtier.serve.scheduler import PENDING, ScheduledRow

ARGS = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=256, vocab_size=256,
                 max_position_embeddings=512)
CUDA = torch.cuda.is_available()


def tiny(device: str = "cpu"):
    return build_random(ARGS, dtype=torch.float32, device=device, std=0.3)


MODEL = tiny()  # the CPU model every example of the random workloads shares


def workload(seed: int = 0, n: int = 14):
    """Prompts sharing a 40-token prefix or not, and params that stop by length, by stop
    token (a common id of this random model: some rows stop early), sample with a seed or
    ask for logprobs; penalties on the stopping rows (whose counts the asynchronous engine
    keeps on the device, a step ahead of the host)."""
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(40)]
    out = []
    for i in range(n):
        tail = [rng.randrange(256) for _ in range(rng.randint(1, 60))]
        ids = shared + tail if i % 3 == 0 else tail
        kind = i % 4
        if kind == 0:
            p = RequestParams(max_tokens=rng.randint(1, 30))
        elif kind == 1:
            p = RequestParams(max_tokens=30, stop_token_ids=tuple(rng.sample(range(256), 40)),
                              frequency_penalty=0.7)
        elif kind == 2:
            p = RequestParams(max_tokens=20, sampling=SamplingParams(temperature=0.8, top_k=50, seed=i))
        else:
            p = RequestParams(max_tokens=12, logprobs=3, stop_token_ids=tuple(rng.sample(range(256), 20)),
                              presence_penalty=0.5, repetition_penalty=1.2)
        out.append((ids, p))
    return out


def drive(engine: LLMEngine, arrivals: dict[int, list], abort_at: dict[int, int] | None = None):
    """Step ``engine``, adding ``arrivals[step]`` before that step and aborting the
    ``abort_at[step]``-th request added; outputs per request in order (token ids, text,
    finish reason, logprobs)."""
    got: dict[str, list] = {}
    order: list[str] = []
    step = 0
    while engine.has_unfinished() or any(k >= step for k in arrivals):
        for ids, params in arrivals.get(step, []):
            rid = engine.add_request(ids, params)
            order.append(rid)
            got[rid] = []
        if abort_at and step in abort_at:
            engine.abort(order[abort_at[step]])
        for out in engine.step():
            got[out.request_id].append(out)
        step += 1
        assert step < 1000
    return {rid: [(o.token_ids, o.text, o.finish_reason,
                   None if o.logprobs is None else [(lp.token_id, round(lp.logprob, 4),
                                                     [(t, round(v, 4)) for t, v in lp.top])
                                                    for lp in o.logprobs]) for o in got[rid]]
            for rid in order}


def both(model, config: EngineConfig, arrivals, abort_at=None, decode_in_prompt_steps=None):
    """The same run through the synchronous and the asynchronous engine (``decode_in_prompt_steps``:
    the runners' choice, ``None`` the device's default)."""
    runs = {}
    for mode in (False, True):
        engine = LLMEngine(model, None, EngineConfig(**{**config.__dict__, "async_scheduling": mode}))
        assert engine.async_scheduling is mode
        if decode_in_prompt_steps is not None:
            engine.runner.decode_in_prompt_steps = decode_in_prompt_steps
        start = engine.stats()["free_blocks"]
        runs[mode] = drive(engine, arrivals, abort_at)
        s = engine.stats()
        assert s["running"] == s["waiting"] == 0 and not engine.has_unfinished()
        assert s["free_blocks"] == start, f"blocks leaked with async_scheduling={mode}"
        runs[mode, "stats"] = s
    return runs


def test_async_gives_the_synchronous_outputs_of_a_mixed_workload() -> None:
    reqs = workload()
    runs = both(tiny(), EngineConfig(num_blocks=64, max_num_seqs=6, max_batched_tokens=48),
                {0: reqs[:6], 2: reqs[6:9], 5: reqs[9:]})
    assert runs[True] == runs[False]
    reasons = [outs[-1][2] for outs in runs[True].values()]
    assert "stop" in reasons and "length" in reasons  # rows stopped by token, one step late
    assert runs[True, "stats"]["prefix_hits"] > 0
    assert runs[True, "stats"]["generation_tokens"] == runs[False, "stats"]["generation_tokens"]


def test_async_with_preemption_gives_the_synchronous_outputs() -> None:
    reqs = [(ids, RequestParams(max_tokens=40)) for ids, _ in workload(1, 8)]
    need = sum(len(ids) + 40 for ids, _ in reqs) // 16
    runs = both(tiny(), EngineConfig(num_blocks=need // 2, max_batched_tokens=64, enable_prefix_caching=False),
                {0: reqs})
    assert runs[True, "stats"]["preemptions"] > 0
    assert runs[True] == runs[False]


def test_async_abort_of_a_request_in_flight() -> None:
    reqs = [(ids, RequestParams(max_tokens=25)) for ids, _ in workload(2, 6)]
    runs = both(tiny(), EngineConfig(num_blocks=64), {0: reqs}, abort_at={4: 1, 9: 3})
    ids = list(runs[True])
    for i, rid in enumerate(ids):
        sync, lagged = runs[False][rid], runs[True][rid]
        if i in (1, 3):  # aborted: the token of the step in flight is dropped with the request
            assert lagged == sync[:-1] and len(sync) > 1 and sync[-1][2] is None
        else:
            assert lagged == sync


def test_outputs_come_one_step_later_and_the_last_with_an_empty_schedule() -> None:
    engine = LLMEngine(tiny(), None, EngineConfig(num_blocks=16, async_scheduling=True))
    engine.add_request([1, 2, 3], RequestParams(max_tokens=2))
    assert engine.step() == []  # the prompt's step is in flight
    first = engine.step()  # its token; the decode step is in flight
    assert [len(o.token_ids) for o in first] == [1] and first[0].finish_reason is None
    assert engine.has_unfinished() and engine.scheduler.num_running == 0  # finished by length, in flight
    last = engine.step()
    assert last[0].finish_reason == "length" and not engine.has_unfinished()
    assert engine.stats()["free_blocks"] == 16


def test_pending_tokens_are_filled_on_the_device() -> None:
    pending = PendingTokens(torch.tensor([11, 22, 33]), {"a": 2, "b": 0})
    rows = [ScheduledRow("b", (PENDING,), 4, (1,), True), ScheduledRow("c", (7,), 2, (2,), True),
            ScheduledRow("a", (PENDING,), 9, (3,), True)]
    codes = pending.codes(rows)
    assert codes == [-1, 7, -3]
    assert fill_pending(torch.tensor(codes), pending).tolist() == [11, 7, 33]
    assert fill_pending(torch.tensor([5, 6]), None).tolist() == [5, 6]
    with pytest.raises(KeyError):
        pending.codes([ScheduledRow("z", (PENDING,), 0, (1,), True)])


def test_a_pending_token_without_its_step_is_refused() -> None:
    engine = LLMEngine(tiny(), None, EngineConfig(num_blocks=16))
    from kvtier.serve.scheduler import StepBatch

    batch = StepBatch((ScheduledRow("x", (PENDING,), 0, (0,), True),))
    with pytest.raises(ValueError, match="no PendingTokens"):
        engine.runner.execute(batch)
    with pytest.raises(ValueError, match="only decode rows"):
        engine.runner.execute(StepBatch((ScheduledRow("x", (3, PENDING), 0, (0,), True),)))


def test_pending_tokens_of_a_step_that_sampled_nothing_are_not_read() -> None:
    """A step in flight that sampled no row (only mid-prompt chunks) leaves an empty token
    tensor; decode rows whose tokens are all on the host must not index it."""
    engine = LLMEngine(tiny(), None, EngineConfig(num_blocks=16))
    from kvtier.serve.scheduler import StepBatch

    rows = (ScheduledRow("x", (5,), 0, (0,), True), ScheduledRow("y", (6,), 0, (1,), True))
    empty = PendingTokens(torch.empty(0, dtype=torch.long), {})
    with torch.inference_mode():
        got = engine.runner.execute(StepBatch(rows), empty)
    fresh = LLMEngine(tiny(), None, EngineConfig(num_blocks=16))
    with torch.inference_mode():
        torch.testing.assert_close(got, fresh.runner.execute(StepBatch(rows)))


def test_config_refuses_a_non_bool() -> None:
    with pytest.raises(ValueError, match="async_scheduling must be a bool or None"):
        EngineConfig(async_scheduling="yes")
    assert LLMEngine(tiny(), None, EngineConfig(num_blocks=8)).async_scheduling is False  # CPU default


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_async_gives_the_synchronous_outputs(graphs) -> None:
    # no stop tokens: a row that stops runs one wasted step with async scheduling, and on the
    # GPU another batch size may round the other rows' matmuls differently; by length alone
    # both engines run the very same batches (stops are compared on the CPU above)
    reqs = [(ids, replace(p, stop_token_ids=())) for ids, p in workload(3, 20)]
    config = EngineConfig(num_blocks=64, max_num_seqs=8, max_batched_tokens=64, cuda_graph=graphs)
    runs = both(tiny("cuda"), config, {0: reqs[:10], 3: reqs[10:]})
    assert runs[True] == runs[False]
    assert LLMEngine(tiny("cuda"), None, EngineConfig(num_blocks=8)).async_scheduling is True  # CUDA default


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_penalties_give_the_reference_tokens(graphs) -> None:
    """Eight rows of one batch, each its own penalties and bias, scheduled asynchronously on
    CUDA (the counts and the bias on the device, with and without CUDA graphs): the tokens of
    the float64 reference loop of tests/serve/test_engine.py on the same model."""
    from test_engine import penalised_greedy

    model = tiny("cuda")
    rng = random.Random(1)
    kinds = [(0.0, 0.0, 1.0), (0.0, 1.5, 1.0), (1.5, 0.0, 1.0), (0.8, 0.8, 1.5), (0.0, 0.0, 2.0),
             (0.0, 2.0, 1.0), (0.0, 0.0, 1.0, ((7, -100.0), (9, 5.0))), (0.0, 0.5, 1.2, ((3, 3.0),))]
    rows = [([rng.randrange(256) for _ in range(rng.randint(3, 40))], k) for k in kinds]
    params = [RequestParams(max_tokens=16, presence_penalty=k[0], frequency_penalty=k[1],
                            repetition_penalty=k[2], logit_bias=k[3] if len(k) > 3 else ())
              for _, k in rows]
    engine = LLMEngine(model, None, EngineConfig(num_blocks=64, cuda_graph=graphs))
    assert engine.async_scheduling
    got = [list(o.token_ids) for o in engine.generate([ids for ids, _ in rows], params)]
    assert got == [penalised_greedy(model, ids, 16, *k) for ids, k in rows]
    unpenalised = [list(o.token_ids) for o in engine.generate([ids for ids, _ in rows], RequestParams(max_tokens=16))]
    assert got[0] == unpenalised[0] and sum(g != u for g, u in zip(got, unpenalised)) >= 5  # most moved


_DEVICE_GRAPHS = [("cpu", False), pytest.param("cuda", True, marks=[pytest.mark.gpu, pytest.mark.skipif(
    not CUDA, reason="needs CUDA")]), pytest.param("cuda", False, marks=[pytest.mark.gpu, pytest.mark.skipif(
        not CUDA, reason="needs CUDA")])]


@pytest.mark.parametrize("device,graphs", _DEVICE_GRAPHS)
def test_async_bans_give_the_reference_tokens(device, graphs) -> None:
    """Bad words of one and two tokens taken from each row's own plain answer, and allowed ids,
    scheduled asynchronously (each request's last tokens shifted in on the device, a step
    ahead of the host): the reference loop's tokens, and every banned pair gone."""
    from test_engine import guided_greedy, penalised_greedy

    model = tiny(device)
    rng = random.Random(4)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 30))] for _ in range(6)]
    engine = LLMEngine(model, None, EngineConfig(num_blocks=64, cuda_graph=graphs, async_scheduling=True))
    plain = [list(o.token_ids) for o in engine.generate(prompts, RequestParams(max_tokens=12))]
    params = []
    for i, out in enumerate(plain):  # a pair of the plain answer, its first token, or allowed ids
        words = ((out[3], out[4]), (out[1], out[2])) if i % 3 == 0 else ((out[0],),) if i % 3 == 1 else ()
        allowed = tuple(sorted(set(out[:6]) | {7, 9})) if i % 3 == 2 else ()
        params.append(RequestParams(max_tokens=12, bad_words=words, allowed_token_ids=allowed))
    got = [list(o.token_ids) for o in engine.generate(prompts, params)]
    for ids, p, g, out in zip(prompts, params, got, plain, strict=True):
        assert g == penalised_greedy(model, ids, 12, bad_words=p.bad_words, allowed=p.allowed_token_ids)
        assert g != out and not {w for w in p.bad_words if len(w) == 2} & set(zip(g, g[1:]))
        assert not p.allowed_token_ids or set(g) <= set(p.allowed_token_ids)
    # guided choices (stop id 200): pieces of the last plain answer, two sharing a first token
    last = plain[-1]
    choices = ((last[1], last[2], last[3]), (last[1], last[5]), (last[0],))
    guided = RequestParams(max_tokens=12, stop_token_ids=(200,), guided_choice=choices)
    for ids, o in zip(prompts, engine.generate(prompts, guided), strict=True):
        assert o.finish_reason == "stop" and tuple(o.token_ids[:-1]) in choices
        assert list(o.token_ids) == guided_greedy(model, ids, choices, frozenset({200}))


def check_prompt_logprobs(device: str) -> None:
    """Prompts of 500, 40 and 3 tokens asking for prompt logprobs: each entry the whole
    prompt's forward's, however the engine chunked and packed them."""
    from kvtier.config import KVCacheConfig

    model = tiny(device)
    rng = random.Random(2)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (500, 40, 3)]
    tops = (5, 0, 20)
    engine = LLMEngine(model, None, EngineConfig(num_blocks=128, max_num_seqs=8, max_batched_tokens=256))
    outs = engine.generate(prompts, [RequestParams(max_tokens=4, prompt_logprobs=k) for k in tops])
    for ids, out, k in zip(prompts, outs, tops, strict=True):
        with torch.inference_mode():
            logits = model(torch.tensor([ids], device=device), model.make_caches(KVCacheConfig()))[0]
        want = torch.log_softmax(logits.double(), dim=-1).cpu()
        got = out.prompt_logprobs
        assert len(got) == len(ids) and got[0] is None and out.cached_tokens == 0
        assert [g.token_id for g in got[1:]] == ids[1:]
        assert [g.logprob for g in got[1:]] == pytest.approx(want[range(len(ids) - 1), ids[1:]].tolist(), abs=2e-3)
        for i in range(1, len(ids)):
            assert [t for t, _ in got[i].top] == want[i - 1].topk(k).indices.tolist()


def test_prompt_logprobs_of_chunked_and_packed_prompts() -> None:
    check_prompt_logprobs("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_prompt_logprobs_of_chunked_and_packed_prompts() -> None:
    check_prompt_logprobs("cuda")  # asynchronous, CUDA graphs, packed steps, padded LM-head rows


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_workloads_give_the_synchronous_outputs(data) -> None:
    random_workload(data, None)


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_random_workloads_with_decode_rows_in_prompt_steps(data) -> None:
    """The same with decode rows in the prompt chunks' forward (the CUDA default), whose
    pending tokens are filled in inside the packed tokens."""
    random_workload(data, True)


def random_workload(data, decode_in_prompt_steps) -> None:
    """Random arrivals, lengths, stop tokens, seeds, aborts and pool sizes (down to one that
    preempts): every request's outputs equal the synchronous engine's and every block comes
    back. An aborted request's outputs are those of the synchronous engine up to the abort,
    which may come a step or two earlier in its life: outputs lag a step, and a row that
    stops holds its seat for one more step, which can delay an admission by one."""
    rng = random.Random(data.draw(st.integers(0, 10**6), label="seed"))
    n = data.draw(st.integers(2, 7), label="requests")
    shared = [rng.randrange(256) for _ in range(rng.choice([0, 16, 32]))]
    arrivals: dict[int, list] = {}
    for i in range(n):
        ids = shared + [rng.randrange(256) for _ in range(rng.randint(1, 32))]  # + 30 new: 6 blocks
        stops = tuple(rng.sample(range(256), rng.choice([0, 5, 30])))
        sampling = SamplingParams(temperature=0.7, seed=i) if rng.random() < 0.3 else SamplingParams()
        params = RequestParams(max_tokens=rng.randint(1, 30), stop_token_ids=stops, sampling=sampling)
        arrivals.setdefault(rng.randint(0, 3), []).append((ids, params))
    aborts = {rng.randint(1, 12): rng.randrange(n) for _ in range(data.draw(st.integers(0, 2), label="aborts"))}
    # an abort names the k-th request added; only those added by then can be aborted
    order = [k for step in sorted(arrivals) for k in [step] * len(arrivals[step])]
    aborts = {s: k for s, k in aborts.items() if order[k] < s}
    blocks = data.draw(st.sampled_from([6, 7, 64]), label="blocks")  # 6 or 7: preemption likely
    config = EngineConfig(num_blocks=blocks, max_num_seqs=rng.randint(1, 4),
                          max_batched_tokens=rng.choice([8, 24, 64]))
    runs = both(MODEL, config, arrivals, aborts, decode_in_prompt_steps)
    aborted = {list(runs[False])[k] for k in aborts.values()}
    for rid, sync in runs[False].items():
        lagged = runs[True][rid]
        if rid in aborted:
            n = min(len(lagged), len(sync))
            assert lagged[:n] == sync[:n], rid
        else:
            assert lagged == sync, rid


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_rows_in_prompt_steps_give_the_same_outputs(async_scheduling) -> None:
    """Decode rows run in the prompt chunks' packed forward (the CUDA default), fed pending
    tokens under asynchronous scheduling: every output equals the engine's with their own
    forward (logprobs to float32 rounding: one matmul of N rows rounds as N of 1 may not)."""
    reqs = workload(4)
    arrivals = {0: reqs[:5], 3: reqs[5:10], 6: reqs[10:]}
    runs = []
    for merged in (False, True):
        engine = LLMEngine(MODEL, None, EngineConfig(num_blocks=64, max_num_seqs=6, max_batched_tokens=40,
                                                     async_scheduling=async_scheduling))
        engine.runner.decode_in_prompt_steps = merged
        runs.append(drive(engine, arrivals))
        assert engine.stats()["free_blocks"] == 64
    assert list(runs[0]) == list(runs[1])
    for rid, outs in runs[0].items():
        assert [o[:3] for o in outs] == [o[:3] for o in runs[1][rid]], rid  # tokens, text, finish
        for a, b in zip(outs, runs[1][rid]):
            if a[3] is not None:
                assert [(t, [i for i, _ in top]) for t, _, top in a[3]] == [(t, [i for i, _ in top]) for t, _, top in b[3]]
                torch.testing.assert_close(torch.tensor([[v, *(x for _, x in top)] for _, v, top in a[3]]),
                                           torch.tensor([[v, *(x for _, x in top)] for _, v, top in b[3]]),
                                           rtol=0, atol=2e-4)
    assert sum(o[3] is not None for outs in runs[0].values() for o in outs) > 0  # logprobs compared


def test_step_budget_defaults_to_the_device_s() -> None:
    """No max_batched_tokens: 2048 tokens a step on the CPU (8192 on CUDA), never below
    max_num_seqs (a decode step must fit every running row); a given budget is kept."""
    from kvtier.serve.engine import DEFAULT_BATCHED_TOKENS

    def budget(**kw) -> int:
        return LLMEngine(MODEL, None, EngineConfig(num_blocks=8, **kw)).scheduler.config.max_batched_tokens

    assert DEFAULT_BATCHED_TOKENS == {"cpu": 2048, "cuda": 8192}
    assert EngineConfig().max_batched_tokens is None and budget() == 2048
    assert budget(max_num_seqs=3000) == 3000
    assert budget(max_batched_tokens=48, max_num_seqs=4) == 48
    with pytest.raises(ValueError, match="max_batched_tokens 48 is below max_num_seqs"):
        budget(max_batched_tokens=48, max_num_seqs=64)
    if CUDA:
        cuda = LLMEngine(tiny("cuda"), None, EngineConfig(num_blocks=8))
        assert cuda.scheduler.config.max_batched_tokens == 8192
