"""``shadowserve_async``: ShadowServe's control plane (asynchronous fetching with batch interception,
§4.1) over its SmartNIC data plane (the four-stage chunked pipeline, §4.2-§4.3).

**Batch interception (§4.1, Fig. 6).** Each iteration the scheduler forms its batch FCFS: running
requests first (decodes, and the last prompt tokens of requests back from a fetch), then waiting
requests while the token budget, the running bound and the device blocks allow. A new request's
whole prompt is given device blocks when it is first scheduled (vLLM's lazy allocation, §4.1: the
fetch can start only after it). The KV cache manager then makes its two-way exchange, atomic from the
scheduler's view:

1. every newly scheduled *prefill* whose prompt KV is held below the device (the remote store) is
   stripped from the batch and put in the fetching queue: a :class:`LoadOrder` with
   ``mode=ASYNC, target=Tier.DEVICE``. The engine takes the request out of the running set
   (``Phase.FETCHING``) while the others keep computing. Decodes are never intercepted.
2. requests whose fetch completed rejoin the scheduler: the engine puts them back in the running
   set when their KV has landed (``Engine._start_fetch``), and the next batch gives them their last
   prompt token, piggybacked on the decodes. The last token is never fetched: "marking the last
   token of the request as not yet prefilled" lets the first output token be sampled from real
   hidden states (the engine always computes >= 1 prompt token).

The manager's fetching queue is FIFO and it fetches one request at a time ("simple FIFO queues; the
manager processes fetch jobs serially", §4.1). kvtier starts every intercepted fetch at once (so each
holds its device blocks from interception on, as in the paper) but gives each a lower link priority
class than those queued before it; kvtier's links serve the most urgent class only, so the head of
the queue has every stage to itself and the rest wait: serial FIFO fetching.

**Data plane (§4.2, §6.3).** A fetch crosses network -> lossless decompression (Deflate, on the
BlueField-3 accelerator) -> dequantization (Arm cores) -> DMA into GPU memory, chunk by chunk (256
tokens, §5), so the four stages overlap and the slowest sets the rate. The engine models a
compressed fetch as concurrent stages: the store link carries ``raw / compression_ratio`` bytes, a
decoder stage runs at ``decode_bytes_per_s`` (raw bytes), and the host link carries raw bytes
(``decode_on_device=False``: the SmartNIC DMAs decoded KV over PCIe). :class:`ChunkedPipeline`
gives the decoder stage the SmartNIC's throughput: the slowest of its four stages *while they run
together* (Fig. 13b), in raw KV bytes. That is the network stage, which the SoC's memory system
holds to 20.6 Gbps (§6.3): so above ~20 Gbps of link bandwidth ShadowServe stops getting faster
(§6.2.2, Fig. 11b).

**Bounded buffers and rounds (§4.3).** ShadowServe stages a request through fixed 0.5 GiB buffers
in rounds of chunks and scatters each round into paged KV with one small GPU kernel. The buffers sit
outside the KV pool and the per-round pipeline fill (a few ms against ~0.1-1 s fetches) is not
modelled; what bounds fetching here is the serial FIFO queue and the device blocks each intercepted
request holds. The scatter kernel's interference is ``interference`` (default 0: "this memory copy
kernel causes negligible overhead", §4.3).

``fetch_mode="sync"`` is the paper's "No AF" ablation (§6.4): the same data plane, but the fetch
blocks the step (``LoadMode.SYNC``), so running decodes wait for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError
from kvtier.sched.base import (
    LoadMode,
    LoadOrder,
    Policy,
    RequestView,
    SchedulerDecision,
    SchedulerView,
    register,
)
from kvtier.sched.batching import blocks_for, reusable_tokens, schedule_running
from kvtier.tiers import Tier

GBPS = 1e9 / 8  # bytes per second in one Gbit/s

FETCH_MODES = ("async", "sync")


@dataclass(frozen=True)
class ChunkedPipeline:
    """ShadowServe's SmartNIC data plane: four pipelined stages, each with its measured throughput
    while all run together (§6.3, Fig. 13b), and the compression the stored KV went through.

    Throughputs are bytes per second of each stage's *output* unless named otherwise. The pipeline's
    rate is its slowest stage's, expressed in raw (decoded) KV bytes so that stages with different
    input and output sizes compare.
    """

    # Network (XLIO TCP on 2 Arm cores): 37.3 Gbps standalone, 20.6 Gbps with the other stages
    # running (§6.3, Fig. 13b: inter-stage memory contention on the SoC). Compressed bytes.
    network_bytes_per_s: float = 20.6 * GBPS
    # Deflate on the BlueField-3 accelerator: ~280 Gbps output standalone (§6.3; 276.5 in Table 1),
    # 27% less in the pipeline (§6.3). Output is quantized bytes.
    decompress_out_bytes_per_s: float = 280.0 * (1 - 0.27) * GBPS
    # Dequantization on 14 Arm cores with Neon: 83.5 Gbps in, 167 Gbps out, unchanged in the
    # pipeline (§6.3). Output is raw KV.
    dequantize_out_bytes_per_s: float = 167.0 * GBPS
    # DMA engine into GPU memory: 230 Gbps standalone, 24% less in the pipeline (§6.3). Raw KV.
    copy_bytes_per_s: float = 230.0 * (1 - 0.24) * GBPS
    # Vector-wise quantization "exactly halves the original data size" (§4.3).
    quantization_ratio: float = 2.0
    # Deflate on the quantized KV: §6.3 picks "a chunk size of 6 MB (256 tokens)" at the network
    # stage, i.e. 6 MiB on the wire for 256 Llama-8B tokens that are 32 MiB raw (128 KiB/token in
    # bf16): 32/6 overall, so Deflate adds 32/6/2 = 2.67x. (That the 6 MB is the compressed chunk is
    # our reading: it is the network stage's input chunk that Fig. 13a sweeps.)
    deflate_ratio: float = 32.0 / 6.0 / 2.0

    def __post_init__(self) -> None:
        for name in (
            "network_bytes_per_s",
            "decompress_out_bytes_per_s",
            "dequantize_out_bytes_per_s",
            "copy_bytes_per_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"chunked pipeline `{name}` is {getattr(self, name)}; expected > 0")
        if self.quantization_ratio < 1 or self.deflate_ratio < 1:
            raise ConfigError("chunked pipeline compression ratios must be >= 1")

    @property
    def compression_ratio(self) -> float:
        """Raw KV bytes per byte on the wire."""
        return self.quantization_ratio * self.deflate_ratio

    def stage_raw_bytes_per_s(self) -> dict[str, float]:
        """Each stage's throughput in raw KV bytes per second."""
        return {
            "network": self.network_bytes_per_s * self.compression_ratio,
            "decompress": self.decompress_out_bytes_per_s * self.quantization_ratio,
            "dequantize": self.dequantize_out_bytes_per_s,
            "copy": self.copy_bytes_per_s,
        }

    def raw_bytes_per_s(self) -> float:
        """The pipeline's rate (its slowest stage), in raw KV bytes per second."""
        return min(self.stage_raw_bytes_per_s().values())

    def bottleneck(self) -> str:
        stages = self.stage_raw_bytes_per_s()
        return min(stages, key=stages.__getitem__)


