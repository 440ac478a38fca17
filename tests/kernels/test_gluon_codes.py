"""The PTX of the Gluon decode kernel's code conversions (:mod:`kvtier.kernels.gluon_codes`),
run by a small interpreter of the instructions it uses (``mov``, ``prmt``, ``sub.f16x2``), so
that its tables and byte selectors are checked off the GPU against the codecs' own decoding;
and the banks its fp16 staging tile's stores and reads meet, on a model of shared memory.
The kernel's results on the GPU: ``test_gluon_decode.py``."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from test_triton_paged import IN_PROCESS

from kvtier.quant import bitpack
from kvtier.quant.lloyd_max import lloyd_max_quantizer

if IN_PROCESS:
    from kvtier.kernels.gluon_codes import CENTROIDS3_ASM, HAVE_GLUON, UINT8_PAIRS_ASM

    if HAVE_GLUON:
        from kvtier.kernels.gluon_codes import staging_bases

pytestmark = pytest.mark.skipif(not IN_PROCESS, reason="Triton's modules are imported in another process here")


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX ``prmt.b32`` in its default mode: byte ``i`` of the result is byte ``sel``'s nibble
    ``i`` of the eight bytes ``b:a`` (``a`` the low four)."""
    pool = (b << 32 | a).to_bytes(8, "little")
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        assert nib < 8, "the sign-replicating selectors are not used"
        out |= pool[nib] << (8 * i)
    return out


def _f16x2(x: int) -> np.ndarray:
    return np.frombuffer(x.to_bytes(4, "little"), dtype=np.float16)


def _run(asm, args: dict[str, int]) -> dict[str, int]:
    """Run ``asm`` (a ``tl.constexpr`` of PTX text) with registers ``$n`` set from ``args``."""
    regs = dict(args)

    def val(tok: str) -> int:
        tok = tok.strip()
        return int(tok, 16) if tok.startswith("0x") else regs[tok]

    for line in str(getattr(asm, "value", asm)).splitlines():
        line = line.strip().rstrip(";")
        m = re.match(r"(\S+)\s+(.*)", line)
        if not m or m.group(1) in ("{", "}", ".reg"):
            continue
        op, ops = m.group(1), [t.strip() for t in m.group(2).split(",")]
        if op == "mov.b32":
            regs[ops[0]] = val(ops[1])
        elif op == "prmt.b32":
            regs[ops[0]] = _prmt(val(ops[1]), val(ops[2]), val(ops[3]))
        elif op == "sub.f16x2":
            r = _f16x2(val(ops[1])) - _f16x2(val(ops[2]))
            regs[ops[0]] = int.from_bytes(r.astype(np.float16).tobytes(), "little")
        else:
            raise AssertionError(f"this interpreter does not know {op!r}")
    return regs


def test_unsigned_bytes_become_their_fp16_values():
    """Every byte value (TurboQuant's 8-bit keys), four to a register as two int16 elements
    ``b0 b1`` and ``b2 b3`` (two channels of one key each), as the fp16 pairs of the elements'
    first channels, ``b0 b2``, and of their second, ``b1 b3``."""
    for first in range(0, 256, 4):
        word = int.from_bytes(bytes(range(first, first + 4)), "little")
        r = _run(UINT8_PAIRS_ASM, {"$2": word})
        assert list(_f16x2(r["$0"])) == [first, first + 2]
        assert list(_f16x2(r["$1"])) == [first + 1, first + 3]


def _selectors(group: bytes) -> list[int]:
    """The kernel's byte selectors of one group's 12 bytes: the 12 bits at bit ``12 k`` of the
    little-endian stream, spread into four nibbles."""
    stream = int.from_bytes(group, "little")
    out = []
    for k in range(8):
        f = (stream >> (12 * k)) & 0xFFF
        out.append((f & 7) | ((f << 1) & 0x70) | ((f << 2) & 0x700) | ((f << 3) & 0x7000))
    return out


def test_three_bit_codes_become_their_centroids():
    """Random groups of 32 codes packed by bitpack's rule: the selectors and the lookup give
    the fp16 centroids of those codes, in order, including the codes that straddle bytes and
    words (10 and 21 of a group)."""
    table = torch.tensor(lloyd_max_quantizer(3).centroids, dtype=torch.float16)
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 8, (64, 32), generator=gen, dtype=torch.uint8)
    codes[0] = torch.arange(32) % 8  # every code in every place of a selector
    codes[1] = 7
    packed = bitpack.pack(codes, 3)
    assert packed.shape == (64, 12)
    for row, group in zip(codes, packed):
        got = []
        for sel in _selectors(bytes(group.tolist())):
            r = _run(CENTROIDS3_ASM, {"$2": sel, "$3": 0, "$4": 0, "$5": 0})
            got += list(_f16x2(r["$0"])) + list(_f16x2(r["$1"]))
        assert got == table[row.long()].tolist()


def _offsets(bases: list[list[int]], block_n: int, d: int) -> dict[tuple[int, int], int]:
    """``{(key, channel): offset}`` of a shared linear layout's ``offset_bases``."""
    out = {}
    for o in range(block_n * d):
        n = c = 0
        for b, (bn, bc) in enumerate(bases):
            if o >> b & 1:
                n, c = n ^ bn, c ^ bc
        out[(n, c)] = o
    return out


