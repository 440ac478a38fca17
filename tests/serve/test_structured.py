"""Structured outputs (kvtier.serve.structured): the masks against a brute-force reading of the
vocabulary, and the engine's answers against a reference loop that recomputes the whole
sequence each token and masks it with xgrammar's own matcher and kernel, synchronously and
under asynchronous scheduling, on the default model and on a random one (CUDA marked)."""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from tokenizers import AddedToken, decoders, models, pre_tokenizers  # noqa: E402
from tokenizers import Tokenizer as Backend  # noqa: E402

from kvtier.config import KVCacheConfig  # noqa: E402
from kvtier.model import ModelArgs, build_random  # noqa: E402
from kvtier.model.tokenizer import Tokenizer, _byte_level_alphabet  # noqa: E402
from kvtier.serve.engine import EngineConfig, LLMEngine  # noqa: E402
from kvtier.serve.params import RequestParams  # noqa: E402
from kvtier.serve.structured import (  # noqa: E402
    MAX_STRUCTURE_CHARS,
    Grammars,
    Structure,
    mask_rows,
    structural_tag,
)
from kvtier.serve.tools import FORMATS, tool_calls  # noqa: E402

CUDA = torch.cuda.is_available()
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "rank": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["city", "rank"], "additionalProperties": False}


def byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer of 256 one-byte tokens (id = the byte) and ``<eos>`` (256)."""
    backend = Backend(models.BPE(vocab=dict(_byte_level_alphabet()), merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<eos>", special=True)])
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=frozenset({256}))


def structured_greedy(model, tokenizer, ids: list[int], structure: Structure, stops: list[int],
                      max_tokens: int) -> list[int]:
    """The reference: each token the float64 argmax of the whole sequence's last logits among
    those xgrammar's own matcher allows (its bitmask applied by its own kernel), until a stop
    or ``max_tokens``; with ``structure.after``, the plain argmax until those bytes are written."""
    vocab = model.args.vocab_size
    seen, after = b"", structure.after.encode()
    grammars = Grammars(tokenizer, vocab)  # (the compiled grammar only; matching is xgrammar's)
    matcher = xgr.GrammarMatcher(grammars.compile(structure), override_stop_tokens=stops)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    out: list[int] = []
    device = model.tok_embeddings.weight.device
    with torch.inference_mode():
        while len(out) < max_tokens and not (out and out[-1] in stops):
            logits = model(torch.tensor([ids + out], device=device), model.make_caches(KVCacheConfig()))[0, -1]
            logits = logits.double().cpu()
            if after and after not in seen:
                out.append(int(logits.argmax()))
                seen += tokenizer.token_bytes(out[-1], padded=True)
                continue
            matcher.fill_next_token_bitmask(bitmask)
            allowed = torch.zeros(1, vocab)
            xgr.apply_token_bitmask_inplace(allowed, bitmask)
            logits[torch.isneginf(allowed[0])] = float("-inf")
            logits[tokenizer.vocab_size:] = float("-inf")  # (ids with no text: never in a grammar)
            out.append(int(logits.argmax()))
            assert matcher.accept_token(out[-1])
    return out


_REFERENCES: dict[tuple, list[int]] = {}


def reference(lm, ids: list[int], structure: Structure) -> list[int]:
    """:func:`structured_greedy` of the default model, once for both engines' tests."""
    key = (id(lm.model), tuple(ids), structure)
    if key not in _REFERENCES:
        _REFERENCES[key] = structured_greedy(lm.model, lm.tokenizer, ids, structure, [2], 48)
    return _REFERENCES[key]


