"""kvtier's serving engine against transformers' continuous batching (generate_batch) on one workload.

Like ``vllm bench serve``: ``--num-requests`` prompts of random token ids with lengths
drawn uniformly from ``--input-len MIN,MAX``, each generating exactly ``--output-len``
greedy tokens (end-of-sequence ignored), run in one process through:

- ``kvtier``: :class:`kvtier.serve.engine.LLMEngine` driven in process by a client
  loop that keeps ``--concurrency`` requests in flight (default: all) or sends them
  at ``--request-rate`` per second (Poisson arrivals); steps run back to back;
- ``transformers``: ``model.generate_batch`` (``attn_implementation="paged|sdpa"``)
  on a ``LlamaForCausalLM`` holding the very same weights (views, no copy), all
  requests at once.

Reported per contender: output tokens/s (generated tokens over the time from the
first request sent to the last token), requests/s, TTFT (first token minus the
request's arrival) and TPOT ((last token - first token) / (tokens - 1)) at p50 and
p99, and how many requests produced the same tokens as kvtier. transformers' times
come from its own per-token timestamps (``record_timestamps``), from the first
request it created, so its manager's set-up is not counted. Each contender first
runs a warm-up of its own: on CUDA the workload's prompts for 4 tokens each (kernels
compile for each shape bucket, graphs are captured), on the CPU a few prompts whose
lengths span the workload's.

Models: on CPU the default SmolLM2-135M-Instruct in float32, its weights kept for kvtier
in their Q4_1/Q8_0 block codes as ``kvtier serve`` keeps them (the same values; decode steps
multiply the codes in one C call) and dense for transformers (``--weights float32`` gives
kvtier the dense ones too); with ``--arch`` (the default on CUDA: ``llama3-8b``) random
weights of that shape (bfloat16 on CUDA).

Example::

    kvtier bench serve --num-requests 32 --input-len 64,512 --output-len 64 --threads 2
    kvtier bench serve --device cuda --num-requests 256 --input-len 64,1024 --output-len 256 \\
        --max-num-seqs 256 --json serve_h200.json --plot serve_h200.png
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import time
from dataclasses import dataclass, field

import torch

from kvtier.devices import set_threads
from kvtier_bench._progress import BenchProgress


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", default="64,512", help="MIN,MAX prompt tokens (uniform)")
    parser.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--concurrency", type=int, default=None, help="requests in flight (default: all)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals (default: all at once)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--arch", default=None, help="random weights of this shape (default on CUDA: "
                                                     "llama3-8b; on CPU the SmolLM2 GGUF)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="kvtier's running requests "
                                                                        "at most (default: all)")
    parser.add_argument("--max-batched-tokens", type=int, default=None,
                        help="kvtier's tokens per step (default: 2048 on CPU, 16384 on CUDA)")
    parser.add_argument("--kv-quant", default=None, help="kvtier's page storage (q8, ...)")
    parser.add_argument("--turboquant", default=None, metavar="K,V",
                        help="kvtier's TurboQuant pages: key,value codes, e.g. q8_0,q3_0 (not with --kv-quant)")
    parser.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false", default=None)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="kvtier schedules a step while the GPU runs the one before (default: on CUDA)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="kvtier's batch-invariant steps (CPU): every token computed as it is alone")
    parser.add_argument("--skip-hf", action="store_true", help="no transformers contender")
    parser.add_argument("--penalties", action="store_true",
                        help="every request with presence 0.5, frequency 0.5 and repetition 1.1 "
                             "penalties (their cost a step; needs --skip-hf)")
    parser.add_argument("--bans", action="store_true",
                        help="every request with 32 two-token and 8 one-token bad words (random ids; their "
                             "cost a step; needs --skip-hf)")
    parser.add_argument("--structured", nargs="?", const="regex", default=None, choices=("regex", "tools"),
                        help="every request's answer held through a grammar matcher (its cost a step; needs "
                             "--skip-hf, and --tokenizer with random weights): regex, a pattern (the default); "
                             "tools, tool_choice \"auto\" over two tools (free text until a call's trigger)")
    parser.add_argument("--detokenize", action="store_true",
                        help="make each request's text as the server does (the engine given the tokenizer; "
                             "--structured does so too); without it the engine makes token ids alone, as "
                             "transformers' generate_batch does")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="a Hugging Face folder (tokenizer.json) whose vocabulary --structured compiles "
                             "over and --detokenize writes with, for random weights (the default model "
                             "brings its own)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--weights", choices=("packed", "float32"), default="packed",
                        help="kvtier's weights of the default model on the CPU: its block codes, as kvtier "
                             "serve keeps them (default), or dense float32 as transformers gets them")
    parser.add_argument("--prefill-dtype", choices=("float32", "bfloat16"), default=None,
                        help="kvtier's prompt forwards of a float32 model (default: KVTIER_PREFILL_DTYPE, "
                             "else float32; transformers stays float32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, help="write a PNG of throughput and latencies here")


@dataclass
class Result:
    name: str
    requests: int
    output_tokens: int
    duration_s: float
    ttft_s: list[float] = field(repr=False)
    tpot_s: list[float] = field(repr=False)
    tokens: list[list[int]] = field(repr=False)
    note: str = ""

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.duration_s

    def summary(self) -> dict:
        return {"name": self.name, "requests": self.requests, "output_tokens": self.output_tokens,
                "duration_s": self.duration_s, "output_tokens_per_s": self.output_tokens_per_s,
                "requests_per_s": self.requests_per_s,
                **{f"{k}_{q}_ms": 1000 * percentile(getattr(self, f"{k}_s"), q)
                   for k in ("ttft", "tpot") for q in (50, 99)},
                "note": self.note}


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-th percentile of ``xs`` (linear between ranks)."""
    s = sorted(xs)
    if not s:
        return math.nan
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def run(args: argparse.Namespace) -> int:
    if args.threads is not None:
        set_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        lo, hi = (int(x) for x in args.input_len.split(","))
    except ValueError:
        raise ValueError(f"--input-len takes MIN,MAX prompt tokens, two whole numbers such as 64,512; "
                         f"got {args.input_len!r}") from None
    if not 1 <= lo <= hi or args.output_len < 1 or args.num_requests < 1:
        raise ValueError(f"--input-len MIN,MAX needs 1 <= MIN <= MAX; --output-len and --num-requests >= 1; "
                         f"got --input-len {lo},{hi} --output-len {args.output_len} "
                         f"--num-requests {args.num_requests}")
    for flag in ("structured", "detokenize"):
        if getattr(args, flag) and (device.type == "cuda" or args.arch is not None) and args.tokenizer is None:
            raise ValueError(f"--{flag} needs a tokenizer's vocabulary, and random weights bring none: give "
                             "--tokenizer DIR (a folder with tokenizer.json)")
    from kvtier.quant.modes import parse_storage_flags

    parse_storage_flags(args.kv_quant, args.turboquant)  # (a bad code, or both flags: before a model loads)
    for flag in ("penalties", "bans", "structured"):
        if getattr(args, flag) and not args.skip_hf:
            raise ValueError(f"--{flag} needs --skip-hf: transformers' generate_batch takes no per-request "
                             f"{flag}, so its tokens could not be compared")
    model, label, tokenizer = load(args, device)
    engine_model = packed_copy() if label.endswith("float32") and args.weights == "packed" else model
    if args.prefill_dtype is not None:
        engine_model.prefill_dtype = args.prefill_dtype
    from kvtier.model.linear import prefill_dtype_in_effect

    prefill_dtype = str(prefill_dtype_in_effect(engine_model)).removeprefix("torch.")
    rng = random.Random(args.seed)
    vocab = model.args.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(args.num_requests)]
    with BenchProgress("serve", 2 - args.skip_hf) as bar:
        bar.advance("kvtier LLMEngine")
        results = [run_kvtier(engine_model, tokenizer, prompts, args, device)]
        if not args.skip_hf:
            bar.advance("transformers generate_batch")
            results.append(run_hf(model, prompts, args, device, results[0]))
    if engine_model is not model:
        label += " (kvtier: packed Q4_1/Q8_0 codes)"
    meta = {"model": label, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
            f"CPU, {torch.get_num_threads()} threads", "num_requests": args.num_requests,
            "input_len": [lo, hi], "output_len": args.output_len, "kvtier_prefill_dtype": prefill_dtype,
            "kvtier_batch_invariant": args.batch_invariant,
            "concurrency": args.concurrency or args.num_requests, "request_rate": args.request_rate,
            "date": time.strftime("%Y-%m-%d %H:%M"), "versions": versions()}
    print_table(results, meta)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": [r.summary() for r in results]}, f, indent=1)
    if args.plot:
        plot(results, meta, args.plot)
    return 0


