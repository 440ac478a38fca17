"""CUDA decode of a Llama-3-8B-shaped model, eager and CUDA graph, against HF generate.

One run on one GPU, every contender with the same random bf16 weights
(:func:`kvtier.model.build_random`; the ``transformers`` model is built from an
equivalent ``LlamaConfig`` and holds views of the very same tensors):

- batch 1, a ``--prompt-tokens`` (512) prompt, ``--new-tokens`` (256) greedy tokens:
  kvtier's engine (:func:`kvtier.generate.generate_step`) over the paged tier
  eagerly (one step plan per step, no graph) and replayed from a CUDA graph, over
  the ragged tier from a CUDA graph; HF ``generate`` with its default DynamicCache
  and with ``cache_implementation="static"`` (which ``generate`` compiles). Roofline:
  the copy bandwidth measured in this run over the weight bytes one token reads.
- batch ``--big-batch`` (64) at ``--big-context`` (8192) tokens per row (fewer rows,
  a multiple of 8 where 8 fit, when their caches would take more than 85% of the free
  device memory; the row's note says so): the paged caches are filled with random keys
  and values (a decode step's cost does not depend on their values; a real prefill
  of 512k tokens would take most of the time budget), then ``--big-steps`` decode
  steps, eagerly and from a CUDA graph.
  Aggregate tokens/s against a roofline that counts the weights and every row's
  keys and values read per step.

Every contender runs once untimed with the same shapes (warm-up; compilation for
the static cache), then once timed. Decode tokens/s counts the ``N - 1`` tokens
after the first over the time between them (the first token's time comes from
the first read, or from a streamer for ``transformers``).

Example::

    kvtier bench decode_gpu --out benchmarks/results_decode_gpu.md
    kvtier bench decode_gpu --skip-static --big-steps 32     # quicker
"""

from __future__ import annotations

import argparse
import math
import time
import warnings
from dataclasses import dataclass, field

import torch

from kvtier.config import KVCacheConfig
from kvtier.generate import generate_step
from kvtier_bench.decode import hf_llama_config, hf_llama_weights, kv_bytes_per_token


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", default="llama3-8b", help="model shape (random weights)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens generated at batch 1")
    parser.add_argument("--hf-new-tokens", type=int, default=None,
                        help="tokens HF generates (default: --new-tokens)")
    parser.add_argument("--skip-hf", action="store_true", help="no transformers contenders")
    parser.add_argument("--skip-static", action="store_true",
                        help="no HF StaticCache (its compilation can take minutes)")
    parser.add_argument("--big-batch", type=int, default=64,
                        help="rows of the big batch (fewer where they do not fit; the row's note says so)")
    parser.add_argument("--big-context", type=int, default=8192)
    parser.add_argument("--big-steps", type=int, default=64, help="decode steps at the big batch")
    parser.add_argument("--skip-big", action="store_true", help="no big-batch run")
    parser.add_argument("--skip-compile", action="store_true",
                        help="no batch-1 run of the CUDA graph over a torch.compile'd forward")
    parser.add_argument("--out", default=None, help="write the tables as Markdown here")
    parser.add_argument("--device", default="cuda")


@dataclass
class Result:
    name: str
    batch: int
    context: int  # prompt (or filled) tokens per row
    steps: int  # tokens generated per row
    first_s: float
    tokens_per_s: float  # aggregate decode tokens/s (all rows)
    roofline: float  # aggregate tokens/s the bandwidth allows
    tokens: list[int] = field(default_factory=list)  # row 0's tokens
    note: str = ""


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"decode_gpu measures CUDA decode; got --device {args.device} with "
                         f"CUDA {'present' if torch.cuda.is_available() else 'absent'}")
    if args.prompt_tokens < 2 or args.new_tokens < 2 or args.big_steps < 2:
        raise ValueError("--prompt-tokens, --new-tokens and --big-steps must be at least 2")
    from kvtier.model import build_random

    t_start = time.perf_counter()
    model = build_random(args.arch, dtype=torch.bfloat16, device=device)
    bandwidth = copy_bandwidth(device)
    weights = weight_bytes(model)
    meta = {
        "model": f"{args.arch} (random weights), bfloat16, {weights / 1e9:.2f} GB of weights",
        "device": torch.cuda.get_device_name(device),
        "bandwidth": f"{bandwidth / 1e12:.2f} TB/s (device copy, bytes read + written, best of 10)",
        "versions": _versions(),
    }
    roof = bandwidth / weights
    # the peers' compilation comes late: the figures the issue asks for first
    sections = [lambda: batch1(model, args, roof)]
    if not args.skip_big:
        sections.append(lambda: big_batch(model, args, bandwidth, weights, kv_bytes_per_token(model, 1, 2)))  # (bf16)
    if not args.skip_hf:
        sections.append(lambda: hf_contenders(model, args, roof, static=False))
        if not args.skip_static:
            sections.append(lambda: hf_contenders(model, args, roof, static=True))
    if not args.skip_compile:  # last: a failure inside a capture can leave the device unusable
        sections.append(lambda: [compiled_graph(model, args, roof)])
    results: list[Result] = []
    for section in sections:
        results += section()
        torch.cuda.empty_cache()
        meta["seconds"] = f"{time.perf_counter() - t_start:.0f}"
        write_markdown(results, meta, args)  # after every section: a later failure keeps these
    print_table(results, meta)
    return 0


