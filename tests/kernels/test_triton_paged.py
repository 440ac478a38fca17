"""The Triton paged kernels against their PyTorch references.

On a machine without CUDA the kernels run under Triton's interpreter on small
shapes (a reduced grid); with CUDA the ``gpu``-marked tests run the full grid.
References: ``kvtier.kernels.paged.paged_attention_reference`` /
``paged_write_reference`` and, independently, SDPA over the decoded K/V
gathered row by row (``kvtier.kernels.reference.causal_attention``).
"""

from __future__ import annotations

import itertools
import math
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

from kvtier.kernels.dispatch import KernelDispatch  # noqa: E402
from kvtier.kernels.paged import (  # noqa: E402
    paged_attention,
    paged_attention_reference,
    paged_write_reference,
)
from kvtier.kernels.reference import causal_attention  # noqa: E402
from kvtier.kernels.triton_paged import (  # noqa: E402
    LaunchConfig,
    paged_attention_triton,
    paged_write_triton,
)
from kvtier.quant import codec_for_mode  # noqa: E402
from kvtier.quant.codec import Codec, CodecUnsupported, IdentityCodec  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")

#: max |out - ref| allowed, per query dtype (bf16: P and K/V meet in bf16 on the tensor cores)
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}
QUANT_MODES = [
    "q8",
    "fp8",
    "q4",
    "q4_g32",
    "turboquant:q8_0,q3_0",
    "turboquant:q5_0r,q4_0",
    "turboquant:int2r,q2_0",
    "turboquant:q4_0,q8_0",
]



_kernels_in_this_process, test_in_a_fresh_process = in_this_process_or_a_fresh_one(IN_PROCESS, __file__)


# -- building paged caches ------------------------------------------------------------------
def alloc_pages(codec: Codec, num_blocks: int, page: int, H: int, gen: torch.Generator):
    """Pages and sidecars filled with the encoding of random data (never zeros), drawn and
    encoded on ``gen``'s device (a long row's gigabytes took minutes on the host's cores)."""
    x = torch.randn(num_blocks, page, H, codec.head_dim, generator=gen, device=gen.device).to(codec.dtype)
    payload, side = codec.encode(x)
    return payload.to(DEVICE), {n: t.to(DEVICE) for n, t in side.items()}


def build_cache(mode, B, H_kv, D, page, lengths, dtype, seed=0):
    """Random pages for rows of ``lengths`` tokens behind a shuffled block table."""
    gen = torch.Generator().manual_seed(seed)
    kc, vc = codec_for_mode(mode, D, dtype)
    per_row = [max(1, math.ceil(n / page)) for n in lengths]
    max_blocks = max(per_row)
    num_blocks = sum(per_row) + 2  # two blocks no row owns: their garbage must never leak in
    pages_gen = gen if DEVICE.type == "cpu" else torch.Generator(device=DEVICE).manual_seed(seed)
    kp, ks = alloc_pages(kc, num_blocks, page, H_kv, pages_gen)
    vp, vs = alloc_pages(vc, num_blocks, page, H_kv, pages_gen)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(B, max_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_row):
        table[b, :n] = perm[used : used + n].to(torch.int32)
        table[b, n:] = perm[-1]  # an unowned block past the row's end
        used += n
    kv_len = torch.tensor(lengths, dtype=torch.int64)
    return dict(kc=kc, vc=vc, kp=kp, vp=vp, ks=ks, vs=vs, table=table.to(DEVICE), kv_len=kv_len.to(DEVICE))


def gathered_reference(c, q, q_start, scale=None, window=None):
    """SDPA over each row's decoded K/V, gathered block by block (independent of kernels.paged)."""
    B = q.shape[0]
    page = c["kp"].shape[1]
    L = max(1, int(c["kv_len"].max()))
    nb = math.ceil(L / page)
    ks, vs = [], []
    for pages, side, codec, out in ((c["kp"], c["ks"], c["kc"], ks), (c["vp"], c["vs"], c["vc"], vs)):
        for b in range(B):
            ids = c["table"][b, :nb].long()
            payload = pages[ids].reshape(nb * page, *pages.shape[2:])  # (nb*page, H, D')
            sc = {n: t[ids].reshape(nb * page, *t.shape[2:]) for n, t in side.items()}
            out.append(codec.decode(payload, sc).transpose(0, 1)[:, :L])  # (H, L, D)
    K, V = torch.stack(ks).float(), torch.stack(vs).float()  # (B, H, L, D)
    return causal_attention(q.float(), K, V, q_start=q_start, kv_len=c["kv_len"], scale=scale, window=window)


