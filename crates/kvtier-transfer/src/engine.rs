//! [`TransferEngine`]: asynchronous load and store jobs over a [`Store`](kvtier_store::Store)
//! and caller pools, run through the chunked pipeline (docs/transfer.md).
//!
//! Threads: `stage_workers.read` readers take chunks from the active jobs (oldest first) as
//! buffer regions free up; decompress, dequantize and scatter workers take chunks from bounded
//! queues (at most `buffer_chunks` entries: one per region); `store_workers` run store jobs and
//! paged jobs (one store call each, [`crate::store_calls`]; paged loads queue first).
//! Lock order: `table`, then the store's locks (a submission leases under `table`); `dispatch`,
//! stage queues and `store_queue` are leaves. The workers are in [`workers`]; what they share
//! with submission and collection, in [`shared`] (below both). A panic on a worker fails its
//! chunk's blocks as `Panicked` and the worker goes on ([`crate::panics`]).

mod shared;
mod workers;

use std::cell::UnsafeCell;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{atomic::AtomicU64, atomic::AtomicUsize, atomic::Ordering, Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use kvtier_core::paged::PagedPool;
use kvtier_core::BlockKey;
use kvtier_store::StoredBlock;

use crate::aligned::AlignedBuf;
use crate::config::TransferConfig;
use crate::error::TransferError;
use crate::job::{BlockOutcome, FinishedJob, Job, JobId, JobKind};
use crate::panics::Faults;
#[cfg(feature = "test-hooks")]
use crate::panics::PanicSite;
use crate::pool::{PoolRef, PoolShape};
use crate::stages;
use crate::submission::{self, BlockClaims};
pub use shared::StoreHandle;
use shared::{
    chunks_done, finish_job, lock, Dispatch, Shared, Slot, StageQueue, Table, DECOMPRESS, DEQUANTIZE, SCATTER,
};
use workers::{read_worker, stage_worker, store_worker};

/// Time and volume one stage spent, summed over its workers.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StageStats {
    pub name: &'static str,
    pub workers: usize,
    pub busy_s: f64,
    /// Block bytes the stage processed (decoded size: `blocks × block_bytes`).
    pub bytes: u64,
    pub chunks: u64,
    /// Read stage: bytes of the blocks as their tiers store them (encoded payloads), i.e. what
    /// was read; `stored_bytes / bytes` is the fraction of the decoded size moved. 0 for the
    /// other stages.
    pub stored_bytes: u64,
}

impl StageStats {
    /// Bytes per second one worker of this stage moves (0 when the stage never ran).
    pub fn rate_bytes_per_s(&self) -> f64 {
        if self.busy_s > 0.0 {
            self.bytes as f64 / self.busy_s
        } else {
            0.0
        }
    }
}

