"""Generic b-bit packing (b = 1..8) of unsigned codes along the last dimension.

The rule, bit-exact (kernels read it this way):

- A row of ``D`` codes becomes ``W = ceil(D * b / 8)`` bytes. There is no pad
  byte: the packed row is exactly the bits it stores, so a row of 128 3-bit
  codes is 48 bytes and stays 16-byte aligned in the pages.
- Code ``i`` occupies bits ``[b*i, b*i + b)`` of the row's little-endian bit
  stream: bit ``k`` of the stream is bit ``k & 7`` of byte ``k >> 3``. So code
  ``i`` is::

      lo    = (b * i) >> 3          # first byte it touches
      shift = (b * i) & 7           # its lowest bit inside that byte
      code  = ((byte[lo] | byte[lo + 1] << 8) >> shift) & ((1 << b) - 1)

- ``byte[lo + 1]`` matters only when the code straddles a byte boundary
  (``shift + b > 8``), which happens only for b in {3, 5, 6, 7}. A code that
  straddles never straddles the row end (its second byte is inside the row), so
  ``lo + 1 == W`` only for codes that do not need that byte: a kernel loads the
  second byte with the mask ``lo + 1 < W`` and ``other=0`` (for b in {1, 2, 4, 8}
  it can skip the second load altogether). Bits past ``b * D`` in the last byte
  are zero.
- Examples: b = 4 puts code ``2j`` in the low nibble of byte ``j`` and ``2j+1``
  in the high nibble; b = 8 stores the codes as they are; b = 3 packs codes
  0..7 of a row into bytes 0..2 as ``c0 | c1<<3 | (c2 & 3)<<6``,
  ``c2>>2 | c3<<1 | c4<<4 | (c5 & 1)<<7``, ``c5>>1 | c6<<2 | c7<<5``.

Both directions are vectorised (no Python loop over elements) and run on any
device: they work on groups of eight codes, which fill exactly ``b`` bytes,
with narrow integer temporaries (int16 codes, int32 bytes).
"""

from __future__ import annotations

import torch


def packed_width(dim: int, bits: int) -> int:
    """Bytes per packed row of ``dim`` codes of ``bits`` bits: ``ceil(dim * bits / 8)``."""
    _check_bits(bits)
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
        raise ValueError(f"dim must be a positive int, got {dim!r}")
    return (dim * bits + 7) // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes ``[..., D]`` (any integer dtype, each in ``[0, 2**bits)``)
    into ``uint8`` ``[..., ceil(D * bits / 8)]`` by the module's rule.

    Codes outside ``[0, 2**bits)`` are a caller bug; they are not checked (that
    would cost a device sync) and corrupt their neighbours.

    Example::

        >>> pack(torch.tensor([1, 2, 3, 4], dtype=torch.uint8), 4)
        tensor([33, 67], dtype=torch.uint8)
    """
    _check_bits(bits)
    if not isinstance(codes, torch.Tensor) or codes.is_floating_point() or codes.is_complex():
        raise ValueError(f"pack() needs an integer tensor of codes, got {_describe(codes)}")
    if codes.dim() < 1 or codes.shape[-1] == 0:
        raise ValueError(f"pack() needs codes [..., D] with D >= 1, got shape {tuple(codes.shape)}")
    D = codes.shape[-1]
    width = packed_width(D, bits)
    if bits == 8:
        return codes.to(torch.uint8)
    if bits == 4 and D % 2 == 0:
        c = codes.to(torch.uint8).unflatten(-1, (D // 2, 2))  # (..., D/2, 2)
        return c[..., 0] | (c[..., 1] << 4)
    # Eight codes fill exactly `bits` bytes: place code k of every group at bit
    # bits*k of its group (a loop over the 8 positions, not over elements).
    pad = (-D) % 8
    c = codes.to(torch.int16)  # (code << shift) < 2**14 for bits <= 7
    if pad:
        c = torch.nn.functional.pad(c, (0, pad))
    c = c.unflatten(-1, (-1, 8))  # (..., G, 8)
    out = c.new_zeros(*c.shape[:-1], bits)  # (..., G, bits)
    for k in range(8):
        lo, shift = (bits * k) >> 3, (bits * k) & 7
        v = c[..., k] << shift
        out[..., lo] |= v & 0xFF
        if shift + bits > 8:
            out[..., lo + 1] |= v >> 8
    return out.flatten(-2)[..., :width].to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unpack ``uint8`` ``[..., ceil(dim * bits / 8)]`` into codes ``uint8`` ``[..., dim]``.

    This is the kernel formula of the module docstring, applied to code ``k`` of
    every group of eight codes (``bits`` bytes) at once. For ``bits == 8`` the
    bytes are the codes and ``packed`` itself is returned.

    Example::

        >>> unpack(torch.tensor([33, 67], dtype=torch.uint8), 4, 4)
        tensor([1, 2, 3, 4], dtype=torch.uint8)
    """
    width = packed_width(dim, bits)
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise ValueError(f"unpack() needs a uint8 tensor, got {_describe(packed)}")
    if packed.dim() < 1 or packed.shape[-1] != width:
        raise ValueError(
            f"unpack(): last dim of {tuple(packed.shape)} must be ceil({dim}*{bits}/8) = {width}; "
            "pass the payload pack() produced for this dim and bits"
        )
    if bits == 8:
        return packed  # the bytes are the codes
    if bits == 4 and dim % 2 == 0:
        return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    # the kernel formula, for code position k of every group of eight at once
    groups = -(-dim // 8)
    p = packed.to(torch.int32)
    if groups * bits > width:
        p = torch.nn.functional.pad(p, (0, groups * bits - width))  # bytes past the row read 0
    p = p.unflatten(-1, (groups, bits))  # (..., G, bits)
    out = torch.empty(*p.shape[:-1], 8, dtype=torch.uint8, device=p.device)  # (..., G, 8)
    for k in range(8):
        lo, shift = (bits * k) >> 3, (bits * k) & 7
        v = p[..., lo]
        if shift + bits > 8:
            v = v | (p[..., lo + 1] << 8)
        out[..., k] = (v >> shift) & ((1 << bits) - 1)
    return out.flatten(-2)[..., :dim]


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")


def _describe(t: object) -> str:
    return f"{t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
