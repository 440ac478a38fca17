"""save_cache/load_cache: exact round trips, damaged files that must not load, and paths
that must never be replaced (directories, FIFOs, symlinks to them)."""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import kvtier.caches.persist as persist
import kvtier.caches.state_checks as state_checks
from kvtier.caches.block_owned import BlockOwnedKVCache
from kvtier.caches.paged import PagedKVCache
from kvtier.caches.persist import load_cache, save_cache
from kvtier.caches.ragged import RaggedBatchKVCache
from kvtier.caches.tail_owned import TailOwnedKVCache
from kvtier.config import TurboQuantConfig


def _layers(dtype=torch.float32):
    """Four layers of mixed tiers: written, trimmed, trimmed to nothing, never written."""
    tail = TailOwnedKVCache(step=4)
    tail.update(torch.randn(2, 2, 9, 8).to(dtype), torch.randn(2, 2, 9, 8).to(dtype))
    block = BlockOwnedKVCache(block_size=4)
    block.update(torch.randn(2, 2, 11, 8).to(dtype), torch.randn(2, 2, 11, 8).to(dtype))
    block.trim(3)
    drained = TailOwnedKVCache(step=4)
    drained.update(torch.randn(2, 2, 3, 8).to(dtype), torch.randn(2, 2, 3, 8).to(dtype))
    drained.trim(3)
    return [tail, block, drained, BlockOwnedKVCache(block_size=4)]


