"""Speculative decoding against plain decoding on the default model.

Greedy decoding of up to ``--max-tokens`` (default 256) new tokens per prompt, with
the chat template, stopping at the end-of-turn token:

- single rows on the tail tier: plain decoding against each drafter (``--drafters``,
  default ``ngram,early-exit:24``) on an input-grounded task (repeat a paragraph with
  its spelling corrected: the answer copies the prompt) and on open chat;
- batches of ``--batch`` rows (default 4) on the ragged tier, plain batched decoding
  against batched n-gram speculation: four grounded prompts (``batch-grounded``), and
  on request a mix of two grounded and two chat prompts (``batch-mixed``; a static
  batch runs until its slowest row is done).

Figures per run: tokens generated, verification forwards, tokens per verification
(per row), acceptance rate, decode time after prefill (wall clock, and the process's
CPU time), tokens per second, and the speedup over plain decoding of the same
prompts in the same run (wall clock; and CPU time, which a busy shared machine
disturbs less). Runs are interleaved over ``--repeats`` rounds (default 2, the order
reversed every other round) and each contender's fastest round counts. Every speculative run is checked to give plain
decoding's tokens.

Example::

    kvtier bench speculative
    kvtier bench speculative --tasks batch-mixed
    python benchmarks/speculative.py --max-tokens 128 --drafters ngram --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch

from kvtier.config import KVCacheConfig
from kvtier.devices import set_threads
from kvtier.generate import generate_step
from kvtier.speculative import SpeculativeConfig, SpeculativeStats, speculative_generate_step
from kvtier_bench._progress import BenchProgress

GROUNDED = (
    "Repeat this paragraph with the spelling corrected, and change nothing else:\n\n"
    "The old lighthouse stood on the edge of the cliff for more then two hundred years. "
    "Every night its keeper climbed the narow stairs, lit the great lamp and watched the "
    "ships pass safely through the dangerous waters below. When the storms came, the waves "
    "crashed agianst the rocks and the wind howled around the tower, but the light never "
    "went out. The people of the village beleived that as long as the lighthouse shone, "
    "no harm could come to their fishermen. Years later, when a modern beacon replaced it, "
    "the villagers gathered one last time to thank the keeper for his faithfull service."
)
GROUNDED_CODE = (
    "Rewrite this Python code, renaming the variable x to count, and change nothing else:\n\n"
    "def tally(items):\n"
    "    x = 0\n"
    "    for item in items:\n"
    "        if item.is_valid():\n"
    "            x += item.weight\n"
    "        else:\n"
    "            x -= 1\n"
    "    print('total:', x)\n"
    "    return x\n"
)
GROUNDED_RECIPE = (
    "Fix the typos in this recipe and change nothing else:\n\n"
    "Pancakes. Mix two cups of flour, two teaspoons of baking powder and a pinch of salt in a "
    "large bowl. In another bowl, wisk two eggs with one and a half cups of milk and three "
    "tablespoons of melted butter. Pour the wet ingredents into the dry ones and stir until just "
    "combined; a few lumps are fine. Heat a lightly oiled pan over medium heat, pour a quarter "
    "cup of batter for each pancake and cook until bubbles form, then flip and cook until golden "
    "brown on both sides. Serve warm with maple syrup and fresh berrys."
)
GROUNDED_EMAIL = (
    "Correct the spelling in this email and change nothing else:\n\n"
    "Dear Ms. Patel,\n\nThank you for your letter of last week. I am pleased to confirm that "
    "the meeting will take place on Thursday at ten o'clock in the main conferance room. Please "
    "bring the quarterly reports and the updated budjet, and let me know if any of your "
    "colleagues will be joining us. I look forward to seeing you there.\n\nKind regards,\n"
    "Daniel Moore\nOperations Manager"
)
CHAT = "Write a short story about a robot who learns to paint."
CHAT_2 = "What are some good habits for staying healthy? Explain each one."
SINGLE = {"grounded": GROUNDED, "chat": CHAT}
BATCHES = {
    "batch-grounded": (GROUNDED, GROUNDED_CODE, GROUNDED_RECIPE, GROUNDED_EMAIL),
    "batch-mixed": (GROUNDED, CHAT, GROUNDED_CODE, CHAT_2),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256, help="new tokens per prompt at most")
    parser.add_argument("--drafters", default="ngram,early-exit:24",
                        help="comma-separated drafters: ngram, early-exit:N, model:PATH")
    parser.add_argument("--draft-tokens", type=int, default=SpeculativeConfig.draft_tokens,
                        help="most drafts per verification")
    parser.add_argument("--tasks", default="grounded,chat,batch-grounded",
                        help=f"comma-separated, from: {', '.join([*SINGLE, *BATCHES])}")
    parser.add_argument("--batch", type=int, default=4, help="rows of the batched runs")
    parser.add_argument("--repeats", type=int, default=2,
                        help="rounds of every run, interleaved; the fastest round counts")
    parser.add_argument("--fixed", action="store_true",
                        help="always draft --draft-tokens (no adaptive depth)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1 suits a small model on a shared machine)")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the figures here")
    parser.add_argument("--plot", default=None, metavar="PNG", help="bar chart of the speedups")


@dataclass
class Result:
    label: str
    tokens: list[list[int]]
    decode_s: float
    cpu_s: float
    stats: SpeculativeStats | None = None
    same: bool = True  # every round gave the same tokens

    @property
    def generated(self) -> int:
        return sum(map(len, self.tokens))

    def row(self, plain: Result) -> dict:
        s = self.stats
        steps = s.steps if s else max(map(len, self.tokens))
        return {
            "run": self.label,
            "tokens": self.generated,
            "steps": steps,
            "tokens_per_step": s.tokens_per_step if s else 1.0,
            "drafted": s.drafted if s else 0,
            "acceptance": s.acceptance_rate if s and s.drafted else None,
            "draft_cost": s.draft_cost if s else None,  # a draft in one-token forwards, as measured
            "depth_reason": s.depth_reason if s else "",  # why the depth ended at plain decoding
            "decode_s": self.decode_s,
            "cpu_s": self.cpu_s,
            "tokens_per_s": self.generated / self.decode_s,
            "speedup": plain.decode_s / self.decode_s,
            "cpu_speedup": plain.cpu_s / self.cpu_s,
            "same_tokens": self.tokens == plain.tokens and self.same,
        }


def _cut(row: list[int], stop_ids: frozenset[int], n: int) -> list[int]:
    for i, t in enumerate(row[:n]):
        if t in stop_ids:
            return row[: i + 1]
    return row[:n]


def run_plain(model, rows, tier: str, n: int, stop_ids) -> Result:
    caches = model.make_caches(KVCacheConfig(tier=tier), batch_size=len(rows))
    marks = {}
    steps = generate_step(model, rows, caches, on_prefilled=lambda: marks.update(_now()))
    out: list[list[int]] = [[] for _ in rows]
    done = [False] * len(rows)
    for y in steps:
        for r, t in enumerate(y.tolist()):
            if not done[r]:
                out[r].append(t)
                done[r] = t in stop_ids or len(out[r]) >= n
        if all(done):
            break
    steps.close()
    wall, cpu = _since(marks)
    return Result("plain", [_cut(o, stop_ids, n) for o in out], wall, cpu)


def _now() -> dict[str, float]:
    return {"wall": time.perf_counter(), "cpu": time.process_time()}


def _since(marks: dict[str, float]) -> tuple[float, float]:
    now = _now()
    return now["wall"] - marks["wall"], now["cpu"] - marks["cpu"]


def run_speculative(model, rows, tier, n, stop_ids, drafter, spec, label) -> Result:
    caches = model.make_caches(KVCacheConfig(tier=tier), batch_size=len(rows))
    stats, marks = SpeculativeStats(), {}
    drafter.reset()
    out: list[list[int]] = [[] for _ in rows]
    for new in speculative_generate_step(
        model, rows, caches, drafter, speculative=spec, max_tokens=n, stop_token_ids=stop_ids,
        stats=stats, on_prefilled=lambda: marks.update(_now()),
    ):
        for o, t in zip(out, new):
            o.extend(t)
    return Result(label, out, *_since(marks), stats)


def _fastest(runs: list[Result]) -> Result:
    """One contender's rounds: the least wall and CPU time (noise only ever adds time)."""
    best = min(runs, key=lambda r: r.decode_s)
    best.cpu_s = min(r.cpu_s for r in runs)
    best.same = all(r.tokens == runs[0].tokens for r in runs)
    return best


