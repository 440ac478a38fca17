"""A server restarted with its prefix cache file (``--prefix-cache-file``) against one restarted empty.

A chat workload over long shared prefixes: ``--documents`` documents of about
``--document-tokens`` tokens each are the system prompts. Before the restart one engine
asks every document a question (greedy, ``--max-tokens`` new tokens), so its prefix cache
holds them all, and its cache is written with :func:`~kvtier.serve.prefix_file.save_prefix_cache`.
Then every document is asked another question, ``--concurrency`` at a time, by three engines
(``LLMEngine``, no HTTP):

- ``restarted empty``: a new engine, which computes every document again (the peer);
- ``restarted from file``: a new engine that first loaded the file
  (:func:`~kvtier.serve.prefix_file.load_prefix_cache`);
- ``kept running``: the engine of before the restart (the ceiling: no restart at all).

Then ``kept running`` saves again, as a server's periodic save would after those requests:
begun between two steps (:func:`~kvtier.serve.prefix_save.begin_prefix_save`: only the blocks
new to the file copied while the engine pauses, the file written by a thread) and, for the
peer, while the engine waits (:func:`~kvtier.serve.prefix_save.save_prefix_cache`).

Figures: the file's size, the save's and the load's seconds and GB/s; the engine's pause in
the two later saves; per engine wall time,
TTFT (mean and p90, arrival to first token), prompt tokens computed, and the ratios of wall
time and mean TTFT against ``restarted empty``, and whether each engine gave every request
the tokens of ``kept running``. ``restarted from file`` computes exactly what ``kept
running`` computes (the same prefix hits, so the same chunks) and must give the same tokens;
the exit status is 1 otherwise. The whole runs ``--repeats`` times (default 2), and each
figure's fastest run counts.

Example::

    kvtier bench restart --device cpu
    python benchmarks/restart.py --documents 16 --document-tokens 1024 --json out.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from kvtier.devices import set_threads
from kvtier_bench._progress import BenchProgress
from kvtier_bench.offload import ask, workload, write_json

PEER, FILE, KEPT = "restarted empty", "restarted from file", "kept running"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--documents", type=int, default=8, help="shared prefixes (system prompts)")
    parser.add_argument("--document-tokens", type=int, default=512, help="about this many tokens each")
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-quant", default=None, help="page storage (q8, ...) of every engine")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--arch", default=None, help="random weights of this shape (llama3-8b, ...) and random "
                        "prompts instead of the default model and its chats")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="FILE", help="write the figures here")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _once(model, tokenizer, config, first, second, args, device: str, path: str) -> dict:
    from kvtier.serve.engine import LLMEngine
    from kvtier.serve.prefix_file import load_prefix_cache, save_prefix_cache

    kept = LLMEngine(model, tokenizer, config)
    ask(kept, first, args.concurrency, args.max_tokens)
    _sync(device)
    t0 = time.perf_counter()
    blocks = save_prefix_cache(kept, path)
    save_s, size = time.perf_counter() - t0, os.path.getsize(path)
    out = {"file": {"blocks": blocks, "bytes": size, "save_s": save_s}}
    shutil.copyfile(path, path + ".restart")  # (the file the restarted engine loads: path is saved again below)
    out[KEPT] = ask(kept, second, args.concurrency, args.max_tokens)
    out["file"] |= _periodic(kept, path, device)
    del kept
    out[PEER] = ask(LLMEngine(model, tokenizer, config), second, args.concurrency, args.max_tokens)
    loaded = LLMEngine(model, tokenizer, config)
    t0 = time.perf_counter()
    got = load_prefix_cache(loaded, path + ".restart")
    _sync(device)
    out["file"]["load_s"] = time.perf_counter() - t0
    if got["left_out"]:
        raise ValueError(f"{got['left_out']} blocks of the file did not fit the new engine's pool")
    out[FILE] = ask(loaded, second, args.concurrency, args.max_tokens)
    return out


def _periodic(engine, path: str, device: str) -> dict:
    """The engine's pause in a save begun between two steps after the second round, and in a save of
    the same blocks while it waits (to another file)."""
    from kvtier.serve.prefix_save import begin_prefix_save, save_prefix_cache

    _sync(device)
    t0 = time.perf_counter()
    save = begin_prefix_save(engine, path)
    pause = time.perf_counter() - t0
    while not save.written():
        time.sleep(0.001)
    save.finish()
    written = time.perf_counter() - t0
    t0 = time.perf_counter()
    save_prefix_cache(engine, path + ".waiting")
    waiting = time.perf_counter() - t0
    return {"begun_blocks": save.blocks, "begun_new": save.new_blocks, "begun_pause_s": pause,
            "begun_written_s": written, "waiting_save_s": waiting}


def _table(title: str, rows: dict[str, dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("engine", "wall s", "TTFT mean ms", "TTFT p90 ms", "computed", "wall vs peer", "TTFT vs peer",
                "same tokens"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    for name, r in rows.items():
        table.add_row(name, f"{r['wall_s']:.2f}", f"{1e3 * r['ttft_mean_s']:.0f}", f"{1e3 * r['ttft_p90_s']:.0f}",
                      f"{r['computed']} / {r['prompt_tokens']}", f"{r['speedup']:.2f}x", f"{r['ttft_speedup']:.2f}x",
                      "yes" if r["same_tokens"] else "NO")
    Console(width=160).print(table)


def run(args: argparse.Namespace) -> int:
    from kvtier.serve.engine import EngineConfig

    for name in ("documents", "document_tokens", "concurrency", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.threads is not None:
        set_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer, label, (first, second) = workload(args, device, 2)
    per_request = -(-(max(map(len, first + second)) + args.max_tokens) // 16)
    # room for every document's blocks, asked twice, and the requests in flight
    config = EngineConfig(num_blocks=(2 * args.documents + args.concurrency) * per_request, kv_quant=args.kv_quant,
                          max_model_len=per_request * 16)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as folder, BenchProgress("restart", args.repeats) as bar:
        for i in range(args.repeats):
            bar.advance(f"round {i + 1}/{args.repeats}")
            runs.append(_once(model, tokenizer, config, first, second, args, device,
                              os.path.join(folder, "prefixes.safetensors")))
    best = {name: min((r[name] for r in runs), key=lambda r: r["wall_s"]) for name in (PEER, FILE, KEPT)}
    want = runs[0][KEPT]["tokens"]
    for name, r in best.items():
        r["speedup"] = best[PEER]["wall_s"] / r["wall_s"]
        r["ttft_speedup"] = best[PEER]["ttft_mean_s"] / r["ttft_mean_s"]
        r["same_tokens"] = all(x[name]["tokens"] == want for x in runs)
    f = runs[0]["file"]
    save_s, load_s = min(r["file"]["save_s"] for r in runs), min(r["file"]["load_s"] for r in runs)
    file = {"blocks": f["blocks"], "bytes": f["bytes"], "save_s": save_s, "load_s": load_s,
            "save_gb_s": f["bytes"] / save_s / 1e9, "load_gb_s": f["bytes"] / load_s / 1e9}
    for key in ("begun_pause_s", "begun_written_s", "waiting_save_s"):
        file[key] = min(r["file"][key] for r in runs)
    file["begun_blocks"], file["begun_new"] = f["begun_blocks"], f["begun_new"]
    file["pause_ratio"] = file["waiting_save_s"] / file["begun_pause_s"]
    print(f"prefix cache file: {file['blocks']} blocks, {file['bytes'] / 2**20:.1f} MiB; saved in {1e3 * save_s:.0f} ms "
          f"({file['save_gb_s']:.2f} GB/s), loaded in {1e3 * load_s:.0f} ms ({file['load_gb_s']:.2f} GB/s)")
    print(f"saved again after the restart's requests ({file['begun_blocks']} blocks, {file['begun_new']} new to the "
          f"file): begun between two steps, the engine paused {1e3 * file['begun_pause_s']:.1f} ms and the thread "
          f"wrote the file in {1e3 * file['begun_written_s']:.0f} ms; while the engine waits, "
          f"{1e3 * file['waiting_save_s']:.0f} ms ({file['pause_ratio']:.1f}x the pause)")
    _table(f"{len(second)} requests after the restart: {args.documents} documents of "
           f"{statistics.fmean(map(len, second)):.0f} prompt tokens, {args.concurrency} at a time, {args.max_tokens} "
           f"new tokens, {label} on {device}", best)
    write_json(args, device, label, best, file=file)
    return 0 if best[FILE]["same_tokens"] else 1
