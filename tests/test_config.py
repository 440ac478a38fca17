"""KVCacheConfig from the environment (and MTPLX aliases), make_caches, configure_kv_cache."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from kvtier.caches.block_owned import BlockOwnedKVCache
from kvtier.caches.tail_owned import TailOwnedKVCache
from kvtier.config import (
    ENV_VARS,
    KV_QUANT_MODES,
    MAX_TOKENS,
    KVCacheConfig,
    KVCacheTooLarge,
    TurboQuantConfig,
    configure_kv_cache,
    env_settings,
    make_caches,
    user_cache_dir,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No KVTIER_*/MTPLX_* variable of the outer environment leaks into a test."""
    for name in list(os.environ):
        if name.startswith(("KVTIER_", "MTPLX_")):
            monkeypatch.delenv(name)


# (KVTIER name, MTPLX alias, value, field, expected), one row per variable of docs/tiers.md
VARIABLES = [
    ("KVTIER_PAGED_ATTN", "MTPLX_VLLM_METAL_PAGED_ATTN", "1", "tier", "paged"),
    ("KVTIER_OWNED_ATTN_KV", "MTPLX_OWNED_ATTN_KV", "block", "tier", "block"),
    ("KVTIER_OWNED_ATTN_KV", "MTPLX_OWNED_ATTN_KV", "block_owned", "tier", "block"),
    ("KVTIER_OWNED_ATTN_KV", "MTPLX_OWNED_ATTN_KV", "ragged", "tier", "ragged"),
    ("KVTIER_OWNED_ATTN_KV", "MTPLX_OWNED_ATTN_KV", "TRUE", "tier", "tail"),
    ("KVTIER_OWNED_ATTN_KV", "MTPLX_OWNED_ATTN_KV", "off", "enabled", False),
    ("KVTIER_OWNED_ATTN_KV_STEP", "MTPLX_OWNED_ATTN_KV_STEP", "64", "step", 64),
    ("KVTIER_OWNED_ATTN_KV_BLOCK_SIZE", "MTPLX_OWNED_ATTN_KV_BLOCK_SIZE", "512", "owned_block_size", 512),
    ("KVTIER_PAGED_BLOCK_SIZE", "MTPLX_VLLM_METAL_PAGED_BLOCK_SIZE", "32", "paged_block_size", 32),
    ("KVTIER_PAGED_NUM_BLOCKS", "MTPLX_VLLM_METAL_PAGED_NUM_BLOCKS", "2048", "paged_num_blocks", 2048),
    ("KVTIER_DYNAMIC_PAGED_KV", "MTPLX_DYNAMIC_PAGED_KV", "yes", "dynamic_paged", True),
    ("KVTIER_DYNAMIC_PAGED_KV_TOKENS", "MTPLX_DYNAMIC_PAGED_KV_TOKENS", "4096", "dynamic_paged_tokens", 4096),
    ("KVTIER_DYNAMIC_PAGED_KV_MIN_BLOCKS", "MTPLX_DYNAMIC_PAGED_KV_MIN_BLOCKS", "8", "dynamic_paged_min_blocks", 8),
    ("KVTIER_DYNAMIC_PAGED_KV_MARGIN", "MTPLX_DYNAMIC_PAGED_KV_MARGIN", "0", "dynamic_paged_margin", 0),
    ("KVTIER_DYNAMIC_PAGED_KV_PREVIOUS_HIGH_WATER", "MTPLX_DYNAMIC_PAGED_KV_PREVIOUS_HIGH_WATER", "900", "previous_high_water", 900),
    ("KVTIER_CONTEXT_WINDOW_TOKENS", "MTPLX_CONTEXT_WINDOW_TOKENS", "8192", "context_window_tokens", 8192),
    ("KVTIER_PAGED_KV_QUANT", "MTPLX_VLLM_METAL_PAGED_KV_QUANT", "q8", "kv_quant", "q8"),
    ("KVTIER_PAGED_KV_QUANT", "MTPLX_PAGED_KV_QUANT", "int4", "kv_quant", "q4"),
    ("KVTIER_PAGED_KV_QUANT", "MTPLX_PAGED_KV_QUANT", "off", "kv_quant", None),
    ("KVTIER_PAGED_KV_QUANT", "MTPLX_PAGED_KV_QUANT", "None", "kv_quant", None),
    ("KVTIER_PAGED_KV_QUANT", "MTPLX_VLLM_METAL_PAGED_KV_QUANT", "Q4_G32", "kv_quant", "q4_g32"),
    ("KVTIER_PAGED_TURBOQUANT", "MTPLX_VLLM_METAL_PAGED_TURBOQUANT", "on", "turboquant", TurboQuantConfig()),
    ("KVTIER_ATTENTION_BACKEND", None, "triton", "attention_backend", "triton"),
    ("KVTIER_OWNED_ATTN_KV_DTYPE", None, "fp16", "kv_dtype", "float16"),
    ("KVTIER_OWNED_ATTN_KV_DTYPE", None, "BFloat16", "kv_dtype", "bfloat16"),
    ("KVTIER_OWNED_ATTN_KV_DTYPE", None, "auto", "kv_dtype", None),
]


