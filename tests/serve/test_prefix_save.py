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
from kvtier.serve.prefix_file import CHUNK, load_prefix_cache
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


def cached_engine(seed: int = 0) -> LLMEngine:
    """A tiny engine that answered two prompts (14 cached blocks)."""
    engine = LLMEngine(tiny(seed), None, SMALL)
    engine.generate(prompts(2, 30), PARAMS)
    return engine


def saved_once(tmp_path):
    """``(engine, path)``: :func:`cached_engine`, its cache saved to ``path`` by a begun save."""
    engine, path = cached_engine(), tmp_path / "p.safetensors"
    finished(engine, path)
    return engine, path


def held(monkeypatch, name: str) -> threading.Event:
    """``prefix_save.<name>`` made to wait for the returned event before it runs (the thread held)."""
    gate, real = threading.Event(), getattr(prefix_save, name)

    def waiting(*args):
        assert gate.wait(30)
        return real(*args)

    monkeypatch.setattr(prefix_save, name, waiting)
    return gate


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
    engine = cached_engine()
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
    gate = held(monkeypatch, "_write_file")
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
    engine, path = saved_once(tmp_path)
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
    engine, path = saved_once(tmp_path)
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(path.read_bytes())
    os.replace(copy, path)  # the same bytes, another file
    save = finished(engine, path)
    assert save.new_blocks == save.blocks


def test_a_save_too_big_to_copy_is_written_while_the_engine_waits(tmp_path, monkeypatch) -> None:
    engine = cached_engine()
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


def test_blocks_of_the_host_tier_and_queued_copies_are_saved_as_a_waiting_save_writes_them(tmp_path) -> None:
    """More blocks than one chunk, from the pool and the host tier, with saves to the host still
    queued: a first begun save (every block copied), then one reading most from the file."""
    config = EngineConfig(num_blocks=CHUNK + 8, block_size=4, kv_offload_gib=0.01, kv_quant="q8")
    engine = LLMEngine(tiny(), None, config)
    for group in (prompts(3, 120), prompts(2, 90)):  # the second evicts much of the first to the host
        engine.generate(group, PARAMS)
    bm = engine.block_manager
    bm.free(bm.allocate(40))  # evicts ten more: their saves queued, not run
    assert bm._copies
    path = tmp_path / "p.safetensors"
    first = finished(engine, path)
    assert first.new_blocks == first.blocks > CHUNK and {w for _, w, _ in bm.cached_entries()} == {"host", "pool"}
    assert same_as_waiting(engine, path, tmp_path)
    engine.generate([p[::-1] for p in prompts(1, 90)], PARAMS)
    bm.free(bm.allocate(20))
    second = finished(engine, path)
    assert 0 < second.new_blocks < second.blocks and same_as_waiting(engine, path, tmp_path)


def test_the_budget_counts_only_the_blocks_new_to_the_file(tmp_path, monkeypatch) -> None:
    engine = cached_engine()
    path = tmp_path / "p.safetensors"
    first = finished(engine, path)
    row = first.copied_bytes // first.new_blocks
    engine.generate(prompts(3, 30)[2:], PARAMS)
    new = sum(h not in prefix_save._ON_DISK[engine.runner][os.path.realpath(path)].rows
              for h, _, _ in engine.block_manager.cached_entries())
    monkeypatch.setattr(prefix_save, "host_budget", lambda: new * row)  # the new blocks fit; all would not
    save = finished(engine, path)
    assert not save.waited and save.new_blocks == new
    engine.generate([p[::-1] for p in prompts(1, 30)], PARAMS)
    monkeypatch.setattr(prefix_save, "host_budget", lambda: row)  # (more than one block new)
    assert finished(engine, path).waited and same_as_waiting(engine, path, tmp_path)


