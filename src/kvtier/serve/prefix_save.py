"""Saving the serving engine's prefix cache to a file (:mod:`kvtier.serve.prefix_file` describes
the file and loads it), in one of two ways:

- :func:`save_prefix_cache` writes every block from the pool and the host tier while the engine
  waits: a server's last save, once its loop has stopped;
- :func:`begin_prefix_save` takes only a moment between two steps (a server's periodic saves,
  ``--prefix-cache-save-interval``): the blocks the file on disk does not hold yet are copied to
  host memory, and a thread writes the new file, taking every other block from the file itself
  (each of its tensors checked against its CRC-32 first), while the engine steps on;
  :meth:`PrefixSave.finish` renames it into place between two later steps.

The file on disk is the one this process last wrote or read at that path, known by its device,
inode, size and modification time (:func:`remember_file`). The thread reads it through one
descriptor of that identity, one tensor at a time, each checked against its CRC-32 before a row
is copied from it; a file changed since fails the save (:class:`StaleFile`) and is not read from
again, so the next save copies every block. A save whose copies would take more than
:data:`CAPTURE_SHARE` of the host's available memory (:func:`host_budget`, shared by the ranks)
is written while the engine waits, as :func:`save_prefix_cache`; a cache whose blocks and order
are those of the file is not written again. Under tensor parallelism every rank does the same
with its own file, and the files are renamed into place only once every rank has written its own.

Example (a server's loop; :func:`kvtier.serve.prefix_file.engine_lifespan` does this)::

    >>> save = begin_prefix_save(engine, "prefixes.safetensors")   # between two steps  # doctest: +SKIP
    >>> while not save.written():                                   # between later steps
    ...     engine.step()                                            # doctest: +SKIP
    >>> save.finish()                                               # doctest: +SKIP
    812
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import io
import json
import os
import stat
import sys
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from kvtier.caches.persist import PREFIX_FORMAT, check_save_path, save_lock, temporary_path
from kvtier.caches.state_checks import free_bytes
from kvtier.serve.prefix_format import (
    _NAMES,
    CHUNK,
    FORMAT_VERSION,
    _bytes,
    _chunks,
    _differences,
    _engine_fingerprint,
    _everywhere,
    _gather,
    _header_crc,
    _pool,
    _runner_fingerprint,
    _runner_of,
    _sound_header,
    rank_path,
)

__all__ = ["CAPTURE_SHARE", "PrefixSave", "StaleFile", "begin_prefix_save", "check_prefix_paths", "discard_unfinished",
           "file_ident", "host_budget", "remember_file", "save_prefix_cache"]

#: the most of the host's available memory (``MemAvailable``) a save begun between two steps may
#: hold in copies of blocks; a save that would need more is written while the engine waits
CAPTURE_SHARE = 0.25


@dataclasses.dataclass(frozen=True)
class _OnDisk:
    """A file this process wrote or read: its identity, each block's row, and for each pool tensor
    the file offset of its data and its CRC-32."""

    ident: tuple[int, int, int, int] | None
    rows: dict[bytes, int]
    offsets: tuple[int, ...]
    crcs: tuple[int, ...]


@dataclasses.dataclass
class _Written:
    """This rank's file being written (:func:`_begin`, :func:`_write`) until renamed into place."""

    target: Path
    hashes: list[bytes]
    offsets: tuple[int, ...]
    future: concurrent.futures.Future
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)


#: each local runner's files as this process last wrote or read them: ``{path: _OnDisk}``
_ON_DISK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: each local runner's file being written: :class:`_Written`
_WRITING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WRITER: list[concurrent.futures.ThreadPoolExecutor] = []


