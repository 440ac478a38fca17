"""What ``kvtier generate``, ``kvtier info`` and ``kvtier eval`` do once their flags are parsed.

:mod:`kvtier.cli` builds the parser; the functions here turn the flags into the
library's dataclasses (defaults live on their fields), check what the library
cannot (the device, the prompt's bytes, whether the caches could fit), then call it.
Every mistake is a ``ValueError`` (or a ``MemoryError`` subclass) raised before the
model loads or before any cache is allocated; :func:`kvtier.cli.main` prints it as one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import warnings

from kvtier.cli_text import argument_text, decode_text, read_stdin

# prompts longer than this get a prefill progress bar
_PROGRESS_TOKENS = 1024
#: texts of at most this many tokens get a warning from kvtier eval: their figure is noise
FEW_TOKENS = 100
#: sampling flags that greedy decoding (temperature 0) ignores
_SAMPLING_ONLY = {"top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p", "seed": "--seed"}


def _given(args: argparse.Namespace, *names: str) -> dict:
    return {n: getattr(args, n) for n in names if hasattr(args, n)}


# -- building the library's dataclasses from flags ----------------------------------------------


def cache_config_from_args(args: argparse.Namespace):
    """``KVCacheConfig.from_env()`` with the flags' changes applied (flags win)."""
    from kvtier.config import KVCacheConfig
    from kvtier.quant.modes import parse_storage_flags

    given = vars(args)
    changes = parse_storage_flags(given.get("kv_quant"), given.get("turboquant"))
    quant = changes.get("kv_quant") is not None or changes.get("turboquant") is not None
    if "tier" in given:
        if quant and given["tier"] != "paged":
            raise ValueError(
                f"--kv-quant and --turboquant store keys and values in the paged tier, but --tier "
                f"is {given['tier']!r}; drop --tier or use --tier paged"
            )
        changes["tier"] = given["tier"]
    elif quant or "num_blocks" in given or "dynamic" in given:
        changes["tier"] = "paged"
    if changes.get("tier", "paged") != "paged" and ("num_blocks" in given or "dynamic" in given):
        raise ValueError(f"--num-blocks and --dynamic size the paged tier's pool, but --tier is "
                         f"{changes['tier']!r}; drop them or use --tier paged")
    if "num_blocks" in given:
        changes["paged_num_blocks"] = given["num_blocks"]
    if "dynamic" in given:
        changes["dynamic_paged"] = True
    if "kv_dtype" in given:
        changes["kv_dtype"] = given["kv_dtype"]
    env = KVCacheConfig.from_env()
    if env.kv_dtype is not None and "kv_dtype" not in given and changes.get("tier", env.tier) != "tail":
        warnings.warn(f"KVTIER_OWNED_ATTN_KV_DTYPE={env.kv_dtype} narrows the tail tier's buffers; the "
                      f"flags chose the {changes['tier']} tier, which stores what the model computes",
                      UserWarning, stacklevel=2)
        changes["kv_dtype"] = None
    config = env.replace(**changes)
    if not config.enabled:
        warnings.warn(f"KVTIER_OWNED_ATTN_KV turns kvtier's caches off for configure_kv_cache; the command "
                      f"line always builds caches: the {config.tier} tier's (--tier chooses)",
                      UserWarning, stacklevel=2)
    return config


def generation_config_from_args(args: argparse.Namespace):
    """``GenerationConfig`` from the flags; sampling flags under greedy decoding warn once."""
    from kvtier.generate import GenerationConfig
    from kvtier.sampling import SamplingParams

    try:
        sampling = SamplingParams(**_given(args, "temperature", "top_k", "top_p", "min_p", "seed"))
    except ValueError as e:
        raise _as_flag(e) from None
    ignored = [flag for name, flag in _SAMPLING_ONLY.items() if hasattr(args, name)]
    if sampling.greedy and ignored:
        warnings.warn(f"{', '.join(ignored)} {'has' if len(ignored) == 1 else 'have'} no effect "
                      "with greedy decoding (--temperature 0, the default, or below 1e-5); set "
                      "--temperature to 1e-5 or above to sample", stacklevel=2)
    extra = _given(args, "max_tokens", "cuda_graph")
    if hasattr(args, "stop"):
        if not all(args.stop):
            raise ValueError("--stop '': a stop string cannot be empty")
        extra["stop"] = tuple(args.stop)
    try:
        return GenerationConfig(sampling=sampling, **extra)
    except ValueError as e:
        raise _as_flag(e) from None


