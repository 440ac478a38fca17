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
model 5.0-5.3 s against transformers' 4.3 s (benchmarks/RESULTS.md, 2026-12-02, sixth
session). PyTorch's
own switch turns it off (``torch.backends.mkldnn.flags(enabled=False)``, or
``torch.backends.mkldnn.enabled = False``). :class:`Linear` is ``nn.Linear`` through
it; every projection of :class:`~kvtier.model.llama.Transformer` is one.

Example::

    >>> import torch
    >>> from kvtier.model.linear import linear
    >>> w, x = torch.randn(8, 4), torch.randn(3, 4)
    >>> torch.allclose(linear(x, w), torch.nn.functional.linear(x, w), atol=1e-5)
    True
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

#: this build of PyTorch has the oneDNN linear primitive
HAVE_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
#: rows from which a CPU without AVX-512 multiplies through ``F.linear`` (its BLAS)
BLAS_MIN_ROWS = 512


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
    """``x @ weight.T + bias``, ``x`` ``[..., K]``, ``weight`` ``[N, K]``; ``[..., N]``."""
    if onednn_applies(x, weight) and (bias is None or bias.dtype == torch.float32):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`linear` (same parameters, same state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
