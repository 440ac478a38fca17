"""Sliding-window attention (Mistral 7B v0.1, Qwen2 with ``use_sliding_window``): every tier, the
paged reference and the engine's generation paths give transformers' logits and greedy tokens past
the window; the kernels keep serving until a row passes it."""

from __future__ import annotations

import pytest
import torch

from kvtier.caches.paged_codecs import select_codecs
from kvtier.config import KVCacheConfig
from kvtier.cuda_graph import CUDAGraphDecoder
from kvtier.drafters import EarlyExitDrafter
from kvtier.generate import generate_step
from kvtier.kernels.paged import paged_attention_reference
from kvtier.kernels.reference import causal_attention, causal_mask
from kvtier.model import ModelArgs, Transformer, load_model
from kvtier.model.cpu_step import plan_for
from kvtier.speculative import SpeculativeConfig, speculative_generate_step

transformers = pytest.importorskip("transformers")
from hf_pairs import WINDOW, hf_greedy, hf_windowed, loaded_pairs, prompts  # noqa: E402  (needs transformers)

TIERS = {
    "tail": KVCacheConfig(tier="tail", step=16),
    "block": KVCacheConfig(tier="block", owned_block_size=4),  # blocks out of every window are skipped
    "ragged": KVCacheConfig(tier="ragged", step=16),
    "paged": KVCacheConfig(tier="paged", paged_block_size=4, paged_num_blocks=64),
}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return loaded_pairs(tmp_path_factory, hf_windowed, "sw")


# -- the model: every tier against transformers ----------------------------------------------------
@pytest.mark.parametrize("kind", ["mistral", "qwen2", "phi3"])
def test_the_config_names_the_window_and_its_layers(pairs, kind):
    _, lm = pairs(kind)
    assert lm.args.sliding_window == WINDOW
    assert [lm.model.layers[i].attention.window for i in range(2)] == (
        [None, WINDOW] if kind == "qwen2" else [WINDOW, WINDOW])


@pytest.mark.parametrize("tier, kv_quant", [(t, None) for t in TIERS] + [("paged", "q8"), ("paged", "q4")])
@pytest.mark.parametrize("kind", ["mistral", "qwen2", "phi3"])
@torch.no_grad()
def test_prefill_chunks_then_decode_give_transformers_logits(pairs, kind, tier, kv_quant):
    hf, lm = pairs(kind)
    ids = torch.tensor(prompts(1, [40]))
    ref = hf(ids).logits[0]
    caches = lm.model.make_caches(TIERS[tier].replace(kv_quant=kv_quant) if kv_quant else TIERS[tier])
    got = [lm.model(ids[:, :13], caches)[0]]  # a chunk past the window, then one token a call
    got += [lm.model(ids[:, t : t + 1], caches)[0] for t in range(13, 40)]
    err = (torch.cat(got) - ref).abs().amax(-1)
    assert err.max() <= {None: 1e-4, "q8": 1e-2, "q4": 0.1}[kv_quant], err
    windowless = Transformer(ModelArgs.from_dict({**lm.args.to_dict(), "sliding_window": None}))
    windowless.load_state_dict(lm.model.state_dict())
    off = (windowless(ids, windowless.make_caches()) - ref).abs().amax(-1)[0]
    assert off[:WINDOW].max() <= 1e-4 < off[WINDOW:].min()  # (what the window changes)


