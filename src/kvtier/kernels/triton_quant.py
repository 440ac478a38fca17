"""Triton helpers that read and write the paged tier's page formats.

One :class:`PageFormat` describes how a kernel sees one of K or V: the payload
element (a float, e4m3 bytes, or ``bits``-wide integer codes packed into bytes),
how a code becomes a value (``x = scale * (code + offset) + zero``,
``x = scale * e4m3(code)`` or ``x = scale * centroids[code]``), and how many
channels share one scale and zero. :func:`page_format` builds it from a codec;
the jit helpers below read a tile of codes, dequantise it, and quantise and pack
rows on the write path.

Fast conversions (compiled kernels only). Codes become fp16 operands of the
tensor cores without an int-to-float instruction: ``0x6400 | u`` is the fp16
``1024 + u`` for ``0 <= u < 1024``, so a byte permute that slides two codes
under the ``0x64`` exponent bytes and one packed subtraction turn two codes into
two fp16 values; a nibble is masked in place under the same exponent. e4m3
bytes convert two at a time (``cvt.rn.f16x2.e4m3x2``, compute capability 8.9+).
Value tiles run these as non-pure inline assembly in the layout the tile was
loaded in, which keeps the compiler from moving the conversion behind the
shared-memory transposition of the dot operand, where every byte would be a
load of its own; key tiles (no transposition) let it move. Under the interpreter the same helpers use plain conversions.

Bit packing (every integer codec): code ``i`` of a (token, head) row sits at bits
``[bits*i, bits*i + bits)`` of the row's little-endian bit stream. Eight codes
fill exactly ``bits`` bytes, so the helpers work in chunks of eight codes: one
chunk is one machine word of ``8 * bits`` bits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvtier.kernels.launch_plan import capability
from kvtier.quant.codec import Codec, CodecUnsupported, IdentityCodec
from kvtier.quant.fp8 import Fp8Codec
from kvtier.quant.hadamard import HadamardRotation
from kvtier.quant.kv_quant import GROUP, GroupQ4Codec, Q4Codec, Q8Codec
from kvtier.quant.lloyd_max import lloyd_max_quantizer
from kvtier.quant.turboquant import TurboKeyCodec, TurboValueCodec

#: how a code becomes a value
FP, AFFINE, CENTROID, FLOAT8 = 0, 1, 2, 3
#: the oldest compute capability with native e4m3 conversions (Ada, Hopper)
FP8_MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class PageFormat:
    """What a kernel needs to know about one of K or V.

    ``mode``: :data:`FP` (payload holds the values), :data:`AFFINE`
    (``scale * (code + offset) [+ zero]``), :data:`CENTROID`
    (``scale * centroids[code]``) or :data:`FLOAT8` (``scale * e4m3(code)``).
    ``group`` channels share one scale (and zero); ``group == head_dim`` means
    one per (token, head). ``centroids`` (fp32
    ``[2**bits]``) and ``boundaries`` (fp32 ``[2**bits - 1]``) are the Lloyd-Max
    tables of :data:`CENTROID` codes. ``rotation`` (fp32 ``[D, D]``, or ``None``)
    is the orthogonal matrix the codec applies before coding, as
    ``stored = x @ rotation``. ``centre`` (fp32 ``[H_kv, D]``, or ``None``) is
    what a centred key codec subtracts before coding (``kvtier.quant.fp8``);
    reads need no correction, only the write kernel uses it.
    """

    mode: int
    head_dim: int
    packed_dim: int
    bits: int = 16
    signed: bool = False
    offset: int = 0
    group: int = 0
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    centroids: torch.Tensor | None = None
    boundaries: torch.Tensor | None = None
    rotation: torch.Tensor | None = None
    centre: torch.Tensor | None = None

    @property
    def num_groups(self) -> int:
        return self.head_dim // self.group if self.group else 0


def page_format(
    codec: Codec,
    payload: torch.Tensor,
    sidecars: dict[str, torch.Tensor] | None,
) -> PageFormat:
    """Describe ``codec``'s pages for the kernels; raise :class:`CodecUnsupported` if none can read them.

    ``payload``: the pages ``[num_blocks, block_size, H_kv, D']``; ``sidecars``:
    ``{name: [num_blocks, block_size, H_kv, G]}``.
    """
    sidecars = sidecars or {}
    D = codec.head_dim
    if type(codec) is IdentityCodec:
        if payload.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise CodecUnsupported(f"fp pages of dtype {payload.dtype} have no Triton kernel")
        return PageFormat(FP, D, D, bits=8 * payload.element_size())
    if type(codec) is Q8Codec:
        return PageFormat(AFFINE, D, D, bits=8, signed=True, group=D, scale=sidecars.get("scale"))
    if type(codec) is Fp8Codec:
        if payload.device.type == "cuda" and capability(payload.device) < FP8_MIN_CAPABILITY:
            cap = ".".join(map(str, capability(payload.device)))
            raise CodecUnsupported(
                f"fp8 pages need native e4m3 conversions (compute capability 8.9+), this GPU has {cap}"
            )
        return PageFormat(FLOAT8, D, D, bits=8, group=D, scale=sidecars.get("scale"), centre=codec.centre)
    if type(codec) is Q4Codec:
        return PageFormat(AFFINE, D, D // 2, bits=4, offset=-8, group=D, scale=sidecars.get("scale"))
    if type(codec) is GroupQ4Codec:
        return PageFormat(
            AFFINE, D, D // 2, bits=4, group=GROUP, scale=sidecars.get("scale"), zero=sidecars.get("zero")
        )
    if type(codec) is TurboKeyCodec:
        return PageFormat(
            AFFINE, D, codec.packed_dim(), bits=codec.bits, group=GROUP,
            scale=sidecars.get("scale"), zero=sidecars.get("zero"),
            rotation=_rotation(codec.rotation, payload.device),
        )  # fmt: skip
    if type(codec) is TurboValueCodec:
        centroids, boundaries = _lloyd_max_tables(codec.bits, payload.device)
        return PageFormat(
            CENTROID, D, codec.packed_dim(), bits=codec.bits, group=GROUP,
            scale=sidecars.get("scale"), centroids=centroids, boundaries=boundaries,
            rotation=_rotation(codec.rotation, payload.device),
        )  # fmt: skip
    raise CodecUnsupported(f"codec {type(codec).__name__} ({codec.name!r}) has no Triton kernel")


@functools.lru_cache(maxsize=64)
def _rotation_on(dim: int, seed: int, device: torch.device) -> torch.Tensor:
    # Pi [D, D] with y = Pi x, so the row form is y = x @ Pi.T
    return HadamardRotation(dim, seed).matrix(torch.float32, device).T.contiguous()


def _rotation(rotation: HadamardRotation | None, device: torch.device) -> torch.Tensor | None:
    """The codec's rotation as a right-multiplied fp32 matrix ``[D, D]`` on ``device`` (memoised)."""
    if rotation is None:
        return None
    return _rotation_on(rotation.dim, rotation.seed, device)


@functools.lru_cache(maxsize=64)
def _lloyd_max_tables(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    q = lloyd_max_quantizer(bits)
    return q.centroids_tensor(device, torch.float32), q.boundaries_tensor(device, torch.float32)


def direct_format(fmt: PageFormat, head_dim: int) -> bool:
    """Whether the kernel reads ``fmt`` straight into fp16 operands (``kv_tile``'s direct
    branches): e4m3, signed bytes with a scale per row (q8), and nibbles with a scale per row
    (q4) or a scale and zero per 32 channels (q4_g32, 4-bit keys). Other formats are
    dequantised in fp32 (:func:`dequant_tile`)."""
    per_row = fmt.group == head_dim and fmt.zero is None
    if fmt.mode == FLOAT8:
        return True
    return fmt.mode == AFFINE and (
        (fmt.bits == 8 and fmt.signed and per_row) or (fmt.bits == 4 and (per_row or fmt.group == 32))
    )


def int8_key_format(fmt: PageFormat, head_dim: int) -> bool:
    """Whether keys of ``fmt`` are scored as integer dots with int8 queries: q8 (signed bytes,
    one scale per token and head). 4-bit keys were slower this way on the H200 (their nibbles become
    int8 in the operand layout), so they keep the fp16 operands."""
    return fmt.mode == AFFINE and fmt.bits == 8 and fmt.signed and fmt.group == head_dim and fmt.zero is None


def format_constexprs(prefix: str, fmt: PageFormat, head_dim: int, direct: bool = False) -> dict[str, object]:
    """The kernel's compile-time arguments for one of K (``prefix="K"``) or V; ``direct``: the
    pair of formats is read straight into fp16 (both :func:`direct_format`)."""
    factor = fmt.mode in (AFFINE, FLOAT8) and fmt.group == head_dim and fmt.zero is None
    return {
        f"{prefix}_MODE": fmt.mode,
        f"{prefix}_BITS": fmt.bits,
        f"{prefix}_SIGNED": fmt.signed,
        f"{prefix}_OFFSET": fmt.offset,
        f"{prefix}_GROUP": fmt.group or head_dim,
        f"{prefix}_ZERO": fmt.zero is not None,
        f"{prefix}_FACTOR": factor,
        # 4-bit codes in two halves (low and high nibbles)
        f"{prefix}_SPLIT": direct and fmt.mode == AFFINE and fmt.bits == 4,
        f"{prefix}_DIRECT": direct,
    }


def check_format_tensors(fmt: PageFormat, payload: torch.Tensor, what: str) -> None:
    """Raise ``ValueError`` when ``payload`` or the sidecars do not match ``fmt``."""
    nb, bs, H, Dp = payload.shape
    if Dp != fmt.packed_dim:
        raise ValueError(
            f"{what} pages have last dim {Dp} but the codec packs head_dim {fmt.head_dim} "
            f"into {fmt.packed_dim}; allocate pages with codec.packed_dim()"
        )
    if payload.stride(-1) != 1:
        raise ValueError(f"{what} pages need a contiguous last dim, got strides {payload.stride()}")
    for name, t in (("scale", fmt.scale), ("zero", fmt.zero)):
        if t is None:
            continue
        want = (nb, bs, H, fmt.num_groups)
        if tuple(t.shape) != want:
            raise ValueError(f"{what} sidecar {name!r} has shape {tuple(t.shape)}, expected {want}")
        if not t.is_contiguous():
            raise ValueError(f"{what} sidecar {name!r} must be contiguous, got strides {t.stride()}")
        if t.device != payload.device:
            raise ValueError(f"{what} sidecar {name!r} is on {t.device}, pages on {payload.device}")
    c = fmt.centre
    if c is not None and (
        tuple(c.shape) != (H, fmt.head_dim) or c.dtype != torch.float32 or not c.is_contiguous()
        or c.device != payload.device
    ):  # fmt: skip
        raise ValueError(
            f"{what} codec's centre must be contiguous float32 [{H}, {fmt.head_dim}] on {payload.device}, "
            f"got {c.dtype} {tuple(c.shape)} on {c.device}"
        )


# ---------------------------------------------------------------------------------------------
# jit helpers: reading
# ---------------------------------------------------------------------------------------------


@triton.jit
def dequant_tile(
    P,
    S,
    Z,
    C,
    rows,
    srows,
    mask_n,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MODE: tl.constexpr,
    BITS: tl.constexpr,
    SIGNED: tl.constexpr,
    OFFSET: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    FACTOR: tl.constexpr,
):
    """A tile ``[BLOCK_N, HEAD_DIM]`` read from pages ``P`` at element offsets ``rows``.

    ``srows`` are the sidecar element offsets of the same rows. The tile is fp32;
    with ``FACTOR`` (one scale per row, no zero) it holds the codes (plus offset)
    and the caller applies the scale to scores or probabilities, once per row
    instead of once per element; 8-bit codes then stay int32, which the caller
    converts straight to the dot's dtype. Narrower codes become floats through
    :func:`codes_to_float`.
    """
    if MODE == 0:
        d = tl.arange(0, HEAD_DIM)
        x = tl.load(P + rows[:, None] + d[None, :], mask=mask_n[:, None], other=0.0).to(tl.float32)
    else:
        if BITS == 8:
            d = tl.arange(0, HEAD_DIM)
            raw = tl.load(P + rows[:, None] + d[None, :], mask=mask_n[:, None], other=0)
            if SIGNED:
                u = raw.to(tl.int32)
            else:
                u = raw.to(tl.int32) & 0xFF
        elif BITS == 4:
            # byte j holds channel 2j in its low nibble and 2j + 1 in its high nibble
            d2 = tl.arange(0, HEAD_DIM // 2)
            byte = tl.load(P + rows[:, None] + d2[None, :], mask=mask_n[:, None], other=0).to(tl.int32) & 0xFF
            u = tl.reshape(tl.join(byte & 0xF, byte >> 4), (BLOCK_N, HEAD_DIM))
        else:
            # eight codes fill BITS bytes: assemble each chunk's bytes into one word, then split it
            NCH: tl.constexpr = HEAD_DIM // 8
            BP: tl.constexpr = 8 if BITS > 4 else 4
            c = tl.arange(0, NCH)
            j = tl.arange(0, BP)
            ptr = P + rows[:, None, None] + (c * BITS)[None, :, None] + j[None, None, :]
            m = mask_n[:, None, None] & (j < BITS)[None, None, :]
            byte = tl.load(ptr, mask=m, other=0).to(tl.int32) & 0xFF  # (N, NCH, BP)
            if BITS > 4:
                word = tl.sum(byte.to(tl.int64) << (8 * j).to(tl.int64)[None, None, :], axis=2)
            else:
                word = tl.sum(byte << (8 * j)[None, None, :], axis=2)  # (N, NCH)
            k = tl.arange(0, 8)
            codes = (word[:, :, None] >> (BITS * k)[None, None, :]) & ((1 << BITS) - 1)
            u = tl.reshape(codes.to(tl.int32), (BLOCK_N, HEAD_DIM))
        if MODE == 1 and BITS == 8 and FACTOR:
            x = u + OFFSET  # integers: the caller converts them straight to the dot's dtype
        elif MODE == 1 and BITS == 8:
            x = (u + OFFSET).to(tl.float32)
        elif MODE == 1:
            x = codes_to_float(u, BITS, SIGNED, OFFSET)
        else:
            x = tl.load(C + u)  # centroid table, fp32, a few hundred bytes: stays in L1
        if not FACTOR:
            NG: tl.constexpr = HEAD_DIM // GROUP
            g = tl.arange(0, NG)
            sptr = srows[:, None] + g[None, :]
            s = tl.load(S + sptr, mask=mask_n[:, None], other=0.0).to(tl.float32)  # (N, NG)
            x3 = tl.reshape(x, (BLOCK_N, NG, GROUP)) * s[:, :, None]
            if HAS_ZERO:
                z = tl.load(Z + sptr, mask=mask_n[:, None], other=0.0).to(tl.float32)
                x3 = x3 + z[:, :, None]
            x = tl.reshape(x3, (BLOCK_N, HEAD_DIM))
    return x


@triton.jit
def codes_to_float(u, BITS: tl.constexpr, SIGNED: tl.constexpr, OFFSET: tl.constexpr):
    """``code + OFFSET`` in fp32 from int32 codes ``u`` (signed codes: any sign extension of
    their ``BITS``-bit two's complement), without an int-to-float conversion instruction.

    Conversions run on a quarter-rate pipe (16 per clock per multiprocessor on an
    H100/H200), about the rate a decode kernel reads 8-bit codes at: ``2**23 + x`` has
    the bits ``0x4B000000 | x`` for ``0 <= x < 2**23``, so an OR and one exact
    subtraction give the same float at full rate.
    """
    if SIGNED:
        x = (u & ((1 << BITS) - 1)) ^ (1 << (BITS - 1))  # code + 2**(BITS-1), in [0, 2**BITS)
        bias: tl.constexpr = 8388608.0 + (1 << (BITS - 1)) - OFFSET
    else:
        x = u
        bias: tl.constexpr = 8388608.0 - OFFSET
    return (x | 0x4B000000).to(tl.float32, bitcast=True) - bias


def _int8_asm(pairs: bool = False, signed: bool = True) -> str:
    """PTX for :func:`_asm_int8_to_f16`: four int8 codes ``b0 b1 b2 b3`` in ``$2``, the fp16
    pairs of ``b0 b1`` and ``b2 b3`` in ``$0 $1``; ``pairs`` (the Gluon decode kernel: two int16
    elements ``b0 b1`` and ``b2 b3``): of ``b0 b2`` and ``b1 b3``. ``code + 128`` slid under the
    exponent byte ``0x64`` is the fp16 ``1152 + code``, and one packed subtraction leaves the code.
    ``signed=False``: unsigned bytes, slid under it as they are (``1024 + code``)."""
    first, second = ("0x7270", "0x7371") if pairs else ("0x7170", "0x7372")
    bias, to_unsigned = ("0x64806480", "xor.b32 t, $2, 0x80808080;") if signed else ("0x64006400", "mov.b32 t, $2;")
    return f"""{{
        .reg .b32 t, m;
        mov.b32 m, {bias};
        {to_unsigned}
        prmt.b32 $0, t, 0x64646464, {first};
        prmt.b32 $1, t, 0x64646464, {second};
        sub.f16x2 $0, $0, m;
        sub.f16x2 $1, $1, m;
        }}"""


#: int8 codes to fp16, four a call, and in pairs of int16 elements; unsigned bytes in pairs
INT8_ASM = tl.constexpr(_int8_asm())
INT8_PAIRS_ASM = tl.constexpr(_int8_asm(pairs=True))
UINT8_PAIRS_ASM = tl.constexpr(_int8_asm(pairs=True, signed=False))


@triton.jit
def _asm_int8_to_f16(x, PURE: tl.constexpr):
    """fp16 of int8 codes ``x``, four a call (:func:`_int8_asm`)."""
    return tl.inline_asm_elementwise(INT8_ASM, "=r,=r,r", [x], dtype=tl.float16, is_pure=PURE, pack=4)


def _nibbles_asm(offset: int, pairs: bool = False) -> str:
    """PTX for :func:`_asm_nibbles_to_f16`: four bytes ``b0 b1 b2 b3`` in ``$4``, the fp16
    pairs of their low nibbles in ``$0 $1`` and of their high ones in ``$2 $3``, each plus
    ``offset`` (-8 or 0). ``pairs`` (the Gluon decode kernel: two int16 elements ``b0 b1`` and
    ``b2 b3``): the pairs of ``b0 b2`` low, ``b0 b2`` high, ``b1 b3`` low, ``b1 b3`` high in
    ``$0 .. $3``."""
    lo, hi = {-8: ("0x64086408", "0xD480D480"), 0: ("0x64006400", "0xD400D400")}[offset]
    sel_y, sel_z, out = ("0x4240", "0x4341", "$0 $2 $1 $3") if pairs else ("0x4140", "0x4342", "$0 $1 $2 $3")
    o = out.split()
    return f"""{{
        .reg .b32 y, z, t, lo, hi, sc;
        mov.b32 lo, {lo};
        mov.b32 hi, {hi};
        mov.b32 sc, 0x2C002C00;
        prmt.b32 y, $4, 0, {sel_y};
        prmt.b32 z, $4, 0, {sel_z};
        lop3.b32 t, y, 0x000F000F, 0x64006400, 0xEA;
        sub.f16x2 {o[0]}, t, lo;
        lop3.b32 t, z, 0x000F000F, 0x64006400, 0xEA;
        sub.f16x2 {o[1]}, t, lo;
        lop3.b32 t, y, 0x00F000F0, 0x64006400, 0xEA;
        fma.rn.f16x2 {o[2]}, t, sc, hi;
        lop3.b32 t, z, 0x00F000F0, 0x64006400, 0xEA;
        fma.rn.f16x2 {o[3]}, t, sc, hi;
        }}"""


#: the nibble conversions' PTX: offset -8 (q4's signed codes) and 0, and both in pairs
NIBBLES_M8_ASM = tl.constexpr(_nibbles_asm(-8))
NIBBLES_ASM = tl.constexpr(_nibbles_asm(0))
NIBBLES_M8_PAIRS_ASM = tl.constexpr(_nibbles_asm(-8, pairs=True))
NIBBLES_PAIRS_ASM = tl.constexpr(_nibbles_asm(0, pairs=True))
#: the pairs' nibbles as they lie, each the fp16 bits of a subnormal: a low nibble ``n`` is
#: ``n 2^-24``, a high one ``n 2^-20`` (exact; the Gluon decode kernel's raw operands, whose
#: dots it scales back in float32), in the order of :data:`NIBBLES_PAIRS_ASM`
NIBBLES_RAW_PAIRS_ASM = tl.constexpr("""{
        .reg .b32 z;
        shr.b32 z, $4, 8;
        and.b32 $0, $4, 0x000F000F;
        and.b32 $1, $4, 0x00F000F0;
        and.b32 $2, z, 0x000F000F;
        and.b32 $3, z, 0x00F000F0;
        }""")


@triton.jit
def _asm_nibbles_to_f16(byte, OFFSET: tl.constexpr, PURE: tl.constexpr):
    """fp16 ``(low nibble + OFFSET, high nibble + OFFSET)`` of uint8 ``byte``, four bytes a call.

    Bytes ``b0 b1`` are spread to ``b0 0 b1 0`` (``b2 b3`` likewise); masked under the
    exponent ``0x64`` a low nibble is the fp16 ``1024 + n``, a high one ``1024 + 16 n``.
    """
    if OFFSET == -8:
        asm: tl.constexpr = NIBBLES_M8_ASM
    else:
        asm: tl.constexpr = NIBBLES_ASM
    return tl.inline_asm_elementwise(
        asm, "=r,=r,=r,=r,r", [byte], dtype=(tl.float16, tl.float16), is_pure=PURE, pack=4
    )


@triton.jit
def _asm_e4m3_to_f16(x, PURE: tl.constexpr):
    """fp16 of e4m3 bytes ``x`` (uint8), four a call, two per ``cvt`` (compute capability 8.9+)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b16 a, b;
        mov.b32 {a, b}, $2;
        cvt.rn.f16x2.e4m3x2 $0, a;
        cvt.rn.f16x2.e4m3x2 $1, b;
        }""",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=PURE, pack=4,
    )  # fmt: skip


@triton.jit
def kv_tile(
    P, S, Z, C, rows, srows, mask_n,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    MODE: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr, OFFSET: tl.constexpr,
    GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, FACTOR: tl.constexpr, SPLIT: tl.constexpr,
    DIRECT: tl.constexpr, FAST: tl.constexpr, DT: tl.constexpr, PURE: tl.constexpr,
):  # fmt: skip
    """A K or V tile as the dot's operand dtype ``DT``, returned as two tensors.

    ``SPLIT`` (4-bit codes): ``(even channels, odd channels)``, each ``[BLOCK_N, HEAD_DIM // 2]``:
    the low and the high nibbles of the bytes, never interleaved (the caller scores
    the even and odd channels of the query against them, and keeps an accumulator
    for each). Otherwise ``(x, x)`` with ``x`` ``[BLOCK_N, HEAD_DIM]``. With
    ``FACTOR`` (one scale per row, no zero) the tile holds ``code + offset`` (e4m3
    values for :data:`FLOAT8`) and the caller applies the scale to scores or
    probabilities. ``DIRECT``: the format is read straight into fp16 (see
    :func:`direct_format`); else it goes through :func:`dequant_tile` in
    fp32. ``FAST``: the inline-assembly conversions (compiled kernels); else plain
    conversions (the interpreter). ``PURE``: the conversion may move into the dot's
    operand layout (keys, whose bytes need no transposition: the raw codes go from shared
    memory straight into the operand registers, one shared-memory round trip instead of
    two); values keep theirs in the load layout (a transposed byte would be a load).
    """
    if MODE == 3:  # e4m3 bytes, one scale per row (FACTOR)
        d = tl.arange(0, HEAD_DIM)
        raw = tl.load(P + rows[:, None] + d[None, :], mask=mask_n[:, None], other=0)
        if FAST:
            x = _asm_e4m3_to_f16(raw, PURE).to(DT)
        else:
            x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(DT)
        return x, x
    elif DIRECT and SPLIT:  # 4-bit codes, low nibble channel 2j, high nibble 2j + 1
        d2 = tl.arange(0, HEAD_DIM // 2)
        byte = tl.load(P + rows[:, None] + d2[None, :], mask=mask_n[:, None], other=0)
        if FAST:
            lo, hi = _asm_nibbles_to_f16(byte, OFFSET, PURE)
        else:
            b = byte.to(tl.int32) & 0xFF
            lo = ((b & 0xF) + OFFSET).to(tl.float16)
            hi = ((b >> 4) + OFFSET).to(tl.float16)
        lo = lo.to(DT)
        hi = hi.to(DT)
        if not FACTOR:  # a scale (and zero) per group of GROUP channels: GROUP // 2 bytes
            NG: tl.constexpr = HEAD_DIM // GROUP
            g = tl.arange(0, NG)
            sptr = srows[:, None] + g[None, :]
            sc = tl.load(S + sptr, mask=mask_n[:, None], other=0.0).to(DT)[:, :, None]
            lo3 = tl.reshape(lo, (BLOCK_N, NG, GROUP // 2)) * sc
            hi3 = tl.reshape(hi, (BLOCK_N, NG, GROUP // 2)) * sc
            if HAS_ZERO:
                z = tl.load(Z + sptr, mask=mask_n[:, None], other=0.0).to(DT)[:, :, None]
                lo3 = lo3 + z
                hi3 = hi3 + z
            lo = tl.reshape(lo3, (BLOCK_N, HEAD_DIM // 2))
            hi = tl.reshape(hi3, (BLOCK_N, HEAD_DIM // 2))
        return lo, hi
    elif DIRECT and MODE == 1 and BITS == 8:  # q8: signed bytes, one scale per row (FACTOR)
        d = tl.arange(0, HEAD_DIM)
        raw = tl.load(P + rows[:, None] + d[None, :], mask=mask_n[:, None], other=0)
        if FAST:
            x = _asm_int8_to_f16(raw, PURE).to(DT)
        else:
            x = raw.to(tl.float32).to(DT)
        return x, x
    else:
        x = dequant_tile(P, S, Z, C, rows, srows, mask_n, BLOCK_N, HEAD_DIM,
                         MODE, BITS, SIGNED, OFFSET, GROUP, HAS_ZERO, FACTOR).to(DT)  # fmt: skip
        return x, x


# ---------------------------------------------------------------------------------------------
# jit helpers: writing
# ---------------------------------------------------------------------------------------------


@triton.jit
def round_half_even(x):
    """Round to nearest, ties to even (as ``torch.round``), in fp32."""
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def round_to_dtype(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (fp32, fp16 or bf16) to nearest even, as ``torch``'s
    ``.to(dtype)``, and returned in fp32. bf16 is rounded on the bits: Triton's interpreter
    truncates a bf16 conversion, so the cast would store other bytes on the CPU than on a GPU."""
    if dtype == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536  # keep the high half, ties to even (finite x)
        return b.to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def store_codes(
    P,
    rows,
    mask_r,
    u,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BITS: tl.constexpr,
):
    """Pack int32 codes ``u`` ``[ROWS, HEAD_DIM]`` (each in ``[0, 2**BITS)``, or int8 for 8 bits) into bytes."""
    if BITS == 8:
        d = tl.arange(0, HEAD_DIM)
        tl.store(P + rows[:, None] + d[None, :], u.to(P.dtype.element_ty), mask=mask_r[:, None])
    else:
        NCH: tl.constexpr = HEAD_DIM // 8
        BP: tl.constexpr = 8 if BITS > 4 else 4
        k = tl.arange(0, 8)
        u3 = tl.reshape(u, (ROWS, NCH, 8))
        if BITS > 4:
            word = tl.sum(u3.to(tl.int64) << (BITS * k).to(tl.int64)[None, None, :], axis=2)
        else:
            word = tl.sum(u3 << (BITS * k)[None, None, :], axis=2)  # (R, NCH): bits are disjoint
        j = tl.arange(0, BP)
        byte = ((word[:, :, None] >> (8 * j)[None, None, :]) & 0xFF).to(tl.int32)
        ptr = P + rows[:, None, None] + tl.arange(0, NCH)[None, :, None] * BITS + j[None, None, :]
        m = mask_r[:, None, None] & (j < BITS)[None, None, :]
        tl.store(ptr, byte.to(P.dtype.element_ty), mask=m)
