"""``kvtier serve`` processes of their own: start-up flags refused before the model loads,
a taken port, a pool too small for its requests, asynchronous scheduling, a stop with
requests in flight, a model without a chat template given one, prefixes offloaded to host
memory and kept on disk across a restart. Each server is started here
and stopped by its pid."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from openai import AsyncOpenAI, OpenAI

from kvtier.config import KVCacheConfig
from kvtier.generate import GenerationConfig, generate
from server_support import free_port, metrics, model_name, running_server, settle, started_server


@pytest.mark.parametrize("argv, words", [
    (["--max-request-mb", "inf"], "--max-request-mb must be a number of MiB in (0, 1048576], got inf"),
    (["--max-request-mb", "1e308"], "in (0, 1048576], got 1e+308"),  # both were an OverflowError
    (["--max-waiting", "0"], "max_waiting must be an int >= 1, got 0"),  # was a server answering only 429
    (["--chat-template", "/nonexistent/chat.jinja"], "is neither a file nor a Jinja template"),
    (["--chat-template", "{% if %}"], "the chat template does not parse: Expected an expression"),
    (["--api-key", "secret", "--api-key", "two words"], "API key 2 of 2 is not printable ASCII without spaces; "
     "give keys"),  # (the keys themselves never written out)
    (["--api-key", ""], "API key 1 of 1 is empty"),  # was "... got 1 keys"
    (["--served-model-name", "  "], "served_model_name '  ' is no name"),  # was served as "  "
    (["--device", "tpu"], "--device 'tpu' is not a device"),  # these three were tracebacks
    pytest.param(["--device", "cuda"], "sees no CUDA device", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="a machine without CUDA")),
    (["--threads", "100000"], "--threads must be an int from 1 to"),  # was a segfault after the model loaded
    (["--kv-offload-memory", "0"], "kv_offload_gib (--kv-offload-memory) must be a number of GiB > 0 (below 2**40) or None (the default), got 0.0"),
    (["--kv-offload-memory", "1", "--no-prefix-caching"], "kv_offload_gib offloads cached prefixes, and prefix "
     "caching is off"),
    (["--prefix-cache-file", __file__], "exists and is not a kvtier prefix cache file (kvtier serve "
     "--prefix-cache-file); saving would overwrite it"),
    (["--prefix-cache-file", "/nonexistent/dir/p.safetensors"], "its folder /nonexistent/dir does not exist"),
    (["--prefix-cache-file", "p.safetensors", "--no-prefix-caching"], "--prefix-cache-file keeps the prefix "
     "cache, and --no-prefix-caching turns it off"),
    (["--prefix-cache-save-interval", "5"], "--prefix-cache-save-interval saves the prefix cache file, and none is "
     "given"),
    (["--prefix-cache-file", "p.safetensors", "--prefix-cache-save-interval", "0.5"], "prefix_cache_save_interval_s "
     "(--prefix-cache-save-interval) must be a number of seconds >= 1"),
    (["--prefix-cache-read-only"], "--prefix-cache-read-only reads the prefix cache file, and none is given"),
    (["--prefix-cache-file", "/nonexistent/p.safetensors", "--prefix-cache-read-only"], "/nonexistent/p.safetensors "
     "does not exist; --prefix-cache-read-only reads a prefix cache file saved before"),
    (["--prefix-cache-file", __file__, "--prefix-cache-read-only"], "is not a kvtier prefix cache file"),
    (["--prefix-cache-file", "/", "--prefix-cache-read-only"], "/ is not a regular file"),
    (["--prefix-cache-file", __file__, "--prefix-cache-read-only", "--tensor-parallel", "3"], "test_server_process.rank1"
     ".py does not exist, while " + __file__ + " does: the files were saved by a server of another --tensor-parallel"),
])
def test_serve_flags_are_refused_before_the_model_loads(argv, words) -> None:
    port = str(free_port())  # a process of its own, bounded in time: a server that starts is a failure
    done = subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "--device", "cpu", "--port", port, *argv,
                           "--model", "/nonexistent/model.gguf"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr  # (the model's path is not what is refused: checked first)
    assert done.stderr.startswith("kvtier: error:") and words in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("argv, words", [
    (["--block-size", "100000", "--kv-memory", "0.01"], "0.01 GiB of keys and values hold no block of 100000 "
     "tokens"),  # was a pool of 8.6 GiB
    (["--num-blocks", "100000000000"], "a pool of 100000000000 blocks takes"),  # was "MemoryError"
    (["--max-model-len", "100000000"], "--max-model-len 100000000 is more than the model's 8192 positions"),  # a cap
    (["--kv-offload-memory", "1e-9"], "--kv-offload-memory 1e-09 GiB holds no block of 16 tokens"),
    (["--kv-offload-memory", "1e9"], "GiB this host has free; lower --kv-offload-memory"),
    (["--kv-offload-memory", "20", "--kv-memory", "3"], "a host tier of 20 GiB and the pool's 3.0 GiB are more than"),
])
def test_a_pool_that_cannot_be_is_refused_before_it_is_allocated(argv, words) -> None:
    done = subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "--device", "cpu", "--port",
                           str(free_port()), *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_taken_port_is_refused_before_the_model_loads() -> None:
    """The socket is bound first: with a taken port and a model file that does not exist, the
    port is what is refused (before: the model loaded for nothing, then the port failed)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        done = subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "--device", "cpu", "--port", port,
                               "--model", "/nonexistent/model.gguf"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"kvtier: error: cannot listen on 127.0.0.1:{port} (Address already in use)")


