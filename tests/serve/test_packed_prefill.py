"""Prompt chunks of several requests packed into one forward give the logits and the stored
keys of each chunk run on its own (CPU float32 in CI; CUDA float32 and bfloat16 on a GPU)."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier.model import ModelArgs, build_random
from kvtier.serve.runner import ModelRunner, token_rows
from kvtier.serve.scheduler import ScheduledRow, StepBatch

ARGS = ModelArgs(dim=256, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=512, vocab_size=512,
                 max_position_embeddings=1024)
_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICES = [("cpu", torch.float32, 1e-5),
           pytest.param("cuda", torch.float32, 1e-3, marks=_GPU),
           pytest.param("cuda", torch.bfloat16, 6e-2, marks=_GPU)]


def rows(rng: random.Random, block_size: int) -> list[ScheduledRow]:
    """Four chunks: two from position 0, two continuing a history, over disjoint blocks."""
    out, next_block = [], 1
    for i, (start, n) in enumerate(((0, 37), (16, 5), (0, 1 + rng.randrange(90)), (48, 64))):
        need = -(-(start + n) // block_size)
        blocks = tuple(range(next_block, next_block + need))
        next_block += need
        out.append(ScheduledRow(f"r{i}", tuple(rng.randrange(512) for _ in range(n)), start, blocks, True))
    return out


def mixed_step(rng: random.Random) -> tuple[list[ScheduledRow], StepBatch]:
    """A step of :func:`rows`' four chunks and three decode rows, interleaved (7 rows), and the
    histories (from position 0) of the rows that continue one."""
    chunks = rows(rng, 16)
    decode = [ScheduledRow(f"d{i}", (rng.randrange(512),), start, tuple(range(20 + 4 * i, 24 + 4 * i)), True)
              for i, start in enumerate((3, 40, 63))]
    history = [ScheduledRow(r.request_id, tuple(rng.randrange(512) for _ in range(r.start)), 0, r.blocks, True)
               for r in chunks + decode if r.start]
    return history, StepBatch((decode[0], *chunks[:2], decode[1], *chunks[2:], decode[2]))


@pytest.mark.parametrize("device,dtype,tol", DEVICES, ids=lambda x: str(x))
def test_packed_chunks_equal_each_chunk_alone(device, dtype, tol) -> None:
    model = build_random(ARGS, dtype=dtype, device=device, std=0.2)
    rng = random.Random(0)
    batch = rows(rng, 16)
    runners = [ModelRunner(model, num_blocks=40, block_size=16, cuda_graph=False) for _ in range(2)]
    history = [ScheduledRow(r.request_id, tuple(rng.randrange(512) for _ in range(r.start)), 0, r.blocks, True)
               for r in batch if r.start]
    for runner in runners:  # the same histories in both pools, one row at a time
        for h in history:
            runner._prefill(h)
    packed = runners[0]._prefill_packed(batch)  # (4, V)
    alone = torch.stack([runners[1]._prefill(r) for r in batch])  # (4, V)
    torch.testing.assert_close(packed, alone, rtol=tol, atol=tol * alone.abs().max().item())
    for a, b in zip(runners[0].caches, runners[1].caches):  # one matmul of N rows rounds as N of 1
        for got, want in ((a.key_cache, b.key_cache), (a.value_cache, b.value_cache)):
            want = want.float()
            torch.testing.assert_close(got.float(), want, rtol=10 * tol, atol=10 * tol * want.abs().max().item())


@pytest.mark.parametrize("device,dtype,tol", DEVICES, ids=lambda x: str(x))
def test_decode_rows_in_the_packed_forward_equal_their_own_forward(device, dtype, tol) -> None:
    """A step with prompt chunks and decode rows, run as one packed forward and as the decode
    forward beside the chunks' forward: the same logits for every row, in row order."""
    model = build_random(ARGS, dtype=dtype, device=device, std=0.2)
    history, batch = mixed_step(random.Random(1))
    got = {}
    for merged in (True, False):
        runner = ModelRunner(model, num_blocks=40, block_size=16, cuda_graph=False, decode_in_prompt_steps=merged)
        assert runner.decode_in_prompt_steps is merged
        with torch.inference_mode():
            for h in history:
                runner._prefill(h)
            got[merged] = runner.execute(batch)
    assert got[True].shape == (len(batch.rows), ARGS.vocab_size)
    torch.testing.assert_close(got[True], got[False], rtol=tol, atol=tol * got[False].abs().max().item())