def _as_flag(e: ValueError, fields=("temperature", "top_k", "top_p", "min_p", "seed", "max_tokens")
             ) -> ValueError:
    """A field's message in the flag's name (``max_tokens must ...`` -> ``--max-tokens must
    ...``; the library's ``or None`` is no value of a flag): the command line's user set the
    flag, not the field."""
    field, _, rest = str(e).partition(" ")
    if field in fields:
        return ValueError(f"--{field.replace('_', '-')} {rest.replace(' or None,', ',')}")
    return e


def speculative_config_from_args(args: argparse.Namespace):
    """``SpeculativeConfig`` from ``--speculative``/``--draft-tokens``/``--fixed-depth``;
    ``None`` without ``--speculative``."""
    if not hasattr(args, "speculative"):
        for name, flag in (("draft_tokens", "--draft-tokens"), ("fixed_depth", "--fixed-depth")):
            if hasattr(args, name):
                raise ValueError(f"{flag} sets the depth of speculative decoding; add "
                                 "--speculative ngram|early-exit:N|model:PATH")
        return None
    from kvtier.drafters import parse_drafter_spec
    from kvtier.speculative import SpeculativeConfig

    parse_drafter_spec(args.speculative)
    fixed = {"adaptive": False} if hasattr(args, "fixed_depth") else {}
    return SpeculativeConfig(**_given(args, "draft_tokens"), **fixed)


def _load(args: argparse.Namespace):
    import torch

    from kvtier.devices import parse_device
    from kvtier.model import load_model
    from kvtier.model.linear import PREFILL_ENV_VAR, parse_prefill_dtype, prefill_dtype_warning

    parse_prefill_dtype(os.environ.get(PREFILL_ENV_VAR), source=PREFILL_ENV_VAR)  # before the model loads
    kw = {"device": parse_device(args.device)} if hasattr(args, "device") else {}
    if hasattr(args, "dtype"):
        kw["dtype"] = getattr(torch, args.dtype)
    lm = load_model(getattr(args, "model", None), progress=sys.stderr.isatty(), **kw)
    if hasattr(args, "act_quant"):
        lm.model.act_quant = args.act_quant  # (the model's own setting: the environment's is the default)
    if hasattr(args, "prefill_dtype"):
        lm.model.prefill_dtype = args.prefill_dtype
    note = prefill_dtype_warning(lm.model)
    if note:
        warnings.warn(note, stacklevel=2)
    return lm


# -- the caches of one request ---------------------------------------------------------------------


def sized_for_request(config, args: argparse.Namespace, tokens: int):
    """The paged pool sized to hold ``tokens`` (prompt, max_tokens and drafts), rounded up
    to blocks. Precedence: ``--num-blocks``, then ``KVTIER_PAGED_NUM_BLOCKS``, then this."""
    from kvtier.config import env_settings

    env = env_settings()
    if config.tier != "paged" or hasattr(args, "num_blocks") or "paged_num_blocks" in env:
        return config
    changes = {"paged_num_blocks": max(1, math.ceil(tokens / config.paged_block_size))}
    if config.dynamic_paged and "dynamic_paged_tokens" not in env:
        changes["dynamic_paged_tokens"] = tokens
    return config.replace(**changes)


def check_pool_holds(config, tokens: int, what: str) -> None:
    """Refuse, before the prefill, a fixed paged pool (``--num-blocks``,
    ``KVTIER_PAGED_NUM_BLOCKS``) too small for ``tokens`` (``what`` they are), which would
    end the answer part way with the pool's own error."""
    if config.tier != "paged" or config.dynamic_paged:
        return
    held = config.paged_num_blocks * config.paged_block_size
    if tokens > held:
        need = math.ceil(tokens / config.paged_block_size)
        raise ValueError(f"the paged pool of {config.paged_num_blocks} blocks of {config.paged_block_size} "
                         f"tokens (--num-blocks, KVTIER_PAGED_NUM_BLOCKS) holds {held} tokens and this "
                         f"request may need {tokens} ({what}): give --num-blocks {need} or more, "
                         "--dynamic to let the pool grow, or fewer --max-tokens")


