"""The tokenizer rebuilt from GGUF metadata against transformers' tokenizer for the same file."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvtier.model.loading import default_model_path
from kvtier.model.tokenizer import StreamDecoder, Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; pi is 3.14159.",
    "naïve café — Ünïcödé, 日本語のテキスト, 한국어, emoji 🙂👍🏽 and 🇫🇷",
    "  leading spaces\n\n\ttabs and trailing   ",
    "def f(x):\n    return x ** 2  # comment\n",
    "I'm sure they'll say we've done it, don't you? IT'S FINE",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
    "a<|endoftext|>b <repo_name> c",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 🙂"},
     {"role": "user", "content": "Tell me a joke."}],
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture(scope="module")
def theirs():
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# The pre-tokenizer of SmolLM2's own tokenizer.json: every numeric character on its own, then
# GPT-2's split. transformers' GGUF import keeps only the byte-level step, so it agrees with the
# model's tokenizer on ASCII digits (the vocabulary merges none) but not on a space before "¼".
SMOLLM2_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}


@pytest.fixture(scope="module")
def published(theirs):
    """transformers' tokenizer for the GGUF with the pre-tokenizer SmolLM2 publishes."""
    from tokenizers import Tokenizer as Backend

    spec = json.loads(theirs.backend_tokenizer.to_str())
    spec["pre_tokenizer"] = SMOLLM2_PRE_TOKENIZER
    return Backend.from_str(json.dumps(spec))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours, theirs, text):
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)


def test_special_ids_match_transformers(ours, theirs):
    assert ours.vocab_size == len(theirs) == 49152
    assert ours.bos_token_id == theirs.bos_token_id == 1
    assert theirs.eos_token_id in ours.eos_token_ids and ours.eos_token_id == 2
    assert not ours.add_bos
    assert ours.encode("Hi", add_bos=True) == [1, *ours.encode("Hi")]


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, theirs, messages, add_generation_prompt):
    got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    want = theirs.apply_chat_template(messages, tokenize=False,
                                      add_generation_prompt=add_generation_prompt)
    assert got == want
    assert ours.encode(got) == theirs.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False)


def test_from_pretrained_dir_matches_transformers(theirs, tmp_path):
    theirs.save_pretrained(tmp_path)
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    for text in TEXTS:
        assert tok.encode(text) == theirs.encode(text, add_special_tokens=False)
    assert tok.bos_token_id == 1 and 2 in tok.eos_token_ids
    assert tok.apply_chat_template(CHATS[1]) == theirs.apply_chat_template(
        CHATS[1], tokenize=False, add_generation_prompt=True)


def test_round_trip_through_to_dict(ours):
    again = Tokenizer.from_dict(ours.to_dict())
    for text in TEXTS:
        assert again.encode(text) == ours.encode(text)
    assert again.apply_chat_template(CHATS[0]) == ours.apply_chat_template(CHATS[0])
    assert (again.bos_token_id, again.eos_token_ids) == (ours.bos_token_id, ours.eos_token_ids)


@pytest.mark.parametrize("text", [" ¼", "x ½ y", " ²3", " ٣٤", " ①", " Ⅻ", "in 2024"])
def test_numerals_split_as_the_models_own_tokenizer(ours, published, text):
    ids = ours.encode(text)
    assert ids == published.encode(text, add_special_tokens=False).ids
    assert ours.decode(ids) == text


def test_a_space_before_a_fraction_is_its_own_token(ours):
    space, quarter = ours.encode(" "), ours.encode("¼")
    assert ours.encode(" ¼") == space + quarter == [216, 28151]


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
@example(" ¼")
def test_any_text_matches_transformers_and_round_trips(ours, published, text):
    ids = ours.encode(text)
    assert ids == published.encode(text, add_special_tokens=False).ids
    # SmolLM2's vocabulary lacks 21 byte tokens (0x04, 0x1D, 0xF1, 0xF5-0xFF, ...): text
    # holding those bytes cannot come back, in transformers either
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab, spelling = ours.backend.get_vocab(), bytes_to_unicode()
    if all(spelling[b] in vocab for b in text.encode("utf-8")):
        assert ours.decode(ids) == text


