"""Weights kept in their GGUF block codes on the CPU, multiplied without a float32 copy.

The default model is a Q4_1 GGUF (embedding and LM head Q8_0). Dequantised to
float32 it reads 538 MB per decoded token; kept as codes it reads 0.625 bytes per
weight (Q4_1) and 1.0625 (Q8_0), about 97 MB. Decoding on a CPU is bound by those
bytes, so the packed model decodes several times faster than the same weights in
float32, and it computes with exactly the same weights:

- :func:`recover_q4_1` / :func:`recover_q8_0` find, for a float32 weight, the codes
  and fp16 scales (and minima) of blocks of 32 along the input dimension, and
  return them only if ``code * d + m`` (``code * d``) gives back every weight bit
  for bit; otherwise ``None`` and the layer stays float32. No weight is ever
  rounded: packing is lossless or it does not happen.
- :class:`PackedLinear` multiplies a float32 input by the packed weight. For up to
  ``kernels.max_rows`` rows (decode, a speculative verification, a short prompt: 64 on
  the AVX-512 and AVX2 paths, whose kernels decode each block once for four rows at a time,
  else :data:`MAX_KERNEL_ROWS`) a small C kernel (AVX-512 or AVX2 where the CPU has them,
  plain C elsewhere) dequantises in registers and accumulates in float32, with
  the threads of PyTorch's OpenMP runtime; for more rows (prefill) it dequantises
  the weight and calls :func:`kvtier.model.linear.linear`, as the float32 model does,
  which gives its results bit for bit (in a bfloat16 prefill,
  :func:`kvtier.kernels.precision.prefill_matmuls`, the C kernel dequantises the weight straight to
  bfloat16). Decode differs from the float32 model only in
  float32 rounding (the order of its sums; AVX2's one-row q8_0 loop applies each block's scale
  once), and where the CPU has AVX512-VNNI, or AVX2 without AVX-512, one row's q4_1 products
  take the row as integer digits that hold it to float32's resolution
  (:mod:`kvtier.model.packed_digits`: integer sums, exact; the logits within float32 rounding of
  the float32 products').
- The kernels (:mod:`kvtier.model.packed_kernels`, whose names this module re-exports) are
  compiled once per machine with the system C compiler
  (:func:`kvtier.kernels.native.build_library`); where no compiler works,
  :func:`load_kernels` returns ``None`` and nothing is packed.

Example::

    >>> from kvtier.model import load_model
    >>> lm = load_model(device="cpu", dtype=torch.float32)        # doctest: +SKIP
    >>> pack_model(lm.model)   # load_model packs CPU float32 models already  # doctest: +SKIP
    {'packed': {'q4_1': 210, 'q8_0': 1}, 'float32': 0, 'bytes_before': ..., 'bytes_after': ..., 'huge_pages': ...}
"""

from __future__ import annotations

import torch
from torch import nn

from kvtier.kernels.precision import narrow_dtype
from kvtier.model.huge_pages import place_on_huge_pages
from kvtier.model.linear import linear as dense_linear
from kvtier.model.linear import narrow_linear
from kvtier.model.packed_kernels import (  # noqa: F401 (the kernels' names, as before, from here too)
    _C_SOURCE,
    GROUPED_MAX_ROWS,
    MAX_KERNEL_ROWS,
    PackedKernels,
    load_kernels,
)

BLOCK = 32  # weights per block along the input dimension (GGUF Q4_1 and Q8_0)
FORMATS = ("q4_1", "q8_0")

