"""Step plans and CUDA-graph decode against the per-layer decode path.

The reference is the model's ordinary decode step, where every layer books its own
write (``write_start``/``new_offsets`` per layer): a planned step must give the same
logits and leave the same cache contents. On CUDA the captured graph must give
the tokens of eager decode, with no sync and no allocation in a replayed step.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvtier.caches.base import CacheCapacityError
from kvtier.caches.paged import PagedKVGrowthRefused
from kvtier.config import KVCacheConfig
from kvtier.cuda_graph import (
    CUDAGraphDecoder,
    PlannedDecoder,
    freeze_for_steps,
    graph_unavailable,
    make_decoder,
)
from kvtier.model import ModelArgs, build_random

CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _layered_forward(monkeypatch):
    """The planned steps through the layered forward, whose bytes equal the per-layer path's; on
    the CPU a planned step over paged caches is otherwise one C call
    (``DecodeStep.run_planned``, tested in tests/model/test_paged_step.py), which rounds apart."""
    monkeypatch.setenv("KVTIER_DECODE_STEP", "0")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
ARGS = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=128)
TIERS = ("ragged", "paged")


def config(tier: str, **kw) -> KVCacheConfig:
    return KVCacheConfig(tier=tier, step=8, paged_block_size=4, paged_num_blocks=kw.pop("blocks", 64),
                         **kw)


@pytest.fixture(scope="module")
def model():
    return build_random(ARGS, dtype=torch.float32, device="cpu", std=0.1)


def prefill(model, caches, prompts) -> torch.Tensor:
    """Write every prompt but its last token (rows of different lengths); returns the last tokens."""
    B, ends = len(prompts), [len(p) - 1 for p in prompts]
    dev = next(model.parameters()).device
    if max(ends):
        width = max(ends)
        block = [p[:-1] + [0] * (width - len(p) + 1) for p in prompts]
        kw = {"write_start": torch.zeros(B, dtype=torch.long), "new_offsets": torch.tensor(ends)}
        model(torch.tensor(block, device=dev), caches, cache_kwargs=kw, last_only=True)
    return torch.tensor([p[-1] for p in prompts], device=dev)


def per_layer_decode(model, caches, y, lengths, n):
    """The reference: ``n`` greedy steps, each layer booking its own write."""
    pos, logits = torch.tensor(lengths, device=y.device), []
    for _ in range(n):
        kw = {"write_start": pos, "new_offsets": pos + 1}
        out = model(y[:, None], caches, cache_kwargs=kw, last_only=True)[:, -1]
        logits.append(out.clone())
        y, pos = out.argmax(-1), pos + 1
    return logits


def planned_decode(decoder, y, n):
    logits = []
    for _ in range(n):
        out = decoder.step(y)[:, -1]
        logits.append(out.clone())
        y = out.argmax(-1)
    return logits


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, ARGS.vocab_size, (n,), generator=g).tolist() for n in lengths]


def same_contents(a, b) -> None:
    assert [c.offset.tolist() for c in a] == [c.offset.tolist() for c in b]
    for ca, cb in zip(a, b):
        lengths = ca.offset.tolist()
        for x, y in zip(ca.fetch(), cb.fetch()):  # compare each row's live tokens only
            for r, n in enumerate(lengths):
                torch.testing.assert_close(x[r, :, :n], y[r, :, :n], rtol=0, atol=0)


# -- the shared plan against the per-layer path ---------------------------------------------------
@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("lengths", [(6, 10, 2), (1, 1), (3,)])
def test_planned_steps_equal_the_per_layer_path(model, tier, lengths):
    """Rows of different lengths, block boundaries crossed, capacity reserved on the way
    (a 64-block pool cannot take 256 tokens ahead for every row, so the planner reserves
    what each step needs); one-token prompts start from empty caches."""
    prompts, n = prompts_of(lengths), 14
    with torch.inference_mode():
        ref = model.make_caches(config(tier), batch_size=len(prompts))
        y = prefill(model, ref, prompts)
        want = per_layer_decode(model, ref, y, [len(p) - 1 for p in prompts], n)
        caches = model.make_caches(config(tier), batch_size=len(prompts))
        y = prefill(model, caches, prompts)
        dec = PlannedDecoder(model, caches, [len(p) - 1 for p in prompts])
        got = planned_decode(dec, y, n)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    same_contents(caches, ref)
    if tier == "paged":  # one table for all layers: every layer holds the same blocks
        assert all(c.block_table_view().rows == caches[0].block_table_view().rows for c in caches)


@pytest.mark.parametrize("tier", TIERS)
def test_a_growing_ragged_or_dynamic_paged_cache_reserves_ahead_once(model, tier):
    prompts = prompts_of((5, 3))
    cfg = config(tier, dynamic_paged=True, blocks=4)
    with torch.inference_mode():
        caches = model.make_caches(cfg, batch_size=2)
        y = prefill(model, caches, prompts)
        dec = PlannedDecoder(model, caches)
        planned_decode(dec, y, 20)
    grown = [c.copy_stats.grow_events for c in caches]
    assert len(set(grown)) == 1 and grown[0] >= 1  # every layer alike
    held = caches[0].capacity if tier == "ragged" else caches[0].headroom()
    assert held >= 256 - 20  # reserved 256 tokens ahead, once


# -- the budget guard -----------------------------------------------------------------------------
@pytest.mark.parametrize("tier", TIERS)
def test_budget_is_what_the_frozen_capacity_holds_and_a_step_past_it_changes_nothing(model, tier):
    prompts = prompts_of((6, 3))
    with torch.inference_mode():
        caches = model.make_caches(config(tier), batch_size=2)
        y = prefill(model, caches, prompts)
        dec = PlannedDecoder(model, caches, max_steps=3)
        assert all(c.frozen for c in caches)
        if tier == "ragged":  # 5 + 3 positions, rounded up to the step (8)
            assert caches[0].capacity == 8 and dec.budget == 8 - 5
        else:  # blocks of 4: row 0 holds 2 (5 of 8 slots used), row 1 gets a second one (2 of 8)
            assert [len(r) for r in caches[0].block_table_view().rows] == [2, 2] and dec.budget == 8 - 5
        steps = planned_decode(dec, y, dec.budget)
        before = [[t.clone() for t in c.fetch()] for c in caches], [c.offset.tolist() for c in caches]
        with pytest.raises(CacheCapacityError, match="frozen capacity"):
            dec.step(steps[-1].argmax(-1))
        after = [[t.clone() for t in c.fetch()] for c in caches], [c.offset.tolist() for c in caches]
    assert before[1] == after[1]
    assert all(torch.equal(a, b) for la, lb in zip(before[0], after[0]) for a, b in zip(la, lb))


def test_freeze_for_steps_refuses_before_changing_any_layer(model):
    prompts = prompts_of((6, 3))
    with torch.inference_mode():
        caches = model.make_caches(config("paged", blocks=8), batch_size=2)
        prefill(model, caches, prompts)
    books = [(c.block_table_view().rows, c.paged_stats()["free_blocks"]) for c in caches]
    with pytest.raises(PagedKVGrowthRefused, match="KVTIER_PAGED_NUM_BLOCKS"):
        freeze_for_steps(caches, 40)
    assert [(c.block_table_view().rows, c.paged_stats()["free_blocks"]) for c in caches] == books
    assert not any(c.frozen for c in caches)


# -- a plan holds only while the caches follow it --------------------------------------------------
@pytest.mark.parametrize("tier", TIERS)
def test_a_cache_changed_outside_the_plan_stops_the_next_step(model, tier):
    prompts = prompts_of((6, 4))
    with torch.inference_mode():
        caches = model.make_caches(config(tier), batch_size=2)
        y = prefill(model, caches, prompts)
        dec = PlannedDecoder(model, caches)
        out = planned_decode(dec, y, 2)
        caches[1].trim(1)
        offsets = [c.offset.tolist() for c in caches]
        with pytest.raises(ValueError, match="changed outside"):
            dec.step(out[-1].argmax(-1))
    assert [c.offset.tolist() for c in caches] == offsets


def test_releasing_a_row_in_one_paged_layer_leaves_the_others_books(model):
    prompts = prompts_of((6, 4))
    with torch.inference_mode():
        caches = model.make_caches(config("paged"), batch_size=2)
        y = prefill(model, caches, prompts)
        dec = PlannedDecoder(model, caches)
        planned_decode(dec, y, 3)
        caches[0].release([0])
    assert caches[0].offset.tolist() == [0, 6]
    assert [c.offset.tolist() for c in caches[1:]] == [[8, 6]] * (len(caches) - 1)


# -- choosing the decoder ----------------------------------------------------------------------------
def test_without_cuda_the_graph_is_refused_with_the_reason_and_auto_decodes_eagerly(model):
    prompts = prompts_of((4, 2))
    with torch.inference_mode():
        caches = model.make_caches(config("paged"), batch_size=2)
        prefill(model, caches, prompts)
        assert "CUDA" in graph_unavailable(model, caches, max_steps=4)
        with pytest.raises(ValueError, match="CUDA-graph decode cannot serve"):
            make_decoder(model, caches, cuda_graph=True, max_steps=4)
        with pytest.raises(ValueError, match="cannot serve"):
            CUDAGraphDecoder(model, caches, max_steps=4)
        assert type(make_decoder(model, caches, max_steps=4)) is PlannedDecoder
        with pytest.raises(ValueError, match="cuda_graph"):
            make_decoder(model, caches, cuda_graph="yes")
    assert not any(c.frozen for c in caches)  # nothing was frozen on the way


def test_generate_refuses_a_graph_on_a_scalar_tier_and_a_bad_setting(model):
    from kvtier.generate import GenerationConfig, generate_step

    caches = model.make_caches(KVCacheConfig(tier="tail"))
    with pytest.raises(ValueError, match="ragged or paged"):
        next(generate_step(model, [[1, 2, 3]], caches, cuda_graph=True))
    with pytest.raises(ValueError, match="cuda_graph"):
        GenerationConfig(cuda_graph=1)


# -- the Triton paths, on the CPU under Triton's interpreter ----------------------------------------
_INTERPRETED = r"""
import torch
from kvtier.caches.ragged import RaggedBatchKVCache
from kvtier.config import KVCacheConfig
from kvtier.cuda_graph import PlannedDecoder
from kvtier.model import ModelArgs, build_random

