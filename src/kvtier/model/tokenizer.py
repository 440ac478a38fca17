"""Tokenizer and chat template, from a GGUF file's metadata or a ``tokenizer.json``.

A GGUF carries no ``tokenizer.json``: it stores the vocabulary, the merges, the
token types and the special ids under llama.cpp's key names. For byte-level BPE
vocabularies (``tokenizer.ggml.model == "gpt2"``: SmolLM2, Llama 3, Qwen) this
module rebuilds the equivalent ``tokenizers`` pipeline, choosing the
pre-tokenizer from ``tokenizer.ggml.pre`` with llama.cpp's split patterns; for
SmolLM it is the pre-tokenizer of the model's own ``tokenizer.json`` (every numeric
character on its own), which transformers' GGUF import leaves out.

Example::

    >>> tok = Tokenizer.from_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")   # doctest: +SKIP
    >>> ids = tok.encode("Hello, world!")                               # doctest: +SKIP
    >>> tok.decode(ids)                                                 # doctest: +SKIP
    'Hello, world!'
    >>> tok.apply_chat_template([{"role": "user", "content": "Hi"}])    # doctest: +SKIP
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

try:
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # tokenizers < 0.21
    _DecodeStream = None

# llama.cpp's split patterns for the ``tokenizer.ggml.pre`` values we know.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: SmolLM's own tokenizer.json splits every numeric character off first (any Unicode number, "¼"
#: and "²" too, not only 0-9); transformers' GGUF import leaves that step out
_DIGITS = "digits"
# the split steps of each ``tokenizer.ggml.pre`` value: regex patterns, or _DIGITS
_PRE_SPLITS: dict[str, list[str]] = {
    "default": [_GPT2_SPLIT],
    "gpt2": [_GPT2_SPLIT],
    "smollm": [_DIGITS, _GPT2_SPLIT],
    "llama3": [_LLAMA3_SPLIT],
    "llama-v3": [_LLAMA3_SPLIT],
    "llama-bpe": [_LLAMA3_SPLIT],
    "smaug-bpe": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT],
    "deepseek-r1-qwen": [_QWEN2_SPLIT],
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): the character each byte is written as in a
    vocabulary, mapped back to the byte. Printable bytes stand for themselves; the others
    take the characters from U+0100 on, in byte order."""
    own = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in own]
    return {**{chr(b): b for b in own}, **{chr(256 + n): b for n, b in enumerate(moved)}}


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer of a GGUF's ``tokenizer.ggml.pre`` value (GPT-2's for unknown values):
    its split steps, then the byte-level mapping."""
    steps = [
        pre_tokenizers.Digits(individual_digits=True) if s == _DIGITS
        else pre_tokenizers.Split(Regex(s), behavior="isolated")
        for s in _PRE_SPLITS.get(pre, _PRE_SPLITS["default"])
    ]
    return pre_tokenizers.Sequence(steps + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


class NoChatTemplate(ValueError):
    """The tokenizer has no chat template to render messages with."""


class Tokenizer:
    """Text <-> token ids, special tokens, and the chat template.

    ``encode(text)`` returns ``list[int]``; ``add_bos`` defaults to what the
    model's source asks for. ``decode(ids)`` returns ``str``.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None,
        eos_token_ids: frozenset[int],
        add_bos: bool = False,
        chat_template: str | None = None,
        special_tokens: dict[str, str | None] | None = None,
    ):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = frozenset(eos_token_ids)
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self._template = None

    # -- text <-> ids --------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        """The smallest end-of-sequence id (the tokenizer's main one), or None."""
        return min(self.eos_token_ids) if self.eos_token_ids else None

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; special tokens written in the text map to their ids. The work
        runs without Python's interpreter lock (the backend's batch call releases it; its single
        call holds it), so other threads go on while a long text is tokenized."""
        if not isinstance(text, str):
            raise ValueError(f"encode() takes a str, got {type(text).__name__}")
        try:
            ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        except TypeError:  # the backend's word for a str that is not valid Unicode
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"the text holds {text[e.start]!r} at character {e.start}, a lone UTF-16 "
                                 "surrogate that is not valid Unicode; send the whole pair") from None
            raise
        add_bos = self.add_bos if add_bos is None else add_bos
        if add_bos:
            if self.bos_token_id is None:
                raise ValueError("add_bos=True but this tokenizer has no BOS token; pass add_bos=False")
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids, *, skip_special_tokens: bool = False, padded: bool = False) -> str:
        """Text of ``ids`` (a list of ints or a 1-D tensor); an id outside the vocabulary is a
        ``ValueError``, or with ``padded`` one past it has no text (a model's rows padded past
        its tokenizer's vocabulary)."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        size = self.vocab_size
        if padded:
            ids = [i for i in ids if not (isinstance(i, int) and i >= size)]
        bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside [0, {size})")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(i)

    @functools.cached_property
    def _pieces(self) -> tuple[frozenset[int], bool]:
        """The added (special) tokens' ids, and whether pieces are written in the byte-level
        alphabet: read once (the backend builds both anew on each call)."""
        return (frozenset(self.backend.get_added_tokens_decoder()),
                isinstance(self.backend.decoder, decoders.ByteLevel))

    def token_bytes(self, i: int, *, padded: bool = False) -> bytes:
        """The bytes token ``i`` stands for. A byte-level piece may hold part of a character
        (an emoji's first two bytes), which ``decode([i])`` can only show as U+FFFD: its
        bytes come from the vocabulary's byte alphabet, or from a ``<0xNN>`` byte-fallback
        piece; special tokens and other pieces give their text's UTF-8 (``▁`` as a space).
        ``padded``: an id past the vocabulary has none (as :meth:`decode`'s)."""
        piece = self.backend.id_to_token(i)
        if piece is None and padded and i >= 0:
            return b""
        if piece is None:
            raise ValueError(f"token id {i} is outside [0, {self.vocab_size})")
        added, byte_level = self._pieces
        if i not in added:
            alphabet = _byte_level_alphabet()
            if byte_level and all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            piece = piece.replace("\u2581", " ")
        return piece.encode("utf-8")

    def stream_decoder(self, *, skip_special_tokens: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    # -- chat ------------------------------------------------------------------------------------
    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the model's template.

        Renders like ``transformers``: a sandboxed jinja2 environment with
        ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception``, ``tojson`` and
        ``strftime_now``, and the special tokens (``bos_token``, ``eos_token``) in scope.
        """
        if self.chat_template is None:
            raise NoChatTemplate("this tokenizer has no chat template; pass raw text (--raw) instead")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of dicts like {'role': 'user', 'content': '...'}")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **{k: v for k, v in self.special_tokens.items() if v is not None},
            **extra,
        )

    def set_chat_template(self, source: str) -> None:
        """Render chats with ``source`` (Jinja, as a model's ``chat_template``) from now on; a
        ``ValueError`` (:func:`compile_chat_template`'s) leaves the template as it was."""
        self._template = compile_chat_template(source)
        self.chat_template = source

    # -- persistence -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild this tokenizer (the backend as its JSON string)."""
        return {
            "backend": self.backend.to_str(),
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": sorted(self.eos_token_ids),
            "add_bos": self.add_bos,
            "chat_template": self.chat_template,
            "special_tokens": self.special_tokens,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Tokenizer:
        return cls(
            Backend.from_str(d["backend"]),
            bos_token_id=d["bos_token_id"],
            eos_token_ids=frozenset(d["eos_token_ids"]),
            add_bos=d["add_bos"],
            chat_template=d["chat_template"],
            special_tokens=d["special_tokens"],
        )

    # -- sources ---------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, reader_or_path) -> Tokenizer:
        """Build from a GGUF file (a path or an open ``gguf.GGUFReader``).

        Supports byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``).
        """
        import gguf

        reader = reader_or_path
        if isinstance(reader_or_path, str | os.PathLike):
            reader = gguf.GGUFReader(os.fspath(reader_or_path))
        meta = _GGUFMeta(reader)
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2'); "
                "load the model from a Hugging Face folder with tokenizer.json instead"
            )
        tokens: list[str] = meta.get("tokenizer.ggml.tokens")
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        vocab = {t: i for i, t in enumerate(tokens)}
        backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre") or "default")
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False)
             for t, ty in zip(tokens, types) if ty == _CONTROL]
        )
        backend.add_tokens(
            [AddedToken(t, special=False, normalized=False)
             for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
        )
        ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "eot", "eom")}
        eos = frozenset(i for k in ("eos", "eot", "eom") if (i := ids[k]) is not None)
        special = {
            "bos_token": tokens[ids["bos"]] if ids["bos"] is not None else None,
            "eos_token": tokens[ids["eos"]] if ids["eos"] is not None else None,
        }
        return cls(
            backend,
            bos_token_id=ids["bos"],
            eos_token_ids=eos,
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
            special_tokens=special,
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Build from a Hugging Face folder: ``tokenizer.json`` plus ``tokenizer_config.json``,
        ``chat_template.jinja`` and ``generation_config.json`` where present."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"{tj} not found; a Hugging Face folder needs tokenizer.json")
        try:
            backend = Backend.from_file(str(tj))
        except Exception as e:  # the tokenizers library raises its own plain Exception
            raise ValueError(f"{tj} cannot be read as a tokenizer ({e}); download the model's "
                             "tokenizer.json again") from None
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        model_cfg = _read_json(path / "config.json")
        special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token")}
        bos_id = backend.token_to_id(special["bos_token"]) if special["bos_token"] else None
        if bos_id is None:
            bos_id = gen.get("bos_token_id", model_cfg.get("bos_token_id"))
        eos: set[int] = set()
        if special["eos_token"] and backend.token_to_id(special["eos_token"]) is not None:
            eos.add(backend.token_to_id(special["eos_token"]))
        for source in (gen, model_cfg):
            e = source.get("eos_token_id")
            eos.update(e if isinstance(e, list) else [] if e is None else [e])
        if bos_id is not None and special["bos_token"] is None:
            special["bos_token"] = backend.id_to_token(bos_id)
        if "add_bos_token" in cfg:
            add_bos = bool(cfg["add_bos_token"])
        else:  # ask the post-processor: does it put BOS in front?
            probe = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and bool(probe) and probe[0] == bos_id
        template = cfg.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            try:
                template = (path / "chat_template.jinja").read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path / 'chat_template.jinja'} is not UTF-8 text ({e}); download it "
                                 "again") from None
        if isinstance(template, list):  # named templates: take the default one
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        return cls(backend, bos_token_id=bos_id, eos_token_ids=frozenset(eos), add_bos=add_bos,
                   chat_template=template, special_tokens=special)


