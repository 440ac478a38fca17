"""The ``kvtier_paged`` attention function for ``transformers``: attention read from kvtier tiers in place.

A model whose ``config._attn_implementation`` is ``"kvtier_paged"`` calls
:func:`kvtier_attention_forward` instead of SDPA. When the keys it receives come
from a :class:`~kvtier.integrations.hf.KVTierCache` layer that reads in place
(they are then a :class:`PendingKeys`), the layer computes attention through its
tier's own read path (``PagedKVCache.attention``: page by page, dequantising in
chunks; ``RaggedBatchKVCache.attention``: per-row lengths); nothing gathers the
history into one contiguous copy. Any other keys (transformers' own sliding-window
layers, a ``DynamicCache`` of an assistant model) get SDPA, or eager arithmetic
when the model uses a logit softcap, with the mask transformers built.

The masks are those of ``sdpa``: ``None`` for a plain causal pattern, else a
boolean ``[B, 1, T, S]`` tensor (True = visible).

Shapes: ``query`` ``[B, H_q, T, D]``, ``key``/``value`` ``[B, H_kv, S, D]``; the
function returns ``([B, T, H_q, D], None)`` as transformers expects.
"""

from __future__ import annotations

import torch

from kvtier.integrations.hf_version import require_transformers
from kvtier.kernels.reference import causal_attention

require_transformers()  # before transformers' own imports, so an old version gets a clear error

from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402
from transformers.modeling_utils import AttentionInterface  # noqa: E402

#: the name to pass as ``attn_implementation`` (``from_pretrained`` or ``set_attn_implementation``)
ATTENTION_NAME = "kvtier_paged"


class PendingKeys(torch.Tensor):
    """The new keys ``[B, H_kv, T, D]`` of one forward, tagged with the layer that attends to them.

    A kvtier layer that reads in place returns this instead of gathered keys;
    :func:`kvtier_attention_forward` recognises it by type and hands the queries
    to ``keys.layer.attend(...)``. It shares storage with the keys it wraps.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl  # ops on it give plain tensors

    @staticmethod
    def wrap(keys: torch.Tensor, layer) -> PendingKeys:
        tagged = torch.Tensor._make_subclass(PendingKeys, keys.detach())
        tagged.layer = layer
        return tagged


def kvtier_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: ``query`` ``[B, H_q, T, D]`` -> ``([B, T, H_q, D], None)``.

    ``key``/``value`` are either a :class:`PendingKeys` from a kvtier layer (the
    layer attends in place) or ordinary ``[B, H_kv, S, D]`` tensors (SDPA, or
    eager arithmetic when ``softcap`` is set). ``attention_mask`` is ``None`` or
    boolean ``[B, 1, T, S]``.
    """
    softcap = kwargs.get("softcap")
    refusal = refused(module, key, attention_mask, dropout, kwargs.get("s_aux"))
    if refusal is not None:
        if isinstance(key, PendingKeys):  # take back the layer's update: the cache is as before it
            key.layer.undo_update(key.shape[2])
        raise ValueError(refusal)
    if isinstance(key, PendingKeys):
        out = key.layer.attend(query, attention_mask, scaling=scaling, softcap=softcap)
    elif softcap is not None:
        out = dense_attention(query, key, value, attention_mask, scaling=scaling, softcap=softcap)
    else:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    return out.transpose(1, 2).contiguous(), None  # (B, T, H_q, D)


def refused(module: torch.nn.Module, key: torch.Tensor, mask: torch.Tensor | None, dropout: float,
            s_aux: torch.Tensor | None) -> str | None:
    """Why :func:`kvtier_attention_forward` refuses this call (``None``: it does not)."""
    if dropout and module.training:
        return (f"kvtier_paged attention is for inference and got dropout={dropout} in training mode; "
                "call model.eval() or use attn_implementation='sdpa' for training")
    if s_aux is not None:
        return ("kvtier_paged attention does not support attention sinks (s_aux); "
                "use attn_implementation='eager' for this model")
    if isinstance(key, PendingKeys) and mask is not None and mask.dtype != torch.bool:
        return (f"kvtier attention takes boolean masks (True = visible), got {mask.dtype}; "
                "build the model's masks with attn_implementation='kvtier_paged' (sdpa-style masks)")
    return None


def dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention ``[B, H_q, T, D]`` over contiguous ``key``/``value`` ``[B, H_kv, S, D]``.

    ``mask``: boolean ``[B, 1, T, S]`` (True = visible), or ``None`` for causal
    attention of the ``T`` newest positions. Without ``softcap`` this is PyTorch
    SDPA (a query that sees nothing gets zeros, as SDPA gives); with it, the eager
    arithmetic of transformers' Gemma-2 (``tanh(s / softcap) * softcap`` before the
    softmax, float32 softmax).
    """
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(
            f"kvtier attention takes boolean masks (True = visible), got {mask.dtype}; "
            "build the model's masks with attn_implementation='kvtier_paged' (sdpa-style masks)"
        )
    if softcap is None:
        return causal_attention(query, key, value, scale=scaling, mask=mask)
    B, Hq, T, D = query.shape
    S = key.shape[2]
    groups = Hq // key.shape[1]
    k = key.repeat_interleave(groups, dim=1) if groups > 1 else key  # (B, H_q, S, D)
    v = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    scale = D**-0.5 if scaling is None else scaling
    w = torch.matmul(query, k.transpose(2, 3)) * scale  # (B, H_q, T, S)
    w = torch.tanh(w / softcap) * softcap
    if mask is None:
        mask = torch.ones(T, S, dtype=torch.bool, device=query.device).tril(S - T)[None, None]
    w = w.masked_fill(~mask, torch.finfo(w.dtype).min)
    p = torch.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(p, v)


def real_new_tokens(mask: torch.Tensor | None, past: int, new: int) -> torch.Tensor | None:
    """Which of the ``new`` tokens at key columns ``[past, past + new)`` are real, not padding.

    ``mask`` is the boolean ``[B, 1, T, S]`` mask transformers built; a padding
    key is visible to no query, a real key at least to its own query. Returns
    ``None`` when every new token is real (the common case), else a boolean
    ``[B, new]``.
    """
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        raise ValueError(
            f"kvtier attention takes boolean masks (True = visible), got {mask.dtype}; "
            "build the model's masks with attn_implementation='kvtier_paged'"
        )
    if mask.shape[-1] < past + new:
        raise ValueError(
            f"the attention mask covers {mask.shape[-1]} key positions but the cache holds "
            f"{past + new}; pass the full 2-D attention_mask (past and new tokens) to the model"
        )
    real = mask[:, 0, :, past : past + new].any(dim=1)  # (B, new)
    return None if bool(real.all()) else real


def register_attention() -> str:
    """Register :func:`kvtier_attention_forward` and sdpa-style masks under :data:`ATTENTION_NAME`.

    Idempotent; importing :mod:`kvtier.integrations.hf` calls it. Returns the name.
    """
    AttentionInterface.register(ATTENTION_NAME, kvtier_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME
