"""PyTorch reference attention: the arithmetic every tier and kernel is checked against.

Positions: query ``i`` of row ``b`` sits at ``q_start[b] + i`` and sees keys
``j <= q_start[b] + i`` with ``j < kv_len[b]``. ``q_start``/``kv_len`` may be
ints (every row alike) or ``[B]`` integer tensors (ragged rows).
"""

from __future__ import annotations

import math

import torch

from kvtier.kernels import precision


def _as_rows(x: int | torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor | None:
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        x = x.to(device=device, dtype=torch.long).reshape(-1)
        return x.expand(batch) if x.numel() == 1 else x.reshape(batch)
    return torch.full((batch,), int(x), dtype=torch.long, device=device)


def causal_mask(
    batch: int,
    q_len: int,
    key_len: int,
    q_start: int | torch.Tensor,
    kv_len: int | torch.Tensor | None = None,
    *,
    key_start: int = 0,
    device: torch.device | str = "cpu",
    window: int | None = None,
) -> torch.Tensor:
    """Boolean visibility mask ``[B, 1, q_len, key_len]`` (True = visible).

    Key column ``c`` is absolute position ``key_start + c``. ``window``: a query at ``p`` sees
    only the keys after ``p - window`` (a sliding window of ``window`` keys, its own included).
    """
    device = torch.device(device)
    qs = _as_rows(q_start, batch, device)  # (B,)
    qpos = qs[:, None] + torch.arange(q_len, device=device)  # (B, T)
    kpos = key_start + torch.arange(key_len, device=device)  # (S,)
    mask = kpos[None, None, :] <= qpos[:, :, None]  # (B, T, S)
    if window is not None:
        mask = mask & (kpos[None, None, :] > qpos[:, :, None] - window)
    if kv_len is not None:
        kl = _as_rows(kv_len, batch, device)
        mask = mask & (kpos[None, None, :] < kl[:, None, None])
    return mask[:, None]  # (B, 1, T, S)


#: the widest sliding window taken: the kernels hold key positions and windows in 32 bits, and
#: no context is longer (a wider window would bind nowhere: pass ``None`` instead)
MAX_WINDOW = 2**31 - 1


def check_window(window, name: str = "window") -> None:
    """``ValueError`` unless ``window`` is ``None`` or a positive int (a sliding window's keys) of
    at most :data:`MAX_WINDOW`; ``name``: what the message calls it."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{name} must be a positive int (the keys a query sees) or None, got {window!r}")
    if window is not None and window > MAX_WINDOW:
        raise ValueError(f"{name} {window} is wider than any context (at most 2**31 - 1 keys, which the kernels "
                         f"hold in 32 bits); a window that wide binds nowhere: pass None (no window)")


def window_start(first_query: int, window: int | None) -> int:
    """The first key position that a query at ``first_query`` or later can see through a sliding
    ``window`` (0 without one): keys before it may be left out of the call."""
    return 0 if window is None else max(0, first_query - window + 1)


def zero_unseen(out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``out`` ``[B, H, T, D]`` with the queries that see no key in ``mask`` ``[B, 1, T, S]`` set
    to zero. SDPA's answer for them differs by backend (NaN on the CPU, a mean of the values
    from some CUDA kernels), and such queries are padding or empty rows."""
    return out.masked_fill(~mask.any(-1, keepdim=True), 0.0)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_start: int | torch.Tensor | None = None,
    kv_len: int | torch.Tensor | None = None,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal GQA attention ``[B, H_q, T, D]`` through PyTorch SDPA.

    ``q``: ``[B, H_q, T, D]``; ``k``/``v``: ``[B, H_kv, S, D]``. ``q_start``
    defaults to ``S - T`` (the queries are the newest positions). A boolean
    ``mask`` ``[B, 1, T, S]`` replaces the positional one when given. ``window``: each
    query sees only the ``window`` newest keys up to its own (:func:`causal_mask`). Rows
    whose queries see no key return zeros.
    """
    B, Hq, T, D = q.shape
    S, Hkv = k.shape[2], k.shape[1]
    G = Hq // Hkv
    sdpa = precision.sdpa  # (in a bfloat16 prefill, a prompt's queries in bfloat16)
    if window is not None and mask is None and (q_start is not None or kv_len is not None or window < S):
        mask = causal_mask(B, T, S, S - T if q_start is None else q_start, kv_len, device=q.device,
                           window=window)
    newest = mask is None and kv_len is None and (q_start is None or (
        not isinstance(q_start, torch.Tensor) and q_start == S - T))
    if newest and T == 1:
        # Decode: the one query sees every key; no mask lets SDPA take its fastest path.
        qg = q.reshape(B, Hkv, G, D)  # (B, H_kv, G, D): a KV head's query heads share its keys
        return sdpa(qg, k, v, scale=scale).reshape(B, Hq, 1, v.shape[3])
    if newest and T == S:
        # Prefill from empty: plain causal attention.
        return sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=G > 1)
    if newest and q.device.type == "cpu":
        # A prefill chunk over the cache's earlier keys: every query sees a key (its own), so no
        # row to zero, and the CPU's flash kernel takes the query heads and the mask as they are
        # (a 512-token chunk over 2,048 keys: 20 against 23 ms with the heads folded and the
        # unseen rows zeroed; on CUDA a mask with enable_gqa would leave the fused kernels)
        mask = causal_mask(B, T, S, S - T, device=q.device)
        return sdpa(q, k, v, attn_mask=mask, scale=scale, enable_gqa=G > 1)
    if mask is None:
        mask = causal_mask(B, T, S, S - T if q_start is None else q_start, kv_len, device=q.device)
    # The G query heads of a KV head share its keys: fold them into the query
    # axis instead of expanding K/V (no copy of the cache per call).
    qg = q.reshape(B, Hkv, G * T, D)  # (B, H_kv, G*T, D)
    mg = mask if G == 1 or mask.shape[2] == 1 else mask.repeat(1, 1, G, 1)  # (B, 1, G*T, S)
    out = zero_unseen(sdpa(qg, k, v, attn_mask=mg, scale=scale), mg)
    return out.reshape(B, Hq, T, v.shape[3])  # (B, H_q, T, D)


def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over one chunk of keys, unnormalised across chunks.

    ``q``: ``[B, H_q, T, D]``; ``k``: ``[B, H_kv, S, D]``; ``v``: ``[B, H_kv, S, Dv]``;
    ``mask``: boolean ``[B, 1, T, S]`` (True = visible) or ``None`` (all visible).
    Returns ``(out, lse)``: ``out`` ``[B, H_q, T, Dv]`` (float32) is the softmax
    average over this chunk alone and ``lse`` ``[B, H_q, T]`` its log-sum-exp
    (``-inf`` where the chunk holds no visible key). Merge chunks with
    :class:`OnlineSoftmax`.
    """
    B, Hq, T, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qf = q.float().reshape(B, Hkv, G * T, D)  # (B, H_kv, G*T, D): query heads of a group share K
    s = torch.matmul(qf, k.float().transpose(-1, -2)) * scale  # (B, H_kv, G*T, S)
    s = s.reshape(B, Hkv, G, T, -1)  # (B, H_kv, G, T, S)
    if mask is not None:
        s = s.masked_fill(~mask[:, :, None], float("-inf"))  # mask (B, 1, T, S)
    lse = torch.logsumexp(s, dim=-1)  # (B, H_kv, G, T)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    out = torch.matmul(p.reshape(B, Hkv, G * T, -1), v.float())  # (B, H_kv, G*T, Dv)
    return out.reshape(B, Hq, T, Dv), lse.reshape(B, Hq, T)


class OnlineSoftmax:
    """Log-sum-exp merge of per-chunk results from :func:`partial_attention`, one chunk at a time.

    Keeps one running ``(out, lse)`` pair, float32 ``[B, H, T, D]`` and ``[B, H, T]``, so
    memory stays at one chunk however many chunks the cache holds. After the last
    chunk they are what one chunk holding every key would give; a query that no chunk
    lets see a key gets zeros and ``lse = -inf``.
    """

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Fold in one chunk's ``(out [B, H, T, D], lse [B, H, T])`` from :func:`partial_attention`."""
        if self.out is None:
            self.out, self.lse = out, lse
            return
        # the two chunks' softmax averages, weighted by their share of the total exp-sum
        m = torch.maximum(self.lse, lse)
        m = torch.where(torch.isfinite(m), m, 0.0)  # both -inf: nothing seen yet
        wa, wb = torch.exp(self.lse - m), torch.exp(lse - m)  # (B, H, T)
        total = wa + wb
        denom = torch.where(total > 0, total, 1.0)[..., None]
        self.out = (self.out * wa[..., None] + out * wb[..., None]) / denom
        self.lse = m + torch.log(total)

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        """The merged output ``[B, H, T, D]`` in ``dtype``."""
        assert self.out is not None, "no chunk was added"
        return self.out.to(dtype)


def round_queries_int8(q: torch.Tensor) -> torch.Tensor:
    """The queries the Triton kernel scores q8 keys with, in fp32: each query row (the last
    dim) as int8 codes with the scale ``max|q| / 127``, rounded to nearest even, times the scale.

    >>> q = torch.tensor([[1.0, -0.5, 0.25, 0.0]])
    >>> round_queries_int8(q) * 127
    tensor([[127., -64.,  32.,   0.]])
    """
    qf = q.float()
    s = qf.abs().amax(-1, keepdim=True) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(qf / s) * s
