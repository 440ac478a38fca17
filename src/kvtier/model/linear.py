"""The model's matrix multiplications: ``F.linear``, or oneDNN's for float32 on the CPU.

PyTorch's CPU ``F.linear`` calls the BLAS it was built with (MKL). Its own oneDNN
primitive (``torch.ops.mkldnn._linear_pointwise``, what ``torch.compile`` uses for
CPU linears) takes the same plain float32 weight, no copy or repacking. On the 2-core
CPU these figures come from (AMD EPYC, AVX-512, PyTorch 2.13), SmolLM2's linears of one
forward, each weight hot in cache, took 1.49x less time for one row, 1.37x for 16 rows
and 1.31x for 512 rows (``python benchmarks/tools/cpu_linear.py``; the LM head and the
MLP's gate/up gain most, the smallest projections lose a little at one row). A whole
float32 decode step, weights streamed from memory, took 56-57 ms instead of 67-85 ms,
and a 512-token prefill 0.85-0.90 s instead of 1.05-1.11 s (``cpu_linear.py --model``).
Only the summation order differs, so results agree with ``F.linear`` to float32
rounding, not bit for bit.

:func:`linear` takes that path for float32 inputs on the CPU when nothing needs a
gradient and this PyTorch has oneDNN enabled, and ``F.linear`` otherwise. On a CPU
without AVX-512 (PyTorch's ``get_cpu_capability()`` below ``AVX512``), inputs of
:data:`BLAS_MIN_ROWS` rows or more (prefills) take ``F.linear`` too: on a 2-core AMD
EPYC Zen 3 (AVX2), SmolLM2's four projection shapes took 1.05-1.18x longer through oneDNN
from 512 rows up (0.79-0.98x at 32-256 rows), and a 2,048-token prefill of the default
model 5.0-5.3 s against transformers' 4.3 s (benchmarks/RESULTS.md, 2026-12-02).
PyTorch's own switch turns it off (``torch.backends.mkldnn.flags(enabled=False)``, or
``torch.backends.mkldnn.enabled = False``). :class:`Linear` is ``nn.Linear`` through
it; every projection of :class:`~kvtier.model.llama.Transformer` is one.

Prefills in bfloat16 (opt-in). A float32 model's forward of more than 64 tokens a row (a
prompt, a prompt chunk, the server's packed prompt chunks; not a batch of decode steps or a
verification of drafts) can multiply its linears in bfloat16 instead (:mod:`kvtier.kernels.precision`; the LM head
keeps float32: logits are what a caller reads): :func:`narrow_linear` rounds the input and the
weight to bfloat16 (packed weights are dequantised straight to it), oneDNN sums the products in
float32 (on AMX tiles where the CPU has them) and rounds the result to bfloat16, which comes
back as float32; a bias is added in float32. Select it per model (``model.prefill_dtype =
"bfloat16"``), with ``$KVTIER_PREFILL_DTYPE`` or the command line's ``--prefill-dtype``;
``float32`` (the default) keeps the exact float32 products (:func:`prefill_dtype_of`).

Example::

    >>> import torch
    >>> from kvtier.model.linear import linear
    >>> w, x = torch.randn(8, 4), torch.randn(3, 4)
    >>> torch.allclose(linear(x, w), torch.nn.functional.linear(x, w), atol=1e-5)
    True
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn
from torch.nn import functional as F

from kvtier.kernels.precision import bf16_matmuls_fast, narrow_dtype

#: this build of PyTorch has the oneDNN linear primitive
HAVE_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
#: rows from which a CPU without AVX-512 multiplies through ``F.linear`` (its BLAS)
BLAS_MIN_ROWS = 512
#: what a float32 model's prefills may multiply in: ``float32`` (exact) or ``bfloat16``
PREFILL_DTYPES = ("float32", "bfloat16")
PREFILL_ENV_VAR = "KVTIER_PREFILL_DTYPE"


def parse_prefill_dtype(value: str | torch.dtype | None, *, source: str = "prefill_dtype") -> torch.dtype:
    """``value`` (a name of :data:`PREFILL_DTYPES`, the dtype itself, ``None`` or ``""``: float32)
    as a dtype; ``ValueError`` naming it and the accepted names otherwise."""
    if isinstance(value, torch.dtype):
        name = str(value).removeprefix("torch.")
    else:
        name = (value or "float32").strip().lower()
    if name not in PREFILL_DTYPES:
        raise ValueError(f"{source}={value!r} is unknown; accepted: {', '.join(PREFILL_DTYPES)} "
                         "(bfloat16: a float32 model's prefills multiply their linears in bfloat16)")
    return getattr(torch, name)


def prefill_dtype_of(model) -> torch.dtype:
    """The prefill dtype of ``model``: its own ``prefill_dtype`` attribute when set, else
    ``$KVTIER_PREFILL_DTYPE``, else float32."""
    own = model.__dict__.get("prefill_dtype")  # (a plain attribute: no nn.Module lookup)
    if own is not None:
        return parse_prefill_dtype(own)
    return parse_prefill_dtype(os.environ.get(PREFILL_ENV_VAR), source=PREFILL_ENV_VAR)


def prefill_dtype_in_effect(model) -> torch.dtype:
    """The dtype ``model``'s prefills multiply in: bfloat16 where asked of a float32 model
    (:func:`prefill_dtype_of`), else the model's own."""
    own = model.tok_embeddings.weight.dtype
    return prefill_dtype_of(model) if own == torch.float32 else own


