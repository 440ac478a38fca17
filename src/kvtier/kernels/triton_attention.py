"""The Triton attention kernel behind the paged and ragged read paths.

One kernel serves decode (T = 1) and extend (T > 1: chunked prefill, speculative
verify) over keys that live either in pages reached through a block table (NHD
``[num_blocks, block_size, H_kv, D']``) or in one padded buffer per row
(``[B, H_kv, capacity, D]``, the ragged tier).

Work split. A program owns one (row, kv head), a tile of ``BLOCK_M`` query rows
and one split of the key range. Query rows are ``(t, g)`` pairs, ``g`` the query
heads of the kv head's GQA group, so one K/V tile read from memory feeds the
whole group through ``tl.dot``. Long contexts are split across programs
(flash-decoding): each split writes its softmax-normalised partial output and
log-sum-exp, and :func:`_merge_kernel` combines them. The split plan depends on
the table's capacity, not on the lengths, so a launch needs no device-to-host
sync and keeps one shape across decode steps (CUDA graphs).

Visibility: query ``i`` of row ``b`` sees key ``j`` when ``j <= q_start[b] + i``
and ``j < kv_len[b]`` (``kvtier.kernels.reference.causal_attention``); with a sliding
``window``, also ``j > q_start[b] + i - window``: the splits cover ``window + T - 1`` keys from
each row's first query's window on, and a tile's keys start at its first query's window (the
keys before are not read).

Packed rows (``VARLEN``): the queries of several rows side by side in ``[1, H_q, N, D]``,
row ``b``'s ``kv_len[b] - q_start[b]`` of them from token ``q_offsets[b]``, read and
written in place (the serving engine's prompt chunks).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from kvtier.kernels import gluon_decode, triton_decode_quant
from kvtier.kernels.launch_plan import (  # noqa: F401  (LaunchConfig, plan_launch: this module's API too)
    DECODE_KERNELS,
    PACKED_BLOCK_M,
    LaunchConfig,
    _next_pow2,
    plan_launch,
)
from kvtier.kernels.triton_merge import _merge, _pdl, merge_splits, split_partials  # noqa: F401  (and here)
from kvtier.kernels.triton_quant import (
    CENTROID,
    FP,
    PageFormat,
    direct_format,
    format_constexprs,
    int8_key_format,
    kv_tile,
    round_half_even,
)

LOG2E = 1.4426950408889634

#: Which kernel serves a decode step (one query token per row) over quantised pages
#: when ``LaunchConfig.decode_kernel`` is ``None`` and :data:`GLUON_DECODE` does not take it,
#: per family: ``"kv_quant"`` (q8, q4, q4_g32, fp8), ``"turboquant"`` (Lloyd-Max values).
#: ``"mma"``: the kernel below, on the tensor cores; ``"cuda_core"``: the dot-free kernel of
#: :mod:`kvtier.kernels.triton_decode_quant` (``kvtier bench attention --quant-sweep`` times
#: both; fp8 and 5-bit codes always ``"mma"``). H200, B=64 / 8k (benchmarks/RESULTS.md,
#: 2026-12-01): TurboQuant 1111 us on CUDA cores, 1651 on the MMA kernel; q8 382, bf16 489.
QUANT_DECODE_KERNEL = {"kv_quant": "mma", "turboquant": "cuda_core"}
#: Score q8 keys with int8 queries (each query row's codes at the scale ``max|q| / 127``) on
#: compiled launches of bf16/fp16 queries; ``LaunchConfig.int8_queries`` overrides. The key tile
#: goes from shared memory into an integer dot as stored: no conversion. H200, B=64 / 8k, 32/8
#: heads: 358 against 385 us; SmolLM2 perplexity with q8 pages +0.133% against +0.124%
#: (benchmarks/RESULTS.md, 2026-12-03).
INT8_QUERIES = True
#: decode steps over these pages (``"q8"``, ``"q4"``, ``"fp8"``, ``"q4_g32"``, ``"fp"``, ``"tq"``:
#: TurboQuant's 8-bit keys and 3-bit values, ahead of its CUDA-core kernel) go to the
#: pipelined Gluon kernel (:mod:`kvtier.kernels.gluon_decode`) where it runs, in launches of at
#: most the kind's number of (row, kv head) pairs (``None``: any), unless the ``LaunchConfig``
#: names a kernel, a tile, stages or warps (the MMA kernel's settings) or turns int8 queries off.
#: H200, 32/8 heads, B=64 / 8k: q8 264 against 355 us on the MMA kernel, q4 190 against 327, fp8
#: 266 against 371, q4_g32 374 against 479 (bf16 488-498); 16-bit pages: B=1 / 4k 11.9 against
#: 13.2 us, B=8 / 4k 39.0 against 41.0, but B=64 / 8k 500 against 488 (benchmarks/RESULTS.md,
#: 2026-12-03). q4_g32 at a serving step's 2,048 pairs, with its codes as operands in registers:
#: 101.0 against the MMA kernel's 170.5 us (2026-12-04; 174.0 against 169.9 on dequantised tiles).
GLUON_DECODE: dict[str, int | None] = {"q8": None, "q4": None, "fp8": None, "q4_g32": None, "fp": 64, "tq": None}


@triton.jit
def _dot(a, b, acc, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


# row offset, table stride and query count change from one serving step to the next: one
# compiled kernel for all their values, not one per value class (1, multiples of 16, other)
@triton.jit(do_not_specialize=["stride_btb", "ROW0", "T", "window"])
def _attention_kernel(
    Q, stride_qb, stride_qh, stride_qt,
    K, stride_kb, stride_kn, stride_kh,
    V, stride_vb, stride_vn, stride_vh,
    KS, KZ, KC, stride_ksb, stride_ksn, stride_ksh,
    VS, VZ, VC, stride_vsb, stride_vsn, stride_vsh,
    BT, stride_btb, capacity,
    QSTART, KVLEN, QOFF, ROW0,
    O, stride_ob, stride_oh, stride_ot,
    PO, PL,
    qk_scale, T, H_KV, split_len, num_splits, window,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    PAGED: tl.constexpr,
    CAUSAL: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DT: tl.constexpr,
    FAST: tl.constexpr,
    NEED_SIDECARS: tl.constexpr,
    K_MODE: tl.constexpr, K_BITS: tl.constexpr, K_SIGNED: tl.constexpr, K_OFFSET: tl.constexpr,
    K_GROUP: tl.constexpr, K_ZERO: tl.constexpr, K_FACTOR: tl.constexpr, K_SPLIT: tl.constexpr,
    K_DIRECT: tl.constexpr,
    V_MODE: tl.constexpr, V_BITS: tl.constexpr, V_SIGNED: tl.constexpr, V_OFFSET: tl.constexpr,
    V_GROUP: tl.constexpr, V_ZERO: tl.constexpr, V_FACTOR: tl.constexpr, V_SPLIT: tl.constexpr,
    V_DIRECT: tl.constexpr,
    K_PURE: tl.constexpr,
    VARLEN: tl.constexpr,
    K_INT8: tl.constexpr = False,
    PDL: tl.constexpr = False,
    WINDOWED: tl.constexpr = False,
):  # fmt: skip
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = ROW0 + pid_bh // H_KV  # packed launches may start past the step's first rows
    hk = pid_bh % H_KV
    # query rows (t, g) of this tile
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    t = m // G
    hq = hk * G + m % G
    if VARLEN:
        # packed rows: row b's T_b = kv_len - q_start queries start at token QOFF[b] of batch 0
        T_row = (tl.load(KVLEN + b) - tl.load(QSTART + b)).to(tl.int32)
        tok = tl.load(QOFF + b).to(tl.int32) + t
        row_ok = t < T_row
        q_off = hq * stride_qh + tok.to(tl.int64) * stride_qt
    else:
        T_row = T
        row_ok = t < T
        q_off = b * stride_qb + hq * stride_qh + t * stride_qt
    # the query in the dot's dtype, log2 domain (the softmax runs on exp2); 4-bit keys are
    # scored as two halves, even channels against the low nibbles and odd against the high
    d = tl.arange(0, HEAD_DIM)
    if K_SPLIT:
        d2 = tl.arange(0, HEAD_DIM // 2)
        qa = tl.load(Q + q_off[:, None] + 2 * d2[None, :], mask=row_ok[:, None], other=0.0)
        qb = tl.load(Q + q_off[:, None] + 2 * d2[None, :] + 1, mask=row_ok[:, None], other=0.0)
        qa = (qa.to(tl.float32) * qk_scale).to(DT)
        qb = (qb.to(tl.float32) * qk_scale).to(DT)
    elif K_INT8:
        # q8 keys: int8 queries, one scale a query row, scored by integer dots with the codes as
        # stored (the key tile needs no conversion, and half the tensor-core instructions of fp16)
        qa = tl.load(Q + q_off[:, None] + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32) * qk_scale
        q_max = tl.max(tl.abs(qa), axis=1)
        q_sc = tl.where(q_max > 0.0, q_max / 127.0, 1.0)
        qa = round_half_even(qa / q_sc[:, None]).to(tl.int8)
        qb = qa
    else:
        qa = tl.load(Q + q_off[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
        qa = (qa.to(tl.float32) * qk_scale).to(DT)
        qb = qa

    kv_len = tl.load(KVLEN + b).to(tl.int32)
    kv_len = tl.minimum(kv_len, capacity)  # never read past the table or buffer
    if CAUSAL:
        q0 = tl.load(QSTART + b).to(tl.int32)  # the row's first query's position
        q_pos = q0 + t  # (M,)
        t_last = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, G * T_row - 1) // G
        hi = tl.minimum(kv_len, q0 + t_last + 1)
        if VARLEN:
            hi = tl.where(pid_m * BLOCK_M < G * T_row, hi, 0)  # a tile past the row's queries reads nothing
    else:
        q_pos = kv_len + t  # sees every key below kv_len
        hi = kv_len
    lo = pid_s * split_len
    if WINDOWED:  # (CAUSAL) the splits cover the row's window, from its first query's on (the plan's span)
        lo += tl.maximum(q0 - window + 1, 0)
    hi = tl.minimum(hi, lo + split_len)
    if WINDOWED:  # from the window of the tile's first query: no query of it sees a key before
        lo = tl.maximum(lo, q0 + (pid_m * BLOCK_M) // G - window + 1)

    # 4-bit values accumulate the even and the odd channels apart (acc_a, acc_b)
    if V_SPLIT:
        VD: tl.constexpr = HEAD_DIM // 2
    else:
        VD: tl.constexpr = HEAD_DIM
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc_a = tl.zeros((BLOCK_M, VD), tl.float32)
    acc_b = tl.zeros((BLOCK_M, VD), tl.float32)

    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        if PAGED:
            # 64-bit only where it must be: one 32 x 32 -> 64 multiply per row and tensor
            blk = tl.load(BT + b * stride_btb + n // PAGE, mask=n_ok, other=0).to(tl.int64)
            pos = n % PAGE
            k_rows = blk * stride_kb + (pos * stride_kn + hk * stride_kh)
            v_rows = blk * stride_vb + (pos * stride_vn + hk * stride_vh)
            if NEED_SIDECARS:
                ks_rows = blk * stride_ksb + (pos * stride_ksn + hk * stride_ksh)
                vs_rows = blk * stride_vsb + (pos * stride_vsn + hk * stride_vsh)
        else:
            nn = n.to(tl.int64)
            k_rows = b * stride_kb + nn * stride_kn + hk * stride_kh
            v_rows = b * stride_vb + nn * stride_vn + hk * stride_vh
            if NEED_SIDECARS:
                ks_rows = b * stride_ksb + nn * stride_ksn + hk * stride_ksh
                vs_rows = b * stride_vsb + nn * stride_vsn + hk * stride_vsh
        if not NEED_SIDECARS:
            ks_rows = k_rows
            vs_rows = v_rows

        if K_MODE == 0:  # inline: a helper call costs the interpreter more than the tile
            ka = tl.load(K + k_rows[:, None] + d[None, :], mask=n_ok[:, None], other=0.0).to(DT)
            s = _dot(qa, tl.trans(ka), None, DOT_FP32)  # (M, N)
        elif K_INT8:  # signed bytes straight into the integer dot; the key scale below
            ka = tl.load(K + k_rows[:, None] + d[None, :], mask=n_ok[:, None], other=0)
            s = tl.dot(qa, tl.trans(ka), out_dtype=tl.int32).to(tl.float32) * q_sc[:, None]
        else:
            ka, kb = kv_tile(K, KS, KZ, KC, k_rows, ks_rows, n_ok, BLOCK_N, HEAD_DIM, K_MODE, K_BITS,
                             K_SIGNED, K_OFFSET, K_GROUP, K_ZERO, K_FACTOR, K_SPLIT, K_DIRECT, FAST, DT, K_PURE)  # fmt: skip
            s = _dot(qa, tl.trans(ka), None, DOT_FP32)
            if K_SPLIT:
                s = _dot(qb, tl.trans(kb), s, DOT_FP32)
        if K_FACTOR:
            s = s * tl.load(KS + ks_rows, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if WINDOWED:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

        if V_FACTOR:
            p = p * tl.load(VS + vs_rows, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        p = p.to(DT)
        if V_MODE == 0:
            va = tl.load(V + v_rows[:, None] + d[None, :], mask=n_ok[:, None], other=0.0).to(DT)
            acc_a = _dot(p, va, acc_a * alpha[:, None], DOT_FP32)
        else:
            va, vb = kv_tile(V, VS, VZ, VC, v_rows, vs_rows, n_ok, BLOCK_N, HEAD_DIM, V_MODE, V_BITS,
                             V_SIGNED, V_OFFSET, V_GROUP, V_ZERO, V_FACTOR, V_SPLIT, V_DIRECT, FAST, DT, False)  # fmt: skip
            acc_a = _dot(p, va, acc_a * alpha[:, None], DOT_FP32)
            if V_SPLIT:
                acc_b = _dot(p, vb, acc_b * alpha[:, None], DOT_FP32)

    if SPLIT and PDL:
        gdc_launch_dependents()  # the merge's programs may start; they wait for these results
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    # output channels of acc_a (and acc_b): all of them, or the even (and odd) ones
    if V_SPLIT:
        c = 2 * tl.arange(0, VD)
    else:
        c = tl.arange(0, VD)
    if not SPLIT:
        if VARLEN:
            o_off = hq * stride_oh + tok.to(tl.int64) * stride_ot
        else:
            o_off = b * stride_ob + hq * stride_oh + t * stride_ot
        o_ptr = O + o_off[:, None] + c[None, :]
        tl.store(o_ptr, (acc_a / l_safe[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None])
        if V_SPLIT:
            tl.store(o_ptr + 1, (acc_b / l_safe[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None])
    else:
        # partials (B, Hq, T, num_splits, D) and base-2 lse (B, Hq, T, num_splits), contiguous
        r = (b * (H_KV * G) + hq) * T + t
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(PL + r * num_splits + pid_s, lse, mask=row_ok)
        po = PO + ((r * num_splits + pid_s) * HEAD_DIM)[:, None] + c[None, :]
        tl.store(po, acc_a / l_safe[:, None], mask=row_ok[:, None])
        if V_SPLIT:
            tl.store(po + 1, acc_b / l_safe[:, None], mask=row_ok[:, None])


def launch_attention(
    q: torch.Tensor,
    k_payload: torch.Tensor,
    v_payload: torch.Tensor,
    k_fmt: PageFormat,
    v_fmt: PageFormat,
    *,
    block_tables: torch.Tensor | None,
    q_start: torch.Tensor | None,
    kv_len: torch.Tensor,
    scale: float | None,
    out_dtype: torch.dtype,
    config: LaunchConfig | None = None,
    q_offsets: torch.Tensor | None = None,
    max_q_len: int = 0,
    single_rows: int = 0,
    first_row: int = 0,
    out: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Launch the kernel on validated inputs; ``[B, Hq, T, D]`` in ``out_dtype`` (into ``out``,
    a tensor of that shape and dtype with a contiguous last dim, when given).

    Paged (``block_tables`` given): payloads ``[num_blocks, page, H_kv, D']``.
    Ragged (``block_tables`` ``None``): payloads ``[B, H_kv, capacity, D']``,
    no causal limit beyond ``kv_len`` without a window (``q_start`` ignored then).

    Packed (paged only, ``q_offsets`` given): ``q`` is ``[1, Hq, N, D]``, the rows'
    queries side by side, row ``b``'s ``kv_len[b] - q_start[b]`` (at most ``max_q_len``)
    from token ``q_offsets[b]``; the result has ``q``'s shape (token-major in memory). No
    split: prompt chunks give the grid programs enough, and a tile past its row's queries
    reads nothing. ``single_rows``: the first rows feed one query each, tokens ``0 ..
    single_rows - 1`` (a serving step's decode rows); they go to a decode launch of their own
    (a tile of one token's query heads), the other rows to the packed one.
    ``first_row`` (packed only): launch rows ``first_row ..`` of the tables, the rows before
    left alone (no sliced pointers, whose alignment would compile a kernel per class).
    ``window`` (with ``q_start``): a sliding window of that many keys, on this kernel (the
    Gluon and CUDA-core decode kernels take none).
    """
    cfg = config or LaunchConfig()
    varlen = q_offsets is not None
    if varlen and single_rows:
        return _launch_with_singles(
            q, k_payload, v_payload, k_fmt, v_fmt, block_tables=block_tables, q_start=q_start,
            kv_len=kv_len, scale=scale, out_dtype=out_dtype, config=config, q_offsets=q_offsets,
            max_q_len=max_q_len, single_rows=single_rows, out=out, window=window,
        )  # fmt: skip
    if varlen:
        assert block_tables is not None and q_start is not None and q.shape[0] == 1 and max_q_len >= 1
        cfg = replace(cfg, num_splits=1)
        B, T = block_tables.shape[0] - first_row, max_q_len  # rows first_row .. of the tables
        Hq, D = q.shape[1], q.shape[3]
    else:
        B, Hq, T, D = q.shape
    if block_tables is not None:
        H_kv, page = k_payload.shape[2], k_payload.shape[1]
        max_blocks = block_tables.shape[1]
        kstr = (k_payload.stride(0), k_payload.stride(1), k_payload.stride(2))
        vstr = (v_payload.stride(0), v_payload.stride(1), v_payload.stride(2))
        bt, bt_stride = block_tables, block_tables.stride(0)
    else:
        H_kv, cap = k_payload.shape[1], k_payload.shape[2]
        page, max_blocks = 1, cap
        kstr = (k_payload.stride(0), k_payload.stride(2), k_payload.stride(1))
        vstr = (v_payload.stride(0), v_payload.stride(2), v_payload.stride(1))
        bt, bt_stride = kv_len, 0
    G = Hq // H_kv
    capacity = max_blocks * page
    quantised = k_fmt.mode != FP or v_fmt.mode != FP
    assert window is None or (q_start is not None and window >= 1), window
    decode = T == 1 and not varlen and block_tables is not None and window is None
    if decode and cfg.decode_kernel in (None, "gluon"):
        kw = dict(block_tables=block_tables, kv_len=kv_len, q_start=q_start, capacity=capacity, scale=scale,
                  out=out, out_dtype=out_dtype, cfg=cfg)
        if cfg.decode_kernel == "gluon":
            return gluon_decode.decode(q, k_payload, v_payload, k_fmt, v_fmt, **kw)
        kind = gluon_decode.takes_by_default(GLUON_DECODE, cfg, k_fmt, v_fmt, q, G, k_payload, B * H_kv)
        if kind is not None:
            done = gluon_decode.try_decode(q, k_payload, v_payload, k_fmt, v_fmt, kind=kind, **kw)
            if done is not None:  # else it failed here (and is not tried again): the kernels below
                return done
    if decode and uses_cuda_core_decode(k_fmt, v_fmt, k_payload, v_payload, cfg, G):
        if out is None:
            out = torch.empty((B, Hq, 1, D), dtype=out_dtype, device=q.device)
        rows, lanes, splits, split_len, num_warps = triton_decode_quant.plan_decode(
            B, H_kv, capacity, D, q.device, cfg
        )
        parts = triton_decode_quant.launch_decode(
            q, k_payload, v_payload, k_fmt, v_fmt,
            block_tables=block_tables, q_start=q_start, kv_len=kv_len, scale=scale, out=out,
            rows=rows, lanes=lanes, splits=splits, split_len=split_len, num_warps=num_warps,
            num_stages=cfg.num_stages or 1,
        )  # fmt: skip
        if parts is not None:
            _merge(parts[0], parts[1], out, splits)
        return out
    if varlen and cfg.block_m is None and not quantised and q.device.type == "cuda":
        # H200, a prompt step of 27 chunks (15,852 tokens), 32/8 heads: 128 query rows a tile
        # 0.69 ms against 0.82-0.91 at 64 (benchmarks/RESULTS.md, 2026-12-02)
        cfg = replace(cfg, block_m=max(16, min(PACKED_BLOCK_M, _next_pow2(G * T))))
    span = capacity if window is None else min(capacity, window + T - 1)  # the keys a row's queries see
    block_m, m_tiles, block_n, splits, split_len, base = plan_launch(B, H_kv, G, T, span, q.device, cfg, quantised)
    sm_scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if out is None and varlen:  # token-major, so that the caller's (1, N, H_q * D) view of it needs no copy
        out = torch.empty((1, q.shape[2], Hq, D), dtype=out_dtype, device=q.device).transpose(1, 2)
    elif out is None:
        out = torch.empty((B, Hq, T, D), dtype=out_dtype, device=q.device)
    po, pl = split_partials(out, splits)

    def sidecar_args(fmt: PageFormat, payload: torch.Tensor, paged: bool):
        s = fmt.scale if fmt.scale is not None else payload
        z = fmt.zero if fmt.zero is not None else s
        c = fmt.centroids if fmt.centroids is not None else s
        if fmt.scale is None:
            return s, z, c, 0, 0, 0
        if paged:
            return s, z, c, s.stride(0), s.stride(1), s.stride(2)
        return s, z, c, s.stride(0), s.stride(2), s.stride(1)

    paged = block_tables is not None
    # the interpreter has no bf16 arithmetic: dot in fp32 there (and for fp32 queries); on the
    # GPU quantised tiles meet the query in fp16, which holds every code exactly
    compiled = q.device.type == "cuda"
    direct = quantised and direct_format(k_fmt, D) and direct_format(v_fmt, D)
    dot_fp32 = not compiled or q.dtype == torch.float32
    # by default only where the dot is in 16 bits anyway (compiled, bf16/fp16 queries)
    int8_q = INT8_QUERIES and not dot_fp32 if cfg.int8_queries is None else cfg.int8_queries
    int8_q = int8_q and int8_key_format(k_fmt, D)
    if dot_fp32:
        dot_dtype = tl.float32
    elif direct:
        dot_dtype = tl.float16
    else:
        dot_dtype = tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16
    # H200 sweeps: 4 warps beat 8 for bf16 and for every quantised format at its best tile
    num_warps = cfg.num_warps or 4
    num_stages = cfg.num_stages or (2 if q.device.type == "cuda" else 1)
    qs = q_start if q_start is not None else kv_len
    grid = (B * H_kv, m_tiles, splits)
    _attention_kernel[grid](
        q, q.stride(0), q.stride(1), q.stride(2),
        k_payload, *kstr,
        v_payload, *vstr,
        *sidecar_args(k_fmt, k_payload, paged),
        *sidecar_args(v_fmt, v_payload, paged),
        bt, bt_stride, capacity,
        qs, kv_len, q_offsets if varlen else kv_len, first_row,
        out, out.stride(0), out.stride(1), out.stride(2),
        po, pl,
        sm_scale * LOG2E, T, H_kv, split_len, splits, window or 0,
        G=G, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page, PAGED=paged,
        CAUSAL=q_start is not None, SPLIT=splits > 1, DOT_FP32=dot_fp32, DT=dot_dtype, FAST=compiled,
        K_PURE=True, VARLEN=varlen, K_INT8=int8_q,
        NEED_SIDECARS=k_fmt.scale is not None or v_fmt.scale is not None,
        **format_constexprs("K", k_fmt, D, direct), **format_constexprs("V", v_fmt, D, direct),
        PDL=splits > 1 and bool(_pdl(q.device)), WINDOWED=window is not None, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    merge_splits(po, pl, out, splits, base, split_len, block_n)
    return out


def _launch_with_singles(q, k_payload, v_payload, k_fmt, v_fmt, *, block_tables, q_start, kv_len, q_offsets,
                         max_q_len, single_rows, out, **kw) -> torch.Tensor:
    """:func:`launch_attention` of packed rows whose first ``single_rows`` feed one query each
    (tokens ``0 .. single_rows - 1``): those as a decode launch of their own, the rest packed,
    into one token-major result. In the packed launch a decode row's programs queue behind
    the chunks' and pad its query heads to the chunks' tile; on its own it takes a tile of
    one token's heads. Unsplit (unless ``config`` says otherwise): a split plan follows each
    step's table width, and every split count would compile a merge of its own mid-serving."""
    s, B = single_rows, block_tables.shape[0]
    cfg = kw.pop("config", None) or LaunchConfig()
    Hq, N, D = q.shape[1], q.shape[2], q.shape[3]
    if out is None:
        out = torch.empty((1, N, Hq, D), dtype=kw["out_dtype"], device=q.device).transpose(1, 2)

    def rows(t: torch.Tensor) -> torch.Tensor:  # (1, Hq, N, D) -> the single rows' (s, Hq, 1, D)
        return t[0, :, :s].transpose(0, 1)[:, :, None]

    unsplit = cfg if cfg.num_splits is not None else replace(cfg, num_splits=1)
    launch_attention(rows(q), k_payload, v_payload, k_fmt, v_fmt, block_tables=block_tables[:s],
                     q_start=q_start[:s], kv_len=kv_len[:s], out=rows(out), config=unsplit, **kw)
    if s < B:
        launch_attention(q, k_payload, v_payload, k_fmt, v_fmt, block_tables=block_tables,
                         q_start=q_start, kv_len=kv_len, q_offsets=q_offsets, max_q_len=max_q_len,
                         first_row=s, out=out, config=cfg, **kw)
    return out


def decode_family(k_fmt: PageFormat, v_fmt: PageFormat) -> str:
    """The :data:`QUANT_DECODE_KERNEL` key of a pair of page formats."""
    return "turboquant" if v_fmt.mode == CENTROID else "kv_quant"  # TurboQuant values are centroids


def uses_cuda_core_decode(
    k_fmt: PageFormat,
    v_fmt: PageFormat,
    k_payload: torch.Tensor,
    v_payload: torch.Tensor,
    cfg: LaunchConfig,
    group: int = 1,
) -> bool:
    """True when a decode step over these pages, ``group`` query heads per kv head, goes
    to the CUDA-core kernel (:mod:`kvtier.kernels.triton_decode_quant`) rather than the
    MMA kernel. Chosen by default only for groups up to
    ``triton_decode_quant.MAX_DEFAULT_GROUP`` heads (registers); asked for, at any group.
    """
    if cfg.decode_kernel is not None:
        choice = cfg.decode_kernel
    elif group > triton_decode_quant.MAX_DEFAULT_GROUP:
        return False
    else:
        choice = QUANT_DECODE_KERNEL[decode_family(k_fmt, v_fmt)]
    if choice != "cuda_core" or not triton_decode_quant.decode_supported(k_fmt, v_fmt, k_fmt.head_dim):
        return False
    for fmt, payload in ((k_fmt, k_payload), (v_fmt, v_payload)):
        # 3-bit codes are read as 16-bit halfwords
        if fmt.bits == 3 and (payload.data_ptr() % 2 or any(st % 2 for st in payload.stride()[:3])):
            return False
    return True