def _assert_same(a, b):
    assert type(a) is type(b) and a.meta_state == b.meta_state
    assert a.state.keys() == b.state.keys()
    for name in a.state:
        assert a.state[name].dtype == b.state[name].dtype
        assert torch.equal(a.state[name], b.state[name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_exact(tmp_path, seed, dtype):
    caches = _layers(dtype)
    path = tmp_path / "prompt.safetensors"
    meta = {"model": "SmolLM2-135M", "tokens": [1, 2, 3]}
    save_cache(path, caches, metadata=meta)
    loaded, got_meta = load_cache(path)
    assert got_meta == meta and len(loaded) == len(caches)
    for a, b in zip(caches, loaded):
        _assert_same(a, b)
    assert [p.name for p in tmp_path.iterdir()] == ["prompt.safetensors"]  # no temp file left


def test_loaded_caches_keep_decoding_like_the_originals(tmp_path, seed):
    caches = _layers()[:2]
    save_cache(tmp_path / "c.safetensors", caches)
    loaded, meta = load_cache(tmp_path / "c.safetensors")
    assert meta == {}
    k, v, q = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8), torch.randn(2, 4, 3, 8)
    for a, b in zip(caches, loaded):
        for x, y in zip(a.update_and_fetch(k, v), b.update_and_fetch(k, v)):
            assert torch.equal(x, y)
        assert torch.equal(a.attention(q), b.attention(q))


def test_saving_over_a_file_replaces_it(tmp_path, seed):
    path = tmp_path / "c.safetensors"
    save_cache(path, _layers())
    save_cache(path, _layers()[:1], metadata={"n": 1})
    loaded, meta = load_cache(path)
    assert len(loaded) == 1 and meta == {"n": 1}


def test_a_failed_save_leaves_the_old_file_and_no_temp(tmp_path, seed, monkeypatch):
    path = tmp_path / "c.safetensors"
    save_cache(path, _layers()[:1], metadata={"v": 1})

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(persist, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        save_cache(path, _layers())
    monkeypatch.undo()
    assert load_cache(path)[1] == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]


@pytest.mark.parametrize(
    "caches,metadata,match",
    [
        ("not a list", None, "list"),
        ([object()], None, "list"),
        ([TailOwnedKVCache()], {"bad": object()}, "JSON"),
        ([TailOwnedKVCache()], ["not", "a", "dict"], "dict"),
        (TailOwnedKVCache(), None, r"one TailOwnedKVCache; pass \[cache\]"),
    ],
)
def test_bad_arguments_to_save_raise_before_writing(tmp_path, caches, metadata, match):
    with pytest.raises(ValueError, match=match):
        save_cache(tmp_path / "c.safetensors", caches, metadata=metadata)
    assert list(tmp_path.iterdir()) == []


def test_a_file_of_something_else_is_never_overwritten(tmp_path):
    notes = tmp_path / "notes.txt"
    other = tmp_path / "weights.safetensors"  # a safetensors file, but not a cache
    notes.write_text("my notes")
    save_file({"w": torch.ones(2)}, str(other), metadata={"format": "pt"})
    before = {p: p.read_bytes() for p in (notes, other)}
    for path in before:
        with pytest.raises(ValueError, match="not a kvtier cache file; saving would overwrite it"):
            save_cache(path, [TailOwnedKVCache()])
    assert {p: p.read_bytes() for p in before} == before
    empty = tmp_path / "empty.safetensors"
    empty.touch()
    save_cache(empty, [TailOwnedKVCache()])  # an empty file holds nothing to lose
    old = tmp_path / "old.safetensors"  # a cache of another version (or damaged past its header)
    save_file({"x": torch.zeros(1)}, str(old), metadata={"format": "kvtier.cache", "format_version": "1"})
    save_cache(old, [TailOwnedKVCache()])
    assert len(load_cache(old)[0]) == 1 and len(load_cache(empty)[0]) == 1


def test_the_arguments_of_save_swapped_name_the_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for caches in ([TailOwnedKVCache()], TailOwnedKVCache()):
        with pytest.raises(ValueError, match="the path comes first"):
            save_cache(caches, "c.safetensors")
    assert list(tmp_path.iterdir()) == []


# -- damaged files -----------------------------------------------------------------


def _saved(tmp_path) -> tuple:
    path = tmp_path / "c.safetensors"
    save_cache(path, _layers(), metadata={"m": 1})
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        header = dict(f.metadata())
    return path, tensors, header


def _rewrite(path, tensors, header, **changes):
    """Write the file again with ``changes`` and a valid header checksum (a crafted file)."""
    header = {**header, **changes}
    header["header_crc"] = persist._header_crc(header)
    save_file(tensors, str(path), metadata=header)


def _expect_refusal(path, match):
    with pytest.raises(ValueError, match=match) as e:
        load_cache(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("keep", [0.3, 0.95])
def test_truncated_file(tmp_path, seed, keep):
    path, _, _ = _saved(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    _expect_refusal(path, "truncated or corrupted")


def test_flipped_byte_in_the_data(tmp_path, seed):
    path, _, _ = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    data[-7] ^= 0xFF  # inside the last tensor's bytes
    path.write_bytes(bytes(data))
    _expect_refusal(path, "checksum")


def test_not_a_kvtier_file(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    _expect_refusal(path, "not a kvtier cache file")
    (tmp_path / "text.safetensors").write_text("hello")
    _expect_refusal(tmp_path / "text.safetensors", "truncated or corrupted")


def test_other_format_version(tmp_path, seed):
    path, tensors, header = _saved(tmp_path)
    _rewrite(path, tensors, header, format_version="99")
    _expect_refusal(path, "format version 99")
    _rewrite(path, tensors, header, format_version="1")  # files of the previous layout
    _expect_refusal(path, "format version 1; .* save the cache again")


def test_bad_json_in_the_header(tmp_path, seed):
    path, tensors, header = _saved(tmp_path)
    _rewrite(path, tensors, header, layers=header["layers"][:-5])
    _expect_refusal(path, "header is damaged")


def test_missing_and_unexpected_tensors(tmp_path, seed):
    path, tensors, header = _saved(tmp_path)
    del tensors["layer1.values"]
    _rewrite(path, tensors, header)
    _expect_refusal(path, r"missing \['layer1.values'\]")
    path, tensors, header = _saved(tmp_path)
    _rewrite(path, tensors | {"layer9.keys": torch.zeros(1)}, header)
    _expect_refusal(path, r"unexpected \['layer9.keys'\]")


def test_unknown_tier(tmp_path, seed):
    path, tensors, header = _saved(tmp_path)
    layers = json.loads(header["layers"])
    layers[0]["meta_state"]["tier"] = "sliding"
    _rewrite(path, tensors, header, layers=json.dumps(layers))
    _expect_refusal(path, "unknown tier 'sliding'")


def test_meta_state_that_disagrees_with_the_tensors(tmp_path, seed):
    path, tensors, header = _saved(tmp_path)
    layers = json.loads(header["layers"])
    layers[0]["meta_state"]["offset"] = 4  # the tensors hold 9 tokens
    _rewrite(path, tensors, header, layers=json.dumps(layers))
    _expect_refusal(path, "layer 0 .*cannot be rebuilt")


def test_a_capacity_the_memory_cannot_hold_is_the_files_problem(tmp_path, monkeypatch):
    """A crafted ragged file (valid checksums) whose capacity the allocator refuses: load_cache
    raises its ValueError, not the tier's capacity error (a MemoryError)."""
    cache = RaggedBatchKVCache(batch_size=1, step=1)
    cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    path = _crafted(tmp_path, cache, capacity=60_000)  # within the bound: 1 token + 65536
    real = torch.Tensor.new_zeros

    def refuse_large(self, *size, **kw):  # as an allocator with less memory refuses it
        if size[2] > 1000:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return real(self, *size, **kw)

    monkeypatch.setattr(torch.Tensor, "new_zeros", refuse_large)
    _expect_refusal(path, "layer 0 .*cannot be rebuilt: allocating 60000 positions")


def _crafted(tmp_path, cache, **meta):
    """``cache`` saved, then its meta_state changed by ``meta`` under valid checksums (the
    CRCs are easy to recompute: a crafted file, as an audit made them)."""
    path = tmp_path / "crafted.safetensors"
    save_cache(path, [cache])
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        header = dict(f.metadata())
    layers = json.loads(header["layers"])
    layers[0]["meta_state"].update(meta)
    _rewrite(path, tensors, header, layers=json.dumps(layers))
    return path


def _seven_tokens(cache):
    cache.update(torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8))
    return cache


@pytest.fixture
def no_allocation(monkeypatch):
    """Called: from then on the tiers' buffers may not be allocated (a crafted size must be
    refused before; the old code allocated a block at a time, for minutes)."""
    def refuse(self, *size, **kw):
        raise AssertionError(f"allocated {size} for a file that should have been refused")

    def arm():
        for name in ("new_empty", "new_zeros"):
            monkeypatch.setattr(torch.Tensor, name, refuse)
    return arm


def test_blocks_past_the_slack_are_not_allocated(tmp_path, seed):
    """A crafted num_blocks=2**27 (it hung load_cache) loads with restore_slack's blocks at most."""
    path = _crafted(tmp_path, _seven_tokens(BlockOwnedKVCache(block_size=64)), num_blocks=2**27)
    (back,), _ = load_cache(path)
    assert (back.num_blocks, back.offset) == (1 + 65536 // 64, 7)


def test_a_block_cache_trimmed_far_back_round_trips_and_decodes_like_the_original(tmp_path, seed):
    """Trimmed back past restore_slack, a cache keeps its blocks; the file loads (it was refused)
    with fewer of them allocated and decodes exactly as the original, which reuses its own."""
    cache = BlockOwnedKVCache(block_size=1024)
    cache.update(torch.randn(1, 1, 70_000, 4), torch.randn(1, 1, 70_000, 4))
    cache.trim(70_000 - 10)
    save_cache(tmp_path / "c.safetensors", [cache])
    (back,), _ = load_cache(tmp_path / "c.safetensors")
    assert (cache.num_blocks, back.num_blocks, back.offset) == (69, 1 + 64, 10)
    assert torch.equal(back.state["keys"], cache.state["keys"])
    for n in (1, 66_600):  # the second passes the blocks restored: the copy appends, as allocated
        k, v, q = torch.randn(1, 1, n, 4), torch.randn(1, 1, n, 4), torch.randn(1, 2, min(n, 3), 4)
        cache.update(k, v)
        back.update(k, v)
        assert all(torch.equal(x, y) for x, y in zip(back.fetch(), cache.fetch()))
        assert torch.equal(back.attention(q), cache.attention(q))
    assert (back.num_blocks, cache.num_blocks) == (66, 69)  # one appended; the original kept its 69


@pytest.mark.parametrize("field,value,match", [
    ("block_size", 2**27, "block_size=134217728 passes the 16777216 tokens a block_size may have "
                          r"\(the state holds 7 tokens\)"),
    ("block_size", 3, "num_blocks=2 cannot hold offset=7 tokens in blocks of 3"),
])
def test_a_block_size_that_disagrees_is_refused(tmp_path, seed, no_allocation, field, value, match):
    path = _crafted(tmp_path, _seven_tokens(BlockOwnedKVCache(block_size=4)), **{field: value})
    no_allocation()
    _expect_refusal(path, f"layer 0 .*cannot be rebuilt: meta_state {match}")


def test_a_tail_step_past_the_librarys_limit_is_refused(tmp_path, seed, no_allocation):
    path = _crafted(tmp_path, _seven_tokens(TailOwnedKVCache()), step=2**27)  # was nbytes 16 GiB
    no_allocation()
    _expect_refusal(path, r"layer 0 .*cannot be rebuilt: meta_state step=134217728 passes the "
                          r"16777216 tokens a step may have \(the state holds 7 tokens\); the file is "
                          "inconsistent")


def test_a_large_tail_step_allocates_the_tokens_held_not_the_step(tmp_path, seed):
    """A step within the limits loads (a real file may have one), but its rounding is not
    allocated past restore_slack: the capacity is the tokens stored; writes go on as before."""
    cache = _seven_tokens(TailOwnedKVCache(step=2**20))
    save_cache(tmp_path / "c.safetensors", [cache])
    (back,), _ = load_cache(tmp_path / "c.safetensors")
    assert back.meta_state == cache.meta_state and back.capacity == 7
    assert back.nbytes == cache.state["keys"].nbytes * 2
    k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    for x, y in zip(back.update_and_fetch(k, v), cache.update_and_fetch(k, v)):
        assert torch.equal(x, y)
    assert back.capacity == cache.capacity == 2**20  # grown by the step, as the original was
    small = _seven_tokens(TailOwnedKVCache(step=4))  # a rounding within the slack is kept
    save_cache(tmp_path / "s.safetensors", [small])
    assert load_cache(tmp_path / "s.safetensors")[0][0].capacity == 8


def test_a_paged_block_count_that_disagrees_with_the_pages_is_refused(tmp_path, seed, no_allocation):
    fixed = _seven_tokens(PagedKVCache(block_size=4, num_blocks=4, batch_size=1))
    path = _crafted(tmp_path, fixed, num_blocks=100_000)
    no_allocation()
    _expect_refusal(path, r"meta_state num_blocks=100000 but state\['key_cache'\] holds 4 blocks; a "
                          "fixed pool's first allocation is exactly the blocks it holds; the file is "
                          "inconsistent")
    path = _crafted(tmp_path, fixed, num_blocks=3)
    no_allocation()
    _expect_refusal(path, r"num_blocks=3 but state\['key_cache'\] holds 4 blocks")
    grown = _seven_tokens(PagedKVCache(block_size=4, num_blocks=1, batch_size=1, dynamic=True))
    path = _crafted(tmp_path, grown, num_blocks=grown.pool.num_blocks + 1)
    no_allocation()
    _expect_refusal(path, f"num_blocks={grown.pool.num_blocks + 1} but .* holds {grown.pool.num_blocks} "
                          "blocks; a dynamic pool's first allocation is at most the blocks it holds")


def test_a_grown_dynamic_paged_pool_round_trips(tmp_path, seed):
    grown = _seven_tokens(PagedKVCache(block_size=4, num_blocks=1, batch_size=1, dynamic=True))
    assert grown.pool.num_blocks > grown.num_blocks  # the real file: first allocation < pool
    save_cache(tmp_path / "c.safetensors", [grown])
    (back,), _ = load_cache(tmp_path / "c.safetensors")
    _assert_same(grown, back)


def test_a_ragged_capacity_past_the_slack_is_clamped_when_not_frozen(tmp_path, seed):
    """A capacity not frozen is room the cache would grow into: a crafted 2**27 loads clamped."""
    cache = _seven_tokens(RaggedBatchKVCache(batch_size=1))
    (back,), _ = load_cache(_crafted(tmp_path, cache, capacity=2**27))
    assert (back.capacity, back.frozen, back.offset.tolist()) == (65792, False, [7])  # 7 + 65536 -> 256s
    for n in (5, 66_000):
        k, v, q = torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8), torch.randn(1, 4, 1, 8)
        cache.update(k, v)
        back.update(k, v)
        assert all(torch.equal(back.state[x], cache.state[x]) for x in cache.state)
        assert torch.equal(back.attention(q), cache.attention(q))
    assert back.capacity == cache.capacity == 66_048


def test_a_frozen_ragged_capacity_is_refused_only_past_the_limit_or_the_free_memory(
        tmp_path, seed, monkeypatch, no_allocation):
    """Frozen, the capacity is kept exactly (test_ragged: a round trip); a crafted one is refused,
    before any allocation, only past MAX_UNIT_TOKENS or where its K/V pass the free memory."""
    cache = _seven_tokens(RaggedBatchKVCache(batch_size=1))
    step = _crafted(tmp_path, cache, step=2**25, capacity=2**25).rename(tmp_path / "step.safetensors")
    big = _crafted(tmp_path, cache, frozen=True, capacity=2**27).rename(tmp_path / "big.safetensors")
    path = _crafted(tmp_path, cache, frozen=True, capacity=131_072)
    monkeypatch.setattr(state_checks, "free_bytes", lambda device: 10**6)
    no_allocation()
    _expect_refusal(step, "meta_state step=33554432 passes the 16777216 tokens a step may have; the file")
    _expect_refusal(big, r"meta_state capacity=134217728 \(frozen\) passes the 16777216 positions a "
                         r"capacity may have \(the state's keys hold 7\); the file is inconsistent")
    _expect_refusal(path, r"layer 0 .*: meta_state capacity=131072 \(frozen\) needs 16777216 bytes \(0.0 GiB\) "
                          r"of keys and values \(1 rows x 2 kv_heads x 131072 positions x 8 head_dim x 2 x 4 "
                          r"bytes\), more than the 1000000 bytes \(0.0 GiB\) free on cpu; free memory or load")


def test_missing_file_is_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_cache(tmp_path / "nothing.safetensors")


def test_deeply_nested_header_json_is_refused(tmp_path, seed):
    path, tensors, header = _saved(tmp_path)
    deep = "[" * 100_000 + "]" * 100_000  # json.loads raises RecursionError on it
    _rewrite(path, tensors, header, metadata=deep)
    _expect_refusal(path, "header is damaged")


# -- checksums cover every byte ------------------------------------------------------------


def _all_tiers():
    """One layer of each tier, a TurboQuant paged layer among them (its seed lives in the header)."""
    tail = TailOwnedKVCache(step=4)
    tail.update(torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4))
    ragged = RaggedBatchKVCache(batch_size=2, step=4)
    ragged.update(torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4), new_offsets=[3, 2])
    paged = PagedKVCache(block_size=4, num_blocks=2, batch_size=1,
                         turboquant=TurboQuantConfig(seed=7))
    paged.update(torch.randn(1, 1, 5, 64), torch.randn(1, 1, 5, 64))
    block = BlockOwnedKVCache(block_size=2)
    block.update(torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4))
    return [tail, ragged, paged, block]


