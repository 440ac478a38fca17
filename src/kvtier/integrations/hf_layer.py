"""One attention layer of a :class:`~kvtier.integrations.hf.KVTierCache`: a kvtier tier behind
transformers' ``CacheLayerMixin``.

:class:`KVTierLayer` builds its tier on the first update (``make_caches`` with the
batch size of that update) and serves both read paths of the cache: gathered K/V
for any attention implementation, or attention through the tier's own read path
(``kvtier_paged``). Its ``keys`` / ``values`` are the live tokens, read from the
tier (see :meth:`KVTierLayer.live`); ``crop`` follows ``DynamicLayer.crop``.

Shapes: keys and values ``[B, H_kv, T, D]``, queries ``[B, H_q, T, D]``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

from kvtier.caches.base import KVCache, RowKVCache, check_kv
from kvtier.caches.paged import PagedKVCache, PagedKVGrowthRefused
from kvtier.caches.step_plan import StepPlanner
from kvtier.config import KVCacheConfig, make_caches
from kvtier.integrations.hf_version import TransformersVersionError, require_transformers

require_transformers()  # before transformers' own imports, so an old version gets a clear error

try:
    from transformers.cache_utils import CacheLayerMixin
except ImportError as e:  # a 5.x release older than the layer-type API
    raise TransformersVersionError(
        f"kvtier.integrations.hf needs transformers' layer-type cache API ({e}); "
        "upgrade with: pip install -U transformers"
    ) from e

from kvtier.integrations.hf_attention import PendingKeys, dense_attention, real_new_tokens  # noqa: E402

__all__ = ["KVTierLayer", "crop_count"]


class PaddingProbe:
    """Which new tokens of one forward are real; computed once per mask and shared by the layers."""

    def __init__(self) -> None:
        self._mask: torch.Tensor | None = None
        self._key: tuple[int, int] | None = None
        self._real: torch.Tensor | None = None

    def real_tokens(self, mask: torch.Tensor | None, past: int, new: int) -> torch.Tensor | None:
        if mask is None:
            return None
        if mask is not self._mask or self._key != (past, new):
            self._mask, self._key = mask, (past, new)
            self._real = real_new_tokens(mask, past, new)
        return self._real


class DecodePlans:
    """One step plan per decode step, shared by the in-place ragged or paged layers of one cache.

    A decode step writes one token per row into every layer at the same positions,
    so the first layer books the step once (a
    :class:`~kvtier.caches.step_plan.StepPlanner`) and every layer writes and reads
    with the plan's device tensors: no per-layer host books, slots or copies to the
    device. Anything else (a prefill, a padded write, ``crop``, a row selection)
    is written unplanned and ends the plan; the next decode step plans anew.
    """

    def __init__(self, layers: Callable[[], list[KVTierLayer]]) -> None:
        self._layers = layers  # the in-place layers are fixed once a forward reaches them
        self._order: list[KVTierLayer] | None = None
        self.planner: StepPlanner | None = None
        self._kwargs: dict[str, Any] = {}
        self.planned_steps = 0

    def close(self) -> None:
        if self.planner is not None:
            self.planner.close()
        self.planner, self._kwargs = None, {}

    def kwargs(self, layer: KVTierLayer, new_tokens: int) -> dict[str, Any]:
        """The ``update`` keywords of ``layer``'s write of ``new_tokens`` real tokens per row."""
        if self._order is None:
            self._order = self._layers()
        layers = self._order
        if layer is layers[0]:  # the first layer of a forward plans the step for all
            self._kwargs = self._prepare(layers) if new_tokens == 1 else {}
            if not self._kwargs:
                self.close()
        return self._kwargs

    def _prepare(self, layers: list[KVTierLayer]) -> dict[str, Any]:
        tiers = [layer.tier for layer in layers]
        if any(not isinstance(t, RowKVCache) or t.empty() or not layer.in_place
               for t, layer in zip(tiers, layers)):
            return {}
        p = self.planner
        if p is not None and (p.plan is None or not p.plan.valid or len(p.caches) != len(tiers)
                              or any(a is not b for a, b in zip(p.caches, tiers))):
            self.close()  # a cache was changed outside the plan, or replaced
        if self.planner is None:
            view = tiers[0].block_table_view()
            ahead = 256 if view is None else view.block_size  # a pooled tier: one block at a time
            try:
                self.planner = StepPlanner(tiers, reserve_tokens=ahead)
            except ValueError:  # layers that were written differently: each books its own writes
                return {}
        self.planned_steps += 1
        return self.planner.prepare()


