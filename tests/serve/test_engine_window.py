"""The serving engine on a model with a sliding window: continuous batching, chunked prefills, the
prefix cache and preemption give transformers' greedy tokens past the window; batch-invariant steps
and CUDA graphs, which read every key up to a token's, refuse it where a sequence may pass the window."""

from __future__ import annotations

import pytest
import torch

from kvtier.cuda_graph import window_blocker
from kvtier.model import load_model
from kvtier.serve.engine import EngineConfig, LLMEngine
from kvtier.serve.params import RequestParams
from kvtier.serve.runner import ModelRunner

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
    # 3 rows a step, 12 tokens a step, 18 blocks of 4 tokens: prompts in chunks, rows preempted
    engine = LLMEngine(lm.model, None, EngineConfig(num_blocks=18, block_size=4, max_num_seqs=3,
                                                    max_batched_tokens=12))
    first = engine.generate(rows[:4], params)
    again = engine.generate(rows[4:], params)[0]  # after the second finished: its blocks cached
    assert again.cached_tokens == 24 > WINDOW
    s = engine.stats()
    assert s["preemptions"] > 0 and s["free_blocks"] == 18
    for ids, out in zip(rows, [*first, again]):
        assert list(out.token_ids) == hf_greedy(hf, ids, 10)


def test_batch_invariant_steps_refuse_a_model_whose_sequences_may_pass_its_window(pair):
    _, lm = pair
    with pytest.raises(ValueError, match=rf"past a sliding window, and the model's is {WINDOW} tokens: serve it "
                                         rf"with --max-model-len {WINDOW} or less"):
        ModelRunner(lm.model, num_blocks=8, block_size=4, batch_invariant=True, max_model_len=64)
    runner = ModelRunner(lm.model, num_blocks=8, block_size=4, batch_invariant=True, max_model_len=WINDOW)
    assert runner.batch_invariant


def test_cuda_graphs_name_the_window_where_a_sequence_may_pass_it(pair):
    _, lm = pair
    assert window_blocker(lm.model, WINDOW) is None
    why = window_blocker(lm.model, WINDOW + 1)
    assert why == window_blocker(lm.model, None) and f"sliding window of {WINDOW} tokens" in why


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_graphs_serve_only_sequences_inside_the_window(pair, tmp_path):
    hf, _ = pair
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, device="cuda", dtype=torch.float32, progress=False).model
    rows = prompts(12, [5, 30, 17])
    params = RequestParams(max_tokens=10, ignore_eos=True)
    engine = LLMEngine(model, None, EngineConfig(num_blocks=64, block_size=4, max_model_len=64))
    assert engine.runner.graphs is None  # a sequence may pass the window: eager decode steps
    assert [list(o.token_ids) for o in engine.generate(rows, params)] == [hf_greedy(hf, r, 10) for r in rows]
    inside = LLMEngine(model, None, EngineConfig(num_blocks=64, block_size=4, max_model_len=WINDOW))
    assert inside.runner.graphs is not None
    short = [r[:3] for r in rows]
    out = inside.generate(short, RequestParams(max_tokens=WINDOW - 3, ignore_eos=True))
    assert [list(o.token_ids) for o in out] == [hf_greedy(hf, r, WINDOW - 3) for r in short]