@pytest.mark.parametrize("tier", ["ragged", "paged"])
@torch.no_grad()
def test_rows_of_different_lengths_decode_transformers_tokens(pairs, tier):
    hf, lm = pairs("mistral")
    rows = prompts(2, [5, 19, 11])  # one row starts inside the window, two past it
    caches = lm.model.make_caches(TIERS[tier], batch_size=len(rows))
    steps = generate_step(lm.model, rows, caches, prefill_chunk=6)
    got = torch.stack([next(steps) for _ in range(12)], 1).tolist()
    steps.close()
    assert got == [hf_greedy(hf, r, 12) for r in rows]


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
@torch.no_grad()
def test_the_one_call_paged_step_decodes_past_the_window(pairs, kind, monkeypatch):
    """Lone tokens of each sequence, then a run of one sequence's tokens past the window (each
    token of it attends alone, to its own window's keys), against transformers."""
    from kvtier.model.cpu_step import DecodeStep

    hf, lm = pairs(kind)
    if plan_for(lm.model) is None:
        pytest.skip("the one-call CPU step is not built here")
    served, real = [], DecodeStep.run_paged
    monkeypatch.setattr(DecodeStep, "run_paged", lambda self, *a, **kw: served.append(real(self, *a, **kw)) or served[-1])
    rows = prompts(9, [14, 11])
    caches = lm.model.make_caches(TIERS["paged"], batch_size=2)
    steps = generate_step(lm.model, rows, caches)
    got = torch.stack([next(steps) for _ in range(6)], 1).tolist()
    steps.close()
    assert len(served) >= 5 and all(x is not None for x in served)  # every decode step in one call
    assert got == [hf_greedy(hf, r, 6) for r in rows]
    table = caches[0].pool.block_tables[:1].repeat(3, 1).contiguous()  # three tokens of one sequence: a run
    run = real(plan_for(lm.model), torch.tensor([5, 6, 7]), torch.tensor([15, 16, 17]), table, caches)
    ids = torch.tensor([rows[0] + [got[0][0], 5, 6, 7]])  # (positions 0 .. 14 were written before)
    assert (run - hf(ids).logits[0, 15:]).abs().max() <= 1e-4


@pytest.mark.parametrize("tier", ["ragged", "paged"])
@torch.no_grad()
def test_speculative_rows_give_transformers_tokens(pairs, tier):
    hf, lm = pairs("mistral")
    rows = prompts(3, [6, 14])
    caches = lm.model.make_caches(TIERS[tier], batch_size=len(rows))
    out = [[] for _ in rows]
    for new in speculative_generate_step(lm.model, rows, caches, EarlyExitDrafter(lm.model, 1),
                                         speculative=SpeculativeConfig(draft_tokens=3, adaptive=False), max_tokens=14):
        for o, t in zip(out, new):
            o.extend(t)
    assert out == [hf_greedy(hf, r, 14) for r in rows]


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
@torch.no_grad()
def test_the_one_call_cpu_step_decodes_past_the_window_and_leaves_chunks_that_pass_it(pairs, kind):
    hf, lm = pairs(kind)
    step = plan_for(lm.model)
    if step is None:
        pytest.skip("the one-call CPU step is not built here")
    assert step.window == WINDOW
    ids = torch.tensor(prompts(4, [WINDOW + 6]))
    ref = hf(ids).logits[0]
    caches = lm.model.make_caches(TIERS["tail"])
    assert step.run(ids[:, :WINDOW], caches, 2) is not None  # the last position sees the whole window
    assert step.run(ids[:, WINDOW : WINDOW + 2], caches, 2) is None  # two tokens past it: not the step's
    assert caches[0].offset == WINDOW  # (nothing written)
    got = torch.cat([step.run(ids[:, t : t + 1], caches, 2)[0] for t in range(WINDOW, WINDOW + 6)])
    assert (got - ref[WINDOW:]).abs().max() <= 1e-4  # one token a call: each layer's last keys


