"""F.linear (PyTorch's BLAS call) against oneDNN's linear (kvtier.model.linear) on the CPU,
float32, for every projection shape of a model, at several row counts.

    python benchmarks/tools/cpu_linear.py [--arch smollm2-135m] [--rows 1,16,64,512] [--threads 2]
    python benchmarks/tools/cpu_linear.py --model    # the default model end to end

Prints per shape the median time of each and the ratio, then the whole model's linears per
forward (each layer's projections times the layers, plus the LM head), and the largest
difference between the two results. Each weight is hot in cache there. ``--model`` times
the default model in float32 (tail tier) instead, weights streamed from memory: a 512-token
prefill and 32 decode steps after a 64-token prompt, oneDNN on and off
(``torch.backends.mkldnn.enabled``), two rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn import functional as F


def median_time(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="smollm2-135m")
    p.add_argument("--rows", default="1,16,64,512")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", action="store_true", help="time the default model end to end instead")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.model:
        return model_times()
    from kvtier.model.architectures import ARCHITECTURES
    from kvtier.model.linear import HAVE_ONEDNN, linear

    if not HAVE_ONEDNN:
        raise SystemExit("this PyTorch has no oneDNN linear (torch.ops.mkldnn._linear_pointwise)")
    a = ARCHITECTURES[args.arch]
    qkv = (a.n_heads + 2 * a.n_kv_heads) * a.head_dim
    shapes = {"wqkv": (qkv, a.dim), "wo": (a.dim, a.n_heads * a.head_dim), "w13": (2 * a.hidden_dim, a.dim),
              "w2": (a.dim, a.hidden_dim), "output": (a.vocab_size, a.dim)}
    print(f"{args.arch}, float32, {args.threads} threads, torch {torch.__version__}")
    print(f"{'rows':>5} {'weight':>7} {'shape':>12} {'F.linear us':>12} {'oneDNN us':>10} {'ratio':>6} {'max diff':>9}")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            total_f = total_o = 0.0
            for name, (n, k) in shapes.items():
                w, x = torch.randn(n, k), torch.randn(rows, k)
                tf = median_time(lambda x=x, w=w: F.linear(x, w))
                to = median_time(lambda x=x, w=w: linear(x, w))
                diff = (linear(x, w) - F.linear(x, w)).abs().max().item()
                times = 1 if name == "output" else a.n_layers
                total_f, total_o = total_f + tf * times, total_o + to * times
                print(f"{rows:>5} {name:>7} {f'{n}x{k}':>12} {tf * 1e6:>12.0f} {to * 1e6:>10.0f} {tf / to:>5.2f}x {diff:>9.1e}")
            print(f"{rows:>5} {'model':>7} {'':>12} {total_f * 1e6:>12.0f} {total_o * 1e6:>10.0f} "
                  f"{total_f / total_o:>5.2f}x")


def model_times() -> None:
    from kvtier.config import KVCacheConfig
    from kvtier.model import load_model

    model = load_model(device="cpu", dtype=torch.float32, progress=False, pack=False).model
    tokens = torch.randint(0, model.args.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))

    def prefill() -> None:
        model(tokens, model.make_caches(KVCacheConfig(tier="tail")), last_only=True)

    def decode_ms() -> float:
        caches = model.make_caches(KVCacheConfig(tier="tail"))
        model(tokens[:, :64], caches, last_only=True)
        t = time.perf_counter()
        for i in range(32):
            model(tokens[:, 64 + i : 65 + i], caches, last_only=True)
        return (time.perf_counter() - t) / 32 * 1e3

    print(f"default model, float32, tail tier, {torch.get_num_threads()} threads, torch {torch.__version__}")
    with torch.inference_mode():
        for _ in range(2):
            for on in (True, False):
                with torch.backends.mkldnn.flags(enabled=on):
                    pre = median_time(prefill, reps=3)
                    print(f"{'oneDNN' if on else 'F.linear':>8}: prefill 512 tokens {pre * 1e3:.0f} ms, "
                          f"decode {decode_ms():.1f} ms/token")


if __name__ == "__main__":
    main()
