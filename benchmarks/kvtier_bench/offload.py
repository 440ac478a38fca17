"""The serving engine's host tier of the prefix cache against recomputing evicted prefixes.

A chat workload that returns to long shared prefixes: ``--documents`` documents of about
``--document-tokens`` tokens each are the system prompts, and each of ``--rounds`` rounds asks
every document a new question, ``--concurrency`` requests at a time (greedy, ``--max-tokens``
new tokens). The pool holds about ``--pool-documents`` documents' blocks, so a document's
prefix is evicted before its next question comes. Three engines run the same requests
(``LLMEngine``, no HTTP):

- ``pool only``: an evicted prefix is computed again (the peer);
- ``pool + host``: the same pool and a host tier (``--kv-offload-memory``, default one that
  holds every document) that saves evicted blocks and loads them back;
- ``pool for all``: a pool that keeps every document (the ceiling: every repeat a hit).

Figures per engine: wall time, TTFT (mean and p90 over the requests, arrival to first
token), prompt tokens computed (prompt tokens less prefix hits), the tokens loaded from the
host, and the ratios of wall time and mean TTFT against ``pool only``, and whether each engine
gave every request the tokens of ``pool for all``. ``pool + host`` computes exactly what ``pool
for all`` computes (the same prefix hits, so the same chunks), and must give the same tokens;
the exit status is 1 otherwise. ``pool only`` computes other chunks: on the CPU (the one-call
step, each row alone) its tokens are the same too, on CUDA in bfloat16 a near tie (random
weights have many) can round the other way. The
engines run ``--repeats`` times (default 2), in reversed order every other time, and each
engine's fastest run counts.

Example::

    kvtier bench offload --device cpu
    python benchmarks/offload.py --documents 12 --document-tokens 1024 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

import torch

from kvtier.devices import set_threads
from kvtier_bench._progress import BenchProgress

WORDS = ("river", "stone", "cloud", "lamp", "garden", "paper", "violin", "mountain", "orange", "window",
         "silver", "thunder", "candle", "harbor", "meadow", "engine", "letter", "forest", "bridge", "copper")
QUESTIONS = ("Which word comes first?", "Name a colour from the text.", "How long is the text?",
             "Which word is repeated most?", "Say one word from the middle.", "Is there a river?")
PEER, HOST, ALL = "pool only", "pool + host", "pool for all"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--documents", type=int, default=8, help="shared prefixes (system prompts)")
    parser.add_argument("--document-tokens", type=int, default=512, help="about this many tokens each")
    parser.add_argument("--rounds", type=int, default=3, help="questions asked of every document")
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight")
    parser.add_argument("--pool-documents", type=float, default=2.5,
                        help="the pool of the first two engines holds about this many documents")
    parser.add_argument("--kv-offload-memory", type=float, default=None, metavar="GIB",
                        help="the host tier (default: room for every document)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-quant", default=None, help="page storage (q8, ...) of every engine")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--arch", default=None, help="random weights of this shape (llama3-8b, ...) and random "
                        "prompts instead of the default model and its chats: a larger model's prefill against the "
                        "same copies")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="FILE", help="write the figures here")


def _documents(tok, n: int, tokens: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words_per_token = len(tok.encode(" ".join(WORDS), add_bos=False)) / len(WORDS)
    return [f"Document {d}: " + " ".join(rng.choice(WORDS) for _ in range(int(tokens / words_per_token)))
            for d in range(n)]


def workload(args: argparse.Namespace, device: str, rounds: int):
    """``(model, tokenizer, label, prompts)``: ``--documents`` documents as system prompts, and
    ``prompts[r]`` every document's question ``r``. The default model and its chats, or with
    ``--arch`` random weights of that shape and random token ids (12 of them a question; no
    tokenizer, nor the default model, needed)."""
    from kvtier.model import load_model

    if args.arch is None:
        lm = load_model(device=device, progress=False)
        tok = lm.tokenizer
        chat = lambda doc, q: tok.encode(tok.apply_chat_template([{"role": "system", "content": doc},
                                                                  {"role": "user", "content": q}]), add_bos=False)
        docs = _documents(tok, args.documents, args.document_tokens, args.seed)
        return lm.model, tok, lm.source.name, [[chat(doc, QUESTIONS[r % len(QUESTIONS)]) for doc in docs]
                                               for r in range(rounds)]
    from kvtier.model import build_random

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_random(args.arch, dtype=dtype, device=device)
    rng, vocab = random.Random(args.seed), model.args.vocab_size
    docs = [[rng.randrange(vocab) for _ in range(args.document_tokens)] for _ in range(args.documents)]
    return model, None, f"{args.arch} (random weights), {str(dtype)[6:]}", [
        [doc + [rng.randrange(vocab) for _ in range(12)] for doc in docs] for _ in range(rounds)]


def ask(engine, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    """``prompts`` through ``engine``, ``concurrency`` at a time (greedy, ``max_tokens`` each, end of
    sequence ignored): wall time, TTFT (mean, p90), the prompt tokens and those computed (not
    found cached) of these requests, and every request's tokens."""
    from kvtier.serve.params import RequestParams

    before = engine.stats()
    params = RequestParams(max_tokens=max_tokens, ignore_eos=True)
    outs, start = [], time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        outs += engine.generate(prompts[i : i + concurrency], params)
    wall = time.perf_counter() - start
    s = engine.stats()
    ttft = sorted(o.first_token_time - o.arrival_time for o in outs)
    asked = s["prompt_tokens"] - before["prompt_tokens"]
    return {"wall_s": wall, "ttft_mean_s": statistics.fmean(ttft), "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
            "prompt_tokens": asked, "computed": asked - (s["prefix_hits"] - before["prefix_hits"]),
            "tokens": [list(o.token_ids) for o in outs]}


