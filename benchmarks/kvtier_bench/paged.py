"""Bytes per token, fragmentation and codec error of the paged tier.

Three tables, each measured against a peer in the same run:

1. **Bytes per token** of every storage mode (fp16 baseline, q8, q4, q4_g32,
   TurboQuant K8/V3, K5r/V4, K4r/V4) for the head shapes of SmolLM2-135M
   (3 kv heads, head_dim 64, 30 layers) and Llama-3-8B (8, 128, 32 layers): read
   from a real :class:`~kvtier.caches.paged.PagedKVCache`'s ``paged_stats()``
   after one write, with the compression ratio against fp16 and the KV memory
   of an 8k-token context for the whole model.
2. **Fragmentation**: ``--sequences`` sequences with lengths drawn (seeded)
   uniformly from ``--min-len .. --max-len``, held by paged caches of block
   size 16, 256 and 1024 (pool sized to exactly the blocks the rows hold), by one
   tail cache per sequence (step padding), and by one tail cache for the whole
   batch (every row padded to the longest). Waste = allocated slots not holding a
   live token.
3. **Codec error**: relative MSE ``|x - x^|^2 / |x|^2`` of K and V per mode on
   standard Gaussian vectors at ``--error-head-dim``, beside the Lloyd-Max
   figures TurboQuant's value codes should approach (2/3/4 bits: 0.117, 0.034,
   0.0095 for the unit-norm coordinate density).

Example::

    kvtier bench paged
    python benchmarks/paged.py --sequences 64 --plot benchmarks/paged.png
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch

from kvtier.caches.paged import PagedKVCache
from kvtier.caches.tail_owned import TailOwnedKVCache
from kvtier.config import TurboQuantConfig
from kvtier_bench import FOLDER


@dataclass(frozen=True)
class Mode:
    label: str
    kv_quant: str | None = None
    turboquant: TurboQuantConfig | None = None

    @property
    def expected(self) -> str:
        return "turboquant" if self.turboquant else (self.kv_quant or "fp")


MODES = (
    Mode("fp16"),
    Mode("q8", "q8"),
    Mode("q4", "q4"),
    Mode("q4_g32", "q4_g32"),
    Mode("TurboQuant K8/V3", turboquant=TurboQuantConfig("q8_0", "q3_0")),
    Mode("TurboQuant K5r/V4", turboquant=TurboQuantConfig("q5_0", "q4_0", rotate_keys=True)),
    Mode("TurboQuant K4r/V4", turboquant=TurboQuantConfig("q4_0", "q4_0", rotate_keys=True)),
)
#: (name, kv_heads, head_dim, layers)
SHAPES = (("SmolLM2-135M", 3, 64, 30), ("Llama-3-8B", 8, 128, 32))
#: MSE of Lloyd-Max coding of the unit-sphere coordinate density, by bits (TurboQuant paper)
LLOYD_MAX_MSE = {2: 0.117, 3: 0.034, 4: 0.0095}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sequences", type=int, default=64, help="sequences in the fragmentation table")
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=8000)
    parser.add_argument("--block-sizes", default="16,256,1024", help="comma-separated paged block sizes")
    parser.add_argument("--tail-step", type=int, default=256, help="step of the tail tier peer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--error-vectors", type=int, default=4096,
                        help="Gaussian (token, head) vectors per codec error measurement")
    parser.add_argument("--error-head-dim", type=int, default=128)
    parser.add_argument("--context", type=int, default=8192,
                        help="context for the whole-model KV memory column")
    parser.add_argument("--plot", default=str(FOLDER / "paged.png"), help=f"PNG written here (default {FOLDER / 'paged.png'}, beside the benchmarks; \"\" for none)")


# -- measurements ------------------------------------------------------------------------------------
def bytes_per_token(mode: Mode, kv_heads: int, head_dim: int) -> tuple[int, float, float]:
    """(bytes per token per layer, K bits/element, V bits/element) from a real fp16 cache."""
    cache = PagedKVCache(16, 1, kv_quant=mode.kv_quant, turboquant=mode.turboquant)
    x = torch.randn(1, kv_heads, 1, head_dim, dtype=torch.float16)
    cache.update(x, x)
    s = cache.paged_stats()
    assert s["mode"] == mode.expected, f"{mode.label} fell back: {s}"
    return s["bytes_per_token"], cache.codecs.k_codec.bits_per_element(), cache.codecs.v_codec.bits_per_element()


@dataclass
class Layout:
    label: str
    slots: int  # allocated token slots
    live: int

    @property
    def waste(self) -> int:
        return self.slots - self.live

    @property
    def waste_pct(self) -> float:
        return 100.0 * self.waste / self.slots


def draw_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


def fragmentation(lengths: list[int], block_sizes: list[int], tail_step: int) -> list[Layout]:
    """Each layout holding the same sequences (one kv head of 8 channels: only slots matter)."""
    B, n = len(lengths), max(lengths)
    k = torch.zeros(B, 1, n, 8, dtype=torch.float16)  # (B, H_kv, T, D)
    out = []
    for bs in block_sizes:
        blocks = sum(math.ceil(L / bs) for L in lengths)
        cache = PagedKVCache(bs, blocks, batch_size=B)
        cache.update(k, k, new_offsets=lengths)  # tokens past a row's length are not stored
        s = cache.paged_stats()
        assert s["free_blocks"] == 0 and s["live_tokens"] == sum(lengths)
        out.append(Layout(f"paged, block {bs}", s["capacity"], s["live_tokens"]))
    slots = 0
    for L in lengths:
        tail = TailOwnedKVCache(step=tail_step)
        tail.update(k[:1, :, :L], k[:1, :, :L])
        slots += tail.capacity
    out.append(Layout(f"tail step {tail_step}, a cache per sequence", slots, sum(lengths)))
    batched = TailOwnedKVCache(step=tail_step)
    batched.update(k, k)  # a rectangular batch: every row as long as the longest
    out.append(Layout(f"tail step {tail_step}, one padded batch",
                      B * batched.capacity, sum(lengths)))
    return out


def codec_error(mode: Mode, head_dim: int, vectors: int, seed: int) -> tuple[float, float]:
    """Relative MSE of K and V through the mode's codecs on N(0, 1) vectors ``[vectors, 1, D]``."""
    cache = PagedKVCache(16, 1, kv_quant=mode.kv_quant, turboquant=mode.turboquant)
    x = torch.randn(1, 1, 1, head_dim)
    cache.update(x, x)  # chooses the codecs for this head_dim
    assert cache.paged_stats()["mode"] == mode.expected
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(vectors, 1, head_dim, generator=g)
    errs = []
    for codec in (cache.codecs.k_codec, cache.codecs.v_codec):
        y = codec.roundtrip(x)
        errs.append(float(((x - y) ** 2).sum() / (x**2).sum()))
    return errs[0], errs[1]


