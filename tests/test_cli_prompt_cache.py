"""``kvtier generate --prompt-cache``: a run that reuses the saved prompt gives the tokens of
one that computes it, with every paged codec. Before, the command line rebuilt the restored
paged caches through ``configure_kv_cache`` (to size the pool for its own request), which
decoded the pages and coded them again: fp8 keys against a new key centre, TurboQuant
values fitted to their own reconstruction; greedy output then changed."""

from __future__ import annotations

import json

import pytest

from kvtier import cli

PROMPT = "Write a haiku about the sea and the moon, then explain it briefly."


pytestmark = pytest.mark.usefixtures("cli_on_lm")


def tokens(capsys, *argv: str) -> tuple[list[int], int]:
    assert cli.main(["generate", PROMPT, "--max-tokens", "14", "--json", *argv]) == 0
    out = json.loads(capsys.readouterr().out)
    return out["tokens"], out["timings"]["prompt_cache_tokens_reused"]


# fp8 and q5_0r,q4_0 changed (fp8 from the first token, q5_0r,q4_0 from the thirteenth); q8 did not
@pytest.mark.parametrize("storage", [("--kv-quant", "fp8"), ("--turboquant", "q5_0r,q4_0"),
                                     ("--kv-quant", "q8")], ids=lambda s: s[1])
def test_a_reused_prompt_gives_the_tokens_of_a_computed_one(capsys, tmp_path, storage):
    path = str(tmp_path / "pc.st")
    computed, reused = tokens(capsys, *storage)
    assert reused == 0
    assert tokens(capsys, *storage, "--prompt-cache", path) == (computed, 0)  # computes, saves
    again, reused = tokens(capsys, *storage, "--prompt-cache", path)
    assert reused > 0
    assert again == computed
