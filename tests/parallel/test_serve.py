"""Serving over tensor-parallel ranks on the CPU: rank 0's engine broadcasts each step, the
other ranks run it on their shards; tokens equal a single-process engine's."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from kvtier.parallel import TensorParallelError
from kvtier.parallel.serve import serve_sharded
from kvtier.serve.prefix_file import (
    begin_prefix_save,
    check_prefix_paths,
    load_prefix_cache,
    rank_path,
    save_prefix_cache,
)

engine = pytest.importorskip("kvtier.serve.engine")
EngineConfig, LLMEngine = engine.EngineConfig, engine.LLMEngine
RequestParams = pytest.importorskip("kvtier.serve.params").RequestParams

PROMPTS = ("The capital of France is", "Water boils at", "1, 2, 3,")
CONFIG = EngineConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_batched_tokens=8)  # chunks too


def _generate(engine, prompts):
    """Each prompt's tokens, the first's prompt logprobs (its chunks' every position), the stats."""
    outs = engine.generate(prompts, [RequestParams(max_tokens=6, prompt_logprobs=2)]
                           + [RequestParams(max_tokens=6)] * (len(prompts) - 1))
    scored = [(x.token_id, x.logprob, [t for t, _ in x.top]) for x in outs[0].prompt_logprobs[1:]]
    return [list(o.token_ids) for o in outs], scored, engine.stats()


def test_three_ranks_serve_the_tokens_of_one(lm):
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    got, scored, stats = serve_sharded(_generate, 3, args=(prompts,), config=CONFIG,
                                       dtype=torch.float32, timeout_s=60)
    want, want_scored, single = _generate(LLMEngine(lm.model, lm.tokenizer, CONFIG), prompts)
    assert got == want
    assert [(t, top) for t, _, top in scored] == [(t, top) for t, _, top in want_scored]
    assert [lp for _, lp, _ in scored] == pytest.approx([lp for _, lp, _ in want_scored], abs=1e-4)
    assert stats["steps"] == single["steps"]
    assert stats["kv_bytes"] * 3 == single["kv_bytes"]  # rank 0's pages hold 1 of 3 KV heads


def _copy(engine, prompt):
    """A greedy copy with n-gram drafts: its tokens and the speculative counts."""
    out = engine.generate([prompt], RequestParams(max_tokens=40))[0]
    return list(out.token_ids), {k: v for k, v in engine.stats().items() if k.startswith("spec_")}, engine.steps


def test_three_ranks_verify_drafts_as_one(lm):
    """Drafted rows (n-gram speculative decoding) run on every rank as any batch does."""
    from kvtier.serve.speculate import SpeculativeConfig

    text = "alpha, beta, gamma, delta, epsilon, zeta, eta, theta, iota, kappa"
    prompt = lm.tokenizer.encode(lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat exactly: {text}"}]), add_bos=False)
    config = dataclasses.replace(CONFIG, max_batched_tokens=64, speculative=SpeculativeConfig())
    got = serve_sharded(_copy, 3, args=(prompt,), config=config, dtype=torch.float32, timeout_s=60)
    plain = _copy(LLMEngine(lm.model, lm.tokenizer, dataclasses.replace(config, speculative=None)), prompt)
    assert got[0] == plain[0]
    assert got[1]["spec_accepted_tokens"] > 5 and got[2] < plain[2], got


def _failing(engine):
    engine.generate([[1, 2, 3]], RequestParams(max_tokens=2))  # the followers run these steps
    raise RuntimeError("the server fails on purpose")


def test_a_failing_server_stops_the_followers():
    with pytest.raises(TensorParallelError, match="rank 0 of 3: RuntimeError: the server fails"):
        serve_sharded(_failing, 3, config=CONFIG, dtype=torch.float32, timeout_s=60)


def test_async_scheduling_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="async_scheduling=True cannot serve sharded"):
        serve_sharded(_generate, 2, args=([[1, 2]],), config=dataclasses.replace(CONFIG, async_scheduling=True))


def test_a_taken_port_fails_before_any_rank_starts(monkeypatch, capsys):
    # before: every rank loaded the model (20 s on two cores), then rank 0 failed to bind
    import socket

    import kvtier.parallel.serve
    from kvtier import cli

    spawned = []
    monkeypatch.setattr(kvtier.parallel.serve, "serve_sharded", lambda *a, **k: spawned.append(a))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        rc = cli.main(["serve", "--tensor-parallel", "3", "--device", "cpu", "--port", str(port)])
    assert rc == 2 and not spawned
    err = capsys.readouterr().err
    assert err.startswith(f"kvtier: error: cannot listen on 127.0.0.1:{port} (") and "choose another --port" in err


def _return_to(engine, first, other):
    """``first``, then ``other`` (which takes its blocks), then ``first`` again: its tokens each
    time, the second time's cached tokens, the stats."""
    params = RequestParams(max_tokens=6)
    a = engine.generate([first], params)[0]
    engine.generate([other], params)
    again = engine.generate([first], params)[0]
    return list(a.token_ids), list(again.token_ids), again.cached_tokens, engine.stats()


def test_three_ranks_load_offloaded_prefixes_as_one(lm):
    """The host tier under tensor parallelism: each rank saves and loads its own shards of the
    blocks the broadcast batch names, so the evicted prefix comes back with one process's tokens."""
    first = lm.tokenizer.encode("You are a careful assistant. " * 24 + "Name a colour:")
    other = lm.tokenizer.encode("Answer briefly and plainly, please. " * 24 + "Name a fruit:")
    config = dataclasses.replace(CONFIG, num_blocks=len(first) // 16 + 4, max_batched_tokens=256,
                                 kv_offload_gib=0.02)
    got = serve_sharded(_return_to, 3, args=(first, other), config=config, dtype=torch.float32, timeout_s=60)
    want = _return_to(LLMEngine(lm.model, lm.tokenizer, config), first, other)
    assert got[:3] == want[:3] and got[0] == got[1]
    assert got[2] == (len(first) - 1) // 16 * 16 and got[3]["host_hits"] == want[3]["host_hits"] > 0
    assert abs(got[3]["host_blocks"] - want[3]["host_blocks"]) <= 1  # the GiB shared out: a third a rank


def _save(engine, first, path):
    a = engine.generate([first], RequestParams(max_tokens=6))[0]
    return list(a.token_ids), save_prefix_cache(engine, path)


def _refusal(fn, *args):
    try:
        fn(*args)
    except ValueError as e:
        return str(e)
    return None


def _restart(engine, first, damaged, path):
    """A load of a set of files one of which is damaged (refused, nothing booked), then the
    good set, then the prompt again; then a rank's path that is a folder, and a save that one
    rank fails (every file as it was)."""
    refused = _refusal(load_prefix_cache, engine, damaged)
    empty = engine.stats()["cached_blocks"]
    got = load_prefix_cache(engine, path)
    again = engine.generate([first], RequestParams(max_tokens=6))[0]
    folder = damaged.parent / "folder.safetensors"
    rank_path(folder, 1).mkdir()
    unwritable = _refusal(check_prefix_paths, engine, folder)
    before = [f.read_bytes() for f in (rank_path(path, r) for r in range(3))]
    engine.generate([[t + 1 for t in first[:40]]], RequestParams(max_tokens=6))  # blocks the files do not hold
    temporary = rank_path(path, 2).with_name(f".{rank_path(path, 2).name}.kvtier-tmp")
    temporary.mkdir()  # rank 2 cannot write its temporary file
    failed = _refusal(save_prefix_cache, engine, path)
    after = [f.read_bytes() for f in (rank_path(path, r) for r in range(3))]
    left = sorted(f.name for f in path.parent.glob(".*kvtier-tmp"))
    return (refused, empty, got, list(again.token_ids), again.cached_tokens, unwritable, failed,
            before == after, left)


def test_three_ranks_keep_their_prefix_cache_across_a_restart(lm, tmp_path):
    """Each rank writes its share of the blocks to its own file; three new ranks load them and
    answer from them with one process's tokens; one rank's damaged file refuses the whole set."""
    first = lm.tokenizer.encode("You are a careful assistant. " * 24 + "Name a colour:")
    path = tmp_path / "prefixes.safetensors"
    config = dataclasses.replace(CONFIG, max_batched_tokens=256)
    tokens, n = serve_sharded(_save, 3, args=(first, path), config=config, dtype=torch.float32, timeout_s=60)
    files = [rank_path(path, r) for r in range(3)]
    assert [f.name for f in files] == ["prefixes.safetensors", "prefixes.rank1.safetensors", "prefixes.rank2.safetensors"]
    assert n == (len(first) + 5) // 16 and all(f.is_file() for f in files)
    bad = tmp_path / "bad"
    bad.mkdir()
    for r, f in enumerate(files):
        data = bytearray(f.read_bytes())
        if r == 2:
            data[-100] ^= 1  # a byte of rank 2's last page tensor
        rank_path(bad / "prefixes.safetensors", r).write_bytes(bytes(data))
    refused, empty, got, again, cached, unwritable, failed, kept, left = serve_sharded(
        _restart, 3, args=(first, bad / "prefixes.safetensors", path), config=config, dtype=torch.float32,
        timeout_s=60)
    assert refused is not None and refused.startswith("rank 2: the prefix cache file") and "fails its checksum" in refused
    assert unwritable.startswith("rank 1: ") and "folder.rank1.safetensors is a directory" in unwritable
    assert failed.startswith("rank 2: IsADirectoryError") and kept  # no rank's file replaced
    assert left == [".prefixes.rank2.safetensors.kvtier-tmp"]  # (the folder made for the test): none written left
    assert empty == 0 and got == {"blocks": n, "pool": n, "host": 0, "left_out": 0}
    want = LLMEngine(lm.model, lm.tokenizer, config).generate([first], RequestParams(max_tokens=6))[0]
    assert tokens == again == list(want.token_ids) and cached == (len(first) - 1) // 16 * 16


def _begun(engine, first, path):
    """A save while the engine waits, new blocks, a save begun between steps (the ranks' files
    compared with a waiting save's); then rank 2's file damaged in place and a begun save refused."""
    params = RequestParams(max_tokens=6)
    engine.generate([first], params)
    save_prefix_cache(engine, path)
    engine.generate([[t + 1 for t in first[:40]]], params)
    save = begin_prefix_save(engine, path)
    while not save.written():
        pass
    save.finish()
    ref = path.with_name("ref.safetensors")
    save_prefix_cache(engine, ref)
    same = [rank_path(path, r).read_bytes() == rank_path(ref, r).read_bytes() for r in range(3)]
    two = rank_path(path, 2)
    st, data = two.stat(), bytearray(two.read_bytes())
    data[len(data) // 2] ^= 1  # a byte of a page tensor
    two.write_bytes(bytes(data))
    os.utime(two, ns=(st.st_atime_ns, st.st_mtime_ns))  # (to a stat, the file rank 2 wrote)
    engine.generate([[t + 2 for t in first[:40]]], params)
    before = [rank_path(path, r).read_bytes() for r in range(3)]
    again = begin_prefix_save(engine, path)
    refused = _refusal(lambda: [None for _ in iter(again.written, True)])
    again.discard()
    kept = before == [rank_path(path, r).read_bytes() for r in range(3)]
    return save.new_blocks, save.blocks, same, refused, kept, sorted(f.name for f in path.parent.glob(".*kvtier-tmp"))


def test_three_ranks_write_a_begun_save_as_one(tmp_path, lm):
    """Each rank copies the blocks new to its file and its thread writes the file; the files are
    renamed once all are written; one rank's failure leaves every file as it was."""
    first = lm.tokenizer.encode("You are a careful assistant. " * 24 + "Name a colour:")
    path = tmp_path / "prefixes.safetensors"
    config = dataclasses.replace(CONFIG, max_batched_tokens=256)
    new, blocks, same, refused, kept, left = serve_sharded(_begun, 3, args=(first, path), config=config,
                                                          dtype=torch.float32, timeout_s=60)
    assert 0 < new < blocks and same == [True] * 3
    assert refused.startswith("rank 2: ") and "fails its checksum since this server last wrote or read it" in refused
    assert kept and left == []
