"""PagedKVCache with quantised storage: contents, attention, bytes, persistence and fallback.

The reference for a quantised cache is the codec's own round trip of each token
(``decode(encode(x))``, a per-vector operation), kept per row in a list.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.caches.paged import PagedKVCache
from kvtier.caches.persist import load_cache, save_cache
from kvtier.config import KVCacheConfig, TurboQuantConfig, make_caches
from kvtier.kernels.reference import causal_attention
from kvtier.quant import Fp8Codec

H, D = 2, 64

MODES = {
    "q8": {"kv_quant": "q8"},
    "q4": {"kv_quant": "q4"},
    "q4_g32": {"kv_quant": "q4_g32"},
    "fp8": {"kv_quant": "fp8"},
    "tq_k8v3": {"turboquant": TurboQuantConfig("q8_0", "q3_0")},
    "tq_k5rv4": {"turboquant": TurboQuantConfig("q5_0", "q4_0", rotate_keys=True)},
    "tq_k4rv4": {"turboquant": TurboQuantConfig("q4_0", "q4_0", rotate_keys=True)},
}


def _ceil8(bits: int) -> int:
    return -(-bits // 8)


# bytes of one (token, head) vector of K and of V at head_dim D, from each layout's definition
LAYOUT_BYTES = {
    "q8": (D + 4, D + 4),  # int8 codes + fp32 scale
    "q4": (D // 2 + 4, D // 2 + 4),  # two nibbles a byte + fp32 scale
    "q4_g32": (D // 2 + D // 32 * 4,) * 2,  # nibbles + fp16 scale and zero per 32
    "fp8": (D + 4, D + 4),  # e4m3 bytes + fp32 scale
    "tq_k8v3": (D + D // 32 * 4, _ceil8(3 * D) + D // 32 * 2),  # keys: + scale, zero; values: + scale
    "tq_k5rv4": (_ceil8(5 * D) + D // 32 * 4, D // 2 + D // 32 * 2),
    "tq_k4rv4": (D // 2 + D // 32 * 4, D // 2 + D // 32 * 2),
}
EXPECTED_MODE = {"q8": "q8", "q4": "q4", "q4_g32": "q4_g32", "fp8": "fp8"}


def roundtrip(cache: PagedKVCache, x: torch.Tensor, which: str) -> torch.Tensor:
    """``x`` ``[H, n, D]`` through the cache's key or value codec."""
    codec = cache.codecs.k_codec if which == "k" else cache.codecs.v_codec
    return codec.roundtrip(x.transpose(0, 1)).transpose(0, 1)  # (n, H, D) -> (H, n, D)


def relative_mse(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(((x - y) ** 2).sum() / (x**2).sum())


@pytest.mark.parametrize("mode", list(MODES))
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_random_writes_match_the_codec_round_trip_per_row(mode, data):
    B = 2
    cache = PagedKVCache(4, 2, batch_size=B, dynamic=True, **MODES[mode])
    raw = [torch.zeros(H, 0, D) for _ in range(B)]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 999), label="seed"))
    for _ in range(data.draw(st.integers(1, 5), label="steps")):
        if cache.pool.allocated and data.draw(st.booleans(), label="trim?"):
            n = data.draw(st.integers(0, 3), label="trim")
            cache.trim(n)
            raw = [r[:, : max(0, r.shape[1] - n)] for r in raw]
            continue
        T = data.draw(st.integers(1, 6), label="T")
        ws = [data.draw(st.integers(0, r.shape[1]), label="write_start") for r in raw]
        new = [data.draw(st.integers(w, w + T), label="new_offsets") for w in ws]
        k = torch.randn(B, H, T, D, generator=gen)
        cache.update(k, -k, write_start=ws, new_offsets=new)
        raw = [torch.cat([raw[b][:, : ws[b]], k[b]], 1)[:, : new[b]] for b in range(B)]
    K, V = cache.fetch()
    assert cache.offset.tolist() == [r.shape[1] for r in raw]
    assert cache.paged_stats()["mode"] == EXPECTED_MODE.get(mode, "turboquant")
    for b, r in enumerate(raw):
        n = r.shape[1]
        torch.testing.assert_close(K[b, :, :n], roundtrip(cache, r, "k"))
        torch.testing.assert_close(V[b, :, :n], roundtrip(cache, -r, "v"))
        assert not K[b, :, n:].any() and not V[b, :, n:].any()
        if n:
            assert relative_mse(K[b, :, :n], r) < 0.1 and relative_mse(V[b, :, :n], -r) < 0.1