# -- the masks --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,spec,message", [
    ("yaml", "x", "kind must be one of"),
    ("json", "{", "the schema is not JSON"),
    ("json", "[1]", "the schema must be a JSON object"),
    ("json_object", "{}", "takes no spec"),
    ("regex", "", "takes a spec"),
    ("regex", "a" * (MAX_STRUCTURE_CHARS + 1), "at most 65536"),
    ("structural_tag", "[1]", "structure structural_tag: the structural tag must be a JSON object"),
])
def test_a_structure_names_what_is_wrong(kind, spec, message) -> None:
    with pytest.raises(ValueError, match=message):
        Structure(kind, spec)


#: each keyword the grammars would ignore: a schema with it, an instance that breaks it, one that meets it
UNHELD_CASES = {
    "not": ({"not": {"type": "string"}}, '"a"', "1"),
    "if": ({"if": {"type": "string"}, "then": {"minLength": 3}}, '"a"', '"abc"'),
    "dependentRequired": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a": 1}', '{"a": 1, "b": 2}'),
    "dependencies": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "dependencies": {"a": ["b"]}}, '{"a": 1}', '{"a": 1, "b": 2}'),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, "[2]", "[1]"),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]", "[1, 2]"),
    "allOf": ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
              '{"a": 1}', '{"a": 1, "b": 2}'),
}


@pytest.mark.parametrize("keyword", sorted(UNHELD_CASES))
def test_keywords_the_grammar_would_ignore_are_refused(keyword) -> None:
    from xgrammar.testing import _is_grammar_accept_string as accepts

    schema, breaking, meeting = UNHELD_CASES[keyword]
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True)
    assert accepts(grammar, meeting) and accepts(grammar, breaking)  # why: xgrammar lets the answer break it
    with pytest.raises(ValueError, match=rf"structure json: the schema uses {keyword}\b.* at \$"):
        Structure("json", json.dumps(schema))
    nested = {"type": "object", "properties": {"not": schema}}  # under a property named as a keyword
    with pytest.raises(ValueError, match=rf"uses {keyword}\b.* at \$\.properties\.not"):
        Structure("json", json.dumps(nested))
    tag = {"structures": [{"begin": "<a>", "schema": schema, "end": "</a>"}], "triggers": ["<a>"]}
    with pytest.raises(ValueError, match=rf"structure structural_tag: the schema uses {keyword}\b"):
        structural_tag(tag)


def test_keywords_as_names_or_values_are_not_refused() -> None:
    for schema in ({"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}},
                   {"enum": [{"not": 1}, {"uniqueItems": True}]}, {"const": {"if": 2}},
                   {"type": "array", "uniqueItems": False}, {"allOf": [{"type": "integer"}]},
                   {"$defs": {"contains": {"type": "integer"}}, "$ref": "#/$defs/contains"}):
        Structure("json", json.dumps(schema))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_auto_tool_calls_hold_each_call_to_its_tool_and_leave_text_free(name) -> None:
    """tool_choice "auto": any text, and once a call's trigger is written, one of the tools by
    name with arguments its schema allows; one call at most without parallel calls."""
    fmt, tok = FORMATS[name], byte_tokenizer()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
             {"type": "function", "function": {"name": "get_time"}}]
    grammars = Grammars(tok, 257)

    def takes(text: str, parallel: bool = True) -> bool:
        m = grammars.matcher(tool_calls(tools, "auto", parallel, fmt).structure, [256])
        return all(m.take(b) for b in text.encode()) and m.take(256)

    good = fmt.write("get_weather", '{"city": "Oslo", "rank": 3}')
    assert takes("Free text: <b>{}</b> \"name\" ok") and takes(f"Checking. {good} and {fmt.write('get_time', '{}')}.")
    assert takes(good) and not takes(f"{good}{good}", parallel=False) and takes(f"{good}{good}")
    for bad in (fmt.write("get_wether", "{}"), fmt.write("get_weather", '{"city": "Oslo"}'),
                fmt.write("get_weather", '{"city": "Oslo", "rank": 100}'), fmt.trigger + " no call",
                good[:-1]):
        assert not takes(bad), bad
    # beside a response_format: JSON held to it, or calls alone (a line apart)
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for text, ok in (('{"ok": true}', True), (good, True), (f"{good}\n{good}", True), ('{"ok": 1}', False),
                     ("Free text", False), (f"Checking. {good}", False), ("", False), (f'{{"ok": true}}{good}', False)):
        m = grammars.matcher(tool_calls(tools, "auto", True, fmt, answer).structure, [256])
        assert (all(m.take(b) for b in text.encode()) and m.take(256)) is ok, text


