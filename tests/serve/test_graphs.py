"""Decode steps of the serving engine replayed from CUDA graphs (one per batch-size bucket)
give the tokens of the same engine stepping eagerly."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier.serve.graphs import graph_buckets

CUDA = torch.cuda.is_available()


def test_buckets_cover_every_batch_size() -> None:
    for n in (1, 3, 8, 20, 64, 256):
        b = graph_buckets(n)
        assert b[-1] == n and b == sorted(set(b))
        assert all(any(x >= k for x in b) for k in range(1, n + 1))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_graph_decode_gives_the_tokens_of_eager_decode() -> None:
    from kvtier.model import ModelArgs, build_random
    from kvtier.serve.engine import EngineConfig, LLMEngine
    from kvtier.serve.params import RequestParams

    args = ModelArgs(dim=256, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=512, vocab_size=512,
                     max_position_embeddings=1024)
    model = build_random(args, dtype=torch.float32, device="cuda", std=0.2)
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(3, 200))] for _ in range(11)]
    params = [RequestParams(max_tokens=rng.randint(5, 40), ignore_eos=True) for _ in prompts]
    outs = {}
    for graphs in (True, False):
        engine = LLMEngine(model, None, EngineConfig(num_blocks=128, max_num_seqs=6, max_batched_tokens=96,
                                                     cuda_graph=graphs))
        assert (engine.runner.graphs is not None) == graphs
        outs[graphs] = [o.token_ids for o in engine.generate(prompts, params)]
        assert engine.stats()["free_blocks"] == 128
    assert outs[True] == outs[False]
