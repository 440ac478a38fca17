"""``kvtier serve``: the flags, and starting the server. Imports nothing heavy until it runs.

Flags left out keep the defaults of :class:`~kvtier.serve.engine.EngineConfig` and
:class:`~kvtier.serve.api.ServerConfig`.
"""

from __future__ import annotations

import argparse
import sys

_ABSENT = argparse.SUPPRESS  # a flag not given leaves no attribute: the dataclass default holds
_ENGINE_FLAGS = ("num_blocks", "kv_memory_gib", "block_size", "max_num_seqs", "max_batched_tokens",
                 "max_waiting", "max_model_len", "enable_prefix_caching", "kv_quant", "cuda_graph")


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``serve`` on the ``kvtier`` subparsers ``sub``."""
    from kvtier.quant.modes import KV_QUANT_MODES

    p = sub.add_parser("serve", help="an OpenAI-compatible server with continuous batching",
                       description="An OpenAI-compatible server (/v1/completions, /v1/chat/completions, "
                                   "/v1/models, /health, /metrics) over the paged tier.")
    p.add_argument("--model", metavar="PATH", default=_ABSENT,
                   help="GGUF file or Hugging Face folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=_ABSENT)
    p.add_argument("--device", default=_ABSENT, help="cpu, cuda, cuda:1, ... (default: cuda if present)")
    p.add_argument("--host", default=_ABSENT, help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=_ABSENT, help="port (default 8000)")
    p.add_argument("--served-model-name", dest="served_model_name", default=_ABSENT,
                   help="the model name the API reports and accepts (default: the model file's name)")
    p.add_argument("--kv-quant", dest="kv_quant", choices=("off",) + KV_QUANT_MODES, default=_ABSENT,
                   help="quantised pages")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--num-blocks", dest="num_blocks", type=int, default=_ABSENT,
                      help="blocks in the KV pool")
    pool.add_argument("--kv-memory", dest="kv_memory_gib", type=float, default=_ABSENT, metavar="GIB",
                      help="size the KV pool to this many GiB (default: 1 on CPU, 80%% of free on CUDA)")
    p.add_argument("--block-size", dest="block_size", type=int, default=_ABSENT)
    p.add_argument("--max-num-seqs", dest="max_num_seqs", type=int, default=_ABSENT,
                   help="running requests at most")
    p.add_argument("--max-batched-tokens", dest="max_batched_tokens", type=int, default=_ABSENT,
                   help="tokens per step, decode and prefill chunks together")
    p.add_argument("--max-waiting", dest="max_waiting", type=int, default=_ABSENT,
                   help="queued requests before HTTP 429")
    p.add_argument("--max-model-len", dest="max_model_len", type=int, default=_ABSENT,
                   help="tokens of one request at most (default: the model's context)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   default=_ABSENT)
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false", default=_ABSENT)
    p.add_argument("--threads", type=int, default=_ABSENT, help="torch CPU threads")
    p.add_argument("--log-level", dest="log_level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(_run=run_serve)
    return p


def configs_from_args(args: argparse.Namespace):
    """``(EngineConfig, ServerConfig)`` from the flags that were given."""
    from kvtier.serve.api import ServerConfig
    from kvtier.serve.engine import EngineConfig

    engine = {n: getattr(args, n) for n in _ENGINE_FLAGS if hasattr(args, n)}
    if engine.get("kv_quant") == "off":
        engine["kv_quant"] = None
    server = {n: getattr(args, n) for n in ("host", "port", "served_model_name") if hasattr(args, n)}
    return EngineConfig(**engine), ServerConfig(**server)


def run_serve(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from kvtier.model import load_model
    from kvtier.serve.api import build_app
    from kvtier.serve.async_engine import AsyncLLMEngine
    from kvtier.serve.engine import LLMEngine

    engine_config, server_config = configs_from_args(args)  # bad values fail before the model loads
    if hasattr(args, "threads"):
        torch.set_num_threads(args.threads)
    kw = {"device": args.device} if hasattr(args, "device") else {}
    if hasattr(args, "dtype"):
        kw["dtype"] = getattr(torch, args.dtype)
    lm = load_model(getattr(args, "model", None), progress=sys.stderr.isatty(), **kw)
    if lm.tokenizer is None:
        raise ValueError(f"{lm.source} has no tokenizer (tokenizer.json); the server needs one")
    engine = LLMEngine(lm.model, lm.tokenizer, engine_config)
    name = server_config.served_model_name or lm.source.name.removesuffix(".gguf")
    app = build_app(AsyncLLMEngine(engine), lm.tokenizer, name, server_config)
    s = engine.stats()
    print(f"[kvtier] serving {name} on http://{server_config.host}:{server_config.port}/v1 | "
          f"{s['num_blocks']} blocks of {s['block_size']} ({s['kv_storage']}, "
          f"{s['kv_bytes'] / 2**30:.2f} GiB), context {s['max_model_len']} tokens",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=server_config.host, port=server_config.port, log_level=args.log_level)
    return 0
