"""save_cache/load_cache: exact round trips, and damaged files that must not load."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import kvtier.caches.persist as persist
from kvtier.caches.block_owned import BlockOwnedKVCache
from kvtier.caches.persist import load_cache, save_cache
from kvtier.caches.tail_owned import TailOwnedKVCache


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
    ],
)
def test_bad_arguments_to_save_raise_before_writing(tmp_path, caches, metadata, match):
    with pytest.raises(ValueError, match=match):
        save_cache(tmp_path / "c.safetensors", caches, metadata=metadata)
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
    save_file(tensors, str(path), metadata={**header, **changes})


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


def test_missing_file_is_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_cache(tmp_path / "nothing.safetensors")
