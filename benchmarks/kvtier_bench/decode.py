"""End-to-end decode throughput against HF generate, and against the memory-bandwidth roofline.

CPU (the default without a GPU): the default model (SmolLM2-135M-Instruct, float32)
generates ``--new-tokens`` (256) greedy tokens after a ``--prompt-tokens`` (512)
prompt taken from Python's ``pydoc_data.topics``. Contenders, in the same run:

- ``kvtier``: :func:`kvtier.generate.generate_step` over the ``--tier`` tier (tail),
  on the model as :func:`kvtier.model.load_model` gives it (weights exactly Q4_1 or
  Q8_0 kept as block codes, :mod:`kvtier.model.packed`);
- ``kvtier ... float32``: the same with ``load_model(pack=False)`` (every weight
  dequantised to float32, as before the packed kernels);
- ``HF DynamicCache``: ``transformers`` ``generate`` on a ``LlamaForCausalLM`` that
  ``transformers`` itself loads from the same GGUF file.

CUDA (or ``--arch`` on CPU): a model of the ``--arch`` shape (``llama3-8b``) with
random weights from :func:`kvtier.model.build_random`, in bfloat16 on CUDA; the
``transformers`` model shares those very tensors (no copy). On CUDA it runs
``generate`` with a DynamicCache and with a StaticCache (which ``generate``
compiles: ``torch.compile``, mode ``reduce-overhead``).

Every contender runs once untimed (same prompt and lengths) to warm up, then
``--repeats`` timed rounds run the contenders in turn (so a busy machine slows
them alike); each contender's median round is reported, with the slowest and fastest. Decode tokens/s is
``(N - 1)`` over the time from the first new token to the last (for
``transformers``, the first token's time comes from a streamer); the prefill
column is the time to the first new token. Also reported:

- roofline: measured memory bandwidth over the bytes one decoded token reads, and the
  percentage each contender reaches. The bandwidth is the larger of two measured each
  round, the best of several passes over a 1 GiB tensor: a copy (read + write bytes) and
  a sum (read bytes). The bytes are the weights (every parameter once; a tied embedding
  once) and the keys and values the step attends over, every layer's, at the decode's mean
  context (the prompt and half the new tokens), in the dtype the contender stores them in
  (as ``decode_gpu``'s roofline counts every row's keys and values);
- overhead: the share of a kvtier decode step spent outside the model's forward
  (sampling, cache bookkeeping, the generator, reading the token), measured each
  round in a further kvtier run whose forward is timed (synchronised on CUDA); the
  median is reported.

Example::

    kvtier bench decode
    python benchmarks/decode.py --threads 1 --plot benchmarks/decode.png
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.config import TIERS, KVCacheConfig
from kvtier.devices import set_threads
from kvtier.generate import generate_step
from kvtier_bench._progress import BenchProgress


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-tokens", type=int, default=512, help="prompt length")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens generated")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--model", default=None, help="GGUF file for the CPU run (default: SmolLM2)")
    parser.add_argument("--arch", default=None,
                        help="random weights of this shape (default on CUDA: llama3-8b; "
                             "on CPU the GGUF model unless given, e.g. smollm2-135m)")
    parser.add_argument("--tier", choices=TIERS, default="tail", help="kvtier's tier")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (on a machine shared with other jobs, 1 is steadier)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed rounds; each contender's median round is reported, with the spread")
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    parser.add_argument("--kv-dtype", choices=("float16", "bfloat16"), default=None,
                        help="also run the tail tier with keys and values stored in this dtype "
                             "(TailOwnedKVCache(kv_dtype=...)), against the model's own dtype")
    parser.add_argument("--act-quant", dest="act_quant", choices=("q8",), default=None,
                        help="also run the tail tier with int8 activations in the CPU decode step "
                             "(KVTIER_ACT_QUANT=q8), against the exact products (the first row); "
                             "with --kv-dtype, the two together as well")
    parser.add_argument("--prefill-dtype", dest="prefill_dtype", choices=("bfloat16",), default=None,
                        help="a row more: kvtier's prompt forward in bfloat16 (docs/model.md), against the "
                             "float32 one (the first row) and transformers'")
    parser.add_argument("--plot", default=None, help="write a PNG of decode tokens/s here")


@dataclass
class Result:
    name: str
    prefill_s: float  # prompt and first new token
    decode_tokens_per_s: float  # the median round's
    spread: tuple[float, float]  # the slowest and fastest round's decode tokens/s
    tokens: list[int]


def run(args: argparse.Namespace) -> int:
    if args.threads is not None:
        set_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: this machine has no CUDA device; use --device cpu")
    if args.prompt_tokens < 2 or args.new_tokens < 2:
        raise ValueError("--prompt-tokens and --new-tokens must be at least 2")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1 (timed rounds), got {args.repeats}")
    if args.act_quant is not None and (device.type != "cpu" or args.tier != "tail"):
        raise ValueError(f"--act-quant acts in the CPU decode step over the tail tier, not {device.type} "
                         f"with --tier {args.tier}; use --device cpu and --tier tail")
    if args.prefill_dtype is not None and device.type != "cpu":
        raise ValueError("--prefill-dtype narrows a float32 model's prompts; the CUDA models here are bfloat16 "
                         "already: use --device cpu")
    fp32 = None
    if device.type == "cuda" or args.arch is not None:
        model, hf, ids, label = _random_models(args, device)
    else:
        model, fp32, hf, ids, label = _gguf_models(args)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n, cfg = args.new_tokens, KVCacheConfig(tier=args.tier)
    contenders: dict[str, Callable[[], tuple[float, float, list[int]]]] = {
        f"kvtier {args.tier}": lambda: _kvtier_run(model, ids, n, cfg),
    }
    models = {f"kvtier {args.tier}": model}
    if args.kv_dtype is not None:
        if args.tier != "tail":
            raise ValueError(f"--kv-dtype stores the tail tier's keys and values; drop --tier {args.tier}")
        narrow = f"kvtier tail {args.kv_dtype} KV"
        half_cfg = KVCacheConfig(tier="tail", kv_dtype=args.kv_dtype)
        contenders[narrow] = lambda: _kvtier_run(model, ids, n, half_cfg)
        models[narrow] = model
    if args.act_quant is not None:
        int8 = "kvtier tail int8 activations"
        contenders[f"kvtier {args.tier}"] = lambda: _with(model, "act_quant", "none", ids, n, cfg)
        contenders[int8] = lambda: _with(model, "act_quant", args.act_quant, ids, n, cfg)
        models[int8] = model
        if args.kv_dtype is not None:  # both: the float16 row exact, and the two together
            contenders[narrow] = lambda: _with(model, "act_quant", "none", ids, n, half_cfg)
            both = f"kvtier tail int8 activations, {args.kv_dtype} KV"
            contenders[both] = lambda: _with(model, "act_quant", args.act_quant, ids, n, half_cfg)
            models[both] = model
    if args.prefill_dtype is not None:  # the first row's prompt in float32 whatever the environment says
        first = contenders[f"kvtier {args.tier}"]
        contenders[f"kvtier {args.tier}"] = lambda: _with(model, "prefill_dtype", "float32", first)
        bf16 = f"kvtier {args.tier}, {args.prefill_dtype} prefill"
        contenders[bf16] = lambda: _with(model, "prefill_dtype", args.prefill_dtype, first)
        models[bf16] = model
    if fp32 is not None:
        contenders[f"kvtier {args.tier} float32"] = lambda: _kvtier_run(fp32, ids, n, cfg)
        models[f"kvtier {args.tier} float32"] = fp32
    if hf is not None:
        contenders["HF DynamicCache"] = lambda: _hf_run(hf, ids, n, sync)
        if device.type == "cuda":
            contenders["HF StaticCache compiled"] = lambda: _hf_run(
                hf, ids, n, sync, cache_implementation="static")
    total = len(contenders) * (1 + args.repeats) + args.repeats
    with torch.inference_mode(), BenchProgress("decode", total) as bar:
        for name, fn in contenders.items():
            bar.advance(f"warm-up, {name}")
            fn()  # warm-up with the same shapes (and compilation, for the static cache)
        # rounds interleave the contenders, so a busy machine slows them alike; keep each one's best
        runs: dict[str, list] = {name: [] for name in contenders}
        copy_bw, read_bw, overheads = 0.0, 0.0, []
        for i in range(args.repeats):
            copy_bw = max(copy_bw, measure_bandwidth(device, sync))
            read_bw = max(read_bw, measure_read_bandwidth(device, sync))
            for name, fn in contenders.items():
                bar.advance(f"round {i + 1}/{args.repeats}, {name}")
                runs[name].append(fn())
            bar.advance(f"round {i + 1}/{args.repeats}, kvtier overhead")
            overheads.append(kvtier_overhead(model, ids, n, cfg, sync))
    results = []
    for name, rs in runs.items():
        rates = sorted((n - 1) / r[1] for r in rs)
        results.append(Result(name, min(r[0] for r in rs), rates[len(rates) // 2],
                              (rates[0], rates[-1]), rs[0][2]))
    overhead = sorted(overheads)[len(overheads) // 2]
    # each kvtier model's own weight bytes per token; HF reads what the float32 model reads.
    # Keys and values: the model's dtype, or the narrow dtype the contender stores them in
    context = args.prompt_tokens + args.new_tokens / 2
    per_token = {name: bytes_per_token(m) for name, m in models.items()}
    hf_bytes = bytes_per_token(fp32 if fp32 is not None else model)
    wide = torch.empty((), dtype=model.tok_embeddings.weight.dtype).element_size()
    kv = {r.name: kv_bytes_per_token(model, context, 2 if " KV" in r.name else wide) for r in results}
    bandwidth = max(copy_bw, read_bw)
    roofs = {r.name: bandwidth / (per_token.get(r.name, hf_bytes) + kv[r.name]) for r in results}
    _print_table(results, roofs, overhead, (copy_bw, read_bw), per_token, kv, context, label, args, device)
    if args.kv_dtype is not None:
        base, half = results[0], next(r for r in results if r.name.endswith(" KV"))
        print(f"{half.name} / {base.name}: {half.decode_tokens_per_s / base.decode_tokens_per_s:.2f}x "
              f"decode tokens/s at a {args.prompt_tokens}-token prompt")
    if args.act_quant is not None:
        base = results[0]
        for int8 in (r for r in results if "int8 activations" in r.name):
            same = next((i for i, (a, b) in enumerate(zip(int8.tokens, base.tokens)) if a != b), len(base.tokens))
            print(f"{int8.name} / {base.name}: {int8.decode_tokens_per_s / base.decode_tokens_per_s:.2f}x "
                  f"decode tokens/s; the first {same}/{len(base.tokens)} greedy tokens equal")
    if args.prefill_dtype is not None:
        base, bf16 = results[0], next(r for r in results if r.name.endswith(" prefill"))
        same = next((i for i, (a, b) in enumerate(zip(bf16.tokens, base.tokens)) if a != b), len(base.tokens))
        print(f"{bf16.name} / {base.name}: prompt and first token {bf16.prefill_s:.3f} against "
              f"{base.prefill_s:.3f} s ({base.prefill_s / bf16.prefill_s:.2f}x); the first {same}/{len(base.tokens)} "
              "greedy tokens equal")
    if args.plot:
        _plot(results, roofs[results[0].name], args.plot, label)
    return 0


def _with(model, name: str, value: str, *run):
    """A run with ``model.<name>`` (``act_quant``, ``prefill_dtype``) set to ``value``: ``run`` is
    :func:`_kvtier_run`'s ``(ids, n, cfg)``, or a contender to call."""
    before = model.__dict__.get(name)
    setattr(model, name, value)
    try:
        return run[0]() if len(run) == 1 else _kvtier_run(model, *run)
    finally:
        setattr(model, name, before)