torch.manual_seed(0)
# ragged one-token attention through the kernel equals the mask path, for every q_start
ref, tri = RaggedBatchKVCache(3, step=8, attention_backend="torch"), RaggedBatchKVCache(
    3, step=8, attention_backend="triton")
for T, ws, no in ((5, None, [5, 3, 0]), (2, [5, 1, 0], [6, 3, 1]), (1, None, None)):
    k, v = torch.randn(3, 2, T, 16), torch.randn(3, 2, T, 16)
    for c in (ref, tri):
        c.update(k, v, write_start=ws, new_offsets=no)
    for q_start in (None, [0, 2, 1], [6, 3, 1]):
        q = torch.randn(3, 4, 1, 16)
        torch.testing.assert_close(tri.attention(q, q_start=q_start), ref.attention(q, q_start=q_start),
                                   atol=1e-5, rtol=1e-5)
assert tri.stats()["attention_calls_by_backend"] == {"triton": 9}, tri.stats()
assert ref.stats()["attention_calls_by_backend"] == {"torch": 9}

# the Triton write takes K and V whose strides differ only where a dim has one element
from kvtier.caches.paged import PagedKVCache
qk, qkv = torch.randn(1, 1, 6, 16), torch.randn(1, 1, 8, 16)  # (B, T, H, D), as in the model
k, v = qk[:, :, 4:].transpose(1, 2), qkv[:, :, 6:].transpose(1, 2)  # (1, 2, 1, 16) each
assert k.stride() != v.stride()
pc = {b: PagedKVCache(4, 4, attention_backend=b) for b in ("torch", "triton")}
for c in pc.values():
    c.update(k, v)
