"""Prompt cache: a second run reuses the saved prefix and gives the same tokens; a file
written for another model, tier or prompt is detected and the prompt recomputed."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvtier.config import KVCacheConfig
from kvtier.generate import GenerationConfig, stream_generate
from kvtier.prompt_cache import PromptCache, PromptCacheWarning

PROMPT = "Here is a long list of fruits: apples, pears, plums, cherries, grapes, and"
MORE = " lemons. The list goes on with"
CONFIG = GenerationConfig(max_tokens=6, stop_token_ids=())


def run(lm, text: str, pc: PromptCache | None, tier: str = "tail"):
    """Tokens of a greedy run and its final stats."""
    cfg = KVCacheConfig(tier=tier, paged_num_blocks=16)  # a small pool: 256 tokens
    responses = list(stream_generate(lm.model, lm.tokenizer, text, CONFIG, cache_config=cfg,
                                     prompt_cache=pc))
    return [r.token for r in responses], responses[-1].stats


@pytest.fixture(scope="module")
def baseline(lm):
    return {text: run(lm, text, None)[0] for text in (PROMPT, PROMPT + MORE)}


def fresh(tmp_path, lm, name="pc.safetensors") -> PromptCache:
    return PromptCache(tmp_path / name, model_source=str(lm.source))


@pytest.mark.parametrize("tier", ["tail", "paged"])
def test_second_run_reuses_the_prompt_and_gives_the_same_tokens(lm, baseline, tmp_path, tier):
    n = len(lm.tokenizer.encode(PROMPT))
    tokens, stats = run(lm, PROMPT, fresh(tmp_path, lm), tier)
    assert tokens == baseline[PROMPT]
    assert stats.prompt_cache_tokens_reused == 0
    assert (tmp_path / "pc.safetensors").is_file()
    tokens, stats = run(lm, PROMPT, fresh(tmp_path, lm), tier)
    assert tokens == baseline[PROMPT]
    # everything but the last prompt token, which feeds the first step
    assert stats.prompt_cache_tokens_reused == n - 1
    assert stats.prompt_tokens == n


def test_a_longer_prompt_reuses_the_common_prefix(lm, baseline, tmp_path):
    ids_short = lm.tokenizer.encode(PROMPT)
    ids_long = lm.tokenizer.encode(PROMPT + MORE)
    common = next(i for i, (a, b) in enumerate(zip(ids_short, ids_long)) if a != b) \
        if ids_long[: len(ids_short)] != ids_short else len(ids_short)
    run(lm, PROMPT, fresh(tmp_path, lm))
    tokens, stats = run(lm, PROMPT + MORE, fresh(tmp_path, lm))
    assert tokens == baseline[PROMPT + MORE]
    # the file held the short prompt but its last token
    assert stats.prompt_cache_tokens_reused == min(common, len(ids_short) - 1)
    # and now holds the long prompt: going back to the short one trims it
    tokens, stats = run(lm, PROMPT, fresh(tmp_path, lm))
    assert tokens == baseline[PROMPT]
    assert stats.prompt_cache_tokens_reused == len(ids_short) - 1


def _assert_recomputed(lm, baseline, pc, tier="tail", match=None):
    with pytest.warns(PromptCacheWarning, match=match):
        tokens, stats = run(lm, PROMPT, pc, tier)
    assert tokens == baseline[PROMPT]
    assert stats.prompt_cache_tokens_reused == 0


def test_mismatched_model_is_detected(lm, baseline, tmp_path):
    run(lm, PROMPT, fresh(tmp_path, lm))
    other = PromptCache(tmp_path / "pc.safetensors", model_source="/models/another.gguf")
    _assert_recomputed(lm, baseline, other, match="model")


def test_mismatched_tier_is_detected(lm, baseline, tmp_path):
    run(lm, PROMPT, fresh(tmp_path, lm), "tail")
    _assert_recomputed(lm, baseline, fresh(tmp_path, lm), "block", match="tier")
    # the file was rewritten for the block tier: now it is reused there
    _, stats = run(lm, PROMPT, fresh(tmp_path, lm), "block")
    assert stats.prompt_cache_tokens_reused > 0


def test_a_float16_tail_is_told_from_one_storing_what_the_model_computes(lm, tmp_path):
    """kv_dtype decides what the file's keys hold: before, a float16 cache was reused by a
    run that asked for full precision (and the other way round) without a word."""
    def reused(kv_dtype):
        cfg = KVCacheConfig(tier="tail", kv_dtype=kv_dtype)
        out = list(stream_generate(lm.model, lm.tokenizer, PROMPT, CONFIG, cache_config=cfg,
                                   prompt_cache=fresh(tmp_path, lm)))
        return out[-1].stats.prompt_cache_tokens_reused

    assert reused("float16") == 0
    with pytest.warns(PromptCacheWarning, match="tier .*kv_dtype"):
        assert reused(None) == 0
    assert reused(None) > 0
    with pytest.warns(PromptCacheWarning, match="tier"):
        assert reused("float16") == 0


def test_a_file_that_cannot_be_written_warns_and_the_generation_goes_on(lm, baseline, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):  # a read-only mount, a full disk
        raise PermissionError(13, "Permission denied", str(tmp_path / "pc.safetensors"))

    monkeypatch.setattr("kvtier.caches.persist.save_cache", refuse)
    with pytest.warns(PromptCacheWarning, match="was not saved .*Permission denied.*goes on without it"):
        tokens, _ = run(lm, PROMPT, fresh(tmp_path, lm))
    assert tokens == baseline[PROMPT]  # before: the PermissionError ended the run after prefill


def test_prompt_without_common_prefix_is_recomputed(lm, baseline, tmp_path):
    run(lm, "Completely different words to start with", fresh(tmp_path, lm))
    ids = lm.tokenizer.encode("Completely different words to start with")
    if ids[0] == lm.tokenizer.encode(PROMPT)[0]:
        pytest.skip("the two prompts share their first token under this tokenizer")
    _assert_recomputed(lm, baseline, fresh(tmp_path, lm), match="no prefix")


def test_damaged_file_is_detected(lm, baseline, tmp_path):
    path = tmp_path / "pc.safetensors"
    run(lm, PROMPT, fresh(tmp_path, lm))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _assert_recomputed(lm, baseline, fresh(tmp_path, lm), match="cannot be read")


@pytest.mark.parametrize("damage", ["flip near the start", "a byte of the header", "cut inside the header"])
def test_a_damaged_header_is_recomputed_and_rewritten_not_refused_as_foreign(lm, baseline, tmp_path, damage):
    path = tmp_path / "pc.safetensors"
    run(lm, PROMPT, fresh(tmp_path, lm, "pc.safetensors"), "paged")
    data = bytearray(path.read_bytes())
    if damage == "flip near the start":
        data[20] ^= 4  # the metadata key's name: the JSON parses, its format is gone
    elif damage == "a byte of the header":
        data[5000] = 1  # a control byte: the JSON does not parse
    else:
        data = data[:3000]
    path.write_bytes(bytes(data))
    # before: "exists and is not a kvtier cache file; saving would overwrite it"
    _assert_recomputed(lm, baseline, fresh(tmp_path, lm), "paged", match="cannot be read")
    assert run(lm, PROMPT, fresh(tmp_path, lm), "paged")[1].prompt_cache_tokens_reused > 0  # rewritten


def test_a_file_of_plain_caches_is_not_taken_for_a_prompt_cache(lm, baseline, tmp_path):
    from kvtier.caches.persist import save_cache

    caches = lm.model.make_caches(KVCacheConfig())
    with torch.inference_mode():
        lm.model(torch.tensor([lm.tokenizer.encode(PROMPT)[:-1]]), caches)
    save_cache(tmp_path / "pc.safetensors", caches, {"model": "x"})
    _assert_recomputed(lm, baseline, fresh(tmp_path, lm), match="record")


def test_missing_file_is_created_without_warning(lm, tmp_path):
    (tmp_path / "sub").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PromptCacheWarning)
        run(lm, PROMPT, fresh(tmp_path, lm, "sub/pc.safetensors"))
    assert (tmp_path / "sub/pc.safetensors").is_file()


def test_paths_that_cannot_be_saved_to_are_refused_at_once(lm, tmp_path):
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "fifo")
    for name, what in [("folder", "is a directory"), ("fifo", "is a FIFO"),
                       ("link", "is a FIFO .*through a symlink"),
                       ("missing/pc.safetensors", "folder .*missing does not exist")]:
        with pytest.raises(ValueError, match=what):
            fresh(tmp_path, lm, name)
    assert not (tmp_path / "missing").exists() and (tmp_path / "fifo").is_fifo()


def _crafted_copy(path, change_meta):
    """Rewrite a saved prompt cache with layer 0's meta_state changed and valid checksums,
    as a crafted file would be."""
    import kvtier.caches.persist as persist

    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        header = dict(f.metadata())
    layers = json.loads(header["layers"])
    change_meta(layers[0]["meta_state"])
    header["layers"] = json.dumps(layers)
    header["header_crc"] = persist._header_crc(header)
    save_file(tensors, str(path), metadata=header)


def test_crafted_or_bit_flipped_files_are_recomputed(lm, baseline, tmp_path):
    """A file whose fields are wrong (with valid checksums), or whose header lost a bit
    (a prompt token id), warns and recomputes: the same tokens, nothing reused."""
    path = tmp_path / "pc.safetensors"
    run(lm, PROMPT, fresh(tmp_path, lm), "ragged")
    _crafted_copy(path, lambda m: m.update(step=0))  # a ZeroDivisionError before
    _assert_recomputed(lm, baseline, fresh(tmp_path, lm), "ragged", match="cannot be read.*step")
    _crafted_copy(path, lambda m: m.update(frozen="false"))
    _assert_recomputed(lm, baseline, fresh(tmp_path, lm), "ragged", match="frozen")
    data = bytearray(path.read_bytes())
    at = data.index(b'tokens\\": [') + len(b'tokens\\": [')  # escaped inside the header's JSON
    data[at] ^= 1  # one bit of the first token id's first digit: another digit
    path.write_bytes(bytes(data))
    _assert_recomputed(lm, baseline, fresh(tmp_path, lm), "ragged", match="checksum")


def test_the_command_line_warns_and_recomputes_or_refuses_the_path(lm, tmp_path, capsys,
                                                                   monkeypatch):
    from kvtier import cli, cli_run

    monkeypatch.setattr(cli_run, "_load", lambda args: lm)
    path = tmp_path / "pc.safetensors"
    argv = ["generate", PROMPT, "--raw", "--max-tokens", "4", "--json", "--prompt-cache"]
    assert cli.main([*argv, str(path)]) == 0
    first = json.loads(capsys.readouterr().out)["tokens"]
    _crafted_copy(path, lambda m: m.update(offset=-1))
    assert cli.main([*argv, str(path)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["tokens"] == first
    assert "kvtier: warning: prompt cache" in err and "recomputing" in err
    os.mkfifo(tmp_path / "fifo")
    assert cli.main([*argv, str(tmp_path / "fifo")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: ") and "is a FIFO" in err and len(err.splitlines()) == 1
    notes = tmp_path / "notes.txt"  # --prompt-cache pointed at a file of something else
    notes.write_text("my notes")
    assert cli.main([*argv, str(notes)]) == 2
    assert "not a kvtier cache file; saving would overwrite it" in capsys.readouterr().err
    assert notes.read_text() == "my notes"


def test_prompt_cache_serves_one_prompt(lm, tmp_path):
    with pytest.raises(ValueError, match="one prompt"):
        list(stream_generate(lm.model, lm.tokenizer, [PROMPT, PROMPT + MORE], CONFIG,
                             cache_config=KVCacheConfig(), prompt_cache=fresh(tmp_path, lm)))
    with pytest.raises(ValueError, match="model_source"):
        PromptCache(tmp_path / "x", model_source="")


@pytest.mark.parametrize("storage", [{"kv_quant": "fp8"}, {"turboquant": "q5_0r,q4_0"}],
                         ids=["fp8", "q5_0r,q4_0"])
def test_restored_pages_keep_their_codes_in_this_runs_pool(lm, tmp_path, storage):
    """A restored paged cache takes the configured pool (the file's was sized for the run
    that wrote it) with the file's pages as they are: before, the command line converted
    it, and fp8 keys and TurboQuant values were coded again (other tokens came out)."""
    from kvtier.caches.persist import load_cache
    from kvtier.quant.modes import parse_turboquant

    if "turboquant" in storage:
        storage = {"turboquant": parse_turboquant(storage["turboquant"])}
    small = KVCacheConfig(tier="paged", paged_num_blocks=2, **storage)
    ids = lm.tokenizer.encode(PROMPT)
    list(stream_generate(lm.model, lm.tokenizer, PROMPT, CONFIG, cache_config=small,
                         prompt_cache=fresh(tmp_path, lm)))
    saved, _ = load_cache(tmp_path / "pc.safetensors")
    wide = KVCacheConfig(tier="paged", paged_num_blocks=9, **storage)
    caches, reused = fresh(tmp_path, lm).restore(lm.model, ids, wide)
    assert reused == len(ids) - 1
    for was, now in zip(saved, caches):
        assert now.pool.num_blocks == 9 and now.lengths == was.lengths
        blocks = [now.pool.rows[0], was.pool.rows[0]]
        for name in ("key_cache", "value_cache"):
            mine, theirs = (getattr(c.pool, name)[b] for c, b in zip((now, was), blocks))
            assert torch.equal(mine, theirs), name
        for side in ("k_sidecars", "v_sidecars"):
            for key, t in getattr(now.pool, side).items():
                assert torch.equal(t[blocks[0]], getattr(was.pool, side)[key][blocks[1]]), key
        centre = was.codecs.k_codec.centre
        assert centre is None or torch.equal(now.codecs.k_codec.centre, centre)