def _writer() -> concurrent.futures.ThreadPoolExecutor:
    if not _WRITER:
        _WRITER.append(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvtier-prefix-save"))
    return _WRITER[0]


def file_ident(path: Path | int) -> tuple[int, int, int, int] | None:
    """``(device, inode, size, modification time in ns)`` of ``path`` (or an open descriptor);
    ``None`` where it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def remember_file(runner, target: Path, hashes: list[bytes], offsets, crcs) -> None:
    """Note that ``target`` holds ``hashes`` (row ``i``: ``hashes[i]``), each pool tensor's data at
    ``offsets`` with CRC-32 ``crcs``: a later :func:`begin_prefix_save` reads those blocks from it."""
    rows = {h: i for i, h in enumerate(hashes)}
    _ON_DISK.setdefault(runner, {})[os.path.realpath(target)] = _OnDisk(file_ident(target), rows, tuple(offsets),
                                                                        tuple(crcs))


def _forget(runner, target: Path) -> None:
    _ON_DISK.get(runner, {}).pop(os.path.realpath(target), None)


# -- a save while the engine waits ------------------------------------------------------------------
def save_prefix_cache(engine, path: str | os.PathLike) -> int:
    """Write every block ``engine``'s prefix cache holds (pool and host tier) to ``path`` (and,
    under tensor parallelism, each other rank's share to :func:`rank_path`); returns how many
    (none cached: 0, and the files are left as they are). The engine must not be stepping
    meanwhile (a server's loop stopped). A ``ValueError`` names what is wrong, and no file
    changes: when a rank's path is a folder or a file of another kind, when ``path`` is a
    sound prefix cache file of another fingerprint (another configuration's blocks are never
    written over), when a save begun by :func:`begin_prefix_save` is not finished, or when a
    rank fails to write (every rank writes a temporary file first; all are renamed into place
    only once every rank has written its own)."""
    started = _start(engine, path)
    if started is None:
        return 0  # (an empty cache does not replace a file of blocks)
    runner, engine_fp, entries = started
    _run(runner, path, lambda: _everywhere(runner, _write, str(path), engine_fp, entries))
    return len(entries)


def _start(engine, path) -> tuple | None:
    """``(runner, the engine's fingerprint, the cached entries)`` once every rank's path is checked
    and the queued copies ran on every rank; ``None`` when nothing is cached."""
    runner, bm = _runner_of(engine), engine.block_manager
    engine_fp = _engine_fingerprint(engine)
    _everywhere(runner, _check_path, str(path), engine_fp)
    if not bm.num_cached_blocks and not bm.host_figures()["host_cached_blocks"]:
        return None
    copies = bm.take_copies()  # saves to the host and loads the books count as done, but not yet run
    entries = bm.cached_entries()
    _everywhere(runner, _apply, copies)  # (at once: before anything else can fail)
    return runner, engine_fp, entries


def _run(runner, path, write: Callable[[], object]) -> None:
    """``write()`` on every rank, then every rank's file renamed into place; every temporary file
    removed if a rank fails."""
    try:
        write()
        _everywhere(runner, _commit, str(path))
    except BaseException:
        with contextlib.suppress(Exception):
            _everywhere(runner, _discard, str(path))
        raise


def check_prefix_paths(engine, path: str | os.PathLike) -> None:
    """Every rank's file of ``path`` may be written (a new, empty or prefix cache file in a
    folder that exists and is writable); a ``ValueError`` naming the rank and the fix otherwise."""
    _everywhere(_runner_of(engine), _check_writable, str(path))


def _check_writable(runner, rank: int, world: int, path: str) -> None:
    check_save_path(rank_path(path, rank), PREFIX_FORMAT)


def _check_path(runner, rank: int, world: int, path: str, engine_fp: dict) -> None:
    """This rank's file may be written; rank 0's also holds no sound file of another fingerprint
    (a damaged one, or rank files without it, are replaced); no save begun is unfinished."""
    if runner in _WRITING:
        raise ValueError("a save of the prefix cache begun by begin_prefix_save() is not finished; "
                         "finish() or discard() it first")
    target = check_save_path(rank_path(path, rank), PREFIX_FORMAT)
    if rank or not target.is_file() or not target.stat().st_size:
        return
    try:
        with safe_open(str(target), framework="pt") as f:
            saved, _ = _sound_header(f.metadata() or {}, target)
    except (ValueError, SafetensorError, OSError):
        return
    ours = engine_fp | _runner_fingerprint(runner, rank, world)
    if saved != ours:
        raise ValueError(f"{target} holds the blocks of another model or cache layout ("
                         + "; ".join(_differences(saved, ours)) + "), which saving would overwrite: pass "
                         "another path, or delete the file first")


def _apply(runner, rank: int, world: int, copies) -> None:
    """The queued ``copies`` run, and every save to the host landed (the host's slots are read next)."""
    if copies:
        runner.host.apply(copies)
    if runner.host is not None and runner.host.cuda:
        torch.cuda.synchronize(runner.host.device)


def _named_pool(runner) -> list[torch.Tensor]:
    """The pool's tensors, each of a dtype safetensors names."""
    pool = _pool(runner)
    missing = sorted({str(t.dtype) for t in pool if t.dtype not in _NAMES})
    if missing:
        raise ValueError(f"pages of dtype {missing} have no safetensors name; they cannot be saved")
    return pool


def _header(runner, rank: int, world: int, engine_fp: dict, pool: list[torch.Tensor], n: int) -> tuple[bytes, tuple]:
    """The file's first bytes (its header's length, then the header) for ``n`` blocks, and the
    file offset of each pool tensor's data."""
    names = ["hashes", *(f"t{j}" for j in range(len(pool)))]
    shapes = [[n, 32]] + [[n, *t.shape[1:]] for t in pool]
    dtypes = [torch.uint8] + [t.dtype for t in pool]
    meta = {"format": PREFIX_FORMAT, "format_version": str(FORMAT_VERSION), "blocks": str(n),
            "fingerprint": json.dumps(engine_fp | _runner_fingerprint(runner, rank, world), sort_keys=True)}
    meta["header_crc"] = _header_crc(meta)
    header, offset = {"__metadata__": meta}, 0
    for name, shape, dtype in [*zip(names, shapes, dtypes), ("crc", [len(names)], torch.int64)]:
        size = dtype.itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": _NAMES[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    return len(raw).to_bytes(8, "little") + raw, tuple(start + header[f"t{j}"]["data_offsets"][0] for j in range(len(pool)))


def _hash_rows(entries) -> np.ndarray:
    return np.frombuffer(b"".join(h for h, _, _ in entries), dtype=np.uint8).reshape(-1, 32)


def _write_file(target: Path, head: bytes, hashes: np.ndarray, n: int,
                pieces: Callable[[int], Iterable[np.ndarray]]) -> list[int]:
    """``target``'s temporary file: ``head``, the hashes, the ``n`` pool tensors' bytes from
    ``pieces(j)``, the CRC-32s; returns the pool tensors' CRC-32s. The caller holds the save lock."""
    tmp = temporary_path(target)
    # the keys and values of every user's prompts: readable by the owner only, unless a saved file was
    # opened up (an empty placeholder, made by `touch` with the umask's 0644, is not a choice to keep)
    st = target.stat() if target.exists() else None
    mode = stat.S_IMODE(st.st_mode) if st is not None and st.st_size > 0 else 0o600
    try:
        tmp.unlink(missing_ok=True)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
            os.fchmod(f.fileno(), mode)  # (the umask narrowed it)
            f.write(head)
            crcs = [zlib.crc32(hashes)]
            f.write(hashes)
            for j in range(n):
                crc = 0
                for piece in pieces(j):
                    crc = zlib.crc32(piece, crc)
                    f.write(piece)
                crcs.append(crc)
            f.write(np.asarray(crcs, dtype="<i8").tobytes())
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return crcs[1:]


def _write(runner, rank: int, world: int, path: str, engine_fp: dict, entries) -> None:
    """This rank's share of ``entries`` (``(hash, "pool" | "host", index)``), gathered from the pool
    and the host here, in its temporary file (:func:`_commit` renames it into place)."""
    pool = _named_pool(runner)
    target = check_save_path(rank_path(path, rank), PREFIX_FORMAT)
    head, offsets = _header(runner, rank, world, engine_fp, pool, len(entries))
    chunks = _chunks([(w, i) for _, w, i in entries], runner.device)

    def pieces(j: int):
        host = runner.host.slots[j] if runner.host is not None else None
        return (_bytes(_gather(chunk, pool[j], host)) for chunk in chunks)

    with save_lock(target):
        crcs = _write_file(target, head, _hash_rows(entries), len(pool), pieces)
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_result(crcs)
    _WRITING[runner] = _Written(target, [h for h, _, _ in entries], offsets, done)


def _commit(runner, rank: int, world: int, path: str) -> None:
    """This rank's temporary file renamed over its file (every rank has written its own); on a
    failure the temporary file is removed and the file on disk no longer read from."""
    written = _WRITING.pop(runner, None)
    if written is None:
        raise ValueError(f"no save of {rank_path(path, rank)} was written to commit")
    try:
        crcs = written.future.result()  # (a thread's error: raised here)
        target = check_save_path(rank_path(path, rank), PREFIX_FORMAT)
        if target != written.target:
            raise ValueError(f"{rank_path(path, rank)} now names {target}, not {written.target}, whose save "
                             "was being written; the save is dropped")
        with save_lock(target):
            os.replace(temporary_path(target), target)
            remember_file(runner, target, written.hashes, written.offsets, crcs)
    except BaseException:
        _forget(runner, written.target)
        temporary_path(written.target).unlink(missing_ok=True)
        raise


def _discard(runner, rank: int, world: int, path: str) -> None:
    """This rank's save dropped (:func:`_drop`), or a temporary file of ``path`` left removed."""
    if not _drop(runner, rank, world):
        with contextlib.suppress(ValueError):
            temporary_path(check_save_path(rank_path(path, rank), PREFIX_FORMAT)).unlink(missing_ok=True)


def _drop(runner, rank: int, world: int) -> bool:
    """This rank's unfinished save, if any, dropped: a thread writing told to stop and waited for,
    its temporary file removed."""
    written = _WRITING.pop(runner, None)
    if written is None:
        return False
    written.cancel.set()
    with contextlib.suppress(BaseException):
        written.future.result()
    temporary_path(written.target).unlink(missing_ok=True)
    return True


def discard_unfinished(engine) -> None:
    """Drop a save :func:`begin_prefix_save` began and nobody finished (its server task cancelled),
    on every rank; the engine must not be stepping (a server's loop stopped)."""
    _everywhere(_runner_of(engine), _drop)


# -- a save begun between two steps -----------------------------------------------------------------
class StaleFile(ValueError):
    """The file on disk is not the one this process wrote or read, or fails its CRC-32: no block is
    taken from it (the next save copies every block)."""


@dataclasses.dataclass
class PrefixSave:
    """A save begun by :func:`begin_prefix_save`: ``blocks`` in all, ``new_blocks`` of them copied
    to host memory (``copied_bytes`` on a rank at most) in ``pause_s`` seconds, the file being
    written by a thread. ``waited``: written while the engine waited instead (the copies would
    have taken more than :data:`CAPTURE_SHARE` of the host's memory); ``unchanged``: nothing
    written (the file holds these blocks in this order already). Call :meth:`written`,
    :meth:`finish` and :meth:`discard` where the engine is not stepping, between two steps."""

    engine: object
    path: str
    blocks: int
    new_blocks: int
    copied_bytes: int
    pause_s: float
    waited: bool = False
    unchanged: bool = False
    done: bool = False

    def written(self) -> bool:
        """Whether every rank's file is written (a ``ValueError`` naming the rank whose writing
        failed; then :meth:`discard`)."""
        return self.done or all(_everywhere(self.engine.runner, _poll, self.path))

    def finish(self) -> int:
        """Rename every rank's file into place once all are written (waiting for them); returns the
        blocks saved. A rank's failure drops the save on every rank (every file as it was)."""
        if not self.done:
            try:
                while not self.written():
                    time.sleep(0.005)
                _run(self.engine.runner, self.path, lambda: None)
            except BaseException:
                self.discard()
                raise
            self.done = True
        return self.blocks

    def discard(self) -> None:
        """Drop the save (a thread writing is stopped and waited for): every file stays as it was."""
        if not self.done:
            self.done = True
            _everywhere(self.engine.runner, _discard, self.path)


def begin_prefix_save(engine, path: str | os.PathLike) -> PrefixSave | None:
    """Begin a save of ``engine``'s prefix cache to ``path`` (the module docstring): between two
    steps, copy the blocks the file does not hold yet and start a thread writing the new file;
    ``None`` when nothing is cached (the files are left as they are). The same refusals as
    :func:`save_prefix_cache`, before anything is copied."""
    t0 = time.perf_counter()
    started = _start(engine, path)
    if started is None:
        return None
    runner, engine_fp, entries = started
    plans = _everywhere(runner, _plan, str(path), entries)  # (bytes to copy, file unchanged) by rank
    if all(same for _, same in plans):
        return PrefixSave(engine, str(path), len(entries), 0, 0, time.perf_counter() - t0, unchanged=True, done=True)
    if max(need for need, _ in plans) > host_budget() // len(plans):  # (the ranks share the host)
        _run(runner, path, lambda: _everywhere(runner, _write, str(path), engine_fp, entries))
        return PrefixSave(engine, str(path), len(entries), len(entries), 0, time.perf_counter() - t0,
                          waited=True, done=True)
    try:
        begun = _everywhere(runner, _begin, str(path), engine_fp, entries)
    except BaseException:
        with contextlib.suppress(Exception):
            _everywhere(runner, _discard, str(path))
        raise
    return PrefixSave(engine, str(path), len(entries), max(b[0] for b in begun), max(b[1] for b in begun),
                      time.perf_counter() - t0)


def host_budget() -> int:
    """The bytes of copies a begun save may hold: :data:`CAPTURE_SHARE` of the host's available
    memory, or of what this process's control group (cgroup v2) leaves under its memory limit,
    whichever is less (the group's inactive page cache counted as free); 0 where neither reads."""
    free = free_bytes(torch.device("cpu")) or 0
    with contextlib.suppress(OSError, ValueError, StopIteration):
        own = next(line.split("::", 1)[1].strip() for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if line.startswith("0::"))
        group = Path("/sys/fs/cgroup") / own.lstrip("/")
        limit = (group / "memory.max").read_text().strip()
        if limit != "max":
            stat_lines = (group / "memory.stat").read_text().splitlines()
            cache = next((int(v) for k, v in (x.split() for x in stat_lines) if k == "inactive_file"), 0)
            used = int((group / "memory.current").read_text()) - cache
            free = min(free, int(limit) - used)
    return max(0, int(CAPTURE_SHARE * free))


def _rows(runner, target: Path, entries) -> tuple[np.ndarray, _OnDisk | None]:
    """Each entry's row in the file on disk (-1: not there), and the file's record (``None``:
    none, or the file changed since)."""
    disk = _ON_DISK.get(runner, {}).get(os.path.realpath(target))
    if disk is not None and file_ident(target) != disk.ident:
        disk = None
    return np.array([-1 if disk is None else disk.rows.get(h, -1) for h, _, _ in entries], dtype=np.int64), disk


def _plan(runner, rank: int, world: int, path: str, entries) -> tuple[int, bool]:
    """``(bytes`` this rank would copy``, whether its file holds ``entries`` in their order already)``."""
    rows, disk = _rows(runner, check_save_path(rank_path(path, rank), PREFIX_FORMAT), entries)
    row = sum(t[0].numel() * t.element_size() for t in _pool(runner))
    same = disk is not None and len(rows) == len(disk.rows) and bool((rows == np.arange(len(rows))).all())
    return int((rows < 0).sum()) * row, same


def _begin(runner, rank: int, world: int, path: str, engine_fp: dict, entries):
    """This rank's blocks new to its file copied to host memory and a thread writing the file;
    ``(blocks copied, bytes)``."""
    pool = _named_pool(runner)
    target = check_save_path(rank_path(path, rank), PREFIX_FORMAT)
    rows, disk = _rows(runner, target, entries)
    new = [entries[i] for i in np.flatnonzero(rows < 0)]
    row_bytes = [t[0].numel() * t.element_size() for t in pool]
    copied = _copy(runner, pool, [(w, i) for _, w, i in new], row_bytes)
    head, offsets = _header(runner, rank, world, engine_fp, pool, len(entries))
    cancel = threading.Event()
    future = _writer().submit(_write_in_thread, target, head, _hash_rows(entries), rows, copied, disk, row_bytes, cancel)
    _WRITING[runner] = _Written(target, [h for h, _, _ in entries], offsets, future, cancel)
    return len(new), sum(c.nbytes for c in copied)


def _copy(runner, pool: list[torch.Tensor], places: list, row_bytes: list[int]) -> list[np.ndarray]:
    """The blocks at ``places`` (``("pool" | "host", index)``) of every pool tensor, copied to host
    memory as rows of bytes, a tensor at a time (one gather and one copy from the device each:
    small copies from a GPU run at a fraction of its link's pace)."""
    if not places:
        return [np.empty((0, n), dtype=np.uint8) for n in row_bytes]
    (whole,) = _chunks(places, runner.device, size=len(places))
    return [_bytes(_gather(whole, t, runner.host.slots[j] if runner.host is not None else None)).reshape(len(places), -1)
            for j, t in enumerate(pool)]


def _write_in_thread(target: Path, head: bytes, hashes: np.ndarray, rows: np.ndarray, copied: list[np.ndarray],
                     disk: _OnDisk | None, row_bytes: list[int], cancel: threading.Event) -> list[int]:
    """The writer thread's part of :func:`_begin`: rows ``>= 0`` from the file on disk, the others
    from ``copied`` in order; the pool tensors' CRC-32s. Each tensor of the file on disk is read
    whole (one at a time) and checked against its CRC-32 before a row is taken from it."""
    if sys.platform == "linux":  # the engine's threads first (on Linux a thread has a nice of its own)
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    from_file = rows >= 0
    take = np.cumsum(~from_file) - 1  # row i's index in copied, where it is no file row
    with save_lock(target), _old_file(target, disk if from_file.any() else None) as old:

        def pieces(j: int) -> Iterator[np.ndarray]:
            tensor = old(j, row_bytes[j]) if old is not None else None
            for a in range(0, len(rows), CHUNK):
                if cancel.is_set():
                    raise ValueError("the save was dropped")
                f, r, k = from_file[a : a + CHUNK], rows[a : a + CHUNK], take[a : a + CHUNK]
                out = np.empty((len(f), row_bytes[j]), dtype=np.uint8)
                if tensor is not None:
                    out[f] = tensor[r[f]]
                out[~f] = copied[j][k[~f]]
                yield out

        return _write_file(target, head, hashes, len(row_bytes), pieces)


@contextlib.contextmanager
def _old_file(target: Path, disk: _OnDisk | None):
    """``read(j, bytes a row)``: tensor ``j`` of the file on disk as rows of bytes, read through one
    descriptor of the file this process knows and checked against its CRC-32 (a :class:`StaleFile`
    otherwise); ``None`` for no file."""
    if disk is None:
        yield None
        return
    with io.FileIO(target, "rb") as f:
        if file_ident(f.fileno()) != disk.ident:
            raise StaleFile(f"{target} changed since this server last wrote or read it")
        n = len(disk.rows)

        def read(j: int, row_bytes: int) -> np.ndarray:
            out = np.empty(n * row_bytes, dtype=np.uint8)
            view, got = memoryview(out), 0
            f.seek(disk.offsets[j])
            while got < out.size:
                k = f.readinto(view[got:])
                if not k:
                    raise StaleFile(f"{target} is shorter than when this server last wrote or read it")
                got += k
            if zlib.crc32(out) != disk.crcs[j]:
                raise StaleFile(f"{target} fails its checksum since this server last wrote or read it")
            return out.reshape(n, row_bytes)

        yield read


def _poll(runner, rank: int, world: int, path: str) -> bool:
    """Whether this rank's file is written; its writing's error, if it failed (the file on disk
    then no longer read from: the next save copies every block)."""
    written = _WRITING.get(runner)
    if written is None:
        raise ValueError(f"no save of {rank_path(path, rank)} was begun")
    if not written.future.done():
        return False
    if written.future.exception() is not None:
        _forget(runner, written.target)
        raise written.future.exception()
    return True