def test_every_tier_round_trips(tmp_path, seed):
    caches = _all_tiers()
    save_cache(tmp_path / "c.safetensors", caches, metadata={"tokens": [5, 6, 7]})
    loaded, meta = load_cache(tmp_path / "c.safetensors")
    assert meta == {"tokens": [5, 6, 7]}
    for a, b in zip(caches, loaded):
        _assert_same(a, b)


def test_a_single_flipped_bit_anywhere_is_detected(tmp_path, seed):
    """One bit flipped in each byte of the header and in every 5th byte of the data:
    every damaged copy is refused with a ValueError, none loads."""
    path = tmp_path / "c.safetensors"
    save_cache(path, _all_tiers(), metadata={"tokens": [5, 6, 7]})
    data = path.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    positions = [*range(header_end), *range(header_end, len(data), 5)]
    for i in positions:
        damaged = bytearray(data)
        damaged[i] ^= 1 << (i % 8)
        path.write_bytes(bytes(damaged))
        with pytest.raises(ValueError):
            load_cache(path)


def _flip_in_header(path, old: bytes, new: bytes):
    data = path.read_bytes()
    assert data.count(old) == 1
    path.write_bytes(data.replace(old, new))


def test_a_flipped_turboquant_seed_or_prompt_token_is_detected(tmp_path, seed):
    path = tmp_path / "c.safetensors"
    save_cache(path, _all_tiers(), metadata={"tokens": [5, 6, 7]})
    good = path.read_bytes()
    _flip_in_header(path, b'\\"seed\\": 7', b'\\"seed\\": 6')  # one bit: '7' -> '6'
    _expect_refusal(path, "header fails its checksum")
    path.write_bytes(good)
    _flip_in_header(path, b"[5, 6, 7]", b"[5, 6, 3]")  # '7' -> '3', one bit
    _expect_refusal(path, "header fails its checksum")


