"""The codec protocol: how one of K or V is stored in the paged tier's pages.

A codec turns ``x`` ``[N, H, D]`` (N tokens, H kv heads, head_dim D) into a
payload ``[N, H, D']`` of ``payload_dtype`` plus named sidecars ``[N, H, G]``
(scales, zeros), and back. The paged tier allocates pages
``[num_blocks, block_size, H, D']`` and sidecars ``[num_blocks, block_size, H, G]``
from :meth:`Codec.packed_dim` and :meth:`Codec.sidecar_specs`, and never looks
inside them. Any number of leading dimensions works: only the last one (D, D' or
G) belongs to the codec.

Codecs that work in a rotated domain (TurboQuant values, rotated keys) set
``rotation`` to the orthogonal transform they apply before coding: ``decode``
undoes it; ``decode_rotated`` does not, so a kernel can score a rotated query
against rotated keys, or accumulate values in the rotated domain and rotate the
output back once.

Every codec is deterministic and pure PyTorch (CPU and CUDA). Encoding works
through the input in blocks of at most :data:`ENCODE_BLOCK_ELEMENTS` elements,
so its float32 working copies stay bounded whatever the chunk length. The
exact byte layouts are in ``docs/quantization.md``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

#: elements (rows x head_dim) an encoder converts to float32 at a time (16 MiB per copy)
ENCODE_BLOCK_ELEMENTS = 1 << 22

EncodedRows = tuple[torch.Tensor, dict[str, torch.Tensor]]


class CodecUnsupported(ValueError):
    """A codec cannot serve this shape or platform; ``str(e)`` is the reason."""


@dataclass(frozen=True)
class SidecarSpec:
    """One sidecar: ``groups`` values of ``dtype`` per (token, head) vector."""

    name: str
    groups: int
    dtype: torch.dtype


class Codec(ABC):
    """Base of every storage codec. Subclasses override the four methods below."""

    name: str = "base"
    #: ``decode`` returns the stored payload itself (no arithmetic, no copy)
    lossless: bool = False
    #: orthogonal transform applied before coding (``None``: no rotation)
    rotation: object | None = None
    #: as a key codec, codes keys minus a per-(head, channel) centre (:meth:`set_centre`)
    centres_keys: bool = False
    #: the centre ``[H, D]`` float32 subtracted before coding and added back by ``decode``
    centre: torch.Tensor | None = None

    def __init__(self, head_dim: int, dtype: torch.dtype):
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
            raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.head_dim = head_dim
        self.dtype = dtype  # the dtype decode() returns

    @abstractmethod
    def packed_dim(self) -> int:
        """``D'``: payload elements per (token, head) vector."""

    @property
    @abstractmethod
    def payload_dtype(self) -> torch.dtype:
        """The payload's element type (``uint8``, ``int8``, or ``dtype`` for full precision)."""

    def sidecar_specs(self) -> tuple[SidecarSpec, ...]:
        """Name, groups per vector and dtype of each sidecar (none by default)."""
        return ()

    @abstractmethod
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``x`` ``[N, H, D]`` -> payload ``[N, H, D']``, sidecars ``{name: [N, H, G]}``."""

    @abstractmethod
    def decode(self, payload: torch.Tensor, sidecars: dict[str, torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`encode` (up to the codec's error), ``[..., H, D]`` in ``self.dtype``."""

    def decode_rotated(self, payload: torch.Tensor, sidecars: dict[str, torch.Tensor]) -> torch.Tensor:
        """Like :meth:`decode` but left in the rotated domain (equals decode without rotation)."""
        return self.decode(payload, sidecars)

    def set_centre(self, keys: torch.Tensor) -> None:
        """Fix the centre from the first keys ``[B, H, T, D]`` a cache writes: their mean per
        (head, channel) over the finite values (a NaN or inf in one row's keys must not reach
        every row's codes; a channel with none is centred on 0); zeros inside a CUDA graph
        capture (a mean taken there would be recomputed at every replay). Once set it never
        changes."""
        if self.centre is not None:
            raise ValueError(f"{self.name}: the key centre is already set; a cache codes every key against one")
        if keys.dim() != 4 or keys.shape[3] != self.head_dim:
            raise ValueError(f"{self.name}: set_centre() takes keys [B, H, T, {self.head_dim}], got "
                             f"{tuple(keys.shape)}")
        if keys.is_cuda and torch.cuda.is_current_stream_capturing():
            self.centre = torch.zeros(keys.shape[1], self.head_dim, dtype=torch.float32, device=keys.device)
        else:
            k = keys.float()
            finite = torch.isfinite(k)
            total = torch.where(finite, k, 0.0).sum(dim=(0, 2))
            self.centre = total / finite.sum(dim=(0, 2)).clamp_min(1)  # (H, D)

    def centred(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., H, D]`` minus the centre, rounded back to ``x``'s dtype (``x`` itself
        without a centre): what the codes of this codec hold."""
        if self.centre is None:
            return x
        return (x.float() - self._centre_for(x)).to(x.dtype)

    def _centre_for(self, x: torch.Tensor) -> torch.Tensor:
        c = self.centre
        if x.dim() < 2 or x.shape[-2] != c.shape[0]:
            raise ValueError(f"{self.name}: a centred codec takes [..., {c.shape[0]}, D] vectors (one centre "
                             f"per head), got {tuple(x.shape)}")
        return c.to(x.device)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))``: fake quantisation, ``[..., D]`` in ``self.dtype``."""
        return self.decode(*self.encode(x))

    def bytes_per_token_head(self) -> int:
        """Payload plus sidecar bytes of one (token, head) vector (computed once: a codec is fixed)."""
        size = self.__dict__.get("_bytes_per_token_head")
        if size is None:
            size = self.packed_dim() * torch.empty((), dtype=self.payload_dtype).element_size()
            for s in self.sidecar_specs():
                size += s.groups * torch.empty((), dtype=s.dtype).element_size()
            self._bytes_per_token_head = size
        return size

    def bits_per_element(self) -> float:
        """Stored bits per channel, sidecars included (e.g. 8.25 for ``q8`` at D=128)."""
        return 8.0 * self.bytes_per_token_head() / self.head_dim

    # -- validation (cheap: shapes and dtypes only, never a device sync) --------------
    def check_input(self, x: torch.Tensor) -> None:
        """Raise ``ValueError`` unless ``x`` is a floating tensor ``[..., head_dim]``."""
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{self.name}: encode() takes a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise ValueError(
                f"{self.name}: encode() needs a floating tensor, got {x.dtype}; cast it with "
                f".to({self.dtype})"
            )
        if x.dim() < 1 or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"{self.name}: last dim of {tuple(x.shape)} must be head_dim {self.head_dim}; "
                "build the codec for this head_dim"
            )

    def check_encoded(self, payload: torch.Tensor, sidecars: dict[str, torch.Tensor]) -> None:
        """Raise ``ValueError`` unless payload and sidecars have this codec's layout."""
        if not isinstance(payload, torch.Tensor):
            raise ValueError(f"{self.name}: payload must be a torch.Tensor, got {type(payload).__name__}")
        if payload.dtype != self.payload_dtype or payload.dim() < 1 or payload.shape[-1] != self.packed_dim():
            raise ValueError(
                f"{self.name}: payload {tuple(payload.shape)} {payload.dtype} must be "
                f"[..., {self.packed_dim()}] {self.payload_dtype}; pass what encode() returned"
            )
        specs = self.sidecar_specs()
        if set(sidecars) != {s.name for s in specs}:
            raise ValueError(
                f"{self.name}: sidecars {sorted(sidecars)} must be exactly "
                f"{sorted(s.name for s in specs)}"
            )
        lead = tuple(payload.shape[:-1])
        for s in specs:
            t = sidecars[s.name]
            if t.dtype != s.dtype or tuple(t.shape) != (*lead, s.groups):
                raise ValueError(
                    f"{self.name}: sidecar {s.name!r} {tuple(t.shape)} {t.dtype} must be "
                    f"{(*lead, s.groups)} {s.dtype} to match the payload"
                )

    # -- helpers for subclasses ------------------------------------------------------
    def _encode_blocked(self, x: torch.Tensor, encode_rows: Callable[[torch.Tensor], EncodedRows]) -> EncodedRows:
        """Validate ``x``, then run ``encode_rows`` (``[M, D]`` -> ``[M, D']``,
        ``{name: [M, G]}``) over blocks of rows and restore the leading dims."""
        self.check_input(x)
        lead = tuple(x.shape[:-1])
        rows = x.reshape(x.numel() // self.head_dim, self.head_dim)  # (M, D)
        step = max(1, ENCODE_BLOCK_ELEMENTS // self.head_dim)
        if rows.shape[0] <= step:
            payload, side = encode_rows(rows)
        else:
            payload = torch.empty(
                rows.shape[0], self.packed_dim(), dtype=self.payload_dtype, device=x.device
            )
            side = {
                s.name: torch.empty(rows.shape[0], s.groups, dtype=s.dtype, device=x.device)
                for s in self.sidecar_specs()
            }
            for start in range(0, rows.shape[0], step):
                p, sc = encode_rows(rows[start : start + step])
                payload[start : start + step] = p
                for name, t in sc.items():
                    side[name][start : start + step] = t
        payload = payload.reshape(*lead, self.packed_dim())
        return payload, {name: t.reshape(*lead, t.shape[-1]) for name, t in side.items()}

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, head_dim={self.head_dim}, "
            f"dtype={self.dtype}, bits_per_element={self.bits_per_element():g})"
        )


class IdentityCodec(Codec):
    """Full precision: the payload is the vector itself in ``dtype``."""

    name = "fp"
    lossless = True

    def packed_dim(self) -> int:
        return self.head_dim

    @property
    def payload_dtype(self) -> torch.dtype:
        return self.dtype

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        self.check_input(x)
        return x.to(self.dtype), {}

    def decode(self, payload: torch.Tensor, sidecars: dict[str, torch.Tensor]) -> torch.Tensor:
        return payload