@pytest.mark.parametrize("kvtier_name,alias,value,field,expected", VARIABLES)
def test_each_variable_and_its_mtplx_alias(kvtier_name, alias, value, field, expected):
    assert getattr(KVCacheConfig.from_env({kvtier_name: value}), field) == expected
    if alias is not None:
        assert getattr(KVCacheConfig.from_env({alias: value}), field) == expected


def test_defaults_match_the_dataclass():
    assert KVCacheConfig.from_env({}) == KVCacheConfig()
    assert KVCacheConfig() == KVCacheConfig(
        tier="tail", step=256, owned_block_size=1024, paged_block_size=16, paged_num_blocks=1024
    )


def test_reads_os_environ_and_kvtier_wins_over_its_alias(monkeypatch):
    monkeypatch.setenv("MTPLX_OWNED_ATTN_KV", "block")
    monkeypatch.setenv("MTPLX_OWNED_ATTN_KV_BLOCK_SIZE", "128")
    assert KVCacheConfig.from_env().owned_block_size == 128
    monkeypatch.setenv("KVTIER_OWNED_ATTN_KV", "tail")
    assert KVCacheConfig.from_env().tier == "tail"


def test_from_env_refuses_what_is_not_a_mapping_of_strings():
    with pytest.raises(ValueError, match="KVTIER_OWNED_ATTN_KV_STEP=8 must be a string.*pass '8'"):
        KVCacheConfig.from_env({"KVTIER_OWNED_ATTN_KV_STEP": 8})  # was an AttributeError
    with pytest.raises(TypeError, match="mapping of variable names to strings.*got list"):
        KVCacheConfig.from_env([("KVTIER_OWNED_ATTN_KV", "block")])  # was the defaults, silently


def test_paged_wins_over_the_owned_choice():
    cfg = KVCacheConfig.from_env({"KVTIER_PAGED_ATTN": "true", "KVTIER_OWNED_ATTN_KV": "block"})
    assert cfg.tier == "paged" and cfg.enabled


def test_turboquant_codes():
    env = {
        "MTPLX_VLLM_METAL_PAGED_TURBOQUANT": "1",
        "MTPLX_VLLM_METAL_PAGED_TURBOQUANT_K_QUANT": "q4_0",
        "KVTIER_PAGED_TURBOQUANT_V_QUANT": "q2_0",
    }
    assert KVCacheConfig.from_env(env).turboquant == TurboQuantConfig("q4_0", "q2_0")
    env["MTPLX_VLLM_METAL_PAGED_TURBOQUANT_ROTATE_KEYS"] = "on"
    assert KVCacheConfig.from_env(env).turboquant == TurboQuantConfig("q4_0", "q2_0", True)
    env["KVTIER_PAGED_TURBOQUANT"] = "0"  # the codes alone do not switch TurboQuant on
    assert KVCacheConfig.from_env(env).turboquant is None


def test_an_empty_variable_keeps_the_default_and_hides_its_alias():
    names = [n for var in ENV_VARS for n in var.names]
    assert KVCacheConfig.from_env(dict.fromkeys(names, " ")) == KVCacheConfig()
    env = {"KVTIER_PAGED_BLOCK_SIZE": "", "MTPLX_VLLM_METAL_PAGED_BLOCK_SIZE": "64"}
    assert KVCacheConfig.from_env(env).paged_block_size == KVCacheConfig().paged_block_size