def load(args, device: torch.device):
    """The model, its label, and the tokenizer ``--structured`` compiles over (``None`` without)."""
    if device.type == "cuda" or args.arch is not None:
        from kvtier.model import build_random

        arch = args.arch or "llama3-8b"
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model, tokenizer = build_random(arch, dtype=dtype, device=device), None
        if args.tokenizer is not None:
            from kvtier.model import Tokenizer

            tokenizer = Tokenizer.from_pretrained_dir(args.tokenizer)
            if tokenizer.vocab_size > model.args.vocab_size:
                raise ValueError(f"--tokenizer {args.tokenizer} has {tokenizer.vocab_size} tokens, more than "
                                 f"the {model.args.vocab_size} of {arch}; give a smaller vocabulary")
        return model, f"{arch} (random weights), {str(dtype)[6:]}", tokenizer
    from kvtier.model import load_model

    lm = load_model(device="cpu", dtype=torch.float32, progress=False, pack=False)  # (transformers' views)
    return lm.model, f"{lm.source.name}, float32", lm.tokenizer


def packed_copy():
    """The default model again, every weight that is exactly Q4_1 or Q8_0 kept in those codes, as
    ``kvtier serve`` loads it (the same values as ``model``'s dense ones)."""
    from kvtier.model import load_model

    return load_model(device="cpu", dtype=torch.float32, progress=False, pack=True).model


