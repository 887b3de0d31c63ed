"""Long-document question answering: many short questions over a few long documents.

Each query is one document followed by a question; queries on the same document share the
document's full blocks (``doc_tokens // block_tokens`` keys) and nothing else: the block holding the
document's last tokens and the question's first is new content, so it and every block after it get
fresh keys. This is the workload of Strata's LooGLE and NarrativeQA runs (Strata §5.1, Table 1) and of
ShadowServe's NarrativeQA runs (§6.1): documents reused across users, queries arriving open-loop
(Poisson in both papers).

Shapes, per ``dataset`` (the parameters left at ``None`` take the preset's value):

- ``loogle``: 105 documents of mean 21,613 tokens, answers of mean 15.6 tokens (Strata Table 1,
  LooGLE's Wikipedia part, 2,410 queries);
- ``narrativeqa``: 50 documents of mean 54,797 tokens, documents over 128K tokens dropped, answers
  of mean 13.0 tokens (Strata Table 1). ShadowServe uses LongBench's truncated NarrativeQA (median
  14K tokens) with answers fixed at 32 tokens: set ``doc_tokens_mean`` and the output bounds for that.

The papers give means only, so document lengths are drawn log-normal with that mean and
``doc_tokens_sigma`` (0.5 by default: most documents within 0.4x-2.5x of the median, an assumption),
clipped to ``[doc_tokens_min, doc_tokens_max]``; questions are uniform in
``[question_tokens_min, question_tokens_max]`` (20-100 tokens) and answers uniform in
``[output_tokens_min, output_tokens_max]`` (8-24: mean 16, near Strata's 15.6 and 13.0). Document
popularity is ``zipf`` (weight ``rank ** -zipf_s`` over a random ranking) or ``uniform``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kvtier.sim.request import Request
from kvtier.sim.workload.arrivals import make_arrivals
from kvtier.sim.workload.common import (
    KeyAllocator,
    lognormal_tokens,
    num_blocks,
    require_block_tokens,
    require_choice,
    require_int,
    require_ordered,
    require_positive,
)


@dataclass(frozen=True, slots=True)
class DocumentSet:
    """A dataset's document shapes (Strata Table 1)."""

    num_documents: int
    doc_tokens_mean: int
    doc_tokens_max: int


LONGDOC_DATASETS: dict[str, DocumentSet] = {
    "loogle": DocumentSet(num_documents=105, doc_tokens_mean=21_613, doc_tokens_max=100_000),
    "narrativeqa": DocumentSet(num_documents=50, doc_tokens_mean=54_797, doc_tokens_max=128_000),
}

POPULARITIES = ("zipf", "uniform")


def longdoc_workload(
    *,
    block_tokens: int,
    num_requests: int = 1000,
    rate_per_s: float = 1.0,
    arrival: str = "poisson",
    cv: float = 1.0,
    dataset: str = "loogle",
    num_documents: int | None = None,
    doc_tokens_mean: int | None = None,
    doc_tokens_sigma: float = 0.5,
    doc_tokens_min: int = 10_000,
    doc_tokens_max: int | None = None,
    popularity: str = "zipf",
    zipf_s: float = 1.0,
    question_tokens_min: int = 20,
    question_tokens_max: int = 100,
    output_tokens_min: int = 8,
    output_tokens_max: int = 24,
    seed: int = 0,
) -> Iterator[Request]:
    """``num_requests`` open-loop queries, sorted by arrival; parameters are checked now."""
    block_tokens = require_block_tokens(block_tokens)
    preset = LONGDOC_DATASETS[require_choice("dataset", dataset, tuple(LONGDOC_DATASETS))]
    num_requests = require_int("num_requests", num_requests, 1)
    num_documents = require_int(
        "num_documents", preset.num_documents if num_documents is None else num_documents, 1
    )
    doc_mean = require_positive(
        "doc_tokens_mean", preset.doc_tokens_mean if doc_tokens_mean is None else doc_tokens_mean
    )
    doc_sigma = require_positive("doc_tokens_sigma", doc_tokens_sigma)
    doc_min = require_int("doc_tokens_min", doc_tokens_min, 1)
    doc_max = require_int(
        "doc_tokens_max", preset.doc_tokens_max if doc_tokens_max is None else doc_tokens_max, 1
    )
    require_ordered("doc_tokens_min", doc_min, "doc_tokens_max", doc_max)
    require_choice("popularity", popularity, POPULARITIES)
    zipf_s = require_positive("zipf_s", zipf_s)
    question_min = require_int("question_tokens_min", question_tokens_min, 1)
    question_max = require_int("question_tokens_max", question_tokens_max, 1)
    require_ordered("question_tokens_min", question_min, "question_tokens_max", question_max)
    output_min = require_int("output_tokens_min", output_tokens_min, 1)
    output_max = require_int("output_tokens_max", output_tokens_max, 1)
    require_ordered("output_tokens_min", output_min, "output_tokens_max", output_max)

    # Separate streams, so changing the arrival process leaves the documents and queries unchanged.
    arrival_seed, shape_seed = np.random.SeedSequence(require_int("seed", seed, 0)).spawn(2)
    arrivals = make_arrivals(arrival, rate_per_s, np.random.default_rng(arrival_seed), cv=cv)
    rng = np.random.default_rng(shape_seed)
    doc_tokens = [lognormal_tokens(rng, doc_mean, doc_sigma, doc_min, doc_max) for _ in range(num_documents)]
    if popularity == "zipf":
        weights = np.empty(num_documents)
        weights[rng.permutation(num_documents)] = np.arange(1, num_documents + 1, dtype=float) ** -zipf_s
    else:
        weights = np.ones(num_documents)
    cumulative = np.cumsum(weights / weights.sum())

    def generate() -> Iterator[Request]:
        keys = KeyAllocator()
        # Document d's full blocks are keys doc_first_key[d] .. + doc_tokens[d] // block_tokens - 1.
        doc_first_key = [keys.fresh(tokens // block_tokens).start for tokens in doc_tokens]
        for req_id, arrival_s in zip(range(num_requests), arrivals, strict=False):
            doc = min(int(np.searchsorted(cumulative, rng.random(), side="right")), num_documents - 1)
            question_tokens = int(rng.integers(question_min, question_max, endpoint=True))
            output_tokens = int(rng.integers(output_min, output_max, endpoint=True))
            prompt_tokens = doc_tokens[doc] + question_tokens
            shared = doc_tokens[doc] // block_tokens
            first = doc_first_key[doc]
            fresh = keys.fresh(num_blocks(prompt_tokens, block_tokens) - shared)
            yield Request(
                req_id=req_id,
                arrival_s=arrival_s,
                prompt_tokens=prompt_tokens,
                output_tokens=output_tokens,
                block_keys=(*range(first, first + shared), *fresh),
            )

    return generate()
