"""``kvtier serve --tensor-parallel 2 --device cpu``: a real server over two gloo ranks, driven by
the official ``openai`` client; its greedy tokens equal one process's ``kvtier.generate``.

SmolLM2's 3 KV heads do not split over 2 ranks, so the model is a tiny random Llama (8
query heads over 4 KV heads) saved as a Hugging Face folder with SmolLM2's tokenizer.
The server is stopped by the launcher's pid; its workers must exit after it. Every wait
is bounded in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from openai import AsyncOpenAI, OpenAI

from kvtier.config import KVCacheConfig
from kvtier.generate import GenerationConfig, stream_generate
from kvtier.model import load_model
from kvtier.serve.engine import EngineConfig, LLMEngine
from kvtier.serve.params import RequestParams
from server_support import free_port, wait_until_serving

try:
    import xgrammar  # noqa: F401

    from kvtier.serve import structured
except ImportError:  # (structured outputs need it; the rest of the test does not)
    structured = None

START_S, STOP_S = 240, 60  # start-up: two fresh interpreters load torch on two cores
PROMPTS = ("The capital of France is", "1, 2, 3, 4,", "Water boils at", "A long time ago, in a")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, lm) -> Path:
    """A Hugging Face folder: a seeded random Llama with 4 KV heads and SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(tmp_path_factory.mktemp("tiny-llama"))
    tok = lm.tokenizer
    cfg = LlamaConfig(hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=tok.vocab_size, max_position_embeddings=512,
                      rms_norm_eps=1e-5, bos_token_id=tok.bos_token_id, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # weights large enough that logits do not tie
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    model.save_pretrained(folder)
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        **tok.special_tokens, "add_bos_token": tok.add_bos, "chat_template": tok.chat_template}))
    return folder


def launch_server(tiny: Path, folder: Path) -> tuple[subprocess.Popen, int, Path]:
    """A two-rank ``kvtier serve`` started: ``(launcher process, port, log path)``."""
    port = free_port()
    log = folder / "serve.log"
    cmd = [sys.executable, "-m", "kvtier.cli", "serve", "--model", str(tiny), "--tensor-parallel", "2",
           "--device", "cpu", "--port", str(port), "--threads", "1", "--num-blocks", "64",
           "--block-size", "8", "--max-num-seqs", "4", "--max-batched-tokens", "16", "--warmup"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, port, log


@contextlib.contextmanager
def running_server(tiny: Path, folder: Path):
    """``(base URL, launcher process, log path)`` of a running two-rank ``kvtier serve``; every
    process it started is gone when the block ends."""
    proc, port, log = launch_server(tiny, folder)
    url = f"http://127.0.0.1:{port}"
    workers = []
    try:
        wait_until_serving(proc, url, log, START_S)
        workers = psutil.Process(proc.pid).children(recursive=True)
        yield url, proc, log
    finally:
        kill_all(proc, workers)


def kill_all(proc: subprocess.Popen, workers: list[psutil.Process]) -> None:
    """The launcher and its ``workers`` killed (the workers only matter where a test failed
    before they stopped), the launcher waited for."""
    for p in workers:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.kill()
    proc.wait(timeout=STOP_S)


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    with running_server(tiny, Path(tmp_path_factory.mktemp("serve-tp"))) as s:
        yield s


@contextlib.contextmanager
def orphans_adopted():
    """Within the block, processes orphaned below this one become its children (Linux's child
    subreaper), so that their exit codes can be waited for here."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_CHILD_SUBREAPER = 36
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        pytest.skip("this system has no child subreaper (prctl)")
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def ranks_of(launcher: subprocess.Popen) -> list[psutil.Process]:
    """The launcher's spawned ranks (not its other children, such as the resource tracker)."""
    return [p for p in psutil.Process(launcher.pid).children(recursive=True)
            if "spawn_main" in " ".join(p.cmdline())]


def holders_of(ranks: list[psutil.Process], port: int) -> list[psutil.Process]:
    """Those of ``ranks`` that hold a socket on ``port``."""
    return [p for p in ranks if any(c.laddr and c.laddr.port == port for c in p.net_connections())]


def reference(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of each prompt alone, one process, the tiny model's own tier-default caches."""
    lm = load_model(model_dir, device="cpu", dtype=torch.float32, progress=False)
    out = []
    for ids in prompts:
        config = GenerationConfig(max_tokens=max_tokens)
        out.append([r.token for r in stream_generate(lm.model, lm.tokenizer, ids, config,
                                                     cache_config=KVCacheConfig())])
    return out


def token_bytes(token: str) -> bytes:
    """A logprobs token's bytes: its text, or the ``bytes:\\x..`` form of part of a character."""
    if token.startswith("bytes:\\x"):
        return bytes.fromhex(token.removeprefix("bytes:").replace("\\x", ""))
    return token.encode("utf-8")


def test_two_ranks_serve_the_greedy_tokens_of_one_process_then_stop(server, tiny, lm) -> None:
    url, proc, log = server
    tok = lm.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    want = reference(tiny, prompts, max_tokens=8)
    assert len({tuple(w) for w in want}) == len(want)  # each prompt leads somewhere else
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    assert model == tiny.name

    # one at a time: the tokens (as strings, through logprobs) and the text
    for ids, tokens in zip(prompts, want):
        r = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0, logprobs=0)
        assert [token_bytes(s) for s in r.choices[0].logprobs.tokens] == [tok.token_bytes(t) for t in tokens]
        assert r.choices[0].text == tok.decode(tokens, skip_special_tokens=True)
        assert r.usage.completion_tokens == len(tokens)

    # all at once: continuous batching on rank 0, every step broadcast to rank 1
    async def together():
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(c.completions.create(
                model=model, prompt=ids, max_tokens=8, temperature=0, logprobs=0) for ids in prompts))

    for r, tokens in zip(asyncio.run(asyncio.wait_for(together(), 300)), want):
        assert [token_bytes(s) for s in r.choices[0].logprobs.tokens] == [tok.token_bytes(t) for t in tokens]

    # a structured output: rank 0's grammar masks the logits the ranks made together
    if structured is not None:
        pattern = "[a-z]{2,6}( [a-z]{2,6}){1,3}\\."
        engine = LLMEngine(load_model(tiny, device="cpu", dtype=torch.float32, progress=False).model, tok,
                           EngineConfig(num_blocks=64, block_size=8, max_num_seqs=4))
        one = engine.generate([prompts[0]], RequestParams(max_tokens=16, structure=structured.Structure("regex", pattern)))
        r = client.completions.create(model=model, prompt=prompts[0], max_tokens=16, temperature=0, logprobs=0,
                                      extra_body={"guided_regex": pattern})
        assert [token_bytes(s) for s in r.choices[0].logprobs.tokens] == [tok.token_bytes(t) for t in one[0].token_ids]
        assert re.fullmatch(pattern, r.choices[0].text) and r.choices[0].text == one[0].text, r.choices[0].text

    health = httpx.get(f"{url}/health").json()
    assert health["running"] == health["waiting"] == 0 and health["free_blocks"] == 64

    # stopped by the launcher's pid: rank 0 stops its server, then rank 1; nothing is left behind
    workers = psutil.Process(proc.pid).children(recursive=True)
    assert len(ranks_of(proc)) == 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=STOP_S) == 0, log.read_text()
    gone, alive = psutil.wait_procs(workers, timeout=STOP_S)
    assert not alive, [p.pid for p in alive]
    text = log.read_text()
    assert "Traceback" not in text and "tensor parallel over 2 ranks" in text, text
    assert "warmed up: 7 made-up requests" in text, text  # its steps were broadcast to rank 1 too