def crop_count(tokens_to_remove: Any, length: int) -> int:
    """How many of ``length`` tokens ``crop(tokens_to_remove)`` removes, as ``DynamicLayer.crop``.

    ``-k`` removes the ``k`` newest tokens (all of them when ``k >= length``), ``0``
    removes none; a positive value is refused with ``DynamicLayer``'s ``ValueError``
    (transformers dropped the older "keep the first ``k``" form), and so is anything
    that is not an integer (``int``, ``bool`` and integer 0-d tensors are).
    """
    try:
        n = operator.index(tokens_to_remove)
    except TypeError:
        raise ValueError(
            f"crop() takes an integer number of tokens, got {tokens_to_remove!r}; "
            "pass crop(-k) to remove the k newest tokens"
        ) from None
    if n > 0:
        raise ValueError(
            f"Calling `crop` with a positive value (`{n}`) is not supported (as in DynamicCache). "
            "Please use a negative integer to remove that number of tokens from the cache instead."
        )
    return min(-n, length)


def check_rank(keys: Any, values: Any) -> None:
    """Keys and values are 4-D ``[B, H_kv, T, D]`` (else ``check_kv``'s ``ValueError``) of one
    head size (else a ``ValueError`` naming multi-head latent attention)."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (keys, values)):
        check_kv(keys, values)  # raises its error for a non-tensor or a tensor that is not 4-D
    if keys.shape[3] != values.shape[3]:
        raise ValueError(f"this model's keys and values have different head sizes ({keys.shape[3]} "
                         f"and {values.shape[3]}, as in multi-head latent attention); kvtier's tiers "
                         "store one head size for both: use transformers' DynamicCache for this model")


def refuse_grad_in_place(keys: torch.Tensor, values: torch.Tensor) -> None:
    """``ValueError`` for keys or values that carry autograd history into the in-place read path."""
    if torch.is_grad_enabled() and (keys.requires_grad or values.requires_grad):
        raise ValueError(
            "kvtier_paged attention reads the cache in place, for inference, and got keys that "
            "require grad with autograd on; run the forward under torch.no_grad(), or use "
            "attn_implementation='sdpa' (or 'eager') to take gradients through a KVTierCache"
        )


class _StoredJoin(torch.autograd.Function):
    """``cat([past, stored], 2)`` in the forward; in the backward, the gradient of ``stored`` (the
    tier's copy of the new tokens, ``[B, H, T, D]``) goes to ``live``, the tokens the model computed.

    So a forward reads the values the tier holds (a quantised tier's included), and the
    gradient reaches the projections that made the new keys and values, as through
    ``DynamicCache``. ``past`` (tokens of earlier forwards) is a constant.
    """

    @staticmethod
    def forward(ctx, past: torch.Tensor, stored: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        ctx.split, ctx.dtype = past.shape[2], live.dtype
        return torch.cat([past, stored], dim=2)  # (B, H, S, D): a new tensor, not the tier's buffer

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, None, grad[:, :, ctx.split:].to(ctx.dtype)


class KVTierLayer(CacheLayerMixin):
    """One attention layer's keys and values, held by a kvtier tier built on the first update.

    ``length`` counts positions as transformers does (padding included); the
    tier is built by :func:`~kvtier.config.make_caches` with the batch size of
    the first update. ``keys`` / ``values`` are the live tokens read from the tier
    (:meth:`live`); they cannot be assigned: the layer changes only through
    ``update``, ``crop``, the row methods and ``reset``.
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(
        self,
        config: KVCacheConfig,
        reads_in_place: Callable[[], bool],
        probe: PaddingProbe | None = None,
        plans: DecodePlans | None = None,
    ):
        self.tier: KVCache | None = None  # before the base class sets keys/values to None
        self._heads: tuple[tuple[int, int, torch.dtype], ...] = ()  # (H, D, dtype) of K and V
        super().__init__()
        self.config = config
        self._reads_in_place = reads_in_place
        self._probe = probe or PaddingProbe()
        self._plans = plans or DecodePlans(self._alone)
        self.length = 0
        self.trimmed = 0  # tokens dropped by crop() (rejected drafts of assisted generation)
        self.in_place = False
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        # in place: positions written since the last write whose rows ended in padding (None: none)
        self._after_padding: int | None = None

    @property
    def rows(self) -> bool:
        """Whether the tier keeps a length per row (a :class:`~kvtier.caches.base.RowKVCache`)."""
        return isinstance(self.tier, RowKVCache)

    def _alone(self) -> list[KVTierLayer]:  # a method, not a lambda: copy.deepcopy rebinds it
        return [self]

    def _new_tier(self, batch_size: int) -> KVCache:
        return make_caches(1, self.config, batch_size=batch_size)[0]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        check_rank(key_states, value_states)
        self.device = key_states.device
        self.batch_size = key_states.shape[0]
        self._heads = tuple((t.shape[1], t.shape[3], t.dtype) for t in (key_states, value_states))
        self.tier = self._new_tier(self.batch_size)
        self.in_place = self._reads_in_place()
        self.is_initialized = True

    # -- writes ---------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[B, H_kv, T, D]`` keys and values; return what the attention function reads.

        Gathered path: the layer's K/V ``[B, H_kv, length, D]`` (with autograd on and new
        keys that require grad, joined so that the gradient reaches them). In place: a
        :class:`PendingKeys` and the new values (the ragged and paged tiers write at
        attention time, when the mask tells real tokens from padding). ``T = 0`` writes
        nothing and returns the layer's K/V, as ``DynamicLayer`` does.
        """
        in_place = self._reads_in_place()
        check_rank(key_states, value_states)
        self.check_update(key_states, value_states, in_place)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.in_place = in_place
        T = key_states.shape[2]
        if T == 0:
            k, v = self.live()
            (_, _, kt), (_, _, vt) = self._heads
            return k.to(kt), v.to(vt)
        if self.in_place and self.rows:
            check_kv(key_states, value_states, batch=self.batch_size)
            self._pending = (key_states, value_states)
        else:
            try:
                self.tier.update(key_states, value_states)
            except PagedKVGrowthRefused as e:
                raise self._pool_refused(e) from None
        self.length += T
        if self.in_place:
            return PendingKeys.wrap(key_states, self), value_states
        k, v = self._gathered()
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            P = self.length - T  # (B, H_kv, P + T, D): the stored past, then this update's tokens
            k = _StoredJoin.apply(k[:, :, :P], k[:, :, P:], key_states)
            v = _StoredJoin.apply(v[:, :, :P], v[:, :, P:], value_states)
        return k, v

    def check_update(self, key_states: torch.Tensor, value_states: torch.Tensor, in_place: bool) -> None:
        """The refusals of :meth:`update` that hold for every layer of a forward, before anything
        changes. The cache runs them on its first kvtier layer before a layer of transformers'
        own is written, so that a forward the kvtier layers would refuse changes no layer."""
        if self._pending is not None:
            raise ValueError(
                "a kvtier layer got a second update before its attention ran; the model's "
                "attention must be 'kvtier_paged' while the cache reads in place "
                "(call cache.reset() after changing attn_implementation)"
            )
        if in_place != self.in_place and self.length:
            raise ValueError(
                f"the model's attention implementation changed (in place: {self.in_place} -> "
                f"{in_place}) while the cache holds {self.length} tokens; call cache.reset() "
                "or use a new KVTierCache"
            )
        if in_place:
            refuse_grad_in_place(key_states, value_states)

    def undo_update(self, tokens: int) -> None:
        """Take back the last in-place ``update`` of ``tokens`` tokens, whose attention did not run
        (the attention function refused): the layer is then as before that update."""
        if self._pending is not None:  # ragged, paged: nothing reached the tier yet
            self._pending = None
        elif tokens:  # tail, block: update() stored them
            self.tier.trim(tokens)
        self.length -= tokens

    def _pool_refused(self, e: PagedKVGrowthRefused) -> PagedKVGrowthRefused:
        """A paged pool's refusal ``e`` in a KVTierCache user's terms: the ``KVCacheConfig`` fields
        (raised ``from None`` by the writes, a ``try`` each: no context manager a decode step)."""
        c = self.config
        if e.__cause__ is not None:  # the allocator refused the pool's memory
            return PagedKVGrowthRefused(
                f"allocating the paged pool of a KVTierCache layer failed ({str(e.__cause__)[:160]}); "
                f"build the cache with fewer blocks (KVCacheConfig(paged_num_blocks=...), now "
                f"{c.paged_num_blocks}) or quantised pages (KVCacheConfig(kv_quant='q8'))")
        return PagedKVGrowthRefused(
            f"the paged pool of a KVTierCache layer is full: its {c.paged_num_blocks} blocks of "
            f"{c.paged_block_size} tokens, shared by the batch's rows, hold no more and it does "
            f"not grow; build the cache with KVCacheConfig(paged_num_blocks=...) above "
            f"{c.paged_num_blocks} (ceil(tokens / paged_block_size) * batch holds a request) or "
            "KVCacheConfig(dynamic_paged=True) (from the environment: KVTIER_PAGED_NUM_BLOCKS, "
            "KVTIER_DYNAMIC_PAGED_KV=1)")

    def _fetch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tier's ``fetch()`` in the dtypes the model wrote (a tail tier with ``kv_dtype``
        stores float16 under a float32 or bfloat16 model, whose attention takes its own dtype)."""
        k, v = self.tier.fetch()
        (_, _, kt), (_, _, vt) = self._heads
        return k.to(kt), v.to(vt)

    def _gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._fetch()
        if self.rows:  # (B, H_kv, >= length, D): rows move in lock step on this path
            k, v = k[:, :, : self.length], v[:, :, : self.length]
        return k, v

    # -- the live tokens, read only ---------------------------------------------------------------
    @property
    def keys(self) -> torch.Tensor | None:
        """The live keys ``[B, H_kv, T, D]`` (``None`` before the first update); see :meth:`live`."""
        return self.live()[0]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._refuse_assignment("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        """The live values ``[B, H_kv, T, D]`` (``None`` before the first update); see :meth:`live`."""
        return self.live()[1]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._refuse_assignment("values", value)

    def _refuse_assignment(self, name: str, value: Any) -> None:
        if value is None and self.tier is None:
            return  # CacheLayerMixin.__init__ and DynamicLayer.reset clear both: nothing is held
        raise ValueError(
            f"KVTierLayer.{name} is read from the layer's tier and cannot be assigned (got "
            f"{type(value).__name__}); write with cache.update(keys, values, layer_idx), drop tokens "
            "with cache.crop(-k), rows with cache.batch_select_indices(...), or start over with "
            "cache.reset()"
        )

    def live(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The tokens the tier holds, as ``DynamicLayer.keys`` / ``.values`` hold them: ``[B, H_kv, T, D]``.

        ``(None, None)`` before the first update (and after ``reset``). The tier's own
        dtype and device; a quantised paged tier gives its dequantised values. Views
        of the storage where the tier has one contiguous buffer (tail; ragged when every
        row has the same length; block while one block holds the tokens); a gathered
        copy otherwise (block over several blocks, paged). Read them, never write into
        them: a write into a view changes the cache behind the tier's books (and a
        quantised tier's pages not at all); :meth:`update` and ``crop`` are the way to
        change the layer.

        ``T`` is the layer's length, padding positions included, on the gathered read
        path and for the scalar tiers (tail, block). In place, the ragged and paged tiers
        store only each row's real tokens: ``T`` is then the longest row, row ``r``'s
        tokens are ``[:, :, :lengths[r]]`` and zeros follow them (``tier.lengths`` gives
        the lengths), and the new tokens of a forward reach the tier when its attention
        runs, not at ``update``.
        """
        if self.tier is None:
            return None, None
        if self.tier.size() == 0:  # nothing written yet, or everything cropped
            B = self.batch_size
            return tuple(torch.empty(B, H, 0, D, dtype=dt, device=self.device) for H, D, dt in self._heads)
        k, v = self.tier.fetch()
        if not self.rows:
            return k, v
        lengths = self.tier.lengths
        n = max(lengths)
        k, v = k[:, :, :n], v[:, :, :n]  # (B, H_kv, n, D): views of a ragged buffer, a paged gather
        if min(lengths) < n:
            short = torch.arange(n, device=k.device) >= torch.tensor(lengths, device=k.device)[:, None]
            k, v = k.masked_fill(short[:, None, :, None], 0), v.masked_fill(short[:, None, :, None], 0)
        return k, v

    # -- in-place attention ---------------------------------------------------------------------
    def attend(
        self,
        query: torch.Tensor,
        mask: torch.Tensor | None,
        *,
        scaling: float | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention ``[B, H_q, T, D]`` of ``query`` ``[B, H_q, T, D]`` through the tier's read path.

        ``mask`` is transformers' boolean ``[B, 1, T, length]`` mask or ``None``
        (plain causal). Without padding among the new tokens and without a
        softcap, the tier's own ``attention`` reads its storage in place; a padded
        prefill or a softcap model reads a gathered copy of the layer once.
        """
        if self._pending is None:  # scalar tiers stored the tokens in update()
            if mask is None and softcap is None:
                return self.tier.attention(query, scale=scaling)
            k, v = self._fetch()
            return dense_attention(query, k, v, mask, scaling=scaling, softcap=softcap)
        keys, values = self._pending
        self._pending = None
        T = keys.shape[2]
        try:
            real = self._probe.real_tokens(mask, self.length - T, T)
            if real is None:
                self.tier.update(keys, values, **self._plans.kwargs(self, T))
            else:
                self._plans.kwargs(self, 0)  # an unplanned write: the plan ends
                pos = self._write_real(keys, values, real)
        except Exception as e:
            self.length -= T  # nothing reached the tier (it validates before it writes)
            if isinstance(e, PagedKVGrowthRefused):
                raise self._pool_refused(e) from None
            raise
        if real is not None and not bool(real[:, -1].all()):  # some row ends in padding
            self._after_padding = 0
        elif self._after_padding is not None:
            self._after_padding += T
        if real is None:
            if softcap is None:
                return self.tier.attention(query, scale=scaling)
            pos = self.tier.offset[:, None] - T + torch.arange(T, device=keys.device)
        k, v = self._fetch()  # (B, H_kv, max row length, D)
        visible = torch.arange(k.shape[2], device=k.device) <= pos[:, :, None]  # (B, T, S)
        return dense_attention(query, k, v, visible[:, None], scaling=scaling, softcap=softcap)

    def _write_real(self, keys: torch.Tensor, values: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Store only the real new tokens of each row; return each query's last visible position.

        ``real`` is ``[B, T]``. Row ``r``'s real tokens are written in order at its
        own length; a real query sees up to itself, a padding query up to the real
        token before it (what transformers' padding mask shows it).
        """
        real = real.to(keys.device)
        # (B,) on the tokens' device; a clone, since the ragged tier updates its offsets in place
        start = self.tier.offset.to(keys.device).clone()
        order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)  # real tokens first
        idx = order[:, None, :, None]  # (B, 1, T, 1)
        k = keys.gather(2, idx.expand(-1, keys.shape[1], -1, keys.shape[3]))
        v = values.gather(2, idx.expand(-1, values.shape[1], -1, values.shape[3]))
        self.tier.update(k, v, write_start=start, new_offsets=start + real.sum(1))
        return start[:, None] + real.cumsum(1) - 1  # (B, T)

    # -- lengths --------------------------------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        """The positions each row can reach where the tier has a fixed size: a paged pool that does
        not grow, shared by the batch's rows growing together (its whole size for one row before
        the first update); ``-1`` (no maximum) for the other tiers and a growing pool."""
        tier = self.tier
        if tier is None:
            fixed = self.config.tier == "paged" and not self.config.dynamic_paged
            return self.config.paged_num_blocks * self.config.paged_block_size if fixed else -1
        if not isinstance(tier, PagedKVCache) or (tier.dynamic and not tier.frozen):
            return -1
        blocks = tier.pool.num_blocks if tier.pool.allocated else tier.num_blocks
        return blocks // tier.batch_size * tier.block_size

    def crop_count(self, tokens_to_remove: int) -> int:
        """How many tokens ``crop(tokens_to_remove)`` removes here, or its ``ValueError``
        (checked by the cache on every layer before any layer crops)."""
        n = crop_count(tokens_to_remove, self.length)
        if self._after_padding is not None and n > self._after_padding:
            raise ValueError(
                f"crop({tokens_to_remove}) reaches back into a write whose rows ended in padding (right "
                f"padding); in place the rows hold their real tokens only, so it would remove real ones: "
                f"crop at most {self._after_padding} here, or pad on the left")
        return n

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the ``k`` newest tokens with ``crop(-k)`` (all of them if ``k`` >= the length);
        ``crop(0)`` does nothing; a positive value raises ``ValueError``, as in ``DynamicLayer``."""
        n = self.crop_count(tokens_to_remove)
        if self._after_padding is not None:
            self._after_padding -= n
        if n and self.tier is not None:
            self.tier.trim(n)
            self.length -= n
            self.trimmed += n

    def reset(self) -> None:
        self.tier, self.length, self._pending, self._after_padding = None, 0, None, None
        self.is_initialized = False
        # Cache.batch_size reads the layers that have one: a reset layer has none (as DynamicLayer),
        # so the next update may bring another batch size
        vars(self).pop("batch_size", None)

    # -- rows -------------------------------------------------------------------------------------
    def _select_rows(self, rows: torch.Tensor) -> None:
        """Keep rows ``rows`` (int64 ``[B']``, repeats allowed) in that order."""
        if self.tier is None:
            return
        picked = rows.tolist()
        assert picked, "checked by rows_kept()"
        if self.rows and len(set(picked)) == len(picked) and self.length:
            self.tier.filter(picked)
        elif self.length == 0:
            self.tier = self._new_tier(len(picked))
        else:
            k, v = self._fetch()
            rows = rows.to(k.device)
            tier = self._new_tier(len(picked))
            try:
                if self.rows:
                    lengths = self.tier.offset.index_select(0, rows)
                    n = int(lengths.max())
                    tier.update(k[rows, :, :n], v[rows, :, :n], write_start=0, new_offsets=lengths)
                else:
                    tier.update(k[rows], v[rows])
            except PagedKVGrowthRefused as e:  # more rows than the pool holds
                raise self._pool_refused(e) from None
            self.tier = tier
        self.batch_size = len(picked)

    def rows_kept(self, call: str, indices: Any = None, repeats: int = 1) -> torch.Tensor | None:
        """The rows that ``call`` (a row method, of ``indices`` or ``repeats``) keeps, int64 ``[B']``
        (``None`` before the first update), or a ``ValueError`` where it would keep none: a tier
        holds at least one row."""
        if self.tier is None:
            return None
        rows = torch.arange(self.batch_size)
        rows = rows.repeat_interleave(repeats) if indices is None else rows[torch.as_tensor(indices).cpu()]
        if rows.numel() == 0:
            arg = repeats if indices is None else indices
            raise ValueError(
                f"{call}({arg!r}) keeps none of the cache's {self.batch_size} rows; a KVTierCache holds at least "
                "one row (its tiers are built for a batch): to drop every row, call cache.reset(), "
                "after which the next update may bring a batch of any size"
            )
        return rows.reshape(-1)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        rows = self.rows_kept("reorder_cache", beam_idx)
        if rows is not None:
            self._select_rows(rows)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        rows = self.rows_kept("batch_select_indices", indices)
        if rows is not None:
            self._select_rows(rows)

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = self.rows_kept("batch_repeat_interleave", repeats=repeats)
        if rows is not None:
            self._select_rows(rows)

    # -- figures --------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return 0 if self.tier is None else self.tier.nbytes

    def stats(self) -> dict[str, Any]:
        if self.tier is None:
            return {"tier": self.config.tier, "initialized": False}
        return {**self.tier.stats(), "hf_length": self.length, "in_place": self.in_place,
                "trimmed": self.trimmed}
