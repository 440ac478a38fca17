"""The Triton ragged decode kernel against the dense-mask reference and the ragged tier.

Without CUDA the kernel runs under Triton's interpreter on small shapes; the
``gpu``-marked grid runs with CUDA.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from triton_support import in_this_process_or_a_fresh_one

ON_GPU = torch.cuda.is_available()
if not ON_GPU:  # must precede the first import of triton's jit decorators
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from kvtier.kernels import triton_paged  # noqa: E402

#: False when triton was imported before the interpreter was switched on (it decides
#: at import): then the tests run again in a fresh process (test_in_a_fresh_process)
IN_PROCESS = ON_GPU or triton_paged.interpreted()

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvtier.caches.ragged import RaggedBatchKVCache  # noqa: E402
from kvtier.kernels.reference import causal_attention  # noqa: E402
from kvtier.kernels.triton_ragged import (  # noqa: E402
    LaunchConfig,
    ragged_decode_attention_triton,
    ragged_decode_reference,
)
from kvtier.quant.codec import CodecUnsupported  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}


_kernels_in_this_process, test_in_a_fresh_process = in_this_process_or_a_fresh_one(IN_PROCESS, __file__)


def make(B, Hq, H_kv, cap, D, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, 1, D, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(B, H_kv, cap, D, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(B, H_kv, cap, D, generator=gen).to(dtype).to(DEVICE)
    return q, k, v


def check(B, Hq, H_kv, cap, D, lengths, dtype, splits=None, block_n=None):
    q, k, v = make(B, Hq, H_kv, cap, D, dtype)
    kv_len = torch.tensor(lengths, device=DEVICE)
    out = ragged_decode_attention_triton(q, k, v, kv_len, config=LaunchConfig(num_splits=splits, block_n=block_n))
    assert out.shape == q.shape and out.dtype == dtype
    # reference: per row, SDPA over exactly its first kv_len keys (no mask at all)
    for b, n in enumerate(lengths):
        if n == 0:
            assert torch.count_nonzero(out[b]) == 0
            continue
        ref = causal_attention(q[b : b + 1].float(), k[b : b + 1, :, :n].float(), v[b : b + 1, :, :n].float())
        torch.testing.assert_close(out[b : b + 1].float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(
        out.float(), ragged_decode_reference(q.float(), k.float(), v.float(), kv_len), atol=TOL[dtype], rtol=TOL[dtype]
    )


@pytest.mark.parametrize(
    "B, Hq, H_kv, cap, D, lengths, dtype, splits",
    [
        (4, 4, 1, 48, 64, [0, 1, 33, 48], torch.float32, None),  # empty row, one token, full row
        (2, 8, 1, 40, 128, [16, 17], torch.bfloat16, 3),  # GQA 8, D 128, split-KV
        (2, 2, 2, 64, 64, [64, 5], torch.float16, 2),  # MHA
    ],
)
def test_ragged_decode_matches_reference(B, Hq, H_kv, cap, D, lengths, dtype, splits):
    check(B, Hq, H_kv, cap, D, lengths, dtype, splits)


def test_ragged_decode_reads_views_of_a_larger_buffer():
    q, k, v = make(2, 4, 2, 80, 64, torch.float32)
    kv_len = torch.tensor([30, 7], device=DEVICE)
    ks, vs = k[:, :, :40], v[:, :, :40]  # strided views, as the tier's live prefix is
    out = ragged_decode_attention_triton(q, ks, vs, kv_len)
    torch.testing.assert_close(out, ragged_decode_reference(q, ks, vs, kv_len), atol=1e-4, rtol=1e-4)


def test_ragged_decode_equals_the_tier_mask_path():
    gen = torch.Generator().manual_seed(4)
    B, H_kv, D = 3, 1, 64
    k0 = torch.randn(B, H_kv, 12, D, generator=gen).to(DEVICE)
    v0 = torch.randn(B, H_kv, 12, D, generator=gen).to(DEVICE)
    cache = RaggedBatchKVCache(step=16, keys=k0, values=v0, offsets=[12, 5, 9])
    k1 = torch.randn(B, H_kv, 1, D, generator=gen).to(DEVICE)
    cache.update(k1, k1.clone())  # each row appends at its own length
    q = torch.randn(B, 4, 1, D, generator=gen).to(DEVICE)
    out = ragged_decode_attention_triton(q, cache.keys, cache.values, cache.offset)
    torch.testing.assert_close(out, cache.attention(q), atol=1e-4, rtol=1e-4)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=3), group=st.sampled_from([1, 4]))
def test_ragged_decode_random_lengths(lengths, group):
    check(len(lengths), group, 1, 40, 64, lengths, torch.float32)


def test_ragged_decode_rejects_bad_input():
    q, k, v = make(2, 4, 2, 16, 64, torch.float32)
    kv_len = torch.tensor([3, 4], device=DEVICE)
    with pytest.raises(ValueError, match="one query token"):
        ragged_decode_attention_triton(torch.cat([q, q], 2), k, v, kv_len)
    with pytest.raises(ValueError, match="kv_len must be an integer"):
        ragged_decode_attention_triton(q, k, v, kv_len.float())
    with pytest.raises(ValueError, match="keys must be"):
        ragged_decode_attention_triton(q, k.to(torch.float16), v, kv_len)
    with pytest.raises(ValueError, match="not a multiple"):
        ragged_decode_attention_triton(q[:, :3], k, v, kv_len)
    with pytest.raises(CodecUnsupported, match="power of two"):
        ragged_decode_attention_triton(q[..., :48], k[..., :48], v[..., :48], kv_len)
    if not ON_GPU:
        with pytest.raises(ValueError, match="capacity"):
            ragged_decode_attention_triton(q, k, v, torch.tensor([3, 17]))


@pytest.mark.parametrize(
    "D, group, dtype, lengths",
    list(
        itertools.product(
            [64, 128], [1, 4, 8], [torch.bfloat16, torch.float16], [[1, 255, 256, 3000], [8191]]
        )
    ),
)
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_gpu_ragged_grid(D, group, dtype, lengths):
    cap = 8192
    check(len(lengths), 2 * group, 2, cap, D, lengths, dtype)
