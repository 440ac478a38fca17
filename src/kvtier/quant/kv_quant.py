"""KV-Quant codecs: symmetric q8 and q4 per (token, head), asymmetric q4 per group of 32.

Layouts, for a vector ``x`` of ``D`` channels (one token, one kv head); all
arithmetic in float32, rounding half to even (``torch.round``; a kernel uses
``rint``):

``q8`` (:class:`Q8Codec`)
    payload int8 ``[D]``, sidecar ``scale`` float32 ``[1]``.
    ``scale = max|x| / 127``; ``code = clamp(round(x / scale), -127, 127)``
    (``scale == 0`` codes every channel as 0); ``x^ = code * scale``.

``q4`` (:class:`Q4Codec`)
    payload uint8 ``[D/2]``, sidecar ``scale`` float32 ``[1]``; D must be even.
    ``scale = max|x| / 7``; ``code = clamp(round(x / scale), -7, 7)``; stored as
    the offset-8 nibble ``n = code + 8`` (1..15): channel ``2j`` in the low
    nibble of byte ``j``, channel ``2j+1`` in the high nibble;
    ``x^ = (n - 8) * scale``.

``q4_g32`` (:class:`GroupQ4Codec`)
    payload uint8 ``[D/2]`` (same nibble order, unsigned codes 0..15), sidecars
    ``scale`` and ``zero`` float16 ``[D/32]``; D must be a multiple of 32. For
    group ``g`` (channels ``32g .. 32g+31``): ``zero = fp16(min)``,
    ``scale = fp16((max - min) / 15)``,
    ``code = clamp(round((x - zero) / scale), 0, 15)`` using the fp16-rounded
    ``zero`` and ``scale`` (``scale == 0`` codes 0); ``x^ = zero + scale * code``.
    The same group-affine rule at other bit widths stores TurboQuant keys
    (:func:`group_affine_encode`).

Bits per element including sidecars: q8 ``8 + 32/D`` (8.25 at D=128), q4
``4 + 32/D`` (4.25), q4_g32 5 at every D.
"""

from __future__ import annotations

import torch

from kvtier.quant import bitpack
from kvtier.quant.codec import Codec, CodecUnsupported, SidecarSpec

GROUP = 32


