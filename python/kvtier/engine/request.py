"""One request inside the engine loop, and what the caller gets back when it finishes.

A request's tokens are its prompt followed by its output. ``num_computed`` of them have KV in the
pool; the *prefill* is its first ``prefill_len`` tokens (the prompt, or after a preemption by
recompute the prompt plus the output so far, as in vLLM): when the pool holds all of them the last
position's logits give the next token. From then on each decode step computes the KV of the last
token and samples one more. So ``num_computed == len(tokens)`` right after a step means "sample".

Block table: ``table[i]`` is the pool block of tokens ``i*bt .. i*bt+bt-1``. The first ``locked``
entries are full blocks the request holds a lock on in the device prefix cache; each is the cached
block of its key, except the indices in ``duplicates`` (another request cached that key first: this
request's copy stays private). Entries from ``locked`` on are private.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier.engine.errors import EngineInputError
from kvtier.engine.sampling import SamplingParams
from kvtier.keys import BlockKeys, Namespace
from kvtier.sched.base import Phase
from kvtier.tiers import Tier


@dataclass(frozen=True)
class RequestOutput:
    """A finished request. ``cached_tokens`` counts the prompt tokens reused from each tier at its
    (last) admission, ``ttft_s``/``latency_s`` are from when it was added."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token) or "length" (max_tokens, or the model's context)
    text: str = ""
    ttft_s: float = 0.0
    latency_s: float = 0.0
    cached_tokens: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0
    swaps: int = 0


def check_prompt(
    prompt: Sequence[int],
    params: SamplingParams,
    vocab: int,
    context: int,
    block_tokens: int,
    num_blocks: int,
) -> list[int]:
    """The prompt as a list of ints if the request can run on a model of ``vocab`` tokens and a
    ``context``-token window, in a pool of ``num_blocks`` blocks; else :class:`EngineInputError`."""
    if not isinstance(params, SamplingParams):
        raise EngineInputError(f"sampling is {type(params).__name__}; expected kvtier.engine.SamplingParams")
    ids = np.asarray(prompt)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise EngineInputError(f"a prompt must be a 1-D sequence of token ids; got shape {ids.shape}")
    if ids.size == 0:
        raise EngineInputError("the prompt is empty; expected at least one token")
    if ids.min() < 0 or ids.max() >= vocab:
        raise EngineInputError(f"prompt token ids must be in 0..{vocab - 1}")
    if ids.size >= context:
        raise EngineInputError(
            f"the prompt has {ids.size} tokens; the model's context is {context} tokens, "
            f"so a prompt may have at most {context - 1} (one new token must fit)"
        )
    total = min(ids.size + params.max_tokens, context)
    need = -(-total // block_tokens)
    if need > num_blocks:
        raise EngineInputError(
            f"the KV pool has {num_blocks} blocks of {block_tokens} tokens "
            f"({num_blocks * block_tokens} tokens); this request needs {need} "
            f"({ids.size} prompt + {total - ids.size} new tokens): make the pool larger or max_tokens smaller"
        )
    return [int(t) for t in ids]


@dataclass(eq=False)  # identity, as before: the loop keeps requests in lists and dicts by id
class EngineRequest:
    """Mutable state of one request in the engine loop (see the module doc)."""

    req_id: int
    prompt: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int]
    rng: np.random.Generator
    arrival_s: float
    namespace: Namespace
    output: list[int] = field(default_factory=list, init=False)
    prefill_len: int = field(init=False)
    num_computed: int = field(default=0, init=False)
    table: list[int] = field(default_factory=list, init=False)
    locked: int = field(default=0, init=False)
    duplicates: set[int] = field(default_factory=set, init=False)
    phase: Phase = field(default=Phase.WAITING, init=False)
    epoch: int = field(default=0, init=False)  # bumped when it leaves the device (preempted, swapped out)
    #: Reused prompt tokens per tier, at the last admission.
    hit_tokens: list[int] = field(default_factory=lambda: [0, 0, 0, 0], init=False)
    preemptions: int = field(default=0, init=False)
    swaps: int = field(default=0, init=False)
    first_token_s: float | None = field(default=None, init=False)
    finish_s: float | None = field(default=None, init=False)
    finish_reason: str | None = field(default=None, init=False)
    _keys: BlockKeys = field(init=False, repr=False)
    _key_ints: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.prefill_len = len(self.prompt)
        self._keys = self.namespace.block_keys(np.zeros(0, dtype=np.uint32))

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def prefill_done(self) -> bool:
        """Its prefill's KV is in the pool and its next token sampled: it may decode."""
        return self.num_computed >= self.prefill_len and bool(self.output)

    def block_keys(self, num_blocks: int) -> BlockKeys:
        """Keys of the first ``num_blocks`` full blocks of its tokens."""
        if num_blocks > len(self._keys):
            bt = self.namespace.geometry.block_tokens
            self._keys = self.namespace.block_keys(self.tokens[: self.num_tokens // bt * bt])
            self._key_ints = list(self._keys)
        if num_blocks > len(self._keys):
            raise AssertionError(f"request {self.req_id} has {len(self._keys)} full blocks, not {num_blocks}")
        return self._keys[:num_blocks]

    def key_ints(self, num_blocks: int) -> list[int]:
        self.block_keys(num_blocks)
        return self._key_ints[:num_blocks]

    def private_blocks(self) -> list[int]:
        return [self.table[i] for i in sorted(self.duplicates)] + self.table[self.locked :]

    def to_output(self, now_s: float, text: str = "") -> RequestOutput:
        now_s = self.finish_s if self.finish_s is not None else now_s
        return RequestOutput(
            request_id=self.req_id,
            prompt_token_ids=list(self.prompt),
            token_ids=list(self.output),
            finish_reason=self.finish_reason or "length",
            text=text,
            ttft_s=(self.first_token_s or now_s) - self.arrival_s,
            latency_s=now_s - self.arrival_s,
            cached_tokens={tier.label: self.hit_tokens[tier] for tier in Tier},
            preemptions=self.preemptions,
            swaps=self.swaps,
        )
