"""LMCache's long-document QA benchmark (``benchmarks/long_doc_qa/long_doc_qa.py``, the workload of
Unified KV pooling §III-A and §V-A): a warm-up round sends each of ``num_documents`` documents of
``document_tokens`` once, then a query round sends them again ``repeat_count`` times each, so the
query round finds every document's KV where the warm-up left it (GPU, host, SSD).

As in the benchmark:

- a prompt is its document alone, so a query's prompt equals its warm-up prompt (the same keys,
  tail block included) and only the last prompt token must be computed;
- ``output_tokens`` is the cap on generated tokens (``--output-len``, 100 by default);
- the query order is ``repeat_mode``: ``random`` (the documents repeated, then shuffled by Python's
  ``random`` seeded with ``shuffle_seed``, the benchmark's default), ``tile`` (1..n, 1..n) or
  ``interleave`` (1, 1, 2, 2, ...);
- at most ``max_inflight_requests`` are in flight (an asyncio semaphore in the benchmark): request
  ``k`` is sent when request ``k - max_inflight_requests`` finishes (closed loop, ``parent_id``), and
  the first queries when the last warm-up request has finished plus ``sleep_after_warmup_s``.

The semaphore hands a free slot to the next prompt whichever request finished; the chains here
assume requests finish in the order they were sent (true under FCFS for equal prompts; a request
overtaken by a later one starts its successor a little late). ``query_round=False`` gives the
warm-up round alone (to tell the rounds' metrics apart by difference).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from kvtier.errors import ConfigError
from kvtier.sim.request import Request
from kvtier.sim.workload.common import (
    KeyAllocator,
    num_blocks,
    require_block_tokens,
    require_choice,
    require_int,
)

REPEAT_MODES = ("random", "tile", "interleave")


def query_order(num_documents: int, repeat_count: int, repeat_mode: str, shuffle_seed: int) -> list[int]:
    """Document index of each query, as the benchmark's ``repeat_prompts`` orders them."""
    docs = list(range(num_documents))
    if repeat_mode == "tile":
        return docs * repeat_count
    if repeat_mode == "interleave":
        return [d for d in docs for _ in range(repeat_count)]
    order = docs * repeat_count
    random.Random(shuffle_seed).shuffle(order)
    return order


def long_doc_qa_workload(
    *,
    block_tokens: int,
    num_documents: int = 8,
    document_tokens: int = 20_000,
    output_tokens: int = 100,
    repeat_count: int = 2,
    repeat_mode: str = "random",
    shuffle_seed: int = 0,
    max_inflight_requests: int = 2,
    sleep_after_warmup_s: float = 0.0,
    query_round: bool = True,
    seed: int = 0,  # unused: the benchmark has no other randomness than shuffle_seed
) -> Iterator[Request]:
    """The warm-up round, then (``query_round``) the query round; parameters are checked now."""
    block_tokens = require_block_tokens(block_tokens)
    num_documents = require_int("num_documents", num_documents, 1)
    document_tokens = require_int("document_tokens", document_tokens, 1)
    output_tokens = require_int("output_tokens", output_tokens, 1)
    repeat_count = require_int("repeat_count", repeat_count, 1)
    require_choice("repeat_mode", repeat_mode, REPEAT_MODES)
    shuffle_seed = require_int("shuffle_seed", shuffle_seed, 0)
    inflight = require_int("max_inflight_requests", max_inflight_requests, 1)
    if not (isinstance(sleep_after_warmup_s, int | float) and sleep_after_warmup_s >= 0):
        raise ConfigError(
            f"workload parameter `sleep_after_warmup_s` is {sleep_after_warmup_s!r}; expected >= 0"
        )
    require_int("seed", seed, 0)
    order = query_order(num_documents, repeat_count, repeat_mode, shuffle_seed) if query_round else []

    def generate() -> Iterator[Request]:
        keys = KeyAllocator()
        doc_keys = [
            tuple(keys.fresh(num_blocks(document_tokens, block_tokens))) for _ in range(num_documents)
        ]
        last_warmup = num_documents - 1
        for k in range(num_documents):
            parent = k - inflight if k >= inflight else None
            yield Request(k, 0.0, document_tokens, output_tokens, doc_keys[k], parent_id=parent)
        for j, doc in enumerate(order):
            rid = num_documents + j
            if j < inflight:
                parent, think = last_warmup, float(sleep_after_warmup_s)
            else:
                parent, think = rid - inflight, 0.0
            yield Request(
                rid, 0.0, document_tokens, output_tokens, doc_keys[doc], parent_id=parent, think_time_s=think
            )

    return generate()