def fitted_to_context(config, context: int):
    """``config`` with a default step (tail, ragged) or block (block tier) longer than the
    model's ``context`` cut to it: a default must not refuse a small model. One the
    environment set is kept (:func:`check_caches_fit` refuses it, naming the variable)."""
    from kvtier.config import env_settings

    unit = {"tail": "step", "ragged": "step", "block": "owned_block_size"}.get(config.tier)
    if unit is None or getattr(config, unit) <= context or unit in env_settings():
        return config
    return config.replace(**{unit: context})


def check_caches_fit(config, lm, batch_size: int = 1) -> None:
    """:meth:`KVCacheConfig.check_fits` against the model's context and the device's memory."""
    import torch

    from kvtier.quant import make_codecs

    a = lm.args
    param = next(lm.model.parameters())
    per_head = 2 * a.head_dim * param.element_size()  # K and V at full precision
    if config.tier == "paged" and (config.turboquant or config.kv_quant):
        mode = {"turboquant": config.turboquant} if config.turboquant else {"kv_quant": config.kv_quant}
        try:
            k, v = make_codecs(a.head_dim, param.dtype, **mode)
            per_head = k.bytes_per_token_head() + v.bytes_per_token_head()
        except ValueError:  # a codec that cannot serve this head_dim falls back to full precision
            pass
    if param.device.type == "cuda":
        memory = torch.cuda.mem_get_info(param.device)[1]
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    config.check_fits(context_tokens=a.max_position_embeddings, memory_bytes=memory,
                      bytes_per_token=a.n_layers * a.n_kv_heads * per_head, batch_size=batch_size)


def kv_codec(caches, dtype) -> str:
    """How the caches store keys and values: ``q8``, ``turboquant q8_0/q3_0``, else the dtype
    (``fp32``, ``bf16``, ``fp16``)."""
    stats = caches[0].stats()
    mode = stats.get("mode")
    if mode == "turboquant":
        codes = (stats[k].rpartition(":")[2] for k in ("key_codec", "value_codec"))
        return "turboquant " + "/".join(codes)
    if mode not in (None, "fp"):
        return mode
    name = stats.get("kv_dtype") or str(dtype).removeprefix("torch.")  # (the tail tier's kv_dtype)
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(name, name)


def cache_summary(caches, dtype=None) -> dict:
    """Tier, codec, KV bytes and grow events over every layer, and the first layer's own stats."""
    first = caches[0].stats()
    return {
        "tier": caches[0].tier,
        "codec": None if dtype is None else kv_codec(caches, dtype),
        "layers": len(caches),
        "nbytes": sum(c.nbytes for c in caches),
        "grow_events": sum(int(c.stats().get("grow_events", 0)) for c in caches),
        "layer0": first,
    }


# -- kvtier generate -------------------------------------------------------------------------------