def versions() -> dict[str, str]:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


# -- kvtier ---------------------------------------------------------------------------------------
def engine_config(args, device: torch.device, prompts: list[list[int]]):
    from kvtier.quant.modes import parse_storage_flags
    from kvtier.serve.engine import EngineConfig

    bs = 16
    need = sum(math.ceil((len(p) + args.output_len) / bs) for p in prompts)
    return EngineConfig(
        num_blocks=need + 64, block_size=bs, max_num_seqs=args.max_num_seqs or len(prompts),
        max_batched_tokens=max(args.max_batched_tokens or (16384 if device.type == "cuda" else 2048),
                               args.max_num_seqs or len(prompts)),
        max_waiting=len(prompts), **parse_storage_flags(args.kv_quant, args.turboquant), cuda_graph=args.cuda_graph,
        async_scheduling=args.async_scheduling, batch_invariant=args.batch_invariant,
        enable_prefix_caching=False)  # random prompts share nothing; no hashing to pay for


def drive(engine, prompts: list[list[int]], output_len: int, concurrency: int, rate: float, seed: int,
          penalties: bool = False, bans: bool = False, structured: str | None = None):
    """Send ``prompts`` to ``engine`` (``concurrency`` in flight, ``rate`` per second) and step it
    until all finish; ``(duration, ttft, tpot, tokens)`` with times relative to the first send."""
    from kvtier.serve.params import RequestParams

    params = RequestParams(max_tokens=output_len, ignore_eos=True)
    if penalties:
        params = RequestParams(max_tokens=output_len, ignore_eos=True, presence_penalty=0.5,
                               frequency_penalty=0.5, repetition_penalty=1.1)
    rng = random.Random(seed)
    if bans:
        vocab = engine.model.args.vocab_size
        words = tuple((rng.randrange(vocab), rng.randrange(vocab)) for _ in range(32))
        params = RequestParams(max_tokens=output_len, ignore_eos=True,
                               bad_words=words + tuple((rng.randrange(vocab),) for _ in range(8)))
    if structured:  # any text without "<" (as inside a JSON string), or tool_choice "auto"'s free text with
        # held calls; ended by a stop id the model rarely picks
        from kvtier.serve.structured import Structure
        from kvtier.serve.tools import FORMATS, tool_calls

        tools = [{"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"]}}} for name in ("get_weather", "get_time")]
        held = (Structure("regex", "[^<]*") if structured == "regex" else
                tool_calls(tools, "auto", fmt=FORMATS["hermes"]).structure)
        params = RequestParams(max_tokens=output_len, ignore_eos=True, stop_token_ids=(engine.tokenizer.vocab_size - 1,),
                               structure=held)
    t, arrival = 0.0, []
    for _ in prompts:
        arrival.append(t)
        t += 0.0 if math.isinf(rate) else rng.expovariate(rate)
    n = len(prompts)
    first, done, tokens = [None] * n, [None] * n, [[] for _ in prompts]
    inflight: dict[str, int] = {}
    nxt, t0 = 0, time.perf_counter()
    while nxt < n or inflight:
        now = time.perf_counter() - t0
        while nxt < n and len(inflight) < concurrency and arrival[nxt] <= now:
            inflight[engine.add_request(prompts[nxt], params)] = nxt
            arrival[nxt] = max(arrival[nxt], now)  # a request waiting for a slot arrives when sent
            nxt += 1
        if not inflight:
            time.sleep(max(0.0, arrival[nxt] - now))
            continue
        for out in engine.step():  # the tokens are on the host: the step is over
            i, now = inflight[out.request_id], time.perf_counter() - t0
            tokens[i] += out.token_ids
            first[i] = now if first[i] is None else first[i]
            if out.finished:
                done[i] = now
                del inflight[out.request_id]
    ttft = [f - a for f, a in zip(first, arrival)]
    tpot = [(d - f) / (len(tk) - 1) for f, d, tk in zip(first, done, tokens) if len(tk) > 1]
    return max(done), ttft, tpot, tokens


