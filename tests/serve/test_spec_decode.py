"""Speculative decoding in the serving engine (kvtier.serve.speculate): a greedy request that
feeds drafts gets the tokens, text, finish reason and logprobs the engine gives it without drafts,
whatever the drafts are (the model's own next tokens, wrong ones, tokens past a stop), through
stops, preemption and prefix caching; a sampling one tokens of the same distribution; every block
comes back, and the prefix cache hashes only the tokens kept."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import cli
from kvtier.drafters import NgramDrafter
from kvtier.model import ModelArgs, build_random
from kvtier.sampling import SamplingParams
from kvtier.serve.engine import EngineConfig, LLMEngine
from kvtier.serve.metrics import ServerMetrics
from kvtier.serve.params import RequestParams
from kvtier.serve.prefix import BlockManager
from kvtier.serve.scheduler import Request, Scheduler, SchedulerConfig
from kvtier.serve.speculate import NgramIndex, SpeculativeConfig, Speculator

ARGS = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=256, vocab_size=256,
                 max_position_embeddings=512)
MODEL = build_random(ARGS, dtype=torch.float32, std=0.3)
SPEC = SpeculativeConfig(num_speculative_tokens=5)


def run(engine: LLMEngine, arrivals: dict[int, list]) -> dict[str, tuple]:
    """Step ``engine``, adding ``arrivals[step]`` before that step; per request (in order of
    arrival) its tokens, text, last finish reason and completion count."""
    got: dict[str, list] = {}
    step = 0
    while engine.has_unfinished() or any(k >= step for k in arrivals):
        for ids, params in arrivals.get(step, []):
            got[engine.add_request(ids, params)] = []
        for out in engine.step():
            got[out.request_id].append(out)
        step += 1
        assert step < 1000
    return {rid: (sum((o.token_ids for o in outs), ()), "".join(o.text for o in outs), outs[-1].finish_reason,
                  outs[-1].completion_tokens, [lp.token_id for o in outs for lp in o.logprobs or ()],
                  [x for o in outs for lp in o.logprobs or () for x in (lp.logprob, *(v for _, v in lp.top))])
            for rid, outs in got.items()}


def assert_same(drafted: dict, plain: dict) -> None:
    """The same outputs; logprobs within float32 rounding (a drafted position's logits come
    from the packed forward, a decoded one's from the decode forward)."""
    assert {r: v[:5] for r, v in drafted.items()} == {r: v[:5] for r, v in plain.items()}
    for rid, v in plain.items():
        assert drafted[rid][5] == pytest.approx(v[5], abs=1e-4), rid


def plain_and_drafted(model, tokenizer, config: EngineConfig, arrivals, drafts=None):
    """The same run without drafts and with them; ``drafts(plain_outputs, rng)`` gives the
    drafter (``None``: the n-gram lookup). Both leave every block free."""
    runs, engines = [], []
    for spec in (None, SPEC):
        engine = LLMEngine(model, tokenizer, EngineConfig(**{**config.__dict__, "speculative": spec}))
        assert spec is None or not engine.async_scheduling  # (the plain one: on CUDA, asynchronous)
        if spec is not None and drafts is not None:
            engine.speculator.propose = drafts(runs[0])
        start = engine.stats()["free_blocks"]
        runs.append(run(engine, arrivals))
        s = engine.stats()
        assert s["running"] == s["waiting"] == 0 and s["free_blocks"] == start
        engines.append(engine)
    return runs, engines


def oracle(rng: random.Random, arrivals):
    """Drafts from the plain run's tokens: right, cut short, one token wrong, or running past the
    request's end into made-up tokens."""
    prompts = [ids for step in sorted(arrivals) for ids, _ in arrivals[step]]

    def make(plain):
        truth = {rid: list(ids) + list(out[0]) for (rid, out), ids in zip(plain.items(), prompts)}

        def propose(live, k, running=1):
            request = live.request
            full = truth[request.request_id]
            at = len(request.token_ids)
            assert request.token_ids == full[:at], "a drafted request left the plain run's tokens"
            d = full[at : at + rng.randint(0, k)]
            d += [rng.randrange(ARGS.vocab_size) for _ in range(rng.randint(0, k - len(d)))]
            if d and rng.random() < 0.3:
                d[rng.randrange(len(d))] = rng.randrange(ARGS.vocab_size)
            return d

        return propose

    return make


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_random_workloads_with_drafts_give_the_plain_outputs(data) -> None:
    """Random arrivals, stop ids, seeds, logprobs and pool sizes (down to one that preempts),
    greedy rows fed drafts that are right, wrong or past their end: every request's tokens,
    finish reason and count are the plain engine's."""
    rng = random.Random(data.draw(st.integers(0, 10**6), label="seed"))
    n = data.draw(st.integers(2, 6), label="requests")
    shared = [rng.randrange(256) for _ in range(rng.choice([0, 16, 32]))]
    arrivals: dict[int, list] = {}
    for i in range(n):
        ids = shared + [rng.randrange(256) for _ in range(rng.randint(1, 32))]
        stops = tuple(rng.sample(range(256), rng.choice([0, 5, 30])))
        kind = rng.random()
        # (top_k 1: a sampling row through rejection sampling, whose tokens are then the greedy ones)
        sampling = SamplingParams(temperature=0.7, top_k=1, seed=i) if kind < 0.2 else SamplingParams()
        params = RequestParams(max_tokens=rng.randint(1, 30), stop_token_ids=stops, sampling=sampling,
                               logprobs=2 if 0.2 <= kind < 0.3 else None)
        arrivals.setdefault(rng.randint(0, 3), []).append((ids, params))
    blocks = data.draw(st.sampled_from([6, 7, 64]), label="blocks")  # 6 or 7: preemption likely
    config = EngineConfig(num_blocks=blocks, max_num_seqs=rng.randint(1, 4),
                          max_batched_tokens=rng.choice([8, 24, 64]))
    (plain, drafted), (_, engine) = plain_and_drafted(MODEL, None, config, arrivals, oracle(rng, arrivals))
    assert_same(drafted, plain)
    s = engine.stats()
    assert s["spec_accepted_tokens"] <= s["spec_draft_tokens"]


def test_sampled_rows_draft_and_keep_the_distribution_of_plain_sampling() -> None:
    """Rejection sampling of the drafts: 600 seeded requests of one prompt (temperature 1.5, top 3),
    each offered the plain run's most frequent second token as a draft, give the joint
    distribution of their first two tokens that 600 plain requests give (total variation 0.055
    here, 0.12 allowed; keeping every draft gave 0.43), with drafts both kept and rejected; the
    same seeds give the same tokens again."""
    prompt = [5, 17, 99, 3]
    params = [RequestParams(max_tokens=3, sampling=SamplingParams(temperature=1.5, top_k=3, seed=i)) for i in range(600)]
    arrivals = {0: [(prompt, p) for p in params]}
    config = EngineConfig(num_blocks=700, max_num_seqs=600, max_batched_tokens=4096, max_waiting=600)
    seconds: dict[int, dict[int, int]] = {}

    def offer(plain):
        for out in plain.values():
            seconds.setdefault(out[0][0], {}).setdefault(out[0][1], 0)
            seconds[out[0][0]][out[0][1]] += 1
        best = {first: max(counts, key=counts.get) for first, counts in seconds.items()}
        return lambda live, k, running=1: [best[live.request.token_ids[-1]]] if len(live.request.token_ids) == 5 else []

    (plain, drafted), (_, engine) = plain_and_drafted(MODEL, None, config, arrivals, offer)
    s = engine.stats()
    assert 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"] == 600, s

    def joint(run):
        freq: dict[tuple[int, int], float] = {}
        for out in run.values():
            freq[out[0][:2]] = freq.get(out[0][:2], 0) + 1 / len(run)
        return freq

    a, b = joint(plain), joint(drafted)
    assert 0.5 * sum(abs(a.get(k, 0) - b.get(k, 0)) for k in a.keys() | b.keys()) <= 0.12, (a, b)
    (_, again), _ = plain_and_drafted(MODEL, None, config, arrivals, offer)
    assert again == drafted


def test_drafts_fill_steps_and_keep_the_plain_tokens() -> None:
    """Right drafts: a greedy request of 40 tokens takes far fewer steps, every draft kept."""
    ids = list(range(10, 30))
    arrivals = {0: [(ids, RequestParams(max_tokens=40))]}

    def exact(plain):
        out = list(next(iter(plain.values()))[0])
        return lambda live, k, running=1: (ids + out)[len(live.request.token_ids) : len(live.request.token_ids) + k]

    (plain, drafted), (slow, fast) = plain_and_drafted(MODEL, None, EngineConfig(num_blocks=32), arrivals, exact)
    assert_same(drafted, plain)
    s = fast.stats()
    assert s["spec_accepted_tokens"] == s["spec_draft_tokens"] > 0 and s["spec_acceptance_rate"] == 1.0
    assert fast.steps <= slow.steps // 4  # 5 drafts + 1 a step after the prompt's
    assert s["generation_tokens"] == slow.stats()["generation_tokens"] == 40


def test_drafts_a_stop_cuts_off_are_not_counted_as_kept() -> None:
    """A stop inside a step's kept drafts: the drafts after it are not counted (they were, so
    kvtier_spec_decode_num_accepted_tokens passed the tokens generated)."""
    ids = list(range(10, 30))
    plain = run(LLMEngine(MODEL, None, EngineConfig(num_blocks=32)), {0: [(ids, RequestParams(max_tokens=40))]})
    out = list(next(iter(plain.values()))[0])
    at = next(i for i in range(7, len(out)) if out[i] not in out[:i])  # (the first stop of this id)

    def exact(_plain):
        return lambda live, k, running=1: (ids + out)[len(live.request.token_ids) : len(live.request.token_ids) + k]

    arrivals = {0: [(ids, RequestParams(max_tokens=40, stop_token_ids=(out[at],)))]}
    (_, drafted), (_, fast) = plain_and_drafted(MODEL, None, EngineConfig(num_blocks=32), arrivals, exact)
    s = fast.stats()
    assert list(next(iter(drafted.values()))[0]) == out[: at + 1]
    assert 0 < s["spec_accepted_tokens"] < s["generation_tokens"] == at + 1, s


def test_the_default_model_with_ngram_drafts(lm) -> None:
    """SmolLM2 copying text: the n-gram drafts are kept often; tokens, text and finish reason
    (a stop string found inside a run of kept drafts, an end-of-sequence) are the plain engine's,
    and a row that asks for logprobs, and one that samples from its top token alone (rejection
    sampling, whose tokens are then the greedy ones), get theirs too."""
    tok = lm.tokenizer
    text = ("def area(width, height):\n    return width * height\n\n"
            "def volume(width, height, depth):\n    return area(width, height) * depth\n")
    copy = tok.encode(f"Copy this code exactly.\n\n{text}\nCopy:\n{text[:40]}")
    fact = tok.encode("The capital of France is")
    arrivals = {0: [(copy, RequestParams(max_tokens=60)), (fact, RequestParams(max_tokens=12)),
                    (copy, RequestParams(max_tokens=60, stop=("depth)",))),
                    (copy, RequestParams(max_tokens=20, logprobs=1)),
                    (fact, RequestParams(max_tokens=12, sampling=SamplingParams(temperature=0.8, top_k=1, seed=3)))],
                2: [(copy, RequestParams(max_tokens=30))]}
    (plain, drafted), (slow, fast) = plain_and_drafted(lm.model, tok, EngineConfig(num_blocks=256), arrivals)
    assert_same(drafted, plain)
    reasons = [r[2] for r in plain.values()]
    assert reasons[2] == "stop" and "depth)" not in plain[list(plain)[2]][1]
    s = fast.stats()
    assert s["spec_accepted_tokens"] > 20 and fast.steps < slow.steps, s
    assert len(drafted[list(drafted)[3]][4]) == 20  # the logprobs row: a logprob for each of its tokens


def test_the_prefix_cache_hashes_only_kept_tokens() -> None:
    """A row's drafts fill its block, none is kept: the block is not cached, and a request whose
    prompt holds those drafts finds only the kept tokens' blocks."""
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_model_len=64, max_num_seqs=4, max_batched_tokens=32), bm)
    req = Request("a", [1, 2, 3, 4, 5, 6], max_tokens=20)
    sched.add(req)
    sched.update(sched.schedule(), {"a": 7})  # the prompt: one full block cached; token 7 next
    assert req.token_ids == [1, 2, 3, 4, 5, 6, 7] and req.num_computed == 6
    batch = sched.schedule(lambda r, k: [8, 9, 10, 11])
    (row,) = batch.rows
    assert row.token_ids == (7, 8, 9, 10, 11) and row.draft == 4 and row.start == 6
    sched.update(batch, {"a": (12,)})  # the model wanted 12 after 7: no draft kept
    assert req.token_ids == [1, 2, 3, 4, 5, 6, 7, 12] and req.num_computed == 7
    assert bm.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]) == bm.match_prefix([1, 2, 3, 4])
    batch = sched.schedule(lambda r, k: [13, 14])
    sched.update(batch, {"a": (13, 14, 15)})  # both kept
    assert req.token_ids[-4:] == [12, 13, 14, 15] and req.num_computed == 10
    assert len(bm.match_prefix([1, 2, 3, 4, 5, 6, 7, 12, 13])) == 2  # the second block, kept tokens only


