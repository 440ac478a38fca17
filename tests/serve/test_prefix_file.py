"""The prefix cache on disk: the books' order and adoption, a round trip from one engine to a new
one (the same tokens, the prompt's blocks not computed, every tensor bit for bit over every
codec), what fits and what is left out, and every refusal leaving the engine as it was."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from test_engine import chat, solo
from test_offload import SYSTEM_A, SYSTEM_B, cached

from kvtier.model import ModelArgs, build_random
from kvtier.quant.modes import TurboQuantConfig
from kvtier.serve.engine import EngineConfig, LLMEngine
from kvtier.serve.offload import block_tensors
from kvtier.serve.params import RequestParams
from kvtier.serve.prefix import BlockManager, chain_hash
from kvtier.serve.prefix_file import (
    CHUNK,
    load_prefix_cache,
    load_prefix_file,
    save_prefix_cache,
)
from kvtier.serve.prefix_format import _header_crc

ARGS = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=256, vocab_size=300,
                 max_position_embeddings=2048)  # (head_dim 64: every codec serves)


def tiny(seed: int = 0):
    return build_random(ARGS, dtype=torch.float32, device="cpu", std=0.2, seed=seed)


def prompts(n: int, length: int) -> list[list[int]]:
    return [[(7 * i + 31 * k + 5) % 300 for i in range(length)] for k in range(n)]


SMALL = EngineConfig(num_blocks=40, block_size=4)


def saved(tmp_path, n: int = 1, model=None):
    """``(model, engine, path)``: a tiny engine that answered ``n`` prompts, its cache saved to ``path``."""
    model = tiny() if model is None else model
    engine = LLMEngine(model, None, SMALL)
    engine.generate(prompts(n, 30), RequestParams(max_tokens=2, ignore_eos=True))
    path = tmp_path / "p.safetensors"
    save_prefix_cache(engine, path)
    return model, engine, path


def pages(engine: LLMEngine, blocks) -> list[torch.Tensor]:
    return [t[list(blocks)].clone() for c in engine.runner.caches for t in block_tensors(c)]


# -- the books -----------------------------------------------------------------------------------
def test_cached_entries_come_host_first_then_the_pool_least_recently_used_first() -> None:
    bm = BlockManager(3, 4, host_blocks=4)
    x, y = list(range(12)), list(range(50, 58))
    a = cached(bm, x, 12)  # freed tail first: a[2], a[1], a[0] in the LRU
    held = bm.allocate(8)  # evicts a[2] and a[1]: saved to the host
    bm.take_copies()
    bm.cache_full_blocks(held, y, 8)  # y's two blocks, held by a request
    hx = [chain_hash(None, x[:4])]
    hx += [chain_hash(hx[0], x[4:8]), chain_hash(chain_hash(hx[0], x[4:8]), x[8:12])]
    hy = chain_hash(None, y[:4])
    entries = bm.cached_entries()
    assert entries[:3] == [(hx[2], "host", 0), (hx[1], "host", 1), (hx[0], "pool", a[0])]
    assert sorted(entries[3:]) == sorted([(hy, "pool", held[0]), (chain_hash(hy, y[4:8]), "pool", held[1])])


def test_cached_entries_refuse_queued_copies_and_leave_out_what_the_pool_holds_too() -> None:
    bm = BlockManager(3, 4, host_blocks=4)
    x = list(range(12))
    cached(bm, x, 12)
    bm.free(bm.allocate(12))  # all three evicted: saves queued
    with pytest.raises(ValueError, match="3 block copies are queued; run them first"):
        bm.cached_entries()
    bm.take_copies()
    blocks = bm.allocate(12, [], bm.match_offloaded(x[:11]))  # two loaded back: the pool holds them too
    bm.take_copies()
    assert [w for _, w, _ in bm.cached_entries()] == ["host", "pool", "pool"]
    assert {i for _, w, i in bm.cached_entries() if w == "pool"} == set(blocks[:2])


def test_adopt_books_blocks_from_outside_and_refusals_change_nothing() -> None:
    bm = BlockManager(4, 4, host_blocks=2)
    x = list(range(12))
    h = [chain_hash(None, x[:4])]
    h.append(chain_hash(h[0], x[4:8]))
    h.append(chain_hash(h[1], x[8:12]))
    free, empty = bm.free_places()
    assert (free, empty) == ([0, 1, 2, 3], [0, 1])
    before = bm.cached_entries(), bm.free_places()
    for pool, host, words in [
        ([(h[0], 0), (h[1], 0)], [], "not all free"),
        ([(h[0], 0), (h[0], 1)], [], "a hash comes twice"),
        ([(b"short", 0)], [], "32 bytes"),
        ([(h[0], 0)], [(h[1], 5)], "not all empty"),
    ]:
        with pytest.raises(ValueError, match=words):
            bm.adopt(pool, host)
        assert (bm.cached_entries(), bm.free_places()) == before
    bm.adopt([(h[1], 2), (h[0], 3)], [(h[2], 1)])
    assert bm.match_prefix(x) == [3, 2] and bm.match_offloaded(x) == [1]
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2  # cached blocks stay free to take
    assert bm.allocate(4) == [0]  # a never-cached block first, in free_places() order
    with pytest.raises(ValueError, match="cached already"):
        bm.adopt([(h[0], 0)])


# -- the engine ------------------------------------------------------------------------------------
def test_a_new_engine_answers_from_the_saved_prefixes_without_computing_them(lm, tmp_path) -> None:
    tok = lm.tokenizer
    a, b = chat(tok, "Name a colour.", SYSTEM_A), chat(tok, "Name a fruit.", SYSTEM_B)
    params = RequestParams(max_tokens=8)
    config = EngineConfig(num_blocks=96)
    first = LLMEngine(lm.model, tok, config)
    want = [o.token_ids for o in first.generate([a, b], params)]
    path = tmp_path / "prefixes.safetensors"
    n = save_prefix_cache(first, path)
    assert n == first.stats()["cached_blocks"] > 0
    second = LLMEngine(lm.model, tok, config)
    assert load_prefix_cache(second, path) == {"blocks": n, "pool": n, "host": 0, "left_out": 0}
    outs = second.generate([b, a], params)
    assert [o.token_ids for o in outs] == want[::-1] and list(outs[1].token_ids) == solo(lm, a, 8)
    assert [o.cached_tokens for o in outs] == [(len(b) - 1) // 16 * 16, (len(a) - 1) // 16 * 16]
    with pytest.raises(ValueError, match="whose prefix cache is empty"):  # into a cache that holds blocks
        load_prefix_cache(second, path)


@pytest.mark.parametrize("storage", [{}, {"kv_quant": "q8"}, {"kv_quant": "q4_g32"},
                                     {"turboquant": TurboQuantConfig("q8_0", "q3_0")}],
                         ids=["fp", "q8", "q4_g32", "turboquant"])
def test_every_tensor_of_a_loaded_block_is_the_saved_one_bit_for_bit(tmp_path, storage) -> None:
    """More blocks than one chunk of the copies, from the pool and the host tier (saves still
    queued when the file is written), into a pool and host tier of other sizes."""
    model = tiny()
    config = EngineConfig(num_blocks=CHUNK + 8, block_size=4, kv_offload_gib=0.01, **storage)
    engine = LLMEngine(model, None, config)
    params = RequestParams(max_tokens=2, ignore_eos=True)
    for group in (prompts(3, 120), prompts(2, 90)):  # the second evicts much of the first to the host
        engine.generate(group, params)
    bm = engine.block_manager
    before = [t.clone() for t in engine.runner.host.pool]
    bm.free(bm.allocate(40))  # evicts ten more: their saves queued, not run
    queued = list(bm._copies)
    assert len(queued) >= 5 and {k for k, _, _ in queued} == {"save"}
    path = tmp_path / "p.safetensors"
    n = save_prefix_cache(engine, path)
    entries = bm.cached_entries()  # (the queue ran: the books and tensors of the file)
    assert n == len(entries) > CHUNK and {w for _, w, _ in entries} == {"host", "pool"}
    with safe_open(str(path), framework="pt") as f:
        assert [bytes(h) for h in f.get_tensor("hashes").tolist()] == [h for h, _, _ in entries]
        saved = [f.get_tensor(f"t{j}") for j in range(len(engine.runner.host.pool))]
    for j, (dev, host) in enumerate(zip(engine.runner.host.pool, engine.runner.host.slots)):
        want = torch.stack([(dev if w == "pool" else host)[i] for _, w, i in entries])
        assert torch.equal(saved[j], want), j
    row = {(w, i): k for k, (_, w, i) in enumerate(entries)}
    for _, block, slot in queued:  # what the queued saves copied: the evicted blocks as they were
        assert all(torch.equal(t[row["host", slot]], b[block]) for t, b in zip(saved, before))
    other = LLMEngine(model, None, EngineConfig(num_blocks=30, block_size=4, kv_offload_gib=0.01, **storage))
    got = load_prefix_cache(other, path)
    host_room = other.block_manager.host_blocks
    assert got == {"blocks": n, "pool": 30, "host": min(n - 30, host_room), "left_out": max(0, n - 30 - host_room)}
    kept = {h: k for k, (h, _, _) in enumerate(entries)}
    for h, w, i in other.block_manager.cached_entries():
        src = other.runner.host.pool if w == "pool" else other.runner.host.slots
        assert all(torch.equal(t[i], s[kept[h]]) for t, s in zip(src, saved))
    newest = [h for h, w, _ in other.block_manager.cached_entries() if w == "pool"]
    assert set(newest) == {h for h, _, _ in entries[-30:]}  # the most recently used: the pool's
    last = prompts(2, 90)[1]  # answered from the loaded blocks as from computed ones
    out = other.generate([last], params)[0]
    assert out.cached_tokens >= 40 and out.token_ids == LLMEngine(model, None, config).generate([last], params)[0].token_ids


def test_the_blocks_left_out_are_the_least_recently_used(tmp_path) -> None:
    model = tiny()
    engine = LLMEngine(model, None, EngineConfig(num_blocks=80, block_size=4))
    old, new = prompts(2, 60)
    params = RequestParams(max_tokens=2, ignore_eos=True)
    engine.generate([old], params)
    engine.generate([new], params)
    path = tmp_path / "p.safetensors"
    n = save_prefix_cache(engine, path)
    small = LLMEngine(model, None, EngineConfig(num_blocks=20, block_size=4))
    got = load_prefix_cache(small, path)
    assert got == {"blocks": n, "pool": 20, "host": 0, "left_out": n - 20}
    assert n == 30  # each prompt's 15 full blocks
    bm = small.block_manager  # the newer prompt whole, the older one's head (released tail first)
    assert len(bm.match_prefix(new)) == 15 and len(bm.match_prefix(old)) == 5
    assert small.generate([new], params)[0].cached_tokens == 56  # (its last token computed)


def test_an_empty_cache_leaves_the_file_as_it_was(tmp_path) -> None:
    model, engine, path = saved(tmp_path, 1)
    data = path.read_bytes()
    assert save_prefix_cache(LLMEngine(model, None, SMALL), path) == 0
    assert path.read_bytes() == data


@pytest.mark.parametrize("change, words", [
    ({"kv_quant": "q8"}, 'storage "fp" (this engine: "q8")'),
    ({"block_size": 8}, "block_size 4 (this engine: 8)"),
    ({"seed": 1}, "weights"),
    ({"dtype": torch.bfloat16}, 'dtype "torch.float32" (this engine: "torch.bfloat16")'),
])
def test_a_file_of_another_model_or_layout_is_refused_naming_what_differs(tmp_path, change, words) -> None:
    _, engine, path = saved(tmp_path)
    model = tiny(change.pop("seed", 0)).to(change.pop("dtype", torch.float32))
    other = LLMEngine(model, None, EngineConfig(num_blocks=40, **{"block_size": 4, **change}))
    with pytest.raises(ValueError, match="saved by another model or cache layout") as e:
        load_prefix_cache(other, path)
    assert words in str(e.value)
    assert other.stats()["cached_blocks"] == 0 and other.block_manager.free_places()[0] == list(range(40))


def _damaged(path, at: int, tmp_path):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    out = tmp_path / f"damaged{at}.safetensors"
    out.write_bytes(bytes(data))
    return out


def test_a_damaged_file_is_refused_and_the_engine_left_as_it_was(tmp_path) -> None:
    model, engine, path = saved(tmp_path, 2)
    size = path.stat().st_size
    header = int.from_bytes(path.read_bytes()[:8], "little")
    meta = json.loads(path.read_bytes()[8 : 8 + header])["__metadata__"]
    at_blocks = path.read_bytes().index(f'"blocks":"{meta["blocks"]}"'.encode()) + 10
    cases = [(at_blocks, "header fails its checksum"), (8 + header + 3, "hashes fail their checksum"),
             (size - 500, "fails its checksum"), (size - 3, "fails its checksum")]  # a page's byte, the crc's
    for at, words in cases:
        other = LLMEngine(model, None, SMALL)
        with pytest.raises(ValueError, match=words):
            load_prefix_cache(other, _damaged(path, at, tmp_path))
        assert other.stats()["cached_blocks"] == 0 and other.block_manager.free_places()[0] == list(range(40))
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[: size // 2])
    with pytest.raises(ValueError, match="cannot be loaded: SafetensorError"):
        load_prefix_cache(LLMEngine(model, None, SMALL), cut)
    other = LLMEngine(model, None, SMALL)
    assert load_prefix_cache(other, path)["pool"] > 0  # the file itself was never touched


def test_refusals_before_anything_is_read_or_written(tmp_path) -> None:
    model = tiny()
    engine = LLMEngine(model, None, SMALL)
    engine.generate(prompts(1, 30), RequestParams(max_tokens=2, ignore_eos=True))
    text = tmp_path / "notes.txt"
    text.write_text("my notes")
    with pytest.raises(ValueError, match="exists and is not a kvtier prefix cache file"):
        save_prefix_cache(engine, text)
    assert text.read_text() == "my notes"
    with pytest.raises(ValueError, match="does not exist; create it first"):
        save_prefix_cache(engine, tmp_path / "missing" / "p.safetensors")
    off = LLMEngine(model, None, EngineConfig(num_blocks=40, block_size=4, enable_prefix_caching=False))
    with pytest.raises(ValueError, match="prefix caching is off"):
        save_prefix_cache(off, tmp_path / "p.safetensors")
    with pytest.raises(ValueError, match="cannot be loaded"):
        load_prefix_cache(LLMEngine(model, None, SMALL), text)
    engine.add_request([1, 2, 3], RequestParams(max_tokens=2))
    with pytest.raises(ValueError, match="into an idle engine"):
        load_prefix_cache(engine, tmp_path / "p.safetensors")


def _resealed(path, tmp_path, **changes):
    """``path`` with header metadata fields changed and the header's checksum made right again
    (a crafted file: the checksum guards against damage, not against an author)."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    meta = header["__metadata__"] | changes
    meta["header_crc"] = _header_crc(meta)
    header["__metadata__"] = meta
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    out = tmp_path / "crafted.safetensors"
    out.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + size :])
    return out


