"""The codec protocol: how one of K or V is stored in the paged tier's pages.

A codec turns ``x`` ``[N, H, D]`` (N tokens, H kv heads, head_dim D) into a
payload ``[N, H, D']`` of ``payload_dtype`` plus named sidecars ``[N, H, G]``
(scales, zeros), and back. The paged tier allocates pages
``[num_blocks, block_size, H, D']`` and sidecars ``[num_blocks, block_size, H, G]``
from :meth:`Codec.packed_dim` and :meth:`Codec.sidecar_specs`, and never looks
inside them.

Codecs that work in a rotated domain (TurboQuant values, rotated keys) set
``rotation`` to the orthogonal transform they apply before coding: ``decode``
undoes it; ``decode_rotated`` does not, so a kernel can score a rotated query
against rotated keys, or accumulate values in the rotated domain and rotate the
output back once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class CodecUnsupported(ValueError):
    """A codec cannot serve this shape or platform; ``str(e)`` is the reason."""


@dataclass(frozen=True)
class SidecarSpec:
    name: str
    groups: int
    dtype: torch.dtype


class Codec:
    """Base of every storage codec. Subclasses override the four methods below."""

    name: str = "base"
    #: orthogonal transform applied before coding (``None``: no rotation)
    rotation: object | None = None

    def __init__(self, head_dim: int, dtype: torch.dtype):
        self.head_dim = head_dim
        self.dtype = dtype  # the dtype decode() returns

    def packed_dim(self) -> int:
        raise NotImplementedError

    @property
    def payload_dtype(self) -> torch.dtype:
        raise NotImplementedError

    def sidecar_specs(self) -> tuple[SidecarSpec, ...]:
        return ()

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``x`` ``[N, H, D]`` -> payload ``[N, H, D']``, sidecars ``{name: [N, H, G]}``."""
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, sidecars: dict[str, torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`encode` (up to the codec's error), ``[..., H, D]`` in ``self.dtype``."""
        raise NotImplementedError

    def decode_rotated(self, payload: torch.Tensor, sidecars: dict[str, torch.Tensor]) -> torch.Tensor:
        """Like :meth:`decode` but left in the rotated domain (equals decode without rotation)."""
        return self.decode(payload, sidecars)

    def bytes_per_token_head(self) -> int:
        """Payload plus sidecar bytes of one (token, head) vector."""
        size = self.packed_dim() * torch.empty((), dtype=self.payload_dtype).element_size()
        for s in self.sidecar_specs():
            size += s.groups * torch.empty((), dtype=s.dtype).element_size()
        return size

    def bits_per_element(self) -> float:
        return 8.0 * self.bytes_per_token_head() / self.head_dim


class IdentityCodec(Codec):
    """Full precision: the payload is the vector itself in ``dtype``."""

    name = "fp"

    def packed_dim(self) -> int:
        return self.head_dim

    @property
    def payload_dtype(self) -> torch.dtype:
        return self.dtype

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return x.to(self.dtype), {}

    def decode(self, payload: torch.Tensor, sidecars: dict[str, torch.Tensor]) -> torch.Tensor:
        return payload
