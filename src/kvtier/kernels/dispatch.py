"""One backend dispatch for every kernel: Triton or C where they serve, the PyTorch reference otherwise.

The paged read and write paths and the ragged decode path each have a Triton kernel
beside a PyTorch reference; the paged read path also has a C kernel for decode steps
on the CPU (:mod:`kvtier.kernels.cpu_attention`). A cache holds one
:class:`KernelDispatch`; the operations (:func:`kvtier.kernels.paged.paged_attention`,
:func:`~kvtier.kernels.paged.paged_write`, :func:`kvtier.kernels.ragged.ragged_attention`)
route each call through it. It

- picks the backend: ``auto`` (Triton on CUDA when the kernels import, ``cpu`` on the
  CPU), ``torch`` (always the reference), ``triton`` (always the Triton kernels; on
  the CPU they need ``TRITON_INTERPRET=1``) or ``cpu`` (the C kernel for the calls it
  covers, float32 decode steps over full-precision, ``q8`` or ``fp8`` pages, the reference
  for the rest);
- falls back to the reference for good when a kernel cannot serve (a missing module,
  a compile or launch error, a codec or shape it does not cover): one warning, and the
  reason kept per operation in ``fallback_reasons``;
- counts which backend served each call (``attention_calls``, ``write_calls``).

Example::

    >>> import torch
    >>> from kvtier.kernels.ragged import ragged_attention
    >>> dispatch = KernelDispatch("torch", name="ragged")
    >>> q, k = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 8, 16)   # (B, H, T, D)
    >>> lens = torch.tensor([8, 3])
    >>> ragged_attention(dispatch, q, k, k, lens - 1, lens).shape
    torch.Size([2, 4, 1, 16])
    >>> dict(dispatch.attention_calls)
    {'torch': 1}
"""

from __future__ import annotations

import importlib
import warnings
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

import torch

BACKENDS = ("auto", "torch", "triton", "cpu")
#: what a dispatch routes: the read path and the write path
OPERATIONS = ("attention", "write")
#: ``auto`` takes Triton on CUDA when this module (the kernels every path shares) imports
TRITON_PROBE = "kvtier.kernels.triton_paged"

T = TypeVar("T")


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The backend a call on ``device`` uses: ``"torch"``, ``"triton"`` or ``"cpu"``.

    ``"auto"`` picks Triton on CUDA when ``kvtier.kernels.triton_paged`` imports,
    ``"cpu"`` on the CPU and the PyTorch reference elsewhere; ``"triton"`` forces the
    kernels (on the CPU they need ``TRITON_INTERPRET=1``); ``"torch"`` forces the
    reference; ``"cpu"`` takes the C kernel where it covers a call.
    """
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is unknown; accepted: {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    kind = torch.device(device).type
    if kind == "cpu":
        return "cpu"
    if kind != "cuda":
        return "torch"
    try:
        importlib.import_module(TRITON_PROBE)
    except Exception:  # a missing module or a broken Triton install both mean "not here"
        return "torch"
    return "triton"


class KernelDispatch:
    """Routes each operation to Triton or the reference and books who served (module docstring).

    ``backend``: ``auto``, ``torch`` or ``triton``. ``name`` names the caller in the
    fallback warning (``"paged"``, ``"ragged"``).
    """

    def __init__(self, backend: str = "auto", *, name: str = "paged"):
        if backend not in BACKENDS:
            raise ValueError(
                f"attention_backend {backend!r} is unknown; accepted: {', '.join(BACKENDS)}"
            )
        self.backend = backend
        self.name = name
        self.fallback_reasons: dict[str, str] = {}
        self.calls: dict[str, Counter[str]] = {op: Counter() for op in OPERATIONS}
        self._resolved: dict[str, str] = {}

    @property
    def attention_calls(self) -> Counter[str]:
        """Attention calls by the backend that served them."""
        return self.calls["attention"]

    @property
    def write_calls(self) -> Counter[str]:
        """Write calls by the backend that served them."""
        return self.calls["write"]

    @property
    def fallback_reason(self) -> str | None:
        """The reason of the first fallback (any operation), or None while the kernels serve."""
        return next(iter(self.fallback_reasons.values()), None)

    def backend_for(self, op: str, device: torch.device | str) -> str:
        """The backend a call of ``op`` on ``device`` uses now: ``"torch"``, ``"triton"`` or ``"cpu"``."""
        if op in self.fallback_reasons:
            return "torch"
        key = str(device)
        if key not in self._resolved:
            self._resolved[key] = resolve_backend(self.backend, device)
        return self._resolved[key]

    def serve(
        self,
        op: str,
        device: torch.device,
        kernel: Callable[[], T] | None,
        reference: Callable[[], T],
        cpu_kernel: Callable[[], T | None] | None = None,
    ) -> T:
        """``kernel()`` when Triton serves ``op`` on ``device``, ``cpu_kernel()`` when the C
        kernel does, else ``reference()``.

        ``kernel`` is ``None`` where no Triton kernel covers the call, ``cpu_kernel``
        ``None`` where no C kernel exists, and ``cpu_kernel()`` returns ``None`` for a call
        it does not cover: the reference serves those, and that is no fallback. A kernel
        that raises sends ``op`` to the reference for good; the reference then serves this
        call too (a write rewrites every slot, so a partial kernel write is harmless).
        """
        assert op in OPERATIONS, op
        backend = self.backend_for(op, device)
        chosen = kernel if backend == "triton" else cpu_kernel if backend == "cpu" else None
        if chosen is not None:
            try:
                out = chosen()
            except Exception as e:  # compile/launch failure or unsupported: serve from the reference
                self._fall_back(op, e)
            else:
                if backend == "triton" or out is not None:  # a Triton write returns None
                    self.calls[op][backend] += 1
                    return out
        self.calls[op]["torch"] += 1
        return reference()

    def _fall_back(self, op: str, err: Exception) -> None:
        self.fallback_reasons[op] = f"{type(err).__name__}: {err}"
        warnings.warn(
            f"kvtier {self.name} {op} fell back to the PyTorch reference ({self.fallback_reasons[op]})",
            RuntimeWarning,
            stacklevel=5,  # _fall_back, serve, the operation, the cache's method: its caller
        )
