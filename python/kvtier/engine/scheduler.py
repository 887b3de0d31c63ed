"""The engine loop: continuous batching over the paged pool, driven by a :mod:`kvtier.sched` policy.

Each :meth:`Engine.step` builds a :class:`~kvtier.sched.SchedulerView` from the engine's queues
(:mod:`kvtier.engine.view`), asks the policy for a :class:`~kvtier.sched.SchedulerDecision` and
hands it to the decision executor (:mod:`kvtier.sched.executor`), the same one the simulator uses:
it keeps the order and the validation, and this engine carries out each order on real KV. Prefill
chunks (admitting waiting requests: device prefix hit, then the policy's load from the store,
:mod:`kvtier.engine.loads`) and decodes are packed into **one** forward pass: to the model they are
the same thing (:meth:`Model.forward`), so chunked prefill and mixed steps need nothing extra.

Memory (vLLM v1's rules): a running request that cannot get a block preempts the most recently
admitted other running request by recompute; a waiting request that cannot get its blocks is not
admitted this step. Preemption by recompute drops the KV (full blocks go to the store first when
there is one) and later prefills prompt + output again; by swap it copies the request's blocks into
bounded host slots and back (:mod:`kvtier.engine.swap`), falling back to recompute where they do not
fit. Loads and swaps finish before the step's forward pass (layerwise loads: each layer's). An order
this engine cannot carry out (a load for a request already running, a host prefetch with no store)
raises :class:`EngineError`.

Finished requests' full blocks, and with ``write_through`` offload (``EngineConfig.offload``, else
the policy's paper's: :func:`kvtier.sched.data_plane.default_offload`) each prompt's blocks once
prefilled, are saved to the store; evicted device blocks are therefore already below.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.engine.blocks import BlockManager
from kvtier.engine.config import EngineConfig
from kvtier.engine.errors import EngineError, EngineInputError
from kvtier.engine.hierarchy import KvTransfer
from kvtier.engine.kv import KvAccess, PagedKvPool, pool_geometry
from kvtier.engine.loads import LayerwiseAccess, StoreLoads
from kvtier.engine.model import Model
from kvtier.engine.request import EngineRequest, RequestOutput, check_prompt
from kvtier.engine.sampling import SamplingParams, sample
from kvtier.engine.swap import HostSwap
from kvtier.engine.view import build_view
from kvtier.keys import Namespace
from kvtier.sched.base import LoadOrder, Phase, Policy, SchedulerView
from kvtier.sched.data_plane import default_offload, policy_spec
from kvtier.sched.executor import execute
from kvtier.transfer import DuplexEngine

#: Consecutive steps that schedule nothing while requests are unfinished before the engine gives up.
STALLED_STEPS_MAX = 8


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    forward_s: float = 0.0
    load_s: float = 0.0
    loaded_blocks: int = 0
    saved_blocks: int = 0
    prefetched_blocks: int = 0  # store blocks a host prefetch brought up into DRAM
    preemptions: int = 0
    swap_outs: int = 0
    swap_ins: int = 0
    # Blocks swap-outs copied (a block still synced with its host slot since a swap-in or an eager
    # rotation is not), and blocks rotated eagerly.
    swap_out_blocks_copied: int = 0
    rotated_blocks: int = 0


class Engine:
    """A continuous-batching engine over one model, one paged pool and one policy."""

    def __init__(
        self,
        model: Model,
        policy: Policy,
        config: EngineConfig | None = None,
        *,
        transfer: KvTransfer | None = None,
        pool: PagedKvPool | None = None,
        namespace: Namespace | None = None,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.policy = policy
        self.config = config = config or EngineConfig()
        geometry = pool_geometry(model.config, config.block_tokens)
        self.pool = pool or PagedKvPool(geometry, config.num_blocks)
        if self.pool.geometry != geometry or self.pool.num_blocks != config.num_blocks:
            raise EngineInputError("the pool's geometry or size differs from the engine config")
        self.namespace = namespace or Namespace("smollm2-135m-instruct", geometry)
        if self.namespace.geometry != geometry:
            raise EngineInputError(
                f"namespace geometry {self.namespace.geometry} is not the pool's {geometry}"
            )
        self.transfer = transfer
        # What the engine keeps below the device: its config's, else its policy's paper's.
        self.offload = config.offload or default_offload(policy_spec(policy))
        if self.offload != "none" and transfer is None:
            raise EngineInputError(
                f"offload {self.offload!r} writes KV to a lower tier, but the engine has no store"
            )
        self.blocks = BlockManager(config.num_blocks)
        self.requests: dict[int, EngineRequest] = {}
        self.waiting: list[EngineRequest] = []  # sorted by (arrival, id)
        self.running: list[EngineRequest] = []  # admission order: the tail is preempted first
        # Swap (SuperInfer's DuplexKV): host slots, copied a step's worth at a time (kvtier.engine.swap).
        self.host_swap = HostSwap(geometry, self.pool.pool, config.swap_blocks)
        self.finished: list[EngineRequest] = []
        self.stats = EngineStats()
        # When a list: one (prefill chunks as (new, cached) pairs, decode context lengths, wall
        # seconds of the whole step) per computing step, for `kvtier sim calibrate`.
        self.step_log: list[tuple[list[tuple[int, int]], list[int], float]] | None = None
        # Loads from the store (kvtier.engine.loads); layerwise ones settle within their step.
        self.loads = StoreLoads(
            transfer, self.blocks, geometry, config.layerwise_loads, self.stats, self._commit
        )
        self._next_id = 0
        self._rng = np.random.default_rng(seed)
        self._stalled = 0
        self._start_s = time.monotonic()

    # ------------------------------------------------------------------------------------------
    # Requests in and out

    def add_request(
        self, prompt: Sequence[int], params: SamplingParams, stop_token_ids: Sequence[int] = ()
    ) -> int:
        """Queues a request; returns its id. Bad prompts raise :class:`EngineInputError` at once."""
        tokens = self.check_request(prompt, params)
        stops = frozenset(() if params.ignore_eos else (params.stop_token_ids or tuple(stop_token_ids)))
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**63))
        r = EngineRequest(
            self._next_id,
            tokens,
            params,
            stops,
            np.random.default_rng(seed),
            self.now_s(),
            self.namespace,
        )
        self._next_id += 1
        self.requests[r.req_id] = r
        self._enqueue(r)
        return r.req_id

    def check_request(self, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as a list of ints if the request can run; else :class:`EngineInputError`."""
        c = self.model.config
        return check_prompt(
            prompt,
            params,
            c.vocab_size,
            c.max_context_tokens,
            self.pool.block_tokens,
            self.config.num_blocks,
        )

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def pop_finished(self) -> list[RequestOutput]:
        now = self.now_s()
        out = [r.to_output(now) for r in self.finished]
        self.finished.clear()
        return out

    def now_s(self) -> float:
        return time.monotonic() - self._start_s

    def _enqueue(self, r: EngineRequest) -> None:
        r.phase = Phase.WAITING
        keys = [(w.arrival_s, w.req_id) for w in self.waiting]
        self.waiting.insert(bisect.bisect(keys, (r.arrival_s, r.req_id)), r)

    # ------------------------------------------------------------------------------------------
    # The step

    def step(self) -> int:
        """Runs one engine step; returns the tokens computed (0: nothing could be scheduled)."""
        step_start = time.perf_counter()
        self.host_swap.rotations_done()
        batch: list[tuple[EngineRequest, int, int]] = []  # (request, new tokens, epoch)
        execute(self.policy.schedule(self.view()), self, batch)
        # Passive preemption may have evicted a request planned earlier in this step.
        batch = [(r, n, e) for r, n, e in batch if r.epoch == e and r.phase is Phase.RUNNING]
        if not batch:
            self._settle_all()
            self._stalled += 1
            if self._stalled >= STALLED_STEPS_MAX and self.has_unfinished():
                self._raise_stuck()
            return 0
        self._stalled = 0
        shape = (
            [(n, r.num_computed) for r, n, _ in batch if r.num_computed < r.prefill_len],
            [r.num_computed for r, n, _ in batch if r.num_computed >= r.prefill_len],
        )
        if self.config.eager_rotation:  # copied while the step computes (kvtier.engine.swap)
            self.stats.rotated_blocks += self.host_swap.rotate(self.running, self.loads.inflight)
        self._forward([(r, n) for r, n, _ in batch])
        self._settle_all()  # loads of requests admitted this step but not in its batch
        if self.step_log is not None:
            self.step_log.append((*shape, time.perf_counter() - step_start))
        return sum(n for _, n, _ in batch)

    def run(self) -> list[RequestOutput]:
        """Steps until every request finished; returns them in the order they finished."""
        outputs: list[RequestOutput] = []
        while self.has_unfinished():
            self.step()
            outputs.extend(self.pop_finished())
        return outputs

    def _raise_stuck(self) -> None:
        head = (self.waiting or self.running or [self.requests[next(iter(self.swapped))]])[0]
        raise EngineError(
            f"the engine made no progress for {STALLED_STEPS_MAX} steps: request {head.req_id} "
            f"({len(head.prompt)} prompt tokens, {head.phase.value}) cannot get blocks "
            f"({self.blocks.available()} of {self.config.num_blocks} available) or policy "
            f"{self.policy.name!r} never schedules it"
        )

    # ------------------------------------------------------------------------------------------
    # The decision's orders (kvtier.sched.executor: the executor checks phases and keeps the order)

    def find(self, req_id: int) -> EngineRequest | None:
        return self.requests.get(req_id)

    def error(self, message: str) -> EngineError:
        return EngineError(message)

    def plan_prefill(
        self, batch: list[tuple[EngineRequest, int, int]], r: EngineRequest, n: int, load: LoadOrder | None
    ) -> None:
        admitted = r.phase is Phase.WAITING
        if admitted:
            self._admit(r, load)
        elif load is not None:
            self._refuse_load(r)
        if r.phase is not Phase.RUNNING or r.num_computed >= r.prefill_len:
            return
        n = min(n, r.prefill_len - r.num_computed)
        # A request admitted now never preempts others for its blocks; it waits instead.
        if self._grow(r, r.num_computed + n, preempt=not admitted):
            batch.append((r, n, r.epoch))
        elif admitted:
            self._unadmit(r)

    def plan_decode(self, batch: list[tuple[EngineRequest, int, int]], r: EngineRequest) -> None:
        if self._grow(r, r.num_tokens, preempt=True):
            batch.append((r, 1, r.epoch))

    def start_load(self, r: EngineRequest, load: LoadOrder) -> None:
        """An asynchronous fetch: admit and load now, compute from the next step."""
        if r.phase is not Phase.WAITING:
            self._refuse_load(r)
        self._admit(r, load)

    def _refuse_load(self, r: EngineRequest) -> None:
        raise EngineError(
            f"policy {self.policy.name!r} loads a prefix for request {r.req_id} ({r.phase.value}); "
            "the reference engine loads from the store only when it admits a waiting request"
        )

    def prefetch(self, r: EngineRequest, load: LoadOrder) -> None:
        """Brings the SSD/remote blocks of a waiting request's stored prefix up into the store's
        DRAM tier (Strata §4.3.3), at most ``load.tokens`` of them past its DRAM part."""
        if self.transfer is None:
            raise EngineError(
                f"policy {self.policy.name!r} prefetches request {r.req_id} to host; the engine has no store"
            )
        self.loads.prefetch(r, load.tokens)

    def _forward(self, batch: list[tuple[EngineRequest, int]]) -> None:
        ids: list[int] = []
        positions: list[np.ndarray] = []
        for r, n in batch:
            ids.extend(r.tokens[r.num_computed : r.num_computed + n])
            positions.append(np.arange(r.num_computed, r.num_computed + n))
        access: KvAccess = self.pool.step(
            [r.table for r, _ in batch],
            [r.num_computed + n for r, n in batch],
            [n for _, n in batch],
        )
        inflight = self.loads.inflight
        loading = [inflight[r.req_id][0] for r, _ in batch if r.req_id in inflight]
        if loading:
            access = LayerwiseAccess(access, loading)
        start = time.perf_counter()
        logits = self.model.forward(np.asarray(ids, dtype=np.int64), np.concatenate(positions), access)
        self.stats.forward_s += time.perf_counter() - start
        self.stats.steps += 1
        # A request whose load failed part-way attended garbage for the failed blocks: its step is
        # void (nothing committed, sampled or saved) and it recomputes from the failed block.
        void = {r.req_id for r, _ in batch if r.req_id in inflight and not self.loads.settle(r)}
        for row, (r, n) in enumerate(batch):
            if r.req_id in void:
                continue
            prefilling = r.num_computed < r.prefill_len
            r.num_computed += n
            if prefilling:
                self.stats.prefill_tokens += n
            else:
                self.stats.decode_tokens += n
            self._commit(r)
            if r.num_computed == r.num_tokens:
                self._append_token(r, sample(logits[row], r.params, r.rng))
            # Write-through of a just-prefilled prompt, after its first token (off the TTFT path, as
            # an asynchronous copy would be); a finished request was saved already.
            done = prefilling and r.num_computed >= r.prefill_len and r.finish_reason is None
            if done and self.offload == "write_through":
                self._save(r)

    def _append_token(self, r: EngineRequest, token: int) -> None:
        r.output.append(token)
        if r.first_token_s is None:
            r.first_token_s = self.now_s()
        if token in r.stop_token_ids:
            r.finish_reason = "stop"
        elif len(r.output) >= r.params.max_tokens or r.num_tokens >= self.model.config.max_context_tokens:
            r.finish_reason = "length"
        else:
            return
        r.finish_s = self.now_s()
        self._save(r)
        self._release(r)
        if not self.config.device_prefix_cache:
            self.blocks.drop_unlocked()
        self.running.remove(r)
        del self.requests[r.req_id]
        self.finished.append(r)

    # ------------------------------------------------------------------------------------------
    # Blocks

    def _grow(self, r: EngineRequest, tokens: int, preempt: bool) -> bool:
        """Gives ``r`` blocks for ``tokens`` tokens; with ``preempt``, preempts the most recently
        admitted other running request (by recompute) until they fit."""
        need = -(-tokens // self.pool.block_tokens) - len(r.table)
        if need <= 0:
            return True
        ids = self.blocks.allocate(need)
        while ids is None:
            if not preempt:
                return False
            victim = next((v for v in reversed(self.running) if v is not r), None)
            if victim is None:
                return False
            self.preempt(victim)
            ids = self.blocks.allocate(need)
        r.table.extend(ids)
        return True

    def _commit(self, r: EngineRequest) -> None:
        """Caches ``r``'s newly full blocks in the device prefix cache and locks them for it."""
        full = r.num_computed // self.pool.block_tokens
        if full <= r.locked:
            return
        adopted = self.blocks.commit(r.key_ints(full), r.table, r.locked)
        r.duplicates.update(r.locked + i for i, ok in enumerate(adopted) if not ok)
        r.locked = full

    def _release(self, r: EngineRequest) -> None:
        """Drops ``r``'s device KV: unlocks its cached blocks (they stay cached), frees the rest."""
        self.loads.settle(r)  # never free blocks a load is still writing
        self.host_swap.forget(r.req_id)
        self.blocks.unlock(r.key_ints(r.locked))
        self.blocks.free_private(r.private_blocks())
        r.table, r.locked, r.duplicates, r.num_computed = [], 0, set(), 0

    def _save(self, r: EngineRequest) -> None:
        """Puts ``r``'s full computed blocks into the store (blocks it holds already are skipped)."""
        if self.transfer is None:
            return
        self.loads.settle(r)  # only blocks that landed are saved
        full = r.num_computed // self.pool.block_tokens
        if full:
            self.stats.saved_blocks += self.transfer.save(r.block_keys(full), r.table[:full])

    # ------------------------------------------------------------------------------------------
    # Admission and loads

    def _admit(self, r: EngineRequest, load: LoadOrder | None) -> None:
        """Takes ``r``'s device-cached prefix, loads what ``load`` asks from the lower tiers, and
        makes it running."""
        bt = self.pool.block_tokens
        cap = (r.prefill_len - 1) // bt  # at least one token is computed: it yields the logits
        keys = r.key_ints(cap)
        cached = self.blocks.match(keys)
        self.blocks.lock(keys[: len(cached)])
        r.table, r.locked, r.duplicates = list(cached), len(cached), set()
        r.num_computed = len(cached) * bt
        r.hit_tokens = [r.num_computed, 0, 0, 0]
        if load is not None and self.transfer is not None and len(cached) < cap:
            self.loads.load(r, min(cap, len(cached) + math.ceil(load.tokens / bt)))
        self.waiting.remove(r)
        r.phase = Phase.RUNNING
        self.running.append(r)

    def _unadmit(self, r: EngineRequest) -> None:
        """Undoes an admission whose first chunk found no blocks: back to waiting (loaded blocks stay
        in the device prefix cache)."""
        self._release(r)
        self.running.remove(r)
        r.hit_tokens = [0, 0, 0, 0]
        self._enqueue(r)

    def _settle_all(self) -> None:
        for rid in list(self.loads.inflight):
            self.loads.settle(self.requests[rid])

    # ------------------------------------------------------------------------------------------
    # Preemption and swap

    def preempt(self, r: EngineRequest) -> None:
        """Preemption by recompute: the KV goes (full blocks to the store first); the request waits
        and later prefills its prompt and output so far again."""
        self._save(r)
        self._release(r)
        self.running.remove(r)
        r.prefill_len = r.num_tokens
        r.epoch += 1
        r.preemptions += 1
        self.stats.preemptions += 1
        self._enqueue(r)

    @property
    def swapped(self) -> dict[int, list[int]]:
        """req_id -> the host slots holding a swapped-out request's blocks."""
        return self.host_swap.swapped

    @property
    def duplex(self) -> DuplexEngine | None:
        return self.host_swap.duplex

    def swap_used_blocks(self) -> int:
        """Host slots held by swapped-out requests (slots kept by running ones are reclaimable)."""
        return self.host_swap.used_blocks()

    def swap_out(self, r: EngineRequest) -> None:
        """Copies a running request's blocks to host slots (:meth:`HostSwap.copy_out`) and frees
        them on the device; where the slots cannot take it, preempts it by recompute instead."""
        self.loads.settle(r)  # copy out only KV that has landed
        copied = self.host_swap.copy_out(r)
        if copied is None:
            self.preempt(r)
            return
        self.stats.swap_out_blocks_copied += copied
        computed = r.num_computed
        self._release(r)
        r.num_computed = computed
        self.running.remove(r)
        r.phase = Phase.SWAPPED
        r.epoch += 1
        r.swaps += 1
        self.stats.swap_outs += 1

    def swap_in(self, r: EngineRequest) -> None:
        """Copies a swapped request's blocks back into new device blocks; it runs again. If the
        blocks are not available now, nothing happens (the policy asks again)."""
        ids = self.blocks.allocate(len(self.swapped[r.req_id]))
        if ids is None:
            return
        self.host_swap.copy_in(r, ids)
        r.table = ids
        self._commit(r)
        r.phase = Phase.RUNNING
        self.running.append(r)
        self.stats.swap_ins += 1

    def end_swaps(self) -> None:
        self.host_swap.end_step()

    # ------------------------------------------------------------------------------------------
    # The policy's view

    def view(self) -> SchedulerView:
        """What the policy sees now (:func:`kvtier.engine.view.build_view`)."""
        return build_view(self)

    def check_integrity(self) -> None:
        """Raises :class:`EngineError` if block accounting or request tables disagree."""
        self.blocks.check_integrity()
        owned = [b for r in self.running for b in r.private_blocks()]
        if len(owned) != len(set(owned)) or len(owned) != self.blocks.private:
            raise EngineError(
                f"{len(owned)} private blocks in tables; the manager counts {self.blocks.private}"
            )
        for r in self.running:
            if len(r.table) * self.pool.block_tokens < r.num_computed:
                raise EngineError(
                    f"request {r.req_id} computed {r.num_computed} tokens in {len(r.table)} blocks"
                )
        self.host_swap.check_integrity(self.requests)
