"""The one kernel dispatch: backend choice, the ragged path through it (against SDPA row by
row), the fallback of a kernel that cannot serve, and the books of who served."""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch

from kvtier.kernels import ragged
from kvtier.kernels.dispatch import KernelDispatch, resolve_backend
from kvtier.kernels.reference import causal_attention


def test_resolve_backend():
    assert resolve_backend("auto", "cpu") == "cpu"
    assert resolve_backend("auto", "meta") == "torch"
    assert resolve_backend("torch", "cpu") == "torch"
    assert resolve_backend("triton", "cpu") == "triton"
    assert resolve_backend("cpu", "cpu") == "cpu"
    with pytest.raises(ValueError, match="'cuda' is unknown; accepted: auto, torch, triton, cpu"):
        resolve_backend("cuda", "cpu")


def test_an_unknown_backend_is_refused_with_the_accepted_names():
    with pytest.raises(ValueError, match="attention_backend 'cuda' is unknown; accepted: auto"):
        KernelDispatch("cuda")


def _rows(seed=0):
    """Three rows of a padded ragged buffer (lengths 7, 3, 5), one decode query each."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(3, 2, 8, 16, generator=g), torch.randn(3, 2, 8, 16, generator=g)
    q = torch.randn(3, 4, 1, 16, generator=g)  # (B, H_q, T, D), GQA 2
    kv_len = torch.tensor([7, 3, 5])
    return q, k, v, kv_len - 1, kv_len


def _sdpa_per_row(q, k, v, q_start, kv_len):
    return torch.cat([causal_attention(q[b : b + 1], k[b : b + 1, :, : kv_len[b]], v[b : b + 1, :, : kv_len[b]],
                                       q_start=int(q_start[b])) for b in range(q.shape[0])])


def _fake_kernel(monkeypatch, kernel):
    """``kvtier.kernels.triton_ragged`` replaced by a module whose decode kernel is ``kernel``."""
    monkeypatch.setitem(sys.modules, ragged.TRITON_MODULE,
                        types.SimpleNamespace(ragged_decode_attention_triton=kernel))


def test_ragged_attention_on_the_reference_equals_sdpa_row_by_row():
    q, k, v, q_start, kv_len = _rows()
    d = KernelDispatch("auto", name="ragged")  # the CPU: the reference
    out = ragged.ragged_attention(d, q, k, v, q_start, kv_len)
    torch.testing.assert_close(out, _sdpa_per_row(q, k, v, q_start, kv_len), atol=1e-5, rtol=1e-5)
    assert d.attention_calls == {"torch": 1} and d.fallback_reason is None


def test_ragged_decode_goes_to_the_kernel_with_each_rows_visible_length(monkeypatch):
    seen = []

    def kernel(q, k, v, lens, *, scale=None):  # serves like the real kernel: each row's first lens keys
        seen.append(lens.tolist())
        return _sdpa_per_row(q, k, v, lens - 1, lens)

    _fake_kernel(monkeypatch, kernel)
    q, k, v, _, kv_len = _rows()
    d = KernelDispatch("triton", name="ragged")
    q_start = torch.tensor([6, 0, 9])  # row 1 sees key 0 only; row 2's bound is its length
    out = ragged.ragged_attention(d, q, k, v, q_start, kv_len)
    torch.testing.assert_close(out, _sdpa_per_row(q, k, v, q_start, kv_len), atol=1e-5, rtol=1e-5)
    ragged.ragged_attention(d, q, k, v, q_start, kv_len, decode_len=torch.tensor([2, 2, 2]))
    assert seen == [[7, 1, 5], [2, 2, 2]]
    # a longer query has no kernel: the reference serves it, and that is no fallback
    q3 = torch.randn(3, 4, 3, 16)
    out3 = ragged.ragged_attention(d, q3, k, v, kv_len - 3, kv_len)
    torch.testing.assert_close(out3, _sdpa_per_row(q3, k, v, kv_len - 3, kv_len), atol=1e-5, rtol=1e-5)
    assert d.attention_calls == {"triton": 2, "torch": 1} and d.fallback_reasons == {}


def test_a_failing_ragged_kernel_falls_back_once_with_a_reason(monkeypatch):
    def kernel(*a, **kw):
        raise RuntimeError("simulated launch error")

    _fake_kernel(monkeypatch, kernel)
    q, k, v, q_start, kv_len = _rows()
    d = KernelDispatch("triton", name="ragged")
    assert d.backend_for("attention", q.device) == "triton"
    with pytest.warns(RuntimeWarning, match="kvtier ragged attention fell back .*simulated launch error"):
        out = ragged.ragged_attention(d, q, k, v, q_start, kv_len)
    torch.testing.assert_close(out, _sdpa_per_row(q, k, v, q_start, kv_len), atol=1e-5, rtol=1e-5)
    assert d.fallback_reason == "RuntimeError: simulated launch error" and d.backend_for("attention", q.device) == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ragged.ragged_attention(d, q, k, v, q_start, kv_len)  # no second attempt, no second warning
    assert d.attention_calls == {"torch": 2} and d.write_calls == {}


def test_serve_books_each_operation_apart():
    d = KernelDispatch("triton")

    def broken():
        raise ValueError("no kernel for this codec")

    with pytest.warns(RuntimeWarning, match="kvtier paged write fell back"):
        assert d.serve("write", torch.device("cpu"), broken, lambda: "reference") == "reference"
    assert d.serve("attention", torch.device("cpu"), lambda: "kernel", lambda: "reference") == "kernel"
    assert d.fallback_reasons == {"write": "ValueError: no kernel for this codec"}
    assert d.write_calls == {"torch": 1} and d.attention_calls == {"triton": 1}
    assert d.backend_for("write", "cpu") == "torch" and d.backend_for("attention", "cpu") == "triton"