# -- paths: only regular files are ever replaced ----------------------------------------------


def _special_paths(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "to_folder").symlink_to(folder)
    (tmp_path / "to_fifo").symlink_to(fifo)
    return {"folder": "directory", "fifo": r"FIFO \(named pipe\)",
            "to_folder": "directory, through a symlink",
            "to_fifo": r"FIFO \(named pipe\), through a symlink"}


def test_directories_fifos_and_symlinks_to_them_are_never_replaced(tmp_path):
    kinds = _special_paths(tmp_path)
    before = {p.name: (p.is_symlink(), p.is_dir(), p.is_fifo()) for p in tmp_path.iterdir()}
    for name, kind in kinds.items():
        with pytest.raises(ValueError, match=f"{name} is a {kind}, not a regular file"):
            save_cache(tmp_path / name, [TailOwnedKVCache()])
    after = {p.name: (p.is_symlink(), p.is_dir(), p.is_fifo()) for p in tmp_path.iterdir()}
    assert after == before and list((tmp_path / "folder").iterdir()) == []
    with pytest.raises(ValueError, match="not a regular file"):  # and never opened (a FIFO blocks)
        load_cache(tmp_path / "fifo")


def test_a_symlink_to_a_file_writes_the_file_and_stays_a_link(tmp_path, seed):
    real = tmp_path / "real.safetensors"
    save_cache(real, _layers()[:1], metadata={"v": 1})
    link = tmp_path / "link.safetensors"
    link.symlink_to(real)
    save_cache(link, _layers()[:2], metadata={"v": 2})
    assert link.is_symlink() and load_cache(real)[1] == {"v": 2}
    dangling = tmp_path / "dangling.safetensors"
    dangling.symlink_to(tmp_path / "nowhere" / "x.safetensors")
    with pytest.raises(ValueError, match="which does not exist"):
        save_cache(dangling, _layers()[:1])