def test_the_table_names_real_fields_and_each_variable_once():
    fields = {f.name for f in dataclasses.fields(KVCacheConfig)}
    tq_fields = {f"turboquant.{f.name}" for f in dataclasses.fields(TurboQuantConfig)} - {
        "turboquant.seed"}
    switches = {"paged", "owned", "turboquant"}  # become tier, enabled and turboquant
    keys = [var.key for var in ENV_VARS]
    assert len(set(keys)) == len(keys)
    assert set(keys) == (fields - {"tier", "enabled"}) | tq_fields | switches
    names = [n for var in ENV_VARS for n in var.names]
    assert len(set(names)) == len(names)
    assert all(var.names[0].startswith("KVTIER_") for var in ENV_VARS)
    # every variable of the table is exercised by this file, with a good and a bad value
    covered = {row[0] for row in VARIABLES} | {row[1] for row in VARIABLES} | {
        "KVTIER_PAGED_TURBOQUANT_K_QUANT", "MTPLX_VLLM_METAL_PAGED_TURBOQUANT_K_QUANT",
        "KVTIER_PAGED_TURBOQUANT_V_QUANT", "MTPLX_VLLM_METAL_PAGED_TURBOQUANT_V_QUANT",
        "KVTIER_PAGED_TURBOQUANT_ROTATE_KEYS", "MTPLX_VLLM_METAL_PAGED_TURBOQUANT_ROTATE_KEYS"}
    assert set(names) == covered - {None}
    assert {var.names[0] for var in ENV_VARS} <= {name for name, _, _ in BAD_VALUES} | {
        alias_of(name) for name, _, _ in BAD_VALUES}


def alias_of(name: str) -> str:
    """The KVTIER_* variable of a name (itself, or the one whose alias it is)."""
    return next(var.names[0] for var in ENV_VARS if name in var.names)


# (variable, bad value, what it accepts: words of the message, or a tuple of words)
BAD_VALUES = [
    ("KVTIER_PAGED_ATTN", "maybe", "1/true/yes/on or 0/false/no/off"),
    ("MTPLX_VLLM_METAL_PAGED_ATTN", "2", "1/true/yes/on"),
    ("KVTIER_OWNED_ATTN_KV", "blocks", "block, block_owned"),
    ("MTPLX_OWNED_ATTN_KV", "paged_tail", "ragged, ragged_batch"),
    ("KVTIER_OWNED_ATTN_KV_STEP", "0", "whole number in [1, 16777216]"),
    ("MTPLX_OWNED_ATTN_KV_STEP", "1.5", "whole number in [1, 16777216]"),
    ("KVTIER_OWNED_ATTN_KV_BLOCK_SIZE", "-4", "whole number in [1, 16777216]"),
    ("KVTIER_PAGED_BLOCK_SIZE", "sixteen", "whole number in [1, 16777216]"),
    ("MTPLX_VLLM_METAL_PAGED_NUM_BLOCKS", "0", "whole number in [1, 16777216]"),
    ("KVTIER_DYNAMIC_PAGED_KV", "enabled", "1/true/yes/on"),
    ("MTPLX_DYNAMIC_PAGED_KV_TOKENS", "-1", "whole number in [0, 16777216]"),
    ("KVTIER_DYNAMIC_PAGED_KV_MIN_BLOCKS", "0", "whole number in [1, 16777216]"),
    ("KVTIER_DYNAMIC_PAGED_KV_MARGIN", "x", "whole number in [0, 16777216]"),
    ("MTPLX_DYNAMIC_PAGED_KV_PREVIOUS_HIGH_WATER", "-3", "whole number in [0, 16777216]"),
    ("KVTIER_CONTEXT_WINDOW_TOKENS", "0", "whole number in [1, 16777216]"),
    ("MTPLX_PAGED_KV_QUANT", "q3", ("off", *KV_QUANT_MODES, "int8", "int4")),
    ("KVTIER_PAGED_KV_QUANT", "fp", ("off", *KV_QUANT_MODES)),
    ("KVTIER_PAGED_TURBOQUANT", "sometimes", "1/true/yes/on"),
    ("KVTIER_PAGED_TURBOQUANT_K_QUANT", "q9_0", "q8_0"),
    ("MTPLX_VLLM_METAL_PAGED_TURBOQUANT_V_QUANT", "q1_0", "q2_0, q3_0"),
    ("KVTIER_PAGED_TURBOQUANT_ROTATE_KEYS", "keys", "1/true/yes/on"),
    ("KVTIER_ATTENTION_BACKEND", "cuda", ("auto", "cpu", "torch", "triton")),
    ("KVTIER_OWNED_ATTN_KV_DTYPE", "int8", ("auto", "float16", "bfloat16")),
]


