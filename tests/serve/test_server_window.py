"""``kvtier serve`` on a model with a sliding window (a tiny Mistral, a window of 16 keys in every
layer, SmolLM2's tokenizer), as a client sees it: four long completions at once in a pool too
small to hold them whole get transformers' greedy text, no request is preempted, and /metrics
counts the blocks released behind the window. The server is started here and stopped by its pid."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from openai import OpenAI

from server_support import metrics, model_name, running_server, settle

transformers = pytest.importorskip("transformers")

PROMPTS = ["The quick brown fox jumps over the lazy dog and then", "Once upon a time in a land far away there lived",
           "In the beginning the universe was created and this", "Python is a programming language that lets you"]
NEW = 100


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, lm):
    tok, folder = lm.tokenizer, tmp_path_factory.mktemp("server-window")
    cfg = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=tok.vocab_size,
                                     max_position_embeddings=512, sliding_window=16,
                                     bos_token_id=tok.bos_token_id, eos_token_id=2)
    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(cfg).eval()
    hf.save_pretrained(folder)
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({**tok.special_tokens, "add_bos_token": tok.add_bos}))
    return hf, tok, folder


@torch.no_grad()
def test_long_completions_share_a_small_pool_behind_the_window(tmp_path, mistral) -> None:
    hf, tok, folder = mistral
    want = []
    for p in PROMPTS:
        ids = tok.encode(p)
        out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        want.append(tok.decode(out[0, len(ids):].tolist()))
    # each request holds about 28 blocks of 4 whole; 40 blocks for the four
    with running_server(tmp_path / "serve.log", "--model", str(folder), "--device", "cpu", "--num-blocks", "40",
                        "--block-size", "4", "--max-num-seqs", "4", "--max-model-len", "150") as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
        name = model_name(url)

        def complete(prompt: str) -> str:
            r = client.completions.create(model=name, prompt=prompt, max_tokens=NEW, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == NEW
            return r.choices[0].text

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(complete, PROMPTS))
        m = metrics(url)
        assert settle(url)["free_blocks"] == 40
    assert got == want
    assert "| blocks released behind the 16-token sliding window" in (tmp_path / "serve.log").read_text()
    assert m["kvtier_preemptions_total"] == 0 and m["kvtier_kv_blocks_released_total"] > 4 * 10