/// Asynchronous load/store jobs between a [`Store`](kvtier_store::Store) and `LayerFirst` pools or [`PagedPool`]s.
/// `Send + Sync`.
pub struct TransferEngine {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl TransferEngine {
    /// Starts the engine's workers and allocates every stage buffer.
    pub fn new(store: Arc<dyn StoreHandle>, config: TransferConfig) -> Result<Self, TransferError> {
        config.validate()?;
        let geometry = store.store().namespace().geometry.clone();
        let block_bytes = store.store().block_bytes();
        let store_config = store.store().config();
        // DRAM holds raw blocks only; a lower tier may hold codec objects (whatever this
        // store's codec settings: they may have been written by another configuration).
        let decoding = store_config.ssd.is_some() || store_config.remote.is_some();
        let region = config
            .chunk_blocks
            .checked_mul(block_bytes)
            .ok_or_else(|| TransferError::Config("chunk_blocks × block_bytes overflows".into()))?;
        // Sized for the worst case: a block read raw takes its whole slot.
        let buffers = match () {
            _ if config.allocate_per_chunk => 0,
            _ if decoding => 3,
            _ => 1,
        };
        let slots = (0..config.buffer_chunks)
            .map(|_| Slot {
                bufs: std::array::from_fn(|b| {
                    UnsafeCell::new(AlignedBuf::prefaulted(if b < buffers { region } else { 0 }))
                }),
                forms: UnsafeCell::new(vec![StoredBlock::raw(block_bytes); config.chunk_blocks]),
            })
            .collect();
        let queue = || StageQueue {
            queue: Mutex::new((VecDeque::with_capacity(config.buffer_chunks), false)),
            ready: Condvar::new(),
        };
        let shared = Arc::new(Shared {
            store,
            geometry,
            block_bytes,
            decoding,
            slots,
            dispatch: Mutex::new(Dispatch {
                active: VecDeque::with_capacity(config.jobs_in_flight_max),
                free_slots: (0..config.buffer_chunks).rev().collect(),
                shutdown: false,
            }),
            dispatch_ready: Condvar::new(),
            queues: [queue(), queue(), queue()],
            store_queue: Mutex::new((VecDeque::with_capacity(config.jobs_in_flight_max), false)),
            store_ready: Condvar::new(),
            table: Mutex::new(Table {
                jobs: HashMap::with_capacity(config.jobs_in_flight_max),
                finished: VecDeque::with_capacity(config.jobs_in_flight_max),
                inflight_bytes: 0,
                claims: BlockClaims::default(),
            }),
            table_changed: Condvar::new(),
            layer_waiters: AtomicUsize::new(0),
            counters: Default::default(),
            next_id: AtomicU64::new(1),
            faults: Faults::default(),
            config,
        });
        let mut threads = Vec::new();
        let w = shared.config.stage_workers;
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new().name(name).spawn(f).expect("spawning transfer worker")
        };
        for i in 0..w.read {
            let s = shared.clone();
            threads.push(spawn(format!("kvtier-read-{i}"), Box::new(move || read_worker(&s))));
        }
        let stage_threads = [
            (DECOMPRESS, w.decompress, shared.decoding, "decompress"),
            (DEQUANTIZE, w.dequantize, shared.decoding, "dequantize"),
            (SCATTER, w.scatter, true, "scatter"),
        ];
        for (stage, n, needed, name) in stage_threads {
            for i in 0..if needed { n } else { 0 } {
                let s = shared.clone();
                threads.push(spawn(format!("kvtier-{name}-{i}"), Box::new(move || stage_worker(&s, stage))));
            }
        }
        for i in 0..shared.config.store_workers {
            let s = shared.clone();
            threads.push(spawn(format!("kvtier-store-{i}"), Box::new(move || store_worker(&s))));
        }
        Ok(TransferEngine { shared, threads })
    }

    pub fn config(&self) -> &TransferConfig {
        &self.shared.config
    }

    pub fn block_bytes(&self) -> usize {
        self.shared.block_bytes
    }

    /// Starts loading `keys[i]` into pool block `block_ids[i]`. The hit prefix is leased now
    /// and held until the job finishes; blocks past it finish as [`BlockOutcome::Miss`], ids
    /// out of range as `BadBlockId`, repeated ids as `DuplicateBlock` (the first one loads).
    /// Errors (nothing started): a pool that is not `num_blocks × block_bytes`, a count
    /// mismatch, a bound reached, or the store refusing the lease.
    pub fn submit_load(
        &self,
        keys: &[BlockKey],
        pool: PoolRef,
        block_ids: &[u64],
    ) -> Result<JobId, TransferError> {
        self.submit(JobKind::Load, keys, pool, None, block_ids)
    }

    /// [`submit_load`](Self::submit_load) into a [`PagedPool`] of the geometry's layers (`check_layers`;
    /// kept alive until collected): one [`Store::load_into_pool`](kvtier_store::Store::load_into_pool) on a store worker, layers announced to
    /// [`wait_layer`](Self::wait_layer) before the `ReadFailed` verdicts (docs/transfer.md §1.1).
    pub fn submit_paged_load(
        &self,
        keys: &[BlockKey],
        pool: PagedPool,
        block_ids: &[u64],
    ) -> Result<JobId, TransferError> {
        let blocks = PoolRef::blocks_only(pool.num_blocks() as u64);
        self.submit(JobKind::Load, keys, blocks, Some(pool), block_ids)
    }

    /// [`submit_store`](Self::submit_store) from a [`PagedPool`]: one [`Store::put_from_pool`](kvtier_store::Store::put_from_pool).
    pub fn submit_paged_store(
        &self,
        keys: &[BlockKey],
        pool: PagedPool,
        block_ids: &[u64],
    ) -> Result<JobId, TransferError> {
        let blocks = PoolRef::blocks_only(pool.num_blocks() as u64);
        self.submit(JobKind::Store, keys, blocks, Some(pool), block_ids)
    }

