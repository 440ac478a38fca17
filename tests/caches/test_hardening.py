"""Issue 13, tiers: the edges every tier must hold the same way.

- a bad write (first or later) gets a ``ValueError`` and leaves the cache exactly as it
  was, with nothing allocated when it was empty;
- a bad query or ``scale`` gets the same ``ValueError`` in every tier, and nothing changes;
- keys that require grad are stored detached: no graph, and the inputs' graphs die;
- a second thread inside ``update``/``trim`` gets :class:`ConcurrentCacheUse`, and the
  write of the thread already inside lands whole.

The reference for contents is the list of tokens written (SDPA over it for attention).
"""

from __future__ import annotations

import copy
import gc
import threading
import weakref

import pytest
import torch

from kvtier.caches.base import CacheCapacityError, CopyTimer, RowKVCache
from kvtier.caches.block_owned import BlockOwnedKVCache
from kvtier.caches.checks import ConcurrentCacheUse
from kvtier.caches.paged import PagedKVCache
from kvtier.caches.paged_shared import SharedBlockPagedKVCache
from kvtier.caches.ragged import RaggedBatchKVCache
from kvtier.caches.tail_owned import TailOwnedKVCache
from kvtier.kernels.reference import causal_attention

B, H, HQ, D = 2, 2, 4, 16


def shared() -> SharedBlockPagedKVCache:
    """A shared-block paged cache, allocated (fp32) and bound to two empty rows of 4 blocks."""
    cache = SharedBlockPagedKVCache(block_size=4, num_blocks=8)
    cache.allocate(kv_heads=H, head_dim=D, dtype=torch.float32, device="cpu")
    cache.bind_rows([[0, 1, 2, 3], [4, 5, 6, 7]], [0, 0])
    return cache


TIERS = {
    "tail": lambda: TailOwnedKVCache(step=8),
    "block": lambda: BlockOwnedKVCache(block_size=4),
    "ragged": lambda: RaggedBatchKVCache(step=8),
    "paged": lambda: PagedKVCache(block_size=4, num_blocks=8, batch_size=B),
    "shared": shared,
}


def kv(T: int, seed: int = 0, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, T, D, generator=gen).to(dtype) for _ in range(2))