@pytest.mark.parametrize("num_blocks", [6, 12])
def test_drafts_stay_within_max_tokens_budget_and_free_blocks(num_blocks) -> None:
    """Asked for at most ``max_tokens - out - 1`` (the token after them counts) and what the
    step's budget leaves; cut to the room of the request's blocks, fresh blocks taken only while
    more stay free than requests run; never a preemption."""
    bm = BlockManager(num_blocks, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_model_len=24, max_num_seqs=4, max_batched_tokens=16), bm)
    sched.add(Request("a", [1, 2, 3], max_tokens=5))
    sched.add(Request("b", list(range(10, 19)), max_tokens=15))
    sched.update(sched.schedule(), {"a": 4, "b": 30})  # a: 4 tokens in 1 block, b: 10 in 3
    asked = []

    def drafts(req, k):
        asked.append((req.request_id, k))
        return list(range(100, 100 + k + 3))  # more than asked: cut to k

    batch = sched.schedule(drafts)
    rows = {r.request_id: r for r in batch.rows}
    assert not batch.preempted and batch.num_tokens <= 16
    if num_blocks == 6:  # 2 free for 2 running: no fresh block; a's block is full, b's has 2 slots
        assert asked == [("a", 3), ("b", 13)]
        assert rows["a"].token_ids == (4,) and rows["b"].token_ids == (30, 100, 101)
        assert bm.num_free_blocks == 2
    else:  # a takes a block for its 3 drafts; b what the budget leaves, 11, in 3 more blocks
        assert asked == [("a", 3), ("b", 16 - 2 - 3)]
        assert rows["a"].token_ids == (4, 100, 101, 102) and rows["b"].draft == 11
        assert bm.num_free_blocks == 12 - 2 - 6
    for r in batch.rows:
        assert r.sample and len(r.token_ids) == r.draft + 1 and len(r.blocks) * 4 >= r.start + len(r.token_ids)


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=80), grows=st.lists(st.integers(1, 6), max_size=30),
       ngram=st.tuples(st.integers(1, 3), st.integers(0, 3)), k=st.integers(1, 8))
