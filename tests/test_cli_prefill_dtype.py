"""``--prefill-dtype`` on the command line: a bfloat16 prefill of the default model still
answers, says so, and is refused or warned about where it cannot help."""

from __future__ import annotations

import json

import pytest

from kvtier import cli
from test_cli import loaded_once, main_json  # noqa: F401 (loaded_once: the autouse fixture)

#: a prompt of well over 64 tokens (the bound past which a forward multiplies in bfloat16)
LONG = "Here is some background. " * 30 + "Question: What is the capital of France? Answer in one word."


@pytest.fixture(autouse=True)
def own_setting(lm, monkeypatch):
    monkeypatch.setattr(lm.model, "prefill_dtype", None, raising=False)  # (--prefill-dtype sets it)


def test_a_bfloat16_prefill_answers_and_says_so(capsys, monkeypatch, lm):
    argv = ("generate", LONG, "--max-tokens", "8")
    out = main_json(capsys, *argv, "--prefill-dtype", "bfloat16")
    assert out["prefill_dtype"] == "bfloat16" and "Paris" in out["text"]
    assert len(out["prompt_tokens"]) > 64
    assert cli.main(list(argv)) == 0  # (the model's setting stays: the flag set it)
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("| bfloat16 prefill")
    lm.model.prefill_dtype = None
    assert main_json(capsys, *argv)["prefill_dtype"] == "float32"  # the default
    monkeypatch.setenv("KVTIER_PREFILL_DTYPE", "bfloat16")
    info = main_json(capsys, "info")
    assert info["prefill_dtype"] == "bfloat16"
    from kvtier.kernels.native import _cpu_flags

    flags = set(_cpu_flags().split())  # /proc/cpuinfo's, against PyTorch's own probes
    if flags:
        assert info["cpu_bfloat16"] is bool(flags & {"amx_tile", "avx512_bf16"})
    assert main_json(capsys, "info", "--prefill-dtype", "float32")["prefill_dtype"] == "float32"  # the flag wins


def test_a_bad_setting_is_refused_before_the_model_loads(capsys, monkeypatch):
    import kvtier.model

    monkeypatch.setattr(kvtier.model, "load_model", lambda *a, **kw: pytest.fail("the model loaded"))
    monkeypatch.setenv("KVTIER_PREFILL_DTYPE", "half")
    assert cli.main(["generate", "Hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: KVTIER_PREFILL_DTYPE='half' is unknown; accepted: float32, bfloat16")
    assert "Traceback" not in err
    with pytest.raises(SystemExit):
        cli.main(["generate", "Hi", "--prefill-dtype", "float16"])
    assert "invalid choice: 'float16'" in capsys.readouterr().err


def test_a_bfloat16_model_is_warned_that_the_flag_does_nothing(capsys, lm, monkeypatch):
    import torch

    import kvtier.model

    monkeypatch.setattr(kvtier.model, "load_model", lambda *a, **kw: lm)
    monkeypatch.setattr(lm.model.tok_embeddings.weight, "data", lm.model.tok_embeddings.weight.data.to(torch.bfloat16))
    assert cli.main(["info", "--prefill-dtype", "bfloat16", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["prefill_dtype"] == "bfloat16"  # the model's own dtype
    assert "kvtier: warning: --prefill-dtype bfloat16 (KVTIER_PREFILL_DTYPE) has no effect on a bfloat16 model" in err


def test_eval_ppl_records_the_prefill_dtype_and_moves_little(capsys):
    """Chunks of 100 tokens a forward (more than 64): in bfloat16 the perplexity moves, a little."""
    small = ("eval", "ppl", "--context", "200", "--chunk", "100", "--max-tokens", "201", "--modes", "fp")
    exact = main_json(capsys, *small)
    narrow = main_json(capsys, *small, "--prefill-dtype", "bfloat16")
    assert (exact["prefill_dtype"], narrow["prefill_dtype"]) == ("float32", "bfloat16")
    p32, p16 = exact["modes"][0]["ppl"], narrow["modes"][0]["ppl"]
    assert p16 != p32 and abs(p16 / p32 - 1) < 0.01
    assert cli.main([*small, "--prefill-dtype", "bfloat16"]) == 0
    assert "chunks multiplied in bfloat16" in capsys.readouterr().out