def live(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """The live K/V ``[B, H, n, D]`` of any tier (every row holding ``n`` tokens here)."""
    n = cache.size()
    K, V = cache.fetch()
    return K[:, :, :n], V[:, :, :n]


def snapshot(cache) -> tuple:
    """Everything that must not change: state tensors, meta_state, bytes, lengths, counters."""
    state = {k: v.clone() for k, v in cache.state.items()}
    counters = {k: cache.stats()[k] for k in ("updates", "bytes", "grow_events")}
    return state, copy.deepcopy(cache.meta_state), cache.nbytes, cache.size(), counters


def assert_same(a: tuple, b: tuple) -> None:
    (sa, *ra), (sb, *rb) = a, b
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    assert ra == rb


def bad_pair(mistake: str) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = kv(3, seed=7)
    return {
        "head_dim": lambda: (k, v[..., : D // 2]),
        "batch": lambda: (k, v[:1]),
        "heads": lambda: (k, v[:, :1]),
        "tokens": lambda: (k, v[:, :, :2]),
        "kv_dtype": lambda: (k, v.double()),
        "int": lambda: (k.int(), v.int()),
        "bool": lambda: (k > 0, v > 0),
        "complex": lambda: (k.to(torch.complex64), v.to(torch.complex64)),
        "float8": lambda: (k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)),
    }[mistake]()


WRITE_MISTAKES = ["head_dim", "batch", "heads", "tokens", "kv_dtype", "int", "bool", "complex",
                  "float8"]


@pytest.mark.parametrize("mistake", WRITE_MISTAKES)
@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("first", [True, False], ids=["first_write", "later_write"])
def test_a_bad_write_is_refused_and_changes_nothing(tier, mistake, first):
    cache = TIERS[tier]()
    if not first:
        cache.update(*kv(3))
    before = snapshot(cache)
    allocated = tier == "shared" or not first
    with pytest.raises(ValueError):
        cache.update(*bad_pair(mistake))
    assert_same(before, snapshot(cache))
    if not allocated:  # nothing was allocated: no buffer, no pool
        assert cache.empty() and cache.nbytes == 0
    if isinstance(cache, PagedKVCache):
        assert cache.pool.allocated == allocated and (cache.codecs is None) == (not allocated)
    cache.update(*kv(3, seed=1))  # and the cache still takes a good write
    assert cache.size() == (3 if first else 6)


@pytest.mark.parametrize("first", [True, False], ids=["first_write", "later_write"])
@pytest.mark.parametrize("tier", ["tail", "block", "ragged"])
def test_storage_the_allocator_refuses_is_a_capacity_error_and_changes_nothing(tier, first, monkeypatch):
    cache = TIERS[tier]()  # the ragged cache made without a batch size: its first write fixes it
    held = 0 if first else 3
    if not first:
        cache.update(*kv(3))
    before = snapshot(cache)
    real = {name: getattr(torch.Tensor, name) for name in ("new_empty", "new_zeros")}
    calls = []

    def refusing(name):
        def alloc(self, *size, **kw):  # the write's second buffer is refused, its first was made
            calls.append(name)
            if len(calls) > 1:
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
            return real[name](self, *size, **kw)
        return alloc

    with monkeypatch.context() as m:
        for name in real:
            m.setattr(torch.Tensor, name, refusing(name))
        with pytest.raises(CacheCapacityError, match="allocating .* failed .* the cache is unchanged"):
            cache.update(*kv(20, seed=1))
    assert_same(before, snapshot(cache))  # a refused first write leaves the batch size unknown
    cache.update(*kv(20, seed=1))  # with memory again, the same write lands whole
    assert torch.equal(live(cache)[0][:, :, held:], kv(20, seed=1)[0])


@pytest.mark.parametrize("tier", [RaggedBatchKVCache, lambda **kw: PagedKVCache(4, 8, **kw)],
                         ids=["ragged", "paged"])
def test_a_batch_past_the_bound_on_every_size_is_refused_before_any_row_is_built(tier):
    with pytest.raises(ValueError, match=r"^batch_size must be an int in \[1, 16777216\], got 16777217$"):
        tier(batch_size=2**24 + 1)  # (before: per-row lists and tensors of that many rows, or a MemoryError)


@pytest.mark.parametrize("arg", ["write_start", "new_offsets", "q_start"])
@pytest.mark.parametrize("tier", ["ragged", "paged", "shared"])
def test_a_0d_tensor_for_a_row_argument_gets_one_error_in_every_per_row_tier(tier, arg):
    cache = TIERS[tier]()
    cache.update(*kv(3))
    before = snapshot(cache)
    with pytest.raises(ValueError, match=rf"^{arg} must have shape \(2,\) \(one per row\), got \(\)$"):
        if arg == "q_start":
            cache.attention(torch.randn(B, HQ, 1, D), q_start=torch.tensor(2))
        else:  # (before, the paged tiers applied the one value to every row)
            cache.update(*kv(1, seed=1), **{arg: torch.tensor(3 if arg == "write_start" else 4)})
    assert_same(before, snapshot(cache))


@pytest.mark.parametrize("tier", list(TIERS))
def test_a_cache_written_under_inference_mode_takes_writes_outside_it(tier):
    """An inference_mode prefill, then a no_grad decode: the storage is inference tensors, which
    change in place only inside that mode, so the cache writes inside it (before: a RuntimeError
    after part of the write, the cache changed)."""
    cache = TIERS[tier]()
    with torch.inference_mode():
        cache.update(*kv(3))
    with torch.no_grad():
        cache.update(*kv(2, seed=1))
        if isinstance(cache, RowKVCache) and tier != "shared":
            cache.reserve(4)
            cache.filter([1, 0])
            cache.filter([1, 0])
        cache.trim(1)
        cache.update(*kv(1, seed=2))
    want_k, want_v = (torch.cat([a[:, :, :4], b], 2) for a, b in zip(
        (torch.cat([x, y], 2) for x, y in zip(kv(3), kv(2, seed=1))), kv(1, seed=2)))
    K, V = live(cache)
    assert torch.equal(K, want_k) and torch.equal(V, want_v)
    q = torch.randn(B, HQ, 1, D)
    torch.testing.assert_close(cache.attention(q), causal_attention(q, want_k, want_v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tier", ["tail", "block", "ragged"])
def test_storage_made_outside_inference_mode_keeps_serving_autograd(tier):
    """Only storage made under inference_mode moves a cache's writes there: a write under it into
    storage made outside, or a cache merely constructed under it, leaves the storage usable with
    autograd (queries that require grad, then backward)."""
    for built_inside in (False, True):
        with torch.inference_mode(built_inside):
            cache = TIERS[tier]()
        cache.update(*kv(2))
        with torch.inference_mode():
            cache.update(*kv(1, seed=1))  # fits: nothing allocated here
        cache.update(*kv(9, seed=2))  # grows outside inference_mode
        q = torch.randn(B, HQ, 1, D, requires_grad=True)
        cache.attention(q).sum().backward()
        assert q.grad is not None and torch.isfinite(q.grad).all()


def test_a_ragged_cache_built_under_inference_mode_takes_writes_outside_it():
    with torch.inference_mode():
        cache = RaggedBatchKVCache(step=8, keys=kv(3)[0], values=kv(3)[1])
    cache.update(*kv(1, seed=1))
    assert cache.offset.tolist() == [4, 4]
    plain = RaggedBatchKVCache(step=8)  # storage made outside; rows regrouped inside
    plain.update(*kv(3))
    with torch.inference_mode():
        plain.filter([1, 0])
        plain.extend(RaggedBatchKVCache(step=8, keys=kv(3)[0], values=kv(3)[1]))
    plain.update(torch.randn(4, H, 1, D), torch.randn(4, H, 1, D))  # before: a RuntimeError
    assert plain.offset.tolist() == [4, 4, 4, 4]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8, torch.bool, torch.complex64])
def test_shared_block_cache_refuses_a_dtype_before_allocating(dtype):
    cache = SharedBlockPagedKVCache(block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match=str(dtype)):
        cache.allocate(kv_heads=H, head_dim=D, dtype=dtype, device="cpu")
    assert not cache.pool.allocated and cache.codecs is None and cache.nbytes == 0


def queries(mistake: str) -> tuple[torch.Tensor, object]:
    q = torch.randn(B, HQ, 1, D, generator=torch.Generator().manual_seed(3))
    return {
        "float64": (q.double(), None),
        "float16": (q.half(), None),
        "int": (q.int(), None),
        "scale_str": (q, "x"),
        "scale_zero": (q, 0.0),
        "scale_negative": (q, -1.0),
        "scale_nan": (q, float("nan")),
        "scale_inf": (q, float("inf")),
        "scale_overflow": (q, 1e300),  # finite in Python, infinite in the queries' float32
        "scale_bool": (q, True),
        "scale_tensor": (q, torch.tensor(0.5)),
    }[mistake]


QUERY_MISTAKES = ["float64", "float16", "int", "scale_str", "scale_zero", "scale_negative",
                  "scale_nan", "scale_inf", "scale_overflow", "scale_bool", "scale_tensor"]


@pytest.mark.parametrize("mistake", QUERY_MISTAKES)
@pytest.mark.parametrize("tier", list(TIERS))
def test_a_bad_query_or_scale_gets_one_error_in_every_tier(tier, mistake):
    cache = TIERS[tier]()
    cache.update(*kv(3))
    before = snapshot(cache)
    q, scale = queries(mistake)
    with pytest.raises(ValueError, match="dtype" if scale is None else "scale"):
        cache.attention(q, scale=scale)
    assert_same(before, snapshot(cache))


@pytest.mark.parametrize("calls", ["fewer_queries", "after_trim"])
@pytest.mark.parametrize("tier", list(TIERS))
def test_queries_sit_at_the_newest_positions_in_every_tier(tier, calls):
    """The contract: query i sits at offset - T + i. The row tiers place a write's own queries at
    its start; other queries (fewer than it wrote, or any after a trim) at the rows' newest
    positions, as the tail and block tiers do (before: at the last write's start)."""
    cache = TIERS[tier]()
    k, v = kv(5)
    cache.update(k, v)
    n, T = (5, 1) if calls == "fewer_queries" else (3, 2)
    if calls == "after_trim":
        cache.trim(2)
    q = torch.randn(B, HQ, T, D, generator=torch.Generator().manual_seed(6))
    want = causal_attention(q, k[:, :, :n], v[:, :, :n])
    torch.testing.assert_close(cache.attention(q), want, rtol=1e-5, atol=1e-5)
    for bad in (0, n + 1):  # no query (block raised a RuntimeError), more than any row holds
        with pytest.raises(ValueError, match="no token|queries"):
            cache.attention(torch.randn(B, HQ, bad, D))


@pytest.mark.parametrize("scale", [None, 0.5, 2])
@pytest.mark.parametrize("tier", list(TIERS))
def test_a_good_scale_reaches_the_attention(tier, scale):
    cache = TIERS[tier]()
    k, v = kv(5)
    cache.update(k, v)
    q = torch.randn(B, HQ, 5, D, generator=torch.Generator().manual_seed(4))  # the 5 written
    want = causal_attention(q, k, v, scale=None if scale is None else float(scale))
    torch.testing.assert_close(cache.attention(q, scale=scale), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tier", list(TIERS))
def test_keys_that_require_grad_are_stored_detached(tier):
    cache = TIERS[tier]()
    refs, tokens = [], []
    for _ in range(12):  # update 2 tokens, trim 1: the cache grows by one token a cycle
        leaf = torch.randn(B, H, 2, D, requires_grad=True)
        k, v = leaf * 2, leaf + 1  # non-leaf inputs: they carry a graph back to ``leaf``
        refs.append(weakref.ref(leaf))
        cache.update(k, v)
        assert cache.trim(1) == 1
        tokens.append((k[:, :, :1].detach().clone(), v[:, :, :1].detach().clone()))
        del leaf, k, v
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)  # no graph kept an input alive
    for t in cache.state.values():
        assert not t.requires_grad and t.grad_fn is None
    K, V = live(cache)
    assert not K.requires_grad and K.grad_fn is None
    assert torch.equal(K, torch.cat([k for k, _ in tokens], dim=2))
    assert torch.equal(V, torch.cat([v for _, v in tokens], dim=2))


def blocked_in_update(cache, monkeypatch, k, v):
    """Start a thread whose ``cache.update(k, v)`` stops inside its copy; returns
    ``(thread, go_on, errors)``: set ``go_on`` to let it finish."""
    inside, go_on, errors = threading.Event(), threading.Event(), []
    enter = CopyTimer.__enter__

    def held_enter(timer):
        if threading.current_thread() is worker:
            inside.set()
            assert go_on.wait(30)
        return enter(timer)

    def work():
        try:
            cache.update(k, v)
        except Exception as e:  # reported to the test thread
            errors.append(e)

    monkeypatch.setattr(CopyTimer, "__enter__", held_enter)
    worker = threading.Thread(target=work)
    worker.start()
    assert inside.wait(30), errors
    return worker, go_on, errors


@pytest.mark.parametrize("tier", list(TIERS))
def test_a_second_thread_inside_a_write_gets_an_error_and_no_write_is_lost(tier, monkeypatch):
    cache = TIERS[tier]()
    k0, v0 = kv(2, seed=0)
    k1, v1 = kv(3, seed=1)
    cache.update(k0, v0)
    worker, go_on, errors = blocked_in_update(cache, monkeypatch, k1, v1)
    try:
        with pytest.raises(ConcurrentCacheUse, match="two threads"):
            cache.update(*kv(1, seed=2))
        with pytest.raises(RuntimeError, match="give each thread its own cache"):
            cache.trim(1)
        if isinstance(cache, RowKVCache):
            with pytest.raises(ConcurrentCacheUse):
                cache.set_lengths([0] * B)
    finally:
        go_on.set()
        worker.join(30)
    assert not errors
    K, V = live(cache)  # the worker's write landed whole, nothing else did
    assert torch.equal(K, torch.cat([k0, k1], dim=2)) and torch.equal(V, torch.cat([v0, v1], dim=2))
    cache.update(*kv(1, seed=3))  # the guard is released: the cache serves the next caller
    assert cache.size() == 6


def test_threads_taking_turns_share_a_cache():
    cache = TailOwnedKVCache(step=4)
    parts = [kv(1, seed=s) for s in range(4)]
    for k, v in parts:  # one thread after another: no overlap, no error
        t = threading.Thread(target=cache.update, args=(k, v))
        t.start()
        t.join()
    assert torch.equal(live(cache)[0], torch.cat([k for k, _ in parts], dim=2))