def ieee_div(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor`` correctly rounded on every device.

    PyTorch's CUDA kernels turn division by a Python number into a multiplication
    by its reciprocal (an ulp off at times); dividing by a 0-d tensor on the same
    device keeps the IEEE quotient, so CPU and CUDA store the same scales.
    """
    return x / torch.full((), divisor, dtype=x.dtype, device=x.device)


class _SymmetricCodec(Codec):
    """Symmetric integer code per (token, head) with one float32 scale."""

    qmax: int
    bits: int

    def sidecar_specs(self) -> tuple[SidecarSpec, ...]:
        return (SidecarSpec("scale", 1, torch.float32),)

    def _codes(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` ``[M, D]`` -> signed codes int8 ``[M, D]``, scale float32 ``[M, 1]``."""
        amax = rows.abs().amax(-1, keepdim=True).to(torch.float32)  # (M, 1)
        scale = ieee_div(amax, self.qmax)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = (rows / safe).round_().clamp_(-self.qmax, self.qmax)  # the one fp32 copy
        return q.to(torch.int8), scale

    def _decode_codes(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (codes * scale.to(torch.float32)).to(self.dtype)  # int8 * fp32 promotes: one pass


class Q8Codec(_SymmetricCodec):
    """``q8``: int8 codes ``[..., D]`` and one float32 scale ``[..., 1]`` per vector.

    Example::

        >>> codec = Q8Codec(64, torch.float16)
        >>> payload, side = codec.encode(torch.randn(5, 2, 64, dtype=torch.float16))
        >>> payload.shape, payload.dtype, side["scale"].shape
        (torch.Size([5, 2, 64]), torch.int8, torch.Size([5, 2, 1]))
    """

    name = "q8"
    qmax = 127
    bits = 8

    def packed_dim(self) -> int:
        return self.head_dim

    @property
    def payload_dtype(self) -> torch.dtype:
        return torch.int8

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``x`` ``[..., D]`` float -> int8 ``[..., D]``, ``{"scale": float32 [..., 1]}``."""

        def rows_fn(rows: torch.Tensor):
            q, scale = self._codes(rows)
            return q, {"scale": scale}

        return self._encode_blocked(x, rows_fn)

    def decode(self, payload: torch.Tensor, sidecars: dict[str, torch.Tensor]) -> torch.Tensor:
        """int8 ``[..., D]`` and scale ``[..., 1]`` -> ``[..., D]`` in ``self.dtype``."""
        self.check_encoded(payload, sidecars)
        return self._decode_codes(payload, sidecars["scale"])


class Q4Codec(_SymmetricCodec):
    """``q4``: offset-8 nibbles uint8 ``[..., D/2]`` and one float32 scale ``[..., 1]``.

    Even ``head_dim`` only (else :class:`CodecUnsupported`). Coarse: one scale per
    vector spends its 15 levels on the outlier channels; prefer ``q4_g32``.
    """

    name = "q4"
    qmax = 7
    bits = 4

    def __init__(self, head_dim: int, dtype: torch.dtype):
        super().__init__(head_dim, dtype)
        if head_dim % 2:
            raise CodecUnsupported(
                f"q4 packs two channels per byte and needs an even head_dim, got {head_dim}"
            )

    def packed_dim(self) -> int:
        return self.head_dim // 2

    @property
    def payload_dtype(self) -> torch.dtype:
        return torch.uint8

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``x`` ``[..., D]`` float -> uint8 ``[..., D/2]``, ``{"scale": float32 [..., 1]}``."""

        def rows_fn(rows: torch.Tensor):
            q, scale = self._codes(rows)
            return bitpack.pack((q + 8).to(torch.uint8), 4), {"scale": scale}

        return self._encode_blocked(x, rows_fn)

    def decode(self, payload: torch.Tensor, sidecars: dict[str, torch.Tensor]) -> torch.Tensor:
        """uint8 ``[..., D/2]`` and scale ``[..., 1]`` -> ``[..., D]`` in ``self.dtype``."""
        self.check_encoded(payload, sidecars)
        codes = bitpack.unpack(payload, 4, self.head_dim).to(torch.int8) - 8
        return self._decode_codes(codes, sidecars["scale"])


def group_affine_encode(rows: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric ``bits``-bit codes per group of 32 channels (the ``q4_g32`` rule).

    ``rows`` ``[M, D]`` float (D a multiple of 32) -> codes uint8 ``[M, D]`` in
    ``[0, 2**bits - 1]``, scale and zero float16 ``[M, D/32]``.
    """
    qmax = (1 << bits) - 1
    g = rows.unflatten(-1, (-1, GROUP))  # (M, G, 32)
    lo = g.amin(-1).to(torch.float32)  # (M, G)
    hi = g.amax(-1).to(torch.float32)
    zero = lo.to(torch.float16)
    scale = ieee_div(hi - lo, qmax).to(torch.float16)
    zf, sf = zero.to(torch.float32), scale.to(torch.float32)
    safe = torch.where(sf > 0, sf, torch.ones_like(sf))
    q = (g - zf.unsqueeze(-1)).div_(safe.unsqueeze(-1)).round_().clamp_(0, qmax)  # (M, G, 32)
    return q.to(torch.uint8).flatten(-2), scale, zero


def group_affine_decode(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``zero + scale * code`` per group of 32, float32 ``[..., D]`` from codes ``[..., D]``
    and float16 scale/zero ``[..., D/32]``."""
    c = codes.to(torch.float32).unflatten(-1, (-1, GROUP))  # (..., G, 32)
    out = c.mul_(scale.to(torch.float32).unsqueeze(-1)).add_(zero.to(torch.float32).unsqueeze(-1))
    return out.flatten(-2)


def check_group_dim(head_dim: int, what: str) -> None:
    """Raise :class:`CodecUnsupported` unless ``head_dim`` is a multiple of 32."""
    if head_dim % GROUP:
        raise CodecUnsupported(
            f"{what} codes groups of {GROUP} channels and needs head_dim a multiple of "
            f"{GROUP}, got {head_dim}"
        )


class BitPackedCodec(Codec):
    """A payload of ``bits``-bit codes bit-packed into uint8 (:mod:`kvtier.quant.bitpack`)."""

    bits: int = 4

    def packed_dim(self) -> int:
        return bitpack.packed_width(self.head_dim, self.bits)

    @property
    def payload_dtype(self) -> torch.dtype:
        return torch.uint8


class GroupAffineLayout(BitPackedCodec):
    """Layout shared by the per-32-channel asymmetric codecs: ``bits``-bit codes
    bit-packed into uint8, float16 ``scale`` and ``zero`` per group of 32."""

    def sidecar_specs(self) -> tuple[SidecarSpec, ...]:
        groups = self.head_dim // GROUP
        return (SidecarSpec("scale", groups, torch.float16), SidecarSpec("zero", groups, torch.float16))


class GroupQ4Codec(GroupAffineLayout):
    """``q4_g32``: unsigned nibbles ``[..., D/2]``, float16 ``scale`` and ``zero`` ``[..., D/32]``.

    ``head_dim`` must be a multiple of 32 (else :class:`CodecUnsupported`).

    Example::

        >>> codec = GroupQ4Codec(64, torch.bfloat16)
        >>> payload, side = codec.encode(torch.randn(3, 4, 64, dtype=torch.bfloat16))
        >>> payload.shape, side["zero"].shape, codec.bits_per_element()
        (torch.Size([3, 4, 32]), torch.Size([3, 4, 2]), 5.0)
    """

    name = "q4_g32"
    bits = 4

    def __init__(self, head_dim: int, dtype: torch.dtype):
        super().__init__(head_dim, dtype)
        check_group_dim(head_dim, "q4_g32")

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``x`` ``[..., D]`` -> uint8 ``[..., D/2]``, ``{"scale", "zero": float16 [..., D/32]}``."""

        def rows_fn(rows: torch.Tensor):
            q, scale, zero = group_affine_encode(rows, self.bits)
            return bitpack.pack(q, self.bits), {"scale": scale, "zero": zero}

        return self._encode_blocked(x, rows_fn)

    def decode(self, payload: torch.Tensor, sidecars: dict[str, torch.Tensor]) -> torch.Tensor:
        """Payload and sidecars as :meth:`encode` returns them -> ``[..., D]`` in ``self.dtype``."""
        self.check_encoded(payload, sidecars)
        codes = bitpack.unpack(payload, self.bits, self.head_dim)
        return group_affine_decode(codes, sidecars["scale"], sidecars["zero"]).to(self.dtype)