# -- the models -------------------------------------------------------------------------------------


def _gguf_models(args):
    from kvtier.evaluate import default_text, encode_text
    from kvtier.model import load_model

    lm = load_model(args.model, device="cpu", dtype=torch.float32, progress=False)
    fp32 = load_model(args.model, device="cpu", dtype=torch.float32, progress=False, pack=False)
    ids = encode_text(lm.tokenizer, default_text(), args.prompt_tokens)
    hf = None
    if args.hf:
        from transformers import AutoModelForCausalLM

        path = lm.source
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=torch.float32).eval()
    return lm.model, fp32.model, hf, ids, f"{lm.source.name}, float32 activations, CPU"


def _random_models(args, device):
    from kvtier.model import build_random

    arch = args.arch or "llama3-8b"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_random(arch, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.args.vocab_size, (args.prompt_tokens,), generator=g).tolist()
    hf = hf_llama_sharing(model) if args.hf else None
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return model, hf, ids, f"{arch} (random weights), {str(dtype)[6:]}, {where}"


def hf_llama_config(a, **extra):
    """The ``transformers`` ``LlamaConfig`` of our model arguments ``a``; ``extra`` adds fields."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=a.vocab_size, hidden_size=a.dim, intermediate_size=a.hidden_dim,
        num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads,
        num_key_value_heads=a.n_kv_heads, head_dim=a.head_dim, rms_norm_eps=a.norm_eps,
        rope_theta=a.rope_theta, rope_scaling=a.rope_scaling,
        max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=a.tie_embeddings,
        attention_bias=a.qkv_bias, **extra,
    )


def hf_llama_weights(model) -> dict[str, torch.Tensor]:
    """``model``'s weights under ``LlamaForCausalLM``'s names, as views (no copy).

    Our fused ``wqkv`` and ``w13`` rows are the concatenated q/k/v and gate/up
    projections, in the rotate-half RoPE layout ``transformers`` uses.
    """
    a = model.args
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    sd = {"model.embed_tokens.weight": model.tok_embeddings.weight,
          "model.norm.weight": model.norm.weight, "lm_head.weight": model.output.weight}
    for i, layer in enumerate(model.layers):
        p, att, ff = f"model.layers.{i}.", layer.attention, layer.feed_forward
        wq, wk, wv = att.wqkv.weight.split([q, kv, kv])  # rows: (H_q*D | H_kv*D | H_kv*D)
        gate, up = ff.w13.weight.split(a.hidden_dim)
        sd |= {p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk,
               p + "self_attn.v_proj.weight": wv, p + "self_attn.o_proj.weight": att.wo.weight,
               p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
               p + "mlp.down_proj.weight": ff.w2.weight,
               p + "input_layernorm.weight": layer.attention_norm.weight,
               p + "post_attention_layernorm.weight": layer.ffn_norm.weight}
        if a.qkv_bias:
            bq, bk, bv = att.wqkv.bias.split([q, kv, kv])
            sd |= {p + "self_attn.q_proj.bias": bq, p + "self_attn.k_proj.bias": bk,
                   p + "self_attn.v_proj.bias": bv}
    return sd


def hf_llama_sharing(model):
    """A ``transformers`` ``LlamaForCausalLM`` whose weights are views of ``model``'s (no copy)."""
    from transformers import LlamaForCausalLM

    config = hf_llama_config(model.args)
    with torch.device("meta"):
        hf = LlamaForCausalLM(config)
    hf.load_state_dict(hf_llama_weights(model), strict=True, assign=True)
    with torch.device(model.output.weight.device):  # the RoPE buffers, left on meta above
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=config)
    return hf.eval()