    /// Starts storing pool block `block_ids[i]` under `keys[i]` (gather → put): the store
    /// encodes each block for the tiers it reaches by their codecs (`ssd_codec`, ...).
    /// Blocks the store refuses finish as [`BlockOutcome::Rejected`]; bad ids as for loads.
    pub fn submit_store(
        &self,
        keys: &[BlockKey],
        pool: PoolRef,
        block_ids: &[u64],
    ) -> Result<JobId, TransferError> {
        self.submit(JobKind::Store, keys, pool, None, block_ids)
    }

    fn submit(
        &self,
        kind: JobKind,
        keys: &[BlockKey],
        pool: PoolRef,
        paged: Option<PagedPool>,
        block_ids: &[u64],
    ) -> Result<JobId, TransferError> {
        let sh = &self.shared;
        let len = paged.as_ref().map_or(pool.len(), |p| p.num_blocks() * p.block_bytes());
        let max = sh.config.job_blocks_max;
        submission::check_sizes(sh.block_bytes, max, keys.len(), len, pool.num_blocks(), block_ids)?;
        paged.as_ref().filter(|_| kind == JobKind::Load).map_or(Ok(()), |p| p.check_layers(&sh.geometry))?;
        let job_bytes = keys.len() as u64 * sh.block_bytes as u64;
        let job = {
            let mut table = lock(&sh.table);
            if table.jobs.len() >= sh.config.jobs_in_flight_max {
                return Err(TransferError::TooManyJobs {
                    active: table.jobs.len(),
                    max: sh.config.jobs_in_flight_max,
                });
            }
            if table.inflight_bytes + job_bytes > sh.config.inflight_bytes_max {
                return Err(TransferError::TooManyBytes {
                    job_bytes,
                    inflight_bytes: table.inflight_bytes,
                    max: sh.config.inflight_bytes_max,
                });
            }
            // Refused before the lease: a block an in-flight job touches (submission.rs).
            let address = submission::pool_address(&pool, paged.as_ref());
            let memory = submission::PoolMemory::of(&pool, paged.as_ref());
            table.claims.check(kind, address, &memory, block_ids)?;
            let store = sh.store.store();
            let (lease, work_blocks) = match kind {
                JobKind::Load => {
                    let lease = store.lease(store.namespace_hash(), keys)?;
                    (Some(lease.id), lease.hit_blocks)
                }
                JobKind::Store => (None, keys.len()),
            };
            // A store job's KV is from now: a clear between now and its puts drops them.
            let epoch = store.epoch();
            let id = sh.next_id.fetch_add(1, Ordering::Relaxed);
            let shape = PoolShape::new(&sh.geometry, pool.num_blocks());
            let job = Arc::new(
                Job::new(
                    id,
                    kind,
                    keys.to_vec(),
                    block_ids.to_vec(),
                    pool,
                    shape,
                    lease,
                    work_blocks,
                    // A paged job is one store call: one chunk.
                    if paged.is_some() { work_blocks.max(1) } else { sh.config.chunk_blocks },
                    sh.config.buffer_chunks,
                    sh.block_bytes as u64,
                )
                .with_paged(paged)
                .with_epoch(epoch),
            );
            job.settle_bad_ids();
            (work_blocks..keys.len()).for_each(|i| job.settle(i, BlockOutcome::Miss));
            table.jobs.insert(id, job.clone());
            table.claims.hold(&job, memory);
            table.inflight_bytes += job_bytes;
            job
        };
        if job.chunks_total == 0 {
            finish_job(sh, &job);
        } else if !job.on_store_workers() {
            lock(&sh.dispatch).active.push_back(job.clone());
            sh.dispatch_ready.notify_all();
        } else {
            // A load waits on no one's saves: paged loads go first.
            let mut q = lock(&sh.store_queue);
            let at = if kind == JobKind::Load { 0 } else { q.0.len() };
            q.0.insert(at, job.clone());
            sh.store_ready.notify_all();
        }
        Ok(job.id)
    }

    /// Collects every finished job (each is reported once, here or by [`wait`](Self::wait)),
    /// releasing its pool blocks.
    pub fn finished(&self) -> Vec<FinishedJob> {
        let table = &mut *lock(&self.shared.table);
        let jobs: Vec<_> = table.finished.drain(..).filter_map(|id| table.jobs.remove(&id)).collect();
        jobs.iter().inspect(|j| table.claims.release(j)).map(|j| j.finished_job()).collect()
    }

