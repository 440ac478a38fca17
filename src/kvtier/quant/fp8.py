"""``fp8``: float8 e4m3 codes with one float32 scale per (token, head), as vLLM's
``kv_cache_dtype=fp8`` stores keys and values, with a scale of its own per vector.

Layout, for a vector ``x`` of ``D`` channels (one token, one kv head); arithmetic
in float32:

    payload uint8 ``[D]`` holding the e4m3 bits (``payload.view(torch.float8_e4m3fn)``),
    sidecar ``scale`` float32 ``[1]``.
    ``scale = max|x| / 448`` (448 is e4m3's largest finite value);
    ``code = e4m3(clamp(x / scale, -448, 448))``, rounded to nearest even (a zero
    vector has ``scale = 0`` and codes 0); ``x^ = float(code) * scale``.

The payload is stored as bytes, as vLLM stores its fp8 cache: every tensor
operation the paged tier runs on pages (index copies, gathers, safetensors)
works on uint8 on every device, where some have no float8 kernel on the CPU.

Why a scale per (token, head) rather than vLLM's one per tensor or per head: a
scale fixed ahead of time needs calibration data, and one chosen from the first
tokens overflows on a later outlier; a per-vector scale needs neither and costs
4 bytes per 128 channels (8.25 bits per element at D = 128, the same as ``q8``).
e4m3 keeps 3 mantissa bits at every magnitude, so small channels next to a large
one keep their relative precision, where ``q8`` gives them ``max|x| / 254`` of
absolute error.

Keys are centred. A key codec of a paged cache takes a centre ``c`` ``[H, D]`` (float32),
the mean of the first keys the cache writes per head and channel, and stores ``k - c``;
``decode`` adds ``c`` back. Attention needs no correction: every key of a row moves by
the same ``c``, which shifts every score of a query by ``q . c`` and leaves the softmax
unchanged, so the kernels read the codes as they are. Key channels carry offsets shared
by all tokens, and e4m3's 3 mantissa bits lose ``2^-4`` of each element's magnitude:
with the offsets taken out the elements are small, and so are their errors. On the
default model (``kvtier eval ppl --context 1024 --max-tokens 4096 --modes fp,fp8``, CPU)
perplexity moved from +0.80% over full precision to -0.18%, and from +0.89% to +0.36% at
``--context 2048`` (``docs/quantization.md``).
The centre is fixed once set: every block of a cache, shared or not, is coded against it.
A cache first written inside a CUDA graph capture takes a zero centre (plain fp8), since
a mean computed there would be recomputed at every replay.

The codes convert to fp16 exactly (every e4m3 value is an fp16 value): on GPUs
with native float8 conversions (compute capability 8.9 and later) the attention
kernel turns two codes into fp16 with one instruction and applies the scale to
the scores and the probabilities (``docs/gpu.md``).

Example::

    >>> import torch
    >>> codec = Fp8Codec(64, torch.bfloat16)
    >>> payload, side = codec.encode(torch.randn(5, 2, 64, dtype=torch.bfloat16))
    >>> payload.dtype, tuple(payload.shape), tuple(side["scale"].shape), codec.bits_per_element()
    (torch.uint8, (5, 2, 64), (5, 2, 1), 8.5)
    >>> payload.view(torch.float8_e4m3fn).dtype
    torch.float8_e4m3fn
"""

from __future__ import annotations

import torch

from kvtier.quant.codec import Codec, CodecUnsupported, SidecarSpec
from kvtier.quant.kv_quant import ieee_div

#: e4m3's largest finite value
FP8_MAX = 448.0
#: the float8 type of the payload, or ``None`` where this torch build has none
FP8_DTYPE: torch.dtype | None = getattr(torch, "float8_e4m3fn", None)


class Fp8Codec(Codec):
    """``fp8``: e4m3 codes ``[..., D]`` (uint8 bytes) and one float32 scale ``[..., 1]`` per vector.

    Raises :class:`CodecUnsupported` where torch has no ``float8_e4m3fn`` (the paged
    tier then stores full precision and records why).
    """

    name = "fp8"
    centres_keys = True

    def __init__(self, head_dim: int, dtype: torch.dtype):
        super().__init__(head_dim, dtype)
        if FP8_DTYPE is None:
            raise CodecUnsupported(f"fp8 needs torch.float8_e4m3fn, which torch {torch.__version__} lacks")

    def packed_dim(self) -> int:
        return self.head_dim

    @property
    def payload_dtype(self) -> torch.dtype:
        return torch.uint8  # the e4m3 bits

    def sidecar_specs(self) -> tuple[SidecarSpec, ...]:
        return (SidecarSpec("scale", 1, torch.float32),)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``x`` ``[..., D]`` float -> e4m3 bits uint8 ``[..., D]``, ``{"scale": float32 [..., 1]}``
        (of ``x - centre`` once the codec has a centre; ``x`` then ``[..., H, D]``)."""
        self.check_input(x)
        x = self.centred(x)

        def rows_fn(rows: torch.Tensor):
            amax = rows.abs().amax(-1, keepdim=True).to(torch.float32)  # (M, 1)
            scale = ieee_div(amax, FP8_MAX)
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            y = (rows / safe).clamp_(-FP8_MAX, FP8_MAX)  # (M, D) float32: the one copy
            return y.to(FP8_DTYPE).view(torch.uint8), {"scale": scale}

        return self._encode_blocked(x, rows_fn)

    def decode(self, payload: torch.Tensor, sidecars: dict[str, torch.Tensor]) -> torch.Tensor:
        """e4m3 bits uint8 ``[..., D]`` and scale ``[..., 1]`` -> ``[..., D]`` in ``self.dtype``."""
        self.check_encoded(payload, sidecars)
        x = payload.view(FP8_DTYPE).to(torch.float32) * sidecars["scale"].to(torch.float32)
        if self.centre is not None:
            x = x + self._centre_for(payload)
        return x.to(self.dtype)
