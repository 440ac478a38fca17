"""The command line at its limits: Ctrl-C keeps what was generated, a pool too small is refused
before the prefill, endless stdin stops, output files are checked before a benchmark measures,
and the flags' own names are in their errors."""

from __future__ import annotations

import io
import json

import pytest

from kvtier import cli, cli_text

QUESTION = "What is the capital of France?"


pytestmark = pytest.mark.usefixtures("cli_on_lm")


def interrupt_after(monkeypatch, n: int, error: type[BaseException] = KeyboardInterrupt) -> None:
    """Ctrl-C (or ``error``) as the stream yields its ``n``-th token (``0``: during the prefill)."""
    import kvtier.generate

    real = kvtier.generate.stream_generate

    def stream(*a, **kw):
        if n == 0:
            raise error
        for i, r in enumerate(real(*a, **kw), 1):
            yield r
            if i == n:
                raise error

    monkeypatch.setattr(kvtier.generate, "stream_generate", stream)


def test_ctrl_c_keeps_the_text_and_says_it_was_cut(capsys, monkeypatch):
    interrupt_after(monkeypatch, 3)
    assert cli.main(["generate", QUESTION, "--max-tokens", "20"]) == 130
    out, err = capsys.readouterr()
    assert out.endswith("\n") and out.strip()  # before: the text without its newline, no summary
    assert "generated 3" in err and err.rstrip().endswith("| interrupted")


def test_a_failure_mid_stream_ends_the_text_before_its_error(capsys, monkeypatch):
    interrupt_after(monkeypatch, 3, MemoryError)  # (a lost rank of --tensor-parallel, memory)
    assert cli.main(["generate", QUESTION, "--max-tokens", "20"]) == 2
    out, err = capsys.readouterr()
    assert out.endswith("\n") and out.strip()  # before: the error began on the text's last line
    assert err.startswith("kvtier: error: MemoryError")


def test_ctrl_c_with_json_prints_the_tokens_so_far(capsys, monkeypatch):
    interrupt_after(monkeypatch, 4)
    assert cli.main(["generate", QUESTION, "--max-tokens", "20", "--json"]) == 130
    out = json.loads(capsys.readouterr().out)  # before: nothing at all
    assert len(out["tokens"]) == 4 and out["finish_reason"] == "interrupted" and out["text"]


def test_ctrl_c_before_the_first_token(capsys, monkeypatch):
    interrupt_after(monkeypatch, 0)
    assert cli.main(["generate", QUESTION, "--json"]) == 130
    out, err = capsys.readouterr()
    assert json.loads(out)["finish_reason"] == "interrupted"
    assert "interrupted before the first token" in err


@pytest.mark.parametrize("how", [["--num-blocks", "3"], ["env"]])
def test_a_fixed_pool_too_small_is_refused_before_the_prefill(capsys, monkeypatch, how):
    if how == ["env"]:
        monkeypatch.setenv("KVTIER_PAGED_NUM_BLOCKS", "3")
        how = []
    assert cli.main(["generate", QUESTION, "--tier", "paged", "--max-tokens", "60", *how]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # before: text streamed, then the pool's error naming Python keywords
    assert err.startswith("kvtier: error: the paged pool of 3 blocks of 16 tokens (--num-blocks, "
                          "KVTIER_PAGED_NUM_BLOCKS) holds 48 tokens and this request may need ")
    assert "give --num-blocks 7 or more, --dynamic to let the pool grow, or fewer --max-tokens" in err


def test_a_pool_that_grows_is_not_refused(capsys):
    assert cli.main(["generate", QUESTION, "--tier", "paged", "--max-tokens", "4", "--num-blocks", "1",
                     "--dynamic"]) == 0


def test_a_full_context_is_named_in_the_summary(capsys, lm):
    ids = lm.tokenizer.encode("x")
    room = lm.args.max_position_embeddings - 3
    prompt = "a " * (room - len(ids))
    assert cli.main(["generate", prompt, "--raw", "--max-tokens", "10"]) == 0
    err = capsys.readouterr().err
    gen = int(err.split("generated ")[1].split()[0])
    assert gen < 10 and f"stopped at the model's context ({lm.args.max_position_embeddings} tokens)" in err


class Endless(io.RawIOBase):
    """A pipe that never ends: ``byte`` forever."""

    def __init__(self, byte: bytes):
        self.byte, self.given = byte, 0

    def readable(self):
        return True

    def readinto(self, b):
        b[:] = self.byte * len(b)
        self.given += len(b)
        return len(b)


@pytest.mark.parametrize("byte, message", [(b"\0", "holds a NUL byte at byte 0"), (b"a", "passes 64 MiB")])
def test_endless_stdin_stops(capsys, monkeypatch, byte, message):
    pipe = Endless(byte)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BufferedReader(pipe)))
    assert cli.main(["generate"]) == 2  # before: all of /dev/zero read into memory
    assert message in capsys.readouterr().err
    assert pipe.given <= cli_text.STDIN_LIMIT + 2 * 2**20


@pytest.mark.parametrize("argv, message", [
    (["--max-tokens", "-5"], "--max-tokens must be an int >= 1, got -5"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
])
def test_sampling_errors_name_the_flag(capsys, argv, message):
    assert cli.main(["generate", QUESTION, *argv]) == 2
    assert capsys.readouterr().err.startswith(f"kvtier: error: {message}")  # before: the field's name


def test_a_benchmarks_json_file_is_checked_before_it_measures(capsys, tmp_path):
    pytest.importorskip("kvtier_bench")
    argv = ["bench", "speculative", "--max-tokens", "8", "--drafters", "ngram", "--tasks", "grounded",
            "--repeats", "1", "--json"]
    assert cli.main([*argv, str(tmp_path / "missing" / "s.json")]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # before: the whole benchmark ran, then the file could not be written
    assert err == (f"kvtier: error: --json {tmp_path / 'missing' / 's.json'}: its folder "
                   f"{tmp_path / 'missing'} does not exist; create it first, or pass another path\n")
    assert cli.main([*argv, str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_bench_attention_on_the_cpu_without_the_interpreter_is_an_error(capsys, monkeypatch):
    pytest.importorskip("kvtier_bench")
    pytest.importorskip("triton")
    from kvtier.kernels import triton_paged

    monkeypatch.setattr(triton_paged, "interpreted", lambda: False)
    assert cli.main(["bench", "attention", "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # before: the message on stdout, without "kvtier: error:"
    assert err.startswith("kvtier: error: --device cpu needs TRITON_INTERPRET=1 in the environment")