@pytest.mark.parametrize("fingerprint", ['["a", "b"]', '"x"', "3", "null", "[" * 100000])
def test_a_crafted_fingerprint_is_a_damaged_header_and_the_server_starts_empty(tmp_path, capsys, fingerprint) -> None:
    model, engine, path = saved(tmp_path, 1)
    crafted = _resealed(path, tmp_path, fingerprint=fingerprint)
    other = LLMEngine(model, None, SMALL)
    with pytest.raises(ValueError, match="its header is damaged"):
        load_prefix_cache(other, crafted)
    assert load_prefix_file(other, crafted) is None and other.stats()["cached_blocks"] == 0
    assert "its header is damaged" in capsys.readouterr().err


def test_a_file_of_another_configuration_or_kind_is_never_written_over(tmp_path) -> None:
    """A prefix file another configuration saved, a prompt cache given as a prefix file and a
    prefix file given as a prompt cache are refused before anything is written."""
    from kvtier.caches.paged import PagedKVCache
    from kvtier.caches.persist import save_cache

    model = tiny()
    params = RequestParams(max_tokens=2, ignore_eos=True)
    fp = LLMEngine(model, None, SMALL)
    fp.generate(prompts(1, 30), params)
    path = tmp_path / "p.safetensors"
    save_prefix_cache(fp, path)
    data = path.read_bytes()
    q8 = LLMEngine(model, None, EngineConfig(num_blocks=40, block_size=4, kv_quant="q8"))
    q8.generate(prompts(1, 30), params)
    with pytest.raises(ValueError, match='holds the blocks of another model or cache layout .*storage "fp" '
                                         r'\(this engine: "q8"\).*pass another path, or delete the file first'):
        save_prefix_cache(q8, path)
    assert path.read_bytes() == data
    prompt = tmp_path / "prompt.safetensors"
    save_cache(prompt, [PagedKVCache()])
    with pytest.raises(ValueError, match="exists and is not a kvtier prefix cache file"):
        save_prefix_cache(fp, prompt)
    with pytest.raises(ValueError, match="exists and is not a kvtier cache file"):
        save_cache(path, [PagedKVCache()])
    assert path.read_bytes() == data


