"""Perplexity through the caches: equal to a direct computation, the same on every tier,
and quantised modes measured through their own storage."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.config import KVCacheConfig
from kvtier.evaluate import (
    EvalConfig,
    default_text,
    encode_text,
    evaluate_modes,
    mode_config,
    parse_modes,
    windows,
)
from kvtier.quant import TurboQuantConfig

SMALL = dict(context=48, stride=32, max_tokens=96, chunk=16)


@pytest.fixture(scope="module")
def tokens(lm):
    return lm.tokenizer.encode(default_text()[:4000])


def reference_ppl(model, tokens, context, stride, max_tokens) -> float:
    """Sliding-window perplexity from one plain forward per window (no chunking).

    Windows advance by ``stride`` but start at most one token before the first
    token they score, so every token after the first is scored once.
    """
    ids = torch.tensor(tokens[:max_tokens])
    nll, count, scored_to, begin = 0.0, 0, 1, 0
    with torch.inference_mode():
        while scored_to < len(ids):
            begin = min(begin, scored_to - 1)
            end = min(begin + context, len(ids))
            caches = model.make_caches(KVCacheConfig(tier="tail"))
            logits = model(ids[None, begin:end], caches)[0]  # (T, V): logits[i] predicts i + 1
            pred = logits[scored_to - 1 - begin : end - 1 - begin]
            nll += torch.nn.functional.cross_entropy(pred, ids[scored_to:end], reduction="sum").item()
            count += end - scored_to
            scored_to, begin = end, begin + stride
    assert count == len(ids) - 1
    return math.exp(nll / count)


@pytest.fixture(scope="module")
def tail_fp(lm, tokens):
    return evaluate_modes(lm.model, tokens, EvalConfig(modes=("fp",), tier="tail", **SMALL))[0]


def test_fp_perplexity_equals_a_direct_computation(lm, tokens, tail_fp):
    ref = reference_ppl(lm.model, tokens, SMALL["context"], SMALL["stride"], SMALL["max_tokens"])
    assert tail_fp.tokens == SMALL["max_tokens"] - 1
    assert tail_fp.ppl == pytest.approx(ref, rel=1e-5)
    assert tail_fp.kl == 0.0 and tail_fp.top1 == 1.0 and tail_fp.delta_pct == 0.0
    assert tail_fp.bits_per_element == 32.0  # float32 keys and values


def test_off_is_full_precision_and_keeps_its_label(lm, tokens, tail_fp):
    got = evaluate_modes(lm.model, tokens, EvalConfig(modes=("off", "q8"), tier="tail", **SMALL))
    assert [r.mode for r in got] == ["off", "q8"]
    assert got[0] == dataclasses.replace(tail_fp, mode="off")
    assert got[1].kl > 0.0 and got[1].delta_pct == pytest.approx(100 * (got[1].ppl / tail_fp.ppl - 1))


@pytest.mark.parametrize("tier", ["block", "ragged", "paged"])
def test_fp_perplexity_is_the_same_through_every_tier(lm, tokens, tail_fp, tier):
    got = evaluate_modes(lm.model, tokens, EvalConfig(modes=("fp",), tier=tier, **SMALL))[0]
    # the block tier merges per-block softmax partials: float32 rounding differs by ~1e-6
    # relative in the perplexity (a wrong key or position moves it by percents)
    assert got.ppl == pytest.approx(tail_fp.ppl, rel=1e-5)
    assert got.tokens == tail_fp.tokens


def test_quantised_modes_go_through_their_storage(lm, tokens, tail_fp):
    modes = ("q8", "q4_g32", "turboquant")
    results = evaluate_modes(lm.model, tokens, EvalConfig(modes=modes, **SMALL))
    by_mode = {r.mode: r for r in results}
    assert tuple(by_mode) == modes  # fp is computed as the reference but not reported
    # bits per element with sidecars, by hand for head_dim 64:
    # q8: 8 + one fp32 scale per 64; q4_g32: 4 + one fp32 scale per 32;
    # TurboQuant: K q8_0 = 8 + fp16 scale and zero per 32, V q3_0 = 3 + fp16 scale per 32
    assert by_mode["q8"].bits_per_element == pytest.approx(8 + 32 / 64)
    assert by_mode["q4_g32"].bits_per_element == pytest.approx(4 + 32 / 32)
    assert by_mode["turboquant"].bits_per_element == pytest.approx(((8 + 32 / 32) + (3 + 16 / 32)) / 2)
    for r in results:
        # quantisation really happened (the distributions moved) and stayed close
        assert 0.0 < r.kl < 0.5
        assert abs(r.delta_pct - 100 * (r.ppl / tail_fp.ppl - 1)) < 1e-3
    assert abs(by_mode["q8"].delta_pct) < 2.0
    assert by_mode["q8"].kl < by_mode["q4_g32"].kl


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 300), context=st.integers(2, 64), data=st.data())
def test_windows_score_every_token_once(n, context, data):
    stride = data.draw(st.integers(1, context))
    scored = []
    for begin, end, first in windows(n, context, stride):
        assert end - begin <= context and begin < first <= end
        scored.extend(range(first, end))
    assert scored == list(range(1, n))


def test_mode_names():
    assert mode_config("fp").tier == "paged"
    assert mode_config("fp", fp_tier="block").tier == "block"
    assert mode_config("off", fp_tier="block") == mode_config("fp", fp_tier="block")
    assert mode_config("q4").kv_quant == "q4" and mode_config("q4").tier == "paged"
    assert mode_config("turboquant").turboquant == TurboQuantConfig()
    # a quantised base never leaks into fp, nor a TurboQuant base into a KV-Quant mode
    assert mode_config("fp", KVCacheConfig(tier="paged", kv_quant="q8")).kv_quant is None
    base = KVCacheConfig(turboquant=TurboQuantConfig(), paged_block_size=32)
    assert mode_config("q8", base) == KVCacheConfig(tier="paged", kv_quant="q8", paged_block_size=32)
    assert mode_config("turboquant:q5_0r,q4_0").turboquant == TurboQuantConfig("q5_0", "q4_0", rotate_keys=True)
    assert mode_config("turboquant:q8_0,q3_0").turboquant == TurboQuantConfig("q8_0", "q3_0")
    assert parse_modes("fp, q8,turboquant:q5_0r,q4_0,turboquant,TurboQuant:q8_0,q3_0") == (
        "fp", "q8", "turboquant:q5_0r,q4_0", "turboquant", "TurboQuant:q8_0,q3_0")


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"modes": ("fp", "q3")}, "q3"),
        ({"modes": ("turboquant:q8_0",)}, "KEY,VALUE"),
        ({"modes": ("turboquant:q9_0,q3_0",)}, "key code"),
        ({"modes": ("q8", "q8")}, "twice"),
        ({"modes": ("fp", "off")}, "twice"),
        ({"modes": ("turboquant", "turboquant:q8_0,q3_0")}, "twice"),
        ({"modes": ()}, "modes"),
        ({"context": 1}, "context"),
        ({"stride": 0}, "stride"),
        ({"context": 16, "stride": 32}, "stride"),
        ({"max_tokens": 1}, "max_tokens"),
        ({"tier": "dense"}, "tier"),
    ],
)
def test_eval_config_checks_its_fields(kwargs, word):
    with pytest.raises(ValueError, match=word):
        EvalConfig(**kwargs)


def test_encode_text_stops_at_max_tokens(lm):
    text = default_text()[:3000]
    full = lm.tokenizer.encode(text)
    assert encode_text(lm.tokenizer, text, 50) == full[:50]
    assert encode_text(lm.tokenizer, text, None) == full
    assert encode_text(lm.tokenizer, text, 10**6) == full


def test_too_little_text(lm):
    with pytest.raises(ValueError, match="at least 2"):
        evaluate_modes(lm.model, [5], EvalConfig(modes=("fp",)))


def test_a_window_longer_than_the_models_positions_is_refused(lm, tokens):
    limit = lm.model.args.max_position_embeddings
    with pytest.raises(ValueError, match=f"context {limit + 1} is longer than the model's {limit} positions"):
        evaluate_modes(lm.model, tokens, EvalConfig(context=limit + 1, modes=("fp",)))
    short = evaluate_modes(lm.model, tokens[:40], EvalConfig(context=limit, modes=("fp",)))
    assert short[0].tokens == 39  # one window of the whole text


def test_eval_refuses_a_device_file_and_an_empty_mode_list_in_one_line(capsys):
    from kvtier import cli

    # /dev/zero was read until memory ran out, then "kvtier: error: " with nothing after it
    assert cli.main(["eval", "ppl", "--device", "cpu", "--file", "/dev/zero"]) == 2
    assert capsys.readouterr().err == ("kvtier: error: --file /dev/zero is a device, not a text file; give a "
                                       "text file (or a pipe: --file <(command))\n")
    # before: "modes must be a non-empty tuple of mode names, got ()", naming no flag
    assert cli.main(["eval", "ppl", "--device", "cpu", "--modes", " , "]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: --modes ' , ' names no mode; give a comma-separated list such as fp,q8")


def test_a_bare_memory_error_is_named(capsys, monkeypatch):
    from kvtier import cli, cli_run

    def out_of_memory(args):
        raise MemoryError

    monkeypatch.setattr(cli_run, "run_eval", out_of_memory)
    assert cli.main(["eval", "ppl", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == "kvtier: error: MemoryError\n"


@pytest.mark.parametrize("text, argv, message", [
    ("   \n\n\t  \n", [], "holds no text (only whitespace); give a text to score"),  # before: ppl 68,689.8
    ("a", [], "the text holds 1 token; a perplexity needs at least 2 (one scored): give a longer text"),
    ("a b c d", ["--max-tokens", "1"], "--max-tokens must be an int >= 2, got 1"),  # before: max_tokens ... or None
    ("a b c d", ["--stride", "0"], "--stride must be an int in [1, context="),
])
def test_eval_names_its_flags_and_refuses_blank_text(capsys, monkeypatch, tmp_path, lm, text, argv, message):
    from kvtier import cli, cli_run

    monkeypatch.setattr(cli_run, "_load", lambda args: lm)
    path = tmp_path / "t.txt"
    path.write_text(text)
    assert cli.main(["eval", "ppl", "--device", "cpu", "--modes", "fp", "--file", str(path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: ") and message in err


def test_eval_of_a_few_tokens_warns_that_its_figure_is_noise(capsys, monkeypatch, tmp_path, lm):
    from kvtier import cli, cli_run

    monkeypatch.setattr(cli_run, "_load", lambda args: lm)
    path = tmp_path / "t.txt"
    path.write_text("The quick brown fox jumps over the lazy dog.")
    assert cli.main(["eval", "ppl", "--device", "cpu", "--modes", "fp", "--file", str(path), "--json"]) == 0
    out, err = capsys.readouterr()
    scored = json.loads(out)["tokens"]
    assert f"kvtier: warning: {scored} tokens are scored; a perplexity over so few is noise" in err
