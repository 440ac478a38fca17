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
    monkeypatch.setattr(lm.model, "act_quant", None, raising=False)  # (--act-quant sets it)
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
    for text in ("The capital of France is", "\ufeffThe capital of France is"):  # a BOM is no prompt
        monkeypatch.setattr(sys, "stdin", io.StringIO(text))
        out = main_json(capsys, "generate", "--raw", "--max-tokens", "3")
        assert out["prompt_tokens"] == lm.tokenizer.encode("The capital of France is")
        assert len(out["tokens"]) == 3


def test_prompt_flag_is_the_argument(capsys, lm):
    argv = ("--raw", "--max-tokens", "3")
    by_argument = main_json(capsys, "generate", "The capital of France is", *argv)
    assert by_argument["prompt_tokens"] == lm.tokenizer.encode("The capital of France is")
    for flag in ("--prompt", "-p"):
        by_flag = main_json(capsys, "generate", flag, "The capital of France is", *argv)
        assert (by_flag["prompt_tokens"], by_flag["tokens"]) == (by_argument["prompt_tokens"], by_argument["tokens"])
    assert cli.main(["generate", "one", "--prompt", "two"]) == 2
    assert "two prompts" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["generate", "--prompt-c", "f.st", "hi"], ["generate", "hi", "--max-tok", "3"],
                                  ["serve", "--po", "1"], ["eval", "ppl", "--cont", "64"]])
def test_abbreviated_flags_are_refused(capsys, tmp_path, monkeypatch, argv):
    """``--prompt-c`` is not ``--prompt-cache`` (which would write a file), nor ``--po`` ``--port``."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_flags_override_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("KVTIER_OWNED_ATTN_KV", "block")
    out = main_json(capsys, "generate", "Hi", "--raw", "--max-tokens", "2")
    assert out["cache"]["tier"] == "block"
    out = main_json(capsys, "generate", "Hi", "--raw", "--max-tokens", "2", "--tier", "tail")
    assert out["cache"]["tier"] == "tail"
    out = main_json(capsys, "generate", "Hi", "--raw", "--max-tokens", "2", "--kv-quant", "q8")
    assert out["cache"]["tier"] == "paged" and out["cache"]["layer0"]["mode"] == "q8"
    # a storage flag names the whole storage: the other codec's variable does not stay
    monkeypatch.setenv("KVTIER_PAGED_TURBOQUANT", "1")
    out = main_json(capsys, "generate", "Hi", "--raw", "--max-tokens", "2", "--kv-quant", "q8")
    assert out["cache"]["layer0"]["mode"] == "q8"  # before: TurboQuant's pages, without a word
    monkeypatch.delenv("KVTIER_PAGED_TURBOQUANT")
    monkeypatch.setenv("KVTIER_PAGED_KV_QUANT", "q8")
    config = main_json(capsys, "info", "--turboquant", "q8_0,q3_0")["cache_config"]
    assert config["kv_quant"] is None and config["turboquant"]["value_quant"] == "q3_0"


def test_the_paged_pool_is_never_sized_past_the_context(capsys, lm):
    """--max-tokens far past the context sized a pool of 100,000 tokens (4.4 GiB) that no
    request can fill; it now holds at most the model's 8,192 positions."""
    out = main_json(capsys, "generate", QUESTION, "--tier", "paged", "--max-tokens", "100000")
    a = lm.args
    per_token = 2 * a.n_layers * a.n_kv_heads * a.head_dim * 4
    assert out["cache"]["nbytes"] <= a.max_position_embeddings * per_token


def test_text_a_terminal_cannot_encode_is_replaced():
    """stdout in ASCII (PYTHONIOENCODING=ascii): before, the stream died at the first accent."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "MTPLX_"))}
    done = subprocess.run([sys.executable, "-m", "kvtier.cli", "generate", "é é é é é é é é", "--raw",
                           "--max-tokens", "4"], capture_output=True, env={**env, "PYTHONIOENCODING": "ascii"},
                          timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    assert b"?" in done.stdout and b"Traceback" not in done.stderr


def test_a_reader_that_goes_away_ends_the_run_quietly():
    """kvtier info | head -c 0: the reader is gone before the output comes; before, a
    BrokenPipeError traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "MTPLX_"))}
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "info"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # at once: the model loads for seconds before info writes
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141 and "Traceback" not in err, err