def test_a_file_whose_header_fails_its_checksum_is_no_configuration_to_keep(tmp_path, capsys) -> None:
    """A header edited without its checksum (here: the weights' digest) is damage, not another
    configuration: the load says the file is replaced, and the save replaces it."""
    model, engine, path = saved(tmp_path)
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    meta = json.loads(raw[8 : 8 + size])["__metadata__"]
    digest = json.loads(meta["fingerprint"])["weights"]
    path.write_bytes(raw.replace(digest.encode(), ("0" if digest[0] != "0" else "1").encode() + digest[1:].encode()))
    other = LLMEngine(model, None, SMALL)
    assert load_prefix_file(other, path) is None
    assert "its header fails its checksum (the file is damaged); the prefix cache starts empty (the file is " \
           "replaced when the server saves it)" in capsys.readouterr().err
    other.generate(prompts(1, 30), RequestParams(max_tokens=2, ignore_eos=True))
    assert save_prefix_cache(other, path) > 0 and load_prefix_cache(LLMEngine(model, None, SMALL), path)["pool"] > 0


def test_the_file_is_the_owners_alone_unless_it_was_opened_up(tmp_path) -> None:
    _, engine, path = saved(tmp_path)
    assert path.stat().st_mode & 0o777 == 0o600  # every user's prompts, as keys and values
    path.chmod(0o640)
    save_prefix_cache(engine, path)
    assert path.stat().st_mode & 0o777 == 0o640
    empty = tmp_path / "placeholder.safetensors"  # made beforehand, as `touch` makes it (0644 under the umask)
    empty.touch()
    empty.chmod(0o644)
    save_prefix_cache(engine, empty)
    assert empty.stat().st_size > 0 and empty.stat().st_mode & 0o777 == 0o600  # (before: 0644, every prompt)