# -- measurements ---------------------------------------------------------------------------------
def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes per second of a device copy of ``nbytes`` (read + write), the best of 10."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * nbytes / best


def weight_bytes(model) -> int:
    """Bytes of every parameter once (tied weights once): what one decode step reads."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


def _random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine_run(model, prompts, caches, n, cuda_graph) -> tuple[float, float, list[int], list[str]]:
    """``n`` tokens per row through generate_step: (first_s, rest_s, row 0's tokens, warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        steps = generate_step(model, prompts, caches, cuda_graph=cuda_graph, max_steps=n + 1)
        tokens = [next(steps).tolist()[0]]  # reading a token waits for the device
        t1 = time.perf_counter()
        for _ in range(n - 1):
            tokens.append(next(steps).tolist()[0])
        t2 = time.perf_counter()
        steps.close()
    return t1 - t0, t2 - t1, tokens, [str(w.message) for w in caught]


def batch1(model, args, roof: float) -> list[Result]:
    """kvtier at batch 1: paged eager, paged CUDA graph, ragged CUDA graph."""
    L, n = args.prompt_tokens, args.new_tokens
    prompt = _random_ids(L, model.args.vocab_size, 0)
    blocks = math.ceil((L + n + 2) / 16) + 1
    out = []
    for name, tier, graph in (("kvtier paged, eager (step plan)", "paged", False),
                              ("kvtier paged, CUDA graph", "paged", True),
                              ("kvtier ragged, CUDA graph", "ragged", True)):
        cfg = KVCacheConfig(tier=tier, paged_num_blocks=blocks)
        for _ in range(2):  # warm-up, then the timed run, each on fresh caches
            caches = model.make_caches(cfg, batch_size=1)
            first, rest, tokens, notes = _engine_run(model, [prompt], caches, n, graph)
        note = "; ".join(dict.fromkeys(notes))
        if graph and not caches[0].frozen:
            note = ("not captured; " + note).strip("; ")
        out.append(Result(name, 1, L, n, first, (n - 1) / rest, roof, tokens, note))
        del caches
    return out


def compiled_graph(model, args, roof: float) -> Result:
    """Batch 1, the paged tier: a CUDA graph captured over a ``torch.compile``'d forward."""
    L, n = args.prompt_tokens, args.new_tokens
    name = "kvtier paged, CUDA graph over torch.compile"
    prompt = _random_ids(L, model.args.vocab_size, 0)
    cfg = KVCacheConfig(tier="paged", paged_num_blocks=math.ceil((L + n + 2) / 16) + 1)
    try:
        for _ in range(2):  # warm-up (compilation), then the timed run
            first, rest, tokens, note = _compiled_run(model, prompt, cfg, n)
        return Result(name, 1, L, n, first, (n - 1) / rest, roof, tokens, note)
    except Exception as e:  # an optional contender: report why, keep the others
        return Result(name, 1, L, n, float("nan"), float("nan"), roof,
                      note=f"failed: {type(e).__name__}: {str(e)[:200]}")


def _compiled_run(model, prompt, cfg, n) -> tuple[float, float, list[int], str]:
    """Greedy decode as generate_step does it on CUDA (the next step queued before a read)."""
    from kvtier.cuda_graph import CUDAGraphDecoder

    dev = model.output.weight.device
    caches = model.make_caches(cfg, batch_size=1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model(torch.tensor([prompt[:-1]], device=dev), caches, last_only=True)
        dec = CUDAGraphDecoder(model, caches, max_steps=n + 1, torch_compile=True)
        y = dec.step(torch.tensor([prompt[-1]], device=dev))[:, -1].argmax(-1)
        y_next = dec.step(y)[:, -1].argmax(-1)
        tokens = y.tolist()
        t1 = time.perf_counter()
        for _ in range(n - 1):
            y = y_next
            y_next = dec.step(y)[:, -1].argmax(-1)
            tokens += y.tolist()
        t2 = time.perf_counter()
    note = "" if dec.captured else f"not captured: {dec.eager_reason}"
    dec.close()
    return t1 - t0, t2 - t1, tokens, note


def hf_llama(model):
    """A ``transformers`` ``LlamaForCausalLM`` whose weights are views of ``model``'s (no copy).

    The views are :func:`kvtier_bench.decode.hf_llama_weights`; a tied LM head is tied again.
    """
    from transformers import LlamaForCausalLM

    a = model.args
    config = hf_llama_config(a, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    with torch.device("meta"):
        hf = LlamaForCausalLM(config)
    sd = hf_llama_weights(model)
    if a.tie_embeddings:
        del sd["lm_head.weight"]
    hf.load_state_dict(sd, strict=not a.tie_embeddings, assign=True)
    hf.tie_weights()
    # RoPE frequencies were made on the meta device: make them again (CPU, float32), then move
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=config).to(model.output.weight.device)
    return hf.eval()


class _FirstTokenClock:
    """A ``transformers`` streamer that notes when the first new token is out."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            torch.cuda.synchronize()
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def hf_contenders(model, args, roof: float, *, static: bool) -> list[Result]:
    """HF ``generate`` on the same weights: its default DynamicCache, or a StaticCache."""
    L = args.prompt_tokens
    n = args.hf_new_tokens or args.new_tokens
    hf = hf_llama(model)
    x = torch.tensor([_random_ids(L, model.args.vocab_size, 0)], device=model.output.weight.device)
    out = []
    contenders = [("HF generate, StaticCache (compiled)", {"cache_implementation": "static"})] if static \
        else [("HF generate, DynamicCache", {})]
    for name, kw in contenders:
        note = ""
        try:
            for _ in range(2):  # warm-up (and compilation), then the timed run
                clock = _FirstTokenClock()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.inference_mode():
                    ids = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                      min_new_tokens=n, do_sample=False, streamer=clock, **kw)
                torch.cuda.synchronize()
                t2 = time.perf_counter()
            out.append(Result(name, 1, L, n, clock.first - t0, (n - 1) / (t2 - clock.first), roof,
                              ids[0, L:].tolist(), note))
        except Exception as e:  # a peer that cannot run here is reported, not fatal
            out.append(Result(name, 1, L, n, float("nan"), float("nan"), roof,
                              note=f"failed: {type(e).__name__}: {str(e)[:160]}"))
        torch.cuda.empty_cache()
    del hf
    return out


def big_batch(model, args, bandwidth: float, weights: int, kv_token: int) -> list[Result]:
    """Paged caches holding ``--big-context`` random tokens per row; eager and graph decode."""
    n, a = args.big_steps, model.args
    ctx = min(args.big_context, a.max_position_embeddings - n)  # the engine stops at the context
    dev = model.output.weight.device
    row_pages = math.ceil((ctx + n + 2) / 16)
    B, fit_note = fitting_batch(args.big_batch, row_pages * 16 * kv_token, torch.cuda.mem_get_info(dev)[0])
    blocks = B * row_pages
    cfg = KVCacheConfig(tier="paged", paged_num_blocks=blocks)
    caches = model.make_caches(cfg, batch_size=B)
    g = torch.Generator(device=dev).manual_seed(0)
    shape, dtype = (B, a.n_kv_heads, ctx - 1, a.head_dim), model.output.weight.dtype
    with torch.inference_mode():
        k = torch.randn(shape, generator=g, device=dev, dtype=dtype)
        v = torch.randn(shape, generator=g, device=dev, dtype=dtype)
        for c in caches:
            c.update(k, v)
    del k, v
    prompts = [_random_ids(ctx, a.vocab_size, r) for r in range(B)]  # all but the last are cached
    per_step = weights + B * (ctx + n / 2) * kv_token  # bytes one step reads, on average
    roof = B * bandwidth / per_step
    out = []
    for name, graph in (("kvtier paged, eager (step plan)", False), ("kvtier paged, CUDA graph", True)):
        for _ in range(2):
            first, rest, tokens, notes = _engine_run(model, prompts, caches, n, graph)
            with torch.inference_mode():
                for c in caches:  # back to the filled context for the next run
                    c.trim(c.size() - (ctx - 1))
        note = "; ".join(dict.fromkeys(n for n in (fit_note, *notes) if n))
        if graph and not caches[0].frozen:
            note = ("not captured; " + note).strip("; ")
        out.append(Result(name, B, ctx, n, first, B * (n - 1) / rest, roof, tokens, note))
    del caches
    return out


def fitting_batch(asked: int, row_bytes: float, free: int, *, headroom: float = 0.85) -> tuple[int, str]:
    """The big batch's rows: ``asked``, or fewer (a multiple of 8 where 8 or more fit) whose
    caches take at most ``headroom`` of the ``free`` device bytes (the rest: the fill's random
    keys and values, activations, the graph's pool), with a note saying so; at least one row."""
    if asked < 1:
        raise ValueError(f"--big-batch must be >= 1, got {asked} (--skip-big leaves the section out)")
    fits = int(headroom * free // row_bytes)
    rows = max(1, fits // 8 * 8 if fits >= 8 else fits)
    if asked <= fits or rows >= asked:
        return asked, ""
    note = (f"batch {rows}, not {asked}: {asked} rows' keys and values take {asked * row_bytes / 1e9:.1f} GB, "
            f"{headroom:.0%} of the {free / 1e9:.1f} GB free is {headroom * free / 1e9:.1f}")
    print(f"decode_gpu: {note}")
    return rows, note


# -- output -------------------------------------------------------------------------------------------
def _versions() -> str:
    parts = [f"torch {torch.__version__}"]
    for mod in ("triton", "transformers"):
        try:
            parts.append(f"{mod} {__import__(mod).__version__}")
        except ImportError:
            parts.append(f"{mod} absent")
    return ", ".join(parts)


def _rows(results: list[Result]) -> list[list[str]]:
    peers = {r.name: r.tokens_per_s for r in results if r.name.startswith("HF") and r.batch == 1}
    dyn = peers.get("HF generate, DynamicCache")
    static = peers.get("HF generate, StaticCache (compiled)")
    ref = next((r.tokens for r in results if r.batch == 1 and r.tokens), [])
    rows = []
    for r in results:
        same = "-"
        if r.batch == 1 and r.tokens and ref:
            same = f"{next((i for i, (x, y) in enumerate(zip(r.tokens, ref)) if x != y), len(ref))}/{len(ref)}"
        ok = r.tokens_per_s == r.tokens_per_s  # not NaN
        rows.append([
            r.name, str(r.batch), str(r.context), str(r.steps),
            f"{r.first_s:.3f}" if ok else "-",
            f"{r.tokens_per_s:.1f}" if ok else "-",
            f"{1e3 * r.batch / r.tokens_per_s:.2f}" if ok else "-",
            f"{100 * r.tokens_per_s / r.roofline:.0f}% of {r.roofline:.0f}" if ok else "-",
            f"{r.tokens_per_s / dyn:.2f}x" if ok and dyn and r.batch == 1 else "-",
            f"{r.tokens_per_s / static:.2f}x" if ok and static and r.batch == 1 else "-",
            same, r.note,
        ])
    return rows


HEADER = ["contender", "batch", "context", "new tokens", "prefill + 1st (s)", "decode tok/s",
          "ms/step", "roofline", "vs HF Dynamic", "vs HF Static", "same tokens", "note"]


def write_markdown(results: list[Result], meta: dict, args) -> None:
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(_markdown(_rows(results), meta, args))


def print_table(results: list[Result], meta: dict) -> None:
    rows = _rows(results)
    title = (f"decode on {meta['device']}: {meta['model']}; copy bandwidth {meta['bandwidth']}")
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(_markdown_table(rows))
    else:
        table = Table(title=title)
        for col in HEADER:
            table.add_column(col, justify="left" if col in ("contender", "note") else "right")
        for row in rows:
            table.add_row(*row)
        Console(width=200).print(table)


def _markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _markdown(rows, meta, args) -> str:
    hf_n = args.hf_new_tokens or args.new_tokens
    return "\n".join([
        "# End-to-end decode on CUDA: kvtier against HF generate",
        "",
        f"Date: {time.strftime('%Y-%m-%d %H:%M')}. Device: {meta['device']}. {meta['versions']}.",
        f"Model: {meta['model']}. Copy bandwidth: {meta['bandwidth']}. Whole run: {meta['seconds']} s.",
        "",
        f"Command: `kvtier bench decode_gpu --prompt-tokens {args.prompt_tokens} --new-tokens "
        f"{args.new_tokens}{'' if args.hf_new_tokens is None else f' --hf-new-tokens {hf_n}'}"
        f"{' --skip-hf' if args.skip_hf else ''}{' --skip-static' if args.skip_static else ''}"
        f" --big-batch {args.big_batch} --big-context {args.big_context} --big-steps {args.big_steps}"
        f"{' --skip-big' if args.skip_big else ''}{' --skip-compile' if args.skip_compile else ''}`",
        "",
        f"Batch 1: {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens for kvtier and "
        f"{hf_n} for HF, greedy; each contender timed after an identical warm-up call. Roofline "
        "at batch 1: copy bandwidth / weight bytes per token. Batch "
        f"{args.big_batch}: caches filled with {args.big_context - 1} random tokens per row, "
        f"{args.big_steps} steps; roofline: batch x bandwidth / (weight bytes + every row's "
        "K/V bytes) per step. Decode tok/s counts all rows; ms/step is per step.",
        "",
        _markdown_table(rows),
        "",
    ])