assert all(torch.equal(a, b) for a, b in zip(pc["torch"].fetch(), pc["triton"].fetch()))
assert pc["triton"].paged_stats()["write_calls_by_backend"] == {"triton": 1}

# a planned paged decode through the Triton write and attention kernels
args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=64)
model = build_random(args, dtype=torch.float32, std=0.1)
out = {}
for backend in ("torch", "triton"):
    cfg = KVCacheConfig(tier="paged", paged_block_size=4, paged_num_blocks=16,
                        attention_backend=backend)
    caches = model.make_caches(cfg, batch_size=2)
    with torch.inference_mode():
        kw = {"write_start": torch.tensor([0, 0]), "new_offsets": torch.tensor([5, 2])}
        model(torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1)), caches,
              cache_kwargs=kw)
        dec, y, logits = PlannedDecoder(model, caches), torch.tensor([3, 4]), []
        for _ in range(4):
            logits.append(dec.step(y)[:, -1].clone())
            y = logits[-1].argmax(-1)
    s = caches[1].paged_stats()
    assert s["write_calls_by_backend"] == {backend: 5} and not s["backend_fallback_reasons"], s
    out[backend] = torch.stack(logits)
torch.testing.assert_close(out["triton"], out["torch"], atol=1e-4, rtol=1e-4)
print("ok")
"""


def test_triton_paths_under_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-3000:] + r.stderr[-3000:]


# -- CUDA ----------------------------------------------------------------------------------------------
CUDA_ARGS = ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, hidden_dim=512, vocab_size=512)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def cuda_model(request):
    return build_random(CUDA_ARGS, dtype=request.param, device="cuda", std=0.05)


def _cuda_caches(model, tier, prompts, backend="auto"):
    cfg = KVCacheConfig(tier=tier, step=64, paged_block_size=16, paged_num_blocks=64,
                        attention_backend=backend)
    caches = model.make_caches(cfg, batch_size=len(prompts))
    with torch.inference_mode():
        y = prefill(model, caches, prompts)
    return caches, y


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tier,backend", [("ragged", "auto"), ("ragged", "torch"), ("paged", "auto")])
@pytest.mark.parametrize("lengths", [(37,), (50, 17, 3)])
def test_graph_replay_gives_the_tokens_of_eager_decode(cuda_model, tier, backend, lengths):
    """64 steps from the graph (the first eager, the second captured, then replays) against
    eager planned steps over caches frozen alike: the same kernels with the same launch
    plans, so the same tokens and logits. In float32, where another launch plan (another
    order of sums) cannot flip a token, also against the per-layer path."""
    prompts, n = prompts_of(lengths), 64
    ends = [len(p) - 1 for p in prompts]
    caches, y = _cuda_caches(cuda_model, tier, prompts, backend)
    with torch.inference_mode():
        dec = CUDAGraphDecoder(cuda_model, caches, max_steps=n)
        got = planned_decode(dec, y, n)
        assert dec.captured and dec.eager_reason is None and dec.steps == n
        eager, y = _cuda_caches(cuda_model, tier, prompts, backend)
        want = planned_decode(PlannedDecoder(cuda_model, eager, max_steps=n), y, n)
    tokens = [g.argmax(-1).tolist() for g in got]
    assert tokens == [w.argmax(-1).tolist() for w in want]
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=0, atol=1e-3)
    same_contents(caches, eager)
    assert caches[0].offset.tolist() == [e + n for e in ends]
    if cuda_model.output.weight.dtype == torch.float32:
        with torch.inference_mode():
            per_layer, y = _cuda_caches(cuda_model, tier, prompts, backend)
            ref = per_layer_decode(cuda_model, per_layer, y, ends, n)
        assert tokens == [r.argmax(-1).tolist() for r in ref]
        torch.testing.assert_close(torch.stack(got), torch.stack(ref), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tier", TIERS)
def test_a_replayed_step_neither_syncs_nor_allocates(cuda_model, tier):
    prompts = prompts_of((40, 9))
    caches, y = _cuda_caches(cuda_model, tier, prompts)
    dec = CUDAGraphDecoder(cuda_model, caches, max_steps=16)
    tokens = [torch.full((2,), t, dtype=torch.long, device="cuda") for t in range(12)]
    dec.step(y), dec.step(tokens[0])  # eager warm-up, then capture
    assert dec.captured
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for t in tokens[1:]:
            dec.step(t)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    assert caches[0].offset.tolist() == [39 + 13, 8 + 13]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tier", TIERS)
def test_the_graph_stops_at_its_budget(cuda_model, tier):
    caches, y = _cuda_caches(cuda_model, tier, prompts_of((20,)))
    dec = CUDAGraphDecoder(cuda_model, caches, max_steps=5)
    for _ in range(dec.budget):
        y = dec.step(y)[:, -1].argmax(-1)
    offsets = caches[0].offset.tolist()
    with pytest.raises(CacheCapacityError, match="frozen capacity"):
        dec.step(y)
    assert caches[0].offset.tolist() == offsets == [19 + dec.budget]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tier", TIERS)
def test_generate_with_and_without_the_graph_gives_the_same_tokens(cuda_model, tier):
    from kvtier.generate import generate_step

    if cuda_model.output.weight.dtype != torch.float32:
        pytest.skip("the eager run plans its launches over other capacities: compared in float32")
    prompts = prompts_of((30, 12))
    out = []
    for graph in (True, False):
        caches = cuda_model.make_caches(config(tier), batch_size=2)
        steps = generate_step(cuda_model, prompts, caches, cuda_graph=graph, max_steps=21)
        out.append([next(steps).tolist() for _ in range(20)])
        steps.close()
        assert caches[0].frozen is graph
    assert out[0] == out[1]  # (float32: another launch plan cannot flip a token)


# -- the decode benchmark's peer and table (CPU) ------------------------------------------------------
@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-llama3"])
def test_the_benchmarks_hf_model_holds_our_weights_and_gives_our_logits(arch):
    pytest.importorskip("transformers")
    from kvtier_bench.decode_gpu import hf_llama, weight_bytes

    ours = build_random(arch, dtype=torch.float32, std=0.1)
    hf = hf_llama(ours)
    assert hf.model.layers[1].mlp.up_proj.weight.data_ptr() == (
        ours.layers[1].feed_forward.w13.weight[ours.args.hidden_dim:].data_ptr())  # a view, no copy
    ids = torch.randint(0, ours.args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = ours(ids, ours.make_caches(KVCacheConfig(tier="tail")))
        got = hf(ids).logits.float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert weight_bytes(ours) == 4 * ours.args.n_params


def test_the_benchmark_table_compares_each_contender_with_its_peers():
    from kvtier_bench.decode_gpu import Result, _rows

    rows = _rows([
        Result("kvtier paged, CUDA graph", 1, 512, 4, 0.1, 200.0, 250.0, [1, 2, 3, 4]),
        Result("HF generate, DynamicCache", 1, 512, 4, 0.2, 40.0, 250.0, [1, 2, 9, 9]),
        Result("HF generate, StaticCache (compiled)", 1, 512, 4, 0.2, 100.0, 250.0, [1, 2, 3, 4]),
        Result("kvtier paged, CUDA graph", 64, 8192, 4, 1.0, 2400.0, 3200.0),
    ])
    assert rows[0][5:11] == ["200.0", "5.00", "80% of 250", "5.00x", "2.00x", "4/4"]
    assert rows[1][10] == "2/4"
    assert rows[3][5:10] == ["2400.0", "26.67", "75% of 3200", "-", "-"]
