"""The Triton write kernel: new tokens into their page slots, quantised on the way.

One launch writes K and V of every row: program ``(i, 0)`` handles ``ROWS``
(token, head) vectors of K, program ``(i, 1)`` the same vectors of V. Each vector
is read from ``[B, H_kv, T, D]``, less the codec's centre when it has one
(``kvtier.quant.fp8``; rounded back to the input's dtype, as ``Codec.centred``), rotated when the codec works in a rotated
domain, coded by the codec's rule (see ``kvtier.quant.kv_quant``,
``kvtier.quant.fp8`` and ``kvtier.quant.turboquant``), bit-packed, and stored with its sidecars at slot
``slot_mapping[b * T + t]`` (block ``slot // block_size``, position
``slot % block_size``). A negative slot is padding and writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtier.kernels.triton_quant import (
    AFFINE,
    PageFormat,
    round_half_even,
    round_to_dtype,
    store_codes,
)


@triton.jit
def _write_rows(
    X, stride_xb, stride_xh, stride_xt,
    SLOTS,
    P, stride_pb, stride_pn, stride_ph,
    S, Z, stride_sb, stride_sn, stride_sh,
    R, CEN, BND, n_bnd, CTR,
    row0, n_rows, T, H,
    PAGE: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MODE: tl.constexpr,
    BITS: tl.constexpr,
    OFFSET: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    ROTATE: tl.constexpr,
    QMAX: tl.constexpr,
    CENTRE: tl.constexpr,
):  # fmt: skip
    r = row0 + tl.arange(0, ROWS)
    bt = r // H  # b * T + t
    h = r % H
    b = bt // T
    t = bt % T
    in_range = r < n_rows
    slot = tl.load(SLOTS + bt, mask=in_range, other=-1)
    ok = in_range & (slot >= 0)
    blk = tl.where(ok, slot // PAGE, 0)
    pos = tl.where(ok, slot % PAGE, 0)
    d = tl.arange(0, HEAD_DIM)
    x_off = b.to(tl.int64) * stride_xb + h * stride_xh + t * stride_xt
    x = tl.load(X + x_off[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    if CENTRE:  # x - c in fp32, rounded to the input's dtype: what Codec.centred() hands encode()
        c = tl.load(CTR + h[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)
        x = round_to_dtype(x - c, X.dtype.element_ty)
    if ROTATE:
        rot = tl.load(R + d[:, None] * HEAD_DIM + d[None, :])  # stored = x @ rot
        x = tl.dot(x, rot, input_precision="ieee")
    p_rows = blk * stride_pb + pos * stride_pn + h * stride_ph
    s_rows = blk * stride_sb + pos * stride_sn + h * stride_sh

    if MODE == 0:
        tl.store(P + p_rows[:, None] + d[None, :], x.to(P.dtype.element_ty), mask=ok[:, None])
    elif MODE == 3:
        # e4m3: scale = absmax / 448, code = e4m3(clamp(x / scale)) rounded to nearest even, as bytes
        scale = tl.div_rn(tl.max(tl.abs(x), axis=1), 448.0)
        safe = tl.where(scale > 0.0, scale, 1.0)
        y = tl.minimum(tl.maximum(tl.div_rn(x, safe[:, None]), -448.0), 448.0)
        # round to e4m3's 3 mantissa bits in fp32 (exact: the quantum is a power of two), then
        # assemble the byte from the rounded value's bits: no float8 conversion, so every
        # device and the interpreter store the same byte (round to nearest even, as torch)
        e = tl.maximum(((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # subnormals: 2^-9
        quantum = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
        inverse = ((127 - e + 3) << 23).to(tl.float32, bitcast=True)
        r = round_half_even(y * inverse) * quantum
        rb = r.to(tl.int32, bitcast=True)
        eb = ((rb >> 23) & 0xFF) - 120  # e4m3's biased exponent (bias 7)
        mag = tl.where(eb >= 1, (eb << 3) | ((rb >> 20) & 7), (tl.abs(r) * 512.0).to(tl.int32))
        sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80  # of y: what rounds to zero keeps it
        code = (mag | sign).to(tl.uint8)
        tl.store(P + p_rows[:, None] + d[None, :], code, mask=ok[:, None])
        tl.store(S + s_rows, scale, mask=ok)
    else:
        NG: tl.constexpr = HEAD_DIM // GROUP
        x3 = tl.reshape(x, (ROWS, NG, GROUP))
        g = tl.arange(0, NG)
        s_ptr = s_rows[:, None] + g[None, :]
        if MODE == 1 and HAS_ZERO:
            # asymmetric: zero = fp16(min), scale = fp16((max - min) / QMAX), codes in [0, QMAX]
            lo = tl.min(x3, axis=2)
            hi = tl.max(x3, axis=2)
            zero = lo.to(Z.dtype.element_ty)
            scale = tl.div_rn(hi - lo, QMAX * 1.0).to(S.dtype.element_ty)
            zf = zero.to(tl.float32)
            sf = scale.to(tl.float32)
            safe = tl.where(sf > 0.0, sf, 1.0)
            q = round_half_even(tl.div_rn(x3 - zf[:, :, None], safe[:, :, None]))
            q = tl.minimum(tl.maximum(q, 0.0), QMAX * 1.0)
            tl.store(Z + s_ptr, zero, mask=ok[:, None])
        elif MODE == 1:
            # symmetric: scale = absmax / QMAX, codes in [-QMAX, QMAX], stored as code - OFFSET
            scale = tl.div_rn(tl.max(tl.abs(x3), axis=2), QMAX * 1.0).to(S.dtype.element_ty)
            sf = scale.to(tl.float32)
            safe = tl.where(sf > 0.0, sf, 1.0)
            q = round_half_even(tl.div_rn(x3, safe[:, :, None]))
            q = tl.minimum(tl.maximum(q, -QMAX * 1.0), QMAX * 1.0) - OFFSET
        else:
            # Lloyd-Max codes: s0 = rms of the group, idx = #{t_k < y / s0},
            # scale = fp16(least-squares fit sum(y c) / sum(c^2)) for the chosen centroids
            s0 = tl.sqrt_rn(tl.div_rn(tl.sum(x3 * x3, axis=2), GROUP * 1.0))
            s0 = tl.where(s0 > 0.0, s0, 1.0)
            y = tl.div_rn(x3, s0[:, :, None])
            idx = tl.zeros((ROWS, NG, GROUP), tl.int32)
            for k in range(n_bnd):
                idx += (y > tl.load(BND + k)).to(tl.int32)
            c = tl.load(CEN + idx)
            scale = tl.div_rn(tl.sum(x3 * c, axis=2), tl.sum(c * c, axis=2)).to(S.dtype.element_ty)
            q = idx.to(tl.float32)
        tl.store(S + s_ptr, scale, mask=ok[:, None])
        u = tl.reshape(q, (ROWS, HEAD_DIM)).to(tl.int32)
        store_codes(P, p_rows, ok, u, ROWS, HEAD_DIM, BITS)


# the token counts of a step vary from step to step: specialising on them (a count of 1, or a
# multiple of 16) would compile another variant mid-serving, hundreds of milliseconds of a stall
@triton.jit(do_not_specialize=["n_rows", "T"])
def _write_kernel(
    KX, stride_kxb, stride_kxh, stride_kxt,
    VX, stride_vxb, stride_vxh, stride_vxt,
    SLOTS,
    KP, stride_kpb, stride_kpn, stride_kph,
    VP, stride_vpb, stride_vpn, stride_vph,
    KS, KZ, stride_ksb, stride_ksn, stride_ksh,
    VS, VZ, stride_vsb, stride_vsn, stride_vsh,
    KR, VR, KC, VC, KB, VB, k_nbnd, v_nbnd, KCTR, VCTR,
    n_rows, T, H,
    PAGE: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    K_MODE: tl.constexpr, K_BITS: tl.constexpr, K_OFFSET: tl.constexpr, K_GROUP: tl.constexpr,
    K_ZERO: tl.constexpr, K_ROTATE: tl.constexpr, K_QMAX: tl.constexpr, K_CENTRE: tl.constexpr,
    V_MODE: tl.constexpr, V_BITS: tl.constexpr, V_OFFSET: tl.constexpr, V_GROUP: tl.constexpr,
    V_ZERO: tl.constexpr, V_ROTATE: tl.constexpr, V_QMAX: tl.constexpr, V_CENTRE: tl.constexpr,
):  # fmt: skip
    row0 = tl.program_id(0) * ROWS
    if tl.program_id(1) == 0:
        _write_rows(KX, stride_kxb, stride_kxh, stride_kxt, SLOTS,
                    KP, stride_kpb, stride_kpn, stride_kph, KS, KZ, stride_ksb, stride_ksn, stride_ksh,
                    KR, KC, KB, k_nbnd, KCTR, row0, n_rows, T, H, PAGE, ROWS, HEAD_DIM,
                    K_MODE, K_BITS, K_OFFSET, K_GROUP, K_ZERO, K_ROTATE, K_QMAX, K_CENTRE)  # fmt: skip
    else:
        _write_rows(VX, stride_vxb, stride_vxh, stride_vxt, SLOTS,
                    VP, stride_vpb, stride_vpn, stride_vph, VS, VZ, stride_vsb, stride_vsn, stride_vsh,
                    VR, VC, VB, v_nbnd, VCTR, row0, n_rows, T, H, PAGE, ROWS, HEAD_DIM,
                    V_MODE, V_BITS, V_OFFSET, V_GROUP, V_ZERO, V_ROTATE, V_QMAX, V_CENTRE)  # fmt: skip


def _write_constexprs(prefix: str, fmt: PageFormat, head_dim: int) -> dict[str, object]:
    if fmt.mode == AFFINE and fmt.zero is not None:
        qmax = (1 << fmt.bits) - 1
    elif fmt.mode == AFFINE:
        qmax = (1 << (fmt.bits - 1)) - 1  # q8: 127, q4: 7
    else:
        qmax = 0
    return {
        f"{prefix}_MODE": fmt.mode,
        f"{prefix}_BITS": fmt.bits,
        f"{prefix}_OFFSET": fmt.offset,
        f"{prefix}_GROUP": fmt.group or head_dim,
        f"{prefix}_ZERO": fmt.zero is not None,
        f"{prefix}_ROTATE": fmt.rotation is not None,
        f"{prefix}_QMAX": qmax,
        f"{prefix}_CENTRE": fmt.centre is not None,
    }


def launch_write(
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    k_fmt: PageFormat,
    v_fmt: PageFormat,
    slot_mapping: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    rows_per_program: int = 16,
) -> None:
    """Launch the write kernel on validated inputs (``keys``/``values`` of one shape, each with
    a contiguous last dim)."""
    B, H, T, D = keys.shape
    n_rows = B * H * T
    if n_rows == 0:
        return
    page = key_pages.shape[1]

    def side(fmt: PageFormat, payload: torch.Tensor):
        s = fmt.scale if fmt.scale is not None else payload
        z = fmt.zero if fmt.zero is not None else s
        strides = (s.stride(0), s.stride(1), s.stride(2)) if fmt.scale is not None else (0, 0, 0)
        return (s, z, *strides)

    def aux(fmt: PageFormat, payload: torch.Tensor):
        r = fmt.rotation if fmt.rotation is not None else payload
        c = fmt.centroids if fmt.centroids is not None else payload
        bnd = fmt.boundaries if fmt.boundaries is not None else payload
        n_bnd = fmt.boundaries.numel() if fmt.boundaries is not None else 0
        ctr = fmt.centre if fmt.centre is not None else payload
        return r, c, bnd, n_bnd, ctr

    kr, kc, kb, k_nbnd, kctr = aux(k_fmt, key_pages)
    vr, vc, vb, v_nbnd, vctr = aux(v_fmt, value_pages)
    grid = (triton.cdiv(n_rows, rows_per_program), 2)
    _write_kernel[grid](
        keys, keys.stride(0), keys.stride(1), keys.stride(2),
        values, values.stride(0), values.stride(1), values.stride(2),
        slot_mapping,
        key_pages, key_pages.stride(0), key_pages.stride(1), key_pages.stride(2),
        value_pages, value_pages.stride(0), value_pages.stride(1), value_pages.stride(2),
        *side(k_fmt, key_pages), *side(v_fmt, value_pages),
        kr, vr, kc, vc, kb, vb, k_nbnd, v_nbnd, kctr, vctr,
        n_rows, T, H,
        PAGE=page, ROWS=rows_per_program, HEAD_DIM=D,
        **_write_constexprs("K", k_fmt, D), **_write_constexprs("V", v_fmt, D),
        num_warps=4,
    )  # fmt: skip


__all__ = ["launch_write"]