def run_attention(mode, B, Hq, H_kv, T, D, page, lengths, dtype, *, q_start=None, splits=None, block_n=None):
    c = build_cache(mode, B, H_kv, D, page, lengths, dtype)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, Hq, T, D, generator=gen).to(dtype).to(DEVICE)
    if q_start is None:
        q_start = [max(0, n - T) for n in lengths]
    qs = torch.tensor(q_start, dtype=torch.int64, device=DEVICE)
    kw = dict(k_codec=c["kc"], v_codec=c["vc"], k_sidecars=c["ks"], v_sidecars=c["vs"])
    cfg = LaunchConfig(num_splits=splits, block_n=block_n)
    out = paged_attention_triton(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], config=cfg, **kw)
    assert out.shape == (B, Hq, T, D) and out.dtype == dtype
    tol = TOL[dtype]
    ref = gathered_reference(c, q, qs)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    ref2 = paged_attention_reference(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], **kw)
    torch.testing.assert_close(out.float(), ref2.float(), atol=tol, rtol=tol)
    return out


# -- attention, the interpreter's grid (also runs on CUDA) ------------------------------------
@pytest.mark.parametrize(
    "B, Hq, H_kv, T, D, page, lengths, dtype, splits",
    [
        (3, 4, 1, 1, 64, 16, [1, 16, 33], torch.bfloat16, None),  # length 1, block edge, edge + 1
        (2, 8, 1, 1, 128, 16, [17, 64], torch.bfloat16, 3),  # GQA 8, D 128, forced split-KV
        (2, 2, 2, 1, 64, 128, [128, 129], torch.bfloat16, 2),  # MHA, block size 128
        (2, 8, 2, 5, 64, 16, [5, 40], torch.bfloat16, 2),  # extend: full prefill and a chunk
        (2, 4, 1, 1, 64, 16, [31, 3], torch.float32, None),
        (2, 4, 1, 3, 64, 16, [20, 9], torch.float16, None),
    ],
)
def test_attention_fp_matches_reference(B, Hq, H_kv, T, D, page, lengths, dtype, splits):
    run_attention("fp", B, Hq, H_kv, T, D, page, lengths, dtype, splits=splits)


def test_attention_causal_limit_inside_the_cache():
    # chunked prefill: the queries sit at 10..13 while the cache already holds 30 tokens
    run_attention("fp", 2, 4, 1, 4, 64, 16, [30, 4], torch.float32, q_start=[10, 0], splits=2)


def test_attention_empty_row_returns_zeros():
    out = run_attention("fp", 2, 4, 1, 1, 64, 16, [0, 7], torch.float32)
    assert torch.count_nonzero(out[0]) == 0