def test_a_pool_too_small_for_every_request_preempts_and_still_answers_right(tmp_path, lm) -> None:
    """20 blocks of 16: four counting prompts of about 50 tokens are admitted (4 blocks each) but
    their 40 new tokens need 6 blocks each, so decode runs out of blocks and preempts."""
    tok = lm.tokenizer
    prompts = [", ".join(str(n) for n in range(start, start + 14)) + "," for start in (1, 20, 40, 60)]
    with running_server(tmp_path / "small.log", "--num-blocks", "20", "--max-num-seqs", "4",
                        "--max-batched-tokens", "256") as url:
        async def together():
            async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
                return await asyncio.gather(*(c.completions.create(
                    model=model_name(url), prompt=p, max_tokens=40, temperature=0) for p in prompts))

        got = asyncio.run(asyncio.wait_for(together(), 300))
        m = metrics(url)
        assert m["kvtier_preemptions_total"] > 0 and settle(url)["free_blocks"] == 20
    for p, r in zip(prompts, got):
        want = generate(lm.model, tok, p, GenerationConfig(max_tokens=40), cache_config=KVCacheConfig())
        assert r.choices[0].text == want


def test_async_scheduling_server_answers_like_generate(tmp_path, lm) -> None:
    """``--async-scheduling`` on the CPU: outputs come a step late inside the engine, and the
    HTTP answers must not show it: concurrent greedy completions with stop strings equal
    ``generate``, a stream equals its whole answer, a hang-up frees its blocks."""
    tok = lm.tokenizer
    prompts = [", ".join(str(n) for n in range(start, start + 6)) + "," for start in (1, 7, 30, 52, 90, 3)]
    with running_server(tmp_path / "async.log", "--async-scheduling", "--num-blocks", "64",
                        "--max-num-seqs", "4", "--max-batched-tokens", "64") as url:
        name = model_name(url)

        async def together():
            async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
                return await asyncio.gather(*(c.completions.create(
                    model=name, prompt=p, max_tokens=10 + i, temperature=0, stop=[" 9"])
                    for i, p in enumerate(prompts)))

        got = asyncio.run(asyncio.wait_for(together(), 300))
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        kw = dict(model=name, messages=[{"role": "user", "content": "Name three colours."}],
                  max_tokens=16, temperature=0)
        whole = client.chat.completions.create(**kw).choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                           if c.choices)
        body = {"model": name, "prompt": "Write a long story.", "max_tokens": 300, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            next(r.iter_lines())  # one event, then hang up
        h = settle(url)
        assert h["running"] == h["waiting"] == 0 and h["free_blocks"] == 64
    assert streamed == whole and whole
    for i, (p, r) in enumerate(zip(prompts, got)):
        cfg = GenerationConfig(max_tokens=10 + i, stop=(" 9",))
        assert r.choices[0].text == generate(lm.model, tok, p, cfg, cache_config=KVCacheConfig()), p
    assert any(r.choices[0].finish_reason == "stop" for r in got)


def test_a_stopping_server_ends_long_requests_after_its_shutdown_timeout(tmp_path) -> None:
    """SIGTERM with a 4,000-token stream in flight: --shutdown-timeout 1 ends it with an error
    chunk and [DONE], and the process exits in seconds (before: the stream ran to its end,
    minutes on this CPU)."""
    log = tmp_path / "serve.log"
    with started_server(log, "--num-blocks", "512", "--shutdown-timeout", "1") as (url, proc):
        body = {"prompt": "Tell me a story.", "max_tokens": 4000, "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60)
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                lines = r.iter_lines()
                next(lines)
                stopped = time.monotonic()
                proc.terminate()  # SIGTERM, by its pid
                rest = [line for line in lines if line]  # the server ends the stream
            assert rest[-1] == "data: [DONE]" and "server_shutting_down" in rest[-2], rest[-3:]
            answer = whole.result()  # the client that waits for its whole answer gets a 503
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "server_shutting_down"
        assert proc.wait(timeout=60) is not None
        assert time.monotonic() - stopped < 30, log.read_text()


TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_a_model_without_a_chat_template_is_given_one(tmp_path, lm) -> None:
    """A Hugging Face folder whose tokenizer has no chat template: chat is a 400 that names the
    fix; with --chat-template FILE the messages render with it (/tokenize shows the text's
    tokens) and chat answers. Its model's vocabulary is padded past the tokenizer's: a padded id
    in a prompt, echoed, and one sampled, with logprobs, have no text and fail nothing."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok, folder = lm.tokenizer, tmp_path / "no-template"
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=tok.vocab_size + 64, max_position_embeddings=256,
                      bos_token_id=tok.bos_token_id, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({**tok.special_tokens, "add_bos_token": tok.add_bos}))
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    chat = {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 3}
    with running_server(tmp_path / "plain.log", "--model", str(folder), "--device", "cpu") as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 400 and "start the server with --chat-template FILE" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/tokenizer_info", timeout=60).json()["chat_template"] is None
    with running_server(tmp_path / "given.log", "--model", str(folder), "--device", "cpu",
                        "--chat-template", str(tmp_path / "chat.jinja")) as url:
        r = httpx.post(f"{url}/tokenize", json={"messages": chat["messages"]}, timeout=60).json()
        assert r["tokens"] == tok.encode("<user>Hi there\n<assistant>", add_bos=False)
        r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).json()
        assert r["usage"]["prompt_tokens"] == len(tok.encode("<user>Hi there\n<assistant>", add_bos=False))
        assert r["choices"][0]["finish_reason"] in ("length", "stop")
        assert httpx.get(f"{url}/tokenizer_info", timeout=60).json()["chat_template"] == TEMPLATE
        padded = tok.vocab_size + 63
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [*tok.encode("Hi"), padded], "echo": True,
                                                      "max_tokens": 2, "logprobs": 1,
                                                      "logit_bias": {str(padded): 100}}, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == tok.decode(tok.encode("Hi")) and choice["logprobs"]["tokens"][-3:] == ["", "", ""]


def test_the_model_loads_in_a_thread_that_then_ends() -> None:
    """``kvtier serve`` builds its model and engine through ``in_passing_thread``: the value comes
    back, an exception is raised in the caller, and the thread is gone afterwards (libgomp frees its
    OpenMP workers with it)."""
    import threading

    from kvtier.serve.cli import in_passing_thread

    seen = []

    def build():
        seen.append(threading.current_thread())
        torch.ones(1 << 20).sum()  # a parallel region of that thread's own
        return 42

    assert in_passing_thread(build) == 42
    assert seen[0] is not threading.main_thread() and not seen[0].is_alive()
    def fail():
        raise ValueError("no model here")

    with pytest.raises(ValueError, match="no model here"):
        in_passing_thread(fail)


def test_a_bfloat16_prefill_server_says_so_and_answers_as_generate_does(tmp_path, lm) -> None:
    """``--prefill-dtype bfloat16``: the banner says so, and a greedy completion of a prompt of
    over 64 tokens (its prompt forward in bfloat16, its decode steps float32) is ``generate``'s
    over the paged tier with the same setting. A bad ``KVTIER_PREFILL_DTYPE`` is refused before
    the model loads."""
    prompt = "Here is some background. " * 30 + "Question: What is the capital of France? Answer:"
    log = tmp_path / "bf16.log"
    with running_server(log, "--device", "cpu", "--prefill-dtype", "bfloat16") as url:
        got = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120).completions.create(
            model=model_name(url), prompt=prompt, max_tokens=12, temperature=0)
        banner = next(line for line in log.read_text().splitlines() if line.startswith("[kvtier] serving"))
        assert banner.endswith("| bfloat16 prefill")
    assert got.usage.prompt_tokens > 64
    lm.model.prefill_dtype = "bfloat16"
    try:
        want = generate(lm.model, lm.tokenizer, prompt, GenerationConfig(max_tokens=12),
                        cache_config=KVCacheConfig(tier="paged"))
    finally:
        lm.model.prefill_dtype = None
    assert got.choices[0].text == want
    done = subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "--device", "cpu", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "KVTIER_PREFILL_DTYPE": "half"})
    assert done.returncode == 2 and "KVTIER_PREFILL_DTYPE='half' is unknown" in done.stderr


def test_a_prefix_evicted_from_the_pool_is_served_from_host_memory(tmp_path) -> None:
    """``--kv-offload-memory``: a 244-token prompt, then a 302-token one that takes most of its
    blocks in a pool of 24, then the first again: its prefix comes back from the host tier (the
    metrics count it), and the answer is the first one's."""
    first, other = "You are a careful assistant. " * 40 + "Name a colour:", "Answer plainly. " * 100 + "Fruit:"
    log = tmp_path / "offload.log"
    with running_server(log, "--device", "cpu", "--num-blocks", "24", "--kv-offload-memory", "0.05") as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        answers = [client.completions.create(model=model_name(url), prompt=p, max_tokens=8, temperature=0)
                   for p in (first, other, first)]
        m = metrics(url)
        assert settle(url)["free_blocks"] == 24
        banner = next(line for line in log.read_text().splitlines() if line.startswith("[kvtier] serving"))
    assert banner.endswith("blocks offloaded to host memory")
    assert answers[2].choices[0].text == answers[0].choices[0].text
    hits = m["kvtier_kv_offload_hits_total"]
    assert hits >= 8 * 16 and m["kvtier_kv_offload_blocks_loaded_total"] * 16 == hits
    assert m["kvtier_kv_offload_blocks_saved_total"] >= m["kvtier_kv_offload_blocks_loaded_total"]


@pytest.mark.parametrize("ranks", [1, 3])
def test_a_restarted_server_answers_from_the_prefixes_it_saved(tmp_path, ranks) -> None:
    """``--prefix-cache-file``: a server stopped by SIGTERM writes its cached blocks (each rank
    its share, under --tensor-parallel); the next one reads them and answers the same prompt
    with every full block cached, the same text."""
    prompt = "You are a careful assistant. " * 40 + "Name a colour:"
    path = tmp_path / "prefixes.safetensors"
    answers, logs = [], [tmp_path / "first.log", tmp_path / "second.log"]
    flags = ["--device", "cpu", "--num-blocks", "64", "--prefix-cache-file", str(path)]
    for log in logs:
        with started_server(log, *flags, *(["--tensor-parallel", str(ranks)] if ranks > 1 else [])) as (url, proc):
            client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
            answers.append(client.completions.create(model=model_name(url), prompt=prompt, max_tokens=8, temperature=0))
            proc.terminate()
            assert proc.wait(timeout=60) in (0, -15)
    first, second = (log.read_text() for log in logs)
    n = (answers[0].usage.prompt_tokens + 7) // 16  # full blocks of the tokens computed (the last not fed)
    beside = f" and {ranks - 1} rank files beside it" if ranks > 1 else ""
    assert f"no prefix cache file {path} yet" in first and f"saved {n} cached blocks to {path}{beside} (" in first
    assert sorted(f.name for f in tmp_path.glob("*.safetensors")) == sorted(
        ["prefixes.safetensors"] + [f"prefixes.rank{r}.safetensors" for r in range(1, ranks)])
    assert f"loaded {n} cached blocks from {path}" in second and f"({n} in the pool, 0 in host memory)" in second
    usage = [a.usage.prompt_tokens_details.cached_tokens for a in answers]
    assert usage == [0, (answers[0].usage.prompt_tokens - 1) // 16 * 16]
    assert answers[1].choices[0].text == answers[0].choices[0].text
    if ranks > 1:
        return
    # --prefix-cache-read-only: the file read, answered from, and left as it was (another prompt's blocks too)
    before, log = (path.read_bytes(), path.stat().st_mtime_ns), tmp_path / "third.log"
    with started_server(log, *flags, "--prefix-cache-read-only") as (url, proc):
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        again = client.completions.create(model=model_name(url), prompt=prompt, max_tokens=8, temperature=0)
        client.completions.create(model=model_name(url), prompt="Another prompt " * 30, max_tokens=4)
        proc.terminate()
        assert proc.wait(timeout=60) in (0, -15)
    third = log.read_text()
    assert f"loaded {n} cached blocks from {path}" in third and "saved" not in third
    assert again.usage.prompt_tokens_details.cached_tokens == usage[1] and again.choices[0].text == answers[0].choices[0].text
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before


def test_a_rank_file_that_cannot_be_written_is_refused_before_any_rank_starts(tmp_path) -> None:
    (tmp_path / "p.rank2.safetensors").mkdir()
    done = subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "--device", "cpu", "--port", str(free_port()),
                           "--tensor-parallel", "3", "--prefix-cache-file", str(tmp_path / "p.safetensors"),
                           "--model", "/nonexistent/model.gguf"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"kvtier: error: {tmp_path / 'p.rank2.safetensors'} is a directory, not a regular file")


def test_a_server_killed_restarts_from_its_last_periodic_save(tmp_path) -> None:
    """``--prefix-cache-save-interval``: the file is written while serving, so a server killed
    with SIGKILL (no graceful stop) restarts with its cache."""
    prompt = "You are a careful assistant. " * 40 + "Name a colour:"
    path = tmp_path / "prefixes.safetensors"
    flags = ["--device", "cpu", "--num-blocks", "64", "--prefix-cache-file", str(path)]
    with started_server(tmp_path / "first.log", *flags, "--prefix-cache-save-interval", "1") as (url, proc):
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        first = client.completions.create(model=model_name(url), prompt=prompt, max_tokens=8, temperature=0)
        deadline = time.monotonic() + 60
        metrics = ""
        while ("kvtier_prefix_file_saves_total 0.0" in metrics or not metrics) and time.monotonic() < deadline:
            time.sleep(0.2)  # (the file renamed into place, then the save counted)
            metrics = httpx.get(f"{url}/metrics", timeout=30).text
        proc.kill()
        proc.wait(timeout=30)
    assert path.is_file() and "[kvtier] saved" in (tmp_path / "first.log").read_text()
    figures = {x.split()[0]: float(x.split()[1]) for x in metrics.splitlines() if x.startswith("kvtier_prefix_file_")}
    assert figures["kvtier_prefix_file_saves_total"] >= 1 and figures["kvtier_prefix_file_save_failures_total"] == 0
    assert figures["kvtier_prefix_file_blocks"] >= (first.usage.prompt_tokens - 1) // 16 and 0 < figures["kvtier_prefix_file_last_pause_seconds"] < 60
    with running_server(tmp_path / "second.log", *flags) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        again = client.completions.create(model=model_name(url), prompt=prompt, max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == (first.usage.prompt_tokens - 1) // 16 * 16
    assert again.choices[0].text == first.choices[0].text