def prefill_narrows(model) -> bool:
    """Whether ``model``'s prefills multiply in a narrower dtype than the model computes in."""
    return prefill_dtype_in_effect(model) != model.tok_embeddings.weight.dtype


def prefill_dtype_warning(model) -> str | None:
    """Why a bfloat16 prefill asked of ``model`` (:func:`prefill_dtype_of`) will not help: a model
    that does not compute in float32 (its own dtype serves its prefills), or a CPU that multiplies
    bfloat16 in software (slower than float32); ``None`` when it will, or was not asked for."""
    if prefill_dtype_of(model) == torch.float32:
        return None
    weight = model.tok_embeddings.weight
    if weight.dtype != torch.float32:
        return (f"--prefill-dtype bfloat16 (KVTIER_PREFILL_DTYPE) has no effect on a {str(weight.dtype)[6:]} "
                "model: its prefills already compute in its own dtype")
    if weight.device.type == "cpu" and not bf16_matmuls_fast():
        return ("--prefill-dtype bfloat16 (KVTIER_PREFILL_DTYPE): this CPU has neither AMX nor AVX512-BF16, "
                "so bfloat16 products run in software, slower than float32; use float32 here")
    return None


def narrow_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """``x @ weight.T + bias`` with ``x`` and ``weight`` rounded to ``dtype`` (a no-op for those
    already in it), the result in ``x``'s dtype and ``bias`` added there."""
    out = F.linear(x.to(dtype), weight.to(dtype)).to(x.dtype)
    return out if bias is None else out.add_(bias.to(x.dtype))


@functools.cache
def has_avx512() -> bool:
    """Whether PyTorch's CPU kernels run at AVX-512 (``AVX512`` or better) on this CPU."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def onednn_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` of ``x`` and ``weight`` takes oneDNN's path."""
    return (HAVE_ONEDNN and torch.backends.mkldnn.enabled
            and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.device.type == "cpu" and not weight.is_mkldnn and x.numel() > 0
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and (x.numel() < BLAS_MIN_ROWS * x.shape[-1] or has_avx512()))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, ``x`` ``[..., K]``, ``weight`` ``[N, K]``; ``[..., N]`` (in
    :func:`prefill_matmuls`' dtype within it: :func:`narrow_linear`)."""
    low = narrow_dtype(x)  # a bfloat16 prefill (kvtier.kernels.precision)
    if low is not None:
        return narrow_linear(x, weight, bias, low)
    if onednn_applies(x, weight) and (bias is None or bias.dtype == torch.float32):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`linear` (same parameters, same state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
