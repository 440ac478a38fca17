"""``kvtier bench restart`` as a user runs it: a tiny random shape on the CPU, its JSON figures
(the engine restarted from the file computes what the one kept running computes, far less than
the one restarted empty, with the same tokens), and its refusals."""

from __future__ import annotations

import json

import pytest

from kvtier import cli


def test_bench_restart_from_the_file_computes_what_a_server_kept_running_computes(tmp_path, capsys):
    out = tmp_path / "restart.json"
    assert cli.main(["bench", "restart", "--device", "cpu", "--arch", "tiny-llama3", "--documents", "3",
                     "--document-tokens", "64", "--repeats", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "restarted from file" in printed and "prefix cache file: " in printed
    got = json.loads(out.read_text())
    r, f = got["results"], got["file"]
    empty, loaded, kept = r["restarted empty"], r["restarted from file"], r["kept running"]
    assert all(x["same_tokens"] for x in r.values())
    assert loaded["computed"] == kept["computed"] < empty["computed"] == empty["prompt_tokens"]
    assert f["blocks"] == 3 * ((64 + 12 + 16 - 1) // 16) and f["bytes"] > 0 and f["save_gb_s"] > 0
    # the save begun after the second round copied only the blocks new to the file
    assert 0 < f["begun_new"] < f["begun_blocks"] and f["begun_pause_s"] > 0 and "saved again" in printed


@pytest.mark.parametrize("argv, words", [
    (["--documents", "0"], "--documents must be at least 1, got 0"),
    (["--concurrency", "0"], "--concurrency must be at least 1, got 0"),
])
def test_bench_restart_refuses_empty_work(capsys, argv, words):
    assert cli.main(["bench", "restart", "--device", "cpu", *argv]) == 2
    assert words in capsys.readouterr().err