def test_a_grammar_waits_for_the_reasoning_to_end() -> None:
    """A structure with ``after``: any text (the mask is not applied) until the awaited text is
    written, the end split over tokens included; then the grammar holds the answer."""
    tok = byte_tokenizer()
    grammars = Grammars(tok, 257)
    schema = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'

    def takes(text: str, after: str) -> tuple[bool, bool]:
        m = grammars.matcher(Structure("json", schema, after=after), [256])
        waited = []
        ok = True
        for b in text.encode():
            waited.append(m.waiting)
            ok = ok and m.take(b)
        return ok and m.take(256), any(waited)

    assert takes('{"n": 4}', "") == (True, False)
    assert takes('I think {"n": "x"} is wrong.</think>{"n": 4}', "</think>") == (True, True)
    assert takes('no end, {"n": 4}', "</think>")[0]  # (never ended: the answer stays free)
    assert not takes('fine</think>not json', "</think>")[0]
    assert not takes("fine</think>", "</think>")[0]  # (the end of the answer, with no JSON after it)
    m = grammars.matcher(Structure("json", schema, after="</think>"), [256])
    for b in b"a</think":
        m.take(b)
    assert m.waiting and m.take(ord(">")) and not m.waiting and not m.take(ord("x"))
    with pytest.raises(ValueError, match="after must be a string"):
        Structure("json", schema, after=None)


def test_vllms_structural_tags_are_triggered_tags() -> None:
    """vLLM's ``{"structures": [...], "triggers": [...]}``: free text, each trigger starting one
    of the structures, whose content its schema holds; xgrammar's ``{"format": ...}`` as given."""
    tok = byte_tokenizer()
    grammars = Grammars(tok, 257)
    tag = structural_tag({"structures": [{"begin": "<city>", "schema": SCHEMA, "end": "</city>"}],
                          "triggers": ["<city"]})

    def takes(text: str, s: Structure = tag) -> bool:
        m = grammars.matcher(s, [256])
        return all(m.take(b) for b in text.encode()) and m.take(256)

    good = '<city>{"city": "Oslo", "rank": 3}</city>'
    assert takes("free <b> text") and takes(f"Here: {good} and {good}.") and not takes("<city>Oslo</city>")
    assert not takes('<city>{"city": "Oslo", "rank": 300}</city>') and not takes(good[:-1])
    forced = structural_tag({"format": {"type": "tag", "begin": "<a>", "content": {"type": "json_schema",
                                                                                 "json_schema": SCHEMA}, "end": "</a>"}})
    assert takes('<a>{"city": "Oslo", "rank": 3}</a>', forced) and not takes("free", forced)
    for bad in ({}, {"structures": [], "triggers": ["<"]}, {"structures": [{"begin": "<a>", "end": "</a>"}],
                                                              "triggers": ["<"]},
                {"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": [""]}, [1]):
        with pytest.raises(ValueError, match="structural_tag"):
            structural_tag(bad)
    with pytest.raises(ValueError, match="structural tag does not compile: Invalid structural tag error: Format type "
                                         "not recognized: nope$"):
        grammars.compile(structural_tag({"format": {"type": "nope"}}))


def test_a_structure_goes_with_no_other_choice_of_tokens() -> None:
    s = Structure("regex", "[0-9]+")
    for other in ({"guided_choice": ((5,),)}, {"allowed_token_ids": (5,)}, {"bad_words": ((5,),)},
                  {"min_tokens": 1}):
        with pytest.raises(ValueError, match="structure chooses which tokens"):
            RequestParams(structure=s, **other)
    with pytest.raises(ValueError, match="structure must be a Structure"):
        RequestParams(structure="[0-9]+")


