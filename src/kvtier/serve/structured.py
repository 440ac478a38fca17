"""Structured outputs: answers held, token by token, to a JSON schema, to any JSON object, to a
regular expression or to a grammar (EBNF, as GBNF writes it), through xgrammar's grammar
compiler and matchers.

A request names its constraint as a :class:`Structure` (plain text: the schema's JSON, the
pattern, the grammar). The engine's :class:`Grammars` compiles it once per distinct text
(xgrammar keeps the compiled grammars) into a :class:`Matcher` for the request, which the
engine feeds each token the request is given. At each step every structured row's allowed
tokens are filled into one bitmask on the host (all rows in one call, several threads),
copied to the logits' device, and everything outside them is set to ``-inf``; the stop ids are
allowed once the text is complete, so the answer ends there.

Example::

    >>> grammars = Grammars(tokenizer, vocab_size=49152)             # doctest: +SKIP
    >>> m = grammars.matcher(Structure("regex", "[0-9]{3}"), stop_ids=[2])  # doctest: +SKIP
    >>> mask_rows(logits, [0], [m])   # row 0: only digits are left      # doctest: +SKIP

A matcher needs the tokens in order: under asynchronous scheduling the engine waits for the
step in flight before it masks the next one's structured rows (see
:meth:`kvtier.serve.engine.LLMEngine.step`).
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.caches.paged_shared import to_device

__all__ = ["KINDS", "MAX_STRUCTURE_CHARS", "Grammars", "Matcher", "Structure", "mask_rows", "named", "structural_tag"]

#: what a :class:`Structure` may hold: a JSON schema, any JSON object, a regular expression, a
#: grammar, or xgrammar's structural tag (free text with held parts: tool calls)
KINDS = ("json", "json_object", "regex", "grammar", "structural_tag")

#: characters of a schema, pattern or grammar at most
MAX_STRUCTURE_CHARS = 65536

# what each kind is called in a message
_WHAT = {"json": "JSON schema", "json_object": "JSON object", "regex": "regular expression", "grammar": "grammar",
         "structural_tag": "structural tag"}

# xgrammar prefixes its errors with a time and a source position: "[06:41:55] /project/cpp/x.cc:94: ",
# some with the check that failed
_WHERE = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass(frozen=True)
class Structure:
    """One request's constraint: ``kind`` one of :data:`KINDS`; ``spec`` the JSON schema as JSON
    text (``"json"``), the pattern (``"regex"``), the grammar, whose rule ``root`` is the
    answer (``"grammar"``), or xgrammar's structural tag as JSON text (``"structural_tag"``);
    empty for ``"json_object"``. ``after``: the grammar holds the answer from the end of this
    text on (a reasoning model's ``</think>``, :mod:`kvtier.serve.reasoning`); empty: from its
    start."""

    kind: str
    spec: str = ""
    after: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structure kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"structure spec must be a string, got {type(self.spec).__name__}")
        if (self.kind == "json_object") != (not self.spec):
            raise ValueError(f"structure {self.kind!r} takes {'no' if self.kind == 'json_object' else 'a'} spec")
        if not isinstance(self.after, str):
            raise ValueError(f"structure after must be a string, got {type(self.after).__name__}")
        if len(self.spec) > MAX_STRUCTURE_CHARS:
            raise ValueError(f"structure holds {len(self.spec)} characters; at most {MAX_STRUCTURE_CHARS} "
                             "are accepted")
        if self.kind in ("json", "structural_tag"):
            what = "schema" if self.kind == "json" else "structural tag"
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"structure {self.kind}: the {what} is not JSON: {e}") from None
            if not isinstance(schema, dict | bool) or (self.kind == "structural_tag" and not isinstance(schema, dict)):
                raise ValueError(f"structure {self.kind}: the {what} must be a JSON object, got {type(schema).__name__}")
            unheld = next(unheld_keywords(schema, "$", self.kind == "structural_tag"), None)
            if unheld is not None:
                raise ValueError(f"structure {self.kind}: the schema uses {unheld}, which the grammar would ignore "
                                 f"and an answer could break ({', '.join(UNHELD)} and allOf of several schemas are "
                                 "refused): drop it and check the answer yourself")


#: JSON-schema keywords xgrammar's grammars ignore (an answer would break them unseen): refused
UNHELD = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "contains",
          "minContains", "maxContains", "uniqueItems")
_NAMES = ("properties", "patternProperties", "$defs", "definitions")  # maps of names to schemas
_DATA = ("enum", "const", "default", "examples")  # values, not schemas


def unheld_keywords(node, path: str, tagged: bool = False):
    """Where schema ``node`` (at ``path``) uses a keyword of :data:`UNHELD` or an ``allOf`` of
    several schemas, as ``"<keyword> at <path>"``; ``tagged``: ``node`` is a structural tag, whose
    schemas are the values of its ``json_schema`` keys."""
    if isinstance(node, list):
        for i, sub in enumerate(node):
            yield from unheld_keywords(sub, f"{path}[{i}]", tagged)
        return
    if not isinstance(node, dict):
        return
    if tagged:
        for k, v in node.items():
            yield from unheld_keywords(v, f"{path}.{k}", k != "json_schema")
        return
    for k, v in node.items():
        if k in UNHELD and not (k == "uniqueItems" and v is False):
            yield f"{k} at {path}"
        elif k == "allOf" and isinstance(v, list) and len(v) > 1:
            yield f"allOf of {len(v)} schemas at {path}"
        if k in _NAMES and isinstance(v, dict):
            for name, sub in v.items():
                yield from unheld_keywords(sub, f"{path}.{k}.{name}")
        elif k not in _DATA:
            yield from unheld_keywords(v, f"{path}.{k}")


def structural_tag(given: dict) -> Structure:
    """A structural tag as requests give one: xgrammar's (``{"format": {...}}``) or vLLM's older
    form (``{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}``: free text in
    which each trigger starts one of the structures, its content held to its JSON schema)."""
    if not isinstance(given, dict):
        raise ValueError(f"structure structural_tag must be a JSON object, got {type(given).__name__}")
    if "format" in given:
        return Structure("structural_tag", json.dumps({"type": "structural_tag", "format": given["format"]}))
    structures, triggers = given.get("structures"), given.get("triggers")
    if not (isinstance(structures, list) and structures and isinstance(triggers, list) and triggers
            and all(isinstance(t, str) and t for t in triggers)
            and all(isinstance(x, dict) and isinstance(x.get("begin"), str) and isinstance(x.get("end"), str)
                    and isinstance(x.get("schema"), dict | bool) for x in structures)):
        raise ValueError("structure structural_tag needs format (xgrammar's structural tag) or structures "
                         "([{\"begin\", \"schema\", \"end\"}, ...]) and triggers (non-empty strings)")
    tags = [{"type": "tag", "begin": x["begin"], "content": {"type": "json_schema", "json_schema": x["schema"]},
             "end": x["end"]} for x in structures]
    return Structure("structural_tag", json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": triggers, "tags": tags}}))


def named(message: str, field: str) -> str:
    """A message about a request's structure (``structure regex: ...``, ``structure chooses ...``)
    naming instead the request field that gave it (``guided_regex: ...``)."""
    return re.sub(r"^structure\b(?: (?:json|json_object|regex|grammar|structural_tag)(?=:))?", field, message)


class Matcher:
    """One request's place in its grammar: :meth:`take` each token it is given, in order."""

    def __init__(self, matcher, grammars: Grammars, stops: Sequence[int], after: bytes = b"") -> None:
        self._m, self.grammars, self.stops = matcher, grammars, tuple(stops)
        self._after, self._seen = after, b""  # the text awaited before the grammar applies; its start seen

    def take(self, token: int) -> bool:
        """Advance past ``token``; False where the grammar had ended (a row sampled once more
        under asynchronous scheduling, whose token the engine drops) or refuses it. While
        :attr:`waiting`, every token is taken, and the grammar applies from the token after the
        one that completes the awaited text."""
        if self._after:
            self._seen += self.grammars.tokenizer.token_bytes(token, padded=True)
            if self._after in self._seen:
                self._after = b""
            self._seen = self._seen[max(0, len(self._seen) - len(self._after) + 1):] if self._after else b""
            return True
        return not self._m.is_terminated() and self._m.accept_token(token)

    @property
    def waiting(self) -> bool:
        """Whether the grammar waits for its ``after`` text (the answer is free until then)."""
        return bool(self._after)

    @property
    def ended(self) -> bool:
        """Whether a stop id has been taken: nothing more is allowed."""
        return self._m.is_terminated()


class Grammars:
    """One engine's grammar compiler over its tokenizer's vocabulary (built with the first grammar:
    about 1.6 s for SmolLM2's 49,152 tokens on 2 CPU cores) and its bitmask filler. Thread-safe: the server compiles
    in a worker thread before it queues the request, so the engine's own compile finds it made.
    """

    def __init__(self, tokenizer, vocab_size: int, *, threads: int | None = None) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.threads = threads or min(4, os.cpu_count() or 1)
        self._lock = threading.Lock()
        self._compiler = None
        self._batch = None

    def _xgr(self):
        try:
            import xgrammar as xgr
        except ImportError:
            raise ValueError("structured outputs need the xgrammar package: pip install 'kvtier[serve]' "
                             "(or pip install xgrammar)") from None
        with self._lock:
            if self._compiler is None:
                tok = self.tokenizer
                special = {i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special}
                # special tokens as empty text: xgrammar never allows them inside the answer
                vocab = [b"" if i in special else tok.token_bytes(i) for i in range(tok.vocab_size)]
                # (the tokenizer's own size: the model's ids past it have no text, and xgrammar fills
                # a mask a hundred times slower with tens of thousands of them; fill() bans them)
                info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=tok.vocab_size,
                                         stop_token_ids=sorted(tok.eos_token_ids) or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads)
                self._batch = xgr.BatchGrammarMatcher(max_threads=self.threads)
        return xgr

    def compile(self, structure: Structure):
        """The compiled grammar of ``structure`` (made once; later calls find it);
        ``ValueError`` naming what is wrong with the schema, pattern or grammar."""
        self._xgr()
        c = self._compiler
        try:
            if structure.kind == "json":
                return c.compile_json_schema(structure.spec)
            if structure.kind == "json_object":
                return c.compile_json_schema('{"type": "object"}')
            if structure.kind == "regex":
                return c.compile_regex(structure.spec)
            if structure.kind == "structural_tag":
                return c.compile_structural_tag(structure.spec)
            return c.compile_grammar(structure.spec)
        except (RuntimeError, ValueError) as e:  # xgrammar's parse errors
            raise ValueError(f"structure {structure.kind}: the {_WHAT[structure.kind]} does not compile: "
                             f"{_WHERE.sub('', str(e)).strip()}") from None

    def matcher(self, structure: Structure, stop_ids: Sequence[int]) -> Matcher:
        """A fresh :class:`Matcher` for one request, whose answer ends with one of ``stop_ids``."""
        if not stop_ids:
            raise ValueError("structured outputs end the answer with a stop id, and this request has none "
                             "(ignore_eos without stop_token_ids, or a model without an end-of-sequence id); "
                             "give stop_token_ids")
        beyond = sorted(t for t in stop_ids if t >= self.tokenizer.vocab_size)
        if beyond:
            raise ValueError(f"structured outputs end with one of the tokenizer's {self.tokenizer.vocab_size} tokens; "
                             f"stop_token_ids {beyond[:5]} are past them: give ids of the tokenizer")
        xgr = self._xgr()
        compiled = self.compile(structure)
        m = Matcher(xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_ids)), self, sorted(stop_ids),
                    structure.after.encode())
        first = xgr.allocate_token_bitmask(1, self.tokenizer.vocab_size)
        m._m.fill_next_token_bitmask(first)
        if not first.any():  # (such as "root ::= root", or a schema no value meets)
            raise ValueError(f"structure {structure.kind}: the {_WHAT[structure.kind]} admits no answer: no token "
                             "can begin one")
        return m

    def fill(self, matchers: Sequence[Matcher], rows: Sequence[int], n: int) -> torch.Tensor:
        """The allowed tokens of ``matchers[j]`` in row ``rows[j]`` of a bitmask ``[n, ceil(V / 32)]``
        (int32, bit ``t % 32`` of word ``t // 32`` set where token ``t`` is allowed; the other rows
        are not to be applied), on the host."""
        xgr = self._xgr()
        text = self.tokenizer.vocab_size
        bitmask = xgr.allocate_token_bitmask(n, text)
        self._batch.batch_fill_next_token_bitmask([m._m for m in matchers], bitmask, list(rows))
        width = (self.vocab_size + 31) // 32
        if width > bitmask.shape[1]:  # the model's ids past the tokenizer's: banned
            bitmask = torch.cat([bitmask, torch.zeros(n, width - bitmask.shape[1], dtype=torch.int32)], dim=1)
        if text % 32:  # (and those in the tokenizer's last word)
            bitmask[:, text // 32] &= (1 << text % 32) - 1
        live = bitmask.numpy().any(axis=1)  # (numpy's stops at a row's first allowed word: 0.2 ms for 256 rows)
        for j, m in zip(rows, matchers, strict=True):
            if not live[j]:  # a grammar with no way on: the answer ends here (a row of -inf samples nothing)
                for t in m.stops:
                    bitmask[j, t // 32] |= 1 << t % 32 if t % 32 < 31 else -(1 << 31)  # (int32's sign bit)
        return bitmask


def mask_rows(out: torch.Tensor, rows: Sequence[int], matchers: Sequence[Matcher]) -> None:
    """``-inf`` in rows ``rows`` of ``out`` ``[n, V]`` (float32, in place) at every token that
    ``matchers`` (one a row, those of one :class:`Grammars`) do not allow: xgrammar's kernel
    (C++ on the CPU, Triton on CUDA)."""
    import xgrammar as xgr

    bitmask = matchers[0].grammars.fill(matchers, rows, out.shape[0])
    # (through pinned memory: a copy from pageable memory would wait for the forward in flight)
    index = to_device(torch.tensor(list(rows), dtype=torch.int32), out.device)
    xgr.apply_token_bitmask_inplace(out, to_device(bitmask, out.device), indices=index)