def _run(model, tokenizer, prompts: list[list[int]], concurrency: int, config, max_tokens: int) -> dict:
    from kvtier.serve.engine import LLMEngine

    engine = LLMEngine(model, tokenizer, config)
    out = ask(engine, prompts, concurrency, max_tokens)
    s = engine.stats()
    return out | {k: s[k] for k in ("host_hits", "blocks_saved", "num_blocks", "host_blocks")}


def _table(title: str, rows: dict[str, dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("engine", "blocks", "host blocks", "wall s", "TTFT mean ms", "TTFT p90 ms", "computed",
                "from host", "wall vs peer", "TTFT vs peer", "same tokens"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    for name, r in rows.items():
        table.add_row(name, str(r["num_blocks"]), str(r["host_blocks"]), f"{r['wall_s']:.2f}",
                      f"{1e3 * r['ttft_mean_s']:.0f}", f"{1e3 * r['ttft_p90_s']:.0f}",
                      f"{r['computed']} / {r['prompt_tokens']}", str(r["host_hits"]),
                      f"{r['speedup']:.2f}x", f"{r['ttft_speedup']:.2f}x", "yes" if r["same_tokens"] else "NO")
    Console(width=160).print(table)


def run(args: argparse.Namespace) -> int:
    from kvtier.serve.engine import EngineConfig
    from kvtier.serve.runner import kv_bytes_per_block

    for name in ("documents", "document_tokens", "rounds", "concurrency", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.pool_documents > 0:
        raise ValueError(f"--pool-documents must be > 0, got {args.pool_documents}")
    if args.threads is not None:
        set_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer, label, rounds = workload(args, device, args.rounds)
    prompts = [p for r in rounds for p in r]
    per_request = math.ceil((max(map(len, prompts)) + args.max_tokens) / 16)
    pool = max(math.ceil(args.pool_documents * statistics.fmean(map(len, prompts)) / 16),
               args.concurrency * per_request)
    per_block = kv_bytes_per_block(model.args, next(model.parameters()).dtype, 16, args.kv_quant)
    gib = (1.25 * args.documents * per_request * per_block / 2**30 if args.kv_offload_memory is None
           else args.kv_offload_memory)  # (0 is EngineConfig's to refuse, not a default)
    # one context for all three (it bounds CUDA graphs and split plans, which would otherwise follow the pool)
    same = {"kv_quant": args.kv_quant, "max_model_len": per_request * 16}
    configs = {PEER: EngineConfig(num_blocks=pool, **same),
               HOST: EngineConfig(num_blocks=pool, kv_offload_gib=gib, **same),
               ALL: EngineConfig(num_blocks=(args.documents + args.concurrency) * per_request, **same)}
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    with BenchProgress("offload", args.repeats * len(configs)) as bar:
        for i in range(args.repeats):
            for name in (list(configs) if i % 2 == 0 else list(reversed(configs))):
                bar.advance(f"round {i + 1}/{args.repeats}, {name}")
                runs[name].append(_run(model, tokenizer, prompts, args.concurrency, configs[name], args.max_tokens))
    best = {name: min(rs, key=lambda r: r["wall_s"]) for name, rs in runs.items()}
    want = best[ALL]["tokens"]
    for name, r in best.items():
        r["speedup"] = best[PEER]["wall_s"] / r["wall_s"]
        r["ttft_speedup"] = best[PEER]["ttft_mean_s"] / r["ttft_mean_s"]
        r["same_tokens"] = all(x["tokens"] == want for x in runs[name])  # every run of the engine
    _table(f"{len(prompts)} requests: {args.documents} documents of {statistics.fmean(map(len, prompts)):.0f} "
           f"prompt tokens x {args.rounds} questions, {args.concurrency} at a time, {args.max_tokens} new tokens, "
           f"{label} on {device}", best)
    write_json(args, device, label, best)
    return 0 if best[HOST]["same_tokens"] else 1


def write_json(args: argparse.Namespace, device: str, label: str, best: dict[str, dict], **more) -> None:
    """The figures of each engine (their tokens left out), the flags and ``more`` to ``--json``'s file."""
    if args.json:
        flags = {k: v for k, v in vars(args).items() if isinstance(v, int | float | str | None)}
        results = {n: {k: v for k, v in r.items() if k != "tokens"} for n, r in best.items()}
        with open(args.json, "w") as f:
            json.dump({"device": device, "model": label, "threads": torch.get_num_threads(), "args": flags,
                       **more, "results": results}, f, indent=1)
