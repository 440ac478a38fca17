"""Codes to fp16 for the Gluon decode kernel (:mod:`kvtier.kernels.gluon_decode`).

Two ways a tile of codes meets the tensor cores:

- as dot operands straight from shared memory (q8, q4, fp8: one scale a token and head, which
  goes on the scores and the probabilities): one-byte tiles are read as int16, two bytes of one
  key an element, and a byte permutation turns a register into the fp16 pairs of two channels
  (:func:`byte_pairs`, :func:`nibble_quads`). q4_g32's nibbles alike, and its scale and zero a
  group of 32 channels, which vary along the dots' depth, go on the operands in registers
  (:func:`grouped_quads`), and TurboQuant's 8-bit keys likewise in two parts
  (:func:`grouped_pairs`);
- dequantised into an fp16 tile in shared memory first (TurboQuant's 3-bit Lloyd-Max values,
  :func:`dequant_centroid_groups`): a thread holds one group of 32 channels of one key at a
  time, whose centroids are looked up four at a time by two byte permutations; the tile's layout
  (:func:`staging_bases`) keeps its stores and reads clear of bank conflicts.
"""

from __future__ import annotations

import torch
import triton.language as tl

from kvtier.kernels.triton_quant import (
    INT8_PAIRS_ASM,
    NIBBLES_M8_PAIRS_ASM,
    NIBBLES_PAIRS_ASM,
    NIBBLES_RAW_PAIRS_ASM,
    UINT8_PAIRS_ASM,
)
from kvtier.quant.lloyd_max import lloyd_max_quantizer

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    # Triton 3.6 names a shared-memory view of another dtype _reinterpret, 3.9 reinterpret
    _NEW_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - Triton without Gluon
    HAVE_GLUON = False


def _centroids3_asm() -> str:
    """PTX: the fp16 pairs (``$0 $1``) of the 3-bit Lloyd-Max centroids of N(0, 1) of four codes
    given as a byte selector in ``$2``, a code a nibble (``$3 .. $5`` unused: the call takes four
    int32 elements). One permutation picks the centroids' low bytes out of the eight held in two
    registers, one their high bytes, and two more interleave them."""
    table = torch.tensor(lloyd_max_quantizer(3).centroids, dtype=torch.float16).view(torch.int16)
    half = [int(v) & 0xFFFF for v in table.tolist()]

    def word(shift: int, first: int) -> str:
        return hex(sum(((half[first + k] >> shift) & 0xFF) << (8 * k) for k in range(4)))

    return f"""{{
        .reg .b32 lo, hi, l0, l1, h0, h1;
        mov.b32 l0, {word(0, 0)};
        mov.b32 l1, {word(0, 4)};
        mov.b32 h0, {word(8, 0)};
        mov.b32 h1, {word(8, 4)};
        prmt.b32 lo, l0, l1, $2;
        prmt.b32 hi, h0, h1, $2;
        prmt.b32 $0, lo, hi, 0x5140;
        prmt.b32 $1, lo, hi, 0x7362;
        }}"""


#: 3-bit codes to their centroids (the default TurboQuant values, ``q3_0``)
CENTROIDS3_ASM = tl.constexpr(_centroids3_asm())


