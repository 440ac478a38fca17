"""Tensor-parallel decode: tokens and throughput on N ranks against one device, same weights.

One launch of ``--world-size`` ranks (:func:`kvtier.parallel.launch`; NCCL on CUDA,
gloo on the CPU). Every rank builds the same seeded random model
(:func:`kvtier.model.build_random`); rank 0 first runs it whole, as one device
would, while the others wait; then every rank keeps its shard
(:func:`kvtier.parallel.shard_model`) and the same work runs tensor-parallel:

- check (each ``--check-dtypes``): a ``--prompt-tokens`` prompt, then
  ``--check-tokens`` greedy tokens through the engine (paged tier; a CUDA graph on
  CUDA, which captures the collectives), and the largest difference of the prompt's
  last logits. Tokens equal in float32 is the test; bfloat16 rounds each rank's
  partial sums before they are added, so its tokens may part after a while.
- throughput (bfloat16 on CUDA): ``--big-batch`` rows holding ``--big-context``
  random tokens each in paged caches, then ``--big-steps`` decode steps, eagerly and
  from a CUDA graph, on one device and on N; aggregate tokens/s and the ratio.

``--shard-init`` builds each rank's shard directly on its device (the full weights
never exist: a 70B model in bf16 is about 141 GB, 131 GiB), skips the one-device
runs and the check, and reports the ranks' throughput and memory. ``--tiny`` runs
the same path on the CPU with tiny shapes (a dry run of the GPU script).

Example::

    kvtier bench tensor_parallel --world-size 2 --out tp.md            # 2 GPUs, Llama-3-8B shape
    kvtier bench tensor_parallel --arch llama3-70b --shard-init --big-batch 32
    kvtier bench tensor_parallel --tiny                                # CPU, gloo
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from kvtier.config import KVCacheConfig
from kvtier.generate import generate_step
from kvtier.model import ModelArgs, build_random
from kvtier.model.architectures import get_args
from kvtier.parallel import build_random_shard, launch, shard_model

#: shapes this benchmark knows beside kvtier.model.ARCHITECTURES
SHAPES = {
    "llama3-70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, hidden_dim=28672,
                            vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
    "tiny-tp": ModelArgs(dim=128, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=16, hidden_dim=192,
                         vocab_size=257, max_position_embeddings=1024),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", default="llama3-8b", help="model shape (random weights)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--check-tokens", type=int, default=32, help="0: no token check")
    parser.add_argument("--check-dtypes", default="float32,bfloat16")
    parser.add_argument("--big-batch", type=int, default=64)
    parser.add_argument("--big-context", type=int, default=8192)
    parser.add_argument("--big-steps", type=int, default=32)
    parser.add_argument("--shard-init", action="store_true",
                        help="build each rank's shard on its device (no full model, no 1-device run)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (gloo)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="collective timeout (s)")
    parser.add_argument("--out", default=None, help="write the table as Markdown here (+ .json)")


@dataclass
class Row:
    what: str
    devices: int
    dtype: str
    batch: int
    context: int
    steps: int
    tokens_per_s: float = float("nan")
    same_tokens: str = "-"
    max_logit_diff: float = float("nan")
    note: str = ""


def run(args: argparse.Namespace) -> int:
    if args.tiny:
        args.arch, args.device, args.prompt_tokens, args.check_tokens = "tiny-tp", "cpu", 12, 8
        args.big_batch, args.big_context, args.big_steps = 4, 48, 4
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda needs a GPU; use --tiny (or --device cpu) for a CPU run")
    bad = [d for d in args.check_dtypes.split(",") if d and d not in ("float32", "bfloat16", "float16")]
    if bad:
        raise ValueError(f"--check-dtypes {args.check_dtypes}: {', '.join(bad)} is not one of float32, "
                         "bfloat16, float16")
    t0 = time.perf_counter()
    out = launch(_rank, args.world_size, args=(vars(args),), device_type=args.device,
                 timeout_s=args.timeout)
    out["meta"]["seconds"] = round(time.perf_counter() - t0, 1)
    rows = [Row(**r) for r in out["rows"]]
    text = _markdown(rows, out["meta"], args)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
        with open(args.out.rsplit(".", 1)[0] + ".json", "w", encoding="utf-8") as f:
            json.dump({"meta": out["meta"], "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


def shape(name: str) -> ModelArgs:
    return SHAPES[name] if name in SHAPES else get_args(name)


# -- on every rank --------------------------------------------------------------------------------
def _rank(tp, a: dict) -> dict:
    args = shape(a["arch"])
    rows: list[Row] = []
    meta = {"arch": a["arch"], "world_size": tp.world_size, "device": _device_name(tp.device),
            "versions": f"torch {torch.__version__}", "params": args.n_params}
    if a["shard_init"]:
        model = build_random_shard(args, tp, dtype=torch.bfloat16)
        meta["weights_per_rank_gib"] = round(_weight_bytes(model) / 2**30, 2)
        rows += _report(tp, _throughput(model, a, tp.world_size))
        meta["peak_gib_per_rank"] = _peak_gib(tp)
        return {"rows": [asdict(r) for r in rows], "meta": meta}
    dtypes = [d for d in a["check_dtypes"].split(",") if d] if a["check_tokens"] else []
    for name in dtypes:
        rows += _report(tp, _check(args, tp, a, getattr(torch, name)))
    big_dtype = torch.bfloat16 if tp.device.type == "cuda" else torch.float32
    if a["big_batch"]:
        model = build_random(args, dtype=big_dtype, device=tp.device)
        if tp.is_first:
            rows += _report(tp, _throughput(model, a, 1))
        _free()
        dist.barrier()
        model = shard_model(model, tp)
        _free()
        sharded = _throughput(model, a, tp.world_size)
        rows += sharded
        _ratios(rows)
        _report(tp, sharded)
    meta["peak_gib_per_rank"] = _peak_gib(tp)
    return {"rows": [asdict(r) for r in rows], "meta": meta}


def _report(tp, rows: list[Row]) -> list[Row]:
    """Print each row as it is measured (rank 0), so a run cut short keeps what it had."""
    if tp.is_first:
        for r in rows:
            print(f"[tensor_parallel] {json.dumps(asdict(r))}", flush=True)
    return rows


def _check(args: ModelArgs, tp, a: dict, dtype: torch.dtype) -> list[Row]:
    """Greedy tokens and the prompt's last logits, one device (rank 0) then all ranks."""
    model = build_random(args, dtype=dtype, device=tp.device)
    prompt = _ids(a["prompt_tokens"], args.vocab_size, 0)
    n = a["check_tokens"]
    single = _greedy(model, prompt, n) if tp.is_first else None
    _free()
    dist.barrier()
    model = shard_model(model, tp)
    _free()
    tokens, logits, note = _greedy(model, prompt, n)
    del model
    _free()
    if not tp.is_first:
        return []
    same = next((i for i, (x, y) in enumerate(zip(tokens, single[0])) if x != y), n)
    diff = float((logits - single[1]).abs().max())
    name = str(dtype).removeprefix("torch.")
    return [Row("greedy check, 1 device", 1, name, 1, len(prompt), n, note=single[2]),
            Row(f"greedy check, {tp.world_size} ranks", tp.world_size, name, 1, len(prompt), n,
                same_tokens=f"{same}/{n}", max_logit_diff=diff, note=note)]


