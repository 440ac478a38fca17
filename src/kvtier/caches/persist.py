"""Saving and loading per-layer caches of any tier as one safetensors file.

Layout of the file:

- tensors: each layer's ``state`` under ``layer{i}.{name}`` (e.g. ``layer0.keys``);
- header metadata (strings): ``format`` = ``"kvtier.cache"``, ``format_version``,
  ``num_layers``, ``layers`` (JSON list of each layer's ``meta_state`` and
  tensor names), ``checksums`` (JSON: CRC-32 of every tensor's dtype, shape and
  bytes), ``metadata`` (JSON of the caller's metadata) and ``header_crc`` (CRC-32
  of all the other fields). Every byte that decides what is loaded is covered by
  a checksum, so a single flipped bit anywhere in the file is detected.

The file is written to a temporary name beside ``path`` and renamed into place, so
a reader never sees half a file; only a regular file (or a symlink to one) is ever
replaced. A lock file beside it (held with ``flock``, removed before it is released)
keeps two saves to one path apart: the second gets a ``ValueError``. Loading checks
everything (format, version, checksums, JSON, tiers, tensor names, and each tier's
``from_state`` every field, sizes against the tensors held) before it returns; any
problem is a ``ValueError`` naming the file and what is wrong. Room a file names past
the tokens it holds (blocks a trim kept, an unfrozen ragged capacity) is allocated only
up to :func:`~kvtier.caches.state_checks.restore_slack`; a frozen ragged capacity is
restored exactly, or refused where the device has not the memory for it.

Example::

    >>> save_cache("prompt.safetensors", caches, metadata={"model": "SmolLM2-135M"})
    >>> caches, metadata = load_cache("prompt.safetensors")
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import os
import stat
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kvtier.caches.base import KVCache

FORMAT = "kvtier.cache"
#: the server's prefix cache on disk (:mod:`kvtier.serve.prefix_file`): a kvtier file of its own
#: kind, which a save of either kind refuses to replace with the other
PREFIX_FORMAT = "kvtier.prefix_cache"
#: 2: the header carries its own checksum and each tensor's covers its dtype and shape
FORMAT_VERSION = 2
#: the header's fields, all covered by ``header_crc``
HEADER_FIELDS = ("format", "format_version", "num_layers", "layers", "checksums", "metadata")

#: tier name (``meta_state["tier"]``) -> (module, class); imported only when a file needs it
TIERS: dict[str, tuple[str, str]] = {
    "tail": ("kvtier.caches.tail_owned", "TailOwnedKVCache"),
    "block": ("kvtier.caches.block_owned", "BlockOwnedKVCache"),
    "ragged": ("kvtier.caches.ragged", "RaggedBatchKVCache"),
    "paged": ("kvtier.caches.paged", "PagedKVCache"),
}

_SPECIAL_FILES = (
    (stat.S_ISDIR, "directory"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISFIFO, "FIFO (named pipe)"),
    (stat.S_ISSOCK, "socket"),
)


def _crc(t: torch.Tensor) -> int:
    """CRC-32 of a CPU tensor's dtype, shape and bytes (any dtype, bf16 included)."""
    crc = zlib.crc32(f"{t.dtype}{list(t.shape)}".encode())
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy().data, crc)


def _header_crc(header: dict[str, str]) -> str:
    """CRC-32 of every header field but the checksum itself, as a decimal string."""
    return str(zlib.crc32(json.dumps({k: header[k] for k in HEADER_FIELDS}, sort_keys=True).encode()))