def test_the_ngram_index_looks_up_what_the_drafter_scans(tokens, grows, ngram, k) -> None:
    """Kept as a request's tokens grow a few at a time, the index proposes what the drafter's
    scan of the whole context proposes, at every length."""
    lo, hi = ngram[0], ngram[0] + ngram[1]
    index, drafter = NgramIndex(lo, hi), NgramDrafter(hi, lo)
    at = 1
    for g in [0, *grows]:
        at = min(len(tokens), at + g)
        assert index.lookup(tokens[:at], k) == drafter.lookup(tokens[:at], k), (at, tokens[:at])


def test_no_drafts_while_more_requests_run_than_disable_by_batch_size() -> None:
    """vLLM's ``disable_by_batch_size``: three requests with right drafts draft nothing while all
    three run, and draft once one has ended."""
    arrivals = {0: [([1 + i, 2, 3], RequestParams(max_tokens=6 + 10 * i)) for i in range(3)]}
    spec = SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=2)
    engine = LLMEngine(MODEL, None, EngineConfig(num_blocks=32, speculative=spec))
    asked = []
    engine.speculator.propose = lambda live, k, running, f=engine.speculator.propose: asked.append(running) or f(
        live, k, running)
    run(engine, arrivals)
    assert 3 in asked and 2 in asked and engine.stats()["spec_drafts"] <= asked.count(2) + asked.count(1)
    sp = Speculator(spec)
    assert sp.propose(None, 3, running=3) == []  # (refused before it reads the request)
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        SpeculativeConfig(disable_by_batch_size=0)