def test_a_folder_or_a_crc_of_another_dtype_is_refused(tmp_path) -> None:
    model = tiny()
    engine = LLMEngine(model, None, SMALL)
    with pytest.raises(ValueError, match="it is not a regular file"):
        load_prefix_cache(engine, tmp_path)
    engine.generate(prompts(1, 30), RequestParams(max_tokens=2, ignore_eos=True))
    path = tmp_path / "p.safetensors"
    save_prefix_cache(engine, path)
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    text = raw[8 : 8 + size].replace(b'"crc":{"dtype":"I64"', b'"crc":{"dtype":"U64"')
    crafted = tmp_path / "u64.safetensors"
    crafted.write_bytes(raw[:8] + text + raw[8 + size :])
    with pytest.raises(ValueError, match=r"its crc tensor is U64 \[\d+\], not I64"):
        load_prefix_cache(LLMEngine(model, None, SMALL), crafted)


@pytest.mark.parametrize("value, words", [
    ("", r"must be the path of a file such as prefixes.safetensors, or None \(no file\), got ''"),
    (3, "must be the path of a file such as prefixes.safetensors"),
    (__file__, "exists and is not a kvtier prefix cache file"),
    (os.path.dirname(__file__), "is a directory, not a regular file; .* such as prefixes.safetensors"),
    ("/tmp/" + "p" * 240 + ".safetensors", r"its name \(252 bytes\) is too long to save: a save writes "
                                            r"'\.p+\.safetensors\.kvtier-lock' beside it"),
])
def test_the_server_config_refuses_a_prefix_cache_file_it_could_not_write(value, words) -> None:
    """Before: a 252-byte name (legal) passed, and every save failed on its 13 bytes longer lock
    file; a directory was told to pass "a file path such as prompt.safetensors"."""
    from kvtier.serve.api import (
        ServerConfig,  # (here: the module imports without the server's packages)
    )

    with pytest.raises(ValueError, match=words):
        ServerConfig(prefix_cache_file=value)


