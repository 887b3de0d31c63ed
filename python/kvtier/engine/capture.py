"""Capturing real KV blocks as ``BlockFirst`` objects (for codec work and store tests).

:func:`capture_kv` prefills prompts into a :class:`PagedKvPool` and copies their full blocks out
with :func:`kvtier.layout.gather` — the same path the engine's offload takes — so the result is
byte for byte what the store would hold for those blocks (in fp32, or converted to fp16).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from kvtier import layout
from kvtier.engine.errors import EngineInputError
from kvtier.engine.kv import PagedKvPool, pool_geometry
from kvtier.engine.model import Model
from kvtier.engine.weights import ModelConfig
from kvtier.geometry import Geometry


def capture_geometry(config: ModelConfig, block_tokens: int, dtype: Literal["fp16", "fp32"]) -> Geometry:
    """The geometry of :func:`capture_kv`'s objects."""
    return Geometry(config.num_layers, config.num_kv_heads, config.head_dim, dtype, block_tokens)


def capture_kv(
    model: Model,
    prompts: Sequence[Sequence[int]],
    *,
    block_tokens: int = 16,
    dtype: Literal["fp16", "fp32"] = "fp16",
) -> npt.NDArray[np.uint8]:
    """KV of every *full* block of each prompt (in prompt order), as ``BlockFirst`` objects: an
    ``(n, block_bytes)`` uint8 array in :func:`capture_geometry`'s geometry. A prompt's trailing
    partial block is left out, as the store only holds full blocks. Each prompt is prefilled alone
    from position 0."""
    if dtype not in ("fp16", "fp32"):
        raise EngineInputError(f"dtype is {dtype!r}; expected 'fp16' or 'fp32'")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise EngineInputError("prompts must be a non-empty list of non-empty token id lists")
    geometry = pool_geometry(model.config, block_tokens)
    blocks_per_prompt = [-(-len(p) // block_tokens) for p in prompts]
    pool = PagedKvPool(geometry, sum(blocks_per_prompt))
    full_blocks: list[int] = []
    first = 0
    for prompt, num_blocks in zip(prompts, blocks_per_prompt, strict=True):
        table = list(range(first, first + num_blocks))
        model.forward(
            np.asarray(prompt), np.arange(len(prompt)), pool.step([table], [len(prompt)], [len(prompt)])
        )
        full_blocks += table[: len(prompt) // block_tokens]
        first += num_blocks
    objects = layout.gather(geometry, pool.pool, full_blocks)
    if dtype == "fp32":
        return objects
    return objects.view(np.float32).astype(np.float16).view(np.uint8)