def test_masks_leave_exactly_the_tokens_a_pattern_allows(lm) -> None:
    """``[a-z<|>_]{1,12}``: at each step the tokens whose text is made of those characters and
    still fits (the special tokens, ``<|im_start|>`` among them, never: they are no text), and
    the stop id once a character is out; two rows masked at different places, a third left as
    it was."""
    tok = lm.tokenizer
    vocab = lm.model.args.vocab_size
    grammars = Grammars(tok, vocab)
    chars = set(b"abcdefghijklmnopqrstuvwxyz<|>_")
    special = {i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special}
    assert tok.encode("<|im_start|>", add_bos=False)[0] in special  # (a token made of those characters)
    pieces = [tok.token_bytes(i) for i in range(vocab)]
    structure = Structure("regex", "[a-z<|>_]{1,12}")
    rng = random.Random(0)
    matchers = [grammars.matcher(structure, [2]) for _ in range(2)]
    texts = [b"", b""]
    for step in range(6):
        out = torch.randn(3, vocab)
        free = out[1].clone()
        mask_rows(out, [0, 2], matchers)
        assert torch.equal(out[1], free)
        for row, text in ((0, texts[0]), (2, texts[1])):
            want = {i for i, p in enumerate(pieces) if p and set(p) <= chars and len(text) + len(p) <= 12
                    and i not in special}
            want |= {2} if text else set()
            got = set(torch.nonzero(~torch.isneginf(out[row]))[:, 0].tolist())
            assert got == want, (step, row, sorted(got ^ want)[:10])
        for j, m in enumerate(matchers):  # row 0 takes long pieces, row 2 one letter at a time
            options = [i for i, p in enumerate(pieces) if p and set(p) <= set(b"abc<|>")
                       and len(texts[j]) + len(p) <= 12 and i not in special]
            pick = max(options, key=lambda i: (len(pieces[i]), i)) if j == 0 and step < 2 else rng.choice(
                [i for i in options if len(pieces[i]) == 1])
            assert m.take(pick)
            texts[j] += pieces[pick]


@pytest.mark.parametrize("vocab", [257, 260, 300])
def test_ids_past_the_tokenizer_are_never_allowed(vocab) -> None:
    """A model's vocabulary past its tokenizer's (257 ids: 256 bytes and ``<eos>``), in the
    tokenizer's last word of the mask (260) and past it (300): those ids have no text, while the
    pattern allowing any text leaves every ASCII byte and ``<eos>`` (the stop)."""
    grammars = Grammars(byte_tokenizer(), vocab)
    out = torch.zeros(2, vocab)
    mask_rows(out, [1], [grammars.matcher(Structure("regex", "(.|\n)*"), [256])])
    assert not torch.isinf(out[0]).any()
    allowed = set(torch.nonzero(~torch.isneginf(out[1]))[:, 0].tolist())
    assert set(range(128)) | {256} <= allowed <= set(range(257))  # (ASCII; the stop; UTF-8's lead bytes)


def test_a_grammar_with_no_way_on_allows_its_stop_ids() -> None:
    """Where a row's grammar allows no token at all (none of xgrammar's grammars was found to, but
    a row of -inf would sample garbage, or fail a sampled step for every row), its stop ids are
    allowed: the answer ends there; the other rows keep their masks."""
    grammars = Grammars(byte_tokenizer(), 260)
    matchers = [grammars.matcher(Structure("regex", "[ab]+"), [256]), grammars.matcher(Structure("regex", "x"), [31])]
    grammars._xgr()
    fill = grammars._batch.batch_fill_next_token_bitmask

    def none_for_the_second(ms, bitmask, rows):
        fill(ms, bitmask, rows)
        bitmask[rows[1]] = 0

    grammars._batch = type("Batch", (), {"batch_fill_next_token_bitmask": staticmethod(none_for_the_second)})()
    out = torch.zeros(3, 260)
    mask_rows(out, [0, 2], matchers)
    assert set(torch.nonzero(~torch.isneginf(out[0]))[:, 0].tolist()) == {97, 98}
    assert set(torch.nonzero(~torch.isneginf(out[2]))[:, 0].tolist()) == {31}  # (bit 31: the word's sign)