# -- the kernels' side ------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_tokens", [None, 4])
def test_paged_reference_with_a_window_equals_sdpa_under_the_window_mask(chunk_tokens):
    g = torch.Generator().manual_seed(5)
    B, Hq, Hkv, D, bs, T, W = 3, 4, 2, 16, 4, 3, 6
    kv_len = torch.tensor([21, 9, 3])
    q_start = kv_len - T
    q = torch.randn(B, Hq, T, D, generator=g)
    k, v = (torch.randn(B, Hkv, 24, D, generator=g) for _ in range(2))
    # each row's 6 blocks scattered over a pool of 18, in shuffled order
    tables = torch.randperm(18, generator=g).view(B, 6).to(torch.int32).contiguous()
    pages = [torch.zeros(18, bs, Hkv, D) for _ in range(2)]
    for b in range(B):
        for j in range(6):
            for pool, x in zip(pages, (k, v)):
                pool[tables[b, j]] = x[b, :, j * bs : (j + 1) * bs].transpose(0, 1)
    codecs = select_codecs(D, torch.float32, None, None)
    got = paged_attention_reference(q, *pages, tables, q_start, kv_len, k_codec=codecs.k_codec,
                                    v_codec=codecs.v_codec, k_sidecars={}, v_sidecars={},
                                    chunk_tokens=chunk_tokens, window=W)
    mask = causal_mask(B, T, 24, q_start, kv_len, window=W)
    want = causal_attention(q, k, v, mask=mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(want, causal_attention(q, k, v, mask=causal_mask(B, T, 24, q_start, kv_len)))


@pytest.mark.parametrize("tier", ["ragged", "paged"])
def test_queries_past_the_committed_keys_keep_their_window(tier):
    """Six tokens written at 4..9, only 8 committed (a partial commit): the queries at 8 and 9 see
    keys 1..7 and 2..7 through a window of 8, though no row holds more than 8 keys."""
    from kvtier import PagedKVCache, RaggedBatchKVCache

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 10, 8, generator=g), torch.randn(1, 2, 10, 8, generator=g)
    q = torch.randn(1, 4, 6, 8, generator=g)
    cache = PagedKVCache(block_size=4, num_blocks=16) if tier == "paged" else RaggedBatchKVCache(batch_size=1)
    cache.update(k[:, :, :4], v[:, :, :4])
    cache.update(k[:, :, 4:], v[:, :, 4:], write_start=4, new_offsets=8)
    want = causal_attention(q, k[:, :, :8], v[:, :, :8], mask=causal_mask(1, 6, 8, 4, 8, window=8))
    torch.testing.assert_close(cache.attention(q, window=8), want, atol=1e-5, rtol=1e-5)


def test_a_window_mask_leaves_each_query_its_window():
    mask = causal_mask(1, 3, 10, 7, window=4)[0, 0]  # queries at 7, 8, 9
    assert [row.nonzero().flatten().tolist() for row in mask] == [[4, 5, 6, 7], [5, 6, 7, 8], [6, 7, 8, 9]]


def test_the_c_decode_kernel_serves_past_the_window_and_the_reference_the_chunks(pairs):
    hf, lm = pairs("mistral")
    caches = lm.model.make_caches(TIERS["paged"])
    ids = torch.tensor(prompts(6, [WINDOW + 7]))
    with torch.no_grad():
        got = [lm.model(ids[:, t : t + 1], caches)[0] for t in range(WINDOW + 4)]  # one token a call
        calls = dict(caches[1].paged_stats()["attention_calls_by_backend"])
        got.append(lm.model(ids[:, WINDOW + 4 :], caches)[0])  # three, past the window
    if not calls.get("cpu"):
        pytest.skip("the C attention kernel is not built here")
    assert calls == {"cpu": WINDOW + 4}, calls  # (every decode step, past the window too)
    assert caches[1].paged_stats()["attention_calls_by_backend"]["torch"] == 1
    assert (torch.cat(got) - hf(ids).logits[0]).abs().max() <= 1e-4


