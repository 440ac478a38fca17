"""A decode kernel for quantised pages that scores and accumulates on CUDA cores.

Decode (one query token per row) reads the whole cache and does a few
multiply-adds per byte. The general kernel of :mod:`kvtier.kernels.triton_attention`
feeds the tensor cores, which for a GQA group of ``G`` query heads means padding
the query tile to 16 rows and moving every dequantised K/V tile through shared
memory into the MMA operand layout. This kernel does no ``tl.dot``:

- a program is one warp by default and owns one (row, kv head) and one split of
  the key range; the ``G`` query heads stay in registers in fp32;
- a tile is 5-d, ``(query head, key row of a thread, key lane, chunk, channel)``:
  every thread reads 16 channels (one chunk, ``2 * bits`` bytes) of its keys
  straight into the layout of the products, so nothing is converted between
  layouts;
- scores are a broadcast multiply and a sum per chunk, then the chunk's scale
  (and ``zero * sum(q)`` over the chunk): scales and zeros touch one partial sum
  per chunk, never an element; a 32-channel scale group is two chunks;
- values are accumulated from the codes (or their Lloyd-Max centroids) with
  weights ``p * scale``; zeros add ``p * zero`` to a per-chunk sum; each thread
  accumulates its own keys, and the lanes meet once, after the loop;
- the online softmax moves its running maximum only when a tile beats it by
  :data:`RESCALE_LOG2`, so most tiles skip the rescale of the accumulator;
- the loop loads tile ``i + 1`` (codes, sidecars, block table) before it
  computes tile ``i``.

Splits write their normalised partial output and log-sum-exp for the merge
kernel of :mod:`kvtier.kernels.triton_attention`. :func:`decode_supported` says
which formats the kernel reads; :func:`plan_decode` and :func:`launch_decode`
plan and launch it. ``docs/gpu.md`` compares it with the MMA kernel.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvtier.kernels.triton_quant import AFFINE, CENTROID, PageFormat

LOG2E = 1.4426950408889634
#: bit widths whose codes this kernel unpacks (others use the MMA kernel)
DECODE_BITS = (2, 3, 4, 8)
#: the running maximum of the online softmax moves only when a tile beats it by this
#: much (log2 units): probabilities stay below 2**8, and most tiles skip the rescale
RESCALE_LOG2: tl.constexpr = tl.constexpr(8.0)
#: CUDA defaults: keys per thread in a tile, warps per program, programs per
#: multiprocessor, and the shortest split (``LaunchConfig`` overrides the tile's keys,
#: the warps and the split count). One key a thread keeps a 4-head group at about 200
#: registers with no spill on sm_90; two spill.
ROWS_PER_LANE, NUM_WARPS, PROGRAMS_PER_SM, DECODE_MIN_SPLIT = 1, 1, 16, 256
#: larger GQA groups hold 2 x G x 16 fp32 registers a thread and spill: the MMA kernel
#: serves them unless a LaunchConfig asks for this one
MAX_DEFAULT_GROUP = 4


@triton.jit
def _load_codes(P, rows, ok, NC: tl.constexpr, BITS: tl.constexpr):
    """The packed codes of the rows at byte offsets ``rows`` ``[1, R, NL, 1, 1]``, as loaded.

    A row is ``NC`` chunks of 16 channels (``2 * BITS`` bytes each), one chunk a
    thread, loaded in the shape the products use (a leading 1 for the query
    heads) so each thread keeps the channels it loaded: no layout conversion.
    Returns three tensors: the chunk's bytes ``[1, R, NL, NC, 2 * BITS]`` (and two
    zeros), or for 3-bit codes its three little-endian halfwords ``[1, R, NL, NC, 1]``.
    """
    ch = tl.arange(0, NC)[None, None, None, :, None]
    if BITS == 3:
        H = P.to(tl.pointer_type(tl.int16))
        hp = H + rows // 2 + ch * 3
        return tl.load(hp, mask=ok, other=0), tl.load(hp + 1, mask=ok, other=0), tl.load(hp + 2, mask=ok, other=0)
    else:
        c = tl.arange(0, 2 * BITS)[None, None, None, None, :]
        return tl.load(P + rows + ch * (2 * BITS) + c, mask=ok, other=0), 0, 0


@triton.jit
def _unpack(a, b, c, R: tl.constexpr, NL: tl.constexpr, NC: tl.constexpr, BITS: tl.constexpr):
    """Unsigned int32 codes ``[1, R, NL, NC, 16]`` from what :func:`_load_codes` returned.

    Signed 8-bit codes come back as their two's complement bytes.
    """
    if BITS == 8:
        u = a.to(tl.int32) & 0xFF
    elif BITS == 4:
        # byte j: channel 2j in the low nibble, 2j + 1 in the high nibble
        byte = a.to(tl.int32) & 0xFF
        u = tl.reshape(tl.join(byte & 0xF, byte >> 4), (1, R, NL, NC, 16))
    elif BITS == 2:
        byte = a.to(tl.int32) & 0xFF
        # join(join(a, c), join(b, d))[..., i, j] is (a, b, c, d)[2i + j]: codes in order
        even = tl.join(byte & 3, (byte >> 4) & 3)
        odd = tl.join((byte >> 2) & 3, byte >> 6)
        u = tl.reshape(tl.join(even, odd), (1, R, NL, NC, 16))
    else:
        # 3 bits: halfwords h0 h1 h2 hold 48 bits; codes 0-7 are bits 0-23, codes 8-15 bits 24-47
        h0 = a.to(tl.int32) & 0xFFFF
        h1 = b.to(tl.int32) & 0xFFFF
        h2 = c.to(tl.int32) & 0xFFFF
        lo = h0 | ((h1 & 0xFF) << 16)
        hi = (h1 >> 8) | (h2 << 8)
        k = tl.arange(0, 8)[None, None, None, None, None, :]
        halves = tl.reshape(tl.join(lo, hi), (1, R, NL, NC, 2, 1))
        u = tl.reshape((halves >> (3 * k)) & 7, (1, R, NL, NC, 16))
    return u


@triton.jit
def _load_tile(
    n, hi, b, hk, BT, stride_btb,
    K, stride_kb, stride_kn, stride_kh, KS, KZ, stride_ksb, stride_ksn, stride_ksh, k_col,
    V, stride_vb, stride_vn, stride_vh, VS, VZ, stride_vsb, stride_vsn, stride_vsh, v_col,
    R: tl.constexpr, NL: tl.constexpr, NC: tl.constexpr, PAGE: tl.constexpr,
    K_BITS: tl.constexpr, K_ZERO: tl.constexpr, V_BITS: tl.constexpr, V_ZERO: tl.constexpr,
):  # fmt: skip
    """Everything one tile of keys ``n`` ``[1, R, NL, 1, 1]`` reads from memory: codes and sidecars."""
    n_ok = n < hi
    blk = tl.load(BT + b * stride_btb + n // PAGE, mask=n_ok, other=0).to(tl.int64)
    pos = (n % PAGE).to(tl.int64)
    ka, kb, kc = _load_codes(K, blk * stride_kb + pos * stride_kn + hk * stride_kh, n_ok, NC, K_BITS)
    va, vb, vc = _load_codes(V, blk * stride_vb + pos * stride_vn + hk * stride_vh, n_ok, NC, V_BITS)
    ok4 = tl.reshape(n_ok, (1, R, NL, 1))
    ks_rows = tl.reshape(blk * stride_ksb + pos * stride_ksn + hk * stride_ksh, (1, R, NL, 1)) + k_col
    vs_rows = tl.reshape(blk * stride_vsb + pos * stride_vsn + hk * stride_vsh, (1, R, NL, 1)) + v_col
    ksc = tl.load(KS + ks_rows, mask=ok4, other=0.0)  # (1, R, NL, NC): the scale of each chunk
    vsc = tl.load(VS + vs_rows, mask=ok4, other=0.0)
    kz = tl.load(KZ + ks_rows, mask=ok4, other=0.0) if K_ZERO else 0.0
    vz = tl.load(VZ + vs_rows, mask=ok4, other=0.0) if V_ZERO else 0.0
    return ka, kb, kc, va, vb, vc, ksc, kz, vsc, vz


@triton.jit
def _values(u, C, MODE: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr, OFFSET: tl.constexpr):
    """fp32 values of unsigned int32 codes ``u`` before the scale: ``code + OFFSET`` or ``centroid[u]``.

    A plain conversion: its pipe (16 per clock per multiprocessor) is not this kernel's
    limit, the issue slots are, and the bit trick of ``codes_to_float`` takes more.
    """
    if MODE == 2:
        return tl.load(C + u)  # a table of 2**BITS floats: stays in L1
    elif SIGNED:
        return ((u ^ (1 << (BITS - 1))) - (1 << (BITS - 1)) + OFFSET).to(tl.float32)
    else:
        return (u + OFFSET).to(tl.float32)


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
    G: tl.constexpr, GP: tl.constexpr, NC: tl.constexpr,
    R: tl.constexpr, NL: tl.constexpr,
    PAGE: tl.constexpr, CAUSAL: tl.constexpr, SPLIT: tl.constexpr,
    K_MODE: tl.constexpr, K_BITS: tl.constexpr, K_SIGNED: tl.constexpr, K_OFFSET: tl.constexpr,
    K_GROUPED: tl.constexpr, K_ZERO: tl.constexpr,
    V_MODE: tl.constexpr, V_BITS: tl.constexpr, V_SIGNED: tl.constexpr, V_OFFSET: tl.constexpr,
    V_GROUPED: tl.constexpr, V_ZERO: tl.constexpr,
):  # fmt: skip
    # Tiles are 5-d: (query head, key row of a lane, key lane, chunk of 16 channels, channel).
    # A tile holds R * NL keys, key r * NL + l in row r of lane l; each lane accumulates its
    # own rows' values (no cross-lane sum per tile) and the lanes are summed once at the end.
    # A scale group of 32 channels is two chunks.
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bh // H_KV
    hk = pid_bh % H_KV
    g5 = tl.arange(0, GP)[:, None, None, None, None]
    r5 = tl.arange(0, R)[None, :, None, None, None]
    l5 = tl.arange(0, NL)[None, None, :, None, None]
    ch5 = tl.arange(0, NC)[None, None, None, :, None]
    c5 = tl.arange(0, 16)[None, None, None, None, :]
    q_ptr = Q + b * stride_qb + (hk * G + g5) * stride_qh + ch5 * 16 + c5
    q = tl.load(q_ptr, mask=g5 < G, other=0.0).to(tl.float32) * qk_scale  # (GP, 1, 1, NC, 16), log2 units
    if K_ZERO:
        q_sum = tl.sum(q, axis=4)  # (GP, 1, 1, NC): what a zero of 1 adds to a score

    hi = tl.minimum(tl.load(KVLEN + b).to(tl.int32), capacity)  # never read past the table
    if CAUSAL:
        hi = tl.minimum(hi, tl.load(QSTART + b).to(tl.int32) + 1)
    lo = pid_s * split_len
    hi = tl.minimum(hi, lo + split_len)

    # Online softmax with a lazy maximum: the running max m_i moves (and acc is rescaled)
    # only when a tile's max exceeds it by RESCALE_LOG2, so the exponentials stay below
    # 2**RESCALE_LOG2 and most tiles skip the rescale of acc.
    m_i = tl.full((GP, 1, 1), -1.0e30, tl.float32)  # finite: exp2(-inf - m_i) stays 0, never nan
    l_i = tl.zeros((GP, 1, 1), tl.float32)
    acc = tl.zeros((GP, 1, NL, NC, 16), tl.float32)
    zacc = tl.zeros((GP, 1, NL, NC), tl.float32)
    ch4 = tl.arange(0, NC)[None, None, None, :]
    k_col = ch4 // 2 if K_GROUPED else ch4 * 0  # the sidecar column of each chunk
    v_col = ch4 // 2 if V_GROUPED else ch4 * 0
    key = r5 * NL + l5  # (1, R, NL, 1, 1)

    # Bytes in flight: the loop loads tile i + 1 before it computes tile i.
    ka, kb, kc, va, vb, vc, ksc, kz, vsc, vz = _load_tile(
        lo + key, hi, b, hk, BT, stride_btb,
        K, stride_kb, stride_kn, stride_kh, KS, KZ, stride_ksb, stride_ksn, stride_ksh, k_col,
        V, stride_vb, stride_vn, stride_vh, VS, VZ, stride_vsb, stride_vsn, stride_vsh, v_col,
        R, NL, NC, PAGE, K_BITS, K_ZERO, V_BITS, V_ZERO,
    )  # fmt: skip
    for n0 in range(lo, hi, R * NL):
        n_ok3 = tl.reshape(n0 + key < hi, (1, R, NL))
        nka, nkb, nkc, nva, nvb, nvc, nksc, nkz, nvsc, nvz = _load_tile(
            n0 + R * NL + key, hi, b, hk, BT, stride_btb,
            K, stride_kb, stride_kn, stride_kh, KS, KZ, stride_ksb, stride_ksn, stride_ksh, k_col,
            V, stride_vb, stride_vn, stride_vh, VS, VZ, stride_vsb, stride_vsn, stride_vsh, v_col,
            R, NL, NC, PAGE, K_BITS, K_ZERO, V_BITS, V_ZERO,
        )  # fmt: skip

        # scores: one partial dot per chunk, then its group's scale (and zero)
        kx = _values(_unpack(ka, kb, kc, R, NL, NC, K_BITS), KC, K_MODE, K_BITS, K_SIGNED, K_OFFSET)
        part = tl.sum(q * kx, axis=4)  # (GP, R, NL, NC)
        if K_ZERO:
            s = tl.sum(part * ksc.to(tl.float32) + q_sum * kz.to(tl.float32), axis=3)  # (GP, R, NL)
        else:
            s = tl.sum(part * ksc.to(tl.float32), axis=3)
        s = tl.where(n_ok3, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(tl.max(s, axis=2, keep_dims=True), axis=1, keep_dims=True))
        if tl.max(tl.reshape(m_new - m_i, (GP,)), axis=0) > RESCALE_LOG2:
            alpha = tl.exp2(m_i - m_new)  # (GP, 1, 1)
            a4 = alpha[:, :, :, None]
            acc = acc * a4[:, :, :, :, None]
            zacc = zacc * a4
            l_i = l_i * alpha
            m_i = m_new
        p = tl.exp2(s - m_i)  # (GP, R, NL), below 2**RESCALE_LOG2
        l_i += tl.sum(tl.sum(p, axis=2, keep_dims=True), axis=1, keep_dims=True)

        # values: weights p * scale per chunk, times the codes (or centroids)
        vx = _values(_unpack(va, vb, vc, R, NL, NC, V_BITS), VC, V_MODE, V_BITS, V_SIGNED, V_OFFSET)
        w = p[:, :, :, None] * vsc.to(tl.float32)  # (GP, R, NL, NC)
        acc += tl.sum(w[:, :, :, :, None] * vx, axis=1, keep_dims=True)
        if V_ZERO:
            zacc += tl.sum(p[:, :, :, None] * vz.to(tl.float32), axis=1, keep_dims=True)
        ka, kb, kc, va, vb, vc, ksc, kz, vsc, vz = nka, nkb, nkc, nva, nvb, nvc, nksc, nkz, nvsc, nvz

    if V_ZERO:
        acc += zacc[:, :, :, :, None]
    acc = tl.sum(acc, axis=2)  # (GP, 1, NC, 16): the lanes' sums
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # (GP, 1, 1)
    out = acc / l_safe[:, :, :, None]
    g4 = tl.arange(0, GP)[:, None, None, None]
    ch4 = tl.arange(0, NC)[None, None, :, None]
    c4 = tl.arange(0, 16)[None, None, None, :]
    if not SPLIT:
        o_ptr = O + b * stride_ob + (hk * G + g4) * stride_oh + ch4 * 16 + c4
        tl.store(o_ptr, out.to(O.dtype.element_ty), mask=g4 < G)
    else:
        # partials (B, Hq, 1, num_splits, D) and base-2 lse (B, Hq, 1, num_splits), contiguous
        g3 = tl.arange(0, GP)[:, None, None]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        r3 = b * (H_KV * G) + hk * G + g3
        tl.store(PL + r3 * num_splits + pid_s, lse, mask=g3 < G)
        r4 = b * (H_KV * G) + hk * G + g4
        tl.store(PO + (r4 * num_splits + pid_s) * (NC * 16) + ch4 * 16 + c4, out, mask=g4 < G)


def decode_supported(k_fmt: PageFormat, v_fmt: PageFormat, head_dim: int) -> bool:
    """True when :func:`launch_decode` reads pages of ``k_fmt`` and ``v_fmt``.

    Both must be quantised (``AFFINE`` or ``CENTROID``) with codes of
    :data:`DECODE_BITS` bits and one scale per token or per 32 channels, and
    ``head_dim`` a multiple of 16 (a thread reads 16 channels).
    """
    if head_dim % 16:
        return False
    for fmt in (k_fmt, v_fmt):
        if fmt.mode not in (AFFINE, CENTROID) or fmt.bits not in DECODE_BITS or fmt.scale is None:
            return False
        if fmt.group not in (head_dim, 32):
            return False
    return True


def plan_decode(
    B: int, H_kv: int, capacity: int, head_dim: int, device: torch.device, cfg
) -> tuple[int, int, int, int, int]:
    """``(rows, lanes, num_splits, split_len, num_warps)`` of one decode launch: a tile is
    ``rows * lanes`` keys (``cfg.block_n`` rounded to whole rows).

    ``cfg`` is a ``LaunchConfig``; its ``None`` fields are chosen here. Splits:
    enough programs for :data:`PROGRAMS_PER_SM` per multiprocessor, each split at
    least :data:`DECODE_MIN_SPLIT` keys on CUDA (``cfg.min_split_tokens`` elsewhere)
    and a whole number of tiles. Like the MMA kernel's plan, it depends on the
    capacity, never on the lengths (no device-to-host sync, one shape across steps).
    """
    on_gpu = device.type == "cuda"
    num_warps = cfg.num_warps or (NUM_WARPS if on_gpu else 1)
    lanes = key_lanes(head_dim, num_warps)
    rows = max(1, (cfg.block_n or (ROWS_PER_LANE * lanes if on_gpu else 16)) // lanes)
    block_n = rows * lanes
    if cfg.num_splits is not None:
        splits = max(1, cfg.num_splits)
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else 1
        want = triton.cdiv(PROGRAMS_PER_SM * sms, B * H_kv)
        min_split = DECODE_MIN_SPLIT if on_gpu else cfg.min_split_tokens
        splits = max(1, min(want, triton.cdiv(capacity, max(min_split, block_n))))
    split_len = triton.cdiv(triton.cdiv(capacity, splits), block_n) * block_n
    splits = max(1, triton.cdiv(capacity, split_len))
    return rows, lanes, splits, split_len, num_warps


def key_lanes(head_dim: int, num_warps: int) -> int:
    """Keys side by side in a tile: the program's threads over the ``head_dim / 16``
    threads that share one row (16 channels each), so each thread sums its own keys'
    values in registers."""
    return max(1, 32 * num_warps // min(32 * num_warps, head_dim // 16))


def _format_constexprs(prefix: str, fmt: PageFormat, head_dim: int) -> dict[str, object]:
    return {
        f"{prefix}_MODE": fmt.mode,
        f"{prefix}_BITS": fmt.bits,
        f"{prefix}_SIGNED": fmt.signed,
        f"{prefix}_OFFSET": fmt.offset,
        f"{prefix}_GROUPED": fmt.group != head_dim,
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
    rows: int,
    lanes: int,
    splits: int,
    split_len: int,
    num_warps: int,
    num_stages: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One decode step over quantised pages into ``out`` ``[B, Hq, 1, D]``; returns the
    split partials ``(po, pl)`` to merge, or ``None`` when ``splits == 1`` (``out`` is final).

    ``q`` ``[B, Hq, 1, D]`` (already rotated when the keys are); pages
    ``[num_blocks, page, H_kv, D']`` that :func:`decode_supported` accepts.
    """
    B, Hq, _, D = q.shape
    H_kv, page = k_payload.shape[2], k_payload.shape[1]
    G = Hq // H_kv
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
        G=G, GP=triton.next_power_of_2(G), NC=D // 16,
        R=rows, NL=lanes, PAGE=page, CAUSAL=q_start is not None, SPLIT=splits > 1,
        **_format_constexprs("K", k_fmt, D), **_format_constexprs("V", v_fmt, D),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return (po, pl) if splits > 1 else None