# -- output ------------------------------------------------------------------------------------------
def _plot(per_token: dict, layouts: list[Layout], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_b, ax_w) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [m.label for m in MODES]
    width = 0.8 / len(SHAPES)
    for i, (name, *_rest) in enumerate(SHAPES):
        ratios = [per_token[name]["fp16"] / per_token[name][m] for m in labels]
        ax_b.bar([j + i * width for j in range(len(labels))], ratios, width, label=name)
    ax_b.set_xticks([j + width / 2 for j in range(len(labels))], labels, rotation=30, ha="right")
    ax_b.set_ylabel("compression vs fp16 (x)")
    ax_b.set_title("KV bytes per token, sidecars included")
    ax_b.legend()
    ax_w.barh([lay.label for lay in layouts], [lay.waste_pct for lay in layouts])
    ax_w.set_xlabel("allocated slots not holding a token (%)")
    ax_w.set_title("fragmentation")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Measure, print the three tables, write the plot; returns 0 (a bad flag: ValueError)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    try:
        block_sizes = [int(b) for b in args.block_sizes.split(",")]
    except ValueError:
        raise ValueError(f"--block-sizes {args.block_sizes!r}: give comma-separated ints, e.g. 16,32") from None
    if not 0 < args.min_len <= args.max_len:
        raise ValueError(f"--min-len {args.min_len} and --max-len {args.max_len}: need 0 < --min-len <= --max-len")
    if args.sequences <= 0 or min(block_sizes) <= 0:
        raise ValueError(f"--sequences {args.sequences} and --block-sizes {args.block_sizes!r} must be positive")

    per_token: dict[str, dict[str, int]] = {}
    for name, H, D, layers in SHAPES:
        t = Table(title=f"{name}: KV bytes per token (kv_heads {H}, head_dim {D}, {layers} layers; "
                        f"bits per element with sidecars; last column: whole model)")
        for col in ("mode", "K bits", "V bits", "B/token/layer", "vs fp16",
                    f"KV @{args.context}"):
            t.add_column(col, justify="left" if col == "mode" else "right")
        per_token[name] = {}
        for mode in MODES:
            b, kb, vb = bytes_per_token(mode, H, D)
            per_token[name][mode.label] = b
            ratio = per_token[name]["fp16"] / b
            t.add_row(mode.label, f"{kb:.2f}", f"{vb:.2f}", str(b), f"{ratio:.2f}x",
                      f"{b * layers * args.context / 2**20:.1f} MiB")
        console.print(t)

    lengths = draw_lengths(args.sequences, args.min_len, args.max_len, args.seed)
    layouts = fragmentation(lengths, block_sizes, args.tail_step)
    t = Table(title=f"fragmentation: {args.sequences} sequences of {args.min_len}..{args.max_len} "
                    f"tokens (seed {args.seed}, {sum(lengths)} tokens, longest {max(lengths)})")
    for col in ("layout", "allocated slots", "waste slots", "waste %"):
        t.add_column(col, justify="left" if col == "layout" else "right")
    for lay in layouts:
        t.add_row(lay.label, str(lay.slots), str(lay.waste), f"{lay.waste_pct:.2f}")
    console.print(t)

    D = args.error_head_dim
    t = Table(title=f"codec error: relative MSE on N(0,1) vectors, head_dim {D}, "
                    f"{args.error_vectors} vectors (seed {args.seed})")
    for col in ("mode", "K rel. MSE", "V rel. MSE", "Lloyd-Max (V)"):
        t.add_column(col, justify="left" if col == "mode" else "right")
    for mode in MODES[1:]:
        ek, ev = codec_error(mode, D, args.error_vectors, args.seed)
        bits = None if mode.turboquant is None else int(mode.turboquant.value_quant[1])
        t.add_row(mode.label, f"{ek:.2e}", f"{ev:.2e}", f"{LLOYD_MAX_MSE.get(bits, '')}")
    console.print(t)

    if args.plot:
        _plot(per_token, layouts, args.plot)
        console.print(f"plot written to {args.plot}")
    return 0
