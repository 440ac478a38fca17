"""The CPU decode benchmark's roofline arithmetic (benchmarks/kvtier_bench/decode.py): the bytes a
decoded token reads, against the tensors a model and its caches really hold."""

import json

import pytest
import torch

from kvtier.config import KVCacheConfig
from kvtier.model import ModelArgs, build_random

decode = pytest.importorskip("kvtier_bench.decode")


@pytest.mark.parametrize("kv_dtype", [None, "float16"])
def test_kv_bytes_per_token_are_the_bytes_the_caches_store(kv_dtype):
    # a head dim other than dim / n_heads, so the count must take the model's own
    args = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=128,
                     head_dim=24)
    model = build_random(args, seed=1)
    caches = model.make_caches(KVCacheConfig(tier="tail", kv_dtype=kv_dtype))
    with torch.inference_mode():
        model(torch.arange(1, 12).unsqueeze(0), caches)
    stored = sum(c.keys[:, :, :11].nbytes + c.values[:, :, :11].nbytes for c in caches)
    itemsize = caches[0].keys.element_size()
    assert itemsize == (2 if kv_dtype else 4)
    assert decode.kv_bytes_per_token(model, 11, itemsize) == stored
    # a mean context need not be whole
    assert decode.kv_bytes_per_token(model, 11.5, itemsize) == pytest.approx(stored * 11.5 / 11)


def test_bytes_per_token_counts_a_tied_head_once_and_one_embedding_row_otherwise():
    base = dict(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=64, vocab_size=100)
    tied = build_random(ModelArgs(**base, tie_embeddings=True))
    untied = build_random(ModelArgs(**base, tie_embeddings=False))
    table = 100 * 32 * 4
    assert decode.bytes_per_token(tied) == decode.unique_param_bytes(tied)
    assert decode.bytes_per_token(untied) == decode.unique_param_bytes(untied) - table + 32 * 4
    assert decode.unique_param_bytes(untied) - decode.unique_param_bytes(tied) == table



@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_cpu_products_counts_the_bytes_its_weights_hold(fmt):
    products = pytest.importorskip("kvtier_bench.cpu_products")
    codes, d, m = products.weight(fmt, 40, 576)
    held = codes.nbytes + d.nbytes + (m.nbytes if m is not None else 0)
    assert held == 40 * 576 // 32 * products.BYTES_A_BLOCK[fmt]


