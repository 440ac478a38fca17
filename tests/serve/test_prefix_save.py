"""Saves of the prefix cache begun between two steps (``begin_prefix_save``): the blocks new to the
file copied at once, the file written by a thread while the engine steps on, every other block
read from the file on disk (each tensor checked first). Each file is compared byte for byte with
what a save while the engine waits writes at the same moment."""

from __future__ import annotations

import os
import threading

import pytest
from test_prefix_file import SMALL, prompts, tiny

import kvtier.serve.prefix_save as prefix_save
from kvtier.serve.engine import EngineConfig, LLMEngine
from kvtier.serve.params import RequestParams
from kvtier.serve.prefix_file import load_prefix_cache
from kvtier.serve.prefix_save import begin_prefix_save, save_prefix_cache

PARAMS = RequestParams(max_tokens=2, ignore_eos=True)


def finished(engine, path, *, steps=None):
    """A save of ``engine`` begun, written (``steps()`` run meanwhile) and renamed into place."""
    save = begin_prefix_save(engine, path)
    while not save.written():
        if steps is not None:
            steps()
    assert save.finish() == save.blocks
    return save


def same_as_waiting(engine, path, tmp_path) -> bool:
    """Whether ``path`` holds what a save while the engine waits would write now, byte for byte."""
    ref = tmp_path / "waiting.safetensors"
    save_prefix_cache(engine, ref)
    return path.read_bytes() == ref.read_bytes()


def test_a_begun_save_writes_what_a_waiting_save_writes_and_loads(tmp_path) -> None:
    model = tiny()
    engine = LLMEngine(model, None, SMALL)
    engine.generate(prompts(3, 30), PARAMS)
    path = tmp_path / "p.safetensors"
    save = finished(engine, path)
    n = len(engine.block_manager.cached_entries())
    assert (save.blocks, save.new_blocks, save.waited) == (n, n, False) and save.copied_bytes > 0
    assert same_as_waiting(engine, path, tmp_path)
    other = LLMEngine(model, None, SMALL)
    assert load_prefix_cache(other, path)["blocks"] == n
    last = prompts(3, 30)[2]
    assert other.generate([last], PARAMS)[0].token_ids == engine.generate([last], PARAMS)[0].token_ids
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_the_next_save_copies_only_the_new_blocks_and_reads_the_rest_from_the_file(tmp_path) -> None:
    engine = LLMEngine(tiny(), None, SMALL)
    engine.generate(prompts(2, 30), PARAMS)
    path = tmp_path / "p.safetensors"
    first = finished(engine, path)
    before = {h for h, _, _ in engine.block_manager.cached_entries()}
    engine.generate([prompts(3, 30)[2], prompts(2, 30)[0]], PARAMS)  # one new prompt, one hit (LRU order moves)
    entries = engine.block_manager.cached_entries()
    new = [h for h, _, _ in entries if h not in before]
    second = finished(engine, path)
    assert 0 < second.new_blocks == len(new) < second.blocks == len(entries)
    assert second.copied_bytes == first.copied_bytes * len(new) // first.new_blocks
    assert same_as_waiting(engine, path, tmp_path)  # (the old rows, taken from the file, in the new order)


def test_a_file_loaded_at_the_start_is_read_from(tmp_path) -> None:
    model = tiny()
    engine = LLMEngine(model, None, SMALL)
    engine.generate(prompts(2, 30), PARAMS)
    path = tmp_path / "p.safetensors"
    save_prefix_cache(engine, path)
    other = LLMEngine(model, None, SMALL)
    load_prefix_cache(other, path)
    save = finished(other, path)
    assert save.new_blocks == 0 and save.blocks == len(other.block_manager.cached_entries())
    assert same_as_waiting(other, path, tmp_path)