def test_decode_bits_do_not_depend_on_the_table_width():
    """A decode step at B=1 over one row, through a table as wide as its blocks and through a
    much wider one (a CUDA graph's, captured for the longest row): more splits, all of them
    past the row empty, and the same output bit for bit (the merge reduces over one tile
    whatever the split count)."""
    H_kv, Hq, D, page = (8, 32, 128, 16) if ON_GPU else (1, 4, 64, 16)
    n, wide = (190, 256) if ON_GPU else (40, 8)  # 4 against 64 splits on the GPU, 2 against 4 here
    c = build_cache("fp", 1, H_kv, D, page, [n], torch.bfloat16)
    table = c["table"]
    padded = torch.cat([table, table[:, -1:].expand(1, wide - table.shape[1])], dim=1)
    q = torch.randn(1, Hq, 1, D, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEVICE)
    qs = c["kv_len"] - 1
    kw = dict(k_codec=c["kc"], v_codec=c["vc"], k_sidecars=c["ks"], v_sidecars=c["vs"])
    narrow_out = paged_attention_triton(q, c["kp"], c["vp"], table, qs, c["kv_len"], **kw)
    wide_out = paged_attention_triton(q, c["kp"], c["vp"], padded, qs, c["kv_len"], **kw)
    from kvtier.kernels.triton_attention import plan_launch

    splits = [plan_launch(1, H_kv, Hq // H_kv, 1, t.shape[1] * page, q.device, LaunchConfig())[3] for t in (table, padded)]
    assert splits[0] > 1 and splits[1] > splits[0]  # both merge, the wide table over more splits
    assert torch.equal(narrow_out, wide_out)
    torch.testing.assert_close(narrow_out.float(), gathered_reference(c, q, qs), atol=TOL[torch.bfloat16],
                               rtol=TOL[torch.bfloat16])


@pytest.mark.parametrize("mode", QUANT_MODES)
def test_attention_quantised_decode(mode):
    run_attention(mode, 2, 4, 1, 1, 64, 16, [1, 40], torch.bfloat16, splits=2)


@pytest.mark.parametrize(
    "mode, T, D, page, block_n",
    [
        ("q8", 4, 64, 16, None),
        ("turboquant:q8_0,q3_0", 3, 64, 16, None),
        ("q4_g32", 1, 128, 128, 128),  # the CUDA default tile of quantised pages
        ("turboquant:q5_0r,q4_0", 2, 128, 16, None),
        ("q4", 1, 64, 16, 128),
    ],
)
def test_attention_quantised_extend_and_shapes(mode, T, D, page, block_n):
    run_attention(mode, 2, 8, 2, T, D, page, [T + 150, T], torch.bfloat16, block_n=block_n)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(0, 50), min_size=1, max_size=3),
    T=st.integers(1, 3),
    group=st.sampled_from([1, 4]),
    splits=st.sampled_from([None, 1, 3]),
)
def test_attention_random_rows(lengths, T, group, splits):
    lengths = [max(n, T) for n in lengths]
    run_attention("fp", len(lengths), group, 1, T, 64, 16, lengths, torch.float32, splits=splits)


def test_dispatch_serves_from_the_kernel():
    c = build_cache("q8", 2, 1, 64, 16, [9, 30], torch.bfloat16)
    q = torch.randn(2, 4, 1, 64).to(torch.bfloat16).to(DEVICE)
    qs = c["kv_len"] - 1
    kw = dict(k_codec=c["kc"], v_codec=c["vc"], k_sidecars=c["ks"], v_sidecars=c["vs"])
    dispatch = KernelDispatch("triton")
    out = paged_attention(dispatch, q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], **kw)
    assert dict(dispatch.attention_calls) == {"triton": 1} and dispatch.fallback_reason is None
    ref = paged_attention_reference(q, c["kp"], c["vp"], c["table"], qs, c["kv_len"], **kw)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


# -- the write kernel ----------------------------------------------------------------------
def run_write(mode, B, H, T, D, page, dtype, *, pad_slot=True, seed=0, centre=False):
    """Write with the kernel and with the reference into copies of the same random pool
    (``centre``: keys with per-channel offsets, coded against the key codec's centre)."""
    gen = torch.Generator().manual_seed(seed)
    kc, vc = codec_for_mode(mode, D, dtype)
    num_blocks = math.ceil(B * T / page) + 2
    kp, ks = alloc_pages(kc, num_blocks, page, H, gen)
    vp, vs = alloc_pages(vc, num_blocks, page, H, gen)
    keys = (3 * torch.randn(B, H, T, D, generator=gen)).to(dtype).to(DEVICE)
    if centre:
        keys = (keys.float() + 8 * torch.randn(1, H, 1, D, generator=gen).to(DEVICE)).to(dtype)
        kc.set_centre(keys)
    values = torch.randn(B, H, T, D, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * page, generator=gen)[: B * T].to(DEVICE)
    if pad_slot and B * T > 1:
        slots[-1] = -1  # padding: written by nobody
    before = [t.clone() for t in (kp, vp, *ks.values(), *vs.values())]
    mine = [t.clone() for t in (kp, vp)], {n: t.clone() for n, t in ks.items()}, {n: t.clone() for n, t in vs.items()}
    (kp1, vp1), ks1, vs1 = mine
    paged_write_triton(kp1, vp1, ks1, vs1, slots, keys, values, k_codec=kc, v_codec=vc)
    live = slots >= 0
    rows = torch.nonzero(live).squeeze(1)
    k_live = keys.transpose(1, 2).reshape(B * T, H, D)[rows].unsqueeze(0).transpose(1, 2)  # (1, H, n, D)
    v_live = values.transpose(1, 2).reshape(B * T, H, D)[rows].unsqueeze(0).transpose(1, 2)
    paged_write_reference(kp, vp, ks, vs, slots[live], k_live, v_live, k_codec=kc, v_codec=vc)
    return dict(kc=kc, vc=vc, got=(kp1, vp1, ks1, vs1), ref=(kp, vp, ks, vs), before=before, slots=slots)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])  # (slots, H, last)