def test_decode_in_prompt_steps_default_and_refusal() -> None:
    model = build_random(ARGS, dtype=torch.float32, device="cpu", std=0.2)
    assert ModelRunner(model, num_blocks=8).decode_in_prompt_steps is False  # CPU: own forward
    with pytest.raises(ValueError, match="decode_in_prompt_steps must be a bool or None"):
        ModelRunner(model, num_blocks=8, decode_in_prompt_steps=1)


def test_packed_lm_head_rows_padded_to_a_graph_bucket() -> None:
    """With ``pad_logit_rows`` the LM head of a packed forward multiplies a bucket of rows (7 rows:
    8), and the rows' logits are those of the unpadded head; CPU default: no padding."""
    model = build_random(ARGS, dtype=torch.float32, device="cpu", std=0.2)
    history, batch = mixed_step(random.Random(2))  # 7 rows
    seen: list[int] = []
    hook = model.output.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[-2]))
    got = {}
    try:
        for pad in (True, False):
            runner = ModelRunner(model, num_blocks=40, block_size=16, cuda_graph=False,
                                 decode_in_prompt_steps=True, pad_logit_rows=pad, max_num_seqs=100)
            with torch.inference_mode():
                for h in history:
                    runner._prefill(h)
                seen.clear()
                got[pad] = runner.execute(batch)
            assert seen == [8 if pad else 7]
    finally:
        hook.remove()
    assert got[True].shape == (7, ARGS.vocab_size)
    torch.testing.assert_close(got[True], got[False], rtol=1e-6, atol=1e-6 * got[False].abs().max().item())
    assert ModelRunner(model, num_blocks=8).logit_buckets == []
    with pytest.raises(ValueError, match="pad_logit_rows must be a bool or None"):
        ModelRunner(model, num_blocks=8, pad_logit_rows="yes")


@pytest.mark.parametrize("device,dtype,tol", DEVICES, ids=lambda x: str(x))
def test_drafted_rows_as_decode_rows_equal_the_packed_forward(device, dtype, tol, monkeypatch) -> None:
    """A step of drafted rows (1 + 3, 1 + 1 and 1 + 4 tokens) and a decode row, run as decode rows
    of one token each (:func:`token_rows`, what a decode graph replays on CUDA) and as the packed
    forward: the same sampled logits and drafts' logits; on CUDA ``execute`` takes the graphs."""
    monkeypatch.setenv("KVTIER_DECODE_STEP", "0")  # (the CPU's layered decode forward: what a graph captures)
    model = build_random(ARGS, dtype=dtype, device=device, std=0.2)
    rng = random.Random(3)
    starts, drafts = (5, 40, 17, 63), (3, 1, 0, 4)
    blocks = [tuple(range(1 + 5 * i, 6 + 5 * i)) for i in range(4)]
    history = [ScheduledRow(f"r{i}", tuple(rng.randrange(512) for _ in range(n)), 0, b, True)
               for i, (n, b) in enumerate(zip(starts, blocks))]
    batch = StepBatch(tuple(ScheduledRow(f"r{i}", tuple(rng.randrange(512) for _ in range(d + 1)), n, b, True, draft=d)
                            for i, (n, d, b) in enumerate(zip(starts, drafts, blocks))))
    got = {}
    for as_rows in (True, False):
        runner = ModelRunner(model, num_blocks=24, block_size=16, cuda_graph=as_rows and device == "cuda",
                             max_num_seqs=16)
        with torch.inference_mode():
            for h in history:
                runner._prefill(h)
            if as_rows and device == "cpu":
                out = runner._drafted(batch, token_rows(batch.rows), None)
            else:
                out = runner.execute(batch)
            got[as_rows] = out.clone(), {k: v.clone() for k, v in runner.draft_logits.items()}
    (a, da), (b, db) = got[True], got[False]
    scale = b.abs().max().item()
    assert a.shape == (4, ARGS.vocab_size) and sorted(da) == sorted(db) == ["r0", "r1", "r3"]
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * scale)
    for rid, want in db.items():
        assert da[rid].shape == want.shape == (drafts[int(rid[1])] + 1, ARGS.vocab_size)
        torch.testing.assert_close(da[rid], want, rtol=tol, atol=tol * scale)
