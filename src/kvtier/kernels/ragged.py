"""Ragged attention: the PyTorch reference (a dense mask) and the backend dispatch.

The ragged tier keeps K/V ``[B, H_kv, S, D]`` with a length per row. Query ``i``
of row ``b`` sits at ``q_start[b] + i`` and sees keys ``j <= q_start[b] + i`` with
``j < kv_len[b]``.

- :func:`ragged_attention_reference`: a boolean mask ``[B, 1, T, S]`` and SDPA
  (:func:`kvtier.kernels.reference.causal_attention`); the reference for every shape.
- Decode (``T == 1``) on Triton: one query sees exactly the first
  ``min(kv_len, q_start + 1)`` keys of its row, so
  :func:`kvtier.kernels.triton_ragged.ragged_decode_attention_triton` serves it
  with those per-row lengths and reads nothing past them.

:class:`RaggedDispatch` picks the backend as the paged tier's dispatch does
(``auto``: Triton on CUDA, the reference elsewhere; ``torch``; ``triton``, also on
the CPU under ``TRITON_INTERPRET=1``), falls back to the reference for good when
the kernel cannot serve (one warning, the reason kept) and counts who served.

Example::

    >>> import torch
    >>> q, k = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 8, 16)   # (B, H, T, D)
    >>> lens = torch.tensor([8, 3])
    >>> out = RaggedDispatch("torch").attention(q, k, k, lens - 1, lens)
    >>> out.shape
    torch.Size([2, 4, 1, 16])
"""

from __future__ import annotations

import importlib
import warnings
from collections import Counter

import torch

from kvtier.kernels.paged import BACKENDS, resolve_backend
from kvtier.kernels.reference import causal_attention, causal_mask

TRITON_MODULE = "kvtier.kernels.triton_ragged"


def ragged_attention_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_start: torch.Tensor,
    kv_len: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention ``[B, H_q, T, D]`` of ``q`` ``[B, H_q, T, D]`` over ``keys``/``values``
    ``[B, H_kv, S, D]``; ``q_start``, ``kv_len`` integer ``[B]`` on ``q``'s device.
    Queries that see no key return zeros."""
    B, _, T, _ = q.shape
    mask = causal_mask(B, T, keys.shape[2], q_start, kv_len, device=q.device)  # (B, 1, T, S)
    return causal_attention(q, keys, values, mask=mask, scale=scale)


class RaggedDispatch:
    """Routes ragged attention to a backend and books who served (see the module docstring).

    ``attention_calls`` counts calls by the backend that served them;
    ``fallback_reason`` is why the kernel stopped serving (``None`` while it serves).
    """

    def __init__(self, backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"attention_backend {backend!r} is unknown; accepted: {', '.join(BACKENDS)}")
        self.backend = backend
        self.fallback_reason: str | None = None
        self.attention_calls: Counter[str] = Counter()
        self._resolved: dict[str, str] = {}

    def resolved(self, device: torch.device) -> str:
        """The backend a decode call on ``device`` uses now: ``"torch"`` or ``"triton"``."""
        if self.fallback_reason is not None:
            return "torch"
        key = str(device)
        if key not in self._resolved:
            self._resolved[key] = resolve_backend(self.backend, device)
        return self._resolved[key]

    def attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        q_start: torch.Tensor,
        kv_len: torch.Tensor,
        *,
        scale: float | None = None,
        decode_len: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:func:`ragged_attention_reference`'s arguments; one-token queries go to the kernel.

        ``decode_len`` (integer ``[B]``): the keys each row's single query sees, when
        the caller knows it (a planned decode step: ``kv_len``); by default
        ``min(kv_len, q_start + 1)``, computed on the device.
        """
        if q.shape[2] == 1 and self.resolved(q.device) == "triton":
            try:
                lens = decode_len
                if lens is None:
                    lens = torch.minimum(kv_len, q_start + 1).clamp_(min=0)  # (B,)
                out = importlib.import_module(TRITON_MODULE).ragged_decode_attention_triton(
                    q, keys, values, lens, scale=scale)
            except Exception as e:  # compile/launch failure or unsupported: serve from the reference
                self.fallback_reason = f"{type(e).__name__}: {e}"
                warnings.warn(f"kvtier ragged attention fell back to the PyTorch reference "
                              f"({self.fallback_reason})", RuntimeWarning, stacklevel=3)
            else:
                self.attention_calls["triton"] += 1
                return out
        self.attention_calls["torch"] += 1
        return ragged_attention_reference(q, keys, values, q_start, kv_len, scale=scale)
