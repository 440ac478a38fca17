"""A prompt chunk written through one StepPlan (``chunk_plan``) stores and attends exactly as the
same chunk written with per-layer lists, on full-precision and quantised pages."""

from __future__ import annotations

import pytest
import torch

from kvtier.caches.paged_shared import RowBinding, SharedBlockPagedKVCache, chunk_plan

H, HQ, D, BS, N = 2, 4, 64, 4, 16


def pair(kv_quant):
    caches = []
    for _ in range(2):
        c = SharedBlockPagedKVCache(block_size=BS, num_blocks=N, kv_quant=kv_quant)
        c.allocate(H, D, torch.float32, "cpu")
        caches.append(c)
    return caches


@pytest.mark.parametrize("kv_quant", [None, "q8"])
@pytest.mark.parametrize("start,T", [(0, 7), (5, 6), (8, 1)])
def test_a_planned_chunk_equals_the_listed_one(kv_quant, start, T, seed) -> None:
    blocks = [[9, 2, 14, 5]]
    planned, listed = pair(kv_quant)
    head_k, head_v = torch.randn(1, H, start, D), torch.randn(1, H, start, D)
    k, v, q = torch.randn(1, H, T, D), torch.randn(1, H, T, D), torch.randn(1, HQ, T, D)
    for c in (planned, listed):
        c.bind(RowBinding.build(blocks, [0], block_size=BS, num_blocks=N))
        if start:
            c.update(head_k, head_v)
    rows = RowBinding.build(blocks, [start], block_size=BS, num_blocks=N)
    plan = chunk_plan(rows, T)
    assert plan.write_start.tolist() == [start] and plan.new_offsets.tolist() == [start + T]
    assert plan.slots.tolist() == [blocks[0][p // BS] * BS + p % BS for p in range(start, start + T)]
    planned.bind(rows)
    planned.update(k, v, plan=plan, write_start=plan.write_start)
    listed.bind(rows)
    listed.update(k, v, write_start=[start], new_offsets=[start + T])
    assert planned.lengths == listed.lengths == [start + T]
    for a, b in zip(planned.fetch(), listed.fetch()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    want = listed.attention(q)

    def no_host_lists(*args):  # the plan's device tensors serve: no host list becomes a tensor
        raise AssertionError("the planned chunk's attention built its positions from host lists")

    planned._rows_tensor = no_host_lists
    torch.testing.assert_close(planned.attention(q), want, rtol=0, atol=0)


def test_a_chunk_past_the_rows_blocks_is_refused() -> None:
    rows = RowBinding.build([[3, 4]], [6], block_size=BS, num_blocks=N)
    with pytest.raises(ValueError, match="too few blocks"):
        chunk_plan(rows, 3)  # 9 tokens, 2 blocks of 4
    with pytest.raises(ValueError, match="tokens must be an int >= 1"):
        chunk_plan(rows, 0)


def test_a_plan_of_t_tokens_refuses_other_shapes() -> None:
    c = pair(None)[0]
    rows = RowBinding.build([[3, 4]], [0], block_size=BS, num_blocks=N)
    c.bind(rows)
    plan = chunk_plan(rows, 3)
    k = torch.randn(1, H, 2, D)
    with pytest.raises(ValueError, match="3 token"):
        c.update(k, k, plan=plan, write_start=plan.write_start)
    assert c.lengths == [0]


@pytest.mark.parametrize("decode_first", [False, True])
@pytest.mark.parametrize("kv_quant", [None, "q8"])
def test_packed_chunks_store_and_attend_as_each_row_alone(kv_quant, decode_first, seed) -> None:
    """Three rows' chunks (lengths 5, 1, 7 from positions 3, 0, 6) packed into one write and one
    attention equal each row written and attended on its own; with the one-token row first
    (a decode row, as the scheduler orders them) the plan counts it as a single row."""
    from kvtier.caches.paged_shared import packed_plan

    blocks, starts, counts = [[1, 2, 3], [4], [5, 6, 7, 8]], [3, 0, 6], [5, 1, 7]
    order = [1, 0, 2] if decode_first else [0, 1, 2]
    blocks, starts, counts = ([x[i] for i in order] for x in (blocks, starts, counts))
    packed, single = pair(kv_quant)
    heads = [(torch.randn(1, H, s, D), torch.randn(1, H, s, D)) for s in starts]
    for c in (packed, single):  # the rows' histories, written row by row
        for b, (hk, hv), s in zip(blocks, heads, starts):
            c.bind(RowBinding.build([b], [0], block_size=BS, num_blocks=N))
            if s:
                c.update(hk, hv)
    ks = [torch.randn(1, H, n, D) for n in counts]
    vs = [torch.randn(1, H, n, D) for n in counts]
    qs = [torch.randn(1, HQ, n, D) for n in counts]
    rows = RowBinding.build(blocks, starts, block_size=BS, num_blocks=N)
    plan = packed_plan(rows, counts)
    assert plan.total == sum(counts) and plan.singles == int(decode_first)
    assert plan.last.tolist() == ([0, 5, 12] if decode_first else [4, 5, 12])
    spans = {3: range(3, 8), 0: range(0, 1), 6: range(6, 13)}
    assert plan.positions[0].tolist() == [p for s in starts for p in spans[s]]
    packed.bind(rows)
    packed.update(torch.cat(ks, 2), torch.cat(vs, 2), plan=plan)
    assert packed.lengths == [s + n for s, n in zip(starts, counts)]
    got = packed.attention(torch.cat(qs, 2))  # (1, HQ, 13, D)
    at = 0
    for b, s, n, k, v, q in zip(blocks, starts, counts, ks, vs, qs):
        single.bind(RowBinding.build([b], [s], block_size=BS, num_blocks=N))
        single.update(k, v)
        want = single.attention(q)
        torch.testing.assert_close(got[:, :, at:at + n], want, rtol=1e-5, atol=1e-5)
        at += n
    with pytest.raises(ValueError, match="packed plan writes 13 tokens"):
        packed.bind(rows)
        packed.update(torch.randn(1, H, 12, D), torch.randn(1, H, 12, D), plan=plan)