# -- measurements ------------------------------------------------------------------------------------


def best_seconds(fn: Callable[[], object], sync: Callable[[], None], passes: int = 6) -> float:
    """The fastest of ``passes`` timed calls of ``fn``, synchronised around each."""
    best = float("inf")
    for _ in range(passes):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(device: torch.device, sync: Callable[[], None], nbytes: int = 1 << 30) -> float:
    """Bytes per second of a large tensor copy (read + write), the best of several."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / best_seconds(lambda: dst.copy_(src), sync)


def measure_read_bandwidth(device: torch.device, sync: Callable[[], None], nbytes: int = 1 << 30) -> float:
    """Bytes per second of a large tensor's sum (read only), the best of several."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return nbytes / best_seconds(src.sum, sync)


def kv_bytes_per_token(model, context: float, itemsize: int) -> float:
    """Key and value bytes one decoded token's attention reads at ``context`` positions:
    every layer's keys and values, ``itemsize`` bytes an element."""
    a = model.args
    return a.n_layers * 2 * a.n_kv_heads * a.head_dim * itemsize * context


def unique_param_bytes(model) -> int:
    """Bytes of every parameter once (a tied embedding and LM head count once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def bytes_per_token(model) -> int:
    """Weight bytes one decoded token reads: every parameter once, except an embedding
    table that is not also the LM head (a lookup reads one row of it)."""
    emb = model.tok_embeddings.weight
    tied = model.output.weight.data_ptr() == emb.data_ptr()  # a packed head is its own
    row = emb.shape[1] * emb.element_size()
    return unique_param_bytes(model) - (0 if tied else emb.numel() * emb.element_size() - row)


def _kvtier_run(model, ids, n, cfg) -> tuple[float, float, list[int]]:
    """Seconds to the first token, seconds of the ``n - 1`` after it, and the tokens."""
    caches = model.make_caches(cfg, batch_size=1)
    t0 = time.perf_counter()
    steps = generate_step(model, [ids], caches)
    tokens = next(steps).tolist()  # reading the token waits for the device
    t1 = time.perf_counter()
    for _ in range(n - 1):
        tokens += next(steps).tolist()
    t2 = time.perf_counter()
    steps.close()
    return t1 - t0, t2 - t1, tokens


class _TimedModel:
    """Calls the model and adds up the seconds spent inside it (synchronised)."""

    def __init__(self, model, sync):
        self.model, self.sync, self.seconds = model, sync, 0.0
        self.args = model.args

    def parameters(self):
        return self.model.parameters()

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        out = self.model(*a, **kw)
        self.sync()
        self.seconds += time.perf_counter() - t0
        return out


def kvtier_overhead(model, ids, n, cfg, sync) -> float:
    """Share of a decode step spent outside the model's forward."""
    timed = _TimedModel(model, sync)
    caches = model.make_caches(cfg, batch_size=1)
    steps = generate_step(timed, [ids], caches)
    next(steps).tolist()
    timed.seconds = 0.0
    t0 = time.perf_counter()
    for _ in range(n - 1):
        next(steps).tolist()
    total = time.perf_counter() - t0
    steps.close()
    return 1.0 - timed.seconds / total