def test_kv_dtype_stores_float16_and_keeps_the_greedy_answer(capsys):
    """The default model answers as with float32 keys and values over a short reply."""
    argv = ("generate", QUESTION, "--max-tokens", "8")
    full, half = main_json(capsys, *argv), main_json(capsys, *argv, "--kv-dtype", "float16")
    assert half["cache"]["codec"] == "fp16" and full["cache"]["codec"] == "fp32"
    assert half["cache"]["nbytes"] * 2 == full["cache"]["nbytes"]
    assert half["tokens"] == full["tokens"]


def test_act_quant_q8_decodes_with_int8_activations_and_still_answers(capsys, monkeypatch, lm):
    """An approximation: on a prompt whose next token is clear it gives the same answer (on a
    near tie, such as the chat question's first token, it may not)."""
    argv = ("generate", "The capital of France is", "--raw", "--max-tokens", "4")
    exact = main_json(capsys, *argv)
    int8 = main_json(capsys, *argv, "--act-quant", "q8")
    assert exact["act_quant"] == "none" and int8["act_quant"] == "q8"
    assert int8["text"].startswith(" Paris") and exact["text"].startswith(" Paris")
    monkeypatch.setenv("KVTIER_ACT_QUANT", "q8")
    assert main_json(capsys, *argv, "--act-quant", "none")["act_quant"] == "none"  # the flag wins
    lm.model.act_quant = None  # (a fresh process's model: the environment decides)
    assert cli.main(list(argv)) == 0
    assert "int8 activations (q8)" in capsys.readouterr().err.strip().splitlines()[-1]
    assert main_json(capsys, "info", "--act-quant", "q8")["act_quant"] == "q8"
    monkeypatch.setenv("KVTIER_ACT_QUANT", "int4")
    assert cli.main(["generate", "Hi"]) == 2
    err = capsys.readouterr().err
    assert "KVTIER_ACT_QUANT='int4' is unknown; accepted: none, q8" in err and "Traceback" not in err


def test_act_quant_outside_the_cpu_step_warns_and_stays_exact(capsys):
    argv = ("generate", "The capital of France is", "--raw", "--max-tokens", "3", "--tier", "paged")
    exact = main_json(capsys, *argv)
    assert cli.main([*argv, "--act-quant", "q8", "--json"]) == 0
    out, err = capsys.readouterr()
    warnings_ = [line for line in err.splitlines() if line.startswith("kvtier: warning:")]
    assert warnings_ == ["kvtier: warning: --act-quant q8 (KVTIER_ACT_QUANT) has no effect with --tier paged: "
                         "int8 activations act in the CPU decode step over the tail tier; the products stay exact"]
    int8 = json.loads(out)
    assert int8["act_quant"] == "none" and int8["tokens"] == exact["tokens"]


