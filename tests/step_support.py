"""Batch-invariant one-call steps over fresh paged caches, shared by the tests of the CPU step
(``tests/model/test_paged_step.py``) and of the batch-invariant mode
(``tests/serve/test_batch_invariant.py``)."""

from __future__ import annotations

import platform

import torch

from kvtier.caches.paged_shared import SharedBlockPagedKVCache
from kvtier.kernels.native import build_library
from kvtier.model import step_kernels


def invariant_logits(step, args, seqs: torch.Tensor, tables: torch.Tensor, calls, storage: dict) -> dict:
    """``{(sequence, position): logits}`` of ``DecodeStep.run_paged(..., invariant=True)`` calls in
    order, each a list of ``(sequence, first, end)`` spans of ``seqs``' tokens, over fresh paged
    caches (blocks of 16 tokens, as many as ``tables`` holds, pages of ``storage``)."""
    caches = [SharedBlockPagedKVCache(16, tables.numel(), **storage) for _ in range(args.n_layers)]
    for c in caches:
        c.allocate(args.n_kv_heads, args.head_dim, torch.float32, torch.device("cpu"))
    out = {}
    with torch.inference_mode():
        for call in calls:
            keys = [(s, p) for s, lo, hi in call for p in range(lo, hi)]
            logits = step.run_paged(torch.stack([seqs[s, p] for s, p in keys]), torch.tensor([p for _, p in keys]),
                                    torch.stack([tables[s] for s, _ in keys]), caches, invariant=True)
            out |= dict(zip(keys, logits))
    return out


#: whether the narrower vector builds' x86 flags apply here
ON_X86 = platform.machine() in ("x86_64", "AMD64")


def built_step(flags) -> step_kernels.Kernels:
    """The one-call step's library built with ``flags`` after the native ones (``-mno-avx512f``:
    the AVX2 loops; ``-mno-avx2``: the plain ones)."""
    return step_kernels.Kernels(build_library("cpu_step", step_kernels.step_source(), tuple(flags)))