def _greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor, str]:
    """``n`` greedy tokens through the engine (paged; a CUDA graph on CUDA), the prompt's
    last logits (float32, CPU), and how the steps ran."""
    device = model.output.weight.device
    with torch.inference_mode():
        x = torch.tensor([prompt], device=device)
        caches = model.make_caches(KVCacheConfig(tier="tail"))
        logits = model(x, caches, last_only=True)[0, -1].float().cpu()  # (V,)
    cfg = KVCacheConfig(tier="paged", paged_num_blocks=math.ceil((len(prompt) + n + 2) / 16) + 1)
    caches = model.make_caches(cfg, batch_size=1)
    steps = generate_step(model, [prompt], caches, max_steps=n + 1)
    tokens = [next(steps).tolist()[0] for _ in range(n)]
    steps.close()
    return tokens, logits, "CUDA graph" if caches[0].frozen else "eager"


def _throughput(model, a: dict, devices: int) -> list[Row]:
    """Decode tokens/s of ``--big-batch`` rows at ``--big-context``, eager and CUDA graph."""
    B, ctx, n = a["big_batch"], a["big_context"], a["big_steps"]
    args, device = model.args, model.output.weight.device  # args: this rank's heads
    dtype = model.output.weight.dtype
    cfg = KVCacheConfig(tier="paged", paged_num_blocks=B * math.ceil((ctx + n + 2) / 16))
    caches = model.make_caches(cfg, batch_size=B)
    g = torch.Generator(device=device).manual_seed(0)
    kv_shape = (B, args.n_kv_heads, ctx - 1, args.head_dim)  # (B, H_kv local, T, D)
    with torch.inference_mode():
        for c in caches:  # random keys and values: a decode step's cost does not depend on them
            k = torch.randn(kv_shape, generator=g, device=device, dtype=dtype)
            c.update(k, torch.randn(kv_shape, generator=g, device=device, dtype=dtype))
            del k
    prompts = [_ids(ctx, args.vocab_size, r) for r in range(B)]  # all but the last are cached
    graphs = (False, True) if device.type == "cuda" else (False,)
    rows = []
    for graph in graphs:
        for _ in range(2):  # warm-up (compilation, capture), then the timed run
            rate = _decode_rate(model, prompts, caches, n, graph, device)
            with torch.inference_mode():
                for c in caches:  # back to the filled context
                    c.trim(c.size() - (ctx - 1))
        mode = "CUDA graph" if graph else "eager"
        rows.append(Row(f"decode, paged, {mode}", devices, str(dtype).removeprefix("torch."),
                        B, ctx, n, tokens_per_s=rate))
    del caches
    _free()
    return rows