# -- the engine -------------------------------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_structured_answers_are_the_reference_loops(lm, async_scheduling) -> None:
    """A JSON schema, a pattern and a grammar in one batch with a free row: each structured answer
    is the reference loop's tokens and holds to its structure; the free row is the plain answer."""
    from test_engine import chat

    tok = lm.tokenizer
    engine = LLMEngine(lm.model, tok, EngineConfig(num_blocks=64, async_scheduling=async_scheduling))
    asks = [(chat(tok, "Name a large city and its rank by size, as JSON."), Structure("json", json.dumps(SCHEMA))),
            (chat(tok, "Give me a phone number."), Structure("regex", r"\(\d{3}\) \d{3}-\d{4}")),
            (chat(tok, "Is the sky blue?"), Structure("grammar", 'root ::= "Yes, " [a-z ]{1,20} "." | "No."')),
            (chat(tok, "What is the capital of France?"), None)]
    params = [RequestParams(max_tokens=48, structure=s) for _, s in asks]
    outs = engine.generate([ids for ids, _ in asks], params)
    plain = engine.generate([asks[3][0]], RequestParams(max_tokens=48))[0]
    for (ids, s), o in zip(asks[:3], outs, strict=False):
        assert o.finish_reason == "stop" and o.token_ids[-1] == 2
        assert list(o.token_ids) == reference(lm, ids, s)
    city = json.loads(outs[0].text)
    assert set(city) == {"city", "rank"} and isinstance(city["rank"], int) and 0 <= city["rank"] <= 99
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", outs[1].text)
    assert re.fullmatch(r"Yes, [a-z ]{1,20}\.|No\.", outs[2].text)
    assert outs[3].token_ids == plain.token_ids
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_structured_refusals_queue_nothing(lm) -> None:
    tok = lm.tokenizer
    engine = LLMEngine(lm.model, tok, EngineConfig(num_blocks=16))
    ids = tok.encode("Hi", add_bos=False)
    for s, extra, message in ((Structure("regex", "[a-"), {}, "the regular expression does not compile"),
                              (Structure("json", '{"type": 3}'), {}, "the JSON schema does not compile"),
                              (Structure("grammar", "root ::= "), {}, "the grammar does not compile"),
                              (Structure("grammar", "root ::= root"), {}, "the grammar admits no answer"),
                              (Structure("json_object"), {"ignore_eos": True}, "give stop_token_ids")):
        with pytest.raises(ValueError, match=message):
            engine.add_request(ids, RequestParams(structure=s, **extra))
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        LLMEngine(lm.model, None, EngineConfig(num_blocks=16)).add_request(
            ids, RequestParams(structure=Structure("json_object")))
    out = engine.generate([ids], RequestParams(max_tokens=4, ignore_eos=True, stop_token_ids=(2,),
                                               structure=Structure("regex", "[0-9]{2}")))[0]
    assert re.fullmatch("[0-9]{2}", out.text) and out.token_ids[-1] == 2


_DEVICE_GRAPHS = [("cpu", False), pytest.param("cuda", True, marks=[pytest.mark.gpu, pytest.mark.skipif(
    not CUDA, reason="needs CUDA")]), pytest.param("cuda", False, marks=[pytest.mark.gpu, pytest.mark.skipif(
        not CUDA, reason="needs CUDA")])]


