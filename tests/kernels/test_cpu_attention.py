"""The C decode kernel for the CPU against the PyTorch reference, its refusals and its dispatch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.kernels import cpu_attention
from kvtier.kernels.cpu_attention import load_kernels, paged_decode_cpu
from kvtier.kernels.dispatch import KernelDispatch
from kvtier.kernels.paged import paged_attention, paged_attention_reference
from kvtier.quant.codec import IdentityCodec
from kvtier.quant.fp8 import Fp8Codec
from kvtier.quant.kv_quant import Q4Codec, Q8Codec


@pytest.fixture(scope="module", autouse=True)
def kernels():
    k = load_kernels()
    if k is None:
        pytest.skip("no C compiler builds the CPU decode kernel here")
    return k


def paged_rows(lengths, Hq, Hkv, D, bs, *, seed=0, spare_blocks=3):
    """Random pages holding rows of ``lengths`` in shuffled blocks, and one query per row."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lengths]
    total = sum(need) + spare_blocks
    order = torch.randperm(total, generator=g)
    width = max([*need, 1]) + 1  # a spare column: tables are wider than the rows
    tables = torch.full((len(lengths), width), -1, dtype=torch.int32)  # unused entries: invalid
    at = 0
    for b, k in enumerate(need):
        tables[b, :k] = order[at : at + k]
        at += k
    kp = torch.randn(total, bs, Hkv, D, generator=g)
    vp = torch.randn(total, bs, Hkv, D, generator=g)
    q = torch.randn(len(lengths), Hq, 1, D, generator=g)
    return q, kp, vp, tables


def codecs(D):
    c = IdentityCodec(D, torch.float32)
    return dict(k_codec=c, v_codec=c, k_sidecars={}, v_sidecars={})


def coded_pages(kp, vp, mode="q8"):
    """The same pages coded as ``q8`` or ``fp8`` (one byte an element, a float32 scale per
    token and head); ``fp8-centred``: keys with per-channel offsets, coded against a centre."""
    D = kp.shape[3]
    kc, vc = (Q8Codec(D, torch.float32), Q8Codec(D, torch.float32)) if mode == "q8" else (
        Fp8Codec(D, torch.float32), Fp8Codec(D, torch.float32))
    if mode == "fp8-centred":
        kp = kp + 6 * torch.randn(1, 1, kp.shape[2], D, generator=torch.Generator().manual_seed(5))
        kc.set_centre(kp.reshape(1, -1, kp.shape[2], D).transpose(1, 2))  # (1, H, tokens, D)
    (kq, ks), (vq, vs) = kc.encode(kp), vc.encode(vp)
    return kq, vq, dict(k_codec=kc, v_codec=vc, k_sidecars=ks, v_sidecars=vs)


def q8_pages(kp, vp):
    return coded_pages(kp, vp, "q8")


