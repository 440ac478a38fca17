"""A decode kernel for quantised pages that scores and accumulates on CUDA cores.

Decode (one query token per row) is bound by memory: every step reads the whole
cache and does a few multiply-adds per byte. The general kernel of
:mod:`kvtier.kernels.triton_attention` feeds the tensor cores, which for a GQA
group of ``G`` query heads means padding the query tile to 16 rows and moving
every dequantised K/V element through shared memory into the MMA operand layout.
This kernel does no ``tl.dot``:

- the ``G`` query heads of one kv head are held in registers in fp32,
  ``[G, NG, GS]`` (``NG`` scale groups of ``GS`` channels; ``NG = 1`` for the
  per-token scales of q8 and q4);
- scores are a broadcast multiply and a sum over the channels, per group:
  ``s = sum_g scale_g * (q_g . code_g) + zero_g * sum(q_g)``, so scales and
  zeros touch one partial sum per group instead of every element;
- values are accumulated from the codes (or their Lloyd-Max centroids) with
  weights ``p * scale_g``; zeros add ``p * zero_g`` to a per-group sum;
- codes are unpacked from 8-, 4-, 3- or 2-bit payloads by shifts and masks.

A program owns one (row, kv head) and one split of the key range; splits write
their normalised partial output and log-sum-exp for the merge kernel of
:mod:`kvtier.kernels.triton_attention`. :func:`decode_supported` says which
formats the kernel reads; :func:`launch_decode` launches it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvtier.kernels.triton_quant import AFFINE, CENTROID, PageFormat, codes_to_float

LOG2E = 1.4426950408889634
#: bit widths whose codes this kernel unpacks (others use the MMA kernel)
DECODE_BITS = (2, 3, 4, 8)
#: CUDA defaults: keys per tile, warps per program, programs per multiprocessor, and the
#: shortest split (``LaunchConfig`` overrides the first two and the split count)
BLOCK_N, NUM_WARPS, PROGRAMS_PER_SM, DECODE_MIN_SPLIT = 8, 1, 16, 256


@triton.jit
def _unpack(P, rows, ok, R: tl.constexpr, NL: tl.constexpr, NG: tl.constexpr, GS: tl.constexpr, BITS: tl.constexpr):
    """Unsigned int32 codes ``[1, R, NL, NG, GS]`` of the rows at byte offsets ``rows`` ``[1, R, NL, 1, 1]``.

    Codes are read in the shape the products use (a leading 1 for the query
    heads), so each thread keeps the channels it loaded: no layout conversion.
    Signed 8-bit codes come back as their two's complement bytes.
    """
    grp = tl.arange(0, NG)[None, None, None, :, None]
    if BITS == 8:
        c = tl.arange(0, GS)[None, None, None, None, :]
        u = tl.load(P + rows + grp * GS + c, mask=ok, other=0).to(tl.int32) & 0xFF
    elif BITS == 4:
        # byte j: channel 2j in the low nibble, 2j + 1 in the high nibble
        c = tl.arange(0, GS // 2)[None, None, None, None, :]
        byte = tl.load(P + rows + grp * (GS // 2) + c, mask=ok, other=0).to(tl.int32) & 0xFF
        u = tl.reshape(tl.join(byte & 0xF, byte >> 4), (1, R, NL, NG, GS))
    elif BITS == 2:
        c = tl.arange(0, GS // 4)[None, None, None, None, :]
        byte = tl.load(P + rows + grp * (GS // 4) + c, mask=ok, other=0).to(tl.int32) & 0xFF
        # join(join(a, c), join(b, d))[..., i, j] is (a, b, c, d)[2i + j]: codes in order
        even = tl.join(byte & 3, (byte >> 4) & 3)
        odd = tl.join((byte >> 2) & 3, byte >> 6)
        u = tl.reshape(tl.join(even, odd), (1, R, NL, NG, GS))
    else:
        # 3 bits (GS == 32): a group is 12 bytes, three little-endian words w0 w1 w2;
        # chunk c (8 codes, 24 bits) starts at bit 24c of the group
        W = P.to(tl.pointer_type(tl.int32))
        wp = W + rows // 4 + grp * 3  # (1, R, NL, NG, 1)
        w0 = tl.load(wp, mask=ok, other=0)
        w1 = tl.load(wp + 1, mask=ok, other=0)
        w2 = tl.load(wp + 2, mask=ok, other=0)
        c0 = w0 & 0xFFFFFF
        c1 = ((w0 >> 24) & 0xFF) | ((w1 & 0xFFFF) << 8)
        c2 = ((w1 >> 16) & 0xFFFF) | ((w2 & 0xFF) << 16)
        c3 = (w2 >> 8) & 0xFFFFFF
        chunks = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (1, R, NL, NG, 4, 1))
        k = tl.arange(0, 8)[None, None, None, None, None, :]
        u = tl.reshape((chunks >> (3 * k)) & 7, (1, R, NL, NG, GS))
    return u


@triton.jit
def _values(u, C, MODE: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr, OFFSET: tl.constexpr):
    """fp32 values of unsigned int32 codes ``u`` before the scale: ``code + OFFSET`` or ``centroid[u]``."""
    if MODE == 2:
        return tl.load(C + u)  # a table of 2**BITS floats: stays in L1
    else:
        return codes_to_float(u, BITS, SIGNED, OFFSET)


@triton.jit
def _decode_kernel(
    Q, stride_qb, stride_qh,
    K, stride_kb, stride_kn, stride_kh,
    V, stride_vb, stride_vn, stride_vh,
    KS, KZ, KC, stride_ksb, stride_ksn, stride_ksh,
    VS, VZ, VC, stride_vsb, stride_vsn, stride_vsh,
    BT, stride_btb, capacity, QSTART, KVLEN,
    O, stride_ob, stride_oh,
    PO, PL,
    qk_scale, H_KV, split_len, num_splits,
    G: tl.constexpr, GP: tl.constexpr,
    NG: tl.constexpr, GS: tl.constexpr,
    R: tl.constexpr, NL: tl.constexpr,
    PAGE: tl.constexpr, CAUSAL: tl.constexpr, SPLIT: tl.constexpr,
    K_MODE: tl.constexpr, K_BITS: tl.constexpr, K_SIGNED: tl.constexpr, K_OFFSET: tl.constexpr,
    K_NG: tl.constexpr, K_ZERO: tl.constexpr,
    V_MODE: tl.constexpr, V_BITS: tl.constexpr, V_SIGNED: tl.constexpr, V_OFFSET: tl.constexpr,
    V_NG: tl.constexpr, V_ZERO: tl.constexpr,
):  # fmt: skip
    # Tiles are 5-d: (query head, key row of a lane, key lane, scale group, channel in group).
    # A tile holds R * NL keys, key r * NL + l in row r of lane l; each lane accumulates its
    # own rows' values (no cross-lane sum per tile) and the lanes are summed once at the end.
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bh // H_KV
    hk = pid_bh % H_KV
    g5 = tl.arange(0, GP)[:, None, None, None, None]
    r5 = tl.arange(0, R)[None, :, None, None, None]
    l5 = tl.arange(0, NL)[None, None, :, None, None]
    grp5 = tl.arange(0, NG)[None, None, None, :, None]
    c5 = tl.arange(0, GS)[None, None, None, None, :]
    q_ptr = Q + b * stride_qb + (hk * G + g5) * stride_qh + grp5 * GS + c5
    q = tl.load(q_ptr, mask=g5 < G, other=0.0).to(tl.float32) * qk_scale  # (GP, 1, 1, NG, GS), log2 units
    if K_ZERO:
        q_sum = tl.sum(q, axis=4)  # (GP, 1, 1, NG): what a zero of 1 adds to a score

    hi = tl.minimum(tl.load(KVLEN + b).to(tl.int32), capacity)  # never read past the table
    if CAUSAL:
        hi = tl.minimum(hi, tl.load(QSTART + b).to(tl.int32) + 1)
    lo = pid_s * split_len
    hi = tl.minimum(hi, lo + split_len)

    m_i = tl.full((GP, 1, 1), -1.0e30, tl.float32)  # finite: exp2(-inf - m_i) stays 0, never nan
    l_i = tl.zeros((GP, 1, 1), tl.float32)
    acc = tl.zeros((GP, 1, NL, NG, GS), tl.float32)
    zacc = tl.zeros((GP, 1, NL, V_NG), tl.float32)
    gk = tl.arange(0, K_NG)[None, None, None, :]
    gv = tl.arange(0, V_NG)[None, None, None, :]
    key = r5 * NL + l5  # (1, R, NL, 1, 1)

    for n0 in range(lo, hi, R * NL):
        n = n0 + key
        n_ok = n < hi
        blk = tl.load(BT + b * stride_btb + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        pos = (n % PAGE).to(tl.int64)
        k_rows = blk * stride_kb + pos * stride_kn + hk * stride_kh  # (1, R, NL, 1, 1)
        v_rows = blk * stride_vb + pos * stride_vn + hk * stride_vh
        ks_rows = tl.reshape(blk * stride_ksb + pos * stride_ksn + hk * stride_ksh, (1, R, NL, 1))
        vs_rows = tl.reshape(blk * stride_vsb + pos * stride_vsn + hk * stride_vsh, (1, R, NL, 1))
        ok4 = tl.reshape(n_ok, (1, R, NL, 1))

        # scores: one partial dot per scale group, then its scale (and zero)
        kx = _values(_unpack(K, k_rows, n_ok, R, NL, NG, GS, K_BITS), KC, K_MODE, K_BITS, K_SIGNED, K_OFFSET)
        part = tl.sum(q * kx, axis=4)  # (GP, R, NL, NG)
        ksc = tl.load(KS + ks_rows + gk, mask=ok4, other=0.0).to(tl.float32)  # (1, R, NL, K_NG)
        if K_ZERO:
            kz = tl.load(KZ + ks_rows + gk, mask=ok4, other=0.0).to(tl.float32)
            part = part * ksc + q_sum * kz
        elif K_NG > 1:
            part = part * ksc
        s = tl.sum(part, axis=3)  # (GP, R, NL)
        if K_NG == 1 and not K_ZERO:
            s = s * tl.reshape(ksc, (1, R, NL))
        s = tl.where(tl.reshape(n_ok, (1, R, NL)), s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(tl.max(s, axis=2, keep_dims=True), axis=1, keep_dims=True))
        alpha = tl.exp2(m_i - m_new)  # (GP, 1, 1)
        p = tl.exp2(s - m_new)  # (GP, R, NL)
        l_i = l_i * alpha + tl.sum(tl.sum(p, axis=2, keep_dims=True), axis=1, keep_dims=True)
        m_i = m_new

        # values: weights p * scale per group, times the codes (or centroids)
        vx = _values(_unpack(V, v_rows, n_ok, R, NL, NG, GS, V_BITS), VC, V_MODE, V_BITS, V_SIGNED, V_OFFSET)
        vsc = tl.load(VS + vs_rows + gv, mask=ok4, other=0.0).to(tl.float32)  # (1, R, NL, V_NG)
        w = p[:, :, :, None] * vsc  # (GP, R, NL, V_NG)
        a4 = alpha[:, :, :, None]
        acc = acc * a4[:, :, :, :, None] + tl.sum(w[:, :, :, :, None] * vx, axis=1, keep_dims=True)
        if V_ZERO:
            vz = tl.load(VZ + vs_rows + gv, mask=ok4, other=0.0).to(tl.float32)
            zacc = zacc * a4 + tl.sum(p[:, :, :, None] * vz, axis=1, keep_dims=True)

    if V_ZERO:
        acc += zacc[:, :, :, :, None]
    acc = tl.sum(acc, axis=2)  # (GP, 1, NG, GS): the lanes' sums
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # (GP, 1, 1)
    out = acc / l_safe[:, :, :, None]
    g4 = tl.arange(0, GP)[:, None, None, None]
    grp4 = tl.arange(0, NG)[None, None, :, None]
    c4 = tl.arange(0, GS)[None, None, None, :]
    if not SPLIT:
        o_ptr = O + b * stride_ob + (hk * G + g4) * stride_oh + grp4 * GS + c4
        tl.store(o_ptr, out.to(O.dtype.element_ty), mask=g4 < G)
    else:
        # partials (B, Hq, 1, num_splits, D) and base-2 lse (B, Hq, 1, num_splits), contiguous
        g3 = tl.arange(0, GP)[:, None, None]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        r3 = b * (H_KV * G) + hk * G + g3
        tl.store(PL + r3 * num_splits + pid_s, lse, mask=g3 < G)
        r4 = b * (H_KV * G) + hk * G + g4
        tl.store(PO + (r4 * num_splits + pid_s) * (NG * GS) + grp4 * GS + c4, out, mask=g4 < G)


def decode_supported(k_fmt: PageFormat, v_fmt: PageFormat, head_dim: int) -> bool:
    """True when :func:`launch_decode` reads pages of ``k_fmt`` and ``v_fmt``.

    Both must be quantised (``AFFINE`` or ``CENTROID``) with codes of
    :data:`DECODE_BITS` bits and one scale per token or per 32 channels; 3-bit
    payloads must keep rows on 4-byte boundaries.
    """
    for fmt in (k_fmt, v_fmt):
        if fmt.mode not in (AFFINE, CENTROID) or fmt.bits not in DECODE_BITS or fmt.scale is None:
            return False
        if fmt.group not in (head_dim, 32) or head_dim % 8:
            return False
        if fmt.bits == 3 and (head_dim % 32 or fmt.packed_dim % 4):
            return False
    return True


def plan_decode(
    B: int, H_kv: int, capacity: int, device: torch.device, cfg
) -> tuple[int, int, int, int]:
    """``(block_n, num_splits, split_len, num_warps)`` of one decode launch.

    ``cfg`` is a ``LaunchConfig``; its ``None`` fields are chosen here. Splits:
    enough programs for :data:`PROGRAMS_PER_SM` per multiprocessor, each split at
    least ``cfg.min_split_tokens`` long (``DECODE_MIN_SPLIT`` on CUDA) and a whole
    number of tiles. Like the MMA kernel's plan, it depends on the capacity, never
    on the lengths (no device-to-host sync, one shape across steps).
    """
    on_gpu = device.type == "cuda"
    block_n = cfg.block_n or (BLOCK_N if on_gpu else 16)
    num_warps = cfg.num_warps or (NUM_WARPS if on_gpu else 1)
    if cfg.num_splits is not None:
        splits = max(1, cfg.num_splits)
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else 1
        want = triton.cdiv(PROGRAMS_PER_SM * sms, B * H_kv)
        min_split = DECODE_MIN_SPLIT if on_gpu else cfg.min_split_tokens
        splits = max(1, min(want, triton.cdiv(capacity, max(min_split, block_n))))
    split_len = triton.cdiv(triton.cdiv(capacity, splits), block_n) * block_n
    splits = max(1, triton.cdiv(capacity, split_len))
    return block_n, splits, split_len, num_warps


def key_lanes(v_fmt: PageFormat, head_dim: int, num_warps: int) -> int:
    """Keys side by side in a tile (``NL``): the threads of the program over the threads
    that share one value row, so each thread sums its own rows' values in registers.

    Triton loads at most 16 contiguous bytes per thread, and a scale group's bytes
    are contiguous (3-bit codes: one 32-bit word at a time), so a row of ``NG``
    groups spreads over ``NG * max(1, group_bytes / 16)`` threads.
    """
    ng, gs = _groups(head_dim)
    per_group = 1 if v_fmt.bits == 3 else max(1, gs * v_fmt.bits // 8 // 16)
    return max(1, 32 * num_warps // min(32, ng * per_group))


def _groups(head_dim: int) -> tuple[int, int]:
    """``(NG, GS)``: channels in groups of 32 (one group below 32 channels)."""
    ng = max(1, head_dim // 32)
    return ng, head_dim // ng


def _format_constexprs(prefix: str, fmt: PageFormat, head_dim: int) -> dict[str, object]:
    return {
        f"{prefix}_MODE": fmt.mode,
        f"{prefix}_BITS": fmt.bits,
        f"{prefix}_SIGNED": fmt.signed,
        f"{prefix}_OFFSET": fmt.offset,
        f"{prefix}_NG": 1 if fmt.group == head_dim else head_dim // fmt.group,
        f"{prefix}_ZERO": fmt.zero is not None,
    }


def _sidecars(fmt: PageFormat) -> tuple:
    s = fmt.scale
    z = fmt.zero if fmt.zero is not None else s
    c = fmt.centroids if fmt.centroids is not None else s
    return s, z, c, s.stride(0), s.stride(1), s.stride(2)


def launch_decode(
    q: torch.Tensor,
    k_payload: torch.Tensor,
    v_payload: torch.Tensor,
    k_fmt: PageFormat,
    v_fmt: PageFormat,
    *,
    block_tables: torch.Tensor,
    q_start: torch.Tensor | None,
    kv_len: torch.Tensor,
    scale: float | None,
    out: torch.Tensor,
    block_n: int,
    splits: int,
    split_len: int,
    num_warps: int,
    num_stages: int,
) -> torch.Tensor:
    """One decode step over quantised pages into ``out`` ``[B, Hq, 1, D]``; returns the
    split partials ``(po, pl)`` to merge, or ``None`` when ``splits == 1`` (``out`` is final).

    ``q`` ``[B, Hq, 1, D]`` (already rotated when the keys are); pages
    ``[num_blocks, page, H_kv, D']`` that :func:`decode_supported` accepts.
    """
    B, Hq, _, D = q.shape
    H_kv, page = k_payload.shape[2], k_payload.shape[1]
    G = Hq // H_kv
    NG, GS = _groups(D)
    NL = key_lanes(v_fmt, D, num_warps)
    R = max(1, block_n // NL)
    sm_scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if splits > 1:
        po = torch.empty((B, Hq, 1, splits, D), dtype=torch.float32, device=q.device)
        pl = torch.empty((B, Hq, 1, splits), dtype=torch.float32, device=q.device)
    else:
        po = pl = out
    _decode_kernel[(B * H_kv, splits)](
        q, q.stride(0), q.stride(1),
        k_payload, k_payload.stride(0), k_payload.stride(1), k_payload.stride(2),
        v_payload, v_payload.stride(0), v_payload.stride(1), v_payload.stride(2),
        *_sidecars(k_fmt), *_sidecars(v_fmt),
        block_tables, block_tables.stride(0), block_tables.shape[1] * page,
        q_start if q_start is not None else kv_len, kv_len,
        out, out.stride(0), out.stride(1),
        po, pl,
        sm_scale * LOG2E, H_kv, split_len, splits,
        G=G, GP=triton.next_power_of_2(G), NG=NG, GS=GS,
        R=R, NL=NL, PAGE=page, CAUSAL=q_start is not None, SPLIT=splits > 1,
        **_format_constexprs("K", k_fmt, D), **_format_constexprs("V", v_fmt, D),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return (po, pl) if splits > 1 else None