def run_generate(args: argparse.Namespace, lm=None) -> int:
    """``kvtier generate``; ``lm``: a model already loaded (one rank's shard), else the flags'."""
    from kvtier.generate import stream_generate
    from kvtier.model.act_quant import ENV_VAR, act_quant_of, parse_act_quant
    from kvtier.model.linear import prefill_dtype_in_effect, prefill_narrows

    if hasattr(args, "prompt_option"):
        if hasattr(args, "prompt"):
            raise ValueError("two prompts: give the prompt as the argument or with --prompt, not both")
        args.prompt = vars(args).pop("prompt_option")  # (a rank of --tensor-parallel comes back here)
    gen_config = generation_config_from_args(args)  # bad flag values fail before the model loads
    parse_act_quant(os.environ.get(ENV_VAR), source=ENV_VAR)
    cache_config = cache_config_from_args(args)
    spec = speculative_config_from_args(args)
    if hasattr(args, "device"):
        from kvtier.devices import parse_device

        parse_device(args.device)
    if lm is None and hasattr(args, "tensor_parallel"):
        _check_graph_flag(gen_config, cache_config, args)  # in one line, before any rank loads
        return _run_tensor_parallel(args)
    if hasattr(args, "prompt"):
        prompt = argument_text(args.prompt, "the prompt")
        if not prompt.strip():  # the rule stdin follows: no model loads for nothing to say
            raise ValueError("the prompt is empty; give text to continue (--raw) or a question")
    else:
        prompt = read_stdin()
    lm = _load(args) if lm is None else lm
    tok = lm.require_tokenizer("kvtier generate")
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}])
        ids = tok.encode(text, add_bos=False)
    else:
        ids = tok.encode(prompt)
    if not ids:
        raise ValueError(f"the tokenizer of {lm.source} encodes the prompt to no tokens; it may not be "
                         "this model's tokenizer: use the tokenizer.json the weights came with")
    drafts = 0 if spec is None else spec.draft_tokens + 1
    held = min(len(ids) + gen_config.max_tokens, lm.args.max_position_embeddings)  # never past the context
    cache_config = sized_for_request(cache_config, args, held + drafts)
    check_pool_holds(cache_config, held + drafts, f"prompt {len(ids)} + --max-tokens "
                     f"{gen_config.max_tokens}" + (f" + {drafts} drafted" if drafts else ""))
    cache_config = fitted_to_context(cache_config, lm.args.max_position_embeddings)
    check_caches_fit(cache_config, lm)
    # int8 activations act in the CPU decode step, which serves the tail tier only
    on_cpu = next(lm.model.parameters()).device.type == "cpu"
    asked = act_quant_of(lm.model) == "q8"
    int8 = asked and on_cpu and cache_config.tier == "tail"
    if asked and not int8:
        where = "on CUDA" if not on_cpu else f"with --tier {cache_config.tier}"
        warnings.warn(f"--act-quant q8 (KVTIER_ACT_QUANT) has no effect {where}: int8 activations act "
                      "in the CPU decode step over the tail tier; the products stay exact", stacklevel=2)
    caches, pc = None, None
    if hasattr(args, "prompt_cache"):
        from kvtier.prompt_cache import PromptCache

        pc = PromptCache(args.prompt_cache, model_source=str(lm.source))
        caches, _ = pc.restore(lm.model, ids, cache_config)  # (in this request's paged pool)
    else:
        caches = lm.model.make_caches(cache_config, batch_size=1)
    stream = stream_generate
    if spec is not None:
        from kvtier.drafters import make_drafter
        from kvtier.speculative import stream_speculative

        drafter = make_drafter(args.speculative, lm)
        if hasattr(args, "seed") and spec.adaptive and spec.draft_cost is None:
            # measured timings would move the depths, and with them the draws: the drafter's
            # estimated cost keeps a seeded run's samples the same from run to run
            spec = dataclasses.replace(spec, draft_cost=min(drafter.cost(lm.model), 9.99))
        stream = functools.partial(stream_speculative, drafter=drafter, speculative=spec)
    tokens, text, last, interrupted = [], [], None, False
    prefill = len(ids) - (pc.reused if pc else 0)
    try:
        with Progress("prefill", prefill, enabled=prefill > _PROGRESS_TOKENS) as progress:
            for r in stream(lm.model, tok, ids, gen_config, caches=caches,
                            cache_config=cache_config, prompt_cache=pc, on_progress=progress):
                progress.close()
                tokens.append(r.token)
                text.append(r.text)
                if not args.json and r.text:
                    sys.stdout.write(r.text)
                    sys.stdout.flush()
                last = r
    except KeyboardInterrupt:  # Ctrl-C: what was generated is kept, and said to be cut
        interrupted = True
    except BaseException:  # a failure mid-stream (a lost rank, memory): its error on a line of its own
        if not args.json and any(text):
            print(flush=True)
        raise
    if last is None:  # (only an interruption ends the stream before its first token)
        if args.json:
            print(json.dumps({"prompt_tokens": ids, "tokens": [], "text": "", "finish_reason": "interrupted"}))
        print("[kvtier] interrupted before the first token", file=sys.stderr)
        return 130
    stats = last.stats
    finish = "interrupted" if interrupted else last.finish_reason
    cache = cache_summary(caches, next(lm.model.parameters()).dtype)
    narrow_prefill = prefill_narrows(lm.model)
    ranks = getattr(args, "tensor_parallel", 1)  # a rank of --tensor-parallel holds its heads' share
    if ranks > 1:
        cache["ranks"] = ranks  # (nbytes: this rank's)
    if args.json:
        out = {
            "prompt_tokens": ids, "tokens": tokens, "text": "".join(text),
            "finish_reason": finish, "timings": stats.as_dict(), "cache": cache,
            "model": str(lm.source), "act_quant": "q8" if int8 else "none",
            "prefill_dtype": str(prefill_dtype_in_effect(lm.model)).removeprefix("torch."),
        }
        if spec is not None:
            out["speculative"] = last.speculative.as_dict()
        print(json.dumps(out, default=str))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()  # the text ends before the summary on a shared terminal
    print(
        f"[kvtier] prompt {stats.prompt_tokens} tokens ({stats.prompt_cache_tokens_reused} reused), "
        f"generated {stats.generation_tokens} | prefill {stats.prefill_tokens_per_s:.1f} tok/s, "
        f"decode {stats.decode_tokens_per_s:.1f} tok/s | tier {cache['tier']} {cache['codec']}, "
        f"KV {cache['nbytes'] / 2**20:.2f} MiB{f' on each of {ranks} ranks' if ranks > 1 else ''}, "
        f"grow events {cache['grow_events']}"
        + (" | int8 activations (q8)" if int8 else "")
        + (" | bfloat16 prefill" if narrow_prefill else "")
        + (" | interrupted" if interrupted else "")
        + (f" | stopped at the model's context ({lm.args.max_position_embeddings} tokens)"
           if finish == "length" and stats.generation_tokens < gen_config.max_tokens else ""),
        file=sys.stderr,
    )
    if spec is not None:
        s = last.speculative
        print(
            f"[kvtier] speculative {args.speculative}: drafted {s.drafted}, accepted {s.accepted} "
            f"({100 * s.acceptance_rate:.1f}%), {s.tokens_per_step:.2f} tokens/step, "
            f"{1000 * s.time_per_step_s:.1f} ms/step over {s.steps} steps",
            file=sys.stderr,
        )
        if s.depth_reason:  # the adaptive depth ended at plain decoding
            print(f"[kvtier] speculative depth 0: {s.depth_reason}", file=sys.stderr)
    return 130 if interrupted else 0