@pytest.mark.parametrize("argv, named", [(["--k", "100"], "--k 100"), (["--sizes", "64", "0"], "--sizes")])
def test_cpu_products_refuses_bad_sizes_before_measuring(capsys, argv, named):
    from kvtier import cli

    assert cli.main(["bench", "cpu_products", *argv]) == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("argv, named", [
    (["decode", "--repeats", "0"], "--repeats must be at least 1"),
    (["decode", "--threads", "0"], "--threads must be at least 1, got 0"),  # was a traceback
    (["speculative", "--max-tokens", "0"], "--max-tokens must be at least 1"),  # was "exact: NO"
    (["append", "--device", "gpu"], "--device 'gpu' is not a device"),  # was three tracebacks
    (["paged", "--plot", "/nonexistent/dir/p.png"], "its folder /nonexistent/dir does not exist"),
    (["paged", "--plot", "table.txt"], "write a .png (or .pdf, .svg, .jpg) file"),  # was: after measuring
    (["paged", "--block-sizes", "16,x"], "--block-sizes '16,x'"),  # these were exit 1 without "kvtier: error"
    (["paged", "--min-len", "9", "--max-len", "4"], "--min-len 9 and --max-len 4"),
    (["append", "--contexts", "-5", "--plot", ""], "--contexts '-5': each context must be at least"),
    (["append", "--kv-heads", "0", "--plot", ""], "--kv-heads must be positive, got 0"),
    (["tensor_parallel", "--tiny", "--check-dtypes", "bogus"], "bogus is not one of float32"),  # a traceback
    (["cpu_products", "--ghz", "-2"], "--ghz -2.0: the cores' clock in GHz"),  # negative cycle counts
    pytest.param(["decode", "--device", "cuda", "--no-hf"], "this machine has no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")),
    (["serve", "--input-len", "abc"], "--input-len takes MIN,MAX prompt tokens"),
    (["serve", "--input-len", "64"], "got '64'"),
    (["serve", "--input-len", "10,5"], "got --input-len 10,5"),
    (["serve", "--num-requests", "0"], "--num-requests 0"),
    (["serve", "--bans"], "--bans needs --skip-hf"),
    (["serve", "--turboquant", "q9_0,q3_0"], "key code 'q9_0' is unknown"),
    (["serve", "--kv-quant", "q8", "--turboquant", "q8_0,q3_0"], "drop one of them"),
])
def test_bench_flags_are_refused_before_a_model_loads(capsys, monkeypatch, argv, named):
    from kvtier import cli
    from kvtier_bench import serve

    def no_model(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("kvtier.model.load_model", no_model)  # (decode imports it when it runs)
    monkeypatch.setattr(serve, "load", no_model)
    assert cli.main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err, err


def test_decode_gpu_big_batch_shrinks_to_the_free_memory_and_says_so(capsys):
    # an 80 GB card after 16 GB of weights: 64 rows of 8k tokens (1.08 GB each) do not fit
    from kvtier_bench.decode_gpu import fitting_batch

    row = 1.08e9
    assert fitting_batch(64, row, 120e9) == (64, "")  # fits: unchanged, no note
    rows, note = fitting_batch(64, row, 62e9)
    assert rows == 48 and rows * row <= 0.85 * 62e9 < (rows + 8) * row
    assert note == "batch 48, not 64: 64 rows' keys and values take 69.1 GB, 85% of the 62.0 GB free is 52.7"
    assert note in capsys.readouterr().out
    assert fitting_batch(64, row, 5e9)[0] == 3  # fewer than 8 fit: as many as fit
    assert fitting_batch(64, row, 1e9)[0] == 1  # none fit: one row, whose allocation then says why
    assert fitting_batch(1, row, 1e9) == (1, "")  # nothing to shrink: no "batch 1, not 1"
    with pytest.raises(ValueError, match="--big-batch must be >= 1, got 0"):
        fitting_batch(0, row, 62e9)


@pytest.mark.parametrize("argv, shown", [
    (["/srv/kvtier/src/kvtier/cli.py", "bench", "attention", "--quick"], "kvtier bench attention --quick"),
    (["/usr/bin/kvtier", "bench", "attention"], "kvtier bench attention"),
    (["benchmarks/attention.py", "--quick"], "python benchmarks/attention.py --quick"),
    (["kvtier", "bench", "attention", "--out", "my results.md"], "kvtier bench attention --out 'my results.md'"),
])
def test_attention_report_names_the_command_as_it_was_typed(argv, shown):
    # `python -m kvtier.cli bench ...` has the module's file as argv[0]: the report said
    # "python /srv/.../cli.py bench ...", a path of the machine that ran it
    from kvtier_bench.attention import command_line

    assert command_line(argv) == shown


def test_bench_serve_prefills_in_bfloat16_when_asked_and_records_it(tmp_path, capsys):
    from kvtier import cli

    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--device", "cpu", "--arch", "smollm2-135m", "--num-requests", "2",
            "--input-len", "70,80", "--output-len", "2", "--skip-hf", "--threads", "1", "--json", str(out)]
    assert cli.main([*argv, "--prefill-dtype", "bfloat16"]) == 0
    assert "kvtier's prefill in bfloat16" in capsys.readouterr().out
    assert json.loads(out.read_text())["meta"]["kvtier_prefill_dtype"] == "bfloat16"
    assert cli.main(argv) == 0
    assert json.loads(out.read_text())["meta"]["kvtier_prefill_dtype"] == "float32"


def test_bench_decode_adds_a_bfloat16_prefill_row_beside_the_exact_one(capsys, monkeypatch):
    from kvtier import cli

    monkeypatch.setenv("KVTIER_PREFILL_DTYPE", "bfloat16")  # the exact row stays float32 all the same
    argv = ["bench", "decode", "--device", "cpu", "--arch", "smollm2-135m", "--prompt-tokens", "80",
            "--new-tokens", "3", "--repeats", "1", "--no-hf", "--threads", "1", "--prefill-dtype", "bfloat16"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("kvtier tail, bfloat16 prefill / kvtier tail:"))
    assert "prompt and first token" in line and "greedy tokens equal" in line