def test_the_engine_steps_while_the_file_is_written_and_the_file_holds_the_moment_it_began(tmp_path, monkeypatch) -> None:
    """Blocks evicted and written over by later requests while the thread writes: the file holds
    the blocks of the moment the save began (copied then), not what their pages hold later."""
    engine = LLMEngine(tiny(), None, EngineConfig(num_blocks=24, block_size=4))
    engine.generate(prompts(2, 30), PARAMS)
    path, ref = tmp_path / "p.safetensors", tmp_path / "then.safetensors"
    save_prefix_cache(engine, ref)  # what the file must hold
    gate, write = threading.Event(), prefix_save._write_file

    def held(*args):
        assert gate.wait(30)
        return write(*args)

    monkeypatch.setattr(prefix_save, "_write_file", held)
    save = begin_prefix_save(engine, path)
    engine.generate([p[::-1] for p in prompts(4, 30)], PARAMS)  # four new prompts: every block of the first two reused
    assert not save.written()
    gate.set()
    while not save.written():
        pass
    save.finish()
    assert path.read_bytes() == ref.read_bytes()
    assert not same_as_waiting(engine, path, tmp_path)  # (the pages did change meanwhile)


def test_a_file_damaged_since_is_not_copied_from_and_the_next_save_copies_every_block(tmp_path) -> None:
    engine = LLMEngine(tiny(), None, SMALL)
    engine.generate(prompts(2, 30), PARAMS)
    path = tmp_path / "p.safetensors"
    finished(engine, path)
    engine.generate(prompts(3, 30)[2:], PARAMS)
    st, data = os.stat(path), bytearray(path.read_bytes())
    data[-200] ^= 0xFF  # a byte of the last pool tensor; same size, inode and time: the same file to a stat
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    save = begin_prefix_save(engine, path)
    with pytest.raises(ValueError, match="fails its checksum since this server last wrote or read it"):
        while not save.written():
            pass
    save.discard()
    assert path.read_bytes() == bytes(data) and not any(p.name.endswith("kvtier-tmp") for p in tmp_path.iterdir())
    again = finished(engine, path)
    assert again.new_blocks == again.blocks  # (the file no longer trusted: every block copied)
    assert same_as_waiting(engine, path, tmp_path)


def test_a_file_replaced_since_is_not_read_from(tmp_path) -> None:
    engine = LLMEngine(tiny(), None, SMALL)
    engine.generate(prompts(2, 30), PARAMS)
    path = tmp_path / "p.safetensors"
    finished(engine, path)
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(path.read_bytes())
    os.replace(copy, path)  # the same bytes, another file
    save = finished(engine, path)
    assert save.new_blocks == save.blocks


def test_a_save_too_big_to_copy_is_written_while_the_engine_waits(tmp_path, monkeypatch) -> None:
    engine = LLMEngine(tiny(), None, SMALL)
    engine.generate(prompts(2, 30), PARAMS)
    monkeypatch.setattr(prefix_save, "CAPTURE_SHARE", 0.0)
    path = tmp_path / "p.safetensors"
    save = begin_prefix_save(engine, path)
    assert save.waited and save.done and save.written() and save.copied_bytes == 0
    assert save.finish() == save.blocks and same_as_waiting(engine, path, tmp_path)


def test_nothing_else_saves_while_a_begun_save_is_unfinished_and_a_discard_leaves_the_file(tmp_path) -> None:
    engine = LLMEngine(tiny(), None, SMALL)
    assert begin_prefix_save(engine, tmp_path / "p.safetensors") is None  # nothing cached
    engine.generate(prompts(2, 30), PARAMS)
    path = tmp_path / "p.safetensors"
    save_prefix_cache(engine, path)
    kept = path.read_bytes()
    engine.generate(prompts(3, 30)[2:], PARAMS)
    save = begin_prefix_save(engine, path)
    for other in (lambda: save_prefix_cache(engine, path), lambda: begin_prefix_save(engine, path)):
        with pytest.raises(ValueError, match="is not finished; finish\\(\\) or discard\\(\\) it first"):
            other()
    save.discard()
    assert path.read_bytes() == kept and sorted(p.name for p in tmp_path.iterdir()) == ["p.safetensors"]
    finished(engine, path)
    assert same_as_waiting(engine, path, tmp_path)