    /// Waits for every job in `ids` to finish and collects them, in the order given. An id
    /// that is unknown (never submitted, or already collected) is an error, checked first; so is
    /// one another caller collected while this one waited (it was reported there: each job is
    /// reported once), and then this call collects none of `ids`. An id given twice is an
    /// error too (`RepeatedJob`), checked first.
    pub fn wait(&self, ids: &[JobId]) -> Result<Vec<FinishedJob>, TransferError> {
        let sh = &self.shared;
        let mut table = lock(&sh.table);
        if let Some(&id) = ids.iter().find(|id| !table.jobs.contains_key(id)) {
            return Err(TransferError::UnknownJob { id });
        }
        // A job is reported once: an id given twice would be returned twice.
        let mut seen = HashSet::with_capacity(ids.len());
        if let Some(&id) = ids.iter().find(|&&id| !seen.insert(id)) {
            return Err(TransferError::RepeatedJob { id });
        }
        let jobs: Vec<Arc<Job>> = ids.iter().map(|id| table.jobs[id].clone()).collect();
        while !jobs.iter().all(|j| j.is_finished()) {
            table = sh.table_changed.wait(table).unwrap_or_else(|e| e.into_inner());
        }
        // Another caller (a `wait` or `finished` on another thread) may have collected one of
        // them while this one waited: it was reported there, so it is not reported again here
        // (each job is reported once), and none of `ids` is collected by this call.
        if let Some(&id) = ids.iter().find(|id| !table.jobs.contains_key(id)) {
            return Err(TransferError::UnknownJob { id });
        }
        let wanted: HashSet<JobId> = ids.iter().copied().collect();
        table.finished.retain(|id| !wanted.contains(id));
        for id in ids {
            table.jobs.remove(id).inspect(|j| table.claims.release(j));
        }
        Ok(jobs.iter().map(|j| j.finished_job()).collect())
    }

    /// Waits until layer `layer` of every block of load job `id` is final: in place in the pool,
    /// or failed (see the block's outcome, e.g. with [`outcomes`](Self::outcomes)). Returns at
    /// once for a finished job; for a store job, waits for the whole job. Does not collect it.
    /// Errors with [`TransferError::WorkerPanicked`] once a worker panic failed some block of
    /// the job (its outcome is `Panicked`): the layer is not in place for every block.
    pub fn wait_layer(&self, id: JobId, layer: u32) -> Result<(), TransferError> {
        let sh = &self.shared;
        let num_layers = sh.geometry.num_layers();
        if layer >= num_layers {
            return Err(TransferError::LayerOutOfRange { layer, num_layers });
        }
        let mut table = lock(&sh.table);
        let job = table.jobs.get(&id).cloned().ok_or(TransferError::UnknownJob { id })?;
        sh.layer_waiters.fetch_add(1, Ordering::SeqCst);
        let ready = |j: &Job| match j.kind {
            JobKind::Load => j.layer_ready(layer as usize),
            JobKind::Store => j.is_finished(),
        };
        while !ready(&job) && job.panic_message().is_none() {
            table = sh.table_changed.wait(table).unwrap_or_else(|e| e.into_inner());
        }
        sh.layer_waiters.fetch_sub(1, Ordering::SeqCst);
        match job.panic_message() {
            Some(message) => Err(TransferError::WorkerPanicked { id, message: message.to_string() }),
            None => Ok(()),
        }
    }

    /// The outcome of each block of job `id` so far (`Pending` for blocks still moving).
    pub fn outcomes(&self, id: JobId) -> Result<Vec<BlockOutcome>, TransferError> {
        let table = lock(&self.shared.table);
        Ok(table.jobs.get(&id).ok_or(TransferError::UnknownJob { id })?.outcomes())
    }