def test_the_c_decode_kernel_starts_each_row_at_its_first_key():
    from kvtier.kernels.cpu_attention import load_kernels, paged_decode_cpu

    if load_kernels() is None:
        pytest.skip("the C attention kernel is not built here")
    g = torch.Generator().manual_seed(2)
    B, Hq, Hkv, D, bs = 3, 4, 2, 64, 4
    kp, vp = torch.randn(12, bs, Hkv, D, generator=g), torch.randn(12, bs, Hkv, D, generator=g)
    tables = torch.randperm(12, generator=g)[:12].view(B, 4).to(torch.int32).contiguous()
    q = torch.randn(B, Hq, 1, D, generator=g)
    q_start, kv_len, first = torch.tensor([15, 9, 4]), torch.tensor([16, 10, 5]), torch.tensor([0, 3, 4])
    codecs = select_codecs(D, torch.float32, None, None)
    got = paged_decode_cpu(q, kp, vp, tables, q_start, kv_len, k_codec=codecs.k_codec, v_codec=codecs.v_codec,
                           k_sidecars={}, v_sidecars={}, first=first)
    k, v = (pool[tables.long()].reshape(B, 16, Hkv, D).transpose(1, 2) for pool in (kp, vp))
    seen = torch.arange(16) >= first[:, None]  # (and j <= q_start, j < kv_len: the causal mask's)
    want = causal_attention(q, k, v, mask=causal_mask(B, 1, 16, q_start, kv_len) & seen[:, None, None])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_planned_ragged_step_keeps_its_kernel_until_a_row_holds_more_than_the_window(pairs, monkeypatch):
    import kvtier.caches.ragged as ragged

    hf, lm = pairs("mistral")
    seen, real = [], ragged.ragged_attention
    monkeypatch.setattr(ragged, "ragged_attention", lambda *a, **kw: seen.append(kw["window"]) or real(*a, **kw))
    rows = prompts(8, [WINDOW - 2])
    steps = generate_step(lm.model, rows, lm.model.make_caches(TIERS["ragged"]))
    got = [int(next(steps)[0]) for _ in range(4)]  # decode steps over 6, 7, 8 and 9 keys
    steps.close()
    assert got == hf_greedy(hf, rows[0], 4)
    assert seen[-6::2] == [None, None, WINDOW]  # layer 1 of the steps over 7, 8 and 9 keys


def test_paged_calls_with_a_window_check_their_table_and_first_keys():
    from kvtier.kernels.cpu_attention import load_kernels, paged_decode_cpu

    codecs = select_codecs(16, torch.float32, None, None)
    kw = dict(k_codec=codecs.k_codec, v_codec=codecs.v_codec, k_sidecars={}, v_sidecars={})
    pages, q = torch.zeros(8, 4, 2, 16), torch.zeros(1, 4, 1, 16)
    narrow = torch.tensor([[0, 1, 2]], dtype=torch.int32)  # 20 keys need 5 blocks of 4
    with pytest.raises(ValueError, match="kv_len 20 needs 5 blocks but block_tables has 3 columns"):
        paged_attention_reference(q, pages, pages, narrow, torch.tensor([19]), torch.tensor([20]), window=4, **kw)
    if load_kernels() is None:
        return
    with pytest.raises(ValueError, match=r"first must be >= 0 per row .* got \[-1\]"):
        paged_decode_cpu(q, pages, pages, narrow, torch.tensor([3]), torch.tensor([4]), first=torch.tensor([-1]), **kw)
    g = torch.Generator().manual_seed(3)
    pages = torch.randn(8, 4, 2, 16, generator=g)
    wide = torch.randperm(8, generator=g).view(2, 4).to(torch.int32)
    q, start, n = torch.randn(2, 4, 1, 16, generator=g), torch.tensor([9, 5]), torch.tensor([10, 6])
    view = paged_decode_cpu(q, pages, pages, wide[:, :3], start, n, **kw)  # (a plan's view of the columns)
    assert view is not None and torch.equal(view, paged_decode_cpu(q, pages, pages, wide[:, :3].clone(), start, n, **kw))


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_a_bad_window_is_refused_naming_it(bad):
    from kvtier import TailOwnedKVCache

    cache = TailOwnedKVCache()
    cache.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))
    with pytest.raises(ValueError, match=rf"window must be a positive int .* got {bad!r}"):
        cache.attention(torch.zeros(1, 2, 1, 8), window=bad)
    with pytest.raises(ValueError, match=rf"sliding_window must be a positive int .* got {bad!r}"):
        ModelArgs(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=32, vocab_size=10, sliding_window=bad)
    for layers in ([1], 0, "0"):
        with pytest.raises(ValueError, match=r"sliding_layers must be layer indices in \[0, 1\)"):
            ModelArgs(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=32, vocab_size=10, sliding_window=4,
                      sliding_layers=layers)


