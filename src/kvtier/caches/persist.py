"""Saving and loading per-layer caches of any tier as one safetensors file.

Layout of the file:

- tensors: each layer's ``state`` under ``layer{i}.{name}`` (e.g. ``layer0.keys``);
- header metadata (strings): ``format`` = ``"kvtier.cache"``, ``format_version``,
  ``num_layers``, ``layers`` (JSON list of each layer's ``meta_state`` and
  tensor names), ``checksums`` (JSON: CRC-32 of every tensor's bytes) and
  ``metadata`` (JSON of the caller's metadata).

The file is written to a temporary name beside ``path`` and renamed into place, so
a reader never sees half a file. Loading checks everything (format, version,
JSON, tiers, tensor names, checksums) before it returns; any problem is a
``ValueError`` naming the file and what is wrong.

Example::

    >>> save_cache("prompt.safetensors", caches, metadata={"model": "SmolLM2-135M"})
    >>> caches, metadata = load_cache("prompt.safetensors")
"""

from __future__ import annotations

import importlib
import json
import os
import tempfile
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kvtier.caches.base import KVCache

FORMAT = "kvtier.cache"
FORMAT_VERSION = 1

#: tier name (``meta_state["tier"]``) -> (module, class); imported only when a file needs it
TIERS: dict[str, tuple[str, str]] = {
    "tail": ("kvtier.caches.tail_owned", "TailOwnedKVCache"),
    "block": ("kvtier.caches.block_owned", "BlockOwnedKVCache"),
    "ragged": ("kvtier.caches.ragged", "RaggedBatchKVCache"),
    "paged": ("kvtier.caches.paged", "PagedKVCache"),
}


def _crc(t: torch.Tensor) -> int:
    # bytes of a contiguous CPU tensor of any dtype (bf16 included) through a uint8 view
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy().data)


def save_cache(
    path: str | os.PathLike, caches: list[KVCache], metadata: dict[str, Any] | None = None
) -> None:
    """Write per-layer ``caches`` (any tiers, mixed allowed) and ``metadata`` to ``path``.

    ``caches``: a list of :class:`~kvtier.caches.base.KVCache`; each layer's
    ``state`` tensors (any dtype, any device: they are copied to CPU) and
    ``meta_state`` are stored. ``metadata``: a JSON-serialisable dict of the
    caller's own (e.g. the model name and the prompt's token ids). Everything is
    checked before the file is touched; the write is atomic (temporary file, then
    rename).
    """
    path = Path(path)
    if not isinstance(caches, list | tuple) or not all(isinstance(c, KVCache) for c in caches):
        raise ValueError("caches must be a list of KVCache objects, one per layer")
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict):
        raise ValueError(f"metadata must be a dict or None, got {type(metadata).__name__}")
    try:
        meta_json = json.dumps(metadata)
    except (TypeError, ValueError) as e:
        raise ValueError(f"metadata is not JSON-serialisable ({e}); pass plain types") from None

    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for i, cache in enumerate(caches):
        if cache.tier not in TIERS:
            raise ValueError(f"layer {i}: tier {cache.tier!r} cannot be saved; known: {list(TIERS)}")
        state = cache.state
        for name, t in state.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"layer {i}: state[{name!r}] is {type(t).__name__}, not a tensor")
            # an owned CPU copy: no storage is shared between entries (safetensors refuses that)
            tensors[f"layer{i}.{name}"] = t.detach().to("cpu", copy=True).contiguous()
        layers.append({"meta_state": cache.meta_state, "tensors": sorted(state)})
    try:
        layers_json = json.dumps(layers)
    except (TypeError, ValueError) as e:
        raise ValueError(f"a meta_state is not JSON-serialisable ({e})") from None
    header = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "num_layers": str(len(caches)),
        "layers": layers_json,
        "checksums": json.dumps({k: _crc(t) for k, t in tensors.items()}),
        "metadata": meta_json,
    }

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=header)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _tier_class(tier: Any, i: int) -> type[KVCache]:
    if tier not in TIERS:
        raise ValueError(f"layer {i} has unknown tier {tier!r}; known: {list(TIERS)}")
    module, name = TIERS[tier]
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"layer {i} needs tier {tier!r}, which is unavailable ({e})") from e


