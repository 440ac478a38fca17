"""Text in for the command line: a prompt as an argument or from stdin, and text files,
checked to be UTF-8 text (not binary data) and read within bounds."""

from __future__ import annotations

import io
import sys


def decode_text(data: bytes, where: str) -> str:
    """``data`` as UTF-8 text, or a ``ValueError`` naming ``where`` and the first bad byte's
    offset (an invalid UTF-8 sequence, or a NUL: binary data, not text)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not UTF-8 text: byte {e.start} is "
                         f"{data[e.start:e.start + 1].hex(' ')} (hex); convert it to UTF-8 first, "
                         "e.g. iconv -f LATIN1 -t UTF-8") from None
    nul = data.find(b"\0")
    if nul >= 0:
        raise ValueError(f"{where} holds a NUL byte at byte {nul}: it is binary data, not text; "
                         "pass text")
    return text


def argument_text(text: str, where: str) -> str:
    """A ``str`` from argv or a text stream, whose undecodable bytes Python kept as
    surrogate escapes, checked as the bytes it came from."""
    try:
        data = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where} holds a lone surrogate at character {e.start}; pass UTF-8 "
                         "text") from None
    return decode_text(data, where)


#: the most bytes of prompt read from stdin (no model's context holds more text)
STDIN_LIMIT = 64 * 2**20


def read_bytes(stream) -> bytes:
    """``stream``'s bytes, read a MiB at a time, stopping at binary data (a NUL) or past
    :data:`STDIN_LIMIT`: ``/dev/zero`` or an endless pipe must not fill the memory."""
    parts, size = [], 0
    while chunk := stream.read(2**20):
        nul = chunk.find(b"\0")
        if nul >= 0:  # binary: the first fault up to the NUL (a byte not UTF-8 before it, else the NUL)
            decode_text(b"".join(parts) + chunk[: nul + 1], "the prompt read from stdin")
        size += len(chunk)
        if size > STDIN_LIMIT:
            raise ValueError(f"the prompt read from stdin passes {STDIN_LIMIT // 2**20} MiB, more text than a "
                             "model's context holds; pass a shorter text (or a file: head -c ...)")
        parts.append(chunk)
    return b"".join(parts)


def read_stdin() -> str:
    if sys.stdin is None or sys.stdin.isatty():
        raise ValueError("no prompt: give one as an argument or pipe it to stdin")
    if isinstance(sys.stdin, io.TextIOWrapper):  # read the bytes: the text layer may not be UTF-8
        text = decode_text(read_bytes(sys.stdin.buffer), "the prompt read from stdin")
    else:
        text = argument_text(sys.stdin.read(), "the prompt read from stdin")
    text = text.removeprefix("\ufeff")  # a byte-order mark is no part of the prompt
    if not text.strip():
        raise ValueError("the prompt read from stdin is empty")
    return text