BLUEFIELD3 = ChunkedPipeline()


class BatchInterception(Policy):
    """Asynchronous fetching with batch interception (§4.1), shared by ShadowServe and the
    CacheGen-Async baseline (which the paper equips with this same design, §6.1). Subclasses say
    how a fetch moves its bytes: ``compression_ratio``, ``decode_bytes_per_s``, where decoding runs
    (``decode_on_device``) and how much it slows the model (:meth:`fetch_interference`)."""

    offload: str = "none"  # §6.1: local prefix caching disabled; KV comes from the store
    decode_on_device: bool = False
    compression_ratio: float
    decode_bytes_per_s: float

    def __init__(self, fetch_mode: str = "async", serial_fetch: bool = True) -> None:
        if fetch_mode not in FETCH_MODES:
            raise ConfigError(f"fetch_mode is {fetch_mode!r}; expected one of {list(FETCH_MODES)}")
        self.fetch_mode = fetch_mode
        self.serial_fetch = serial_fetch
        self._fetch_class: dict[int, int] = {}  # req_id -> link priority class of its fetch

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        decision = SchedulerDecision()
        # Running requests first: decodes, and the last prompt token of requests whose fetch has
        # completed (② in Fig. 6, "piggybacked immediately in the next batch").
        budget = schedule_running(view, decision)
        self._admit_and_intercept(view, decision, budget)
        return decision

    def forget_landed(self, view: SchedulerView) -> None:
        """Drops the fetch classes of requests no longer fetching (their fetch has landed)."""
        fetching = {r.req_id for r in view.fetching}
        self._fetch_class = {rid: c for rid, c in self._fetch_class.items() if rid in fetching}

    def intercept(self, view: SchedulerView, r: RequestView, tokens: int) -> LoadOrder:
        """① in Fig. 6: ``r`` goes to the fetching queue, behind the fetches already queued."""
        priority = self._next_class()
        if self.serial_fetch:
            self._fetch_class[r.req_id] = priority
        return self.fetch_order(view, r, tokens, LoadMode.ASYNC, priority)

    def _admit_and_intercept(self, view: SchedulerView, decision: SchedulerDecision, budget: int) -> None:
        self.forget_landed(view)
        # Keep a block per running request free, so decodes can grow without preempting anyone
        # (vLLM keeps a watermark of free blocks when it admits; kvtier preempts by recompute).
        free_blocks = view.free_device_blocks - len(view.running)
        running = len(view.running)
        scheduled = 0  # requests this loop put in the batch
        for r in view.waiting:
            if budget <= 0 or running >= view.max_running:
                break
            # The whole prompt gets its blocks at first scheduling (§4.1); FCFS, no overtaking.
            need = blocks_for(r.prompt_tokens, view.block_tokens) - blocks_for(
                r.cached_tokens[Tier.DEVICE], view.block_tokens
            )
            if need > free_blocks:
                break
            free_blocks -= need
            reused = reusable_tokens(r, True)
            fetched = reused - r.cached_tokens[Tier.DEVICE]
            new_tokens = r.prompt_tokens - r.cached_tokens[Tier.DEVICE]  # what the scheduler put in its batch
            if fetched <= 0:  # not in the store: an ordinary prefill
                decision.prefill.append((r.req_id, min(r.prompt_tokens - reused, budget)))
                budget -= new_tokens
                running += 1
                scheduled += 1
                continue
            if new_tokens > budget and scheduled:  # no chunked prefill (§4.1): the whole prompt fits
                break
            budget -= new_tokens  # the scheduler counted it before the manager stripped it
            scheduled += 1
            if self.fetch_mode == "sync":  # No AF (§6.4): the step waits for the fetch
                decision.loads.append(self.fetch_order(view, r, fetched, LoadMode.SYNC, 1))
                decision.prefill.append((r.req_id, r.prompt_tokens - reused))
                running += 1
                continue
            decision.loads.append(self.intercept(view, r, fetched))

    def _next_class(self) -> int:
        """The link priority class of the next fetch: one after every queued fetch (FIFO), so it
        waits for them on every stage; 1 (the class of ordinary loads) when none is queued.

        Classes above 2 rank below write-backs (``EngineConfig.offload_priority``); this policy
        writes nothing back (``offload = "none"``)."""
        if not self.serial_fetch:
            return 1
        return max(self._fetch_class.values(), default=0) + 1

    def fetch_interference(self, view: SchedulerView, r: RequestView, tokens: int) -> float:
        """How much a fetch of ``tokens`` slows the model's compute while it runs."""
        raise NotImplementedError

    def fetch_order(
        self, view: SchedulerView, r: RequestView, tokens: int, mode: LoadMode, priority: int
    ) -> LoadOrder:
        return LoadOrder(
            r.req_id,
            tokens,
            mode,
            priority=priority,
            target=Tier.DEVICE,
            interference=self.fetch_interference(view, r, tokens),
            compression_ratio=self.compression_ratio,
            decode_bytes_per_s=self.decode_bytes_per_s,
            decode_on_device=self.decode_on_device,
        )

    def params(self) -> dict[str, Any]:
        return {"fetch_mode": self.fetch_mode, "serial_fetch": self.serial_fetch}