class StreamDecoder:
    """Incremental detokenizer: feed ids, get the new text, always whole UTF-8 characters.

    Byte-level tokens can split a character across ids; text that would end in
    an incomplete character is held back until the next id completes it.
    Decodes a short window of ids, so each step costs O(1), not O(length): in the
    tokenizers library's own ``DecodeStream`` where it has one (0.21 on; a few
    microseconds an id), else here, with the same windows and so the same text.

    Example::

        dec = tok.stream_decoder()
        for i in ids:
            print(dec.feed(i), end="")
        print(dec.flush())
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # ids[:_read] have been emitted as text
        self._stream = _DecodeStream(skip_special_tokens=skip_special_tokens) if _DecodeStream else None
        self._size = tokenizer.vocab_size  # (ids past it, a model's padded rows, have no text)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def feed(self, ids: int | list[int]) -> str:
        """Add one id or several; return the text they complete (possibly ``""``). An id past the
        tokenizer's vocabulary (a model's padded rows) has no text, as in ``decode(padded=True)``."""
        new = [i for i in ([ids] if isinstance(ids, int) else [int(i) for i in ids]) if 0 <= i < self._size]
        if self._stream is None:
            self.ids.extend(new)
            return self._step()
        out = []
        for i in new:
            self.ids.append(i)
            try:
                piece = self._stream.step(self.tokenizer.backend, i)
            except Exception:  # (a decoder whose windows do not extend each other: decode them here)
                self._stream = None
                piece = self._step() or None
            if piece is not None:
                out.append(piece)
                self._prefix, self._read = self._read, len(self.ids)
        return "".join(out)

    def _step(self) -> str:
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is held back (an incomplete character decodes to U+FFFD)."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        self._prefix, self._read = self._read, len(self.ids)
        self._stream = None  # (its window no longer matches: later ids are decoded here)
        return new_text[len(prefix_text) :]


# -- helpers ---------------------------------------------------------------------------------------
class _GGUFMeta:
    """Scalar and array metadata of a GGUFReader as Python values."""

    def __init__(self, reader):
        self.fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        f = self.fields.get(key)
        return default if f is None else f.contents()


def compile_chat_template(source: str):
    """``source`` compiled as chat templates are rendered; a ``ValueError`` naming the line of a
    syntax error, or for text that is empty."""
    import jinja2

    if not isinstance(source, str) or not source.strip():
        raise ValueError("a chat template must be non-empty Jinja text")
    try:
        return _compile_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: {e.message} (line {e.lineno})") from None


def _compile_template(source: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, ``{}`` where there is none; a ``ValueError`` naming a damaged one."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON text ({e}); download it again") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object; download it again")
    return data


def _token_text(tok: Any) -> str | None:
    if isinstance(tok, dict):  # serialised AddedToken
        return tok.get("content")
    return tok
