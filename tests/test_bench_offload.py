"""``kvtier bench offload`` as a user runs it: a tiny random shape on the CPU, its JSON figures
(the host tier computes fewer prompt tokens than recomputing, the same tokens everywhere),
and its refusals."""

from __future__ import annotations

import json

import pytest

from kvtier import cli


def test_bench_offload_loads_what_recomputing_computes_again(tmp_path, capsys):
    out = tmp_path / "offload.json"
    assert cli.main(["bench", "offload", "--device", "cpu", "--arch", "tiny-llama3", "--documents", "3",
                     "--document-tokens", "64", "--rounds", "2", "--repeats", "1", "--json", str(out)]) == 0
    assert "pool + host" in capsys.readouterr().out
    r = json.loads(out.read_text())["results"]
    peer, host, every = r["pool only"], r["pool + host"], r["pool for all"]
    assert all(x["same_tokens"] for x in r.values())
    assert host["computed"] == every["computed"] < peer["computed"] and host["host_hits"] > 0
    assert host["num_blocks"] == peer["num_blocks"] < every["num_blocks"] and host["host_blocks"] > 0
    assert peer["prompt_tokens"] == host["prompt_tokens"] == every["prompt_tokens"]


@pytest.mark.parametrize("argv, words", [
    (["--rounds", "0"], "--rounds must be at least 1, got 0"),
    (["--arch", "tiny-llama3", "--kv-offload-memory", "0"], "kv_offload_gib (--kv-offload-memory) must be a "
     "number of GiB > 0"),  # (was run with the default size)
])
def test_bench_offload_refuses_empty_work_and_an_empty_tier(capsys, argv, words):
    assert cli.main(["bench", "offload", "--device", "cpu", "--documents", "2", *argv]) == 2
    assert words in capsys.readouterr().err
