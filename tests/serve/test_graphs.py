"""Decode steps of the serving engine replayed from CUDA graphs (one per batch-size bucket)
give the tokens of the same engine stepping eagerly."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier.serve.graphs import HostInputs, graph_buckets, reference_inputs
from kvtier.serve.runner import smallest_bucket
from kvtier.serve.scheduler import ScheduledRow

CUDA = torch.cuda.is_available()


def test_buckets_cover_every_batch_size() -> None:
    for n in (1, 3, 8, 20, 64, 256):
        b = graph_buckets(n)
        assert b[-1] == n and b == sorted(set(b))
        assert all(any(x >= k for x in b) for k in range(1, n + 1))
        for k in range(1, n + 1):  # the smallest bucket that holds k rows; none past the largest
            got = smallest_bucket(b, k)
            assert got in b and got >= k and all(x < k for x in b if x < got)
        assert smallest_bucket(b, n + 5) == n + 5


def test_host_inputs_equal_the_list_built_ones_step_after_step() -> None:
    rng = random.Random(0)
    bs, width, scratch, max_rows = 4, 12, 500, 9
    h = HostInputs(max_rows, width, block_size=bs, scratch=scratch)
    live: dict[str, list[int]] = {}  # request -> tokens so far (its length sets its blocks)
    blocks: dict[str, list[int]] = {}
    ids = iter(range(10**6))
    for _ in range(300):
        for rid in list(live):  # requests end, are preempted (new blocks) or decode one token
            u = rng.random()
            if u < 0.08:
                del live[rid]
                blocks.pop(rid, None)
            elif u < 0.12:
                blocks[rid] = rng.sample(range(scratch), len(blocks.get(rid, ())))
            elif len(live[rid]) < width * bs - 1:
                live[rid].append(rng.randrange(1000))
        while len(live) < max_rows and rng.random() < 0.5:
            live[f"r{next(ids)}"] = [rng.randrange(1000) for _ in range(rng.randint(1, width * bs - 1))]
        order = list(live)
        if rng.random() < 0.2:
            rng.shuffle(order)
        order = order[: rng.randint(1, max_rows)] if order else []
        if not order:
            continue
        rows = []
        for rid in order:
            n = -(-len(live[rid]) // bs)
            have = blocks.setdefault(rid, [])
            have += rng.sample(range(scratch), n - len(have)) if n > len(have) else []
            start = len(live[rid]) - 1
            rows.append(ScheduledRow(rid, (live[rid][-1],), start, tuple(have), True))
        bucket = min(b for b in graph_buckets(max_rows) if b >= len(rows))
        host, table = h.fill(rows, bucket)
        ref_host, ref_table = reference_inputs(rows, bucket, bs, scratch)
        assert torch.equal(host, ref_host) and torch.equal(table, ref_table)
        assert host.dtype == torch.long and table.dtype == torch.int32


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


def test_host_inputs_take_coded_tokens_for_rows_whose_token_is_on_the_device() -> None:
    """Asynchronous scheduling: a pending row's token goes in as its code (``-1 - i``), the
    rest of the inputs as for its own token."""
    from kvtier.serve.scheduler import PENDING

    rows = [ScheduledRow("a", (PENDING,), 17, (3, 5), True), ScheduledRow("b", (9,), 4, (7,), True)]
    plain, coded = HostInputs(4, 8, block_size=16, scratch=99), HostInputs(4, 8, block_size=16, scratch=99)
    want, _ = plain.fill(rows, bucket=2)
    host, _ = coded.fill(rows, bucket=2, tokens=[-3, 9])
    assert host[0].tolist() == [-3, 9] and torch.equal(host[1:], want[1:])
