//! What the engine and its workers share: the jobs' table, the buffer regions, the stage
//! queues and counters (one [`Shared`] per engine, behind an `Arc`), and how a job's chunks end.
//! Below both [`super`] (submission, collection, drop) and [`super::workers`] (the threads).

use std::cell::UnsafeCell;
use std::collections::{HashMap, VecDeque};
use std::sync::{atomic::AtomicU64, atomic::AtomicUsize, atomic::Ordering, Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use kvtier_core::Geometry;
use kvtier_store::{Store, StoredBlock};

use crate::aligned::AlignedBuf;
use crate::config::TransferConfig;
use crate::hot_path::foreign;
use crate::job::{Job, JobId};
use crate::panics::Faults;
use crate::stages::Needs;
use crate::submission::BlockClaims;

/// Something that holds a [`Store`] for the engine's life (an `Arc<Store>`, or the Python
/// store object).
pub trait StoreHandle: Send + Sync + 'static {
    fn store(&self) -> &Store;
}

impl StoreHandle for Store {
    fn store(&self) -> &Store {
        self
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A worker panic is a bug; the state it guards is still consistent for shutdown.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Default)]
pub(super) struct StageCounter {
    pub(super) busy_ns: AtomicU64,
    pub(super) bytes: AtomicU64,
    pub(super) chunks: AtomicU64,
    pub(super) stored_bytes: AtomicU64,
}

impl StageCounter {
    pub(super) fn add(&self, since: Instant, bytes: usize) {
        self.busy_ns.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.chunks.fetch_add(1, Ordering::Relaxed);
    }
}

/// One chunk moving through the stages, with the buffer region it occupies.
pub(super) struct Task {
    pub(super) job: Arc<Job>,
    pub(super) chunk: usize,
    pub(super) slot: usize,
    /// Decode stages the chunk's blocks need (set by the read stage).
    pub(super) needs: Needs,
    /// `allocate_per_chunk` only: buffers allocated for this chunk, by stage buffer index.
    pub(super) owned: [Option<AlignedBuf>; 3],
}

/// A buffer region: up to three stage buffers of `chunk_blocks × block_bytes` (read,
/// decompress, dequantize), allocated once, and where each block's stored payload sits in the
/// read buffer. A region belongs to exactly one task at a time (`dispatch.free_slots`).
pub(super) struct Slot {
    pub(super) bufs: [UnsafeCell<AlignedBuf>; 3],
    pub(super) forms: UnsafeCell<Vec<StoredBlock>>,
}

// SAFETY: a slot's buffers are accessed only by the worker holding the task that owns the slot.
unsafe impl Sync for Slot {}

pub(super) struct Dispatch {
    pub(super) active: VecDeque<Arc<Job>>,
    pub(super) free_slots: Vec<usize>,
    pub(super) shutdown: bool,
}

pub(super) struct StageQueue {
    pub(super) queue: Mutex<(VecDeque<Task>, bool)>,
    pub(super) ready: Condvar,
}

pub(super) struct Table {
    pub(super) jobs: HashMap<JobId, Arc<Job>>,
    pub(super) finished: VecDeque<JobId>,
    pub(super) inflight_bytes: u64,
    pub(super) claims: BlockClaims,
}

pub(super) struct Shared {
    pub(super) store: Arc<dyn StoreHandle>,
    pub(super) geometry: Geometry,
    pub(super) block_bytes: usize,
    pub(super) config: TransferConfig,
    /// The store has a lower tier, which may hold encoded blocks: decode stages and buffers.
    pub(super) decoding: bool,
    pub(super) slots: Vec<Slot>,
    pub(super) dispatch: Mutex<Dispatch>,
    pub(super) dispatch_ready: Condvar,
    /// Decompress, dequantize, scatter.
    pub(super) queues: [StageQueue; 3],
    pub(super) store_queue: Mutex<(VecDeque<Arc<Job>>, bool)>,
    pub(super) store_ready: Condvar,
    pub(super) table: Mutex<Table>,
    pub(super) table_changed: Condvar,
    pub(super) layer_waiters: AtomicUsize,
    pub(super) counters: [StageCounter; 4],
    pub(super) next_id: AtomicU64,
    /// Injected panics (`test-hooks`; empty otherwise).
    pub(super) faults: Faults,
}

pub(super) const DECOMPRESS: usize = 0;
pub(super) const DEQUANTIZE: usize = 1;
pub(super) const SCATTER: usize = 2;

/// Records `n` more chunks of `job` as done; the last one finishes the job.
pub(super) fn chunks_done(sh: &Shared, job: &Arc<Job>, n: usize) {
    if job.chunks_done.fetch_add(n, Ordering::AcqRel) + n == job.chunks_total {
        finish_job(sh, job);
    }
}

/// Releases the job's lease and publishes it as finished.
pub(super) fn finish_job(sh: &Shared, job: &Arc<Job>) {
    if let Some(lease) = job.lease {
        // Releasing is idempotent; an error means the lease already ended (expired). A panic in
        // the store must not leave the job unfinished (waiters would hang): the lease then
        // expires by its ttl. Nothing of the engine's is borrowed across it.
        let release = || foreign(|| sh.store.store().release(lease));
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(release));
    }
    let mut table = lock(&sh.table);
    job.mark_finished();
    table.inflight_bytes -= job.bytes;
    table.finished.push_back(job.id);
    sh.table_changed.notify_all();
}