    /// Cancels job `id`: chunks not yet started finish as `Cancelled`, chunks in flight stop at
    /// their next stage boundary (a chunk already scattering completes). Returns `Ok(true)` if
    /// the job was still running, `Ok(false)` (a no-op) if it had finished; the job must still
    /// be collected. An unknown id (never submitted, or already collected) is an error.
    pub fn cancel(&self, id: JobId) -> Result<bool, TransferError> {
        let sh = &self.shared;
        let job = lock(&sh.table).jobs.get(&id).cloned().ok_or(TransferError::UnknownJob { id })?;
        if job.is_finished() {
            return Ok(false);
        }
        job.cancelled.store(true, Ordering::Release);
        let (from, to) = if job.on_store_workers() {
            let mut q = lock(&sh.store_queue);
            q.0.retain(|j| j.id != id);
            take_rest(&job)
        } else {
            let mut d = lock(&sh.dispatch);
            d.active.retain(|j| j.id != id);
            take_rest(&job)
        };
        for chunk in from..to {
            let (first, count) = job.chunk_range(chunk);
            stages::settle_chunk(&job, first, count, BlockOutcome::Cancelled);
        }
        if to > from {
            chunks_done(sh, &job, to - from);
        }
        Ok(true)
    }

    /// Jobs submitted and not yet collected.
    pub fn jobs(&self) -> usize {
        lock(&self.shared.table).jobs.len()
    }

    /// Per stage (read, decompress, dequantize, scatter): busy time and bytes since start.
    pub fn stage_stats(&self) -> [StageStats; 4] {
        let w = self.shared.config.stage_workers.as_array();
        std::array::from_fn(|i| {
            let c = &self.shared.counters[i];
            StageStats {
                name: crate::config::STAGE_NAMES[i],
                workers: w[i],
                busy_s: c.busy_ns.load(Ordering::Relaxed) as f64 / 1e9,
                bytes: c.bytes.load(Ordering::Relaxed),
                chunks: c.chunks.load(Ordering::Relaxed),
                stored_bytes: c.stored_bytes.load(Ordering::Relaxed),
            }
        })
    }

    /// Tests only (`test-hooks`): the `nth` (from 1) time from now a worker passes `site`, it
    /// panics (see [`PanicSite`]); 0 disarms it. [`PanicSite::Swap`] is the duplex engine's.
    #[cfg(feature = "test-hooks")]
    pub fn panic_for_test(&self, site: PanicSite, nth: u64) {
        self.shared.faults.arm(site, nth);
    }

    /// Runs a load with the same stage code, without pipelining: the baselines of
    /// `pipeline_ratio_to_sequential` (`bench-baselines` feature). Default: stage after stage
    /// over the whole request, each stage with its configured workers (whole-request buffers,
    /// allocated before timing). `per_chunk`: one thread takes each chunk through all stages
    /// before the next, in one chunk-sized region (the pipeline's buffer locality, no overlap).
    #[cfg(feature = "bench-baselines")]
    pub fn load_sequential(
        &self,
        keys: &[BlockKey],
        pool: PoolRef,
        block_ids: &[u64],
        per_chunk: bool,
    ) -> Result<(FinishedJob, [f64; 4]), TransferError> {
        let sh = &self.shared;
        let max = sh.config.job_blocks_max;
        submission::check_sizes(sh.block_bytes, max, keys.len(), pool.len(), pool.num_blocks(), block_ids)?;
        crate::sequential::run(sh.store.store(), &sh.geometry, &sh.config, keys, pool, block_ids, per_chunk)
    }
}

/// Claims the chunks not yet dispatched (caller holds the dispatch or store-queue lock).
fn take_rest(job: &Job) -> (usize, usize) {
    let from = job.next_chunk.swap(job.chunks_total, Ordering::AcqRel).min(job.chunks_total);
    (from, job.chunks_total)
}

impl Drop for TransferEngine {
    /// Cancels what is still running, waits for in-flight chunks to drain (so no worker touches
    /// a caller pool after this returns), releases every lease, and joins the workers.
    fn drop(&mut self) {
        let sh = &self.shared;
        let ids: Vec<JobId> = lock(&sh.table).jobs.keys().copied().collect();
        for id in ids {
            let _ = self.cancel(id);
        }
        {
            let mut table = lock(&sh.table);
            while !table.jobs.values().all(|j| j.is_finished()) {
                table = sh.table_changed.wait(table).unwrap_or_else(|e| e.into_inner());
            }
        }
        lock(&sh.dispatch).shutdown = true;
        sh.dispatch_ready.notify_all();
        for q in &sh.queues {
            lock(&q.queue).1 = true;
            q.ready.notify_all();
        }
        lock(&sh.store_queue).1 = true;
        sh.store_ready.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
