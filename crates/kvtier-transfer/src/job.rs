//! A job's state, shared by the submitting thread, the stage workers and waiters.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kvtier_core::paged::PagedPool;
use kvtier_core::BlockKey;

use crate::pool::{PoolRef, PoolShape};

pub type JobId = u64;

/// Load (store → pool) or store (pool → store).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobKind {
    Load,
    Store,
}

/// What happened to one block of a job. Every block ends in exactly one of these; only
/// [`BlockOutcome::Done`] means its bytes are in place (loads) or stored (stores).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum BlockOutcome {
    /// Not finished yet (only seen through [`TransferEngine::wait_layer`](crate::TransferEngine)).
    Pending = 0,
    Done = 1,
    /// Not in the store (a load past the hit prefix).
    Miss = 2,
    /// The stored copy failed verification (checksum, namespace) or its read failed (a device
    /// error): the store does not serve it. The rest of its chunk is still read.
    ReadFailed = 3,
    /// The payload did not decode under the engine's codec.
    DecodeFailed = 4,
    /// The job was cancelled before this block moved.
    Cancelled = 5,
    /// The block id is not below the pool's `num_blocks`.
    BadBlockId = 6,
    /// The block id appears earlier in the same job.
    DuplicateBlock = 7,
    /// The store refused it (full of leased blocks) or could not encode it into an object.
    Rejected = 8,
    /// The store call failed (e.g. the lease expired mid-job, or a store job's blocks were
    /// computed before a clear of the store that ran before they were stored).
    StoreFailed = 9,
    /// A transfer worker panicked while moving this block's chunk (a bug, in kvtier or the
    /// store): its bytes may be partly written (loads) or not stored (stores). The worker goes
    /// on with other chunks; [`TransferEngine::wait_layer`](crate::TransferEngine) on the job
    /// errors.
    Panicked = 10,
}

impl BlockOutcome {
    pub const ALL: [BlockOutcome; 11] = [
        BlockOutcome::Pending,
        BlockOutcome::Done,
        BlockOutcome::Miss,
        BlockOutcome::ReadFailed,
        BlockOutcome::DecodeFailed,
        BlockOutcome::Cancelled,
        BlockOutcome::BadBlockId,
        BlockOutcome::DuplicateBlock,
        BlockOutcome::Rejected,
        BlockOutcome::StoreFailed,
        BlockOutcome::Panicked,
    ];

    pub fn name(self) -> &'static str {
        match self {
            BlockOutcome::Pending => "pending",
            BlockOutcome::Done => "done",
            BlockOutcome::Miss => "miss",
            BlockOutcome::ReadFailed => "read_failed",
            BlockOutcome::DecodeFailed => "decode_failed",
            BlockOutcome::Cancelled => "cancelled",
            BlockOutcome::BadBlockId => "bad_block_id",
            BlockOutcome::DuplicateBlock => "duplicate_block",
            BlockOutcome::Rejected => "rejected",
            BlockOutcome::StoreFailed => "store_failed",
            BlockOutcome::Panicked => "panicked",
        }
    }

    fn from_u8(v: u8) -> Self {
        Self::ALL[v as usize]
    }
}

/// A collected job: its outcome per block, in the order of its keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FinishedJob {
    pub id: JobId,
    pub kind: JobKind,
    pub outcomes: Vec<BlockOutcome>,
    pub cancelled: bool,
    /// Times the job's chunks wrapped around the stage buffers (1 when it fit at once).
    pub rounds: usize,
    /// From submission to the job's last block settling (zero for `load_sequential`).
    pub elapsed: Duration,
}

impl FinishedJob {
    /// Blocks whose bytes are in place (loads) or stored (stores).
    pub fn done_blocks(&self) -> usize {
        self.outcomes.iter().filter(|&&o| o == BlockOutcome::Done).count()
    }
    /// `(index, outcome)` of every block that did not complete.
    pub fn failed(&self) -> Vec<(usize, BlockOutcome)> {
        self.outcomes.iter().copied().enumerate().filter(|&(_, o)| o != BlockOutcome::Done).collect()
    }
}

pub(crate) struct Job {
    pub id: JobId,
    pub kind: JobKind,
    pub keys: Vec<BlockKey>,
    pub block_ids: Vec<u64>,
    pub pool: PoolRef,
    pub shape: PoolShape,
    pub lease: Option<u64>,
    /// A store job: the store's [`epoch`](kvtier_store::Store::epoch) at submission. Its puts
    /// store nothing if the store was cleared since (the KV is from before the clear).
    pub epoch: Option<u64>,
    /// Blocks `0..work_blocks` go through the stages; later ones already have their outcome.
    pub work_blocks: usize,
    pub chunk_blocks: usize,
    pub chunks_total: usize,
    pub bytes: u64,
    pub rounds: usize,
    outcomes: Vec<AtomicU8>,
    /// Chunks handed to a worker (advanced under the dispatch lock).
    pub next_chunk: AtomicUsize,
    pub chunks_done: AtomicUsize,
    /// Per layer: chunks whose blocks have that layer in place (or failed).
    pub layer_chunks_done: Vec<AtomicUsize>,
    pub cancelled: AtomicBool,
    pub finished: AtomicBool,
    /// Set (before the blocks' chunk counts as done) when a worker panic settled some block of
    /// the job as `Panicked`: the first panic's message. No layer of the job is then complete.
    panic: OnceLock<String>,
    /// A paged job's target (its `pool` then holds no bytes, only `num_blocks`): the job runs as
    /// one store call ([`crate::store_calls`]) on a store worker.
    pub paged: Option<PagedPool>,
    pub submitted: Instant,
    /// Set when the job finishes: nanoseconds since `submitted`.
    pub elapsed_ns: AtomicU64,
}

