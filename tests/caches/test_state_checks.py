"""from_state of every tier refuses a damaged or crafted state with a ValueError naming the field,
directly and through load_cache (a crafted file carries valid checksums), and never lets
another exception out."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

import kvtier.caches.persist as persist
from kvtier.caches.block_owned import BlockOwnedKVCache
from kvtier.caches.paged import PagedKVCache
from kvtier.caches.persist import load_cache
from kvtier.caches.ragged import RaggedBatchKVCache
from kvtier.caches.tail_owned import TailOwnedKVCache
from kvtier.config import TurboQuantConfig


def _tail():
    c = TailOwnedKVCache(step=4)
    c.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    return c


def _block():
    c = BlockOwnedKVCache(block_size=2)
    c.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    return c


def _ragged():
    c = RaggedBatchKVCache(batch_size=2, step=4)
    c.update(torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8), new_offsets=[3, 2])
    return c


def _paged(**kw):
    """Two rows of 3 tokens, one block of 4 each."""
    c = PagedKVCache(block_size=4, num_blocks=4, batch_size=2, **kw)
    c.update(torch.randn(2, 2, 3, 64), torch.randn(2, 2, 3, 64))
    return c


BUILDERS = {"tail": _tail, "block": _block, "ragged": _ragged, "paged": _paged,
            "paged_tq": lambda: _paged(turboquant=TurboQuantConfig(seed=7))}


def _rows(*values):
    return torch.tensor(values, dtype=torch.long)


# (tier, change to meta_state, change to state, what the error names)
CASES = {
    "tail step 0": ("tail", {"step": 0}, {}, "step"),
    "tail negative offset": ("tail", {"offset": -1}, {}, "offset"),
    "tail no tier": ("tail", {"tier": None}, {}, "tier None"),
    "tail integer keys": ("tail", {}, {"keys": torch.zeros(1, 2, 3, 8, dtype=torch.long)},
                          "floating point"),
    "block block_size 0": ("block", {"block_size": 0}, {}, "block_size"),
    "block huge num_blocks": ("block", {"num_blocks": 2**40}, {}, "num_blocks"),
    "ragged step 0": ("ragged", {"step": 0}, {}, "step"),
    "ragged frozen as a string": ("ragged", {"frozen": "false"}, {}, "frozen.*true or false"),
    "ragged has_last_write as a string": ("ragged", {"has_last_write": "true"}, {},
                                          "has_last_write"),
    "ragged last_write_start shape": ("ragged", {}, {"last_write_start": _rows(0, 0, 0)},
                                      "last_write_start.*shape|last_write_start.*\\(2,\\)"),
    "ragged last_write_start float": ("ragged", {}, {"last_write_start": torch.zeros(2)},
                                      "last_write_start.*integer"),
    "ragged negative offsets": ("ragged", {}, {"offsets": _rows(3, -1)}, "offsets"),
    "ragged more rows than batch_size": ("ragged", {"batch_size": 3}, {}, "rows"),
    "paged row 1 reads past its block": ("paged", {}, {"lengths": _rows(3, 5)},
                                         r"passes the blocks rows \[1\] hold"),
    "paged negative length": ("paged", {}, {"lengths": _rows(3, -1)}, "lengths"),
    "paged write start past the blocks": ("paged", {}, {"write_start": _rows(9, 0)},
                                          "write_start"),
    "paged three rows of held blocks": ("paged", {}, {"held_blocks": _rows(1, 1, 0)},
                                        "held_blocks"),
    "paged float held blocks": ("paged", {}, {"held_blocks": torch.tensor([1.0, 1.0])},
                                "held_blocks.*integer"),
    "paged unknown dtype": ("paged", {"dtype": "float33"}, {}, "dtype"),
    "paged frozen as a string": ("paged", {"frozen": "false"}, {}, "frozen"),
    "paged num_blocks 0": ("paged", {"num_blocks": 0}, {}, "num_blocks"),
    "paged stray tensor": ("paged", {}, {"stray": torch.zeros(1)}, "unexpected"),
    "paged turboquant mode without settings": ("paged", {"mode": "turboquant"}, {},
                                               "turboquant"),
    "turboquant seed as a string": ("paged_tq", {"turboquant": {"key_quant": "q8_0",
                                    "value_quant": "q3_0", "rotate_keys": False, "seed": "7"}},
                                    {}, "seed"),
    "turboquant unknown field": ("paged_tq", {"turboquant": {"key_quant": "q8_0",
                                 "value_quant": "q3_0", "rotate_keys": False, "seed": 7,
                                 "bits": 3}}, {}, "turboquant"),
}


def _crafted(tier, meta_change, state_change):
    cache = BUILDERS[tier]()
    cls = type(cache)
    state = dict(cache.state) | state_change
    meta = copy.deepcopy(cache.meta_state) | meta_change
    return cls, state, meta


def _write_crafted(path, state, meta):
    """A file as save_cache writes it, with valid checksums, of any state and meta_state."""
    tensors = {f"layer0.{n}": t.contiguous() for n, t in state.items()}
    header = {"format": persist.FORMAT, "format_version": str(persist.FORMAT_VERSION),
              "num_layers": "1",
              "layers": json.dumps([{"meta_state": meta, "tensors": sorted(state)}]),
              "checksums": json.dumps({k: persist._crc(t) for k, t in tensors.items()}),
              "metadata": "{}"}
    header["header_crc"] = persist._header_crc(header)
    save_file(tensors, str(path), metadata=header)


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_field_is_refused_naming_it(case, tmp_path, seed):
    tier, meta_change, state_change, match = CASES[case]
    cls, state, meta = _crafted(tier, meta_change, state_change)
    with pytest.raises(ValueError, match=match):
        cls.from_state(state, meta)
    path = tmp_path / "crafted.safetensors"
    _write_crafted(path, state, meta)
    with pytest.raises(ValueError, match=f"crafted.safetensors: layer 0 .*({match})"):
        load_cache(path)


@pytest.mark.parametrize("tier", list(BUILDERS))
def test_untouched_states_rebuild_exactly(tier, tmp_path, seed):
    cls, state, meta = _crafted(tier, {}, {})
    copy_ = cls.from_state(state, meta)
    assert copy_.meta_state == meta
    for name, t in state.items():
        assert torch.equal(copy_.state[name], t), name


BAD_VALUES = [None, "x", "false", -1, 0, 3, 2**70, 1.5, True, [], {}, [1], {"a": 1}, "float33",
              "turboquant", "q8", json.loads("[" * 50 + "]" * 50)]


@pytest.mark.parametrize("tier", list(BUILDERS))
def test_any_value_in_any_field_gives_a_cache_or_a_value_error(tier, seed):
    """Each meta_state field (and a stray one) set to each of BAD_VALUES: from_state builds a
    cache or raises ValueError, nothing else (no AttributeError, ZeroDivisionError, ...)."""
    cls, state, meta = _crafted(tier, {}, {})
    fields = [*meta, "stray"]
    if isinstance(meta.get("turboquant"), dict):
        fields += [("turboquant", k) for k in meta["turboquant"]]
    built = refused = 0
    for field in fields:
        for bad in BAD_VALUES:
            m = copy.deepcopy(meta)
            if isinstance(field, tuple):
                m[field[0]][field[1]] = bad
            else:
                m[field] = bad
            try:
                cls.from_state(state, m)
                built += 1
            except ValueError:
                refused += 1
    assert refused > len(fields) and built > 0  # a stray field is ignored, bad ones refused