def _decode_rate(model, prompts, caches, n: int, graph: bool, device: torch.device) -> float:
    """Aggregate tokens/s of the ``n - 1`` steps after the first."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    steps = generate_step(model, prompts, caches, cuda_graph=graph, max_steps=n + 1)
    next(steps).tolist()
    sync()
    t = time.perf_counter()
    for _ in range(n - 1):
        next(steps).tolist()
    dt = time.perf_counter() - t
    steps.close()
    return len(prompts) * (n - 1) / dt


def _ratios(rows: list[Row]) -> None:
    one = {r.what: r.tokens_per_s for r in rows if r.devices == 1 and r.what.startswith("decode")}
    for r in rows:
        if r.devices > 1 and r.what in one:
            r.note = f"{r.tokens_per_s / one[r.what]:.2f}x one device"


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _weight_bytes(model) -> int:
    return sum({p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}.values())


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _peak_gib(tp) -> float | None:
    if tp.device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(tp.device) / 2**30, 1)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# -- output -------------------------------------------------------------------------------------------
HEADER = ["what", "devices", "dtype", "batch", "context", "steps", "tokens/s", "same tokens",
          "max |Δ logit|", "note"]


def _markdown(rows: list[Row], meta: dict, args) -> str:
    lines = [f"# Tensor parallel: {meta['arch']} (random weights, {meta['params'] / 1e9:.2f} B "
             f"parameters) on {meta['world_size']} x {meta['device']}", "",
             f"{meta['versions']}. Whole run: {meta['seconds']} s. Peak memory per rank: "
             f"{meta.get('peak_gib_per_rank')} GiB"
             + (f"; weights per rank: {meta['weights_per_rank_gib']} GiB"
                if "weights_per_rank_gib" in meta else "") + ".", "",
             "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in rows:
        cells = [r.what, str(r.devices), r.dtype, str(r.batch), str(r.context), str(r.steps),
                 "-" if math.isnan(r.tokens_per_s) else f"{r.tokens_per_s:.1f}", r.same_tokens,
                 "-" if math.isnan(r.max_logit_diff) else f"{r.max_logit_diff:.3g}", r.note]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
