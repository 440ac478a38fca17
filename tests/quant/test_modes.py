"""kvtier.quant.modes: the codec vocabulary and the one parser of each spelling.

References: the grammar of the module docstring written out by hand, the codec
each mode builds (by its name), and the names :mod:`kvtier.config` re-exports.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvtier.quant import codec_for_mode
from kvtier.quant.modes import (
    FULL_PRECISION,
    KV_QUANT_MODES,
    TURBOQUANT_KEY_CODES,
    TURBOQUANT_VALUE_CODES,
    TurboQuantConfig,
    check_kv_quant,
    check_turboquant,
    is_full_precision,
    mode_name,
    parse_kv_quant,
    parse_mode,
    parse_turboquant,
)


@pytest.mark.parametrize(
    "name, kv_quant, tq",
    [
        ("off", None, None),
        (" FP ", None, None),
        ("Q4_G32", "q4_g32", None),
        ("turboquant", None, TurboQuantConfig()),
        ("turboquant:q8_0,q3_0", None, TurboQuantConfig("q8_0", "q3_0")),
        ("turboquant:q5_0r,q4_0", None, TurboQuantConfig("q5_0", "q4_0", rotate_keys=True)),
        ("TurboQuant:UINT2, q2_0", None, TurboQuantConfig("uint2", "q2_0")),
    ],
)
def test_mode_names(name, kv_quant, tq):
    assert parse_mode(name) == (kv_quant, tq)
    assert parse_mode(mode_name(kv_quant, tq)) == (kv_quant, tq)
    assert is_full_precision(name) == (kv_quant is None and tq is None)
    k, v = codec_for_mode(name, 128, torch.float16)
    if tq is not None:
        assert k.name == f"turboquant-key:{tq.key_quant}{'r' if tq.rotate_keys else ''}"
        assert v.name == f"turboquant-value:{tq.value_quant}"
    else:
        assert k.name == v.name == (kv_quant or "fp")


def test_full_precision_has_one_canonical_name():
    assert mode_name() == mode_name(None, None) == FULL_PRECISION == "off"
    assert [mode_name(m) for m in KV_QUANT_MODES] == list(KV_QUANT_MODES)


@given(
    key=st.sampled_from(TURBOQUANT_KEY_CODES),
    value=st.sampled_from(TURBOQUANT_VALUE_CODES),
    rotate=st.booleans(),
)
def test_every_turboquant_name_round_trips(key, value, rotate):
    tq = TurboQuantConfig(key, value, rotate_keys=rotate)
    name = mode_name(turboquant=tq)
    assert name == f"turboquant:{key}{'r' if rotate else ''},{value}"
    assert parse_mode(name) == (None, tq)
    assert parse_turboquant(name.split(":", 1)[1]) == tq


@pytest.mark.parametrize(
    "bad, word",
    [
        ("q3", "turboquant:KEY\\[r\\],VALUE"),
        ("turbo:q8_0,q3_0", "turboquant:KEY\\[r\\],VALUE"),
        ("", "turboquant:KEY\\[r\\],VALUE"),
        ("turboquant:", "KEY,VALUE"),
        ("turboquant:q8_0", "KEY,VALUE"),
        ("turboquant:q8_0,q3_0,q4_0", "KEY,VALUE"),
        ("turboquant:q3_0,q3_0", "key code 'q3_0'"),
        ("turboquant:q8_0,int4", "value code 'int4'"),
        ("turboquant:q8_0rr,q3_0", "key code 'q8_0rr'"),
    ],
)
def test_bad_mode_names(bad, word):
    with pytest.raises(ValueError, match=word) as e:
        parse_mode(bad)
    assert repr(bad) in str(e.value)


def test_parse_turboquant_is_the_flag_grammar():
    assert parse_turboquant("q8_0,q3_0") == TurboQuantConfig()
    assert parse_turboquant(" Q4_0R , q4_0 ") == TurboQuantConfig("q4_0", "q4_0", rotate_keys=True)
    for bad, word in (("q8_0", "KEY,VALUE"), (",q3_0", "KEY,VALUE"), ("q9_0,q3_0", "q9_0"),
                      (3, "str")):
        with pytest.raises(ValueError, match=word):
            parse_turboquant(bad)


def test_kv_quant_text_and_values():
    assert parse_kv_quant("off") is None and parse_kv_quant(" OFF ") is None
    assert [parse_kv_quant(m.upper()) for m in KV_QUANT_MODES] == list(KV_QUANT_MODES)
    assert check_kv_quant(None) is None and check_kv_quant("q4") == "q4"
    # "fp" is a mode name (kvtier eval --modes), not a kv_quant setting; "off" is text, not Python
    for bad in ("fp", "q2", "int8", ""):
        with pytest.raises(ValueError, match=f"kv_quant {bad!r} is unknown; accepted: q8, q4, q4_g32"):
            parse_kv_quant(bad)
    for bad in ("off", "Q8", 8, False):
        with pytest.raises(ValueError, match="None in Python"):
            check_kv_quant(bad)
    with pytest.raises(ValueError, match="str"):
        parse_kv_quant(None)


def test_turboquant_config_checks_its_fields():
    tq = TurboQuantConfig("int4", "q4_0", rotate_keys=True, seed=3)
    assert check_turboquant(tq) is tq and check_turboquant(None) is None
    for kwargs, word in (({"key_quant": "q3_0"}, "key code 'q3_0'"),
                         ({"value_quant": "int4"}, "value code 'int4'"),
                         ({"rotate_keys": 1}, "rotate_keys"),
                         ({"seed": 1.0}, "seed"),
                         ({"seed": True}, "seed")):
        with pytest.raises(ValueError, match=word):
            TurboQuantConfig(**kwargs)
    with pytest.raises(ValueError, match="parse_turboquant"):
        check_turboquant("q8_0,q3_0")


def test_config_reexports_the_same_names():
    import kvtier
    import kvtier.config as config
    import kvtier.quant as quant
    import kvtier.quant.modes as modes

    for name in ("KV_QUANT_MODES", "TURBOQUANT_KEY_CODES", "TURBOQUANT_VALUE_CODES",
                 "TurboQuantConfig"):
        assert getattr(config, name) is getattr(modes, name) is getattr(quant, name), name
    assert kvtier.TurboQuantConfig is modes.TurboQuantConfig
