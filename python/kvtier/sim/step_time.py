"""Step times of the roofline (:class:`kvtier.sim.cost.RooflineCostModel`), to the bit and with
less Python per step: every step the engine plans (:meth:`StepTimes.step_s`), and the decode-only
ones the decode fast-forward (:mod:`kvtier.sim.fast_forward`) plans most steps of a sized cluster
with (issue 20: ~0.9M steps on the 12K-request trace), one at a time or a run of them.

Invariant: every time here is the float :meth:`RooflineCostModel.step_cost` gives (``total_s``), by
the same operations in the same order (``tests/sim/test_cost.py`` checks it), with what does not
change between steps (the rates, the FLOPs per token and pair, the weights read and the all-reduce
time of a batch size) computed once; a closed form that sums differently would move every later
event by the last bits.

What makes it cheaper without changing a bit: ``step_s = max(compute_s, memory_s) + allreduce_s +
overhead_s``, and a small decode batch is bound by reading the weights, so ``max`` returns
``memory_s`` whatever ``compute_s``'s last bits are. The decode FLOPs are a sum of non-negative
terms, so ``n x linear + pair x (sum of contexts + n)`` bounds them to within ``(n + 3)`` roundings
(relative ``< n x 2^-52``); with a ``1e-6`` margin over it, ``compute_s < memory_s`` is then certain and
the per-decode sum is skipped. Otherwise (compute bound, or sparse attention, whose FLOPs per pair
are not one constant) it is summed as :meth:`RooflineCostModel.step_cost` sums it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from kvtier.sim.hardware import HardwareProfile
from kvtier.sim.models import ModelProfile

#: Above the bound's relative rounding error (``n x 2^-52``) for any batch below ``10^9`` decodes.
_MARGIN = 1.0 + 1e-6


class _Chunk(Protocol):
    """A prefill chunk (:class:`kvtier.sim.cost.PrefillChunk`)."""

    @property
    def new_tokens(self) -> int: ...
    @property
    def context_tokens(self) -> int: ...


class _Roofline(Protocol):
    """What is read of :class:`kvtier.sim.cost.RooflineCostModel` (which builds a :class:`StepTimes`)."""

    @property
    def hardware(self) -> HardwareProfile: ...
    @property
    def model(self) -> ModelProfile: ...
    @property
    def tp(self) -> int: ...
    @property
    def mfu_prefill(self) -> float: ...
    @property
    def mfu_decode(self) -> float: ...
    @property
    def bandwidth_efficiency(self) -> float: ...
    @property
    def step_overhead_s(self) -> float: ...
    @property
    def kv_bytes_per_token(self) -> int: ...

    def allreduce_s(self, num_tokens: int) -> float: ...


class StepTimes:
    """A roofline's step time of a batch, of a decode-only one, and of a run of those (contexts + 1
    a step)."""

    def __init__(self, cost: _Roofline) -> None:
        m, hw = cost.model, cost.hardware
        self._cost = cost
        # step_cost's floats, read once: the same values it computes every step.
        self._linear = m.linear_flops_per_token
        self._pair_flops = m.dense_pair_flops
        gpu_flops = cost.tp * hw.gpu_bf16_flops_per_s
        self._prefill_rate = gpu_flops * cost.mfu_prefill
        self._compute_rate = gpu_flops * cost.mfu_decode  # the decodes'
        self._kv_bytes = cost.kv_bytes_per_token
        self._memory_rate = hw.hbm_bytes_per_s * cost.bandwidth_efficiency
        self._overhead_s = cost.step_overhead_s
        # The bound needs non-negative terms (true of every profile; else always sum).
        self._bounded = self._pair_flops is not None and self._pair_flops >= 0 and self._linear >= 0
        self._per_n: dict[int, tuple[float, float]] = {}  # weights read, all-reduce time by tokens

    def step_s(self, prefills: Sequence[_Chunk], contexts: Sequence[int]) -> float:
        """``step_cost(BatchShape(prefills, contexts)).total_s``: the same float; 0 for no work."""
        if not prefills:
            return self.decode_s(contexts)
        m, linear, pair_flops = self._cost.model, self._linear, self._pair_flops
        prefill_flops = sum(
            c.new_tokens * linear + m.attention_flops(c.new_tokens, c.context_tokens) for c in prefills
        )
        if pair_flops is None:
            attention = m.attention_flops
            decode_flops = sum([linear + attention(1, ctx) for ctx in contexts])
        else:  # attention_flops(1, ctx) inline: ctx + 1.0 pairs (the same float, one call fewer a decode)
            decode_flops = sum([linear + pair_flops * (ctx + 1.0) for ctx in contexts])
        compute_s = prefill_flops / self._prefill_rate + decode_flops / self._compute_rate
        num_tokens = kv_tokens = 0  # ints: any order is exact
        for c in prefills:
            num_tokens += c.new_tokens
            kv_tokens += c.context_tokens + c.new_tokens
        num_tokens += len(contexts)
        kv_tokens += sum(contexts) + len(contexts)  # read each context, write one token
        weights, allreduce = self._per_n.get(num_tokens) or self._weights_and_allreduce(num_tokens)
        memory_s = (weights + kv_tokens * self._kv_bytes) / self._memory_rate
        return max(compute_s, memory_s) + allreduce + self._overhead_s

    def decode_s(self, contexts: Sequence[int]) -> float:
        """``step_s((), contexts)``: the same float."""
        n = len(contexts)
        if n == 0:
            return 0.0
        weights, allreduce = self._per_n.get(n) or self._weights_and_allreduce(n)
        # step_cost adds 0 (no prefill) to the KV tokens and 0.0 to the FLOPs: no change to either.
        memory_s = (weights + (sum(contexts) + n) * self._kv_bytes) / self._memory_rate
        return max(self._compute_s(contexts, 0, memory_s), memory_s) + allreduce + self._overhead_s

    def decode_run_s(self, contexts: Sequence[int], slowdown: float) -> Iterator[float]:
        """``decode_s(c) * slowdown`` for ``c`` = ``contexts``, then each context + 1, + 2, ...:
        the steps of a decode run (every decode adds a token to its context), endless."""
        n = len(contexts)
        if n == 0:
            while True:
                yield 0.0 * slowdown
        weights, allreduce = self._per_n.get(n) or self._weights_and_allreduce(n)
        kv_bytes, memory_rate, overhead_s = self._kv_bytes, self._memory_rate, self._overhead_s
        kv_tokens = sum(contexts) + n  # read each context, write one token: + n a step
        linear_n = n * self._linear
        pair_flops = self._pair_flops if self._bounded else None
        compute_rate = self._compute_rate
        advance = 0
        while True:
            memory_s = (weights + kv_tokens * kv_bytes) / memory_rate
            if (
                pair_flops is not None
                and (linear_n + pair_flops * kv_tokens) * _MARGIN / compute_rate < memory_s
            ):
                yield (memory_s + allreduce + overhead_s) * slowdown  # max(compute_s, memory_s) is memory_s
            else:
                compute_s = self._compute_s(contexts, advance, memory_s)
                yield (max(compute_s, memory_s) + allreduce + overhead_s) * slowdown
            kv_tokens += n
            advance += 1

    def _compute_s(self, contexts: Sequence[int], advance: int, memory_s: float) -> float:
        """The decode FLOPs' time of ``contexts`` each + ``advance``, as step_cost computes it; or
        0.0 where the bound shows it below ``memory_s`` (then ``max`` ignores it)."""
        linear, pair_flops = self._linear, self._pair_flops
        n = len(contexts)
        if self._bounded and pair_flops is not None:
            bound = (n * linear + pair_flops * (sum(contexts) + n * (advance + 1))) * _MARGIN
            if bound / self._compute_rate < memory_s:
                return 0.0
        if pair_flops is None:
            attention = self._cost.model.attention_flops
            decode_flops = sum([linear + attention(1, ctx + advance) for ctx in contexts])
        else:  # attention_flops(1, ctx) inline: ctx + 1.0 pairs (the same float)
            decode_flops = sum([linear + pair_flops * (ctx + advance + 1.0) for ctx in contexts])
        return decode_flops / self._compute_rate

    def _weights_and_allreduce(self, n: int) -> tuple[float, float]:
        cost = self._cost
        pair = self._per_n[n] = (cost.model.weight_bytes_read(n) / cost.tp, cost.allreduce_s(n))
        return pair
