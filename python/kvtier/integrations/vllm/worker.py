"""The worker side of the vLLM connector: one kvtier Store per TP rank (numpy only; no vLLM).

Each step the scheduler sends `LoadSpec`s and `SaveSpec`s (token ids, the request's key extra,
which of its blocks, and vLLM block ids). The worker hashes the tokens into kvtier's chained keys
in its own namespace, so the scheduler never needs the namespace.

Loads (`start_loads`) run on a thread: `Store.load_into_pool` copies each leased object straight
into vLLM's per-layer cache tensors (one copy from DRAM, no staging array), layer by layer,
advancing a `LayerProgress`; `wait_layer(l)` returns (GIL released while it waits) as soon as
layer l of every block is in place, so attention on the first layers overlaps the copy of the
later ones. With `load_async`, a hit is loaded between steps instead (`start_async_loads`): the
request sits outside the forward until `finished_async_loads` reports it to vLLM. A block the store cannot give (evicted, checksum failure, server down) is a *load
error*: its vLLM block id (and those after it in the request) is reported so vLLM recomputes it
and discards the step's output for that request, and the request's saves of that step are
dropped (their KV was computed over the missing block). A checksum verdict comes after the last
layer, which is why a failed block is still reported even though its layers were announced.

Saves (`submit_saves`) run on a second thread, after the step's forward: `Store.put_from_pool`
stores the full blocks straight from vLLM's cache (one copy into DRAM). vLLM must not free a
request's blocks before its saves are done: `finished()` reports a finished request only once its
queued saves completed, and `drain()` (before a preemption frees blocks, and at shutdown) waits for
all of them.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.integrations.vllm.kv_layout import PagedKV
from kvtier.keys import BlockKeys
from kvtier.layout import PagedPool
from kvtier.store import LayerProgress, Store

log = logging.getLogger("kvtier.vllm")


@dataclass(frozen=True)
class LoadSpec:
    """Load blocks `start .. start + len(block_ids)` of the chain over `tokens` into `block_ids`."""

    req_id: str
    tokens: bytes  # <u4 token ids, whole blocks, up to the last block loaded
    extra: bytes
    start: int
    block_ids: list[int]


@dataclass(frozen=True)
class SaveSpec:
    """Save vLLM blocks `block_ids` as blocks `start ..` of the chain over `tokens`."""

    req_id: str
    tokens: bytes
    extra: bytes
    start: int
    block_ids: list[int]


@dataclass
class _LoadJob:
    specs: list[LoadSpec]
    progress: list[LayerProgress]  # one per spec: each load announces its own layers
    thread: threading.Thread | None = None
    errors: set[int] = field(default_factory=set)
    failed_reqs: set[str] = field(default_factory=set)


class WorkerSide:
    def __init__(self, store: Store, paged: PagedKV, stats_file: str | None = None) -> None:
        if paged.block_bytes != store.block_bytes:
            raise ValueError(
                f"vLLM's KV block is {paged.block_bytes} bytes over all layers; the store's geometry "
                f"says {store.block_bytes}"
            )
        self.store = store
        self.paged = paged
        self.namespace = store.namespace
        self.block_tokens = store.namespace.geometry.block_tokens
        self.stats_file = Path(stats_file) if stats_file else None
        self.counters: Counter[str] = Counter()  # ints, and float second totals (names ending in _s)
        self._lock = threading.Lock()
        self._job: _LoadJob | None = None
        # Loads between steps (`load_async`): running, and done but not yet reported to vLLM.
        self._async_running: list[_LoadJob] = []
        self._async_done: list[_LoadJob] = []
        self._load_errors: set[int] = set()
        # Load failures of the current step, kept until its saves are planned (vLLM may ask for the
        # load errors first, with speculative decoding): read and cleared by submit_saves only.
        self._step_failed = False
        # Saves: a queue served by one thread; per-request counts of queued saves.
        self._saves: queue.Queue[tuple[SaveSpec, BlockKeys] | None] = queue.Queue()
        self._pending: Counter[str] = Counter()
        self._submitted = 0  # saves queued so far; the one save thread completes them in order
        self._completed = 0
        self._saw_saves: set[str] = set()
        self._awaiting: set[str] = set()
        self._idle = threading.Condition(self._lock)
        self._saver = threading.Thread(target=self._save_loop, name="kvtier-save", daemon=True)
        self._saver.start()

    @property
    def paged(self) -> PagedKV:
        """vLLM's cache tensors (and `pool`, the same memory as the store's `PagedPool`)."""
        return self._paged

    @paged.setter
    def paged(self, paged: PagedKV) -> None:
        self._paged = paged
        self.pool = PagedPool(paged.layers)

    # ---------------------------------------------------------------- lookups
    def keys(self, tokens: npt.NDArray[np.uint32] | bytes, extra: bytes) -> BlockKeys:
        arr = np.frombuffer(tokens, dtype="<u4") if isinstance(tokens, bytes) else tokens
        return self.namespace.block_keys(arr, extra)

    def lookup(self, tokens: npt.NDArray[np.uint32], extra: bytes) -> int:
        """Cached blocks of `tokens`, counting every save queued before this call: vLLM hands a
        request's output back before its (delayed) save is done, and the user's next turn must hit."""
        t0 = time.perf_counter()
        with self._lock:
            target = self._submitted
            while self._completed < target:
                self._idle.wait()
        t1 = time.perf_counter()
        hit = self.store.lookup(self.keys(tokens, extra)).hit_blocks
        with self._lock:
            self.counters["lookup_save_wait_s"] += t1 - t0  # type: ignore[assignment]
            self.counters["lookup_s"] += time.perf_counter() - t1  # type: ignore[assignment]
            self.counters["lookups"] += 1
            self.counters["lookup_hit_blocks"] += hit
        return hit

    # ---------------------------------------------------------------- loads
    def start_loads(self, specs: list[LoadSpec], layerwise: bool = True) -> None:
        """Starts this step's loads; synchronous unless `layerwise`."""
        self.finish_loads()  # a previous step's job is always waited on by then; be safe
        if not specs:
            return
        job = _LoadJob(specs, [LayerProgress() for _ in specs])
        self._job = job
        with self._lock:
            self.counters["layerwise_jobs" if layerwise else "synchronous_jobs"] += 1
        if layerwise:
            job.thread = threading.Thread(
                target=self._run_loads, args=(job,), name="kvtier-load", daemon=True
            )
            job.thread.start()
        else:
            self._run_loads(job)

    def _run_loads(self, job: _LoadJob) -> None:
        t0 = time.perf_counter()
        try:
            for spec, progress in zip(job.specs, job.progress, strict=True):
                ids = self.paged.check_ids(spec.block_ids)
                keys = self.keys(spec.tokens, spec.extra)[spec.start : spec.start + ids.size]
                loaded = 0
                if len(keys) == ids.size and ids.size:
                    with self.store.lease(keys) as lease:
                        n = min(lease.hit_blocks, ids.size)
                        if n:
                            report = self.store.load_into_pool(lease, self.pool, ids[:n], progress=progress)
                            loaded = report.loaded_blocks
                progress.close()
                if loaded < ids.size:
                    job.errors.update(int(b) for b in ids[loaded:])
                    job.failed_reqs.add(spec.req_id)
                with self._lock:
                    self.counters["loads"] += 1
                    self.counters["loaded_blocks"] += loaded
                    self.counters["load_error_blocks"] += ids.size - loaded
            with self._lock:  # seconds, for the load's share of TTFT (kvtier bench vllm)
                self.counters["load_s"] += time.perf_counter() - t0  # type: ignore[assignment]
        except BaseException:
            log.exception("kvtier load failed; every block of this step's loads is reported for recompute")
            for spec in job.specs:
                job.errors.update(spec.block_ids)
                job.failed_reqs.add(spec.req_id)
            with self._lock:
                self.counters["load_exceptions"] += 1
        finally:
            for progress in job.progress:
                progress.close()

    def start_async_loads(self, specs: list[LoadSpec]) -> None:
        """Starts loads for requests outside this step's forward (vLLM holds them in
        WAITING_FOR_REMOTE_KVS); `finished_async_loads` reports them once every block is in place
        or failed. Nothing in the forward waits for them."""
        job = _LoadJob(specs, [LayerProgress() for _ in specs])

        def run() -> None:
            self._run_loads(job)
            with self._lock:
                self._async_running.remove(job)
                self._async_done.append(job)

        with self._lock:
            self.counters["async_jobs"] += 1
            self._async_running.append(job)
        job.thread = threading.Thread(target=run, name="kvtier-async-load", daemon=True)
        job.thread.start()

    def finished_async_loads(self) -> set[str]:
        """Requests whose async loads ended since the last call; their failed blocks join the load
        errors (`take_load_errors`), which vLLM reads after this in the same pass."""
        with self._lock:
            done, self._async_done = self._async_done, []
        reqs: set[str] = set()
        for job in done:
            self._load_errors |= job.errors
            reqs.update(spec.req_id for spec in job.specs)
        return reqs

    def wait_layer(self, layer: int | None) -> None:
        """Waits until `layer`'s blocks of this step's loads are in place; `None` (a layer the
        connector cannot place): until every layer's are."""
        job = self._job
        if job is None:
            return
        last = self.paged.num_layers - 1 if layer is None else layer
        t0 = time.perf_counter()
        for progress in job.progress:
            progress.wait(last)
        waited = time.perf_counter() - t0
        with self._lock:  # seconds the forward stood still for loads (overlap = load_s - this)
            self.counters["load_wait_s"] += waited  # type: ignore[assignment]

    def finish_loads(self) -> set[str]:
        """Waits for this step's loads; returns the requests whose loads failed (their saves drop)."""
        job, self._job = self._job, None
        if job is None:
            return set()
        if job.thread is not None:
            job.thread.join()
        self._load_errors |= job.errors
        if job.failed_reqs:
            self._step_failed = True
        return job.failed_reqs

    def take_load_errors(self) -> set[int]:
        self.finish_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---------------------------------------------------------------- saves
    def submit_saves(self, specs: list[SaveSpec]) -> None:
        self.finish_loads()
        # Any load failure drops every save of the step: other requests (a shared prefix block,
        # another TP rank through the all-reduce) may have computed over the missing block.
        failed, self._step_failed = self._step_failed, False
        for spec in specs:
            with self._lock:
                self._saw_saves.add(spec.req_id)
            if failed or not spec.block_ids:
                with self._lock:
                    self.counters["saves_dropped_after_load_error"] += 1
                continue
            keys = self.keys(spec.tokens, spec.extra)[spec.start : spec.start + len(spec.block_ids)]
            if len(keys) != len(spec.block_ids):
                log.error(
                    "kvtier save of %s: %d keys for %d blocks; skipped",
                    spec.req_id,
                    len(keys),
                    len(spec.block_ids),
                )
                continue
            with self._lock:
                self._pending[spec.req_id] += 1
                self._submitted += 1
            self._saves.put((spec, keys))

    def _save_loop(self) -> None:
        while True:
            item = self._saves.get()
            if item is None:
                return
            spec, keys = item
            try:
                report = self.store.put_from_pool(keys, self.pool, spec.block_ids)
                with self._lock:
                    self.counters["saves"] += 1
                    self.counters["saved_blocks"] += report.stored
                    self.counters["save_already_present"] += report.already_present
                    self.counters["save_rejected"] += report.rejected
            except Exception:
                log.exception("kvtier save of request %s failed; those blocks stay uncached", spec.req_id)
                with self._lock:
                    self.counters["save_exceptions"] += 1
            finally:
                with self._lock:
                    self._completed += 1
                    self._pending[spec.req_id] -= 1
                    if self._pending[spec.req_id] <= 0:
                        del self._pending[spec.req_id]
                    self._idle.notify_all()

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Of the requests vLLM finished (now or earlier) whose blocks wait on saves, those done."""
        with self._lock:
            self._awaiting |= finished_req_ids & self._saw_saves
            done = {r for r in self._awaiting if self._pending[r] == 0}
            self._awaiting -= done
            self._saw_saves -= done
        return done

    def drain(self) -> None:
        """Waits until every queued save is done (before vLLM may overwrite blocks)."""
        with self._lock:
            while self._pending:
                self._idle.wait()

    # ---------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        s = self.store.stats()
        with self._lock:
            out: dict[str, Any] = dict(self.counters)
        out["store"] = {k: v for k, v in vars(s).items() if isinstance(v, int | float)}
        return out

    def write_stats(self) -> None:
        if self.stats_file is None:
            return
        tmp = self.stats_file.with_name(self.stats_file.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.stats(), indent=1, sort_keys=True))
        os.replace(tmp, self.stats_file)

    def close(self) -> None:
        self.finish_loads()
        with self._lock:
            running = [j.thread for j in self._async_running if j.thread is not None]
        for thread in running:
            thread.join()
        self.drain()
        self._saves.put(None)
        self._saver.join(timeout=30)
        self.store.flush()
        self.write_stats()