@pytest.mark.parametrize("device,graphs", _DEVICE_GRAPHS)
def test_random_model_structured_rows_under_asynchronous_scheduling(device, graphs) -> None:
    """A random model over a byte tokenizer (vocabulary 257, the model's 260: three ids with no
    text), rows of every kind arriving together and asynchronously scheduled (a structured row
    waits for the step in flight before its mask): the reference loop's tokens."""
    args = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=256, vocab_size=260,
                     max_position_embeddings=512)
    model = build_random(args, dtype=torch.float32, device=device, std=0.3)
    tok = byte_tokenizer()
    engine = LLMEngine(model, tok, EngineConfig(num_blocks=64, cuda_graph=graphs, async_scheduling=True))
    with pytest.raises(ValueError, match=r"stop_token_ids \[258\] are past them"):  # (an id with no text)
        engine.add_request([1, 2], RequestParams(ignore_eos=True, stop_token_ids=(258,),
                                                 structure=Structure("json_object")))
    rng = random.Random(3)
    structures = [Structure("json", json.dumps(SCHEMA)), Structure("regex", "[a-c]{2,6}(-[0-9])?"),
                  Structure("grammar", 'root ::= "yes" | "no" | "maybe " [xyz]+'), Structure("json_object"), None]
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 30))] for _ in range(10)]
    params = [RequestParams(max_tokens=24, structure=structures[i % 5]) for i in range(10)]
    outs = engine.generate(prompts, params)
    for ids, p, o in zip(prompts, params, outs, strict=True):
        if p.structure is not None:
            assert list(o.token_ids) == structured_greedy(model, tok, ids, p.structure, [256], 24)
    for o in outs[1::5] + outs[2::5]:  # (patterns that end within 24 tokens)
        assert o.finish_reason == "stop"
    assert all(re.fullmatch("[a-c]{2,6}(-[0-9])?", o.text) for o in outs[1::5])
    assert all(re.fullmatch("yes|no|maybe [xyz]+", o.text) for o in outs[2::5])
    # rows whose grammar waits for their answer's first three bytes (a reasoning model's end): free
    # until then, held after, under asynchronous scheduling
    firsts = [f.token_ids for f in engine.generate(prompts, RequestParams(max_tokens=3))]
    heads = [next((f[:k] for k in (3, 2, 1) if max(f[:k]) < 128), ()) for f in firsts]  # (ASCII to wait for)
    rows = [i for i, h in enumerate(heads) if h and structures[i % 5] is not None]
    waits = [RequestParams(max_tokens=24, structure=replace(structures[i % 5], after=bytes(heads[i]).decode()))
             for i in rows]
    assert len(waits) >= 3, firsts
    got = engine.generate([prompts[i] for i in rows], waits)
    for i, p, o in zip(rows, waits, got, strict=True):
        assert list(o.token_ids) == structured_greedy(model, tok, prompts[i], p.structure, [256], 24)
        assert o.token_ids[:len(heads[i])] == heads[i] and o.token_ids != outs[i].token_ids


def test_warm_up_builds_the_grammars_tables() -> None:
    """A warm-up with a tokenizer runs one answer held to a pattern, so the first structured
    request does not build the vocabulary's tables; the engine is left as a fresh one."""
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=260,
                     max_position_embeddings=512)
    model = build_random(args, dtype=torch.float32, device="cpu", std=0.2)
    config = EngineConfig(num_blocks=48, block_size=16, max_num_seqs=4, max_batched_tokens=64)
    warm, fresh = LLMEngine(model, byte_tokenizer(), config), LLMEngine(model, byte_tokenizer(), config)
    compiled = []
    compile_ = warm.grammars.compile
    warm.grammars.compile = lambda s: compiled.append(s) or compile_(s)
    assert warm.grammars._compiler is None
    warm.warm_up()
    assert compiled == [Structure("regex", "[^<]*")] and warm.grammars._compiler is not None
    assert warm.stats() == fresh.stats() and not warm.has_unfinished()