def test_a_folder_not_writable_names_the_read_only_flag(tmp_path, monkeypatch) -> None:
    """A prefix cache file in a folder this user cannot write: the message names
    ``--prefix-cache-read-only`` (which reads it there); a new path there does not (read-only
    mode would refuse a file that does not exist)."""
    import kvtier.serve.prefix_file as prefix_file
    from kvtier.serve.api import ServerConfig

    _, _, path = saved(tmp_path)
    monkeypatch.setattr(prefix_file.os, "access", lambda p, mode: False)  # (root writes any folder)
    with pytest.raises(ValueError, match=r"its folder .* is not writable, and the server writes the file when it "
                                         r"stops: pass another path, or add --prefix-cache-read-only"):
        ServerConfig(prefix_cache_file=str(path))
    with pytest.raises(ValueError, match=r"its folder .* is not writable; pass another path$"):
        ServerConfig(prefix_cache_file=str(tmp_path / "new.safetensors"))


def test_the_server_config_reads_a_read_only_file_without_asking_to_write_it(tmp_path, monkeypatch) -> None:
    import kvtier.serve.prefix_file as prefix_file
    from kvtier.serve.api import ServerConfig

    _, _, path = saved(tmp_path)

    def unwritable(*args):
        raise ValueError("its folder is not writable")

    monkeypatch.setattr(prefix_file, "check_save_path", unwritable)  # (a read-only volume: not asked)
    with pytest.raises(ValueError, match="its folder is not writable"):
        ServerConfig(prefix_cache_file=str(path))
    assert ServerConfig(prefix_cache_file=str(path), prefix_cache_read_only=True).prefix_cache_read_only
    with pytest.raises(ValueError, match="prefix_cache_read_only must be a bool, got 'yes'"):
        ServerConfig(prefix_cache_file=str(path), prefix_cache_read_only="yes")
    with pytest.raises(ValueError, match="--prefix-cache-read-only never writes it: drop one of them"):
        ServerConfig(prefix_cache_file=str(path), prefix_cache_read_only=True, prefix_cache_save_interval_s=5)
    with pytest.raises(ValueError, match="does not exist; --prefix-cache-read-only reads"):
        ServerConfig(prefix_cache_file=str(tmp_path / "none.safetensors"), prefix_cache_read_only=True)