def _wavefronts(offsets: dict, chunks: list[tuple[int, int]], elem_bytes: int = 2) -> int:
    """Shared-memory wavefronts of 16-byte accesses (chunks ``(key, channel)`` of elements of
    ``elem_bytes``, fp16 by default, a lane each): eight lanes a phase, a phase as many
    wavefronts as the most lines one of the eight 16-byte bank groups of a 128-byte line is
    asked for."""
    total = 0
    for p in range(0, len(chunks), 8):
        lines: dict[int, set[int]] = {}
        for chunk in chunks[p : p + 8]:
            byte = elem_bytes * offsets[chunk]
            lines.setdefault(byte // 16 % 8, set()).add(byte // 128)
        total += max(len(v) for v in lines.values())
    return total


def _swizzled(block_n: int, d: int) -> list[list[int]]:
    """``SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8)``: the chunk XORed with the key alone."""
    chunks = [[0, 1 << b] for b in range(d.bit_length() - 1)]
    return chunks + [[1 << i, 8 << i if i < 3 and 8 << i < d else 0] for i in range(block_n.bit_length() - 1)]


@pytest.mark.skipif(not IN_PROCESS or not HAVE_GLUON, reason="needs Gluon")
@pytest.mark.parametrize("block_n, d", [(16, 64), (16, 128), (32, 128), (64, 128), (16, 256), (16, 512), (32, 256)])
def test_the_staging_tile_takes_its_stores_and_reads_without_bank_conflicts(block_n, d):
    offsets = _offsets(staging_bases(block_n, d), block_n, d)
    assert sorted(offsets.values()) == list(range(block_n * d)), "every place of the tile once"
    ng = d // 32
    # the dequantising stores: lane = key * ng + group; a thread's four 16-byte stores j
    stores = [[(k0 + lane // ng, lane % ng * 32 + 8 * j) for lane in range(32)]
              for k0 in range(0, block_n, 32 // ng) for j in range(4)]  # fmt: skip
    # ldmatrix (transposed or not): eight keys of one 16-byte chunk a phase
    reads = [[(k0 + i, c) for i in range(8)] for k0 in range(0, block_n, 8) for c in range(0, d, 8)]
    assert sum(_wavefronts(offsets, s) for s in stores) == 4 * len(stores)  # 512 bytes: four at least
    assert sum(_wavefronts(offsets, r) for r in reads) == len(reads)
    # the premise: the key's swizzle alone puts a store phase's groups g and g + 2 in one bank
    if d >= 128:
        plain = _offsets(_swizzled(block_n, d), block_n, d)
        assert sum(_wavefronts(plain, s) for s in stores) >= 8 * len(stores)
        assert sum(_wavefronts(plain, r) for r in reads) == len(reads)


def _byte_offsets(rows: int, row_bytes: int, vec: int, per_phase: int, max_phase: int) -> dict[tuple[int, int], int]:
    """``{(row, byte): offset}`` of a ``SwizzledSharedLayout(vec, per_phase, max_phase)`` tile of
    one-byte elements, as its linear layout: row bit ``i`` XORs the chunk with
    ``(2^i // per_phase) % max_phase``, and a XOR past the row's chunks is dropped."""
    bases = [[0, 1 << b] for b in range(row_bytes.bit_length() - 1)]
    for i in range(rows.bit_length() - 1):
        x = ((1 << i) // per_phase % max_phase) * vec
        bases.append([1 << i, x if x < row_bytes else 0])
    return _offsets(bases, rows, row_bytes)


@pytest.mark.skipif(not IN_PROCESS or not HAVE_GLUON, reason="needs Gluon")
@pytest.mark.parametrize("row_bytes", [32, 64, 128, 256])
def test_tiles_of_codes_take_ldmatrix_reads_without_bank_conflicts(row_bytes):
    """``gluon_tiles.tile_layout`` swizzles a tile of rows of codes so that the eight rows of a
    16-byte chunk one ``ldmatrix`` phase reads fall in the eight 16-byte bank groups of a line:
    one wavefront a phase, for q4's 32- and 64-byte rows as for 128 bytes and more. The premise:
    one row a phase over eight phases, the old swizzle, split a 64-byte tile's phase in two."""
    from kvtier.kernels.gluon_tiles import tile_layout

    layout = tile_layout(16, row_bytes, 1)
    assert layout.max_phase <= row_bytes // 16, "no XOR past the row's chunks"
    rows = 64
    # eight rows of one 16-byte chunk a phase
    reads = [(r0 + i, 16 * c) for r0 in range(0, rows, 8) for c in range(row_bytes // 16) for i in range(8)]

    offsets = _byte_offsets(rows, row_bytes, 16, layout.per_phase, layout.max_phase)
    assert sorted(offsets.values()) == list(range(rows * row_bytes)), "every place of the tile once"
    phases = len(reads) // 8
    assert _wavefronts(offsets, reads, 1) == phases
    if row_bytes == 64:
        assert _wavefronts(_byte_offsets(rows, row_bytes, 16, 1, 8), reads, 1) == 2 * phases