def test_a_file_replaced_after_the_save_began_is_not_read_and_the_next_save_copies_every_block(tmp_path, monkeypatch):
    engine, path = saved_once(tmp_path)
    engine.generate(prompts(3, 30)[2:], PARAMS)
    gate = held(monkeypatch, "_old_file")
    save = begin_prefix_save(engine, path)
    assert 0 < save.new_blocks < save.blocks
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(path.read_bytes())
    os.replace(copy, path)  # the same bytes, another file: not the one the save began from
    gate.set()
    with pytest.raises(prefix_save.StaleFile, match="changed since this server last wrote or read it"):
        save.finish()  # (written() raised: the save dropped)
    assert save.done and not list(tmp_path.glob(".*kvtier-tmp"))
    again = finished(engine, path)
    assert again.new_blocks == again.blocks and same_as_waiting(engine, path, tmp_path)


def test_an_unchanged_cache_is_not_written_again(tmp_path) -> None:
    engine, path = saved_once(tmp_path)
    ident = prefix_save.file_ident(path)
    save = begin_prefix_save(engine, path)
    assert save.unchanged and save.done and save.new_blocks == 0 and prefix_save.file_ident(path) == ident


# -- the server's side ------------------------------------------------------------------------------
def _serving(engine, fn):
    """``fn(async engine)`` awaited with ``engine`` served by a started loop; the loop stopped after."""
    import asyncio

    from kvtier.serve.async_engine import AsyncLLMEngine

    eng = AsyncLLMEngine(engine)
    eng.start()
    try:
        return asyncio.run(asyncio.wait_for(fn(eng), 60))
    finally:
        eng.shutdown()


def test_save_in_loop_saves_and_says_so(tmp_path, capsys) -> None:
    from kvtier.serve.prefix_file import save_figures, save_in_loop

    engine = cached_engine()
    path = tmp_path / "p.safetensors"
    figures = []

    async def twice(eng):  # (the second finds the file unchanged: nothing written, nothing counted)
        saved = [await save_in_loop(eng, path), await save_in_loop(eng, path)]
        figures.append(save_figures(eng))
        return all(saved)

    assert _serving(engine, twice)
    err = capsys.readouterr().err
    n = len(engine.block_manager.cached_entries())
    assert f"saved {n} cached blocks to {path}" in err and f"to copy {n} blocks new to the file" in err
    assert err.count("[kvtier] saved") == 1 and figures[0]["prefix_file_saves"] == 1
    assert same_as_waiting(engine, path, tmp_path)


def test_save_in_loop_saves_again_at_once_when_the_file_on_disk_fails_its_check(tmp_path, capsys) -> None:
    """A file damaged in place: the begun save fails in its thread, is dropped, and is made again
    at once, every block copied (the periodic saves go on); the metrics count one failure, one save."""
    from kvtier.serve.prefix_file import save_figures, save_in_loop

    engine, path = saved_once(tmp_path)
    engine.generate(prompts(3, 30)[2:], PARAMS)
    st, data = os.stat(path), bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    figures = {}

    async def save(eng):
        saved = await save_in_loop(eng, path)
        figures.update(save_figures(eng))
        return saved

    assert _serving(engine, save)
    err = capsys.readouterr().err
    n = len(engine.block_manager.cached_entries())
    assert "fails its checksum since this server last wrote or read it; saving again at once, copying every block" in err
    assert (figures["prefix_file_saves"], figures["prefix_file_save_failures"], figures["prefix_file_blocks"]) == (1, 1, n)
    assert 0 < figures["prefix_file_last_pause_seconds"] < figures["prefix_file_last_save_seconds"]
    assert f"to copy {n} blocks new to the file" in err and same_as_waiting(engine, path, tmp_path)


