"""Cost models: how long a batch step computes and how long a transfer occupies a link.

The engine only sees the :class:`CostModel` protocol, so the analytical
:class:`RooflineCostModel` here can be swapped for a profile-fitted predictor (Vidur-style: fit
per-operator times measured on a GPU) without touching the engine: implement the protocol and
register a factory in :data:`COST_MODELS` (``make_cost_model`` builds one by name, as the config
does; the factories returning ``CostModel`` are where mypy checks the protocol). ``fitted`` is that
kind of predictor for the CPU reference engine (its coefficients are read here from a calibration
file, :func:`load_calibration`; :mod:`kvtier.sim.calibrate` fits them). ``fixed`` is a trivial
model for tests.

Roofline per step (one engine of ``tp`` GPUs)::

    compute_s   = prefill FLOPs / (tp x peak x mfu_prefill) + decode FLOPs / (tp x peak x mfu_decode)
    memory_s    = (weight bytes read / tp + KV bytes read and written per GPU) / (HBM bw x efficiency)
    allreduce_s = 2 x layers x (latency + 2 (tp-1)/tp x tokens x hidden x dtype / NVLink bw)
    step_s      = max(compute_s, memory_s) + allreduce_s + step_overhead_s;   empty batch: 0

FLOPs are the linear layers for every token in the batch plus attention over cached context and
the causal new tokens (:meth:`ModelProfile.attention_flops`), so prefill grows superlinearly with
context while a small decode batch is bound by reading the weights.

Transfers: ``transfer_work_s = nbytes / bandwidth + segments x per_segment_overhead_s``: small
segments are slow (Strata Fig. 3, SuperInfer Fig. 5 and Table 1), so per-page copies of a paged
layer-first cache cost more than batched copies of the same bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import yaml

from kvtier.errors import ConfigError
from kvtier.sim.hardware import HardwareProfile
from kvtier.sim.machine import REFIT, differences
from kvtier.sim.models import ModelProfile
from kvtier.sim.step_time import StepTimes

log = logging.getLogger("kvtier.sim")

#: Packaged calibration files (``calibration: NAME`` in a sim config names one of them).
CALIBRATIONS = Path(__file__).parent / "profiles" / "calibration"
#: :class:`FittedCostModel`'s coefficients, in the order of :meth:`FittedCostModel.features`.
COEFFICIENTS = ("base_s", "token_s", "pair_s", "seq_s", "decode_pair_s", "multi_token_s")
#: Coefficients added after calibration files were first written: a file without one fitted a
#: model without that term, which is the term at 0.
LATER_COEFFICIENTS = frozenset({"multi_token_s"})
#: What an engine with kvtier's connector adds to a step (a calibration's ``connector:`` section):
#: its per-step work and the per-token part of writing every computed block through to kvtier.
CONNECTOR_COEFFICIENTS = ("base_s", "token_s")


@dataclass(frozen=True)
class PrefillChunk:
    """``new_tokens`` prompt tokens to compute after ``context_tokens`` already in KV."""

    new_tokens: int
    context_tokens: int

    def __post_init__(self) -> None:
        if self.new_tokens < 1 or self.context_tokens < 0:
            raise ConfigError(
                f"prefill chunk of {self.new_tokens} new after {self.context_tokens} cached tokens; "
                "expected new >= 1 and context >= 0"
            )


@dataclass(frozen=True)
class BatchShape:
    """One step's work: prefill chunks and one decode token per running request (its KV length)."""

    prefills: tuple[PrefillChunk, ...] = ()
    decode_context_tokens: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(c.new_tokens for c in self.prefills) + len(self.decode_context_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decode_context_tokens


class CostModel(Protocol):
    """What the engine asks of a cost model. All times in seconds, sizes in bytes."""

    def step_time_s(self, batch: BatchShape) -> float:
        """Wall time of one engine iteration running ``batch``; 0 for an empty batch."""
        ...

    def prefill_time_s(self, new_tokens: int, context_tokens: int = 0) -> float:
        """``step_time_s`` of a batch holding only this prefill chunk."""
        ...

    def transfer_work_s(
        self, nbytes: int, segment_bytes: int, bandwidth_bytes_per_s: float, per_segment_overhead_s: float
    ) -> float:
        """Seconds ``nbytes`` in ``segment_bytes`` pieces take on an otherwise idle link."""
        ...

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token on one GPU of the engine."""
        ...

    @property
    def num_layers(self) -> int: ...


def engine_kv_bytes_per_token(cost: CostModel, tp: int) -> int:
    """KV bytes per token of a whole engine of ``tp`` GPUs: ``tp`` times one GPU's
    ``cost.kv_bytes_per_token``, since each GPU holds its own part of every token (its shard of the
    KV heads; its own copy of a replicated MLA latent or of KV heads fewer than ``tp``).

    HBM is per GPU (device blocks: one GPU's bytes); what the engine stores below the device and
    moves (swaps, loads, offloads, the P/D hand-off) is the whole engine's bytes, carried over the
    links of ``tp`` GPUs (the simulator's links are ``tp`` side by side): each GPU's part over its own."""
    if tp < 1:
        raise ConfigError(f"tp is {tp}; expected >= 1")
    return cost.kv_bytes_per_token * tp


def transfer_work_s(
    nbytes: int, segment_bytes: int, bandwidth_bytes_per_s: float, per_segment_overhead_s: float
) -> float:
    """``nbytes / bandwidth + ceil(nbytes / segment_bytes) x overhead``; 0 for 0 bytes."""
    if nbytes < 0 or segment_bytes < 1 or not bandwidth_bytes_per_s > 0 or per_segment_overhead_s < 0:
        raise ConfigError(
            f"transfer of {nbytes} B in {segment_bytes} B segments at {bandwidth_bytes_per_s} B/s "
            f"(+{per_segment_overhead_s} s/segment): expected nbytes >= 0, segment >= 1, bandwidth > 0"
        )
    if nbytes == 0:
        return 0.0
    segments = -(-nbytes // segment_bytes)
    return nbytes / bandwidth_bytes_per_s + segments * per_segment_overhead_s


def link_efficiency(segment_bytes: int, bandwidth_bytes_per_s: float, per_segment_overhead_s: float) -> float:
    """Fraction of ``bandwidth`` reached with ``segment_bytes`` segments (1 for large segments)."""
    work = transfer_work_s(segment_bytes, segment_bytes, bandwidth_bytes_per_s, per_segment_overhead_s)
    return segment_bytes / bandwidth_bytes_per_s / work


@dataclass(frozen=True)
class StepCost:
    """The parts of one step's time (for reports and layerwise overlap)."""

    compute_s: float
    memory_s: float
    allreduce_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.allreduce_s + self.overhead_s


_ZERO = StepCost(0.0, 0.0, 0.0, 0.0)

# Defaults, each an assumption to be replaced by a fitted predictor where a GPU is at hand:
# - MFU_PREFILL 0.5: large bf16 GEMMs reach ~70-80% of the dense peak on Hopper and FlashAttention-3
#   ~75%, but end-to-end prefill in vLLM/SGLang (norms, rotary, sampling, launch gaps) lands at
#   ~40-60% of peak for long prompts.
# - MFU_DECODE 0.35: decode GEMMs have few rows (one per running request), so even when a large
#   batch makes them compute bound they run well below the prefill efficiency.
# - BANDWIDTH_EFFICIENCY 0.8: streaming kernels reach ~90% of HBM peak; decode's GEMV and paged
#   attention reads reach ~75-85%.
# - STEP_OVERHEAD_S 1 ms: per-iteration scheduling, input preparation and launch time not hidden
#   behind the GPU; the vLLM V1 design notes call this material against ~5 ms Llama-8B/H100 steps.
# - ALLREDUCE_LATENCY_S 8 us: a small-message all-reduce on NVLink (decode's few KB-MB) is latency
#   bound at ~5-10 us (NCCL LL protocol, vLLM custom all-reduce); two per layer add up.
MFU_PREFILL = 0.5
MFU_DECODE = 0.35
BANDWIDTH_EFFICIENCY = 0.8
STEP_OVERHEAD_S = 1e-3
ALLREDUCE_LATENCY_S = 8e-6


@dataclass(frozen=True)
class RooflineCostModel:
    """Analytical step times from a hardware and a model profile (see the module docs)."""

    hardware: HardwareProfile
    model: ModelProfile
    tp: int = 1
    mfu_prefill: float = MFU_PREFILL
    mfu_decode: float = MFU_DECODE
    bandwidth_efficiency: float = BANDWIDTH_EFFICIENCY
    step_overhead_s: float = STEP_OVERHEAD_S
    allreduce_latency_s: float = ALLREDUCE_LATENCY_S

    def __post_init__(self) -> None:
        heads, kv_heads = self.model.num_attention_heads, self.model.num_kv_heads
        if self.tp < 1 or heads % self.tp != 0:
            raise ConfigError(f"tp is {self.tp}; expected >= 1 and dividing {heads} attention heads")
        if not self.model.is_mla and kv_heads % self.tp != 0 and self.tp % kv_heads != 0:
            raise ConfigError(f"tp {self.tp} neither divides nor is a multiple of {kv_heads} KV heads")
        for name in ("mfu_prefill", "mfu_decode", "bandwidth_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ConfigError(f"{name} is {value}; expected in (0, 1]")
        if self.step_overhead_s < 0 or self.allreduce_latency_s < 0:
            raise ConfigError("step_overhead_s and allreduce_latency_s must be >= 0")

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token_per_gpu(self.tp)

    @property
    def num_layers(self) -> int:
        return self.model.num_layers

    def step_time_s(self, batch: BatchShape) -> float:
        # step_cost(batch).total_s, the same float, with its constants read once (sim/step_time.py)
        return self.step_times.step_s(batch.prefills, batch.decode_context_tokens)

    def prefill_time_s(self, new_tokens: int, context_tokens: int = 0) -> float:
        return self.step_times.step_s((PrefillChunk(new_tokens, context_tokens),), ())

    def transfer_work_s(
        self, nbytes: int, segment_bytes: int, bandwidth_bytes_per_s: float, per_segment_overhead_s: float
    ) -> float:
        return transfer_work_s(nbytes, segment_bytes, bandwidth_bytes_per_s, per_segment_overhead_s)

    def step_cost(self, batch: BatchShape) -> StepCost:
        """The roofline parts of one step; all zero for an empty batch."""
        if batch.is_empty:
            return _ZERO
        m = self.model
        gpu_flops = self.tp * self.hardware.gpu_bf16_flops_per_s
        prefill_flops = sum(
            c.new_tokens * m.linear_flops_per_token + m.attention_flops(c.new_tokens, c.context_tokens)
            for c in batch.prefills
        )
        linear, pair_flops = m.linear_flops_per_token, m.dense_pair_flops  # once, not per decode
        contexts = batch.decode_context_tokens
        if pair_flops is None:
            attention = m.attention_flops
            decode_flops = sum([linear + attention(1, ctx) for ctx in contexts])
        else:  # attention_flops(1, ctx) inline: ctx + 1.0 pairs (the same float, one call fewer a decode)
            decode_flops = sum([linear + pair_flops * (ctx + 1.0) for ctx in contexts])
        compute_s = prefill_flops / (gpu_flops * self.mfu_prefill) + decode_flops / (
            gpu_flops * self.mfu_decode
        )

        num_tokens = batch.num_tokens
        kv_tokens = sum(c.context_tokens + c.new_tokens for c in batch.prefills)
        kv_tokens += sum(contexts) + len(contexts)  # read each context, write one token
        memory_bytes = m.weight_bytes_read(num_tokens) / self.tp + kv_tokens * self.kv_bytes_per_token
        memory_s = memory_bytes / (self.hardware.hbm_bytes_per_s * self.bandwidth_efficiency)
        return StepCost(compute_s, memory_s, self.allreduce_s(num_tokens), self.step_overhead_s)

    def decode_step_time_s(self, contexts: Sequence[int]) -> float:
        """``step_time_s(BatchShape((), contexts))`` (decodes only): the same float."""
        return self.step_times.decode_s(contexts)

    @cached_property
    def step_times(self) -> StepTimes:
        """Step times by fewer operations, and a decode run's (the fast-forward's), to the bit."""
        return StepTimes(self)

    def allreduce_s(self, num_tokens: int) -> float:
        """Two ring all-reduces per layer of the ``num_tokens x hidden`` activations; 0 for tp 1.

        Without NVLink (L40S) the reduce runs peer to peer over the host link.
        """
        if self.tp == 1 or num_tokens == 0:
            return 0.0
        hw = self.hardware
        link = hw.nvlink_bytes_per_s or min(hw.host_link.h2d_bytes_per_s, hw.host_link.d2h_bytes_per_s)
        nbytes = num_tokens * self.model.hidden_size * self.model.dtype_bytes
        one = self.allreduce_latency_s + 2 * (self.tp - 1) / self.tp * nbytes / link
        return 2 * self.model.num_layers * one


@dataclass(frozen=True)
class FixedCostModel:
    """A step costs ``step_s + per_token_s x tokens``; for engine tests that want simple numbers."""

    kv_bytes_per_token: int
    num_layers: int
    step_s: float = 1e-3
    per_token_s: float = 1e-5

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token < 1 or self.num_layers < 1 or self.step_s < 0 or self.per_token_s < 0:
            raise ConfigError(f"bad FixedCostModel {self}")

    def step_time_s(self, batch: BatchShape) -> float:
        return 0.0 if batch.is_empty else self.step_s + self.per_token_s * batch.num_tokens

    def prefill_time_s(self, new_tokens: int, context_tokens: int = 0) -> float:
        return self.step_time_s(BatchShape((PrefillChunk(new_tokens, context_tokens),)))

    def transfer_work_s(
        self, nbytes: int, segment_bytes: int, bandwidth_bytes_per_s: float, per_segment_overhead_s: float
    ) -> float:
        return transfer_work_s(nbytes, segment_bytes, bandwidth_bytes_per_s, per_segment_overhead_s)


@dataclass(frozen=True)
class FittedCostModel:
    """Step times fitted to an engine's measured steps (``kvtier sim calibrate``, Vidur-style)::

        step_s = base_s + token_s x new tokens + pair_s x prefill attention pairs
                 + decode_pair_s x decode attention pairs + seq_s x sequences
                 + multi_token_s x [two or more new tokens]

    where attention pairs are the (query, key) pairs the step's attention scores: ``new x context +
    new (new + 1) / 2`` per prefill chunk, ``context`` per decode (the simulator's decode context
    counts the token it decodes; a decode reads its whole context for one query: memory bound,
    unlike a prefill's GEMMs, hence its own rate). Empty: 0.
    ``multi_token_s`` is the step that computes more than one token row: the reference engine's
    weight products of a one-token step run as matrix-vector products (OpenBLAS forwards a
    one-row GEMM to GEMV), about 35 ms for SmolLM2, while two rows already cost about 70 ms
    (docs/simulator.md, "Where the fitted model holds").
    """

    kv_bytes_per_token: int
    num_layers: int
    base_s: float
    token_s: float
    pair_s: float
    seq_s: float
    decode_pair_s: float = 0.0
    multi_token_s: float = 0.0

    def __post_init__(self) -> None:
        coefficients = (
            self.base_s, self.token_s, self.pair_s, self.seq_s, self.decode_pair_s, self.multi_token_s
        )  # fmt: skip
        if self.kv_bytes_per_token < 1 or self.num_layers < 1 or min(coefficients) < 0:
            raise ConfigError(f"bad FittedCostModel {self}: sizes >= 1 and coefficients >= 0 expected")

    @staticmethod
    def features(batch: BatchShape) -> tuple[float, float, float, float, float, float]:
        """``(1, tokens, prefill pairs, sequences, decode pairs, [tokens >= 2])``: what the
        coefficients multiply, in the order of :data:`COEFFICIENTS`."""
        pairs = sum(
            c.new_tokens * c.context_tokens + c.new_tokens * (c.new_tokens + 1) / 2 for c in batch.prefills
        )
        decode_pairs = sum(batch.decode_context_tokens)
        seqs = len(batch.prefills) + len(batch.decode_context_tokens)
        multi = float(batch.num_tokens >= 2)
        return (1.0, float(batch.num_tokens), float(pairs), float(seqs), float(decode_pairs), multi)

    def step_time_s(self, batch: BatchShape) -> float:
        if batch.is_empty:
            return 0.0
        _, tokens, pairs, seqs, decode_pairs, multi = self.features(batch)
        return (
            self.base_s + self.token_s * tokens + self.pair_s * pairs + self.seq_s * seqs
            + self.decode_pair_s * decode_pairs + self.multi_token_s * multi
        )  # fmt: skip

    def prefill_time_s(self, new_tokens: int, context_tokens: int = 0) -> float:
        return self.step_time_s(BatchShape((PrefillChunk(new_tokens, context_tokens),)))

    def transfer_work_s(
        self, nbytes: int, segment_bytes: int, bandwidth_bytes_per_s: float, per_segment_overhead_s: float
    ) -> float:
        return transfer_work_s(nbytes, segment_bytes, bandwidth_bytes_per_s, per_segment_overhead_s)


def read_calibration(name_or_path: str) -> dict[str, Any]:
    """A calibration file as written (coefficients checked): a path, or a name under
    ``profiles/calibration``."""
    path = Path(name_or_path)
    if not path.exists():
        path = CALIBRATIONS / f"{name_or_path}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in CALIBRATIONS.glob("*.yaml"))
        raise ConfigError(f"calibration {name_or_path!r} is neither a file nor one of {known}")
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ConfigError(
            f"calibration {path} is not a mapping of coefficients; rerun `kvtier sim calibrate`"
        )
    data = {**{k: 0.0 for k in LATER_COEFFICIENTS}, **data}
    missing = [k for k in COEFFICIENTS if not isinstance(data.get(k), (int, float))]
    if missing:
        raise ConfigError(f"calibration {path} lacks numeric {missing}; rerun `kvtier sim calibrate`")
    negative = [k for k in COEFFICIENTS if data[k] < 0]
    if negative:
        raise ConfigError(f"calibration {path} has negative {negative}; rerun `kvtier sim calibrate`")
    return dict(data)


def load_calibration(name_or_path: str, connector: bool = False) -> dict[str, float]:
    """The coefficients of a calibration file (see :func:`read_calibration`). One fitted on another
    kind of machine (:mod:`kvtier.sim.machine`) is logged once, with the command that refits it.
    ``connector``: the engine runs kvtier's connector, so each coefficient gains the connector's
    measured increment (the file's ``connector:`` section, :data:`CONNECTOR_COEFFICIENTS`, fitted
    by ``kvtier sim calibrate --engine vllm`` on the same workload with the connector configured);
    a calibration without that section is refused."""
    data = read_calibration(name_or_path)
    differs = differences(data.get("machine"))
    if differs and name_or_path not in _WARNED:
        _WARNED.add(name_or_path)
        log.warning(
            "calibration %s was not fitted on this machine (%s): its step times may not hold here; "
            "refit with `%s`", name_or_path, "; ".join(differs), REFIT,
        )  # fmt: skip
    out = {k: float(data[k]) for k in COEFFICIENTS}
    if connector:
        section = data.get("connector")
        if not isinstance(section, dict):
            raise ConfigError(
                f"calibration {name_or_path} has no `connector` section (its engine was not timed with "
                "kvtier's connector); refit with `kvtier sim calibrate --engine vllm`"
            )
        bad = [
            k
            for k in CONNECTOR_COEFFICIENTS
            if not isinstance(section.get(k), (int, float)) or section[k] < 0
        ]
        if bad:
            raise ConfigError(f"calibration {name_or_path}: `connector` lacks non-negative {bad}")
        for k in CONNECTOR_COEFFICIENTS:
            out[k] += float(section[k])
    return out


_WARNED: set[str] = set()


def _make_roofline(hardware: HardwareProfile, model: ModelProfile, **params: Any) -> CostModel:
    return RooflineCostModel(hardware, model, **params)


def _make_fixed(hardware: HardwareProfile, model: ModelProfile, **params: Any) -> CostModel:
    tp = params.pop("tp", 1)
    return FixedCostModel(model.kv_bytes_per_token_per_gpu(tp), model.num_layers, **params)


def _make_fitted(hardware: HardwareProfile, model: ModelProfile, **params: Any) -> CostModel:
    tp = params.pop("tp", 1)
    if tp != 1:
        raise ConfigError(f"a fitted cost model describes one calibrated engine; tp is {tp}, expected 1")
    connector = bool(params.pop("connector", False))  # kvtier's connector configured (vLLM's steps)
    if "calibration" in params:  # a file written by `kvtier sim calibrate`, or a packaged one's name
        params = {**load_calibration(str(params.pop("calibration")), connector), **params}
    elif connector:
        raise ConfigError("`connector: true` needs `calibration:` (its connector section is measured)")
    return FittedCostModel(model.kv_bytes_per_token_per_gpu(1), model.num_layers, **params)


COST_MODELS: Mapping[str, Callable[..., CostModel]] = {
    "roofline": _make_roofline,
    "fixed": _make_fixed,
    "fitted": _make_fitted,
}


def make_cost_model(kind: str, hardware: HardwareProfile, model: ModelProfile, **params: Any) -> CostModel:
    """Build the cost model registered as ``kind`` with keyword ``params`` (e.g. ``tp=2``)."""
    if kind not in COST_MODELS:
        raise ConfigError(f"unknown cost model {kind!r}; known: {', '.join(sorted(COST_MODELS))}")
    try:
        return COST_MODELS[kind](hardware, model, **params)
    except TypeError as exc:
        raise ConfigError(f"cost model {kind!r}: bad parameters {sorted(params)}: {exc}") from exc
