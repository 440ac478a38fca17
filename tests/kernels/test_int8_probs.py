"""q8 values weighed with int8 probabilities: keys-major value pages (a page's keys side by side,
``kvtier.caches.paged_pool.Q8_VALUES_KEYS_MAJOR``) and ``LaunchConfig(int8_probs=True)`` on the
usual pages, against ``kvtier.kernels.reference.int8_probs_attention``.

In each tile of keys the kernel rounds a query row's weights ``p * value scale`` to int8 codes at
the scale ``max / 127`` and takes the integer dot with the value codes as stored. With fp32
queries under the interpreter every other product is fp32, so the kernel must match the reference
(the same rounding, tile for tile) to fp32 accuracy and differ from plain attention by the
rounding's effect: a kernel that skipped the rounding, or tiled otherwise, fails.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_paged import DEVICE, IN_PROCESS, ON_GPU, TOL, build_cache, gathered_reference

from kvtier.caches import paged_pool
from kvtier.kernels.paged import gather_rows, paged_attention_reference
from kvtier.kernels.reference import int8_probs_attention, round_queries_int8
from kvtier.quant import codec_for_mode
from triton_support import in_this_process_or_a_fresh_one

if IN_PROCESS:
    from kvtier.kernels.triton_paged import LaunchConfig, paged_attention_triton, paged_write_triton

_kernels_in_this_process, test_in_a_fresh_process = in_this_process_or_a_fresh_one(IN_PROCESS, __file__)

#: fp32 queries: what the kernel may differ from the reference over the same rounding
EXACT = 2e-5


def keys_major(pages: torch.Tensor) -> torch.Tensor:
    """``pages`` ``[N, page, H, D]`` stored as ``[N, H, D, page]``: the same view, other strides."""
    return pages.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)


def _case(B, Hq, H_kv, T, D, lengths, dtype=torch.float32, seed=0):
    c = build_cache("q8", B, H_kv, D, 16, lengths, dtype, seed=seed)
    q = torch.randn(B, Hq, T, D, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(DEVICE)
    qs = torch.tensor([max(0, n - T) for n in lengths], dtype=torch.int64, device=DEVICE)
    return c, q, qs


def _attend(c, q, qs, vp=None, **cfg):
    kw = dict(k_codec=c["kc"], v_codec=c["vc"], k_sidecars=c["ks"], v_sidecars=c["vs"])
    vp = c["vp"] if vp is None else vp
    return paged_attention_triton(q, c["kp"], vp, c["table"], qs, c["kv_len"], config=LaunchConfig(**cfg), **kw)


def _reference(c, q, qs, tile):
    """int8 probabilities over the row's decoded keys and values, the scales gathered as stored."""
    L = max(1, int(c["kv_len"].max()))
    kv = c["kv_len"]
    k = gather_rows(c["kp"], c["ks"], c["table"], kv, L, codec=c["kc"])
    v = gather_rows(c["vp"], c["vs"], c["table"], kv, L, codec=c["vc"])
    page = c["vp"].shape[1]
    blocks = c["table"][:, : -(-L // page)].long()  # (B, nb)
    s_v = c["vs"]["scale"][blocks].flatten(1, 2)[:, :L, :, 0].transpose(1, 2)  # (B, H_kv, L)
    return int8_probs_attention(q, k, v, s_v, q_start=qs, kv_len=kv, tile=tile)


CASES = [
    (3, 4, 1, 1, 64, [1, 17, 45], None, None),  # decode: one key, a page edge + 1, a few pages
    (2, 8, 2, 1, 128, [300, 70], 3, 128),  # GQA 4, head_dim 128, three splits, tiles of 128
    (2, 4, 1, 5, 64, [140, 25], None, None),  # five queries a row (a verification, a prompt chunk)
]


@pytest.mark.parametrize("B, Hq, H_kv, T, D, lengths, splits, block_n", CASES)
def test_keys_major_values_weigh_like_the_reference(B, Hq, H_kv, T, D, lengths, splits, block_n):
    c, q, qs = _case(B, Hq, H_kv, T, D, lengths)
    out = _attend(c, q, qs, keys_major(c["vp"]), num_splits=splits, block_n=block_n)
    tile = block_n or (128 if ON_GPU else 32)
    torch.testing.assert_close(out, _reference(c, q, qs, tile), atol=EXACT, rtol=EXACT)
    plain = gathered_reference(c, q, qs)
    assert (out - plain).abs().max() > 10 * EXACT  # the rounding is there, and this test can see it
    assert (out - plain).abs().max() < 5e-2  # and no more than rounding
    # the usual pages with int8 probabilities asked for: the same arithmetic, bit for bit
    same = _attend(c, q, qs, int8_probs=True, num_splits=splits, block_n=block_n)
    torch.testing.assert_close(same, out, atol=0, rtol=0)
    # and without: the fp32 products, as before
    torch.testing.assert_close(_attend(c, q, qs, num_splits=splits, block_n=block_n), plain, atol=EXACT, rtol=EXACT)


def test_packed_serving_step_over_keys_major_values():
    """A decode row first, then two prompt chunks, over keys-major q8 value pages."""
    lengths, counts = [20, 30, 9], [1, 6, 9]
    c = build_cache("q8", 3, 1, 64, 16, lengths, torch.float32, seed=3)
    N = sum(counts)
    q = torch.randn(1, 4, N, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    to = dict(dtype=torch.int64, device=DEVICE)
    qs = torch.tensor([n - k for n, k in zip(lengths, counts)], **to)
    qo = torch.tensor([0, 1, 7], **to)
    kw = dict(k_codec=c["kc"], v_codec=c["vc"], k_sidecars=c["ks"], v_sidecars=c["vs"], q_offsets=qo,
              max_q_len=max(counts))
    out = paged_attention_triton(q, c["kp"], keys_major(c["vp"]), c["table"], qs, c["kv_len"], single_rows=1,
                                 config=LaunchConfig(block_n=32), **kw)
    for r, (start, n) in enumerate(zip(qo.tolist(), counts)):
        row = {k: (v[r : r + 1] if k in ("table", "kv_len") else v) for k, v in c.items()}
        ref = _reference(row, q[:, :, start : start + n], qs[r : r + 1], 32)
        torch.testing.assert_close(out[:, :, start : start + n], ref, atol=EXACT, rtol=EXACT)


def test_cuda_core_choice_goes_to_the_mma_kernel_on_keys_major_values():
    c, q, qs = _case(2, 4, 1, 1, 64, [33, 8])
    vkm = keys_major(c["vp"])
    torch.testing.assert_close(_attend(c, q, qs, vkm, decode_kernel="cuda_core"), _attend(c, q, qs, vkm),
                               atol=0, rtol=0)


def test_keys_major_refusals():
    c, q, qs = _case(2, 4, 1, 1, 64, [33, 8])
    with pytest.raises(ValueError, match=r"int8_probs=False\) needs value pages with a contiguous last dim"):
        _attend(c, q, qs, keys_major(c["vp"]), int8_probs=False)
    c4 = build_cache("q4", 2, 1, 64, 16, [33, 8], torch.float32)
    with pytest.raises(ValueError, match=r"contiguous last dim \(or q8 codes keys-major\)"):
        _attend(c4, q, qs, keys_major(c4["vp"]))


def test_write_kernel_fills_keys_major_pages_as_the_usual_ones():
    kc, vc = codec_for_mode("q8", 64, torch.float32)
    nb, page, H = 6, 16, 2
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn(2, H, 20, 64, generator=gen).to(DEVICE) for _ in range(2))
    slots = torch.randperm(nb * page, generator=gen)[:40].to(DEVICE)
    filled = []
    for vp in (torch.zeros(nb, page, H, 64, dtype=torch.int8), keys_major(torch.zeros(nb, page, H, 64, dtype=torch.int8))):
        kp, vp = torch.zeros(nb, page, H, 64, dtype=torch.int8, device=DEVICE), vp.to(DEVICE)
        ks, vs = ({"scale": torch.zeros(nb, page, H, 1, device=DEVICE)} for _ in range(2))
        paged_write_triton(kp, vp, ks, vs, slots, k, v, k_codec=kc, v_codec=vc)
        filled.append((vp, vs["scale"]))
    assert filled[1][0].stride(3) == page
    assert filled[0][0].abs().sum() > 0
    torch.testing.assert_close(filled[1][0], filled[0][0], atol=0, rtol=0)
    torch.testing.assert_close(filled[1][1], filled[0][1], atol=0, rtol=0)


def test_reference_reads_keys_major_pages():
    """The PyTorch path (any device without the kernel) indexes the view: the same result."""
    c, q, qs = _case(3, 4, 1, 1, 64, [1, 17, 45])
    kw = dict(k_codec=c["kc"], v_codec=c["vc"], k_sidecars=c["ks"], v_sidecars=c["vs"])
    args = (c["table"], qs, c["kv_len"])
    torch.testing.assert_close(paged_attention_reference(q, c["kp"], keys_major(c["vp"]), *args, **kw),
                               paged_attention_reference(q, c["kp"], c["vp"], *args, **kw), atol=0, rtol=0)


def test_the_pool_lays_out_q8_values_keys_major_on_cuda_only(monkeypatch):
    q8, q4 = (codec_for_mode(m, 64, torch.float16)[1] for m in ("q8", "q4"))
    monkeypatch.setattr(paged_pool, "Q8_VALUES_KEYS_MAJOR", True)
    assert paged_pool.keys_major_values(q8, "cuda")
    assert not paged_pool.keys_major_values(q8, "cpu")  # the CPU's kernels read the usual layout
    assert not paged_pool.keys_major_values(q4, "cuda")
    monkeypatch.setattr(paged_pool, "Q8_VALUES_KEYS_MAJOR", False)
    assert not paged_pool.keys_major_values(q8, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("B, L, splits", [(64, 8192, None), (8, 16384, None), (1, 4096, None), (4, 3000, 5)])
def test_gpu_keys_major_long_rows(B, L, splits):
    """bf16 queries on the H200's shapes (32/8 heads, head_dim 128): keys-major values against the
    reference over the rounded queries with int8 probabilities, and within bf16's tolerance of
    the fp16-operand launch on the usual pages."""
    lengths = [L - 37 * b for b in range(B)]
    c, q, qs = _case(B, 32, 8, 1, 128, lengths, dtype=torch.bfloat16)
    out = _attend(c, q, qs, keys_major(c["vp"]), num_splits=splits)
    tol = TOL[torch.bfloat16]
    ref = _reference(c, round_queries_int8(q), qs, 128)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    usual = _attend(c, q, qs, int8_queries=False, int8_probs=False).float()
    torch.testing.assert_close(out.float(), usual, atol=2 * tol, rtol=2 * tol)