def is_cache_file(path: str | os.PathLike, fmt: str = FORMAT) -> bool:
    """Whether ``path`` opens as a safetensors file whose header names format ``fmt`` (this
    module's, or :data:`PREFIX_FORMAT`; of any version; its tensors and checksums are not read),
    or whose damaged or cut-short header still holds that format's mark (or, for this format, a
    prompt cache's). The header is read by hand: ``safe_open`` also checks the tensors' extent,
    and a cache cut short past its header is still one."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= 1 << 30:
                return False
            raw = f.read(size)
    except OSError:
        return False
    try:
        if json.loads(raw).get("__metadata__", {}).get("format") == fmt:
            return True
    except (ValueError, AttributeError):  # (UnicodeDecodeError and JSON errors are ValueErrors)
        pass
    # a header damaged or cut short: still ours where it names the format or a prompt cache
    return any(mark in raw for mark in _MARKS.get(fmt, ()))


#: what a kvtier cache's header holds (its format, a prompt cache's record, a layer's state, the
#: tensors' checksums: each at the start of a value, which come in no fixed order), found in one
#: whose JSON no longer parses; a prefix cache file's header names its format
_MARKS = {FORMAT: (f'"format":"{FORMAT}"'.encode(), b'\\"kvtier.prompt_cache\\"',
                   b'{\\"meta_state\\": {\\"tier\\": \\"', b'"checksums":"{\\"layer0.'),
          PREFIX_FORMAT: (f'"format":"{PREFIX_FORMAT}"'.encode(),)}
#: what a file of each format is called in an error
_KINDS = {FORMAT: "kvtier cache file", PREFIX_FORMAT: "kvtier prefix cache file (kvtier serve --prefix-cache-file)"}
#: a file name of each format, for the messages
_EXAMPLES = {FORMAT: "prompt.safetensors", PREFIX_FORMAT: "prefixes.safetensors"}


def check_save_path(path: str | os.PathLike, fmt: str = FORMAT) -> Path:
    """The regular file that saving to ``path`` replaces: ``path``, or the file its symlink names.

    Raises ``ValueError`` (and touches nothing) when ``path`` names a directory, a
    device, a FIFO or a socket, or a symlink to one; when it is a dangling symlink;
    when it is a file of something else (not empty and not a file of format ``fmt``, of any
    version: :func:`is_cache_file`), which saving would overwrite; and when its folder
    is missing or not writable (folders are never created); and when its name is too long for the
    lock and temporary files a save writes beside it (``.NAME.kvtier-lock``).
    """
    path = Path(path)
    try:
        st = os.stat(path)  # follows symlinks
    except FileNotFoundError:
        if path.is_symlink():
            raise ValueError(f"{path} is a symlink to {os.readlink(path)}, which does not exist; "
                             "create the file it names, or pass another path") from None
        st = None
    except OSError as e:
        raise ValueError(f"{path} cannot be inspected ({e}); pass the path of a regular file") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _SPECIAL_FILES if test(st.st_mode)), "special file")
        via = ", through a symlink" if path.is_symlink() else ""
        raise ValueError(f"{path} is a {kind}{via}, not a regular file; caches are saved only to "
                         f"regular files: pass a file path such as {_EXAMPLES[fmt]}")
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    if st is not None and st.st_size > 0 and not is_cache_file(target, fmt):
        raise ValueError(f"{path} exists and is not a {_KINDS[fmt]}; saving would overwrite it: "
                         "pass another path, or delete the file first")
    folder = target.parent
    if not folder.is_dir():
        raise ValueError(f"{path}: its folder {folder} does not exist; create it first "
                         f"(mkdir -p {folder}) or pass another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        if fmt == PREFIX_FORMAT and st is not None and st.st_size > 0:  # (a prefix cache file there: it may be read)
            raise ValueError(f"{path}: its folder {folder} is not writable, and the server writes the file when it "
                             "stops: pass another path, or add --prefix-cache-read-only (prefix_cache_read_only) to "
                             "read the file there without ever writing it")
        raise ValueError(f"{path}: its folder {folder} is not writable; pass another path")
    beside = f".{target.name}.kvtier-lock"  # (the longest name a save writes next to it)
    try:
        limit = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    if len(os.fsencode(beside)) > limit:
        raise ValueError(f"{path}: its name ({len(os.fsencode(target.name))} bytes) is too long to save: a save "
                         f"writes {beside!r} beside it, and a name in {folder} holds {limit} bytes at most; "
                         "pass a shorter name")
    return target


def save_cache(
    path: str | os.PathLike, caches: list[KVCache], metadata: dict[str, Any] | None = None
) -> None:
    """Write per-layer ``caches`` (any tiers, mixed allowed) and ``metadata`` to ``path``.

    ``caches``: a list of :class:`~kvtier.caches.base.KVCache`; each layer's
    ``state`` tensors (any dtype, any device: they are copied to CPU) and
    ``meta_state`` are stored. ``metadata``: a JSON-serialisable dict of the
    caller's own (e.g. the model name and the prompt's token ids). Everything is
    checked before the file is touched (the path too: see :func:`check_save_path`);
    the write is atomic (a temporary file ``.NAME.kvtier-tmp`` beside it, then a
    rename), under a lock (``.NAME.kvtier-lock``, removed when the save ends). A
    temporary or lock file left by a killed save is replaced; a second process (or
    thread) saving to the same path at the same moment gets a ``ValueError``, and the
    save under way completes.
    """
    if isinstance(path, KVCache | list | tuple):
        raise ValueError(f"save_cache(path, caches): the path comes first, got a {type(path).__name__} "
                         "in its place")
    target = check_save_path(path)
    if isinstance(caches, KVCache):
        raise ValueError(f"caches must be a list of KVCache objects, one per layer, got one "
                         f"{type(caches).__name__}; pass [cache] for a single layer")
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
    header["header_crc"] = _header_crc(header)

    tmp = temporary_path(target)
    with save_lock(target):  # only the holder touches tmp: save_file may replace it by rename
        try:
            tmp.unlink(missing_ok=True)  # a killed save's leftover (or a symlink): never written through
            save_file(tensors, tmp, metadata=header)
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def temporary_path(target: Path) -> Path:
    """Where a save of ``target`` writes before its rename: ``.NAME.kvtier-tmp`` beside it."""
    return target.with_name(f".{target.name}.kvtier-tmp")


@contextlib.contextmanager
def save_lock(target: Path):
    """Hold the save lock of ``target``: ``.NAME.kvtier-lock`` beside it, ``flock``-ed.

    The file is unlinked before the lock is released, so none is left behind; a save
    that locked a file just unlinked (the save before it ended) sees that the name
    now names another file, or none, and opens it afresh. The lock is on the lock
    file, never on the temporary file: ``save_file`` (safetensors 0.8 at least) writes
    that by writing a file of its own and renaming it over the name, so a lock on the
    temporary file's first inode would no longer guard the name.
    """
    lock = target.with_name(f".{target.name}.kvtier-lock")
    for _ in range(3):
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(f"another process is saving to {target} right now; try again "
                             "when it is done") from None
        st, now = os.fstat(fd), _stat_or_none(lock)
        if now is not None and (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
            break
        os.close(fd)  # a save that just finished unlinked the file we locked; open it afresh
    else:
        raise ValueError(f"another process keeps saving to {target}; try again when it is done")
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)  # before the lock is released: a waiting save then opens a new file
        os.close(fd)


def _stat_or_none(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None


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
    if raw.get("format_version") != str(FORMAT_VERSION):
        raise ValueError(
            f"format version {raw.get('format_version')}; this kvtier reads version "
            f"{FORMAT_VERSION}: save the cache again with this version"
        )
    if set(raw) != {*HEADER_FIELDS, "header_crc"}:
        raise ValueError(f"the kvtier header's fields {sorted(raw)} are not {sorted(HEADER_FIELDS)} "
                         "plus header_crc: the file is corrupted")
    if raw["header_crc"] != _header_crc(raw):
        raise ValueError("the kvtier header fails its checksum: the file is corrupted")
    try:
        num_layers = int(raw["num_layers"])
        layers = json.loads(raw["layers"])
        checksums = json.loads(raw["checksums"])
        metadata = json.loads(raw["metadata"])
    except (ValueError, RecursionError) as e:  # RecursionError: JSON nested too deeply
        raise ValueError(f"the kvtier header is damaged ({type(e).__name__}: {e})") from None
    if not isinstance(layers, list) or len(layers) != num_layers:
        raise ValueError(f"the header's layer list does not hold num_layers={num_layers} entries")
    expected = set()
    for i, layer in enumerate(layers):
        if not (
            isinstance(layer, dict)
            and isinstance(layer.get("meta_state"), dict)
            and isinstance(layer.get("tensors"), list)
            and all(isinstance(n, str) for n in layer["tensors"])
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
            # every from_state checks its fields; the others are a net, and a capacity the memory
            # cannot hold (a MemoryError, or torch's RuntimeError) is the file's problem too
            except (ValueError, KeyError, TypeError, IndexError, RuntimeError, MemoryError) as e:
                raise ValueError(f"layer {i} ({cls.__name__}) cannot be rebuilt: {e}") from e
    return caches, header["metadata"]


def load_cache(
    path: str | os.PathLike, *, device: str | torch.device = "cpu"
) -> tuple[list[KVCache], dict[str, Any]]:
    """Read a file written by :func:`save_cache`.

    Returns ``(caches, metadata)``: ``caches`` is the list of per-layer caches,
    each rebuilt by its tier's ``from_state`` with tensors on ``device``, and
    ``metadata`` the dict given to :func:`save_cache` (``{}`` if none). Raises
    ``FileNotFoundError`` when ``path`` does not exist, and otherwise only
    ``ValueError``, naming the file and the problem, if it is not a regular file or
    is truncated, corrupted (a flipped bit anywhere fails a checksum), of another
    format version, or inconsistent; then nothing is returned.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such cache file")
    if not path.is_file():
        raise ValueError(f"{path} is not a regular file; pass the path of a saved cache file")
    device = torch.device(device)
    try:
        return _load(path, device)
    except SafetensorError as e:
        raise ValueError(
            f"{path}: not a readable safetensors file ({e}); it is truncated or corrupted"
        ) from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
