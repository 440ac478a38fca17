"""The PTX of the Gluon decode kernel's code conversions (:mod:`kvtier.kernels.gluon_codes`),
run by a small interpreter of the instructions it uses (``mov``, ``prmt``, ``sub.f16x2``), so
that its tables and byte selectors are checked off the GPU against the codecs' own decoding.
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
    from kvtier.kernels.gluon_codes import CENTROIDS3_ASM, UINT8_ASM

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
    """Every byte value, four to a register, as the two fp16 pairs of bytes 0 1 and 2 3."""
    for first in range(0, 256, 4):
        word = int.from_bytes(bytes(range(first, first + 4)), "little")
        r = _run(UINT8_ASM, {"$2": word})
        assert list(np.concatenate([_f16x2(r["$0"]), _f16x2(r["$1"])])) == [first, first + 1, first + 2, first + 3]


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