# -- lossless recovery of block codes ---------------------------------------------------------------
def recover_q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Codes of a float32 weight ``[N, K]`` that is exactly Q4_1 (blocks of 32 along K).

    Returns ``(codes uint8 [N, K/32, 16], d fp16 [N, K/32], m fp16 [N, K/32])`` with
    ``w[n, 32g + j] == code_j * d + m`` (low nibble of byte j: element j, high: j + 16)
    for every weight bit for bit, or ``None`` when ``w`` is not such a weight.
    """
    if w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] % BLOCK:
        return None
    blocks = w.reshape(w.shape[0], -1, BLOCK)  # (N, G, 32)
    lo, hi = torch.aminmax(blocks, dim=-1, keepdim=True)  # (N, G, 1): codes 0 and 15
    m, d = lo, ((hi - lo) / 15).half().float()
    if not (torch.isfinite(d).all() and torch.equal(m.half().float(), m)):
        return None
    q = (blocks - m).div_(torch.where(d > 0, d, 1.0)).round_()  # a constant block: codes 0
    q_lo, q_hi = torch.aminmax(q)
    if q_lo < 0 or q_hi > 15 or not torch.equal(torch.addcmul(m, q, d), blocks):
        return None
    q = q.to(torch.uint8)
    codes = q[..., :16] | (q[..., 16:] << 4)  # (N, G, 16)
    return codes.contiguous(), d[..., 0].half(), m[..., 0].half()


def recover_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Codes of a float32 weight ``[N, K]`` that is exactly Q8_0 (blocks of 32 along K).

    Returns ``(codes int8 [N, K], d fp16 [N, K/32])`` with ``w == code * d`` bit for
    bit, or ``None``.
    """
    if w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] % BLOCK:
        return None
    blocks = w.reshape(w.shape[0], -1, BLOCK)  # (N, G, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()  # the largest is +-127
    if not torch.isfinite(d).all():
        return None
    q = (blocks / torch.where(d > 0, d, 1.0)).round_()  # (N, G, 32)
    if q.abs().max() > 127 or not torch.equal(q * d, blocks):
        return None
    return q.to(torch.int8).reshape(w.shape).contiguous(), d[..., 0].half()


# -- the module -------------------------------------------------------------------------------------
class PackedLinear(nn.Module):
    """``F.linear(x, w, bias)`` with ``w`` ``[N, K]`` held as Q4_1 or Q8_0 block codes.

    Built by :meth:`from_linear`, which returns ``None`` unless the packing is exact.
    ``forward`` takes float32 ``[..., K]`` and returns float32 ``[..., N]``.
    """

    def __init__(self, fmt: str, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                 bias: torch.Tensor | None, in_features: int, kernels: PackedKernels):
        super().__init__()
        assert fmt in FORMATS, fmt
        self.fmt, self.in_features, self.out_features = fmt, in_features, codes.shape[0]
        self.kernels = kernels
        # integer parameters (no gradient) so that .to() and parameters() see them
        self.codes = nn.Parameter(codes, requires_grad=False)
        self.d = nn.Parameter(d, requires_grad=False)
        self.m = None if m is None else nn.Parameter(m, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str, kernels: PackedKernels
                    ) -> PackedLinear | None:
        """The packed twin of ``linear`` in ``fmt``, or ``None`` if its weight is not exactly that."""
        w = linear.weight.detach()
        if fmt == "q4_1":
            found = recover_q4_1(w)
            if found is None:
                return None
            codes, d, m = found
        else:
            found = recover_q8_0(w)
            if found is None:
                return None
            (codes, d), m = found, None
        return cls(fmt, codes, d, m, linear.bias, w.shape[1], kernels)

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], prefix: str, linear: nn.Linear,
                   kernels: PackedKernels) -> PackedLinear:
        """Rebuild from :func:`packed_state`'s tensors under ``prefix`` (``"layers.0.attention.wqkv."``)."""
        codes = state[prefix + "codes"]
        fmt = "q8_0" if codes.dtype == torch.int8 else "q4_1"
        return cls(fmt, codes, state[prefix + "d"], state.get(prefix + "m"), linear.bias,
                   linear.weight.shape[1], kernels)

    @property
    def weight(self) -> torch.Tensor:
        """The float32 weight ``[N, K]``, dequantised on each access (exactly the original)."""
        return self.weight_as(torch.float32)

    def weight_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``[N, K]`` in ``dtype``: the float32 weight, exactly the original, or for
        bfloat16 each of its values rounded to nearest even. On the CPU in one pass of the C kernel
        (the default model's 121 float32 weights in 0.08 s, against 0.24 s for the five passes of
        PyTorch's ops below, which serve elsewhere)."""
        if (dtype in (torch.float32, torch.bfloat16) and self.codes.device.type == "cpu"
                and self.codes.is_contiguous() and self.d.dtype == torch.float16
                and (self.m is None or self.m.dtype == torch.float16)):
            out = torch.empty(self.out_features, self.in_features, dtype=dtype)
            return self.kernels.dequant(self.fmt, self.codes, self.d.contiguous(),
                                        None if self.m is None else self.m.contiguous(), out)
        d = self.d.float()[..., None]  # (N, G, 1)
        if self.fmt == "q8_0":
            codes = self.codes.view(self.out_features, -1, BLOCK)  # (N, G, 32)
            return (codes.float() * d).reshape(self.out_features, self.in_features).to(dtype)
        lo, hi = self.codes & 15, self.codes >> 4  # (N, G, 16) each
        q = torch.cat([lo, hi], dim=-1).float()  # (N, G, 32)
        return torch.addcmul(self.m.float()[..., None], q, d).reshape(self.out_features, -1).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low = narrow_dtype(x)  # a bfloat16 prefill (kvtier.kernels.precision)
        if low is not None:
            return narrow_linear(x, self.weight_as(low), self.bias, low)
        rows = x.numel() // self.in_features
        if rows > self.kernels.max_rows or x.dtype != torch.float32 or x.device.type != "cpu":
            return dense_linear(x, self.weight, self.bias)
        x2 = x.reshape(rows, self.in_features).contiguous()  # (M, K)
        out = torch.empty(rows, self.out_features, dtype=torch.float32)  # (M, N)
        self.kernels.gemv(self.fmt, x2, self.codes, self.d, self.m, out)
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.fmt}, in_features={self.in_features}, out_features={self.out_features}"