def _check_graph_flag(gen_config, cache_config, args: argparse.Namespace) -> None:
    """``--cuda-graph`` refused as one process refuses it (on the CPU; over the tail or block
    tier), before ``--tensor-parallel`` spawns ranks that would each refuse it once loaded."""
    import torch

    from kvtier.cuda_graph import check_graph_tier, device_unavailable

    if gen_config.cuda_graph is not True:
        return
    check_graph_tier(cache_config.tier)
    why = device_unavailable(getattr(args, "device", "cuda" if torch.cuda.is_available() else "cpu"))
    if why is not None:
        raise ValueError(f"CUDA-graph decode cannot serve: {why}")


def _run_tensor_parallel(args: argparse.Namespace) -> int:
    """Every rank runs :func:`run_generate` on its shard of the model; rank 0 alone prints."""
    import torch
    import torch.distributed as dist

    from kvtier.parallel import run_sharded

    if hasattr(args, "prompt_cache"):
        raise ValueError("--prompt-cache keeps one device's keys and values; it does not combine "
                         "with --tensor-parallel (drop one of them)")
    if not hasattr(args, "prompt"):  # spawned workers have no stdin, torchrun's share one
        if dist.is_torchelastic_launched():
            raise ValueError("under torchrun, give the prompt as an argument, not on stdin")
        args.prompt = read_stdin()
    device = getattr(args, "device", "cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if hasattr(args, "dtype") else None
    return run_sharded(_generate_on_rank, args.tensor_parallel, args=(args,), device_type=device,
                       model=getattr(args, "model", None), dtype=dtype)


def _generate_on_rank(lm, args: argparse.Namespace) -> int:
    if hasattr(args, "prefill_dtype"):
        lm.model.prefill_dtype = args.prefill_dtype  # (the shard's own, as _load sets it)
    return run_generate(args, lm=lm)


class Progress:
    """A rich progress bar on stderr, shown only when ``enabled`` and stderr is a terminal;
    called as ``progress(done, total)``; a no-op otherwise."""

    def __init__(self, description: str, total: int, *, enabled: bool = True):
        self.bar = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import Progress as Bar

            self.bar = Bar(transient=True, console=Console(stderr=True))
            self.task = self.bar.add_task(description, total=total)

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def __call__(self, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def __exit__(self, *exc) -> None:
        self.close()


# -- kvtier info ------------------------------------------------------------------------------------


def run_info(args: argparse.Namespace) -> int:
    import torch

    from kvtier.kernels.precision import bf16_matmuls_fast
    from kvtier.model.act_quant import act_quant_of
    from kvtier.model.linear import prefill_dtype_in_effect
    from kvtier.model.packed import load_kernels as packed_kernels

    cache_config = cache_config_from_args(args)
    lm = _load(args)
    param = next(lm.model.parameters())
    kernels = packed_kernels() if param.device.type == "cpu" else None
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    out = {
        "model": str(lm.source),
        "model_args": lm.args.to_dict(),
        "parameters": lm.model.args.n_params,  # (the weights as the model counts them: packed or not)
        "device": str(param.device),
        "dtype": str(param.dtype).removeprefix("torch."),
        "load_seconds": round(lm.load_seconds, 3),
        "from_cache": lm.from_cache,
        "tier": cache_config.tier,
        "cache_config": dataclasses.asdict(cache_config),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "threads": torch.get_num_threads(),
        "act_quant": act_quant_of(lm.model),
        "prefill_dtype": str(prefill_dtype_in_effect(lm.model)).removeprefix("torch."),
        # whether this CPU multiplies bfloat16 in hardware (AMX, AVX512-BF16): --prefill-dtype pays off
        "cpu_bfloat16": bf16_matmuls_fast(),
        # what load_model packed (and placed on huge pages), and which loops the packed products take
        "packing": lm.packing,
        "cpu_products": None if kernels is None else {"lanes": kernels.lanes, "digits": list(kernels.digits)},
    }
    if args.json:
        print(json.dumps(out, default=str))
        return 0
    width = max(map(len, out))
    for k, v in out.items():
        print(f"{k:<{width}}  {v}")
    return 0


# -- kvtier eval -------------------------------------------------------------------------------------


def run_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvtier.evaluate import EvalConfig, default_text, encode_text, evaluate_modes, parse_modes
    from kvtier.model.linear import prefill_dtype_in_effect

    fields = _given(args, "context", "stride", "max_tokens", "chunk", "tier")
    if hasattr(args, "modes"):
        fields["modes"] = parse_modes(args.modes)
        if not fields["modes"]:
            raise ValueError(f"--modes {args.modes!r} names no mode; give a comma-separated list such as "
                             "fp,q8,q4_g32,fp8,turboquant:q5_0r,q4_0 (or leave --modes out for the default set)")
    try:
        config = EvalConfig(**fields)
    except ValueError as e:
        raise _as_flag(e, ("context", "stride", "max_tokens", "chunk")) from None
    base = cache_config_from_args(args)
    if hasattr(args, "file"):
        path = Path(args.file)
        if not path.exists():
            raise FileNotFoundError(f"--file {path}: no such file")
        if path.is_dir():
            raise ValueError(f"--file {path} is a folder; give a text file")
        if path.is_char_device() or path.is_block_device():  # /dev/zero would be read forever
            raise ValueError(f"--file {path} is a device, not a text file; give a text file (or a pipe: "
                             "--file <(command))")
        text = decode_text(path.read_bytes(), f"--file {path}")
        if not text.strip():
            raise ValueError(f"--file {path} holds no text (only whitespace); give a text to score")
    else:
        text = default_text()
    lm = _load(args)
    prefill = str(prefill_dtype_in_effect(lm.model)).removeprefix("torch.")
    tokens = encode_text(lm.require_tokenizer("kvtier eval"), text, config.max_tokens)
    if len(tokens) < 2:
        raise ValueError(f"the text holds {len(tokens)} token{'s' * (len(tokens) != 1)}; a perplexity needs at "
                         "least 2 (one scored): give a longer text (--file)")
    if len(tokens) <= FEW_TOKENS:
        warnings.warn(f"{len(tokens) - 1} tokens are scored; a perplexity over so few is noise, not a measure: "
                      "give a longer text (--file) for figures to compare", stacklevel=2)
    with Progress(f"{args.metric}: {len(config.modes)} modes", len(tokens) - 1,
                  enabled=not args.json) as progress:
        results = evaluate_modes(lm.model, tokens, config, base=base, on_progress=progress)
    if args.json:
        keys = ("mode", "ppl", "delta_pct", "bits_per_element", "kl", "top1")  # (both metrics: the table's columns)
        print(json.dumps({"modes": [{k: r.as_dict()[k] for k in keys} for r in results],
                          "tokens": results[0].tokens, "context": config.context, "prefill_dtype": prefill}))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.metric}: {results[0].tokens} tokens, context {config.context}"
                        + ("" if prefill == "float32" else f", chunks multiplied in {prefill}"))
    for col in ("mode", "ppl", "Δ vs fp", "bits/elem", "KL (nats)", "top-1"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for r in results:
        table.add_row(r.mode, f"{r.ppl:.4f}", f"{r.delta_pct:+.2f}%", f"{r.bits_per_element:.2f}",
                      f"{r.kl:.5f}", f"{100 * r.top1:.2f}%")
    Console().print(table)
    return 0
