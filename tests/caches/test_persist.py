"""save_cache/load_cache: exact round trips, damaged files that must not load, and paths
that must never be replaced (directories, FIFOs, symlinks to them)."""

from __future__ import annotations

import fcntl
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import kvtier.caches.persist as persist
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
    path = tmp_path / "r.safetensors"
    cache = RaggedBatchKVCache(batch_size=1, step=1)
    cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    save_cache(path, [cache])
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        header = dict(f.metadata())
    layers = json.loads(header["layers"])
    layers[0]["meta_state"]["capacity"] = 2**31 - 1
    _rewrite(path, tensors, header, layers=json.dumps(layers))
    real = torch.Tensor.new_zeros

    def refuse_large(self, *size, **kw):  # as the allocator refuses 2**31 positions
        if size[2] > 1000:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return real(self, *size, **kw)

    monkeypatch.setattr(torch.Tensor, "new_zeros", refuse_large)
    _expect_refusal(path, "layer 0 .*cannot be rebuilt: allocating 2147483647 positions")


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


def test_a_killed_saves_temporary_file_is_reused(tmp_path, seed):
    leftover = tmp_path / ".c.safetensors.kvtier-tmp"
    leftover.write_bytes(b"half of a file from a save that was killed" * 100)
    save_cache(tmp_path / "c.safetensors", _layers()[:1], metadata={"v": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]
    assert load_cache(tmp_path / "c.safetensors")[1] == {"v": 1}


def test_a_save_in_progress_elsewhere_is_not_overwritten(tmp_path, seed):
    path = tmp_path / "c.safetensors"
    save_cache(path, _layers()[:1], metadata={"v": 1})
    tmp = tmp_path / ".c.safetensors.kvtier-tmp"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as another process's save holds it
        with pytest.raises(ValueError, match="another process is saving"):
            save_cache(path, _layers()[:2], metadata={"v": 2})
        assert tmp.exists() and load_cache(path)[1] == {"v": 1}
    finally:
        os.close(fd)
    save_cache(path, _layers()[:2], metadata={"v": 2})
    assert load_cache(path)[1] == {"v": 2} and not tmp.exists()
