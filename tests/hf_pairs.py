"""Tiny transformers models saved by transformers and loaded by kvtier (:func:`loaded_pairs`), the
windowed ones of the sliding-window tests (tests/model/test_sliding_window.py,
tests/serve/test_engine_window.py) and transformers' greedy tokens."""

from __future__ import annotations

import torch
import transformers

from kvtier.model import load_model

WINDOW = 8
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=300, max_position_embeddings=512, rms_norm_eps=1e-6)


def hf_windowed(kind: str):
    """A tiny transformers model with a window of :data:`WINDOW` keys: Mistral's and Phi-3's in every
    layer, Qwen2's in its second layer only (``max_window_layers=1``)."""
    torch.manual_seed(7)
    if kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=WINDOW))
    elif kind == "phi3":  # (its Q, K and V in one tensor, its gate and up in another)
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(
            **COMMON, sliding_window=WINDOW, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1))
    model.generation_config.eos_token_id = None  # (greedy tokens run on through a random model's EOS)
    return model.eval()


def prompts(n: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(3, 300, (k,), generator=g).tolist() for k in lengths]


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0)
    assert out.shape[1] == len(ids) + n
    return out[0, len(ids):].tolist()


def loaded_pairs(tmp_path_factory, build, prefix: str):
    """``get(kind) -> (hf_model, LoadedModel)``: ``build(kind)`` saved by transformers and loaded by
    kvtier (CPU, float32), each kind built once."""
    made = {}

    def get(kind: str):
        if kind not in made:
            hf = build(kind)
            folder = tmp_path_factory.mktemp(f"{prefix}-{kind}")
            hf.save_pretrained(folder)
            made[kind] = hf, load_model(folder, device="cpu", dtype=torch.float32, progress=False)
        return made[kind]

    return get