@pytest.mark.gpu
def test_a_round_trip_on_cuda_with_pinned_host_slots(tmp_path) -> None:
    """On CUDA (pinned host slots, saves queued in the stream): every loaded block is the file's
    bit for bit, and the newest prompt, whose blocks both pools hold, gets the tokens of the
    engine that saved them (a full prefill in bfloat16 computes other chunks, and may not)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = tiny().to("cuda", torch.bfloat16)
    config = EngineConfig(num_blocks=CHUNK + 8, block_size=4, kv_offload_gib=0.01, cuda_graph=False)
    engine = LLMEngine(model, None, config)
    params = RequestParams(max_tokens=4, ignore_eos=True)
    for group in (prompts(3, 120), prompts(2, 90)):
        engine.generate(group, params)
    path = tmp_path / "p.safetensors"
    n = save_prefix_cache(engine, path)
    other = LLMEngine(model, None, config)
    got = load_prefix_cache(other, path)
    assert got["pool"] + got["host"] == n - got["left_out"] and got["host"] > 0 and other.runner.host.slots[0].is_pinned()
    with safe_open(str(path), framework="pt") as f:
        row = {bytes(h): k for k, h in enumerate(f.get_tensor("hashes").tolist())}
        saved = [f.get_tensor(f"t{j}") for j in range(len(other.runner.host.pool))]
    for h, w, i in other.block_manager.cached_entries():
        src = other.runner.host.pool if w == "pool" else other.runner.host.slots
        assert all(torch.equal(t[i].cpu(), s[row[h]]) for t, s in zip(src, saved))
    last = prompts(2, 90)[1]
    mine, theirs = other.generate([last], params)[0], engine.generate([last], params)[0]
    assert mine.token_ids == theirs.token_ids and mine.cached_tokens == theirs.cached_tokens > 0


def _lifespan_run(monkeypatch, capsys, periodic, *, steps: bool = True, hold_s: float = 0.0) -> tuple[str, list]:
    """Serve one request through ``engine_lifespan`` with periodic saves every 0.05 s, ``periodic``
    (async) standing in for ``save_in_loop``, the final save recorded, and a loop given 0.5 s to
    stop; stderr and the final saves' calls."""
    import asyncio

    import kvtier.serve.prefix_file as prefix_file
    from kvtier.serve.async_engine import AsyncLLMEngine

    finals = []
    monkeypatch.setattr(prefix_file, "save_in_loop", periodic)
    monkeypatch.setattr(prefix_file, "save_prefix_file", lambda engine, path: finals.append("final") or 1)
    eng = AsyncLLMEngine(LLMEngine(tiny(), None, SMALL))
    monkeypatch.setattr(eng, "shutdown", lambda: AsyncLLMEngine.shutdown(eng, timeout=0.5))

    async def serve():
        async with prefix_file.engine_lifespan(eng, "unused.safetensors", 0.05):
            if steps:
                rid = await eng.add_request(prompts(1, 30)[0], RequestParams(max_tokens=2, ignore_eos=True))
                _ = [out async for out in eng.stream(rid)]
            await asyncio.sleep(hold_s)

    asyncio.run(asyncio.wait_for(serve(), 60))
    return capsys.readouterr().err, finals


