"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, with a per-request seed.

:class:`SamplingParams` is validated when it is built (:class:`SamplingError` names the field), so a
bad value never reaches the engine loop. ``temperature == 0`` is greedy decoding (argmax; ``top_k``,
``top_p`` and ``seed`` do not matter then). With ``temperature > 0`` the logits are divided by it,
cut to the ``top_k`` largest (0: no cut), then to the smallest set of tokens whose probability
reaches ``top_p``, renormalised and sampled with the request's own generator: one uniform draw per
token, so a seeded request gives the same tokens however it is batched, chunked or preempted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvtier.engine.errors import EngineInputError


class SamplingError(EngineInputError):
    """A sampling parameter is out of range."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token. The default is greedy decoding of up to 16 tokens.

    ``stop_token_ids``: generation ends after one of these (``None``: the tokenizer's end-of-turn
    and end-of-text tokens); ``ignore_eos``: never stop on a token, only at ``max_tokens``.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SamplingError(f"max_tokens is {self.max_tokens!r}; expected an int >= 1")
        if not _real(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise SamplingError(
                f"temperature is {self.temperature!r}; expected a number in [0, 100] (0 = greedy)"
            )
        if not _real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p is {self.top_p!r}; expected a number in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k is {self.top_k!r}; expected an int >= 0 (0 = no cut)")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64
        ):
            raise SamplingError(f"seed is {self.seed!r}; expected None or an int in [0, 2**64)")
        if self.stop_token_ids is not None:
            stops = tuple(self.stop_token_ids)
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stops):
                raise SamplingError(f"stop_token_ids is {self.stop_token_ids!r}; expected token ids >= 0")
            object.__setattr__(self, "stop_token_ids", stops)
        if not isinstance(self.ignore_eos, bool):
            raise SamplingError(f"ignore_eos is {self.ignore_eos!r}; expected true or false")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def sample(logits: npt.NDArray[np.float32], params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id from one row of logits ``[vocab]``."""
    if params.greedy:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    order = np.argsort(-scaled, kind="stable")  # most likely first; ties by token id
    if params.top_k:
        order = order[: params.top_k]
    top = scaled[order]
    probs = np.exp(top - top[0])
    probs /= probs.sum()
    if params.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1  # smallest set reaching top_p
        probs = probs[:keep] / probs[:keep].sum()
    draw = rng.random()  # exactly one draw per token: reproducible under any batching
    index = min(int(np.searchsorted(np.cumsum(probs), draw, side="right")), probs.size - 1)
    return int(order[index])
