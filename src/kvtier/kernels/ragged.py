"""Ragged attention: the PyTorch reference (a dense mask), and the same through the dispatch.

The ragged tier keeps K/V ``[B, H_kv, S, D]`` with a length per row. Query ``i``
of row ``b`` sits at ``q_start[b] + i`` and sees keys ``j <= q_start[b] + i`` with
``j < kv_len[b]``.

- :func:`ragged_attention_reference`: a boolean mask ``[B, 1, T, S]`` and SDPA
  (:func:`kvtier.kernels.reference.causal_attention`); the reference for every shape.
- :func:`ragged_attention`: the same through a cache's
  :class:`~kvtier.kernels.dispatch.KernelDispatch` (the one the paged tier uses). Decode
  (``T == 1``) on Triton: one query sees exactly the first ``min(kv_len, q_start + 1)``
  keys of its row, so
  :func:`kvtier.kernels.triton_ragged.ragged_decode_attention_triton` serves it
  with those per-row lengths and reads nothing past them; longer queries go to the
  reference.

Example::

    >>> import torch
    >>> from kvtier.kernels.dispatch import KernelDispatch
    >>> q, k = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 8, 16)   # (B, H, T, D)
    >>> lens = torch.tensor([8, 3])
    >>> out = ragged_attention(KernelDispatch("torch", name="ragged"), q, k, k, lens - 1, lens)
    >>> out.shape
    torch.Size([2, 4, 1, 16])
"""

from __future__ import annotations

import importlib

import torch

from kvtier.kernels.dispatch import KernelDispatch
from kvtier.kernels.reference import causal_attention, causal_mask, check_window

TRITON_MODULE = "kvtier.kernels.triton_ragged"


def ragged_attention_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_start: torch.Tensor,
    kv_len: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention ``[B, H_q, T, D]`` of ``q`` ``[B, H_q, T, D]`` over ``keys``/``values``
    ``[B, H_kv, S, D]``; ``q_start``, ``kv_len`` integer ``[B]`` on ``q``'s device.
    ``window``: each query sees only the ``window`` newest keys up to its own. Queries that
    see no key return zeros."""
    B, _, T, _ = q.shape
    mask = causal_mask(B, T, keys.shape[2], q_start, kv_len, device=q.device, window=window)  # (B, 1, T, S)
    return causal_attention(q, keys, values, mask=mask, scale=scale)


def ragged_attention(
    dispatch: KernelDispatch,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_start: torch.Tensor,
    kv_len: torch.Tensor,
    *,
    scale: float | None = None,
    decode_len: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """:func:`ragged_attention_reference` through ``dispatch``; one-token queries go to the kernel
    (a sliding ``window`` included).

    ``decode_len`` (integer ``[B]``): the keys each row's single query sees, when
    the caller knows it (a planned decode step: ``kv_len``); by default
    ``min(kv_len, q_start + 1)``, computed on the device.
    """

    check_window(window)

    def decode_kernel() -> torch.Tensor:
        lens = decode_len
        if lens is None:
            lens = torch.minimum(kv_len, q_start + 1).clamp_(min=0)  # (B,)
        return importlib.import_module(TRITON_MODULE).ragged_decode_attention_triton(
            q, keys, values, lens, scale=scale, **({} if window is None else dict(window=window, q_start=q_start)))

    return dispatch.serve(
        "attention", q.device,
        decode_kernel if q.shape[2] == 1 else None,
        lambda: ragged_attention_reference(q, keys, values, q_start, kv_len, scale=scale, window=window),
    )

