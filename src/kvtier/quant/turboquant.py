"""TurboQuant storage: integer-coded keys and Hadamard-rotated Lloyd-Max values.

Both codecs need ``head_dim`` a power of two from 64 to 512 (the fast
Walsh-Hadamard transform), else :class:`CodecUnsupported`, so a mode serves the
same shapes whichever half is rotated. Groups are 32 consecutive channels
(``G = D / 32`` per vector).

Keys (:class:`TurboKeyCodec`)
    The group-affine rule of ``q4_g32`` at ``b`` bits: per group
    ``zero = fp16(min)``, ``scale = fp16((max - min) / (2^b - 1))``,
    ``code = clamp(round((x - zero) / scale), 0, 2^b - 1)`` (unsigned),
    ``x^ = zero + scale * code``; codes bit-packed by :mod:`kvtier.quant.bitpack`
    into ``ceil(D * b / 8)`` bytes. Sidecars ``scale`` and ``zero`` float16
    ``[G]``. Bits per code: ``q8_0``, ``int8``, ``uint8`` -> 8; ``q5_0`` -> 5;
    ``q4_0``, ``int4``, ``uint4`` -> 4; ``int2``, ``uint2`` -> 2. The signed and
    unsigned names are accepted for MTPLX compatibility and all mean the same
    unsigned-code-plus-zero storage (a signed code ``k - 2^(b-1)`` with zero
    ``zero + 2^(b-1) * scale`` is the same number). Unlike llama.cpp's ``q8_0``
    (symmetric, one scale per 32), every key code here carries a zero.
    With ``rotate=True`` the key is first rotated, ``y = Pi x``
    (:class:`HadamardRotation` with the codec's seed), and ``y`` is coded;
    ``decode`` returns ``Pi^T y^``, ``decode_rotated`` returns ``y^``; a kernel
    rotates the query once (``q' = Pi q``) and scores ``q' . y^``.

Values (:class:`TurboValueCodec`)
    ``y = Pi x``; per group of 32 rotated channels ``s0 = sqrt(mean(y^2))``
    (float32; ``s0 = 0`` divides by 1), ``idx = sum_k [y / s0 > t_k]`` over the
    Lloyd-Max boundaries ``t`` of N(0, 1) at ``b`` bits (so ``idx`` names the
    nearest centroid), then the stored scale is the least-squares fit for those
    indices, ``scale = fp16(sum(y * c[idx]) / sum(c[idx]^2))``. Payload: the
    ``b``-bit ``idx`` bit-packed; sidecar ``scale`` float16 ``[G]``.
    ``decode_rotated`` gives ``y^ = scale * c[idx]``; ``decode`` gives
    ``Pi^T y^``. Codes: ``q2_0`` -> 2 bits, ``q3_0`` -> 3, ``q4_0`` -> 4,
    ``q5_0`` -> 5, ``q8_0`` -> 8.

Decoding computes in float32 and rounds once to the codec's dtype.
"""

from __future__ import annotations

import torch

from kvtier.quant import bitpack
from kvtier.quant.codec import SidecarSpec
from kvtier.quant.hadamard import HadamardRotation, check_rotation_dim
from kvtier.quant.kv_quant import (
    GROUP,
    BitPackedCodec,
    GroupAffineLayout,
    group_affine_decode,
    group_affine_encode,
)
from kvtier.quant.lloyd_max import lloyd_max_quantizer

KEY_CODE_BITS = {
    "q8_0": 8, "int8": 8, "uint8": 8,
    "q5_0": 5,
    "q4_0": 4, "int4": 4, "uint4": 4,
    "int2": 2, "uint2": 2,
}
VALUE_CODE_BITS = {"q2_0": 2, "q3_0": 3, "q4_0": 4, "q5_0": 5, "q8_0": 8}


def _bits_of(code: str, table: dict[str, int], what: str) -> int:
    if code not in table:
        raise ValueError(f"TurboQuant {what} code {code!r} is unknown; accepted: {', '.join(table)}")
    return table[code]