@pytest.mark.parametrize("wide", [2**31, 2**63, 2**64 + 3])
def test_a_window_wider_than_the_kernels_hold_is_refused(wide):
    """A window past 32 bits is refused by the caches and by ``ModelArgs``, naming the fix (before:
    the CPU step held ``2**64 + 3`` as a window of 3 and ``2**63`` as a negative one, and the tail
    tier then generated other tokens than the model without a window). ``2**31 - 1`` is taken."""
    from kvtier import TailOwnedKVCache

    cache = TailOwnedKVCache()
    cache.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))
    with pytest.raises(ValueError, match=rf"^window {wide} is wider than any context .* pass None \(no window\)"):
        cache.attention(torch.zeros(1, 2, 1, 8), window=wide)
    shape = dict(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=32, vocab_size=10)
    with pytest.raises(ValueError, match=rf"^sliding_window {wide} is wider than any context"):
        ModelArgs(**shape, sliding_window=wide)
    assert ModelArgs(**shape, sliding_window=2**31 - 1).sliding_window == 2**31 - 1
    q = torch.randn(1, 2, 1, 8)
    assert torch.equal(cache.attention(q, window=2**31 - 1), cache.attention(q))


def test_fewer_layers_keep_the_windows_of_those_left():
    from kvtier.model import build_random

    args = ModelArgs(dim=16, n_layers=4, n_heads=2, n_kv_heads=1, hidden_dim=32, vocab_size=10, sliding_window=4,
                     sliding_layers=[0, 3])
    model = build_random(args, n_layers=2)
    assert model.args.sliding_layers == (0,)
    assert [ly.attention.window for ly in model.layers] == [4, None]
    assert ModelArgs.from_dict(args.to_dict()) == args  # (a JSON round trip: lists back to a tuple)
    assert ModelArgs.from_dict({**args.to_dict(), "sliding_layers": range(1, 4)}).sliding_layers == (1, 2, 3)


# -- on a GPU: the Triton kernels, past the window too ---------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tier", ["ragged", "paged"])
@torch.no_grad()
def test_on_cuda_the_kernels_and_graphs_give_transformers_logits_past_the_window(pairs, tier, tmp_path):
    hf, _ = pairs("mistral")
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, device="cuda", dtype=torch.float32, progress=False).model
    ids = torch.tensor(prompts(1, [40]))
    ref = hf(ids).logits[0]
    caches = model.make_caches(TIERS[tier])
    x = ids.cuda()
    got = [model(x[:, :5], caches)[0]] + [model(x[:, t : t + 1], caches)[0] for t in range(5, 40)]
    assert (torch.cat(got).cpu() - ref).abs().max() <= 2e-3
    calls = caches[0].dispatch.calls["attention"]
    # the kernels take the window (the ragged tier's only one query a row: its prompt, the reference)
    assert dict(calls) == ({"triton": 35, "torch": 1} if tier == "ragged" else {"triton": 36}), calls
    rows = prompts(2, [3, 19])  # the first row passes the window inside the graph's replays
    for graph in (True, False):  # a CUDA graph captured inside the window, eager steps
        steps = generate_step(model, rows, model.make_caches(TIERS[tier], batch_size=2), cuda_graph=graph,
                              max_steps=12)
        got = torch.stack([next(steps) for _ in range(10)], 1).tolist()
        steps.close()
        assert got == [hf_greedy(hf, r, 10) for r in rows], graph
    caches = model.make_caches(TIERS[tier])
    model(x[:, :3], caches)  # (3 tokens: every key inside the window when the graph is captured)
    decoder = CUDAGraphDecoder(model, caches, max_steps=12)
    logits = [decoder.step(x[:, t])[0, -1].clone() for t in range(3, 15)]  # (the graph's buffer: copied)
    assert decoder.captured and decoder.steps == 12
    torch.testing.assert_close(torch.stack(logits).cpu(), ref[3:15], atol=2e-3, rtol=0)
