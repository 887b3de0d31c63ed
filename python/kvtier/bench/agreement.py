"""Next-token agreement of greedy decoding with codec-round-tripped KV vs exact KV (issue 7).

A cache hit in kvtier loads a prompt's prefix blocks from a tier — as fp16 ``BlockFirst`` objects,
possibly through the ``quant`` codec — and prefills only the rest (ShadowServe §4.1: the last
token is always re-prefilled). This module replays exactly that on the real SmolLM2-135M model:

1. prefill the prompt's prefix blocks (all full blocks before the last token) into a paged pool,
   gather them as fp16 objects (what the store holds);
2. for each variant — ``exact`` (the fp16 objects as stored), ``quant`` (after encode/decode with
   the given bins) — scatter the objects into a fresh pool, prefill the prompt's tail over them,
   then decode;
3. the reference continuation is the ``exact`` variant's greedy output; the other variants are fed
   the same tokens (teacher forcing), and *agreement* is the fraction of steps whose argmax equals
   the reference token. ``fp32`` (no offload at all: the prefix KV never leaves fp32) is reported
   too, so the fp16 rounding the store itself adds is visible beside the codec's error.

CacheGen (and ShadowServe §5, "Compression algorithm") report task accuracy; next-token agreement
is the direct, model-level version of the same question: does the lossy KV change what is decoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier import codec, layout
from kvtier.engine.capture import capture_geometry
from kvtier.engine.errors import EngineInputError
from kvtier.engine.kv import PagedKvPool, pool_geometry
from kvtier.engine.model import Model
from kvtier.results import Result

# Chat prompts (prose, code, facts), long enough for several 16-token prefix blocks.
PROMPTS: tuple[str, ...] = (
    "Explain, in a few sentences, how photosynthesis turns light into chemical energy, and why the "
    "enzyme RuBisCO is considered inefficient even though it is the most abundant protein on Earth.",
    "Write a Python function that merges two sorted lists into one sorted list without using the "
    "built-in sorted function, and explain its time complexity.",
    "A small river town has a ferry, a bakery, a post office and a bridge that has been under "
    "construction for years. Write the opening paragraph of a short story set there in autumn.",
    "What are the main differences between TCP and UDP? Give one example of an application that "
    "should use each protocol and say why.",
)


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "fp32" (no round trip), "raw" (fp16 as stored) or "quant"
    key_bins: codec.BinRule = codec.CACHEGEN_KEYS
    value_bins: codec.BinRule = codec.CACHEGEN_VALUES


EXACT = Variant("exact", "raw")
DEFAULT_VARIANTS: tuple[Variant, ...] = (
    Variant("fp32", "fp32"),
    Variant("quant_cachegen", "quant"),
    Variant("quant_uniform_8", "quant", codec.BinRule(0, 8, 8), codec.BinRule(0, 8, 8)),
    Variant("quant_uniform_4", "quant", codec.BinRule(0, 4, 4), codec.BinRule(0, 4, 4)),
)


def _round_trip(objects16: npt.NDArray[np.uint8], variant: Variant, model: Model, block_tokens: int) -> Any:
    """fp16 objects after ``variant``'s codec, as fp32 objects for the engine's pool."""
    if variant.kind == "raw":
        decoded = objects16
    elif variant.kind == "quant":
        geometry16 = capture_geometry(model.config, block_tokens, "fp16")
        decoded = np.empty_like(objects16)
        for i, obj in enumerate(objects16):
            payload = codec.encode(
                obj, "quant", backend="none", geometry=geometry16, key_bins=variant.key_bins,
                value_bins=variant.value_bins,
            )  # fmt: skip
            codec.decode(payload, "quant", out=decoded[i])
    else:
        raise EngineInputError(f"variant {variant.name!r} has kind {variant.kind!r}; expected raw or quant")
    return decoded.view(np.float16).astype(np.float32).view(np.uint8)


def _decode_over_prefix(
    model: Model,
    prompt: Sequence[int],
    prefix_objects: npt.NDArray[np.uint8] | None,
    prefix_tokens: int,
    block_tokens: int,
    forced: Sequence[int] | None,
    steps: int,
) -> list[int]:
    """Argmax tokens of ``steps`` decode steps after ``prompt``, its first ``prefix_tokens`` KV taken
    from ``prefix_objects`` (fp32 ``BlockFirst``; ``None``: computed in place). With ``forced``, step
    ``j`` is fed ``forced[j - 1]`` instead of its own previous argmax (teacher forcing)."""
    geometry = pool_geometry(model.config, block_tokens)
    total = len(prompt) + steps
    pool = PagedKvPool(geometry, -(-total // block_tokens))
    table = list(range(pool.num_blocks))
    start = 0
    if prefix_objects is not None:
        layout.scatter(geometry, prefix_objects, table[: prefix_tokens // block_tokens], pool.pool)
        start = prefix_tokens
    tail = np.asarray(prompt[start:])
    logits = model.forward(
        tail, np.arange(start, len(prompt)), pool.step([table], [len(prompt)], [len(tail)])
    )
    out = [int(np.argmax(logits[-1]))]
    pos = len(prompt)
    while len(out) < steps:
        token = forced[len(out) - 1] if forced is not None else out[-1]
        logits = model.forward(np.asarray([token]), np.asarray([pos]), pool.step([table], [pos + 1], [1]))
        out.append(int(np.argmax(logits[-1])))
        pos += 1
    return out


@dataclass(frozen=True)
class VariantAgreement(Result):
    agreement: float
    first_token_agreement: float
    per_prompt: list[float]


@dataclass(frozen=True)
class Agreement(Result):
    """:func:`next_token_agreement`'s result; its JSON has each variant under its own name beside
    ``prompts``, ``steps`` and ``block_tokens``."""

    prompts: int
    steps: int
    block_tokens: int
    variants: dict[str, VariantAgreement]

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "prompts": self.prompts,
            "steps": self.steps,
            "block_tokens": self.block_tokens,
        }
        return out | {name: v.as_dict() for name, v in self.variants.items()}


def next_token_agreement(
    model: Model,
    prompts: Sequence[Sequence[int]],
    *,
    steps: int = 24,
    block_tokens: int = 16,
    variants: Sequence[Variant] = DEFAULT_VARIANTS,
) -> Agreement:
    """Per variant: ``agreement`` (teacher-forced, over all prompts' steps), ``first_token_agreement``
    (the token right after the prompt: a cache hit's first output), plus per-prompt figures."""
    if steps < 1:
        raise EngineInputError(f"steps is {steps}; expected >= 1")
    if not prompts:
        raise EngineInputError("prompts is empty")
    geometry = pool_geometry(model.config, block_tokens)
    per_variant: dict[str, list[tuple[int, int, int]]] = {v.name: [] for v in variants}
    for prompt in prompts:
        prefix_blocks = (len(prompt) - 1) // block_tokens
        if prefix_blocks < 1:
            raise EngineInputError(
                f"a prompt of {len(prompt)} tokens has no full {block_tokens}-token block before its last token"
            )
        prefix_tokens = prefix_blocks * block_tokens
        pool = PagedKvPool(geometry, prefix_blocks)
        ids = list(range(prefix_blocks))
        model.forward(
            np.asarray(prompt[:prefix_tokens]), np.arange(prefix_tokens), pool.step([ids], [prefix_tokens], [prefix_tokens])
        )  # fmt: skip
        objects32 = layout.gather(geometry, pool.pool, ids)
        objects16 = objects32.view(np.float32).astype(np.float16).view(np.uint8)
        exact = _round_trip(objects16, EXACT, model, block_tokens)
        reference = _decode_over_prefix(model, prompt, exact, prefix_tokens, block_tokens, None, steps)
        for v in variants:
            prefix = objects32 if v.kind == "fp32" else _round_trip(objects16, v, model, block_tokens)
            got = _decode_over_prefix(model, prompt, prefix, prefix_tokens, block_tokens, reference, steps)
            matches = sum(int(a == b) for a, b in zip(got, reference, strict=True))
            per_variant[v.name].append((matches, steps, int(got[0] == reference[0])))
    figures = {
        name: VariantAgreement(
            agreement=sum(r[0] for r in rows) / sum(r[1] for r in rows),
            first_token_agreement=sum(r[2] for r in rows) / len(rows),
            per_prompt=[r[0] / r[1] for r in rows],
        )
        for name, rows in per_variant.items()
    }
    return Agreement(len(prompts), steps, block_tokens, figures)