impl Job {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: JobId,
        kind: JobKind,
        keys: Vec<BlockKey>,
        block_ids: Vec<u64>,
        pool: PoolRef,
        shape: PoolShape,
        lease: Option<u64>,
        work_blocks: usize,
        chunk_blocks: usize,
        buffer_chunks: usize,
        block_bytes: u64,
    ) -> Job {
        let num_layers = shape.layers;
        let chunks_total = work_blocks.div_ceil(chunk_blocks);
        let bytes = keys.len() as u64 * block_bytes;
        let outcomes = (0..keys.len()).map(|_| AtomicU8::new(BlockOutcome::Pending as u8)).collect();
        Job {
            id,
            kind,
            keys,
            block_ids,
            pool,
            shape,
            lease,
            epoch: None,
            work_blocks,
            chunk_blocks,
            chunks_total,
            bytes,
            rounds: chunks_total.div_ceil(buffer_chunks).max(1),
            outcomes,
            next_chunk: AtomicUsize::new(0),
            chunks_done: AtomicUsize::new(0),
            layer_chunks_done: (0..num_layers).map(|_| AtomicUsize::new(0)).collect(),
            cancelled: AtomicBool::new(false),
            finished: AtomicBool::new(false),
            panic: OnceLock::new(),
            paged: None,
            submitted: Instant::now(),
            elapsed_ns: AtomicU64::new(0),
        }
    }

    /// A store job submitted at the store's `epoch` (see [`Job::epoch`]).
    pub fn with_epoch(mut self, epoch: u64) -> Job {
        self.epoch = Some(epoch);
        self
    }

    /// A job whose blocks live in `pool` (see [`Job::paged`]).
    pub fn with_paged(mut self, pool: Option<PagedPool>) -> Job {
        self.paged = pool;
        self
    }

    /// Paged jobs and store jobs run on the store workers (the store queue); LayerFirst loads
    /// go through the stages.
    pub fn on_store_workers(&self) -> bool {
        self.kind == JobKind::Store || self.paged.is_some()
    }

    /// Records the job's duration and publishes it as finished.
    pub fn mark_finished(&self) {
        self.elapsed_ns.store(self.submitted.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.finished.store(true, Ordering::Release);
    }

    /// Blocks `first..first + count` of chunk `chunk`.
    pub fn chunk_range(&self, chunk: usize) -> (usize, usize) {
        let first = chunk * self.chunk_blocks;
        (first, self.chunk_blocks.min(self.work_blocks - first))
    }

    pub fn outcome(&self, i: usize) -> BlockOutcome {
        BlockOutcome::from_u8(self.outcomes[i].load(Ordering::Acquire))
    }

    pub fn is_pending(&self, i: usize) -> bool {
        self.outcome(i) == BlockOutcome::Pending
    }

    /// Ids past the pool and repeated ids fail before any byte moves.
    pub fn settle_bad_ids(&self) {
        let mut seen = std::collections::HashSet::with_capacity(self.block_ids.len());
        for (i, &b) in self.block_ids.iter().enumerate() {
            if b >= self.pool.num_blocks() {
                self.settle(i, BlockOutcome::BadBlockId);
            } else if !seen.insert(b) {
                self.settle(i, BlockOutcome::DuplicateBlock);
            }
        }
    }

    /// Sets block `i`'s outcome unless it already has one (the first reason wins).
    pub fn settle(&self, i: usize, outcome: BlockOutcome) {
        self.try_settle(i, outcome);
    }

    /// [`settle`](Self::settle); true if this call set the outcome.
    pub fn try_settle(&self, i: usize, outcome: BlockOutcome) -> bool {
        self.outcomes[i]
            .compare_exchange(BlockOutcome::Pending as u8, outcome as u8, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// A worker panicked over blocks `first..first + count`: each still pending is `Panicked`,
    /// and if any was, the job records `message` (the first panic's wins).
    pub fn settle_panicked(&self, first: usize, count: usize, message: String) {
        let settled = (first..first + count).filter(|&i| self.try_settle(i, BlockOutcome::Panicked)).count();
        if settled > 0 {
            let _ = self.panic.set(message);
        }
    }

    /// The message of the worker panic that failed some of the job's blocks, if one did.
    pub fn panic_message(&self) -> Option<&str> {
        self.panic.get().map(String::as_str)
    }

    pub fn outcomes(&self) -> Vec<BlockOutcome> {
        (0..self.outcomes.len()).map(|i| self.outcome(i)).collect()
    }

    pub fn is_finished(&self) -> bool {
        self.finished.load(Ordering::Acquire)
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    pub fn layer_ready(&self, layer: usize) -> bool {
        // SeqCst pairs with the scatter stage's increment and waiter check (see engine.rs).
        self.is_finished() || self.layer_chunks_done[layer].load(Ordering::SeqCst) >= self.chunks_total
    }

    pub fn finished_job(&self) -> FinishedJob {
        FinishedJob {
            id: self.id,
            kind: self.kind,
            outcomes: self.outcomes(),
            cancelled: self.is_cancelled(),
            rounds: self.rounds,
            elapsed: Duration::from_nanos(self.elapsed_ns.load(Ordering::Relaxed)),
        }
    }
}