class TurboKeyCodec(GroupAffineLayout):
    """TurboQuant keys: group-affine integers (fp16 scale and zero per 32 channels).

    ``code`` is one of :data:`KEY_CODE_BITS`; ``rotate=True`` codes ``Pi x`` with
    ``rotation = HadamardRotation(head_dim, seed)``.

    Example::

        >>> codec = TurboKeyCodec(128, torch.float16, code="q5_0", rotate=True, seed=0)
        >>> payload, side = codec.encode(torch.randn(7, 2, 128, dtype=torch.float16))
        >>> payload.shape, side["scale"].shape, codec.bits_per_element()
        (torch.Size([7, 2, 80]), torch.Size([7, 2, 4]), 6.0)
    """

    def __init__(
        self,
        head_dim: int,
        dtype: torch.dtype,
        code: str = "q8_0",
        rotate: bool = False,
        seed: int = 0,
    ):
        super().__init__(head_dim, dtype)
        self.bits = _bits_of(code, KEY_CODE_BITS, "key")
        check_rotation_dim(head_dim, "TurboQuant")
        self.code = code
        self.rotation = HadamardRotation(head_dim, seed) if rotate else None
        self.name = f"turboquant-key:{code}{'r' if rotate else ''}"

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``x`` ``[..., D]`` -> uint8 ``[..., ceil(D*b/8)]``, ``{"scale", "zero": float16 [..., D/32]}``."""

        def rows_fn(rows: torch.Tensor):
            if self.rotation is not None:
                rows = self.rotation.apply(rows.to(torch.float32))  # (M, D) float32
            q, scale, zero = group_affine_encode(rows, self.bits)
            return bitpack.pack(q, self.bits), {"scale": scale, "zero": zero}

        return self._encode_blocked(x, rows_fn)

    def decode_rotated(self, payload: torch.Tensor, sidecars: dict[str, torch.Tensor]) -> torch.Tensor:
        """The coded vectors ``[..., D]`` in ``self.dtype``, still rotated when ``rotate=True``."""
        return self._decode_f32(payload, sidecars).to(self.dtype)

    def decode(self, payload: torch.Tensor, sidecars: dict[str, torch.Tensor]) -> torch.Tensor:
        """The keys ``[..., D]`` in ``self.dtype`` (rotation undone)."""
        y = self._decode_f32(payload, sidecars)
        if self.rotation is not None:
            y = self.rotation.inverse(y)
        return y.to(self.dtype)

    def _decode_f32(self, payload: torch.Tensor, sidecars: dict[str, torch.Tensor]) -> torch.Tensor:
        self.check_encoded(payload, sidecars)
        codes = bitpack.unpack(payload, self.bits, self.head_dim)
        return group_affine_decode(codes, sidecars["scale"], sidecars["zero"])


class TurboValueCodec(BitPackedCodec):
    """TurboQuant values: Hadamard-rotated, Lloyd-Max coded, one fp16 scale per 32 channels.

    ``code`` is one of :data:`VALUE_CODE_BITS`; ``rotation = HadamardRotation(head_dim, seed)``.

    Example::

        >>> codec = TurboValueCodec(128, torch.float16, code="q3_0", seed=1)
        >>> payload, side = codec.encode(torch.randn(7, 2, 128, dtype=torch.float16))
        >>> payload.shape, side["scale"].shape, codec.bits_per_element()
        (torch.Size([7, 2, 48]), torch.Size([7, 2, 4]), 3.5)
    """

    def __init__(self, head_dim: int, dtype: torch.dtype, code: str = "q3_0", seed: int = 1):
        super().__init__(head_dim, dtype)
        self.bits = _bits_of(code, VALUE_CODE_BITS, "value")
        check_rotation_dim(head_dim, "TurboQuant")
        self.code = code
        self.quantizer = lloyd_max_quantizer(self.bits)
        self.rotation = HadamardRotation(head_dim, seed)
        self.name = f"turboquant-value:{code}"
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def sidecar_specs(self) -> tuple[SidecarSpec, ...]:
        return (SidecarSpec("scale", self.head_dim // GROUP, torch.float16),)

    def centroids(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``2**bits`` Lloyd-Max centroids of N(0, 1), ascending, ``[2**bits]``."""
        return self.quantizer.centroids_tensor(device, dtype)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``x`` ``[..., D]`` -> uint8 ``[..., ceil(D*b/8)]``, ``{"scale": float16 [..., D/32]}``."""

        def rows_fn(rows: torch.Tensor):
            cents, bounds = self._table(rows.device)
            y = self.rotation.apply(rows.to(torch.float32)).unflatten(-1, (-1, GROUP))  # (M, G, 32)
            s0 = y.square().mean(-1, keepdim=True).sqrt_()  # (M, G, 1)
            s0 = torch.where(s0 > 0, s0, torch.ones_like(s0))
            idx = torch.searchsorted(bounds, (y / s0).contiguous())  # count of t_k < y/s0
            c = cents[idx]  # (M, G, 32)
            scale = ((y * c).sum(-1) / c.square().sum(-1)).to(torch.float16)  # (M, G)
            return bitpack.pack(idx.flatten(-2), self.bits), {"scale": scale}

        return self._encode_blocked(x, rows_fn)

    def decode_rotated(self, payload: torch.Tensor, sidecars: dict[str, torch.Tensor]) -> torch.Tensor:
        """``scale * c[idx]`` ``[..., D]`` in ``self.dtype``: the values in the rotated domain."""
        return self._decode_f32(payload, sidecars).to(self.dtype)

    def decode(self, payload: torch.Tensor, sidecars: dict[str, torch.Tensor]) -> torch.Tensor:
        """The values ``[..., D]`` in ``self.dtype`` (``Pi^T`` of :meth:`decode_rotated`)."""
        return self.rotation.inverse(self._decode_f32(payload, sidecars)).to(self.dtype)

    def _decode_f32(self, payload: torch.Tensor, sidecars: dict[str, torch.Tensor]) -> torch.Tensor:
        self.check_encoded(payload, sidecars)
        cents, _ = self._table(payload.device)
        idx = bitpack.unpack(payload, self.bits, self.head_dim).to(torch.int64)
        y = cents[idx].unflatten(-1, (-1, GROUP))  # (..., G, 32)
        return y.mul_(sidecars["scale"].to(torch.float32).unsqueeze(-1)).flatten(-2)

    def _table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, torch.float32)
        if key not in self._tables:
            self._tables[key] = (
                self.quantizer.centroids_tensor(device, torch.float32),
                self.quantizer.boundaries_tensor(device, torch.float32),
            )
        return self._tables[key]