def pack_model(model: nn.Module, kernels: PackedKernels | None = None,
               state: dict[str, torch.Tensor] | None = None, *, huge_pages: bool = True) -> dict:
    """Replace every linear of ``model`` (a :class:`~kvtier.model.llama.Transformer` on the
    CPU in float32) whose weight is exactly Q4_1 or Q8_0 by a :class:`PackedLinear`.

    ``state`` (from :func:`packed_state` of the same weights, e.g. the conversion
    cache) names the linears to pack and holds their codes, so nothing is searched.
    The embedding table stays float32 (a lookup reads one row). With ``huge_pages`` the packed
    tensors then move into one mapping backed by 2 MB pages where the system gives them
    (:func:`kvtier.model.huge_pages.place_on_huge_pages`: a decode step 10-14% faster). Returns
    counts: ``{"packed": {"q4_1": n, "q8_0": n}, "float32": n, "bytes_before", "bytes_after",
    "huge_pages"}`` (bytes of the linears' weights; bytes placed on huge pages, 0 if none).
    Without kernels (``load_kernels()`` is ``None``) nothing changes.
    """
    kernels = load_kernels() if kernels is None else kernels
    stats = {"packed": {f: 0 for f in FORMATS}, "float32": 0, "bytes_before": 0, "bytes_after": 0,
             "huge_pages": 0}
    if kernels is None:
        return stats
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for name, linear in targets:
        if linear.weight.device.type != "cpu" or linear.weight.dtype != torch.float32:
            continue
        stats["bytes_before"] += linear.weight.numel() * 4
        if state is not None:
            packed = (PackedLinear.from_state(state, f"{name}.", linear, kernels)
                      if f"{name}.codes" in state else None)
        else:
            packed = next((p for fmt in FORMATS
                           if (p := PackedLinear.from_linear(linear, fmt, kernels)) is not None),
                          None)
        if packed is None:
            stats["float32"] += 1
            stats["bytes_after"] += linear.weight.numel() * 4
            continue
        stats["packed"][packed.fmt] += 1
        stats["bytes_after"] += sum(p.numel() * p.element_size() for p in packed.parameters())
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, packed)
    if huge_pages and sum(stats["packed"].values()):
        stats["huge_pages"] = place_on_huge_pages(model)
    return stats


def packed_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The codes, scales and minima of every :class:`PackedLinear` of ``model``, by name
    (``"layers.0.attention.wqkv.codes"``, ``.d``, ``.m``); biases are not included."""
    return {f"{name}.{k}": t for name, mod in model.named_modules() if isinstance(mod, PackedLinear)
            for k, t in (("codes", mod.codes), ("d", mod.d), ("m", mod.m)) if t is not None}