def test_accept_keeps_drafts_up_to_the_first_miss() -> None:
    sp = Speculator(SpeculativeConfig())
    assert sp.accept((1, 2, 3), [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert sp.accept((1, 2, 3), [5, 2, 3, 4]) == [5]
    assert sp.accept((1, 2, 3), [1, 9, 3, 4]) == [1, 9]
    assert (sp.drafts, sp.draft_tokens, sp.accepted) == (3, 9, 4)
    assert sp.stats()["spec_acceptance_rate"] == 4 / 9


def test_config_from_vllms_json_and_its_refusals() -> None:
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}') \
        == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2)
    assert SpeculativeConfig.parse({"model": "[ngram]"}) == SpeculativeConfig()
    for bad, match in [("{", "not JSON"), ("[1]", "JSON object"), ({"method": "eagle"}, "'eagle' is not served"),
                       ({"model": "meta-llama/Llama-3.2-1B"}, "draft model"), ({"k": 1}, r"unknown .*\['k'\]"),
                       ({"num_speculative_tokens": 0}, r"in \[1, 32\]"), ({"num_speculative_tokens": True}, "int"),
                       ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "above")]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="asynchronous scheduling"):
        EngineConfig(speculative=SpeculativeConfig(), async_scheduling=True)
    with pytest.raises(ValueError, match="SpeculativeConfig"):
        EngineConfig(speculative={"method": "ngram"})