def test_a_missing_folder_is_an_error_not_created(tmp_path):
    with pytest.raises(ValueError, match=r"its folder .*sub does not exist; create it first"):
        save_cache(tmp_path / "sub" / "c.safetensors", [TailOwnedKVCache()])
    assert list(tmp_path.iterdir()) == []


def test_a_killed_saves_temporary_and_lock_files_are_replaced(tmp_path, seed):
    leftover = tmp_path / ".c.safetensors.kvtier-tmp"
    leftover.write_bytes(b"half of a file from a save that was killed" * 100)
    (tmp_path / ".c.safetensors.kvtier-lock").touch()  # its lock file, no longer locked
    save_cache(tmp_path / "c.safetensors", _layers()[:1], metadata={"v": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]
    assert load_cache(tmp_path / "c.safetensors")[1] == {"v": 1}


def test_a_save_in_progress_elsewhere_is_not_overwritten(tmp_path, seed):
    path = tmp_path / "c.safetensors"
    save_cache(path, _layers()[:1], metadata={"v": 1})
    lock = tmp_path / ".c.safetensors.kvtier-lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as another process's save holds it
        with pytest.raises(ValueError, match="another process is saving"):
            save_cache(path, _layers()[:2], metadata={"v": 2})
        assert lock.exists() and load_cache(path)[1] == {"v": 1}
    finally:
        os.close(fd)
    save_cache(path, _layers()[:2], metadata={"v": 2})
    assert load_cache(path)[1] == {"v": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]


def test_a_save_that_starts_while_another_renames_gets_the_value_error(tmp_path, seed, monkeypatch):
    """A second save starts between the first's write of the temporary file and its rename.
    safetensors writes the temporary file by renaming a file of its own over it, so a lock on
    the temporary file no longer guarded it: the second save took it and the first one's
    rename failed (FileNotFoundError). Now the second gets the ValueError, the first completes."""
    path = tmp_path / "c.safetensors"
    real, seen = persist.save_file, []

    def save_then_race(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        if not seen:  # as another process would, once
            seen.append(None)
            with pytest.raises(ValueError, match=f"another process is saving to {path} right now"):
                save_cache(path, _layers()[:2], metadata={"v": "second"})

    monkeypatch.setattr(persist, "save_file", save_then_race)
    save_cache(path, _layers()[:1], metadata={"v": "first"})
    assert seen and load_cache(path)[1] == {"v": "first"}
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]


def _save_repeatedly(path: str, worker: int, saves: int, barrier, results) -> None:
    """A process's part of the race below: ``saves`` saves of a cache filled with ``worker``."""
    torch.set_num_threads(1)
    cache = TailOwnedKVCache(step=64)
    fill = torch.full((1, 2, 64, 16), float(worker))
    cache.update(fill, fill)
    outcomes: dict[str, int] = {}
    barrier.wait(timeout=30)
    for _ in range(saves):
        try:
            save_cache(path, [cache], metadata={"worker": worker})
            key = "saved"
        except ValueError as e:
            key = "ValueError" if "another process" in str(e) else f"ValueError: {e}"
        except Exception as e:  # noqa: BLE001 (the test reports whatever else escapes)
            key = f"{type(e).__name__}: {e}"
        outcomes[key] = outcomes.get(key, 0) + 1
    results.put(outcomes)


def test_two_processes_saving_to_one_path(tmp_path):
    """Two processes save to one path 20 times each, at once: every save either succeeds or
    gets the ValueError; the file left is one whole save (its data matches its metadata), and
    no temporary or lock file is left. (The race lost 16 of 60 saves to FileNotFoundError.)"""
    ctx = multiprocessing.get_context("fork")
    path, barrier, results = tmp_path / "c.safetensors", ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_save_repeatedly, args=(str(path), w, 20, barrier, results))
             for w in (1, 2)]
    for p in procs:
        p.start()
    try:
        outcomes = [results.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert all(set(o) <= {"saved", "ValueError"} for o in outcomes), outcomes
    assert sum(o.get("saved", 0) for o in outcomes) >= 1
    (cache,), meta = load_cache(path)
    assert torch.all(cache.fetch()[0] == float(meta["worker"]))
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]