@pytest.mark.parametrize("name,value,accepted", BAD_VALUES)
def test_a_bad_value_names_its_variable_and_what_it_accepts(name, value, accepted):
    with pytest.raises(ValueError, match=name) as e:
        KVCacheConfig.from_env({name: value})
    words = (accepted,) if isinstance(accepted, str) else accepted
    assert f"{name}={value!r}" in str(e.value) and all(w in str(e.value) for w in words)


@pytest.mark.parametrize(
    "changes",
    [
        {"tier": "sliding"},
        {"step": 0},
        {"owned_block_size": True},
        {"paged_num_blocks": -1},
        {"dynamic_paged_margin": -1},
        {"dynamic_paged_min_blocks": 0},
        {"context_window_tokens": 0},
        {"kv_quant": "q2"},
        {"attention_backend": "cuda"},
        {"turboquant": "q8_0"},
        {"step": MAX_TOKENS + 1},
        {"paged_block_size": 10**12},
        {"dynamic_paged_tokens": 10**12},
        {"context_window_tokens": 10**12},
    ],
)
def test_the_dataclass_checks_its_fields(changes):
    with pytest.raises(ValueError, match=next(iter(changes))):
        KVCacheConfig(**changes)


@pytest.mark.parametrize("name", ["KVTIER_OWNED_ATTN_KV_STEP", "KVTIER_OWNED_ATTN_KV_BLOCK_SIZE",
                                  "KVTIER_PAGED_BLOCK_SIZE", "KVTIER_PAGED_NUM_BLOCKS",
                                  "KVTIER_DYNAMIC_PAGED_KV_TOKENS"])
def test_a_size_of_10_to_the_12_is_refused_by_name_before_anything_is_built(name):
    with pytest.raises(ValueError) as e:
        KVCacheConfig.from_env({name: str(10**12)})
    assert str(e.value) == (f"{name}='1000000000000' is too large; set it to a whole number "
                            f"in [{0 if 'TOKENS' in name else 1}, {MAX_TOKENS}]")


def test_a_pool_past_max_tokens_names_both_of_its_settings():
    with pytest.raises(ValueError, match="KVTIER_PAGED_NUM_BLOCKS") as e:
        KVCacheConfig.from_env({"KVTIER_PAGED_NUM_BLOCKS": str(MAX_TOKENS),
                                "KVTIER_PAGED_BLOCK_SIZE": "16"})
    assert "--num-blocks" in str(e.value) and "KVTIER_PAGED_BLOCK_SIZE" in str(e.value)