# -- streaming --------------------------------------------------------------------------------------
def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    dec = StreamDecoder(tok)
    return [dec.feed(i) for i in ids] + [dec.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decoder_yields_whole_characters_that_add_up(ours, text):
    ids = ours.encode(text)
    deltas = stream(ours, ids)
    assert "".join(deltas) == ours.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_stream_decoder_holds_back_a_split_character(ours):
    ids = ours.encode("🙂")
    assert len(ids) > 1  # the emoji's four bytes span several tokens
    deltas = stream(ours, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1) and deltas[-2] == "🙂" and deltas[-1] == ""
    dec = ours.stream_decoder()
    assert dec.feed(ids[:1]) == "" and dec.flush() == "\ufffd"  # cut short: the replacement char


@settings(max_examples=40, deadline=None)
@given(st.text(max_size=30))
def test_stream_decoder_equals_decode(ours, text):
    ids = ours.encode(text)
    assert "".join(stream(ours, ids)) == ours.decode(ids)


@pytest.mark.parametrize("skip", [False, True])
def test_stream_decoder_gives_the_same_pieces_with_or_without_the_librarys_stream(ours, monkeypatch, skip):
    """The tokenizers library's ``DecodeStream`` (where it has one) and the windows decoded here
    give the same piece for every id, random ids included (split characters, special tokens)."""
    import random

    from kvtier.model import tokenizer as module

    rng = random.Random(0)
    ids = ours.encode("Émoji 🙂 and text — <|im_end|> done.") + [rng.randrange(ours.vocab_size) for _ in range(600)]

    def pieces():
        dec = StreamDecoder(ours, skip_special_tokens=skip)
        return [dec.feed(i) for i in ids] + [dec.flush()]

    fast = pieces()
    monkeypatch.setattr(module, "_DecodeStream", None)
    assert StreamDecoder(ours)._stream is None and pieces() == fast
    assert "".join(fast) == ours.decode(ids, skip_special_tokens=skip)


def test_stream_decoder_accepts_several_ids_and_tensors(ours):
    ids = ours.encode("Paris is the capital of France.")
    dec = ours.stream_decoder()
    out = dec.feed(ids[:3]) + dec.feed(ids[3:]) + dec.flush()
    assert out == "Paris is the capital of France."
    assert ours.decode(torch.tensor(ids)) == out


# -- errors -------------------------------------------------------------------------------------------
def test_bad_input_is_named(ours, tmp_path):
    with pytest.raises(ValueError, match="takes a str"):
        ours.encode(b"bytes")
    with pytest.raises(ValueError, match="outside"):
        ours.decode([0, 49152])
    with pytest.raises(ValueError, match="list of dicts"):
        ours.apply_chat_template("hello")
    bare = Tokenizer(ours.backend, bos_token_id=None, eos_token_ids=frozenset())
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(CHATS[0])
    with pytest.raises(ValueError, match="no BOS"):
        bare.encode("x", add_bos=True)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained_dir(tmp_path)


def test_a_lone_surrogate_is_a_value_error_naming_it(ours):
    with pytest.raises(ValueError, match=r"holds '\\ud800' at character 2, a lone UTF-16 surrogate"):
        ours.encode("ab\ud800c")


def test_a_set_chat_template_renders_and_a_broken_one_changes_nothing(ours):
    from kvtier.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dict(ours.to_dict())
    before = tok.chat_template
    with pytest.raises(ValueError, match=r"does not parse: .* \(line 2\)"):
        tok.set_chat_template("fine\n{% for %}")
    assert tok.chat_template == before
    tok.set_chat_template("{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi"