@pytest.mark.parametrize("Hq, Hkv", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("D, bs", [(64, 16), (128, 32), (32, 1)])
@pytest.mark.parametrize("lengths", [[1], [300], [17, 0, 64, 5], [64 + 16 * i for i in range(32)]])
def test_decode_matches_the_reference(Hq, Hkv, D, bs, lengths):
    q, kp, vp, tables = paged_rows(lengths, Hq, Hkv, D, bs)
    kv_len = torch.tensor(lengths)
    q_start = (kv_len - 1).clamp(min=0)
    out = paged_decode_cpu(q, kp, vp, tables, q_start, kv_len, **codecs(D))
    ref = paged_attention_reference(q, kp, vp, tables, q_start, kv_len, **codecs(D))
    assert out.shape == (len(lengths), Hq, 1, D) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for b, n in enumerate(lengths):
        if n == 0:
            assert torch.equal(out[b], torch.zeros(Hq, 1, D))  # a row with no key: zeros


@pytest.mark.parametrize("mode", ["q8", "fp8", "fp8-centred"])
@pytest.mark.parametrize("Hq, Hkv, D", [(9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("lengths", [[1], [300], [17, 0, 64, 5], [64 + 16 * i for i in range(32)]])
def test_coded_pages_match_the_reference(mode, Hq, Hkv, D, lengths):
    """Byte codes read in place, each key's scale on its score and each value's on its weight;
    fp8's key centre left out (it moves every score of a query alike)."""
    q, kp, vp, tables = paged_rows(lengths, Hq, Hkv, D, 16)
    kq, vq, kw = coded_pages(kp, vp, mode)
    assert (kw["k_codec"].centre is not None) == (mode == "fp8-centred")
    kv_len = torch.tensor(lengths)
    q_start = (kv_len - 1).clamp(min=0)
    d = KernelDispatch("auto")
    out = paged_attention(d, q, kq, vq, tables, q_start, kv_len, **kw)
    assert d.attention_calls == {"cpu": 1}
    ref = paged_attention_reference(q, kq, vq, tables, q_start, kv_len, **kw)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    if mode != "fp8-centred":  # and the codes are close to the float32 pages
        fp = paged_attention_reference(q, kp, vp, tables, q_start, kv_len, **codecs(D))
        assert (out - fp).abs().max() < 0.05 * fp.abs().max() + 0.02  # e4m3 keeps 3 mantissa bits


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 90), min_size=1, max_size=9),
    limits=st.lists(st.integers(-1, 100), min_size=9, max_size=9),
    group=st.sampled_from([(2, 1), (6, 2), (3, 3)]),
    bs=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_causal_limits_inside_the_rows_match_the_reference(lengths, limits, group, bs, seed):
    """``q_start`` below ``kv_len - 1`` (a query in the middle of its row) limits the keys seen."""
    Hq, Hkv = group
    q, kp, vp, tables = paged_rows(lengths, Hq, Hkv, 16, bs, seed=seed)
    kv_len = torch.tensor(lengths)
    q_start = torch.tensor(limits[: len(lengths)])
    out = paged_decode_cpu(q, kp, vp, tables, q_start, kv_len, **codecs(16))
    ref = paged_attention_reference(q, kp, vp, tables, q_start, kv_len, **codecs(16))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_a_query_view_with_other_strides_is_read_by_its_strides():
    q, kp, vp, tables = paged_rows([40, 9], 4, 2, 64, 16)
    q_view = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H_q, 1, D) with H_q stride D
    kv_len = torch.tensor([40, 9])
    out = paged_decode_cpu(q_view, kp, vp, tables, kv_len - 1, kv_len, **codecs(64))
    ref = paged_attention_reference(q, kp, vp, tables, kv_len - 1, kv_len, **codecs(64))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_calls_it_does_not_cover_return_none():
    q, kp, vp, tables = paged_rows([20], 4, 2, 64, 16)
    kv_len = torch.tensor([20])
    args = (kp, vp, tables, kv_len - 1, kv_len)
    assert paged_decode_cpu(q.expand(1, 4, 2, 64).contiguous(), *args, **codecs(64)) is None  # T = 2
    assert paged_decode_cpu(q.bfloat16(), *args, **codecs(64)) is None
    q8 = Q8Codec(64, torch.float32)
    kq, vq, kw = q8_pages(kp, vp)
    assert paged_decode_cpu(q, kq, vq, tables, kv_len - 1, kv_len, **kw) is not None
    assert paged_decode_cpu(q, kq, vq, tables, kv_len - 1, kv_len,
                            k_codec=q8, v_codec=q8, k_sidecars={}, v_sidecars={}) is None  # no scales
    assert paged_decode_cpu(q, kq, vq, tables, kv_len - 1, kv_len,
                            **{**kw, "k_codec": Q8Codec(64, torch.bfloat16)}) is None  # decodes to bf16
    q4 = Q4Codec(64, torch.float32)
    (k4, s4), (v4, t4) = q4.encode(kp), q4.encode(vp)
    assert paged_decode_cpu(q, k4, v4, tables, kv_len - 1, kv_len, k_codec=q4, v_codec=q4,
                            k_sidecars=s4, v_sidecars=t4) is None
    assert paged_decode_cpu(q, kp.transpose(0, 1).contiguous().transpose(0, 1), vp, tables,
                            kv_len - 1, kv_len, **codecs(64)) is None  # pages not contiguous
    assert paged_decode_cpu(q, kp, vp, tables.long(), kv_len - 1, kv_len, **codecs(64)) is None


@pytest.mark.parametrize("bad", ["entry", "negative", "too long"])
def test_a_table_that_names_no_block_is_refused_before_reading(bad):
    q, kp, vp, tables = paged_rows([20, 30], 4, 2, 64, 16)
    kv_len = torch.tensor([20, 30])
    if bad == "entry":
        tables[1, 1] = kp.shape[0]  # one past the pool
    elif bad == "negative":
        tables[0, 0] = -1
    else:
        kv_len = torch.tensor([20, 16 * tables.shape[1] + 1])  # longer than its table holds
    row = 0 if bad == "negative" else 1
    with pytest.raises(ValueError, match=rf"row {row} reads \d+ keys .* must lie in \[0, {kp.shape[0]}\)"):
        paged_decode_cpu(q, kp, vp, tables, kv_len - 1, kv_len, **codecs(64))


def test_the_dispatch_serves_decode_steps_from_the_kernel_and_the_rest_from_the_reference():
    q, kp, vp, tables = paged_rows([20, 33], 4, 2, 64, 16)
    kv_len = torch.tensor([20, 33])
    d = KernelDispatch("auto")
    decode = paged_attention(d, q, kp, vp, tables, kv_len - 1, kv_len, **codecs(64))
    q2 = torch.randn(2, 4, 3, 64)  # three queries a row: the reference
    prompt = paged_attention(d, q2, kp, vp, tables, kv_len - 3, kv_len, **codecs(64))
    assert d.attention_calls == {"cpu": 1, "torch": 1} and d.fallback_reasons == {}
    torch.testing.assert_close(decode, paged_attention_reference(q, kp, vp, tables, kv_len - 1, kv_len,
                                                                 **codecs(64)), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(prompt, paged_attention_reference(q2, kp, vp, tables, kv_len - 3, kv_len,
                                                                 **codecs(64)))
    forced = KernelDispatch("torch")
    paged_attention(forced, q, kp, vp, tables, kv_len - 1, kv_len, **codecs(64))
    assert forced.attention_calls == {"torch": 1}


def test_without_a_compiler_the_reference_serves_with_no_fallback(monkeypatch):
    monkeypatch.setattr(cpu_attention, "load_kernels", lambda: None)
    q, kp, vp, tables = paged_rows([20], 4, 2, 64, 16)
    kv_len = torch.tensor([20])
    d = KernelDispatch("auto")
    paged_attention(d, q, kp, vp, tables, kv_len - 1, kv_len, **codecs(64))
    assert d.attention_calls == {"torch": 1} and d.fallback_reasons == {}
