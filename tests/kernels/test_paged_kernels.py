"""The paged reference kernels against SDPA, and the backend dispatch with its fallback."""

from __future__ import annotations

import importlib
import types
import warnings

import pytest
import torch

from kvtier.config import TurboQuantConfig
from kvtier.kernels import paged as kp
from kvtier.kernels.dispatch import KernelDispatch
from kvtier.kernels.reference import causal_attention
from kvtier.quant import make_codecs
from kvtier.quant.codec import IdentityCodec

H, D = 2, 16


def scattered_pages(lengths, block_size, num_blocks, seed=0):
    """Rows of ``lengths`` tokens written to shuffled physical blocks.

    Returns (key_pages, value_pages, block_tables, K rows, V rows) with the rows
    as contiguous ``[1, H, n, D]`` tensors for the SDPA reference.
    """
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    B = len(lengths)
    nb = [-(-n // block_size) for n in lengths]
    tables = torch.zeros(B, max(nb), dtype=torch.int32)
    kpages = torch.randn(num_blocks, block_size, H, D, generator=g) * 100  # garbage must stay unseen
    vpages = torch.randn(num_blocks, block_size, H, D, generator=g) * 100
    ks, vs = [], []
    for b, n in enumerate(lengths):
        ids = [perm.pop() for _ in range(nb[b])]
        tables[b, : nb[b]] = torch.tensor(ids, dtype=torch.int32)
        k, v = torch.randn(1, H, n, D, generator=g), torch.randn(1, H, n, D, generator=g)
        slots = torch.tensor([ids[p // block_size] * block_size + p % block_size for p in range(n)])
        codec = IdentityCodec(D, torch.float32)
        kp.paged_write_reference(kpages, vpages, {}, {}, slots, k, v, k_codec=codec, v_codec=codec)
        ks.append(k)
        vs.append(v)
    return kpages, vpages, tables, ks, vs


def record_gathers(monkeypatch) -> list[tuple[int, int]]:
    """Make ``gather_pages`` record the shape ``(rows, blocks)`` of each block-id table it is
    given (in call order) and go on as before; returns the record."""
    calls, real = [], kp.gather_pages

    def recording(pages, sidecars, ids, *, codec, first_block=None):
        calls.append(tuple(ids.shape))
        return real(pages, sidecars, ids, codec=codec, first_block=first_block)

    monkeypatch.setattr(kp, "gather_pages", recording)
    return calls


def reference_equals_sdpa(lengths, T, hq, block_size, chunk_tokens) -> torch.Tensor:
    """The reference over scattered pages, row ``b``'s queries ending at its length, checked
    row by row against SDPA over the row's contiguous K/V; returns the output."""
    kpages, vpages, tables, ks, vs = scattered_pages(lengths, block_size, 64)
    q_start = torch.tensor([n - T for n in lengths])
    q = torch.randn(len(lengths), hq, T, D)
    codec = IdentityCodec(D, torch.float32)
    out = kp.paged_attention_reference(
        q, kpages, vpages, tables, q_start, torch.tensor(lengths), k_codec=codec, v_codec=codec,
        k_sidecars={}, v_sidecars={}, chunk_tokens=chunk_tokens,
    )
    for b in range(len(lengths)):
        expect = causal_attention(q[b : b + 1], ks[b], vs[b], q_start=int(q_start[b]))
        torch.testing.assert_close(out[b : b + 1], expect, atol=1e-5, rtol=1e-5)
    return out


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("chunk_tokens", [1, 8, 1024])
@pytest.mark.parametrize("hq", [2, 8])
def test_reference_attention_equals_sdpa_over_contiguous_rows(seed, block_size, chunk_tokens, hq):
    out = reference_equals_sdpa([1, 16, 23, 9], 3, hq, block_size, chunk_tokens)
    assert not out[0, :, :2].any()  # row 0's first queries see nothing


def test_reference_decodes_a_bounded_chunk_at_a_time(seed, monkeypatch):
    kpages, vpages, tables, _, _ = scattered_pages([40, 33], 4, 32)
    gathers = record_gathers(monkeypatch)
    codec = IdentityCodec(D, torch.float32)
    kp.paged_attention_reference(
        torch.randn(2, 2, 1, D), kpages, vpages, tables, torch.tensor([39, 32]),
        torch.tensor([40, 33]), k_codec=codec, v_codec=codec, k_sidecars={}, v_sidecars={},
        chunk_tokens=8,
    )
    widths = [nb * 4 for _, nb in gathers]  # tokens per gather (blocks of 4)
    assert max(widths) == 8 and sum(widths) == 2 * 40  # K and V, 10 blocks each, two at a time


@pytest.mark.parametrize("hq", [2, 8])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_a_decode_step_of_rows_of_different_lengths_attends_row_by_row(seed, monkeypatch, hq, block_size):
    """T == 1, every query at its row's end: each row gathered to its own length and attended
    without a mask; equal to SDPA over the row and to the general (chunked, masked) path."""
    lengths = [23, 1, 30, 9]  # 63 blocks of 1 at most: the 64 that scattered_pages makes
    out = reference_equals_sdpa(lengths, 1, hq, block_size, None)  # the row-by-row path
    kpages, vpages, tables, _, _ = scattered_pages(lengths, block_size, 64)
    q = torch.randn(len(lengths), hq, 1, D)
    codec = IdentityCodec(D, torch.float32)
    args = (q, kpages, vpages, tables, torch.tensor([n - 1 for n in lengths]), torch.tensor(lengths))
    kw = dict(k_codec=codec, v_codec=codec, k_sidecars={}, v_sidecars={})
    gathers = record_gathers(monkeypatch)
    rows = kp.paged_attention_reference(*args, **kw)
    assert sorted(gathers) == sorted((1, -(-n // block_size)) for n in lengths for _ in "kv")  # own blocks only
    general = kp.paged_attention_reference(*args, **kw, chunk_tokens=8)  # chunks of 8 < 30: the masked path
    torch.testing.assert_close(rows, general, atol=1e-5, rtol=1e-5)
    assert out.shape == (len(lengths), hq, 1, D)


@pytest.mark.parametrize("block_size", [1, 4])
def test_prompt_chunks_row_by_row_equal_sdpa_and_the_masked_path(seed, block_size):
    """Packed prompt chunks laid out in padded rows: from empty and shorter than the padded
    width (causal, then the padding queries see every key), from empty and longer than T,
    and a chunk after earlier tokens (masked): each row against SDPA and the general path."""
    lengths, starts, T = [5, 12, 9], [0, 0, 4], 8
    kpages, vpages, tables, ks, vs = scattered_pages(lengths, block_size, 64)
    q = torch.randn(len(lengths), 4, T, D)
    codec = IdentityCodec(D, torch.float32)
    args = (q, kpages, vpages, tables, torch.tensor(starts), torch.tensor(lengths))
    kw = dict(k_codec=codec, v_codec=codec, k_sidecars={}, v_sidecars={})
    rows = kp.paged_attention_reference(*args, **kw)
    for b, start in enumerate(starts):
        expect = causal_attention(q[b : b + 1], ks[b], vs[b], q_start=start)
        torch.testing.assert_close(rows[b : b + 1], expect, atol=1e-5, rtol=1e-5)
    general = kp.paged_attention_reference(*args, **kw, chunk_tokens=4)  # past the budget: masked chunks
    torch.testing.assert_close(rows, general, atol=1e-5, rtol=1e-5)


def test_decode_rows_longer_than_the_budget_take_the_chunked_path(seed, monkeypatch):
    kpages, vpages, tables, _, _ = scattered_pages([40, 33], 4, 32)
    monkeypatch.setattr(kp, "_attend_rows", lambda *a, **k: pytest.fail("row by row past the budget"))
    codec = IdentityCodec(D, torch.float32)
    kp.paged_attention_reference(
        torch.randn(2, 2, 1, D), kpages, vpages, tables, torch.tensor([39, 32]), torch.tensor([40, 33]),
        k_codec=codec, v_codec=codec, k_sidecars={}, v_sidecars={}, chunk_tokens=16)


def test_a_decode_row_that_sees_no_key_gets_zeros_row_by_row(seed):
    kpages, vpages, tables, _, _ = scattered_pages([5, 7], 4, 16)
    codec = IdentityCodec(D, torch.float32)
    out = kp.paged_attention_reference(
        torch.randn(2, 2, 1, D), kpages, vpages, tables, torch.tensor([0, 6]), torch.tensor([0, 7]),
        k_codec=codec, v_codec=codec, k_sidecars={}, v_sidecars={})
    assert not out[0].any() and out[1].abs().sum() > 0


@pytest.mark.parametrize("chunk_tokens", [8, 1024])
@pytest.mark.parametrize("T", [1, 2])
def test_reference_decode_rows_that_see_whole_chunks_equal_sdpa(seed, chunk_tokens, T):
    # every query sees its row's keys up to itself: chunks below the shortest row need no mask
    reference_equals_sdpa([23, 9, 16], T, 4, 4, chunk_tokens)


@pytest.mark.parametrize("kv_quant", [None, "q8"])
def test_one_row_on_consecutive_blocks_is_read_as_a_view(seed, monkeypatch, kv_quant):
    kc, vc = make_codecs(D, torch.float32, kv_quant=kv_quant)
    N, bs, n = 12, 4, 19
    kpages = torch.randn(N, bs, H, kc.packed_dim()).to(kc.payload_dtype)
    vpages = kpages.clone()
    ksc = {s.name: torch.rand(N, bs, H, s.groups).to(s.dtype) + 0.5 for s in kc.sidecar_specs()}
    vsc = {name: t.clone() for name, t in ksc.items()}
    keys, values = torch.randn(1, H, n, D), torch.randn(1, H, n, D)
    ids = [3, 4, 5, 6, 7]  # consecutive physical blocks
    slots = torch.tensor([ids[p // bs] * bs + p % bs for p in range(n)])
    kp.paged_write_reference(kpages, vpages, ksc, vsc, slots, keys, values, k_codec=kc, v_codec=vc)
    tables = torch.tensor([ids], dtype=torch.int32)
    assert kp.consecutive_blocks(tables) == 3
    assert kp.consecutive_blocks(tables.flip(1)) is None
    assert kp.consecutive_blocks(torch.cat([tables, tables])) is None  # several rows: gathered
    calls = []
    real = kp.gather_pages

    def recording(pages, sidecars, block_ids, *, codec, first_block=None):
        calls.append((block_ids.shape[1], first_block))
        out = real(pages, sidecars, block_ids, codec=codec, first_block=first_block)
        if first_block is not None and codec.lossless:
            assert out.data_ptr() == pages[first_block].data_ptr()  # the pages themselves
        return out

    monkeypatch.setattr(kp, "gather_pages", recording)
    q = torch.randn(1, 4, 1, D)
    out = kp.paged_attention_reference(
        q, kpages, vpages, tables, torch.tensor([n - 1]), torch.tensor([n]), k_codec=kc,
        v_codec=vc, k_sidecars=ksc, v_sidecars=vsc, chunk_tokens=8,
    )
    k = kc.decode(kpages.view(-1, H, kc.packed_dim())[slots], {m: t.view(-1, H, t.shape[3])[slots]
                                                               for m, t in ksc.items()})
    v = vc.decode(vpages.view(-1, H, vc.packed_dim())[slots], {m: t.view(-1, H, t.shape[3])[slots]
                                                               for m, t in vsc.items()})
    expect = causal_attention(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None])
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
    assert all(first is not None for _, first in calls)
    if kv_quant is None:
        assert [w for w, _ in calls] == [5, 5]  # a view copies nothing: one chunk of all blocks
    else:
        assert max(w for w, _ in calls) == 2  # decoded codes stay bounded: 8 tokens a chunk


def test_fused_partial_attention_equals_the_plain_arithmetic(seed):
    from kvtier.kernels.reference import partial_attention

    q, k, v = torch.randn(2, 6, 3, D), torch.randn(2, 2, 11, D), torch.randn(2, 2, 11, D)
    mask = torch.rand(2, 1, 3, 11) > 0.4
    mask[1, :, 0] = False  # a query that sees nothing in this chunk
    for m in (mask, None):
        out, lse = kp.fused_partial_attention(q, k, v, m, 0.3)
        ref_out, ref_lse = partial_attention(q, k, v, m, 0.3)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    assert torch.isneginf(kp.fused_partial_attention(q, k, v, mask)[1][1, :, 0]).all()


def test_write_fills_exactly_the_named_slots_with_codes_and_sidecars(seed):
    kc, vc = make_codecs(32, torch.float32, kv_quant="q8")
    N, bs = 6, 4
    kpages = torch.zeros(N, bs, H, kc.packed_dim(), dtype=kc.payload_dtype)
    vpages = torch.zeros_like(kpages)
    ksc = {s.name: torch.zeros(N, bs, H, s.groups, dtype=s.dtype) for s in kc.sidecar_specs()}
    vsc = {n: torch.zeros_like(t) for n, t in ksc.items()}
    keys, values = torch.randn(2, H, 3, 32), torch.randn(2, H, 3, 32)
    slots = torch.tensor([5, 6, 7, 20, 21, 0])  # row 0 in block 1; row 1 in blocks 5 and 0
    kp.paged_write_reference(kpages, vpages, ksc, vsc, slots, keys, values, k_codec=kc, v_codec=vc)
    flat_k = kpages.view(-1, H, kc.packed_dim())
    payload, side = kc.encode(keys.transpose(1, 2).reshape(6, H, 32))
    assert torch.equal(flat_k[slots], payload)
    assert torch.equal(ksc["scale"].view(-1, H, 1)[slots], side["scale"])
    untouched = torch.ones(N * bs, dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not ksc["scale"].view(-1, H, 1)[untouched].any()


def test_gather_rows_pads_past_each_length_with_zeros(seed):
    kpages, _, tables, ks, _ = scattered_pages([5, 2], 4, 8)
    out = kp.gather_rows(kpages, {}, tables, torch.tensor([5, 2]), 6, codec=IdentityCodec(D, torch.float32))
    assert out.shape == (2, H, 6, D)
    assert torch.equal(out[0, :, :5], ks[0][0]) and torch.equal(out[1, :, :2], ks[1][0])
    assert not out[0, :, 5:].any() and not out[1, :, 2:].any()


@pytest.mark.parametrize(
    "bad, word",
    [
        ({"block_tables": torch.zeros(2, 4, dtype=torch.int64)}, "int32"),
        ({"q_start": torch.zeros(3, dtype=torch.long)}, "q_start"),
        ({"kv_len": torch.zeros(2)}, "kv_len"),
        ({"q": torch.randn(2, 3, 1, D)}, "multiple"),
        ({"kv_len": torch.tensor([40, 1])}, "columns"),
    ],
)
def test_reference_attention_rejects_bad_arguments(bad, word):
    codec = IdentityCodec(D, torch.float32)
    args = {
        "q": torch.randn(2, 2, 1, D),
        "key_pages": torch.zeros(8, 4, H, D),
        "value_pages": torch.zeros(8, 4, H, D),
        "block_tables": torch.zeros(2, 4, dtype=torch.int32),
        "q_start": torch.zeros(2, dtype=torch.long),
        "kv_len": torch.ones(2, dtype=torch.long),
    } | bad
    with pytest.raises(ValueError, match=word):
        kp.paged_attention_reference(**args, k_codec=codec, v_codec=codec, k_sidecars={}, v_sidecars={})


# -- through the dispatch -------------------------------------------------------------------------
def _dispatch_args(seed=0):
    kpages, vpages, tables, ks, vs = scattered_pages([6, 3], 4, 8, seed)
    codec = IdentityCodec(D, torch.float32)
    q = torch.randn(2, 4, 1, D)
    args = (q, kpages, vpages, tables, torch.tensor([5, 2]), torch.tensor([6, 3]))
    kw = {"k_codec": codec, "v_codec": codec, "k_sidecars": {}, "v_sidecars": {}}
    return args, kw


def test_a_triton_backend_that_serves_is_counted(monkeypatch):
    fake = types.SimpleNamespace(
        paged_attention_triton=lambda *a, **kw: kp.paged_attention_reference(*a, **kw) + 0,
        paged_write_triton=kp.paged_write_reference,
    )
    monkeypatch.setattr(kp, "_import_triton", lambda: fake)
    d = KernelDispatch("triton")
    args, kw = _dispatch_args()
    out = kp.paged_attention(d, *args, **kw)
    torch.testing.assert_close(out, kp.paged_attention_reference(*args, **kw))
    assert d.attention_calls == {"triton": 1} and d.fallback_reasons == {}


def test_writes_through_the_dispatch_equal_the_reference_and_fall_back_on_their_own(monkeypatch):
    def broken_write(*a, **kw):
        raise RuntimeError("simulated write failure")

    fake = types.SimpleNamespace(paged_attention_triton=kp.paged_attention_reference,
                                 paged_write_triton=broken_write)
    monkeypatch.setattr(kp, "_import_triton", lambda: fake)
    codec = IdentityCodec(D, torch.float32)
    k, v = torch.randn(2, H, 3, D), torch.randn(2, H, 3, D)
    slots = torch.tensor([4, 5, 6, 9, 10, 11])
    want = [torch.zeros(4, 4, H, D) for _ in range(2)]
    kp.paged_write_reference(*want, {}, {}, slots, k, v, k_codec=codec, v_codec=codec)
    got = [torch.zeros(4, 4, H, D) for _ in range(2)]
    d = KernelDispatch("triton")
    with pytest.warns(RuntimeWarning, match="kvtier paged write fell back.*simulated write failure"):
        kp.paged_write(d, *got, {}, {}, slots, k, v, k_codec=codec, v_codec=codec)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert d.write_calls == {"torch": 1} and list(d.fallback_reasons) == ["write"]
    args, kw = _dispatch_args()
    kp.paged_attention(d, *args, **kw)  # attention still goes to its kernel
    assert d.attention_calls == {"triton": 1}


@pytest.mark.parametrize("failure", ["import", "launch"])
def test_a_failing_triton_backend_falls_back_once_with_a_reason(monkeypatch, failure):
    def broken_import():
        raise ImportError("No module named 'kvtier.kernels.triton_paged'")

    def broken_launch(*a, **kw):
        raise RuntimeError("simulated compile error")

    fake = types.SimpleNamespace(paged_attention_triton=broken_launch, paged_write_triton=broken_launch)
    monkeypatch.setattr(kp, "_import_triton", broken_import if failure == "import" else lambda: fake)
    d = KernelDispatch("triton")
    args, kw = _dispatch_args()
    with pytest.warns(RuntimeWarning, match="fell back"):
        out = kp.paged_attention(d, *args, **kw)
    torch.testing.assert_close(out, kp.paged_attention_reference(*args, **kw))
    assert ("ImportError" if failure == "import" else "simulated") in d.fallback_reasons["attention"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kp.paged_attention(d, *args, **kw)  # no second attempt, no second warning
    assert d.attention_calls == {"torch": 2} and "write" not in d.fallback_reasons


def test_the_cache_counts_calls_by_the_backend_that_served(seed, monkeypatch):
    from kvtier.caches.paged import PagedKVCache

    calls = []

    def counting_attention(*a, **kw):
        calls.append(1)
        return kp.paged_attention_reference(*a, **kw)

    fake = types.SimpleNamespace(paged_attention_triton=counting_attention,
                                 paged_write_triton=kp.paged_write_reference)
    monkeypatch.setattr(kp, "_import_triton", lambda: fake)
    cache = PagedKVCache(4, 8, attention_backend="triton")
    cache.update(torch.randn(1, H, 5, D), torch.randn(1, H, 5, D))
    cache.attention(torch.randn(1, 4, 5, D))
    s = cache.paged_stats()
    assert s["attention_calls_by_backend"] == {"triton": 1} and calls == [1]
    assert s["write_calls_by_backend"] == {"triton": 1}


# -- the cache over the real Triton kernels (interpreter on the CPU, CUDA on a GPU) ---------------------
def _kernels_run_on(device: str) -> bool:
    try:
        tp = importlib.import_module("kvtier.kernels.triton_paged")
    except Exception:  # no triton, or kernels that do not import here
        return False
    return tp.interpreted() == (device == "cpu")


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
)
@pytest.mark.parametrize("mode", [{}, {"kv_quant": "q8"}, {"turboquant": TurboQuantConfig()}])
def test_cache_over_the_triton_kernels_matches_the_reference_backend(seed, device, mode):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not _kernels_run_on(device):
        pytest.skip(f"the Triton kernels do not run on {device} in this process "
                    "(on the CPU they need TRITON_INTERPRET=1 before they are imported)")
    from kvtier.caches.paged import PagedKVCache

    fast = PagedKVCache(16, 8, batch_size=2, attention_backend="triton", **mode)
    ref = PagedKVCache(16, 8, batch_size=2, attention_backend="torch", **mode)
    for T, new in ((20, [20, 13]), (1, None), (3, None)):
        k, v, q = (torch.randn(2, n, T, 64, device=device) for n in (2, 2, 4))
        for c in (fast, ref):
            c.update(k, v, new_offsets=new)
        torch.testing.assert_close(fast.attention(q), ref.attention(q), atol=2e-3, rtol=2e-3)
    assert torch.equal(fast.key_cache, ref.key_cache) and torch.equal(fast.value_cache, ref.value_cache)
    s = fast.paged_stats()
    assert s["attention_calls_by_backend"] == {"triton": 3} and s["write_calls_by_backend"] == {"triton": 3}
