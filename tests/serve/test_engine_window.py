"""The serving engine on a model with a sliding window: continuous batching, chunked prefills, the
prefix cache and preemption give transformers' greedy tokens past the window, on CUDA through the
decode graphs too, and in batch-invariant steps (each token past the window through the CPU's
one-call step alone)."""

from __future__ import annotations

import pytest
import torch

from kvtier.model import load_model
from kvtier.model.cpu_step import plan_for
from kvtier.serve.engine import EngineConfig, LLMEngine
from kvtier.serve.params import RequestParams

transformers = pytest.importorskip("transformers")
from hf_pairs import WINDOW, hf_greedy, hf_windowed, prompts  # noqa: E402  (needs transformers)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = hf_windowed("mistral")
    folder = tmp_path_factory.mktemp("engine-window")
    hf.save_pretrained(folder)
    return hf, load_model(folder, device="cpu", dtype=torch.float32, progress=False)


def test_batched_chunked_and_preempted_requests_get_transformers_tokens(pair):
    hf, lm = pair
    rows = prompts(11, [5, 30, 17, 9, 26])
    rows[4] = rows[1][:24] + rows[4][:2]  # shares six blocks of four tokens with the second
    params = RequestParams(max_tokens=10, ignore_eos=True)
    # 3 rows a step, 12 tokens a step, 10 blocks of 4 tokens: prompts in chunks, rows preempted
    engine = LLMEngine(lm.model, None, EngineConfig(num_blocks=10, block_size=4, max_num_seqs=3,
                                                    max_batched_tokens=12))
    first = engine.generate(rows[:4], params)
    s = engine.stats()
    assert s["preemptions"] > 0 and s["free_blocks"] == 10
    # the prefix cache past the window (in a pool that keeps the second's released blocks)
    cached = LLMEngine(lm.model, None, EngineConfig(num_blocks=64, block_size=4, max_num_seqs=3, max_batched_tokens=12))
    cached.generate(rows[1:2], params)
    again = cached.generate(rows[4:], params)[0]
    assert again.cached_tokens == 24 > WINDOW
    for ids, out in zip(rows, [*first, again]):
        assert list(out.token_ids) == hf_greedy(hf, ids, 10)


def test_blocks_behind_the_window_are_released_so_long_requests_share_a_small_pool(pair, monkeypatch):
    """Two requests of 5 and 7 + 40 tokens (12 blocks of 4 each, whole) side by side in 12 blocks:
    behind the window of 8 their blocks are released, so neither is preempted; without the
    release (a model whose window some layer lacks) the same pool preempts."""
    hf, lm = pair
    rows = prompts(3, [5, 7])
    params = RequestParams(max_tokens=40, ignore_eos=True)
    want = [hf_greedy(hf, r, 40) for r in rows]
    config = EngineConfig(num_blocks=12, block_size=4, max_num_seqs=2, max_model_len=48)
    engine = LLMEngine(lm.model, None, config)
    release = engine.scheduler._release

    def release_and_poison(req):  # a released block read again would turn the logits to NaN (the
        # prompts share no block: none is taken back from the prefix cache)
        before = list(req.blocks)
        release(req)
        gone = [b for b, now in zip(before, req.blocks) if b != now]
        for c in engine.runner.caches:
            c.pool.key_cache[gone] = c.pool.value_cache[gone] = float("nan")

    monkeypatch.setattr(engine.scheduler, "_release", release_and_poison)
    assert [list(o.token_ids) for o in engine.generate(rows, params)] == want
    s = engine.stats()
    assert s["preemptions"] == 0 and s["released_blocks"] > 0 and s["free_blocks"] == 12
    monkeypatch.setattr(type(lm.model.args), "window_everywhere", property(lambda a: None))
    whole = LLMEngine(lm.model, None, config)
    assert [list(o.token_ids) for o in whole.generate(rows, params)] == want
    assert whole.stats()["preemptions"] > 0 and whole.stats()["released_blocks"] == 0
    monkeypatch.undo()
    warmed = LLMEngine(lm.model, None, config)
    assert warmed.warm_up()["prompt_tokens"] > WINDOW and warmed.stats()["released_blocks"] == 0  # (its books reset)


def test_batch_invariant_answers_past_the_window_are_each_requests_alone(pair):
    """Batch-invariant steps (every token through the one-call step; past the window each token
    attends alone, to its own window's keys): requests together in a small pool, chunked and
    preempted, give transformers' greedy tokens and each request's logprobs alone, bit for bit."""
    hf, lm = pair
    if plan_for(lm.model) is None:
        pytest.skip("the one-call CPU step is not built here")
    rows = prompts(13, [9, 10, 11, 12, 13, 14])
    params = RequestParams(max_tokens=20, logprobs=0, ignore_eos=True)
    config = dict(block_size=4, batch_invariant=True, max_model_len=48)
    engine = LLMEngine(lm.model, None, EngineConfig(num_blocks=12, max_num_seqs=6, max_batched_tokens=12, **config))
    together = engine.generate(rows, params)
    assert engine.stats()["preemptions"] > 0
    for ids, got in zip(rows, together):
        alone = LLMEngine(lm.model, None, EngineConfig(num_blocks=64, **config)).generate([ids], params)[0]
        assert list(got.token_ids) == list(alone.token_ids) == hf_greedy(hf, ids, 20)
        assert [x.logprob for x in got.logprobs] == [x.logprob for x in alone.logprobs]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_decode_graphs_serve_sequences_past_the_window(pair, tmp_path, monkeypatch):
    """Graphs captured over one-token rows (inside every window) replay decode steps past it."""
    hf, _ = pair
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, device="cuda", dtype=torch.float32, progress=False).model
    rows = prompts(12, [3, 30, 17])
    engine = LLMEngine(model, None, EngineConfig(num_blocks=64, block_size=4, max_model_len=64))
    graphs, replays = engine.runner.graphs, []
    assert graphs is not None
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda rows, **kw: replays.append(len(rows)) or run(rows, **kw))
    out = engine.generate(rows, RequestParams(max_tokens=12, ignore_eos=True))
    assert [list(o.token_ids) for o in out] == [hf_greedy(hf, r, 12) for r in rows]
    assert len(replays) >= 8, replays
