"""The engine loop: continuous batching over the paged pool, driven by a :mod:`kvtier.sched` policy.

Each :meth:`Engine.step` builds a :class:`~kvtier.sched.SchedulerView` from the engine's queues (the
same view the simulator builds, with prefix hits per tier from the device prefix cache and the
:class:`~kvtier.engine.hierarchy.KvTransfer` below it), asks the policy for a
:class:`~kvtier.sched.SchedulerDecision`, and applies it in the simulator's order: preemptions,
swap-outs, swap-ins, then prefill chunks (admitting waiting requests: device prefix hit, then the
policy's load from the lower tiers) and decodes, all packed into **one** forward pass. Prefill
chunks and decode tokens are the same thing to the model (:meth:`Model.forward`), so chunked
prefill and mixed steps need nothing extra.

Memory (vLLM v1's rules): a running request that cannot get a block preempts the most recently
admitted other running request by recompute; a waiting request that cannot get its blocks is not
admitted this step. Preemption by recompute drops the KV (full blocks go to the store first when
there is one) and later prefills prompt + output again; by swap (``swap_out``) copies the request's
blocks into bounded host slots and back (``swap_in``) through a :class:`kvtier.transfer.DuplexEngine`
(SuperInfer §4.3.2): a step's swap-outs and swap-ins are one batched transfer per direction, run at
once, and a swap-in into blocks a swap-out of the same step just freed waits for that copy's read. A
swap-out that does not fit falls back to recompute. Loads and swaps finish before the step's
forward pass.

Finished requests' full blocks, and with a ``write_through`` policy each prompt's blocks once
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
from kvtier.engine.hierarchy import STORE_TIER_INDEX, KvTransfer, PendingLoad
from kvtier.engine.kv import F32Array, KvAccess, PagedKvPool, pool_geometry
from kvtier.engine.model import Model
from kvtier.engine.request import EngineRequest, RequestOutput
from kvtier.engine.sampling import SamplingParams, sample
from kvtier.engine.view import build_view
from kvtier.keys import Namespace
from kvtier.sched.base import LoadOrder, Phase, Policy, SchedulerView
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
        if policy.offload != "none" and transfer is None:
            raise EngineInputError(
                f"policy {policy.name!r} writes KV through to a lower tier, but the engine has no store"
            )
        self.blocks = BlockManager(config.num_blocks)
        self.requests: dict[int, EngineRequest] = {}
        self.waiting: list[EngineRequest] = []  # sorted by (arrival, id)
        self.running: list[EngineRequest] = []  # admission order: the tail is preempted first
        # Swap (SuperInfer's DuplexKV, kvtier.transfer.DuplexEngine): host slots of BlockFirst
        # objects; a step's swap-outs and swap-ins are one batched transfer per direction, the two
        # running at once, finished before the step's forward pass.
        self.swapped: dict[int, list[int]] = {}  # req_id -> the host slots holding its blocks
        self.duplex: DuplexEngine | None = None
        if config.swap_blocks:
            self.host_slots = np.zeros((config.swap_blocks, geometry.block_bytes), dtype=np.uint8)
            steps = max(config.swap_blocks, 1 << 16)  # a step may move every slot each way
            self.duplex = DuplexEngine(geometry, self.pool.pool, self.host_slots, step_blocks_max=steps)
        self._free_slots = list(range(config.swap_blocks))[::-1]
        self._slots_to_free: list[int] = []  # read by this step's swap-ins: free after the transfer
        # Blocks marked written or queued for copy-out in this step's swap-outs (or its rotations).
        self._step_out_blocks: set[int] = set()
        # req_id -> host slots still holding a swapped-in running request's first full blocks (KV
        # is append-only: they stay synced), so its next swap-out copies only the newer blocks.
        self._synced: dict[int, list[int]] = {}
        self._rotating = False  # eager rotations submitted and not yet waited for
        self.finished: list[EngineRequest] = []
        self.stats = EngineStats()
        # When a list: one (prefill chunks as (new, cached) pairs, decode context lengths, wall
        # seconds of the whole step) per computing step, for `kvtier sim calibrate`.
        self.step_log: list[tuple[list[tuple[int, int]], list[int], float]] | None = None
        # req_id -> (load in flight, first table index it fills, blocks, start time): settled within
        # the step that started it (see _settle).
        self._inflight: dict[int, tuple[PendingLoad, int, int, float]] = {}
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
        if not isinstance(params, SamplingParams):
            raise EngineInputError(
                f"sampling is {type(params).__name__}; expected kvtier.engine.SamplingParams"
            )
        ids = np.asarray(prompt)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise EngineInputError(f"a prompt must be a 1-D sequence of token ids; got shape {ids.shape}")
        if ids.size == 0:
            raise EngineInputError("the prompt is empty; expected at least one token")
        vocab, context = self.model.config.vocab_size, self.model.config.max_context_tokens
        if ids.min() < 0 or ids.max() >= vocab:
            raise EngineInputError(f"prompt token ids must be in 0..{vocab - 1}")
        if ids.size >= context:
            raise EngineInputError(
                f"the prompt has {ids.size} tokens; the model's context is {context} tokens, "
                f"so a prompt may have at most {context - 1} (one new token must fit)"
            )
        total = min(ids.size + params.max_tokens, context)
        need = -(-total // self.config.block_tokens)
        if need > self.config.num_blocks:
            raise EngineInputError(
                f"the KV pool has {self.config.num_blocks} blocks of {self.config.block_tokens} tokens "
                f"({self.config.num_blocks * self.config.block_tokens} tokens); this request needs {need} "
                f"({ids.size} prompt + {total - ids.size} new tokens): make the pool larger or max_tokens smaller"
            )
        return [int(t) for t in ids]

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
        self._rotations_done()
        decision = self.policy.schedule(self.view())
        # Epochs before any preemption or swap: work planned for a request that leaves is dropped.
        epochs = {rid: self._get(rid, "prefill").epoch for rid, _ in decision.prefill}
        epochs.update((rid, self._get(rid, "decode").epoch) for rid in decision.decode)
        for rid in decision.preempt:
            self._preempt(self._get(rid, "preempt"))
        for rid in decision.swap_out:
            self._swap_out(self._get(rid, "swap out"))
        for rid in decision.swap_in:
            self._swap_in(self._get(rid, "swap in"))
        self._swap_transfers()
        loads = {lo.req_id: lo for lo in decision.loads if lo.target == "device"}
        batch: list[tuple[EngineRequest, int, int]] = []  # (request, new tokens, epoch)
        for rid, n in decision.prefill:
            r = self.requests[rid]
            if r.epoch != epochs[rid]:
                continue
            admitted = r.phase is Phase.WAITING
            if admitted:
                self._admit(r, loads.pop(rid, None))
            if r.phase is not Phase.RUNNING or r.num_computed >= r.prefill_len:
                continue
            n = min(n, r.prefill_len - r.num_computed)
            # A request admitted now never preempts others for its blocks; it waits instead.
            if self._grow(r, r.num_computed + n, preempt=not admitted):
                batch.append((r, n, r.epoch))
            elif admitted:
                self._unadmit(r)
        for rid in decision.decode:
            r = self.requests[rid]
            if r.epoch != epochs[rid]:
                continue
            if r.phase is not Phase.RUNNING or r.num_computed < r.prefill_len or not r.output:
                raise EngineError(
                    f"policy {self.policy.name!r} decodes request {rid} ({r.phase.value}) before its prefill is done"
                )
            if self._grow(r, r.num_tokens, preempt=True):
                batch.append((r, 1, r.epoch))
        for rid, load in loads.items():  # an asynchronous fetch: admit and load now, compute next step
            r = self._get(rid, "load")
            if r.phase is Phase.WAITING:
                self._admit(r, load)
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
        self._rotate()
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

    def _get(self, rid: int, what: str) -> EngineRequest:
        r = self.requests.get(rid)
        if r is None:
            raise EngineError(f"policy {self.policy.name!r} asked to {what} unknown request {rid}")
        return r

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
        loading = [self._inflight[r.req_id][0] for r, _ in batch if r.req_id in self._inflight]
        if loading:
            access = _LayerwiseAccess(access, loading)
        start = time.perf_counter()
        logits = self.model.forward(np.asarray(ids, dtype=np.int64), np.concatenate(positions), access)
        self.stats.forward_s += time.perf_counter() - start
        self.stats.steps += 1
        # A request whose load failed part-way attended garbage for the failed blocks: its step is
        # void (nothing committed, sampled or saved) and it recomputes from the failed block.
        void = {r.req_id for r, _ in batch if r.req_id in self._inflight and not self._settle(r)}
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
            if done and self.policy.offload == "write_through":
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
        need = -(-tokens // self.config.block_tokens) - len(r.table)
        if need <= 0:
            return True
        ids = self.blocks.allocate(need)
        while ids is None:
            if not preempt:
                return False
            victim = next((v for v in reversed(self.running) if v is not r), None)
            if victim is None:
                return False
            self._preempt(victim)
            ids = self.blocks.allocate(need)
        r.table.extend(ids)
        return True

    def _commit(self, r: EngineRequest) -> None:
        """Caches ``r``'s newly full blocks in the device prefix cache and locks them for it."""
        full = r.num_computed // self.config.block_tokens
        if full <= r.locked:
            return
        adopted = self.blocks.commit(r.key_ints(full), r.table, r.locked)
        r.duplicates.update(r.locked + i for i, ok in enumerate(adopted) if not ok)
        r.locked = full

    def _release(self, r: EngineRequest) -> None:
        """Drops ``r``'s device KV: unlocks its cached blocks (they stay cached), frees the rest."""
        self._settle(r)  # never free blocks a load is still writing
        self._free_slots.extend(self._synced.pop(r.req_id, []))
        self.blocks.unlock(r.key_ints(r.locked))
        self.blocks.free_private(r.private_blocks())
        r.table, r.locked, r.duplicates, r.num_computed = [], 0, set(), 0

    def _save(self, r: EngineRequest) -> None:
        """Puts ``r``'s full computed blocks into the store (blocks it holds already are skipped)."""
        if self.transfer is None:
            return
        self._settle(r)  # only blocks that landed are saved
        full = r.num_computed // self.config.block_tokens
        if full:
            self.stats.saved_blocks += self.transfer.save(r.block_keys(full), r.table[:full])

    # ------------------------------------------------------------------------------------------
    # Admission and loads

    def _admit(self, r: EngineRequest, load: LoadOrder | None) -> None:
        """Takes ``r``'s device-cached prefix, loads what ``load`` asks from the lower tiers, and
        makes it running."""
        bt = self.config.block_tokens
        cap = (r.prefill_len - 1) // bt  # at least one token is computed: it yields the logits
        keys = r.key_ints(cap)
        cached = self.blocks.match(keys)
        self.blocks.lock(keys[: len(cached)])
        r.table, r.locked, r.duplicates = list(cached), len(cached), set()
        r.num_computed = len(cached) * bt
        r.hit_tokens = [r.num_computed, 0, 0, 0]
        if load is not None and self.transfer is not None and len(cached) < cap:
            self._load(r, min(cap, len(cached) + math.ceil(load.tokens / bt)))
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

    def _load(self, r: EngineRequest, end_block: int) -> None:
        """Loads blocks ``len(r.table) .. end_block - 1`` of ``r`` from the store into new blocks."""
        assert self.transfer is not None
        start = len(r.table)
        keys = r.block_keys(end_block)[start:]
        held = len(self.transfer.lookup(keys))
        ids = self.blocks.allocate(held) if held else None
        if not ids:
            return
        began = time.perf_counter()
        if self.config.layerwise_loads:
            pending = self.transfer.load_async(keys[:held], ids)
            if pending is not None:  # lands while the step computes; settled by _settle
                self._inflight[r.req_id] = (pending, len(r.table), held, began)
                r.table.extend(ids)
                r.num_computed += held * self.config.block_tokens
                return
        result = self.transfer.load(keys[:held], ids)
        self.stats.load_s += time.perf_counter() - began
        self.stats.loaded_blocks += result.blocks
        self.blocks.free_private(ids[result.blocks :])
        r.table.extend(ids[: result.blocks])
        r.num_computed += result.blocks * self.config.block_tokens
        for tier in result.tiers:
            r.hit_tokens[STORE_TIER_INDEX[tier]] += self.config.block_tokens
        self._commit(r)

    def _settle(self, r: EngineRequest) -> bool:
        """Waits for ``r``'s load in flight, if any; returns whether every block landed. On a
        failure ``r`` keeps the loaded prefix and recomputes from the failed block (the blocks past
        it stay in its table, to be rewritten)."""
        entry = self._inflight.pop(r.req_id, None)
        if entry is None:
            return True
        pending, first, blocks, began = entry
        result = pending.finish()
        self.stats.load_s += time.perf_counter() - began
        self.stats.loaded_blocks += result.blocks
        for tier in result.tiers:
            r.hit_tokens[STORE_TIER_INDEX[tier]] += self.config.block_tokens
        if result.blocks < blocks:
            r.num_computed = (first + result.blocks) * self.config.block_tokens
        self._commit(r)
        return result.blocks == blocks

    def _settle_all(self) -> None:
        for rid in list(self._inflight):
            self._settle(self.requests[rid])

    # ------------------------------------------------------------------------------------------
    # Preemption and swap

    def _preempt(self, r: EngineRequest) -> None:
        """Preemption by recompute: the KV goes (full blocks to the store first); the request waits
        and later prefills its prompt and output so far again."""
        if r.phase is not Phase.RUNNING:
            raise EngineError(
                f"policy {self.policy.name!r} preempts request {r.req_id} in phase {r.phase.value}"
            )
        self._save(r)
        self._release(r)
        self.running.remove(r)
        r.prefill_len = r.num_tokens
        r.epoch += 1
        r.preemptions += 1
        self.stats.preemptions += 1
        self._enqueue(r)

    def swap_used_blocks(self) -> int:
        """Host slots held by swapped-out requests (slots kept by running ones are reclaimable)."""
        return sum(len(slots) for slots in self.swapped.values())

    def _swap_out(self, r: EngineRequest) -> None:
        """Queues a copy of a running request's blocks to host slots and frees them on the device
        (a swap-in into them in the same step waits for the copy's read: DuplexEngine's ordering)."""
        if r.phase is not Phase.RUNNING:
            raise EngineError(
                f"policy {self.policy.name!r} swaps out request {r.req_id} in phase {r.phase.value}"
            )
        self._settle(r)  # copy out only KV that has landed
        held = -(-r.num_computed // self.config.block_tokens)
        synced = self._synced.pop(r.req_id, [])  # slots of r.table[:len(synced)], full since swap-in
        need = held - len(synced)
        if self.duplex is not None and need > len(self._free_slots):
            self._drop_synced()  # others' reservations go before a recompute
        if self.duplex is None or need > len(self._free_slots):
            self._free_slots.extend(synced)
            self._preempt(r)  # the host buffer cannot take it: recompute instead
            return
        slots = synced + [self._free_slots.pop() for _ in range(need)]
        try:
            for i, (block, slot) in enumerate(zip(r.table[:held], slots, strict=True)):
                if i >= len(synced) and block not in self._step_out_blocks:
                    # Written by the forward passes since any copy of it (the engine does not report
                    # each write): its host copy, if any, is stale. Once per step: a prefix block
                    # two swapped requests share is marked once, each gets its own copy.
                    self.duplex.write(block)
                    self._step_out_blocks.add(block)
                # A block still synced with its slot (full at swap-in, unchanged) moves nothing.
                if self.duplex.swap_out(block, slot):
                    self._step_out_blocks.add(block)
                    self.stats.swap_out_blocks_copied += 1
        except Exception:
            self._free_slots.extend(reversed(slots))  # the engine's own bug: keep the accounting
            raise
        computed = r.num_computed
        self._release(r)
        r.num_computed = computed
        self.running.remove(r)
        self.swapped[r.req_id] = slots
        r.phase = Phase.SWAPPED
        r.epoch += 1
        r.swaps += 1
        self.stats.swap_outs += 1

    def _swap_in(self, r: EngineRequest) -> None:
        """Copies a swapped request's blocks back into new device blocks; it runs again. If the
        blocks are not available now, nothing happens (the policy asks again)."""
        if r.phase is not Phase.SWAPPED:
            raise EngineError(
                f"policy {self.policy.name!r} swaps in request {r.req_id}, which is not swapped out"
            )
        slots = self.swapped[r.req_id]
        ids = self.blocks.allocate(len(slots))
        if ids is None:
            return
        assert self.duplex is not None  # a request is swapped only with host slots
        for slot, block in zip(slots, ids, strict=True):
            self.duplex.swap_in(slot, block)
        # The full blocks stay synced with their slots (kept for the next swap-out); the partial
        # tail block will change, so its slot is freed once the copy has read it.
        full = r.num_computed // self.config.block_tokens
        self._synced[r.req_id] = slots[:full]
        self._slots_to_free.extend(slots[full:])
        del self.swapped[r.req_id]
        r.table = ids
        self._commit(r)
        r.phase = Phase.RUNNING
        self.running.append(r)
        self.stats.swap_ins += 1

    def _swap_transfers(self) -> None:
        """Submits the step's swap-outs and swap-ins (one batched transfer each, run at once) and
        waits for both: the forward pass reads swapped-in blocks and may write freed ones."""
        if self.duplex is None:
            return
        out, into = self.duplex.submit_step()
        if out is not None or into is not None:
            self.duplex.wait_all()
        self._free_slots.extend(reversed(self._slots_to_free))
        self._slots_to_free.clear()
        self._step_out_blocks.clear()

    def _rotate(self) -> None:
        """Eager rotation (``EngineConfig.eager_rotation``): queues a background copy of every
        running request's full blocks that no host slot holds yet, into free slots, and submits
        them without waiting: they run during the step's forward pass, which only reads full blocks
        (it writes the tail block and new ones). Requests with a load in flight are skipped (their
        blocks are still being written). Waited for at the next step's start."""
        if not self.config.eager_rotation or self.duplex is None:
            return
        rotated = 0
        for r in self.running:
            if r.req_id in self._inflight:
                continue
            kept = self._synced.setdefault(r.req_id, [])
            for block in r.table[len(kept) : r.num_computed // self.config.block_tokens]:
                if not self._free_slots:
                    break
                if block not in self._step_out_blocks:  # a shared prefix block: marked once
                    self.duplex.write(block)  # holds KV the duplex engine has not seen copied
                    self._step_out_blocks.add(block)
                slot = self._free_slots.pop()
                self.duplex.rotate(block, slot)
                kept.append(slot)
                rotated += 1
        self._step_out_blocks.clear()
        if rotated:
            self.duplex.submit_step()
            self._rotating = True
            self.stats.rotated_blocks += rotated

    def _rotations_done(self) -> None:
        """Waits for the previous step's rotations: blocks may be freed, reused or swapped now."""
        if self._rotating:
            assert self.duplex is not None
            self.duplex.wait_all()
            self._rotating = False

    def _drop_synced(self) -> None:
        """Frees every running request's kept slots (their next swap-out copies everything): a
        swap-out that needs the room comes first. A reused slot's old blocks stop being synced
        (the DuplexEngine marks them dirty when the slot is written)."""
        for slots in self._synced.values():
            self._free_slots.extend(slots)
        self._synced.clear()

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
            if len(r.table) * self.config.block_tokens < r.num_computed:
                raise EngineError(
                    f"request {r.req_id} computed {r.num_computed} tokens in {len(r.table)} blocks"
                )
        held = [slot for slots in self.swapped.values() for slot in slots]
        kept = [slot for slots in self._synced.values() for slot in slots]
        slots = held + kept + self._free_slots + self._slots_to_free
        if sorted(slots) != list(range(self.config.swap_blocks)):
            raise EngineError(
                f"host slots: {len(held)} held by swapped requests, {len(kept)} kept by running ones, "
                f"{len(self._free_slots)} free, {len(self._slots_to_free)} being read; expected each "
                f"of {self.config.swap_blocks} once"
            )
        for rid, kept_slots in self._synced.items():
            keeper = self.requests.get(rid)
            if keeper is None or keeper.phase is not Phase.RUNNING or len(kept_slots) > len(keeper.table):
                raise EngineError(
                    f"request {rid} keeps {len(kept_slots)} host slots but is not running with them"
                )


class _LayerwiseAccess(KvAccess):
    """A step's KV access whose reads of layer ``l`` first wait for layer ``l`` of the loads in flight
    (Unified KV pooling §II-B, Strata §4.2.1: a layer computes once its KV has arrived)."""

    def __init__(self, inner: KvAccess, loads: list[PendingLoad]) -> None:
        super().__init__(inner.query_lens, inner.context_lens)
        self._inner, self._loads, self._ready = inner, loads, -1

    def write(self, layer: int, k: F32Array, v: F32Array) -> None:
        self._inner.write(layer, k, v)

    def read(self, layer: int, seq: int) -> tuple[F32Array, F32Array]:
        if layer > self._ready:
            for load in self._loads:
                load.wait_layer(layer)
            self._ready = layer
        return self._inner.read(layer, seq)
