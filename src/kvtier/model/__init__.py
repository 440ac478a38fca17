"""The Llama-family engine: model, weight loading, tokenizer.

``load_model()`` loads the embedded SmolLM2-135M-Instruct (or a GGUF file or a
Hugging Face folder); ``build_random(name)`` builds a named shape with random
weights for benchmarks.
"""

from kvtier.model.architectures import ARCHITECTURES, build_random
from kvtier.model.llama import ModelArgs, Transformer
from kvtier.model.loading import LoadedModel, load_model, model_args
from kvtier.model.tokenizer import StreamDecoder, Tokenizer

__all__ = [
    "ARCHITECTURES",
    "LoadedModel",
    "ModelArgs",
    "StreamDecoder",
    "Tokenizer",
    "Transformer",
    "build_random",
    "load_model",
    "model_args",
]