def store_tier(r: RequestView) -> Tier:
    """The slowest tier holding part of ``r``'s cached prefix (what a fetch waits on)."""
    for tier in (Tier.REMOTE, Tier.SSD, Tier.HOST):
        if r.cached_tokens[tier] > 0:
            return tier
    return Tier.HOST


@register
class ShadowServeAsync(BatchInterception):
    name = "shadowserve_async"

    def __init__(
        self,
        fetch_mode: str = "async",
        serial_fetch: bool = True,
        compression_ratio: float | None = None,
        decode_bytes_per_s: float | None = None,
        interference: float = 0.0,
        store_writes: bool = False,
    ) -> None:
        super().__init__(fetch_mode, serial_fetch)
        # §6.1 runs against a store that other servers filled (a preloaded tier here). In a run
        # with no preload, ``store_writes`` lets this engine fill the store itself: computed prompt
        # KV is written through to the lower tiers, as the cluster's other engines would.
        self.store_writes = store_writes
        if store_writes:
            self.offload = "write_through"
        self.compression_ratio = (
            BLUEFIELD3.compression_ratio if compression_ratio is None else compression_ratio
        )
        self.decode_bytes_per_s = (
            BLUEFIELD3.raw_bytes_per_s() if decode_bytes_per_s is None else decode_bytes_per_s
        )
        if self.compression_ratio < 1 or not self.decode_bytes_per_s > 0 or interference < 0:
            raise ConfigError(
                f"shadowserve_async: compression_ratio {self.compression_ratio} (>= 1), decode_bytes_per_s "
                f"{self.decode_bytes_per_s} (> 0), interference {interference} (>= 0)"
            )
        self.interference = interference

    def fetch_interference(self, view: SchedulerView, r: RequestView, tokens: int) -> float:
        # SmartNIC decodes; raw KV crosses PCIe by DMA; the GPU only runs the per-round scatter.
        return self.interference

    def params(self) -> dict[str, Any]:
        return {
            **super().params(),
            "compression_ratio": self.compression_ratio,
            "decode_bytes_per_s": self.decode_bytes_per_s,
            "interference": self.interference,
            "store_writes": self.store_writes,
        }