def test_rank0_takes_repeated_stop_signals_as_one_graceful_stop(tiny, tmp_path) -> None:
    """The launcher's death reaches rank 0 as one SIGINT for each of its threads that exits
    (the parent-death signal), and a Ctrl-C as the terminal's SIGINT beside the launcher's
    SIGTERM: rank 0 stops once, gracefully, without uvicorn's forced exit and the traceback of
    its cancelled lifespan task; the follower and the launcher then exit cleanly."""
    with running_server(tiny, tmp_path) as (url, proc, log):
        ranks = ranks_of(proc)
        port = int(url.rsplit(":", 1)[1])
        rank0 = holders_of(ranks, port)
        assert len(ranks) == 2 and len(rank0) == 1
        for _ in range(3):
            rank0[0].send_signal(signal.SIGINT)
        assert proc.wait(timeout=STOP_S) == 0, log.read_text()
        gone, alive = psutil.wait_procs(ranks, timeout=STOP_S)
        assert not alive, [p.pid for p in alive]
        text = log.read_text()
        assert "tensor parallel over 2 ranks" in text and "Traceback" not in text, text


def test_the_ranks_stop_quietly_when_the_launcher_is_killed(tiny, tmp_path) -> None:
    """SIGKILL to the launcher: every rank exits, without a traceback, and no process it left
    (the ranks, multiprocessing's resource tracker) warns of leaked semaphores."""
    with running_server(tiny, tmp_path) as (url, proc, log):
        ranks = ranks_of(proc)
        assert len(ranks) == 2
        port = int(url.rsplit(":", 1)[1])
        rank0 = holders_of(ranks, port)[0].pid
        children = psutil.Process(proc.pid).children(recursive=True)
        with orphans_adopted():  # (so their exit codes can be read here)
            proc.kill()
            gone, alive = psutil.wait_procs(children, timeout=STOP_S)
        assert not alive, [p.pid for p in alive]
        text = log.read_text()
        assert "tensor parallel over 2 ranks" in text and "Traceback" not in text, text
        assert "leaked semaphore" not in text, text
        # rank 0 stopped serving and ended as it ends a run (its report home, to a launcher that
        # is gone, is dropped, not a broken pipe's error)
        assert [p.returncode for p in gone if p.pid == rank0] == [0], [(p.pid, p.returncode) for p in gone]


def test_the_port_is_held_while_the_ranks_load(tiny, tmp_path) -> None:
    """The launcher binds the port before it starts the ranks and hands the socket to rank 0:
    while they load (no answer on /health yet) no other process can bind it, and once serving
    only rank 0 holds it."""
    proc, port, log = launch_server(tiny, tmp_path)
    url = f"http://127.0.0.1:{port}"
    taken_while_loading = 0
    try:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and proc.poll() is None:
            loading = bool(ranks_of(proc))
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                    free = True
                except OSError:
                    free = False
            try:
                serving = httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                serving = False
            if serving:
                break
            assert not (loading and free), \
                f"port {port} was free while the ranks loaded:\n{log.read_text()}"
            taken_while_loading += loading
            time.sleep(0.05)
        assert serving, log.read_text()
        assert taken_while_loading >= 1  # it was seen held at least once before serving
        assert len(holders_of(ranks_of(proc), port)) == 1
    finally:
        kill_all(proc, psutil.Process(proc.pid).children(recursive=True))