def test_a_stop_waits_for_a_periodic_save_under_way(monkeypatch, capsys) -> None:
    """A periodic save still running when the server stops (here longer than the loop's wait)
    finishes, then the final save runs (before: the stop said a step was still running, and
    the final save never ran)."""
    import asyncio

    calls = []

    async def slow(engine, path):
        calls.append("start")
        await asyncio.sleep(1.0)
        calls.append("end")
        return True

    err, finals = _lifespan_run(monkeypatch, capsys, slow, hold_s=0.3)
    assert calls == ["start", "end"] and finals == ["final"] and "not saved" not in err


@pytest.mark.parametrize("cap", [None, 0.1])
def test_a_failed_periodic_save_is_tried_again_later_and_later(monkeypatch, capsys, cap) -> None:
    """A periodic save that fails (another process saving to the file, a folder not writable for
    a while) is tried again, each try twice as late as the one before up to ``RETRY_CAP_S``, and a
    save that works returns to the period (before: the first failure ended the periodic saves for
    good, so a lock held for a moment left the server without saves until it stopped)."""
    import time

    import kvtier.serve.prefix_file as prefix_file

    if cap is not None:
        monkeypatch.setattr(prefix_file, "RETRY_CAP_S", cap)
    calls = []

    async def failing_twice(engine, path):
        calls.append(time.monotonic())
        return len(calls) > 2  # (what save_in_loop returns once it has said why)

    err, finals = _lifespan_run(monkeypatch, capsys, failing_twice, hold_s=0.8)
    assert len(calls) >= 3 and finals == ["final"]  # a third try, which worked
    gaps = [b - a for a, b in zip(calls, calls[1:3], strict=False)]
    waits = [0.1, 0.1] if cap else [0.1, 0.2]  # (periods of 0.05 s)
    assert gaps[0] >= waits[0] and gaps[1] >= waits[1], gaps
    assert err.count("the periodic save of the prefix cache failed; the next is tried in") == 2
    assert [f"tried in {w:g} s" in err for w in (0.1, 0.2)] == [True, cap is None]


def test_no_periodic_save_without_a_step(monkeypatch, capsys) -> None:
    calls = []

    async def periodic(engine, path):
        calls.append("periodic")
        return True

    _, finals = _lifespan_run(monkeypatch, capsys, periodic, steps=False, hold_s=0.4)
    assert calls == [] and finals == ["final"]
