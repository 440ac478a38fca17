"""Int8 activations (``KVTIER_ACT_QUANT=q8``) against the exact products, token by token.

    PYTHONPATH=src python3 benchmarks/tools/act_quant_agreement.py [--tokens 2048] [--context 1024]

Feeds the evaluation text (``kvtier eval``'s default, Python's ``pydoc_data.topics``) through
the default model one token at a time on the tail tier, in windows of ``--context`` tokens
(each window's first 16 tokens as one call), once with the exact products and once with int8
activations, and prints for the decoded positions: the perplexity of each mode, the mean and
largest KL divergence of the int8 distribution from the exact one, top-1 agreement, and the
mean relative difference of the logits. Both runs see the same tokens (teacher forcing), so
the figures measure one step's rounding, not diverging text.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from kvtier.evaluate import default_text, encode_text
from kvtier.model import load_model


def run(model, ids: list[int], context: int, mode: str) -> torch.Tensor:
    """Log-probabilities ``[n, V]`` of every position after each window's first 16 tokens."""
    model.act_quant = mode
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), context):
            window = ids[start:start + context]
            caches = model.make_caches()
            model(torch.tensor([window[:16]]), caches)
            for t in window[16:]:
                out.append(torch.log_softmax(model(torch.tensor([[t]]), caches)[0, -1], -1))
    return torch.stack(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(device="cpu", dtype=torch.float32, progress=False)
    ids = encode_text(lm.tokenizer, default_text(), args.tokens + 1)
    inputs = ids[:-1]
    targets = torch.tensor([t for s in range(0, len(inputs), args.context)
                            for t in ids[s + 17:s + args.context + 1]])
    logp = {}
    for mode in ("none", "q8"):
        t0 = time.perf_counter()
        logp[mode] = run(lm.model, inputs, args.context, mode)
        print(f"{mode}: {logp[mode].shape[0]} positions in {time.perf_counter() - t0:.1f} s")
    exact, int8 = logp["none"], logp["q8"]
    n = min(len(targets), exact.shape[0])
    for mode, lp in logp.items():
        nll = -lp[:n].gather(1, targets[:n, None]).mean().item()
        print(f"ppl {mode}: {math.exp(nll):.4f}")
    kl = (exact.exp() * (exact - int8)).sum(-1)
    rel = (int8.exp() - exact.exp()).norm(dim=-1) / exact.exp().norm(dim=-1)
    logits_rel = ((int8 - exact) - (int8 - exact).mean(-1, keepdim=True)).norm(dim=-1) / \
        (exact - exact.mean(-1, keepdim=True)).norm(dim=-1)
    agree = (exact.argmax(-1) == int8.argmax(-1)).float().mean().item()
    print(f"positions {exact.shape[0]}: KL mean {kl.mean():.2e} max {kl.max():.2e}; top-1 agreement "
          f"{100 * agree:.2f}%; probabilities' relative difference mean {rel.mean():.3f}; "
          f"log-probabilities' relative difference mean {logits_rel.mean():.4f}")


if __name__ == "__main__":
    main()
