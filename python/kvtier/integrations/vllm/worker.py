"""The worker side of the vLLM connector: one kvtier Store per TP rank (numpy only; no vLLM).

Each step the scheduler sends `LoadSpec`s and `SaveSpec`s (token ids, the request's key extra,
which of its blocks, and vLLM block ids). The worker hashes the tokens into kvtier's chained keys
in its own namespace, so the scheduler never needs the namespace.

Every load and save is a `TransferEngine` job over vLLM's cache tensors as a `PagedPool`
(docs/transfer.md §5, docs/vllm.md): one job per request, run on the engine's store workers
(loads queue before saves) as one store call, `Store.load_into_pool` / `Store.put_from_pool`,
which copy each block straight between the store's DRAM objects and vLLM's per-layer tensors.

Loads (`start_loads`): a load job leases the request's hit prefix and announces its layers as they
land; `wait_layer(l)` (`TransferEngine.wait_layer`, GIL released) returns as soon as layer l of
every block of the step's jobs is in place, so attention on the first layers overlaps the copy of
the later ones. Synchronous loads wait for the jobs in `start_loads`. With `load_async`, a hit is
loaded between steps (`start_async_loads`): the request sits outside the forward until
`finished_async_loads` reports it to vLLM. A block whose job outcome is not "done" (a miss after
eviction, "read_failed" for a checksum failure, a server down) is a *load error*: its vLLM block
id (and those after it in the request) is reported so vLLM recomputes it and discards the step's
output for that request, and the step's saves are dropped (their KV was computed over the missing
block). A checksum verdict comes after the last layer, which is why a failed block is still
reported even though its layers were announced.

Saves (`submit_saves`) are store jobs submitted after the step's forward. vLLM must not free a
request's blocks before its saves are done: `finished()` reports a finished request only once its
save jobs completed, and `drain()` (before a preemption frees blocks, and at shutdown) waits for
all of them. Jobs are collected (`TransferEngine.finished` / `wait`) under one lock, so the lookup
thread and the model runner never collect the same job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.errors import ConfigError, KvtierError
from kvtier.integrations.vllm.kv_layout import PagedKV
from kvtier.keys import BlockKeys
from kvtier.layout import PagedPool
from kvtier.results import json_text, output_file
from kvtier.store import Store
from kvtier.transfer import FinishedJob, TransferConfig, TransferEngine, TransferError

log = logging.getLogger("kvtier.vllm")

#: The worker's engine: paged jobs only, so the staged pipeline gets the smallest buffers; two store
#: workers so a load never waits for a save in progress; bounds far above a step's jobs.
ENGINE_CONFIG = TransferConfig(
    chunk_blocks=1,
    buffer_chunks=1,
    store_workers=2,
    jobs_in_flight_max=1 << 16,
    inflight_bytes_max=1 << 50,
    job_blocks_max=1 << 24,
)


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
    """One step's (or one async batch's) loads: an engine job per spec (None: nothing to load)."""

    specs: list[LoadSpec]
    jobs: list[tuple[npt.NDArray[np.int64], int | None]] = field(default_factory=list)
    broken: bool = False  # submission raised: every block of every spec is an error
    done: bool = False
    errors: set[int] = field(default_factory=set)
    failed_reqs: set[str] = field(default_factory=set)

    def ids(self) -> list[int]:
        return [j for _, j in self.jobs if j is not None]


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
        self.stats_file = Path(stats_file) if stats_file else None
        self._stats_error = ""  # why the last write of the stats file failed ("": it did not)
        try:  # now, not at the first step that moves a counter (the error would end the engine)
            output_file(stats_file or None, "`stats_file`")
        except KvtierError as e:
            raise ConfigError(str(e)) from None
        self.counters: Counter[str] = Counter()  # ints, and float second totals (names ending in _s)
        self._lock = threading.Lock()
        self.engine = TransferEngine(store, ENGINE_CONFIG)
        # Collecting jobs (engine.finished / wait) and the maps below; taken before `_lock`.
        self._collect = threading.RLock()
        self._results: dict[int, FinishedJob] = {}  # collected load jobs not yet read
        self._save_jobs: dict[int, str] = {}  # save jobs not yet collected -> request
        self._job: _LoadJob | None = None
        # Loads between steps (`load_async`), not yet reported to vLLM.
        self._async_running: list[_LoadJob] = []
        self._load_errors: set[int] = set()
        # Load failures of the current step, kept until its saves are planned (vLLM may ask for the
        # load errors first, with speculative decoding): read and cleared by submit_saves only.
        self._step_failed = False
        self._pending: Counter[str] = Counter()  # per request: save jobs not yet collected
        self._saw_saves: set[str] = set()
        self._awaiting: set[str] = set()

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
        """Cached blocks of `tokens`, counting every save submitted before this call: vLLM hands a
        request's output back before its (delayed) save is done, and the user's next turn must hit."""
        t0 = time.perf_counter()
        self._wait_saves()
        t1 = time.perf_counter()
        hit = self.store.lookup(self.keys(tokens, extra)).hit_blocks
        with self._lock:
            self.counters["lookup_save_wait_s"] += t1 - t0  # type: ignore[assignment]
            self.counters["lookup_s"] += time.perf_counter() - t1  # type: ignore[assignment]
            self.counters["lookups"] += 1
            self.counters["lookup_hit_blocks"] += hit
        return hit

    # ---------------------------------------------------------------- jobs
    def _submit(self, load: bool, keys: BlockKeys, ids: npt.NDArray[np.int64]) -> int:
        submit = self.engine.submit_load if load else self.engine.submit_store
        try:
            return submit(keys, self.pool, ids)
        except TransferError:  # a bound: collect what finished, and try once more
            self._poll()
            return submit(keys, self.pool, ids)

    def _absorb(self, jobs: Iterable[FinishedJob]) -> None:
        """Files collected jobs (caller holds `_collect`): saves settle their request now, loads
        wait in `_results` for their step."""
        for j in jobs:
            req = self._save_jobs.pop(j.id, None)
            if req is None:
                self._results[j.id] = j
                continue
            failed = [o for o in j.outcomes if o not in ("done", "rejected")]
            if failed:
                log.error("kvtier save of request %s: %d blocks failed (%s)", req, len(failed), failed[0])
            with self._lock:
                self.counters["saves"] += 1
                self.counters["saved_blocks"] += j.done_blocks
                self.counters["save_rejected"] += j.outcomes.count("rejected")
                self.counters["save_failed_blocks"] += len(failed)
                self._pending[req] -= 1
                if self._pending[req] <= 0:
                    del self._pending[req]

    def _poll(self) -> None:
        with self._collect:
            self._absorb(self.engine.finished())

    def _wait_saves(self) -> None:
        """Waits for every save job submitted so far."""
        with self._collect:
            self._absorb(self.engine.wait(list(self._save_jobs)))

    # ---------------------------------------------------------------- loads
    def _submit_loads(self, specs: list[LoadSpec]) -> _LoadJob:
        job = _LoadJob(specs)
        try:
            for spec in specs:
                ids = self.paged.check_ids(spec.block_ids)
                keys = self.keys(spec.tokens, spec.extra)[spec.start : spec.start + ids.size]
                ok = len(keys) == ids.size and ids.size > 0
                job.jobs.append((ids, self._submit(True, keys, ids) if ok else None))
        except Exception:
            log.exception("kvtier load failed; every block of these loads is reported for recompute")
            job.broken = True
            with self._lock:
                self.counters["load_exceptions"] += 1
        return job

    def _complete(self, job: _LoadJob) -> None:
        """Waits for the job's engine jobs and turns their outcomes into load errors."""
        if job.done:
            return
        job.done = True
        with self._collect:
            self._absorb(self.engine.wait([i for i in job.ids() if i not in self._results]))
            results = {i: self._results.pop(i) for i in job.ids()}
        if job.broken:
            for spec in job.specs:
                job.errors.update(spec.block_ids)
                job.failed_reqs.add(spec.req_id)
            return
        for spec, (ids, jid) in zip(job.specs, job.jobs, strict=True):
            outcomes = results[jid].outcomes if jid is not None else ()
            loaded = next((i for i, o in enumerate(outcomes) if o != "done"), len(outcomes))
            if loaded < ids.size:
                job.errors.update(int(b) for b in ids[loaded:])
                job.failed_reqs.add(spec.req_id)
            with self._lock:
                self.counters["loads"] += 1
                self.counters["loaded_blocks"] += loaded
                self.counters["load_error_blocks"] += ids.size - loaded
        with self._lock:  # seconds the jobs ran, for the load's share of TTFT (kvtier bench vllm)
            elapsed = max((r.elapsed_s for r in results.values()), default=0.0)
            self.counters["load_s"] += elapsed  # type: ignore[assignment]

    def start_loads(self, specs: list[LoadSpec], layerwise: bool = True) -> None:
        """Starts this step's loads; synchronous unless `layerwise`."""
        self.finish_loads()  # a previous step's job is always waited on by then; be safe
        if not specs:
            return
        self._job = self._submit_loads(specs)
        with self._lock:
            self.counters["layerwise_jobs" if layerwise else "synchronous_jobs"] += 1
        if not layerwise:
            self._complete(self._job)

    def start_async_loads(self, specs: list[LoadSpec]) -> None:
        """Starts loads for requests outside this step's forward (vLLM holds them in
        WAITING_FOR_REMOTE_KVS); `finished_async_loads` reports them once every block is in place
        or failed. Nothing in the forward waits for them."""
        job = self._submit_loads(specs)
        with self._lock:
            self.counters["async_jobs"] += 1
        self._async_running.append(job)

    def finished_async_loads(self) -> set[str]:
        """Requests whose async loads ended since the last call; their failed blocks join the load
        errors (`take_load_errors`), which vLLM reads after this in the same pass."""
        self._poll()
        reqs: set[str] = set()
        for job in list(self._async_running):
            with self._lock:  # never the case after a preemption's drain; kept as a guard
                saving = any(self._pending[spec.req_id] for spec in job.specs)
            if not saving and all(i in self._results for i in job.ids()):
                self._complete(job)
                self._async_running.remove(job)
                self._load_errors |= job.errors
                reqs.update(spec.req_id for spec in job.specs)
        with self._lock:
            # A request that finished (aborted) while loading is freed by vLLM on this report
            # (finished_recving): it must not be reported again as done sending (`finished`).
            self._awaiting -= reqs
            self._saw_saves -= reqs
        return reqs

    def _loading(self) -> set[str]:
        """Requests with an async load not yet reported to vLLM."""
        return {spec.req_id for job in self._async_running for spec in job.specs}

    def wait_layer(self, layer: int | None) -> None:
        """Waits until `layer`'s blocks of this step's loads are in place; `None` (a layer the
        connector cannot place): until every layer's are."""
        job = self._job
        if job is None or job.done:
            return
        last = self.paged.num_layers - 1 if layer is None else layer
        t0 = time.perf_counter()
        for jid in job.ids():
            try:
                self.engine.wait_layer(jid, last)
            except TransferError:
                # Collected already, or a job that failed before the layer landed (a transfer
                # worker panicked): its failed blocks become this step's load errors, and vLLM
                # drops the affected requests' output and recomputes them. A job the engine cannot
                # return is a real error, raised by `wait`.
                with self._collect:
                    if jid not in self._results:
                        self._absorb(self.engine.wait([jid]))
        waited = time.perf_counter() - t0
        with self._lock:  # seconds the forward stood still for loads (overlap = load_s - this)
            self.counters["load_wait_s"] += waited  # type: ignore[assignment]

    def finish_loads(self) -> set[str]:
        """Waits for this step's loads; returns the requests whose loads failed (their saves drop)."""
        job, self._job = self._job, None
        if job is None:
            return set()
        self._complete(job)
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
        # Any load failure drops every save of this rank's step: other requests (a shared prefix
        # block) may have computed over the missing block. Other TP ranks cannot see this rank's
        # failure: the scheduler holds a loading step's saves back until vLLM applied every rank's
        # load errors (connector.py, `deferred`).
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
            # Registered under the collect lock: no one collects the job before it is known.
            with self._collect:
                try:
                    jid = self._submit(False, keys, np.asarray(spec.block_ids, dtype=np.int64))
                except Exception:
                    log.exception("kvtier save of request %s failed; those blocks stay uncached", spec.req_id)
                    with self._lock:
                        self.counters["save_exceptions"] += 1
                    continue
                self._save_jobs[jid] = spec.req_id
                with self._lock:
                    self._pending[spec.req_id] += 1

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Of the requests vLLM finished (now or earlier) whose blocks wait on saves, those done.
        One whose async load still runs is not: vLLM frees a request's blocks on the first report
        of either kind, and the load still writes into them (`finished_async_loads` reports it)."""
        self._poll()
        loading = self._loading()
        with self._lock:
            self._awaiting |= finished_req_ids & self._saw_saves
            done = {r for r in self._awaiting if self._pending[r] == 0 and r not in loading}
            self._awaiting -= done
            self._saw_saves -= done
        return done

    def clear(self) -> int:
        """Drops every block of this worker's store (vLLM's connector reset, after a weight update)
        once the saves submitted before it are done (a save still queued would fail: the engine
        stores nothing of a job submitted before a clear). Returns how many blocks were dropped."""
        self._wait_saves()
        return self.store.clear()

    def drain(self) -> None:
        """Waits until every submitted save is done (before vLLM may overwrite blocks)."""
        self._wait_saves()

    # ---------------------------------------------------------------- stats
    def counter_snapshot(self) -> dict[str, float]:
        """The counters now, read under the lock (jobs finish on other threads)."""
        with self._lock:
            return dict(self.counters)

    def stats(self) -> dict[str, Any]:
        s = self.store.stats()
        with self._lock:
            out: dict[str, Any] = dict(self.counters)
        out["store"] = s.as_dict()
        return out

    def write_stats(self) -> None:
        """Replaces the stats file (atomically). It runs inside vLLM's step, so a write that fails
        (disk full, directory removed) is a warning, once per cause, never an error that ends the
        engine; the next write that works replaces the file again."""
        if self.stats_file is None:
            return
        tmp = self.stats_file.with_name(self.stats_file.name + f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json_text(self.stats(), indent=1, sort_keys=True))
            os.replace(tmp, self.stats_file)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            if str(e) != self._stats_error:
                log.warning("kvtier: cannot write stats_file %s (%s); serving goes on", self.stats_file, e)
            self._stats_error = str(e)
            return
        if self._stats_error:
            log.warning("kvtier: stats_file %s written again", self.stats_file)
        self._stats_error = ""

    def close(self) -> None:
        self.finish_loads()
        for job in self._async_running:
            self._complete(job)
        self._async_running.clear()
        self.drain()
        self.store.flush()
        self.write_stats()