def test_a_save_cut_off_by_a_cancellation_is_dropped_at_the_stop_and_the_final_save_runs(tmp_path, monkeypatch,
                                                                                      capsys) -> None:
    """The lifespan cancelled while its stop waits for a periodic save (as a forced exit does): the
    save is left begun; once the loop has stopped it is dropped, and the final save is made."""
    import asyncio

    from kvtier.serve.async_engine import AsyncLLMEngine
    from kvtier.serve.prefix_file import engine_lifespan

    engine = LLMEngine(tiny(), None, SMALL)
    path = tmp_path / "p.safetensors"
    gate = held(monkeypatch, "_write_file")
    eng = AsyncLLMEngine(engine)
    cut = []

    async def serve():
        async with engine_lifespan(eng, path, 0.2):
            rid = await eng.add_request(prompts(1, 30)[0], PARAMS)
            _ = [out async for out in eng.stream(rid)]
            for _ in range(600):  # the periodic save begun, its thread held
                if prefix_save._WRITING:
                    break
                await asyncio.sleep(0.05)
            cut.append(bool(prefix_save._WRITING))
            asyncio.get_running_loop().call_later(0.3, asyncio.current_task().cancel)  # while the stop waits
            threading.Timer(1.0, gate.set).start()

    asyncio.run(serve())
    err = capsys.readouterr().err
    assert cut == [True] and "not finished" not in err and "saved 7 cached blocks to" in err
    assert not prefix_save._WRITING and not list(tmp_path.glob(".*kvtier-tmp"))
    assert same_as_waiting(engine, path, tmp_path)


def test_a_new_order_without_new_blocks_is_written_and_finish_waits_for_the_thread(tmp_path) -> None:
    engine, path = saved_once(tmp_path)
    before = [h for h, _, _ in engine.block_manager.cached_entries()]
    engine.generate([prompts(2, 30)[0][:16]], RequestParams(max_tokens=1))  # four cached blocks used again
    after = [h for h, _, _ in engine.block_manager.cached_entries()]
    assert sorted(after) == sorted(before) and after != before
    save = begin_prefix_save(engine, path)
    assert not save.unchanged and save.new_blocks == 0
    assert save.finish() == len(after) and same_as_waiting(engine, path, tmp_path)  # (no written() first)


def test_a_path_that_names_another_file_at_the_rename_drops_the_save(tmp_path) -> None:
    engine = cached_engine()
    path, other = tmp_path / "p.safetensors", tmp_path / "q.safetensors"
    save_prefix_cache(engine, path)
    save_prefix_cache(engine, other)
    kept = path.read_bytes(), other.read_bytes()
    engine.generate(prompts(3, 30)[2:], PARAMS)
    save = begin_prefix_save(engine, path)
    while not save.written():
        pass
    moved = tmp_path / "moved.safetensors"
    os.replace(path, moved)
    path.symlink_to(other)  # the path now names q.safetensors
    with pytest.raises(ValueError, match="now names .*q.safetensors, not .*p.safetensors, whose save was being "
                                         "written; the save is dropped"):
        save.finish()
    assert (moved.read_bytes(), other.read_bytes()) == kept and not list(tmp_path.glob(".*kvtier-tmp"))


def test_a_discard_after_the_thread_has_written_removes_its_file(tmp_path) -> None:
    engine = cached_engine()
    path = tmp_path / "p.safetensors"
    save = begin_prefix_save(engine, path)
    while not save.written():
        pass
    assert list(tmp_path.glob(".*kvtier-tmp"))
    save.discard()
    assert not list(tmp_path.iterdir()) and begin_prefix_save(engine, path) is not None


def test_save_in_loop_refused_before_it_began_says_so_once(tmp_path, capsys) -> None:
    from kvtier.serve.prefix_file import save_in_loop

    path = tmp_path / "p.safetensors"
    save_prefix_cache(cached_engine(seed=1), path)  # another model's blocks
    engine = cached_engine()
    assert not _serving(engine, lambda eng: save_in_loop(eng, path))
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("[kvtier]")]
    assert len(lines) == 1 and "holds the blocks of another model or cache layout" in lines[0]
    assert "saving again" not in lines[0]