if HAVE_GLUON:

    @gluon.constexpr_function
    def staging_bases(block_n: int, d: int) -> list[list[int]]:
        """The fp16 tile ``[block_n, d]`` a tile of grouped codes is dequantised into, as the
        ``offset_bases`` of a shared linear layout: bit ``b`` of an element's offset in memory
        contributes ``bases[b]`` (``[key, channel]``, XORed together) to its place in the tile.

        Rows of ``d`` channels, 16-byte chunks of 8 channels, the chunk's low three bits XORed with
        the key's (the usual swizzle, so the eight keys of one chunk that a transposing ``ldmatrix``
        reads lie in eight banks), and for ``d >= 128`` with the chunk's higher bits too: a thread
        stores the 32 channels of one group of one key (four 16-byte stores), and the eight threads
        of a store's phase hold ``8 / (d / 32)`` keys and all of a row's ``d / 32`` groups, whose
        chunks ``4 g + j`` repeat every 128 bytes. Without the higher bits the groups ``g`` and
        ``g + 2`` met in one bank, two (d = 128) to four (d = 256) ways."""
        ng = d // 32
        shift = max(0, 3 - (ng.bit_length() - 1))  # bits of the chunk taken by a phase's keys (d = 128: 1)
        bases = [[0, 1], [0, 2], [0, 4]]  # the eight channels of a chunk
        for k in range((d // 8).bit_length() - 1):  # the chunk
            at = shift + k - 3  # the higher chunk bits XORed in at bit ``at``
            bases.append([0, (8 << k) ^ (8 << at if k >= 3 and at < 3 else 0)])
        for i in range(block_n.bit_length() - 1):  # the key
            bases.append([1 << i, 8 << i if i < 3 and 8 << i < d else 0])
        return bases

    @gluon.constexpr_function
    def staging_layout(block_n, d):
        """:func:`staging_bases` as a Gluon shared layout."""
        return gl.SharedLinearLayout(staging_bases(block_n, d))

    @gluon.jit
    def nibble_quads(x, SIGNED: gl.constexpr = True, RAW: gl.constexpr = False):
        """fp16 ``(c0, c1, c2, c3) - 8`` (``SIGNED``, q4) or ``(c0, c1, c2, c3)`` (q4_g32) of the
        int16 elements ``x``: four channels of one key, the nibbles low to high. A register holds
        two elements; as :func:`byte_pairs`. ``RAW``: the nibbles as they lie, ``c0 2^-24, c1 2^-20,
        c2 2^-24, c3 2^-20`` (fp16 subnormals, exact: no offset, no scale; the caller scales the
        dots back)."""
        if RAW:
            asm: gl.constexpr = NIBBLES_RAW_PAIRS_ASM
        elif SIGNED:
            asm: gl.constexpr = NIBBLES_M8_PAIRS_ASM
        else:
            asm: gl.constexpr = NIBBLES_PAIRS_ASM
        return gl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r", [x], dtype=(gl.float16,) * 4, is_pure=True, pack=2)

    @gluon.constexpr_function
    def _group_shape(shape, ng, keys_last):
        """``shape`` (``[depth, keys]``, ``keys_last``, or ``[keys, depth]``) with its depth split
        into ``ng`` groups."""
        return [ng, shape[0] // ng, shape[1]] if keys_last else [shape[0], ng, shape[1] // ng]

    @gluon.jit
    def _group_scales(x, scales, zeros, shape: gl.constexpr, KEYS_LAST: gl.constexpr):
        """``scales`` and ``zeros`` (``[keys, NG]`` in shared memory) loaded to broadcast over
        ``x`` seen as ``shape`` (:func:`_group_shape`), in the slice of ``x``'s own layout seen
        so: a thread loads the few scales its elements take, and nothing moves between threads."""
        if KEYS_LAST:
            sl: gl.constexpr = gl.SliceLayout(1, x.reshape(shape).type.layout)
            s = gl.expand_dims(scales.permute((1, 0)).load(sl), 1)
            z = gl.expand_dims(zeros.permute((1, 0)).load(sl), 1)
        else:
            sl: gl.constexpr = gl.SliceLayout(2, x.reshape(shape).type.layout)
            s = gl.expand_dims(scales.load(sl), 2)
            z = gl.expand_dims(zeros.load(sl), 2)
        return s, z

    @gluon.jit
    def _affine(c, s, z, shape: gl.constexpr):
        """``c * s + z`` (one fp16 FMA) with ``c`` seen as ``shape``, back in ``c``'s layout."""
        return gl.convert_layout((c.reshape(shape) * s + z).reshape(c.shape), c.type.layout, assert_trivial=True)

    @gluon.jit
    def grouped_quads(x, scales, zeros, NG: gl.constexpr, KEYS_LAST: gl.constexpr):
        """:func:`nibble_quads` of q4_g32 codes (unsigned nibbles), each channel part times its
        group's scale plus its zero (one fp16 FMA). ``x``: ``[D / 4, keys]`` (``KEYS_LAST``, the
        keys' operand) or ``[keys, D / 4]`` (the values'), whose element ``c`` holds channels
        ``4 c .. 4 c + 3``, in group ``c // 8``; ``scales``, ``zeros``: ``[keys, NG]`` in shared
        memory (:func:`_group_scales`)."""
        shape: gl.constexpr = _group_shape(x.shape, NG, KEYS_LAST)
        s, z = _group_scales(x, scales, zeros, shape, KEYS_LAST)
        c0, c1, c2, c3 = nibble_quads(x, False)
        return _affine(c0, s, z, shape), _affine(c1, s, z, shape), _affine(c2, s, z, shape), _affine(c3, s, z, shape)

    @gluon.jit
    def _stacked_scales(x3, scales, zeros):
        """``scales`` and ``zeros`` (``[keys, NG]`` fp16 in shared memory), to broadcast over ``x3``
        (``[NG, G, keys]``, stacked rows seen by group), in ``x3``'s dtype and the slice of its own
        layout: a thread loads the scales its elements take."""
        sl: gl.constexpr = gl.SliceLayout(1, x3.type.layout)
        s = gl.expand_dims(scales.permute((1, 0)).load(sl).to(x3.dtype), 1)
        z = gl.expand_dims(zeros.permute((1, 0)).load(sl).to(x3.dtype), 1)
        return s, z

    @gluon.jit
    def stacked_group_scales(p, scales, zeros, NG: gl.constexpr, G: gl.constexpr):
        """q4_g32 values' scales and zeros on the probabilities ``p`` (``[16, keys]`` float32, in
        the scores' layout) of a launch whose 16 rows are its ``G`` query heads once for each of
        the ``NG`` groups of channels (row ``g G + r``: head ``r``, group ``g``): each row takes
        its group's scale and zero of each key, ``p s`` and ``p z``, in fp16 (two keys an
        instruction; the value dot takes them in fp16). ``scales``, ``zeros``:
        ``[keys, NG]`` in shared memory, loaded in the slice of ``p``'s own layout seen as
        ``[NG, G, keys]`` (a thread loads the scales its elements take)."""
        p3 = p.to(gl.float16).reshape([NG, G, p.shape[1]])
        s, z = _stacked_scales(p3, scales, zeros)
        ps = gl.convert_layout((p3 * s).reshape(p.shape), p.type.layout, assert_trivial=True)
        pz = gl.convert_layout((p3 * z).reshape(p.shape), p.type.layout, assert_trivial=True)
        return ps, pz

    @gluon.jit
    def stacked_key_scores(s, scales, zeros, qsum, NG: gl.constexpr, G: gl.constexpr):
        """q4_g32 keys' scales and zeros on the scores of stacked rows (as
        :func:`stacked_group_scales`, row ``g G + r`` head ``r`` and group ``g``), whose query
        kept only group ``g``'s channels: ``s`` ``[16, keys]`` float32, each row's dot with the raw
        codes (``c 2^-24``, :func:`nibble_quads`), ``qsum`` ``[16]`` each row's query sum times
        2^-24. A row's part of its head's score is ``2^24 (s scale + zero qsum)`` (its group's
        scale and zero of each key); a head's score, the sum of its ``NG`` rows', is left in each
        of them, less the factor 2^24 (the caller's exponent takes it)."""
        shape: gl.constexpr = [NG, G, s.shape[1]]
        s3 = s.reshape(shape)
        sc, zc = _stacked_scales(s3, scales, zeros)
        q3 = gl.broadcast(gl.expand_dims(qsum, 1), s)[0].reshape(shape)
        head = gl.expand_dims(gl.sum(s3 * sc + q3 * zc, axis=0), 0)  # [1, G, keys]: a head's score
        return gl.convert_layout(gl.broadcast(head, s3)[0].reshape(s.shape), s.type.layout, assert_trivial=True)

    @gluon.jit
    def grouped_pairs(x, scales, zeros, NG: gl.constexpr):
        """The keys' operands of TurboQuant's unsigned 8-bit codes: ``x`` ``[D / 2, keys]``
        int16, element ``c`` channels ``2 c`` and ``2 c + 1`` of one key (group ``c // 16``).
        A register holds two elements along the depth, and one byte permutation makes the fp16
        pairs of their even channels (part 0) and of their odd ones (part 1), as
        :func:`byte_pairs` does; each part times its group's scale plus its zero (one fp16
        FMA, the scale and zero of one key and group for both halves of a register)."""
        shape: gl.constexpr = _group_shape(x.shape, NG, True)
        s, z = _group_scales(x, scales, zeros, shape, True)
        c0, c1 = gl.inline_asm_elementwise(UINT8_PAIRS_ASM, "=r,=r,r", [x], dtype=(gl.float16, gl.float16),
                                           is_pure=True, pack=2)  # fmt: skip
        return _affine(c0, s, z, shape), _affine(c1, s, z, shape)

    @gluon.jit
    def as_int16(tile, shape: gl.constexpr, layout: gl.constexpr):
        """``tile`` (one-byte codes in shared memory) seen as int16 of ``shape``."""
        if _NEW_REINTERPRET:
            return tile.reinterpret(gl.int16, shape, layout)
        else:
            return tile._reinterpret(gl.int16, shape, layout)

    @gluon.jit
    def byte_pairs(x, E4M3: gl.constexpr):
        """fp16 ``(low byte, high byte)`` of the int16 elements ``x``: two channels of one key
        (q8 codes, or e4m3 bytes with ``E4M3``). A register holds the pair of two keys, and a
        byte permutation puts the two keys' bytes of one channel side by side: the fp16
        operands of the probabilities' dot come from 16-bit shared-memory loads, not from one
        byte load and one conversion an element."""
        if E4M3:
            asm: gl.constexpr = """{
            .reg .b32 t;
            .reg .b16 a, b;
            prmt.b32 t, $2, 0, 0x3120;
            mov.b32 {a, b}, t;
            cvt.rn.f16x2.e4m3x2 $0, a;
            cvt.rn.f16x2.e4m3x2 $1, b;
            }"""
        else:  # q8 (triton_quant._int8_asm)
            asm: gl.constexpr = INT8_PAIRS_ASM
        return gl.inline_asm_elementwise(asm, "=r,=r,r", [x], dtype=(gl.float16, gl.float16), is_pure=True, pack=2)

    @gluon.jit
    def dequant_centroid_groups(words, scales, stage, BLOCK_N: gl.constexpr, D: gl.constexpr, NG: gl.constexpr,
                                DQ2: gl.constexpr, DQ3: gl.constexpr):  # fmt: skip
        """``scale * centroid[code]`` in fp16 of a tile of 3-bit codes (TurboQuant values, the
        bit stream of :mod:`kvtier.quant.bitpack`; an fp16 scale a group of 32 channels) stored
        into the fp16 tile ``stage``. ``words``: a group's 12 bytes as three int32 words in a
        slot of four; a thread holds one group of one key at a time. Codes ``4 k .. 4 k + 3``
        are the 12 bits at bit ``12 k`` (every shift is known where they are; ``k`` = 2 and 5
        straddle two words), spread into the nibbles of the byte selector of
        :data:`CENTROIDS3_ASM`, which takes four elements of which the first holds it."""
        x = gl.convert_layout(words.load(DQ2).reshape([BLOCK_N, NG, 4]), DQ3, assert_trivial=True)
        x = x.to(gl.uint32, bitcast=True)
        AXIS: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, DQ3))
        w = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=AXIS), 0), 0)
        a = gl.expand_dims(gl.sum(gl.where(w == 0, x, 0), axis=2), 2)
        b = gl.expand_dims(gl.sum(gl.where(w == 1, x, 0), axis=2), 2)
        c = gl.expand_dims(gl.sum(gl.where(w == 2, x, 0), axis=2), 2)
        i = gl.expand_dims(gl.expand_dims(gl.arange(0, 32, layout=AXIS), 0), 0)
        bit = 12 * (i // 4)
        at = bit // 32
        sh = (bit % 32).to(gl.uint32)
        f = gl.where(at == 0, a, gl.where(at == 1, b, c)) >> sh
        spill = gl.where(at == 0, b, c) << ((32 - sh) & 31)  # the bits past the word's end
        f = gl.where(sh > 20, f | spill, f)
        sel = (f & 7) | ((f << 1) & 0x70) | ((f << 2) & 0x700) | ((f << 3) & 0x7000)
        sel = gl.where(i % 4 == 0, sel, 0).to(gl.int32, bitcast=True)
        v = gl.inline_asm_elementwise(CENTROIDS3_ASM, "=r,=r,r,r,r,r", [sel], dtype=gl.float16, is_pure=True,
                                      pack=4)  # fmt: skip
        stage.store((v * gl.expand_dims(scales.load(gl.SliceLayout(2, DQ3)), 2)).reshape([BLOCK_N, D]))

    @gluon.jit
    def tile_scores(k_tile, ks, kz, qa, qb, qc, qd, q_sc, KIND: gl.constexpr, PARTS: gl.constexpr,
                    KPARTS: gl.constexpr, NG: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                    TILE16: gl.constexpr, KB: gl.constexpr, MMA: gl.constexpr, RAW: gl.constexpr = False,
                    G: gl.constexpr = 1):  # fmt: skip
        """The scores ``[16, BLOCK_N]`` (float32, the log2 domain, unmasked) of the query rows
        (``qa`` .. ``qd``: the query's parts as dot operands; q8: int8 codes and their scales
        ``q_sc``) against a tile of keys of page kind ``KIND`` (``gluon_decode.KINDS``) in shared
        memory, ``k_tile``, with its scales ``ks`` (and zeros ``kz``, q4_g32 and TurboQuant):
        one-byte tiles read as int16 and turned into ``KPARTS`` operands of interleaved channels;
        one scale a token on the scores, a group's scale and zero on the operands."""
        if KIND >= 2:  # (D / KPARTS, BLOCK_N) int16 (q4, fp8, q4_g32, TurboQuant)
            kt = as_int16(k_tile, [BLOCK_N, D // KPARTS], TILE16).permute((1, 0)).load(KB)
        else:
            kt = k_tile.permute((1, 0)).load(KB)  # (D, BLOCK_N)
        if KIND == 1:
            s = mma_v2(qa, kt, gl.zeros([16, BLOCK_N], gl.int32, MMA))
            s = s.to(gl.float32) * gl.expand_dims(q_sc, 1)
        elif PARTS == 4:
            if KIND == 4 and not RAW:  # q4_g32: the keys' groups' scales and zeros on the operands
                k0, k1, k2, k3 = grouped_quads(kt, ks, kz, NG, True)
            else:  # q4 (c - 8), or raw codes (stacked q4_g32's: scales and zeros on the scores)
                k0, k1, k2, k3 = nibble_quads(kt, KIND == 2, RAW)
            s = mma_v2(qa, k0, gl.zeros([16, BLOCK_N], gl.float32, MMA))
            s = mma_v2(qd, k3, mma_v2(qc, k2, mma_v2(qb, k1, s)))
            if RAW and KIND == 4:  # (qb, qd a sixteenth; q_sc each row's query sum 2^-24: 2^-24 scores)
                s = stacked_key_scores(s, ks, kz, q_sc, NG, G)
            elif RAW:  # q4's raw nibbles (qb, qd a sixteenth): the dots back to c - 8, q_sc the query's sums
                s = s * 16777216.0 - 8.0 * gl.expand_dims(q_sc, 1)
        elif KPARTS == 2:  # fp8 bytes, or TurboQuant's with their groups' scales and zeros
            if KIND == 5:
                k_even, k_odd = grouped_pairs(kt, ks, kz, NG)
            else:
                k_even, k_odd = byte_pairs(kt, True)
            s = mma_v2(qb, k_odd, mma_v2(qa, k_even, gl.zeros([16, BLOCK_N], gl.float32, MMA)))
        else:
            s = mma_v2(qa, kt, gl.zeros([16, BLOCK_N], gl.float32, MMA))
        if KIND == 1 or KIND == 2 or KIND == 3:  # one scale a token
            s = s * gl.expand_dims(ks.load(gl.SliceLayout(0, MMA)), 0)
        return s