def _read_header(f: Any) -> dict[str, Any]:
    """Decode and check the kvtier header of an open safetensors file."""
    raw = f.metadata() or {}
    if raw.get("format") != FORMAT:
        raise ValueError(f"not a kvtier cache file (format {raw.get('format')!r})")
    try:
        version = int(raw["format_version"])
        num_layers = int(raw["num_layers"])
        layers = json.loads(raw["layers"])
        checksums = json.loads(raw["checksums"])
        metadata = json.loads(raw["metadata"])
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"the kvtier header is damaged ({type(e).__name__}: {e})") from None
    if version != FORMAT_VERSION:
        raise ValueError(
            f"format version {version}; this kvtier reads version {FORMAT_VERSION}: "
            "save the cache again with this version"
        )
    if not isinstance(layers, list) or len(layers) != num_layers:
        raise ValueError(f"the header's layer list does not hold num_layers={num_layers} entries")
    expected = set()
    for i, layer in enumerate(layers):
        if not (
            isinstance(layer, dict)
            and isinstance(layer.get("meta_state"), dict)
            and isinstance(layer.get("tensors"), list)
        ):
            raise ValueError(f"layer {i}'s header entry is malformed")
        expected |= {f"layer{i}.{n}" for n in layer["tensors"]}
    names = set(f.keys())
    if names != expected:
        raise ValueError(
            f"tensors do not match the header (missing {sorted(expected - names)}, "
            f"unexpected {sorted(names - expected)})"
        )
    if not isinstance(checksums, dict) or set(checksums) != expected:
        raise ValueError("the header's checksums do not cover the file's tensors")
    if not isinstance(metadata, dict):
        raise ValueError("the header's user metadata is not a JSON object")
    return {"layers": layers, "checksums": checksums, "metadata": metadata}


def _load(path: Path, device: torch.device) -> tuple[list[KVCache], dict[str, Any]]:
    with safe_open(str(path), framework="pt") as f:
        header = _read_header(f)
        layers = header["layers"]
        classes = [_tier_class(ly["meta_state"].get("tier"), i) for i, ly in enumerate(layers)]
        caches = []
        for i, (layer, cls) in enumerate(zip(layers, classes)):
            state = {}
            for name in layer["tensors"]:
                key = f"layer{i}.{name}"
                t = f.get_tensor(key)
                if _crc(t) != header["checksums"][key]:
                    raise ValueError(f"tensor {key!r} fails its checksum: the data is corrupted")
                state[name] = t.to(device)
            try:
                caches.append(cls.from_state(state, layer["meta_state"]))
            except (ValueError, KeyError, TypeError, RuntimeError) as e:
                raise ValueError(f"layer {i} ({cls.__name__}) cannot be rebuilt: {e}") from e
    return caches, header["metadata"]


def load_cache(
    path: str | os.PathLike, *, device: str | torch.device = "cpu"
) -> tuple[list[KVCache], dict[str, Any]]:
    """Read a file written by :func:`save_cache`.

    Returns ``(caches, metadata)``: ``caches`` is the list of per-layer caches,
    each rebuilt by its tier's ``from_state`` with tensors on ``device``, and
    ``metadata`` the dict given to :func:`save_cache` (``{}`` if none). Raises
    ``ValueError`` naming the file and the problem if it is truncated, corrupted,
    of another format version, or inconsistent; then nothing is returned.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such cache file")
    device = torch.device(device)
    try:
        return _load(path, device)
    except SafetensorError as e:
        raise ValueError(
            f"{path}: not a readable safetensors file ({e}); it is truncated or corrupted"
        ) from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
