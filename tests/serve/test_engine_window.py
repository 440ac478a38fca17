"""The serving engine on a model with a sliding window: continuous batching, chunked prefills, the
prefix cache and preemption give transformers' greedy tokens past the window, on CUDA through the
decode graphs too; batch-invariant steps (the CPU's one-call step takes no prompt chunk past a
window) refuse it where a sequence may pass the window."""

from __future__ import annotations

import pytest
import torch

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