def test_bench_decode_refuses_act_quant_outside_the_cpu_step(capsys):
    assert cli.main(["bench", "decode", "--act-quant", "q8", "--tier", "paged", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--act-quant acts in the CPU decode step over the tail tier" in err and "Traceback" not in err


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
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--turboquant", "q8_0"], "KEY,VALUE"),
        (["--turboquant", "q9_0,q3_0"], "q9_0"),
        (["--kv-quant", "q8", "--tier", "tail"], "paged"),
        (["--kv-dtype", "float16", "--tier", "block"], "applies to the tail tier, not block"),
        (["--stop", ""], "--stop '': a stop string cannot be empty"),
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
    for blank in ("", " ", "\n\t"):  # as on stdin (before: generated from nothing, or a library message)
        assert one_line_error(capsys, ["generate", blank, "--raw"]).startswith("the prompt is empty")


def test_environment_the_flags_overrule_warns(capsys, monkeypatch):
    monkeypatch.setenv("KVTIER_OWNED_ATTN_KV_DTYPE", "float16")
    assert cli.main(["generate", "Hi", "--raw", "--max-tokens", "2", "--tier", "paged", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["cache"]["tier"] == "paged"  # before: kv_dtype=float16 ... an error
    assert "KVTIER_OWNED_ATTN_KV_DTYPE=float16 narrows the tail tier's buffers" in err
    monkeypatch.delenv("KVTIER_OWNED_ATTN_KV_DTYPE")
    monkeypatch.setenv("KVTIER_OWNED_ATTN_KV", "off")
    assert cli.main(["generate", "Hi", "--raw", "--max-tokens", "2"]) == 0
    assert "the command line always builds caches: the tail tier's" in capsys.readouterr().err
    monkeypatch.delenv("KVTIER_OWNED_ATTN_KV")
    monkeypatch.setenv("KVTIER_FUSED", "maybe")  # before: on, silently
    assert one_line_error(capsys, ["generate", "Hi"]) == (
        "KVTIER_FUSED='maybe' is not a boolean; use one of 1/true/yes/on or 0/false/no/off")


def test_info(capsys, monkeypatch):
    monkeypatch.setenv("KVTIER_PAGED_ATTN", "1")
    out = main_json(capsys, "info")
    assert out["tier"] == "paged" and out["cache_config"]["tier"] == "paged"
    assert out["torch"] == torch.__version__
    assert out["model_args"]["n_layers"] == 30 and out["dtype"] == "float32"
    assert out["parameters"] == 134_515_008  # SmolLM2-135M's weights, packed or not (was the codes' 117,262,656)
    from kvtier.model.packed import load_kernels

    kernels = load_kernels()
    if kernels is not None:  # the packed products' loops and where the weights went
        assert out["cpu_products"] == {"lanes": kernels.lanes, "digits": list(kernels.digits)}
        assert out["packing"]["packed"] == {"q4_1": 120, "q8_0": 1}
        assert out["packing"]["huge_pages"] in (0, out["packing"]["bytes_after"])  # (no bias: all moved)
    out = main_json(capsys, "info", "--tier", "block")
    assert out["tier"] == "block"


def test_eval_ppl_and_kl(capsys):
    small = ("--context", "16", "--max-tokens", "40", "--chunk", "8")
    out = main_json(capsys, "eval", "ppl", *small, "--modes", "fp,q8")
    modes = {m["mode"]: m for m in out["modes"]}
    assert set(modes) == {"fp", "q8"}
    assert modes["fp"]["delta_pct"] == 0.0 and modes["q8"]["bits_per_element"] == 8.5
    assert set(modes["q8"]) == {"mode", "ppl", "delta_pct", "bits_per_element", "kl", "top1"}  # (the table's)
    assert modes["fp"]["kl"] == 0.0 and modes["fp"]["top1"] == 1.0 and modes["q8"]["kl"] >= 0.0
    assert cli.main(["eval", "kl", *small, "--modes", "q8"]) == 0
    table = capsys.readouterr().out
    assert "q8" in table and "top-1" in table


def test_eval_missing_file(capsys, tmp_path):
    assert cli.main(["eval", "ppl", "--file", str(tmp_path / "none.txt")]) == 2
    assert "none.txt" in capsys.readouterr().err
    assert one_line_error(capsys, ["eval", "ppl", "--file", str(tmp_path)]) == (
        f"--file {tmp_path} is a folder; give a text file")  # before: no such file


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


# -- issue 13: the command line's edges -----------------------------------------------------------

KVTIER = os.path.join(os.path.dirname(sys.executable), "kvtier")


def one_line_error(capsys, argv: list[str]) -> str:
    """Run ``kvtier ARGV``, expect exit status 2 and one line on stderr; return that line."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: ") and len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    return err.strip().removeprefix("kvtier: error: ")


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"kvtier {version('kvtier')} (torch {version('torch')})\n"


def test_a_device_that_is_not_one_is_refused_before_the_model_loads(capsys, monkeypatch):
    import kvtier.model

    monkeypatch.setattr(kvtier.model, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    assert one_line_error(capsys, ["generate", "hi", "--device", "foo"]) == (
        "--device 'foo' is not a device; use cpu, cuda or cuda:N")
    assert one_line_error(capsys, ["info", "--device", "meta"]) == (
        "--device 'meta': kvtier runs on cpu or cuda; use one of them")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_without_cuda_is_one_line_in_a_real_process():
    proc = subprocess.run([KVTIER, "generate", "--device", "cuda", "hi"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"kvtier: error: --device cuda: this PyTorch ({torch.__version__}) sees "
                           "no CUDA device; use --device cpu, or leave --device out\n")


def test_invalid_utf8_and_binary_stdin_name_the_byte_in_a_real_process():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "MTPLX_"))}
    for data, message in [
        (b"\xff\xfe\x00bad", "is not UTF-8 text: byte 0 is ff (hex); convert it to UTF-8 first, "
                             "e.g. iconv -f LATIN1 -t UTF-8"),
        (b"caf\xc3", "is not UTF-8 text: byte 3 is c3 (hex)"),
        (b"ok\x00bad", "holds a NUL byte at byte 2: it is binary data, not text; pass text"),
    ]:
        proc = subprocess.run([KVTIER, "generate", "--max-tokens", "2"], input=data,
                              capture_output=True, env=env, timeout=300)
        err = proc.stderr.decode()
        assert proc.returncode == 2 and len(err.splitlines()) == 1, err
        assert err.startswith("kvtier: error: the prompt read from stdin ") and message in err


def test_invalid_utf8_in_the_prompt_argument_and_in_eval_files(capsys, tmp_path):
    # Python keeps argv's undecodable bytes as surrogate escapes
    assert one_line_error(capsys, ["generate", "ok\udcff"]) == (
        "the prompt is not UTF-8 text: byte 2 is ff (hex); convert it to UTF-8 first, "
        "e.g. iconv -f LATIN1 -t UTF-8")
    path = tmp_path / "latin1.txt"
    path.write_bytes("naïve text".encode("latin-1"))
    assert one_line_error(capsys, ["eval", "ppl", "--file", str(path)]).startswith(
        f"--file {path} is not UTF-8 text: byte 2 is ef (hex)")
    path.write_bytes(b"\x7fELF\x02\x01\x01\x00")
    assert one_line_error(capsys, ["eval", "kl", "--file", str(path)]) == (
        f"--file {path} holds a NUL byte at byte 7: it is binary data, not text; pass text")


@pytest.mark.parametrize("variable", ["KVTIER_OWNED_ATTN_KV_STEP", "KVTIER_PAGED_BLOCK_SIZE",
                                      "KVTIER_PAGED_NUM_BLOCKS"])
def test_a_size_of_10_to_the_12_in_the_environment_is_one_line(capsys, monkeypatch, variable):
    monkeypatch.setenv(variable, str(10**12))
    assert one_line_error(capsys, ["generate", "hi", "--max-tokens", "2"]) == (
        f"{variable}='1000000000000' is too large; set it to a whole number in [1, 16777216]")


def test_sizes_that_pass_the_context_or_the_memory_are_refused_before_allocation(capsys,
                                                                                  monkeypatch):
    assert one_line_error(capsys, ["generate", "hi", "--num-blocks", str(10**12)]) == (
        "paged_num_blocks must be an int in [1, 16777216], got 1000000000000; set "
        "paged_num_blocks (--num-blocks, KVTIER_PAGED_NUM_BLOCKS)")
    monkeypatch.setenv("KVTIER_OWNED_ATTN_KV_STEP", "100000")
    assert one_line_error(capsys, ["generate", "hi", "--max-tokens", "2"]) == (
        "step=100000 tokens passes the model's context of 8192 tokens and would never be "
        "filled; set step (KVTIER_OWNED_ATTN_KV_STEP) to at most 8192 (default 256)")
    monkeypatch.delenv("KVTIER_OWNED_ATTN_KV_STEP")
    # 2**24 token slots of SmolLM2 in float32 (30 layers x 3 heads x 64 x 2 x 4 bytes each): 720 GiB
    err = one_line_error(capsys, ["generate", "hi", "--num-blocks", str(2**20)])
    assert err.startswith("the paged tier would allocate 16777216 tokens of keys and values "
                          "(720.0 GiB) at once, more than the device's ")
    assert err.endswith("GiB; lower paged_num_blocks (--num-blocks, KVTIER_PAGED_NUM_BLOCKS)")


def _helps(*argv: str) -> dict[str, str]:
    """``{option: help text}`` of the subcommand ``argv`` (e.g. ``eval ppl``)."""
    p = cli.build_parser()
    for name in argv:
        p = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return {opt: a.help or "" for a in p._actions for opt in a.option_strings}


def test_help_shows_the_defaults_of_the_dataclass_fields(capsys):
    from kvtier.evaluate import EvalConfig
    from kvtier.generate import GenerationConfig
    from kvtier.sampling import SamplingParams
    from kvtier.speculative import SpeculativeConfig

    helps, s, e = _helps("generate"), SamplingParams(), EvalConfig()
    for flag, default in [("--max-tokens", GenerationConfig().max_tokens),
                          ("--temperature", s.temperature), ("--top-p", s.top_p),
                          ("--top-k", s.top_k), ("--min-p", s.min_p), ("--seed", "none"),
                          ("--draft-tokens", SpeculativeConfig().draft_tokens)]:
        assert helps[flag].endswith(f"(default: {default})"), (flag, helps[flag])
    helps = _helps("eval", "ppl")
    for flag, default in [("--context", e.context), ("--chunk", e.chunk),
                          ("--max-tokens", e.max_tokens), ("--modes", ",".join(e.modes)),
                          ("--tier", e.tier)]:
        assert helps[flag].endswith(f"(default: {default})"), (flag, helps[flag])
    # and argparse prints them
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    assert f"(default: {GenerationConfig().max_tokens})" in capsys.readouterr().out


def test_kv_quant_and_turboquant_together_are_refused(capsys):
    assert one_line_error(capsys, ["generate", "hi", "--kv-quant", "q8", "--turboquant", "q8_0,q3_0"]) == (
        "--kv-quant q8 and --turboquant q8_0,q3_0 each name the paged tier's storage, and "
        "TurboQuant is its own codec; drop one of them")
    assert one_line_error(capsys, ["generate", "hi", "--tier", "tail", "--num-blocks", "4"]).startswith(
        "--num-blocks and --dynamic size the paged tier's pool, but --tier is 'tail'")


def test_sampling_flags_under_greedy_warn_once(capsys, lm):
    argv = ["generate", "Hi", "--raw", "--max-tokens", "2", "--json"]
    assert cli.main([*argv, "--top-p", "0.5", "--top-k", "3", "--seed", "1"]) == 0
    out, err = capsys.readouterr()
    warnings_ = [line for line in err.splitlines() if line.startswith("kvtier: warning:")]
    assert warnings_ == ["kvtier: warning: --top-p, --top-k, --seed have no effect with greedy "
                         "decoding (--temperature 0, the default, or below 1e-5); set --temperature to "
                         "1e-5 or above to sample"]
    assert json.loads(out)["tokens"] == main_json(capsys, *argv[:-1])["tokens"]
    assert cli.main([*argv, "--temperature", "0.8", "--top-p", "0.5", "--seed", "1"]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("argv, codec", [
    ([], "tier tail fp32"),
    (["--tier", "block"], "tier block fp32"),
    (["--kv-quant", "q8"], "tier paged q8"),
    (["--kv-quant", "q4"], "tier paged q4"),
    (["--turboquant", "q8_0,q3_0"], "tier paged turboquant q8_0/q3_0"),
    (["--tier", "paged"], "tier paged fp32"),
])
def test_the_summary_line_names_the_codec(capsys, argv, codec):
    assert cli.main(["generate", "Hi", "--raw", "--max-tokens", "2", *argv]) == 0
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"| {codec}, KV " in summary


def test_kv_codec_names_bf16_and_fp16():
    from kvtier.cli_run import kv_codec
    from kvtier.config import KVCacheConfig, make_caches

    for dtype, name in [(torch.bfloat16, "bf16"), (torch.float16, "fp16")]:
        caches = make_caches(1, KVCacheConfig())
        k = torch.zeros(1, 1, 1, 8, dtype=dtype)
        caches[0].update_and_fetch(k, k)
        assert kv_codec(caches, dtype) == name


def paged_blocks(capsys, *argv: str) -> tuple[int, int]:
    out = main_json(capsys, "generate", "Hi there", "--raw", "--max-tokens", "3", *argv)
    return len(out["prompt_tokens"]), out["cache"]["layer0"]["allocated_blocks"]


def test_the_paged_pool_is_sized_from_the_request_unless_told(capsys, monkeypatch):
    import math

    prompt, blocks = paged_blocks(capsys, "--tier", "paged")
    assert blocks == math.ceil((prompt + 3) / 16)
    assert paged_blocks(capsys, "--kv-quant", "q8", "--num-blocks", "7")[1] == 7
    monkeypatch.setenv("KVTIER_PAGED_NUM_BLOCKS", "9")
    assert paged_blocks(capsys, "--tier", "paged")[1] == 9  # the environment over the request
    assert paged_blocks(capsys, "--tier", "paged", "--num-blocks", "5")[1] == 5  # flags over both
    monkeypatch.delenv("KVTIER_PAGED_NUM_BLOCKS")
    # speculative decoding writes drafts past the committed tokens: room for them too
    prompt, blocks = paged_blocks(capsys, "--tier", "paged", "--speculative", "ngram",
                                  "--draft-tokens", "30")
    assert blocks == math.ceil((prompt + 3 + 31) / 16)


def test_dynamic_lets_a_pool_too_small_grow(capsys):
    argv = ("--tier", "paged", "--num-blocks", "1")
    assert cli.main(["generate", "Hi there", "--raw", "--max-tokens", "20", *argv]) == 2
    assert "kvtier: error:" in capsys.readouterr().err  # 1 block of 16 cannot hold 22 tokens
    out = main_json(capsys, "generate", "Hi there", "--raw", "--max-tokens", "20", *argv, "--dynamic")
    assert out["cache"]["layer0"]["dynamic"] is True
    assert out["cache"]["layer0"]["allocated_blocks"] * 16 >= len(out["prompt_tokens"]) + 19
    plain = main_json(capsys, "generate", "Hi there", "--raw", "--max-tokens", "20")
    assert out["tokens"] == plain["tokens"]


def test_fixed_depth_turns_the_adaptive_depth_off(capsys, lm):
    from kvtier.cli_run import speculative_config_from_args

    parse = cli.build_parser().parse_args
    spec = speculative_config_from_args(parse(["generate", "x", "--speculative", "ngram",
                                               "--fixed-depth", "--draft-tokens", "3"]))
    assert spec.adaptive is False and spec.draft_tokens == 3
    assert speculative_config_from_args(parse(["generate", "x", "--speculative", "ngram"])).adaptive
    assert one_line_error(capsys, ["generate", "x", "--fixed-depth"]) == (
        "--fixed-depth sets the depth of speculative decoding; add "
        "--speculative ngram|early-exit:N|model:PATH")
    argv = ("generate", "one two three one two three one two", "--raw", "--max-tokens", "6")
    out = main_json(capsys, *argv, "--speculative", "ngram", "--fixed-depth", "--draft-tokens", "2")
    assert out["tokens"] == main_json(capsys, *argv)["tokens"]
    assert out["speculative"]["drafted"] > 0


def test_progress_bars_only_on_a_terminal(monkeypatch):
    from kvtier.cli_run import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert Progress("eval", 10).bar is None  # pytest's stderr is not a terminal
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert Progress("eval", 10, enabled=False).bar is None  # --json
    with Progress("eval", 10) as progress:
        assert progress.bar is not None
        progress(5, 10)
        assert progress.bar.tasks[0].completed == 5
    assert progress.bar is None


def test_eval_json_writes_nothing_to_stderr(capsys):
    small = ("--context", "16", "--max-tokens", "20", "--chunk", "8", "--modes", "fp")
    main_json(capsys, "eval", "ppl", *small)
    assert capsys.readouterr().err == ""