class _FirstTokenClock:
    """A ``transformers`` streamer that notes when the first new token arrives."""

    def __init__(self, sync):
        self.sync, self.calls, self.first = sync, 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            self.sync()
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def _hf_run(hf, ids, n, sync, **gen_kwargs) -> tuple[float, float, list[int]]:
    """One ``transformers`` ``generate`` of ``n`` tokens: seconds to the first token (from a
    streamer, so a static cache keeps one length), seconds after it, and the tokens."""
    from transformers import DynamicCache

    x = torch.tensor([ids], device=hf.device)
    if "cache_implementation" not in gen_kwargs:
        # the keyword every transformers 5 release takes (later ones prefer "cache")
        gen_kwargs["past_key_values"] = DynamicCache()
    clock = _FirstTokenClock(sync)
    sync()
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated")
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0, streamer=clock, **gen_kwargs)
    sync()
    t2 = time.perf_counter()
    return clock.first - t0, t2 - clock.first, out[0, x.shape[1]:].tolist()


# -- output ---------------------------------------------------------------------------------------------


def _print_table(results, roofs, overhead, bandwidths, per_token, kv, context, label, args, device) -> None:
    from rich.console import Console
    from rich.table import Table

    hf = next((r for r in results if r.name == "HF DynamicCache"), None)
    ref = results[0].tokens
    table = Table(title=f"decode: {label}; {args.prompt_tokens}-token prompt, "
                        f"{args.new_tokens} new tokens, {torch.get_num_threads()} CPU threads")
    for col in ("contender", "prefill + 1st (s)", "decode tok/s", "min-max", "ms/token",
                "vs HF Dynamic",
                "% roofline", "same tokens"):
        table.add_column(col, justify="left" if col == "contender" else "right")
    for r in results:
        same = next((i for i, (a, b) in enumerate(zip(r.tokens, ref)) if a != b), len(ref))
        table.add_row(
            r.name, f"{r.prefill_s:.3f}", f"{r.decode_tokens_per_s:.1f}",
            f"{r.spread[0]:.1f}-{r.spread[1]:.1f}",
            f"{1e3 / r.decode_tokens_per_s:.2f}",
            f"{r.decode_tokens_per_s / hf.decode_tokens_per_s:.2f}x" if hf else "-",
            f"{100 * r.decode_tokens_per_s / roofs[r.name]:.0f}% of {roofs[r.name]:.0f}",
            f"{same}/{len(ref)}",
        )
    console = Console(width=120)
    console.print(table)
    kv_mb = sorted({round(v / 1e6, 1) for v in kv.values()})
    console.print(
        f"memory bandwidth {bandwidths[0] / 1e9:.1f} GB/s (copy), {bandwidths[1] / 1e9:.1f} GB/s (sum); "
        f"the roofline takes the larger | weights read per token: "
        + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in per_token.items())
        + f" | keys and values read per token at the mean context ({context:.0f}): "
        + " or ".join(f"{v:g} MB" for v in kv_mb)
        + f" | kvtier step outside the forward: "
        f"{100 * overhead:.1f}% | device {device}"
    )


def _plot(results, roof, path, label) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r.name for r in results]
    ax.barh(names, [r.decode_tokens_per_s for r in results], color="tab:blue")
    ax.axvline(roof, color="tab:red", linestyle="--", label=f"roofline {roof:.0f} tok/s")
    ax.set_xlabel("decode tokens/s")
    ax.set_title(label, fontsize=9)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