def test_a_pool_past_max_tokens_says_how_far_to_lower_each_setting():
    with pytest.raises(ValueError) as e:
        KVCacheConfig.from_env({"KVTIER_PAGED_BLOCK_SIZE": "100000"})
    assert str(e.value) == (
        f"paged_num_blocks * paged_block_size = 1024 * 100000 = 102400000 tokens, more than {MAX_TOKENS}; "
        f"lower paged_block_size (KVTIER_PAGED_BLOCK_SIZE) to at most {MAX_TOKENS // 1024} (with 1024 "
        f"blocks), or paged_num_blocks (--num-blocks, KVTIER_PAGED_NUM_BLOCKS) to at most "
        f"{MAX_TOKENS // 100000} (with blocks of 100000 tokens)")
    for block_size, blocks in ((MAX_TOKENS // 1024, 1024), (100000, MAX_TOKENS // 100000)):
        KVCacheConfig(paged_block_size=block_size, paged_num_blocks=blocks)  # the bounds it names fit


def test_env_settings_names_only_what_the_environment_sets():
    assert env_settings({}) == {}
    assert env_settings({"KVTIER_PAGED_NUM_BLOCKS": "64", "KVTIER_PAGED_ATTN": "1",
                         "MTPLX_OWNED_ATTN_KV_STEP": "32"}) == {
        "paged_num_blocks": 64, "paged": True, "step": 32}


@pytest.mark.parametrize("tier, blocks, tokens", [("tail", None, 512), ("ragged", None, 512),
                                                  ("block", None, 2048), ("paged", 8, 128)])
def test_first_allocation_tokens_match_what_a_cache_allocates(tier, blocks, tokens):
    config = KVCacheConfig(tier=tier, **({"paged_num_blocks": blocks} if blocks else {}))
    assert config.first_allocation_tokens(batch_size=2) == tokens
    caches = make_caches(1, config, batch_size=2)
    k = torch.zeros(2, 1, 1, 4)
    caches[0].update_and_fetch(k, k)
    payload = 2 * tokens * 4 * 4  # K and V, one head of 4 float32
    assert payload <= caches[0].nbytes < 2 * payload  # plus bookkeeping (ragged: offsets, ...)


def test_check_fits_refuses_a_step_past_the_context_and_a_pool_past_memory():
    with pytest.raises(KVCacheTooLarge) as e:
        KVCacheConfig(step=10_000).check_fits(context_tokens=8192, bytes_per_token=1,
                                              memory_bytes=None)
    assert str(e.value) == ("step=10000 tokens passes the model's context of 8192 tokens and would "
                            "never be filled; set step (KVTIER_OWNED_ATTN_KV_STEP) to at most 8192 "
                            "(default 256)")
    pool = KVCacheConfig(tier="paged", paged_num_blocks=1024)  # 16384 tokens
    pool.check_fits(context_tokens=8192, bytes_per_token=1024, memory_bytes=2**24)
    with pytest.raises(KVCacheTooLarge, match=r"--num-blocks, KVTIER_PAGED_NUM_BLOCKS") as e:
        pool.check_fits(context_tokens=8192, bytes_per_token=1024, memory_bytes=2**24 - 1)
    assert "16384 tokens" in str(e.value) and isinstance(e.value, MemoryError)
    dynamic = KVCacheConfig(tier="paged", dynamic_paged=True, dynamic_paged_min_blocks=100_000)
    with pytest.raises(KVCacheTooLarge, match=r"lower paged_num_blocks .*, dynamic_paged_min_blocks "
                                              r"\(KVTIER_DYNAMIC_PAGED_KV_MIN_BLOCKS\), previous_high_water"):
        dynamic.check_fits(context_tokens=8192, bytes_per_token=1024, memory_bytes=2**30)
    huge = KVCacheConfig(tier="paged", dynamic_paged=True, previous_high_water=MAX_TOKENS)
    with pytest.raises(ValueError, match=rf"the dynamic pool would start at .* more than {MAX_TOKENS} tokens"):
        huge.initial_paged_blocks()  # before: 25 million tokens, then blamed on paged_num_blocks


def test_tier_params():
    assert KVCacheConfig(tier="tail", step=32).tier_params() == {"step": 32}
    ragged = KVCacheConfig(tier="ragged", step=32, attention_backend="torch").tier_params()
    assert ragged == {"step": 32, "attention_backend": "torch"}
    assert KVCacheConfig(tier="block", owned_block_size=64).tier_params() == {"block_size": 64}
    paged = KVCacheConfig(tier="paged", paged_block_size=32, paged_num_blocks=10).tier_params()
    assert paged["block_size"] == 32 and paged["num_blocks"] == 10 and paged["dynamic"] is False


@pytest.mark.parametrize(
    "config,cls,attr,value",
    [
        (KVCacheConfig(tier="tail", step=16), TailOwnedKVCache, "step", 16),
        (KVCacheConfig(tier="block", owned_block_size=8), BlockOwnedKVCache, "block_size", 8),
    ],
)
def test_make_caches(config, cls, attr, value):
    caches = make_caches(3, config)
    assert len(caches) == 3 and len({id(c) for c in caches}) == 3
    assert all(type(c) is cls and getattr(c, attr) == value and c.empty() for c in caches)


def test_make_caches_from_the_environment(monkeypatch):
    monkeypatch.setenv("MTPLX_OWNED_ATTN_KV", "block")
    monkeypatch.setenv("KVTIER_OWNED_ATTN_KV_BLOCK_SIZE", "32")
    caches = make_caches(2)
    assert all(isinstance(c, BlockOwnedKVCache) and c.block_size == 32 for c in caches)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="num_layers"):
            make_caches(bad, KVCacheConfig())
    for bad in (-3, 0, 2.0, True):  # before: taken by the tiers that do not use it, silently
        with pytest.raises(ValueError, match=f"batch_size must be an int >= 1, got {bad!r}"):
            make_caches(2, KVCacheConfig(tier="tail"), batch_size=bad)


def _filled_tails(n: int) -> list:
    caches = []
    for i in range(n):
        c = TailOwnedKVCache(step=4)
        c.update(torch.randn(1, 2, 5 + i, 8), torch.randn(1, 2, 5 + i, 8))
        caches.append(c)
    return caches


@pytest.mark.parametrize(
    "env",
    [
        {"KVTIER_OWNED_ATTN_KV": "block", "KVTIER_OWNED_ATTN_KV_BLOCK_SIZE": "4"},
        {"MTPLX_OWNED_ATTN_KV": "block_owned", "MTPLX_OWNED_ATTN_KV_BLOCK_SIZE": "4"},
    ],
)
def test_configure_converts_in_place_from_the_environment(seed, monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    caches = _filled_tails(3) + [None]
    before = [c.fetch() if c else None for c in caches]
    same_list = caches
    stats = configure_kv_cache(caches)
    assert caches is same_list
    assert stats == {"enabled": True, "mode": "block", "entries": 3, "skipped": 1, "block_size": 4}
    for c, old in zip(caches[:3], before[:3]):
        assert isinstance(c, BlockOwnedKVCache) and c.block_size == 4
        assert torch.equal(c.fetch()[0], old[0]) and torch.equal(c.fetch()[1], old[1])
    assert caches[3] is None


def test_configure_converts_block_back_to_tail(seed):
    caches = _filled_tails(2)
    configure_kv_cache(caches, KVCacheConfig(tier="block", owned_block_size=2))
    originals = [c.fetch() for c in caches]
    stats = configure_kv_cache(caches, KVCacheConfig(tier="tail", step=8))
    assert stats == {"enabled": True, "mode": "tail", "entries": 2, "skipped": 0, "step": 8}
    for c, (k, v) in zip(caches, originals):
        assert isinstance(c, TailOwnedKVCache) and c.capacity == 8
        assert torch.equal(c.fetch()[0], k) and torch.equal(c.fetch()[1], v)


def test_configure_when_disabled_leaves_the_list_alone(seed, monkeypatch):
    monkeypatch.setenv("MTPLX_OWNED_ATTN_KV", "0")
    caches = _filled_tails(2)
    ids = [id(c) for c in caches]
    stats = configure_kv_cache(caches)
    assert stats["enabled"] is False and stats["entries"] == 0 and stats["skipped"] == 2
    assert [id(c) for c in caches] == ids


def test_configure_needs_a_list():
    with pytest.raises(ValueError, match="list"):
        configure_kv_cache(tuple(_filled_tails(1)), KVCacheConfig())


def test_caches_codecs_and_kernels_never_import_config():
    """kvtier.config stands above the caches (it builds them): importing every module of
    kvtier.caches, kvtier.kernels and kvtier.quant in a fresh interpreter leaves it unloaded."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import kvtier.caches, kvtier.kernels, kvtier.quant\n"
        "names = [m.name for p in (kvtier.caches, kvtier.kernels, kvtier.quant)\n"
        "         for m in pkgutil.iter_modules(p.__path__, p.__name__ + '.')]\n"
        "for n in names:\n"
        "    importlib.import_module(n)\n"
        "print(' '.join(names))\n"
        "print('kvtier.config' in sys.modules)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout.split("\n")
    names = set(out[0].split())
    assert {"kvtier.caches.paged", "kvtier.kernels.paged", "kvtier.quant.modes"} <= names
    assert out[1] == "False"


def test_user_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "k"))
    assert user_cache_dir() == tmp_path / "k"
    monkeypatch.delenv("KVTIER_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert user_cache_dir() == tmp_path / "kvtier"


def test_kv_dtype_builds_narrow_tail_caches_and_is_refused_elsewhere():
    caches = make_caches(2, KVCacheConfig.from_env({"KVTIER_OWNED_ATTN_KV_DTYPE": "float16"}))
    assert all(type(c) is TailOwnedKVCache and c.kv_dtype == torch.float16 for c in caches)
    caches[0].update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
    assert caches[0].keys.dtype == torch.float16 and caches[0].nbytes == 2 * 2 * 256 * 4 * 2
    assert KVCacheConfig().tier_params() == {"step": 256}  # unchanged without it
    block = BlockOwnedKVCache()
    block.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    converted = [block]
    configure_kv_cache(converted, KVCacheConfig(kv_dtype="float16"))  # from another tier
    assert type(converted[0]) is TailOwnedKVCache and converted[0].kv_dtype == torch.float16
    assert torch.equal(converted[0].fetch()[0], block.fetch()[0].half())
    with pytest.raises(ValueError, match=r"kv_dtype='float8' is not accepted|kv_dtype 'float8' is unknown"):
        KVCacheConfig(kv_dtype="float8")
    with pytest.raises(ValueError, match=r"KVTIER_OWNED_ATTN_KV_DTYPE='int8' is not accepted"):
        KVCacheConfig.from_env({"KVTIER_OWNED_ATTN_KV_DTYPE": "int8"})
    with pytest.raises(ValueError, match=r"applies to the tail tier, not paged.*kv_quant"):
        KVCacheConfig.from_env({"KVTIER_OWNED_ATTN_KV_DTYPE": "float16", "KVTIER_PAGED_ATTN": "1"})


@pytest.mark.parametrize("env, tier", [({"KVTIER_PAGED_KV_QUANT": "q8"}, "tail"),
                                       ({"KVTIER_PAGED_TURBOQUANT": "1", "KVTIER_OWNED_ATTN_KV": "block"}, "block")])
def test_quantised_storage_without_the_paged_tier_warns_where_caches_are_built(env, tier, recwarn):
    """The storage variables name the paged tier's pages: set beside another tier they store
    nothing, and building caches says so (the environment may switch KVTIER_PAGED_ATTN alone)."""
    config = KVCacheConfig.from_env(env)
    assert config.tier == tier
    with pytest.warns(UserWarning, match=f"stores the paged tier's pages, but the tier is {tier}.*KVTIER_PAGED_ATTN=1"):
        caches = make_caches(2, config)
    assert all(c.tier == tier for c in caches)
    with pytest.warns(UserWarning, match="stays in full precision|stay in full precision"):
        configure_kv_cache([TailOwnedKVCache()], config)
    paged = KVCacheConfig.from_env({**env, "KVTIER_PAGED_ATTN": "1"})
    assert paged.unused_storage() is None and KVCacheConfig().unused_storage() is None
    make_caches(1, paged)
    assert not [w for w in recwarn if "paged tier's pages" in str(w.message)]


@pytest.mark.parametrize("storage", [{"kv_quant": "fp8"}, {"turboquant": "q5_0r,q4_0"}, {"kv_quant": "q8"}])
def test_configuring_a_paged_cache_of_the_same_storage_keeps_its_codes(storage):
    """configure_kv_cache over paged caches already in the configured storage copies their
    blocks (was: decoded and coded again, fp8 keys against a new key centre, TurboQuant values
    fitted to their own reconstruction)."""
    from kvtier.caches.paged import PagedKVCache
    from kvtier.quant.modes import parse_turboquant

    tq = parse_turboquant(storage["turboquant"]) if "turboquant" in storage else None
    kw = {"kv_quant": storage.get("kv_quant"), "turboquant": tq}
    g = torch.Generator().manual_seed(5)
    cache = PagedKVCache(16, 8, batch_size=2, **kw)
    cache.update(torch.randn(2, 2, 37, 64, generator=g), torch.randn(2, 2, 37, 64, generator=g), new_offsets=[37, 20])
    before = cache.fetch()
    caches = [cache]
    configure_kv_cache(caches, KVCacheConfig(tier="paged", paged_num_blocks=64, **kw))
    after = caches[0]
    assert after is not cache and after.pool.num_blocks >= 64 and after.lengths == [37, 20]
    for x, y in zip(before, after.fetch(), strict=True):
        assert torch.equal(x, y)  # the same codes read back, bit for bit