def _table(title: str, rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("run", "tokens", "steps", "tok/step", "drafted", "accept", "decode s", "cpu s",
                "tok/s", "speedup", "cpu speedup", "exact"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
        table.add_row(r["run"], str(r["tokens"]), str(r["steps"]), f"{r['tokens_per_step']:.2f}",
                      str(r["drafted"]), acc,
                      f"{r['decode_s']:.1f}", f"{r['cpu_s']:.1f}", f"{r['tokens_per_s']:.1f}",
                      f"{r['speedup']:.2f}x", f"{r['cpu_speedup']:.2f}x",
                      "yes" if r["same_tokens"] else "NO")
    Console(width=150).print(table)


def _plot(report: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, wall, cpu = [], [], []
    for task, rows in report.items():
        for r in rows[1:]:
            labels.append(f"{task}\n{r['run']}")
            wall.append(r["speedup"])
            cpu.append(r["cpu_speedup"])
    fig, ax = plt.subplots(figsize=(1.6 * len(labels) + 2, 4))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], wall, width=0.4, label="wall clock")
    ax.bar([i + 0.2 for i in x], cpu, width=0.4, label="CPU time")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title("speculative decoding, SmolLM2-135M, CPU, greedy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace) -> int:
    from kvtier.drafters import make_drafter
    from kvtier.model import load_model

    if args.threads is not None:
        set_threads(args.threads)
    lm = load_model(device="cpu", dtype=torch.float32, progress=False)
    tok, model = lm.tokenizer, lm.model
    stop_ids = frozenset(tok.eos_token_ids)
    encode = lambda text: tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]),
                                     add_bos=False)
    spec = SpeculativeConfig(draft_tokens=args.draft_tokens, adaptive=not args.fixed)
    names = [d.strip() for d in args.drafters.split(",") if d.strip()]
    drafters = {name: make_drafter(name, lm) for name in names}
    report: dict[str, list[dict]] = {}
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = sorted(set(tasks) - set(SINGLE) - set(BATCHES))
    if unknown:
        raise ValueError(f"--tasks {unknown} unknown; accepted: {', '.join([*SINGLE, *BATCHES])}")
    rounds = max(args.repeats, 1)
    total = sum(rounds * (1 + (len(drafters) if task in SINGLE else 1)) for task in tasks)
    with torch.inference_mode(), BenchProgress("speculative", total) as bar:
        for task in tasks:
            if task in SINGLE:
                rows, tier, contenders = [encode(SINGLE[task])], "tail", drafters
                title = f"{task}: {len(rows[0])} prompt tokens, greedy, tail tier"
            else:
                prompts = BATCHES[task]
                rows = [encode(prompts[i % len(prompts)]) for i in range(args.batch)]
                tier, contenders = "ragged", {"ngram": make_drafter("ngram", lm)}
                title = f"{task}: {args.batch} rows, greedy, ragged tier, aggregate tokens/s"
            runs: list[list[Result]] = [[] for _ in range(len(contenders) + 1)]
            for i in range(rounds):  # interleaved, the order reversed every round
                order = range(len(runs)) if i % 2 == 0 else reversed(range(len(runs)))
                for j in order:
                    if j == 0:
                        bar.advance(f"{task}, round {i + 1}/{rounds}, plain")
                        runs[0].append(run_plain(model, rows, tier, args.max_tokens, stop_ids))
                    else:
                        name, d = list(contenders.items())[j - 1]
                        bar.advance(f"{task}, round {i + 1}/{rounds}, {name}")
                        runs[j].append(run_speculative(model, rows, tier, args.max_tokens, stop_ids,
                                                       d, spec, name))
            results = [_fastest(r) for r in runs]
            report[task] = [r.row(results[0]) for r in results]
            _table(title, report[task])
    if args.plot:
        _plot(report, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"max_tokens": args.max_tokens, "draft_tokens": args.draft_tokens,
                       "threads": torch.get_num_threads(), "results": report}, f, indent=1)
    return 0 if all(r["same_tokens"] for rs in report.values() for r in rs) else 1