def test_the_serve_flag_and_the_metrics(capsys) -> None:
    from kvtier.serve.cli import configs_from_args

    parser = cli.build_parser()
    args = parser.parse_args(["serve", "--speculative-config", '{"num_speculative_tokens": 2}'])
    engine, _ = configs_from_args(args)
    assert engine.speculative == SpeculativeConfig(num_speculative_tokens=2)
    assert cli.main(["serve", "--speculative-config", '{"method": "medusa"}']) == 2
    assert "'medusa' is not served" in capsys.readouterr().err
    eng = LLMEngine(MODEL, None, EngineConfig(num_blocks=16, speculative=SPEC))
    text = ServerMetrics(eng.stats).render().decode()
    for name in ("kvtier_spec_decode_num_drafts_total", "kvtier_spec_decode_num_accepted_tokens_total",
                 "kvtier_spec_decode_acceptance_rate"):
        assert f"\n{name} 0.0" in text, name
    assert "kvtier_spec_decode" not in ServerMetrics(LLMEngine(MODEL, None, EngineConfig(num_blocks=16)).stats
                                                     ).render().decode()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_drafts_give_the_plain_outputs(graphs) -> None:
    """On CUDA (Triton's paged kernels; decode steps through CUDA graphs or not, drafted steps
    packed): a mixed workload with right and wrong drafts gives the plain engine's outputs."""
    model = build_random(ARGS, dtype=torch.float32, device="cuda", std=0.3)
    rng = random.Random(5)
    arrivals: dict[int, list] = {}
    for i in range(12):
        ids = [rng.randrange(256) for _ in range(rng.randint(1, 60))]
        sampling = SamplingParams(temperature=0.7, top_k=1, seed=i) if i % 4 == 3 else SamplingParams()
        params = RequestParams(max_tokens=rng.randint(1, 40), stop_token_ids=tuple(rng.sample(range(256), 8)),
                               sampling=sampling, logprobs=2 if i % 5 == 4 else None)
        arrivals.setdefault(rng.randint(0, 4), []).append((ids, params))
    config = EngineConfig(num_blocks=48, max_num_seqs=6, max_batched_tokens=64, cuda_graph=graphs)
    (plain, drafted), (_, engine) = plain_and_drafted(model, None, config, arrivals, oracle(rng, arrivals))
    assert_same(drafted, plain)
    assert engine.stats()["spec_accepted_tokens"] > 0