@pytest.mark.parametrize("mode", list(MODES))
def test_quantised_attention_equals_sdpa_over_the_dequantised_rows(seed, mode):
    cache = PagedKVCache(4, 32, batch_size=3, **MODES[mode])
    k, v = torch.randn(3, H, 9, D), torch.randn(3, H, 9, D)
    cache.update(k, v, new_offsets=[9, 4, 6])
    for T in (3, 1):  # a prefill chunk, then a decode step
        cache.update(torch.randn(3, H, T, D), torch.randn(3, H, T, D))
        q = torch.randn(3, 4, T, D)
        out = cache.attention(q)
        K, V = cache.fetch()  # dequantised
        for b, n in enumerate(cache.offset.tolist()):
            expect = causal_attention(q[b : b + 1], K[b : b + 1, :, :n], V[b : b + 1, :, :n])
            torch.testing.assert_close(out[b : b + 1], expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", list(MODES))
def test_nbytes_and_bytes_per_token_are_the_layout_arithmetic(mode):
    cache = PagedKVCache(16, 6, batch_size=2, **MODES[mode])
    cache.update(torch.randn(2, H, 3, D, dtype=torch.float16), torch.randn(2, H, 3, D, dtype=torch.float16))
    kb, vb = LAYOUT_BYTES[mode]
    s = cache.paged_stats()
    assert cache.nbytes == 6 * 16 * H * (kb + vb)
    assert s["bytes_per_token"] == H * (kb + vb)
    assert s["payload_bytes"] + s["sidecar_bytes"] == cache.nbytes and s["sidecar_bytes"] > 0
    assert s["bytes_per_live_token"] == cache.nbytes / 6


@pytest.mark.parametrize("mode", ["q8", "tq_k5rv4"])
def test_quantised_state_round_trips_exactly_through_a_file(seed, tmp_path, mode):
    cache = PagedKVCache(4, 8, batch_size=2, dynamic=True, **MODES[mode])
    cache.update(torch.randn(2, H, 11, D), torch.randn(2, H, 11, D), new_offsets=[11, 7])
    cache.release([1])
    save_cache(tmp_path / "kv.safetensors", [cache])
    (copy,), _ = load_cache(tmp_path / "kv.safetensors")
    assert isinstance(copy, PagedKVCache) and copy.meta_state == cache.meta_state
    for name, t in cache.state.items():
        assert torch.equal(copy.state[name], t), name
    k = torch.randn(2, H, 2, D)
    for c in (cache, copy):
        c.update(k, k)
    assert torch.equal(copy.fetch()[0], cache.fetch()[0]) and copy.pool.free == cache.pool.free


def test_extend_across_quantised_caches_copies_codes_exactly(seed):
    a = PagedKVCache(4, 8, **MODES["q4_g32"])
    b = PagedKVCache(4, 8, **MODES["q4_g32"])
    a.update(torch.randn(1, H, 5, D), torch.randn(1, H, 5, D))
    b.update(torch.randn(1, H, 6, D), torch.randn(1, H, 6, D))
    a.extend(b)
    assert torch.equal(a.fetch()[0][1, :, :6], b.fetch()[0][0])
    q8 = PagedKVCache.from_cache(b, block_size=4, num_blocks=8, kv_quant="q8")
    with pytest.raises(ValueError, match="storage"):
        a.extend(q8)


# -- fallback ---------------------------------------------------------------------------------
def generation_like(cache: PagedKVCache, head_dim: int, steps: int = 4) -> None:
    """A prefill then decode steps, each attention checked against SDPA over the dequantised rows."""
    for T in (7, *([1] * steps)):
        k, v = torch.randn(1, H, T, head_dim), torch.randn(1, H, T, head_dim)
        cache.update(k, v)
        q = torch.randn(1, 4, T, head_dim)
        K, V = cache.fetch()
        torch.testing.assert_close(cache.attention(q), causal_attention(q, K, V), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_quant, expect", [(None, "fp"), ("q8", "q8")])
def test_turboquant_at_head_dim_96_falls_back_warns_once_and_completes(seed, kv_quant, expect):
    cache = PagedKVCache(4, 16, kv_quant=kv_quant, turboquant=TurboQuantConfig())
    with pytest.warns(RuntimeWarning, match="TurboQuant cannot serve") as caught:
        generation_like(cache, 96)
    assert len([w for w in caught if "cannot serve" in str(w.message)]) == 1
    s = cache.paged_stats()
    assert s["mode"] == expect and "96" in s["turboquant_disabled_reason"]
    assert s["kv_quant_disabled_reason"] is None
    assert cache.offset.tolist() == [11]


def test_q4_at_an_odd_head_dim_falls_back_to_full_precision(seed):
    cache = PagedKVCache(4, 16, kv_quant="q4")
    with pytest.warns(RuntimeWarning, match="kv_quant=q4"):
        generation_like(cache, 63, steps=1)
    s = cache.paged_stats()
    assert s["mode"] == "fp" and s["kv_quant_disabled_reason"] and s["turboquant_disabled_reason"] is None


def test_a_codec_module_that_will_not_import_falls_back(seed, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvtier.quant", None)  # any import of it now fails
    cache = PagedKVCache(4, 16, kv_quant="q8", turboquant=TurboQuantConfig())
    with pytest.warns(RuntimeWarning):
        generation_like(cache, D, steps=1)
    s = cache.paged_stats()
    assert s["mode"] == "fp"
    assert "not available" in s["turboquant_disabled_reason"] and "not available" in s["kv_quant_disabled_reason"]


def test_no_warning_when_the_requested_mode_serves(seed):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generation_like(PagedKVCache(4, 16, **MODES["tq_k8v3"]), D, steps=1)


def test_config_from_environment_builds_a_quantised_paged_cache(seed):
    cfg = KVCacheConfig.from_env({"KVTIER_PAGED_ATTN": "1", "KVTIER_PAGED_KV_QUANT": "q8",
                                  "KVTIER_PAGED_BLOCK_SIZE": "8", "KVTIER_PAGED_NUM_BLOCKS": "4"})
    (cache,) = make_caches(1, cfg, batch_size=2)
    cache.update(torch.randn(2, H, 3, D), torch.randn(2, H, 3, D))
    s = cache.paged_stats()
    assert (s["mode"], s["block_size"], s["allocated_blocks"]) == ("q8", 8, 4)


# -- fp8 key centre ------------------------------------------------------------------------------
def test_fp8_cache_codes_keys_against_the_first_keys_mean(seed, tmp_path):
    """The first write fixes the key centre; keys read back closer than without it, attention
    over the pages equals SDPA over the rows read back, and the centre travels with the state."""
    g = torch.Generator().manual_seed(0)
    offsets = 6 * torch.randn(1, H, 1, D, generator=g)
    k1, v1 = torch.randn(2, H, 9, D, generator=g) + offsets, torch.randn(2, H, 9, D, generator=g)
    cache = PagedKVCache(4, 32, batch_size=2, kv_quant="fp8")
    cache.update(k1, v1)
    codec = cache.codecs.k_codec
    torch.testing.assert_close(codec.centre, k1.mean(dim=(0, 2)))
    assert cache.codecs.v_codec.centre is None
    k2 = torch.randn(2, H, 3, D, generator=g) + offsets
    cache.update(k2, torch.randn(2, H, 3, D, generator=g))
    K, V = cache.fetch()
    raw = torch.cat([k1, k2], 2)
    plain = Fp8Codec(D, torch.float32)
    plain_err = relative_mse(plain.roundtrip(raw.transpose(1, 2)).transpose(1, 2), raw)
    assert relative_mse(K, raw) < 0.5 * plain_err
    q = torch.randn(2, 4, 3, D, generator=g)  # the last write's 3 positions
    torch.testing.assert_close(cache.attention(q), causal_attention(q, K, V), atol=1e-5, rtol=1e-5)
    assert torch.equal(cache.state["k_centre"], codec.centre)
    save_cache(tmp_path / "kv.safetensors", [cache])
    (copy,), _ = load_cache(tmp_path / "kv.safetensors")
    assert torch.equal(copy.codecs.k_codec.centre, codec.centre)
    assert torch.equal(copy.fetch()[0], K)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_key_in_one_row_leaves_the_fp8_centre_and_other_rows_finite(seed, tmp_path, bad):
    """The centre is the mean of the first write's finite keys: one row's NaN or inf (a float16
    overflow in one request) stays in that row, as with every other codec, and the cache saves
    and loads."""
    g = torch.Generator().manual_seed(1)
    k1, v1 = torch.randn(2, H, 5, D, generator=g) + 2, torch.randn(2, H, 5, D, generator=g)
    k1[0, 0, 2, 3] = bad
    cache = PagedKVCache(4, 32, batch_size=2, kv_quant="fp8")
    cache.update(k1, v1)
    good = torch.isfinite(k1)
    expected = torch.where(good, k1, 0).sum(dim=(0, 2)) / good.sum(dim=(0, 2))
    torch.testing.assert_close(cache.codecs.k_codec.centre, expected)
    k2 = torch.randn(2, H, 3, D, generator=g) + 2
    cache.update(k2, torch.randn(2, H, 3, D, generator=g))
    K, _ = cache.fetch()
    assert torch.isfinite(K[1]).all() and torch.isfinite(K[0, 1:]).all()
    assert relative_mse(K[1], torch.cat([k1, k2], 2)[1]) < 1e-3
    assert torch.isfinite(cache.attention(torch.randn(2, 4, 3, D, generator=g))[1]).all()
    save_cache(tmp_path / "kv.safetensors", [cache])
    (copy,), _ = load_cache(tmp_path / "kv.safetensors")
    assert torch.equal(copy.fetch()[0][1], K[1])


def test_fp8_caches_with_other_centres_do_not_extend(seed):
    a = PagedKVCache(4, 16, kv_quant="fp8")
    b = PagedKVCache(4, 16, kv_quant="fp8")
    a.update(torch.randn(1, H, 5, D), torch.randn(1, H, 5, D))
    b.update(torch.randn(1, H, 6, D) + 3, torch.randn(1, H, 6, D))
    with pytest.raises(ValueError, match="key centre"):
        a.extend(b)
    state = dict(a.state)
    state["k_centre"] = state["k_centre"][:1]
    with pytest.raises(ValueError, match="k_centre"):
        PagedKVCache.from_state(state, a.meta_state)
    del state["k_centre"]  # keys without the centre they were coded against: decoded wrongly before
    with pytest.raises(ValueError, match="state holds fp8 keys but no k_centre"):
        PagedKVCache.from_state(state, a.meta_state)
    unwritten = PagedKVCache(4, 16, kv_quant="fp8")  # no keys yet, so no centre: still loads
    assert PagedKVCache.from_state(unwritten.state, unwritten.meta_state).size() == 0
