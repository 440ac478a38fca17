"""The command line: `kvtier generate` answers on the default model, its JSON parses, stdin
works, flags override the environment, and mistakes give a clear error and a non-zero exit."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys

import pytest
import torch

from kvtier import cli

QUESTION = "What is the capital of France?"


@pytest.fixture(autouse=True)
def loaded_once(lm, monkeypatch):
    """The default model comes from this module's copy (the first test loads it for real
    in a subprocess); an explicit --model path still goes through the real loader."""
    import kvtier.model

    real = kvtier.model.load_model

    def load(path=None, **kw):
        return lm if path is None else real(path, **kw)

    monkeypatch.setattr(kvtier.model, "load_model", load)
    for name in [k for k in os.environ if k.startswith(("KVTIER_", "MTPLX_"))]:
        monkeypatch.delenv(name)


def main_json(capsys, *argv: str) -> dict:
    assert cli.main(list(argv) + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_answers_paris_on_the_default_model():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "MTPLX_"))}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "generate", QUESTION, "--max-tokens", "24"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    summary = proc.stderr.strip().splitlines()[-1]
    assert "prefill" in summary and "decode" in summary and "tier tail" in summary


def test_json_output(capsys, lm):
    out = main_json(capsys, "generate", QUESTION, "--max-tokens", "8")
    tok = lm.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": QUESTION}])
    assert out["prompt_tokens"] == tok.encode(chat, add_bos=False)
    assert 1 <= len(out["tokens"]) <= 8
    text_tokens = [t for t in out["tokens"] if t not in tok.eos_token_ids]
    assert out["text"] == tok.decode(text_tokens)
    assert "Paris" in out["text"]
    assert out["finish_reason"] in ("stop", "length")
    assert out["timings"]["prefill_tokens_per_s"] > 0
    assert out["timings"]["generation_tokens"] == len(out["tokens"])
    assert out["cache"]["tier"] == "tail"
    assert out["cache"]["layer0"]["offset"] == len(out["prompt_tokens"]) + len(out["tokens"]) - 1


def test_text_streams_to_stdout_and_the_summary_goes_to_stderr(capsys):
    assert cli.main(["generate", QUESTION, "--max-tokens", "8"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    assert "[kvtier]" not in captured.out and "[kvtier] prompt" in captured.err


def test_prompt_from_stdin(capsys, lm, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("The capital of France is"))
    out = main_json(capsys, "generate", "--raw", "--max-tokens", "3")
    assert out["prompt_tokens"] == lm.tokenizer.encode("The capital of France is")
    assert len(out["tokens"]) == 3


def test_flags_override_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("KVTIER_OWNED_ATTN_KV", "block")
    out = main_json(capsys, "generate", "Hi", "--raw", "--max-tokens", "2")
    assert out["cache"]["tier"] == "block"
    out = main_json(capsys, "generate", "Hi", "--raw", "--max-tokens", "2", "--tier", "tail")
    assert out["cache"]["tier"] == "tail"
    out = main_json(capsys, "generate", "Hi", "--raw", "--max-tokens", "2", "--kv-quant", "q8")
    assert out["cache"]["tier"] == "paged" and out["cache"]["layer0"]["mode"] == "q8"


def test_sampling_flags_with_a_seed_repeat(capsys):
    argv = ("generate", "Tell me a story:", "--raw", "--max-tokens", "5", "--temperature", "0.9",
            "--top-k", "40", "--top-p", "0.9", "--min-p", "0.05", "--seed", "3")
    assert main_json(capsys, *argv)["tokens"] == main_json(capsys, *argv)["tokens"]


def test_prompt_cache_flag(capsys, tmp_path):
    argv = ("generate", QUESTION, "--max-tokens", "4", "--prompt-cache", str(tmp_path / "p.st"))
    first = main_json(capsys, *argv)
    second = main_json(capsys, *argv)
    assert first["timings"]["prompt_cache_tokens_reused"] == 0
    assert second["timings"]["prompt_cache_tokens_reused"] == len(second["prompt_tokens"]) - 1
    assert second["tokens"] == first["tokens"]


def test_missing_model_file(capsys, tmp_path):
    missing = tmp_path / "nowhere.gguf"
    assert cli.main(["generate", "Hi", "--model", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "nowhere.gguf" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--turboquant", "q8_0"], "KEY,VALUE"),
        (["--turboquant", "q9_0,q3_0"], "q9_0"),
        (["--kv-quant", "q8", "--tier", "tail"], "paged"),
    ],
)
def test_bad_flag_values_give_a_clear_error(capsys, argv, words):
    assert cli.main(["generate", "Hi", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error:") and words in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["--tier", "bogus"], ["--temperature", "hot"], ["--dtype", "int8"]])
def test_unparsable_flag_values_exit_with_usage(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "Hi", *argv])
    assert exc.value.code == 2
    assert "invalid" in capsys.readouterr().err


def test_bad_environment_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setenv("KVTIER_OWNED_ATTN_KV", "sideways")
    assert cli.main(["generate", "Hi"]) == 2
    assert "KVTIER_OWNED_ATTN_KV" in capsys.readouterr().err


def test_no_prompt_and_no_stdin(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert cli.main(["generate"]) == 2
    assert "empty" in capsys.readouterr().err


def test_info(capsys, monkeypatch):
    monkeypatch.setenv("KVTIER_PAGED_ATTN", "1")
    out = main_json(capsys, "info")
    assert out["tier"] == "paged" and out["cache_config"]["tier"] == "paged"
    assert out["torch"] == torch.__version__
    assert out["model_args"]["n_layers"] == 30 and out["dtype"] == "float32"
    out = main_json(capsys, "info", "--tier", "block")
    assert out["tier"] == "block"


def test_eval_ppl_and_kl(capsys):
    small = ("--context", "16", "--max-tokens", "40", "--chunk", "8")
    out = main_json(capsys, "eval", "ppl", *small, "--modes", "fp,q8")
    modes = {m["mode"]: m for m in out["modes"]}
    assert set(modes) == {"fp", "q8"}
    assert modes["fp"]["delta_pct"] == 0.0 and modes["q8"]["bits_per_element"] == 8.5
    assert set(modes["q8"]) == {"mode", "ppl", "delta_pct", "bits_per_element"}
    assert cli.main(["eval", "kl", *small, "--modes", "q8"]) == 0
    table = capsys.readouterr().out
    assert "q8" in table and "top-1" in table


def test_eval_missing_file(capsys, tmp_path):
    assert cli.main(["eval", "ppl", "--file", str(tmp_path / "none.txt")]) == 2
    assert "none.txt" in capsys.readouterr().err


def _bench_choices() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    bench = sub.choices["bench"]
    return next(a for a in bench._actions if a.dest == "bench").choices


def test_bench_subcommands_are_the_modules_of_kvtier_bench(capsys, tmp_path, monkeypatch):
    import kvtier_bench

    names = _bench_choices()
    assert sorted(names) == kvtier_bench.names()
    assert {"append", "paged", "decode_gpu"} <= set(names) and "_memory" not in names
    assert names["paged"].description == "Bytes per token, fragmentation and codec error of the paged tier"
    # a module dropped into the package is a subcommand by its name, with nothing to register
    (tmp_path / "probe_bench.py").write_text(
        '"""A probe.\n"""\n\ndef add_arguments(parser):\n    parser.add_argument("--n", type=int)\n\n\n'
        "def run(args):\n    print('probe', args.n)\n    return 0\n")
    monkeypatch.setattr(kvtier_bench, "__path__", [*kvtier_bench.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, "kvtier_bench.probe_bench", raising=False)
    try:
        assert _bench_choices()["probe_bench"].description == "A probe"
        assert cli.main(["bench", "probe_bench", "--n", "3"]) == 0
        assert capsys.readouterr().out == "probe 3\n"
    finally:
        sys.modules.pop("kvtier_bench.probe_bench", None)


def test_bench_without_kvtier_bench_says_how_to_install_it(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvtier_bench", None)  # kvtier installed without the checkout
    assert cli.main(["bench", "paged", "--sequences", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kvtier bench paged" in err and "pip install -e ." in err