def warmup_prompts(prompts: list[list[int]], device: torch.device) -> list[list[int]]:
    """The warm-up's prompts. On CUDA the workload's own (run for 4 tokens), so every kernel
    the timed run's prompt chunks specialise (Triton compiles per shape bucket, seconds
    each with a cold cache) is built before the clock starts; elsewhere a few prompts whose
    lengths span the workload's (shortest, each power of two between, longest)."""
    if device.type == "cuda":
        return prompts
    lo, hi = min(map(len, prompts)), max(map(len, prompts))
    lengths = sorted({lo, hi, *(2**k for k in range(hi.bit_length()) if lo < 2**k < hi)})
    return [(prompts[0] * (n // len(prompts[0]) + 1))[:n] for n in lengths]


def run_kvtier(model, tokenizer, prompts, args, device) -> Result:
    from kvtier.serve.engine import LLMEngine, freeze_startup_heap

    engine = LLMEngine(model, tokenizer if args.structured or args.detokenize else None,
                       engine_config(args, device, prompts))
    concurrency = args.concurrency or len(prompts)
    flags = (args.penalties, args.bans, args.structured)
    drive(engine, warmup_prompts(prompts, device), 4, concurrency, math.inf, args.seed, *flags)  # warm-up
    freeze_startup_heap()  # as `kvtier serve` does once it has started
    try:
        duration, ttft, tpot, tokens = drive(engine, prompts, args.output_len, concurrency,
                                             args.request_rate, args.seed, *flags)
    finally:
        gc.unfreeze()  # the engine can be collected once it is done; the contender runs next
    s = engine.stats()
    graphs = "CUDA graphs" if engine.runner.graphs is not None else "eager"
    asked = "".join(f"{name}, " for name, on in zip(("penalties", "bad words", f"structured ({args.structured})",
                                                      "text made"), (*flags, args.detokenize)) if on)
    note = (f"{graphs}, {asked}{s['kv_storage']} pages, "
            f"{s['num_blocks']} blocks, {s['preemptions']} "
            f"preemptions, max_num_seqs {engine.config.max_num_seqs}, "
            f"max_batched_tokens {engine.scheduler.config.max_batched_tokens}")
    return Result("kvtier LLMEngine", len(prompts), sum(map(len, tokens)), duration, ttft, tpot, tokens, note)


# -- transformers ----------------------------------------------------------------------------------
def run_hf(model, prompts, args, device, kvtier: Result) -> Result:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from kvtier_bench.decode_gpu import hf_llama

    hf = hf_llama(model)
    hf.set_attn_implementation("paged|sdpa")
    gen = GenerationConfig(max_new_tokens=args.output_len, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    cb = None
    if device.type == "cpu":  # on CPU it would size its pool from the machine's memory (minutes)
        bs = 16
        blocks = sum(math.ceil((len(p) + args.output_len) / bs) for p in prompts) + 64
        cb = ContinuousBatchingConfig(num_blocks=blocks, page_size=bs, max_batch_tokens=512)
    with torch.no_grad():  # its worker updates, outside inference mode, tensors it makes here
        hf.generate_batch(warmup_prompts(prompts, device), generation_config=GenerationConfig(
            max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0),
            continuous_batching_config=cb)  # warm-up
        out = hf.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                record_timestamps=True)
    ordered = [out[k] for k in sorted(out, key=lambda k: int(k.rsplit("_", 1)[1]))]
    start = min(o.created_time for o in ordered)
    end = max(o.timestamps[-1] for o in ordered)
    ttft = [o.timestamps[0] - o.created_time for o in ordered]
    tpot = [(o.timestamps[-1] - o.timestamps[0]) / (len(o.timestamps) - 1) for o in ordered
            if len(o.timestamps) > 1]
    tokens = [list(o.generated_tokens) for o in ordered]
    same = sum(a == b for a, b in zip(tokens, kvtier.tokens))
    kvtier.note += f"; {same}/{len(tokens)} requests give transformers' tokens"
    note = "generate_batch, paged|sdpa" + ("" if cb is None else f", {cb.num_blocks} blocks of 16")
    return Result(f"transformers {versions()['transformers']}", len(prompts), sum(map(len, tokens)),
                  end - start, ttft, tpot, tokens, note)


# -- report ------------------------------------------------------------------------------------------
def print_table(results: list[Result], meta: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{meta['model']} on {meta['device']}: {meta['num_requests']} requests, prompts "
                    f"{meta['input_len'][0]}-{meta['input_len'][1]}, {meta['output_len']} new tokens"
                    + ("" if meta["kvtier_prefill_dtype"] == "float32"
                       else f", kvtier's prefill in {meta['kvtier_prefill_dtype']}")
                    + (", kvtier batch-invariant" if meta.get("kvtier_batch_invariant") else ""))
    for col in ("contender", "output tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                "TPOT p99 ms", "x transformers"):
        t.add_column(col, justify="left" if col == "contender" else "right")
    base = results[-1].output_tokens_per_s if len(results) > 1 else None
    for r in results:
        s = r.summary()
        t.add_row(r.name, f"{s['output_tokens_per_s']:.1f}", f"{s['requests_per_s']:.2f}",
                  *(f"{s[k]:.1f}" for k in ("ttft_50_ms", "ttft_99_ms", "tpot_50_ms", "tpot_99_ms")),
                  f"{r.output_tokens_per_s / base:.2f}" if base else "")
    console = Console()
    console.print(t)
    for r in results:
        console.print(f"{r.name}: {r.note}")


def plot(results: list[Result], meta: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    names = [r.name for r in results]
    axes[0].bar(names, [r.output_tokens_per_s for r in results], color=["C0", "C1"][: len(results)])
    axes[0].set_ylabel("output tokens/s")
    for ax, key, label in ((axes[1], "ttft_s", "TTFT (s)"), (axes[2], "tpot_s", "TPOT (ms)")):
        scale = 1000 if key == "tpot_s" else 1
        ax.boxplot([[x * scale for x in getattr(r, key)] for r in results], tick_labels=names)
        ax.set_ylabel(label)
    fig.suptitle(f"{meta['model']}, {meta['device']}: {meta['num_requests']} requests, "
                 f"{meta['output_len']} new tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