def check_write(r, *, exact: bool):
    kp1, vp1, ks1, vs1 = r["got"]
    kp, vp, ks, vs = r["ref"]
    slots = r["slots"]
    # slots nobody wrote keep their old bytes
    untouched = torch.ones(kp.shape[0] * kp.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[slots[slots >= 0]] = False
    for got, old in zip((kp1, vp1, *ks1.values(), *vs1.values()), r["before"]):
        assert torch.equal(_flat(got)[untouched], _flat(old)[untouched])
    live = slots[slots >= 0]
    for got_p, ref_p, got_s, ref_s, codec in ((kp1, kp, ks1, ks, r["kc"]), (vp1, vp, vs1, vs, r["vc"])):
        gp, rp = _flat(got_p)[live], _flat(ref_p)[live]
        gs = {n: _flat(t)[live] for n, t in got_s.items()}
        rs = {n: _flat(t)[live] for n, t in ref_s.items()}
        if exact:
            bad = (gp != rp).nonzero()
            assert bad.numel() == 0, (
                f"{codec.name}: {bad.shape[0]} payload bytes differ from the reference, first at "
                f"{bad[0].tolist()}: {gp[tuple(bad[0])].item()} != {rp[tuple(bad[0])].item()}"
            )
            for n in rs:
                assert torch.equal(gs[n], rs[n]), f"{codec.name}: sidecar {n} differs"
        else:
            # fp32 rotations and sums in another order may move a value across a code boundary
            diff = (gp != rp).float().mean().item()
            assert diff <= 0.01, f"{codec.name}: {diff:.2%} of the payload differs"
            dec, ref = codec.decode(gp, gs).float(), codec.decode(rp, rs).float()
            assert (dec - ref).norm() <= 0.05 * ref.norm()


@pytest.mark.parametrize(
    "mode, dtype", [("fp", torch.float32), ("fp", torch.bfloat16), *((m, torch.bfloat16) for m in QUANT_MODES)]
)
def test_write_matches_reference(mode, dtype):
    r = run_write(mode, 2, 2, 3, 64, 16, dtype)
    check_write(r, exact=not ON_GPU or not mode.startswith("turboquant"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_of_centred_fp8_keys_matches_reference(dtype):
    """fp8 keys coded against a centre: the kernel subtracts it (rounding to the keys' dtype,
    as the codec does) and writes the bytes the reference codec does."""
    r = run_write("fp8", 2, 2, 5, 64, 16, dtype, centre=True)
    assert r["kc"].centre is not None and r["vc"].centre is None
    check_write(r, exact=True)


def test_write_refuses_a_centre_of_the_wrong_shape():
    """A key codec whose centre does not match the pages' heads is refused before anything is written."""
    D, page, H = 64, 16, 2
    gen = torch.Generator().manual_seed(0)
    kc, vc = codec_for_mode("fp8", D, torch.bfloat16)
    kp, ks = alloc_pages(kc, 2, page, H, gen)
    vp, vs = alloc_pages(vc, 2, page, H, gen)
    kc.centre = torch.zeros(H + 1, D, device=DEVICE)
    before = kp.clone()
    keys = torch.randn(1, H, 1, D).to(torch.bfloat16).to(DEVICE)
    slots = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"centre must be contiguous float32 \[2, 64\]"):
        paged_write_triton(kp, vp, ks, vs, slots, keys, keys.clone(), k_codec=kc, v_codec=vc)
    assert torch.equal(kp, before)


def test_write_head_dim_128_page_128():
    r = run_write("turboquant:q5_0r,q3_0", 3, 2, 2, 128, 128, torch.bfloat16)
    check_write(r, exact=not ON_GPU)


def test_write_then_attention_round_trip():
    """Tokens written by the kernel are the tokens the attention kernel reads."""
    B, H, T, D, page = 2, 1, 20, 64, 16
    c = build_cache("q4_g32", B, H, D, page, [T, T], torch.bfloat16)
    slots = []
    for b in range(B):
        for t in range(T):
            slots.append(int(c["table"][b, t // page]) * page + t % page)
    slots = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(B, H, T, D, generator=gen).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(B, H, T, D, generator=gen).to(torch.bfloat16).to(DEVICE)
    paged_write_triton(c["kp"], c["vp"], c["ks"], c["vs"], slots, k, v, k_codec=c["kc"], v_codec=c["vc"])
    q = torch.randn(B, 4, T, D, generator=gen).to(torch.bfloat16).to(DEVICE)
    qs = torch.zeros(B, dtype=torch.int64, device=DEVICE)
    out = paged_attention_triton(
        q, c["kp"], c["vp"], c["table"], qs, c["kv_len"],
        k_codec=c["kc"], v_codec=c["vc"], k_sidecars=c["ks"], v_sidecars=c["vs"],
    )  # fmt: skip
    ref = causal_attention(q.float(), c["kc"].roundtrip(k).float(), c["vc"].roundtrip(v).float(), q_start=0)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


# -- bad input: ValueError naming the fix, CodecUnsupported for the fallback, nothing mutated --
def _fp_cache():
    return build_cache("fp", 2, 2, 64, 16, [5, 9], torch.float32)


def _call(c, q, **over):
    args = dict(
        q=q, key_pages=c["kp"], value_pages=c["vp"], block_tables=c["table"],
        q_start=c["kv_len"] - 1, kv_len=c["kv_len"],
    )  # fmt: skip
    args.update(over)
    kw = dict(k_codec=c["kc"], v_codec=c["vc"], k_sidecars=c["ks"], v_sidecars=c["vs"])
    return paged_attention_triton(*args.values(), **kw)


def test_attention_rejects_bad_input():
    c = _fp_cache()
    q = torch.randn(2, 4, 1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        _call(c, q, block_tables=c["table"].long())
    with pytest.raises(ValueError, match="kv_len must be"):
        _call(c, q, kv_len=c["kv_len"].float())
    with pytest.raises(ValueError, match="not a multiple"):
        _call(c, torch.randn(2, 3, 1, 64, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous last dim"):
        _call(c, torch.randn(2, 4, 1, 128, device=DEVICE)[..., ::2])
    with pytest.raises(ValueError, match="head_dim 64 but the tensors have 32"):
        _call(c, torch.randn(2, 4, 1, 32, device=DEVICE))
    if not ON_GPU:
        with pytest.raises(ValueError, match="capacity"):
            _call(c, q, kv_len=torch.tensor([5, 17]))


def test_attention_unsupported_raises_codec_unsupported():
    class Odd(IdentityCodec):
        name = "odd"

    c = _fp_cache()
    q = torch.randn(2, 4, 1, 64, device=DEVICE)
    odd = Odd(64, torch.float32)
    with pytest.raises(CodecUnsupported, match="has no Triton kernel"):
        paged_attention_triton(
            q, c["kp"], c["vp"], c["table"], c["kv_len"] - 1, c["kv_len"],
            k_codec=odd, v_codec=c["vc"], k_sidecars={}, v_sidecars={},
        )  # fmt: skip
    c80 = build_cache("fp", 1, 1, 80, 16, [3], torch.float32)
    with pytest.raises(CodecUnsupported, match="power of two"):
        _call(c80, torch.randn(1, 1, 1, 80, device=DEVICE))


def test_write_rejects_bad_input_and_leaves_pages_alone():
    kc = IdentityCodec(64, torch.float32)
    kp = torch.randn(2, 16, 1, 64, device=DEVICE)
    vp = torch.randn(2, 16, 1, 64, device=DEVICE)
    before = (kp.clone(), vp.clone())
    k = torch.randn(1, 1, 2, 64, device=DEVICE)
    bad = [
        (torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), k, "slot_mapping must be"),
        (torch.tensor([0, 1, 2], device=DEVICE), k, "slot_mapping must be"),
        (torch.tensor([0, 1], device=DEVICE), torch.randn(1, 2, 2, 64, device=DEVICE), "heads"),
    ]
    if not ON_GPU:
        bad.append((torch.tensor([3, 3], device=DEVICE), k, "distinct"))
        bad.append((torch.tensor([0, 32], device=DEVICE), k, "below 32"))
    for slots, keys, msg in bad:
        with pytest.raises(ValueError, match=msg):
            paged_write_triton(kp, vp, {}, {}, slots, keys, keys.clone(), k_codec=kc, v_codec=kc)
        assert torch.equal(kp, before[0]) and torch.equal(vp, before[1])


# -- the full grid on CUDA --------------------------------------------------------------------
LONG_ROWS = [[1, 16, 129, 1000], [4097]]
GPU_ATTENTION = [
    ("fp", page, D, group, T, lengths, torch.bfloat16)
    for page, D, group, T, lengths in itertools.product([16, 128], [64, 128], [1, 4, 8], [1, 4], LONG_ROWS)
] + [
    ("fp", page, 128, 4, T, LONG_ROWS[0], torch.float16) for page in (16, 128) for T in (1, 4)
] + [
    (mode, page, D, group, T, LONG_ROWS[i % 2], torch.bfloat16)
    for mode in QUANT_MODES
    for i, (page, D, group, T) in enumerate([(16, 128, 4, 1), (128, 64, 8, 4), (16, 64, 1, 1)])
]


@pytest.mark.parametrize("mode, page, D, group, T, lengths, dtype", GPU_ATTENTION)
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_gpu_attention_grid(mode, page, D, group, T, lengths, dtype):
    lengths = [max(n, T) for n in lengths]
    run_attention(mode, len(lengths), 2 * group, 2, T, D, page, lengths, dtype)


@pytest.mark.parametrize("mode", ["fp", *QUANT_MODES])
@pytest.mark.parametrize("B, T, D, page", [(1, 1, 64, 16), (64, 1, 128, 16), (4, 7, 128, 128)])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_gpu_write_grid(mode, B, T, D, page):
    r = run_write(mode, B, 8, T, D, page, torch.bfloat16)
    check_write(r, exact=not mode.startswith("turboquant"))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_gpu_fp32_decode():
    run_attention("fp", 3, 8, 2, 1, 128, 16, [1, 300, 5000], torch.float32)


def test_write_reads_keys_and_values_of_other_strides():
    """K from one buffer and V a slice of a fused QKV output (the model's layout): no copy needed,
    the bytes of contiguous copies."""
    kc, vc = codec_for_mode("q8", 64, torch.float32)
    gen = torch.Generator().manual_seed(3)
    B, H, T = 2, 2, 5
    qkv = torch.randn(B, T, 3 * H, 64, generator=gen).to(DEVICE)  # (B, T, heads of q, k, v, D)
    keys = torch.randn(B, T, H, 64, generator=gen).to(DEVICE).transpose(1, 2)  # (B, H, T, D)
    values = qkv[:, :, 2 * H :].transpose(1, 2)  # (B, H, T, D), strides of qkv
    assert keys.stride() != values.stride()
    slots = torch.randperm(4 * 16, generator=gen)[: B * T].to(DEVICE)
    pools = []
    for k, v in ((keys, values), (keys.contiguous(), values.contiguous())):
        kp, ks = alloc_pages(kc, 4, 16, H, torch.Generator().manual_seed(0))
        vp, vs = alloc_pages(vc, 4, 16, H, torch.Generator().manual_seed(1))
        paged_write_triton(kp, vp, ks, vs, slots, k, v, k_codec=kc, v_codec=vc)
        pools.append((kp, vp, *ks.values(), *vs.values()))
    assert all(torch.equal(a, b) for a, b in zip(*pools))
