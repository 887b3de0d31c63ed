//! The engine's worker threads: readers, the decompress, dequantize and scatter stages, and the
//! store workers (see [`super`] for the threads and the lock order).
//!
//! Each chunk's work runs under `catch_unwind` ([`crate::panics`]): a panic settles the chunk's
//! pending blocks as `Panicked` and records it on the job (so `wait_layer` errors), then the
//! chunk leaves as any other (its region back to the free list, its job counted towards
//! finishing, which releases the lease). The thread then takes the next chunk. Why that state is
//! consistent (the `AssertUnwindSafe`s below):
//! - The task, its slot and its job stay owned by this worker: nothing else touches the slot's
//!   buffers or forms, and the next task that takes the slot overwrites what it reads (a read
//!   records each block's form before a later stage uses it).
//! - A job's outcomes, chunk and layer counts are atomics that only grow; a panic leaves the
//!   layer counts of the chunk short (layers it did not publish stay unpublished), never too
//!   high, so no waiter is told a layer landed that did not. The job's blocks that did not finish
//!   are `Panicked`, and only `Done` blocks are promised to hold their bytes.
//! - The engine's mutexes ignore poisoning; the store's are `parking_lot` (never poisoned), and
//!   its in-flight guards and staging buffers are RAII, released by the unwind.
//! - Lost on a panic: the read worker's slice scratch (reallocated on its next chunk) and the
//!   chunk's stage statistics.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use kvtier_store::StoredBlock;

use super::shared::{chunks_done, lock, Shared, Task, DECOMPRESS, DEQUANTIZE, SCATTER};
use crate::aligned::AlignedBuf;
use crate::hot_path;
use crate::job::{BlockOutcome, Job, JobKind};
use crate::panics::{panic_message, PanicSite};
use crate::stages::{self, Needs, SliceScratch};
use crate::store_calls;

impl Shared {
    /// Where each block of the task's chunk sits in its read buffer.
    ///
    /// # Safety
    /// The caller holds `task` (so owns its slot) and keeps no other reference to its forms.
    #[allow(clippy::mut_from_ref)]
    unsafe fn forms(&self, task: &Task) -> &mut [StoredBlock] {
        unsafe { &mut *self.slots[task.slot].forms.get() } // SAFETY: as the caller promises
    }

    /// Pointer to stage buffer `b` of the task's chunk.
    fn buf(&self, task: &mut Task, b: usize) -> *mut u8 {
        match &mut task.owned[b] {
            Some(v) => v.as_mut_ptr(),
            // SAFETY: the task owns its slot, so no one else touches the slot's buffers.
            None => unsafe { (&mut *self.slots[task.slot].bufs[b].get()).as_mut_ptr() },
        }
    }

    /// `allocate_per_chunk`: gives the task a fresh buffer `b` (the "No MM" baseline).
    fn fresh(&self, task: &mut Task, b: usize) {
        if self.config.allocate_per_chunk {
            task.owned[b] = Some(AlignedBuf::fresh(self.config.chunk_blocks * self.block_bytes));
        }
    }

    fn push(&self, stage: usize, task: Task) {
        let q = &self.queues[stage];
        lock(&q.queue).0.push_back(task);
        q.ready.notify_one();
    }

    /// A chunk left the pipeline: its region goes back, and the job may finish.
    fn chunk_left(&self, task: Task) {
        let Task { job, slot, owned, .. } = task;
        drop(owned);
        lock(&self.dispatch).free_slots.push(slot);
        self.dispatch_ready.notify_one();
        chunks_done(self, &job, 1);
    }

    pub(super) fn notify_layer(&self) {
        if self.layer_waiters.load(Ordering::SeqCst) > 0 {
            let _table = lock(&self.table);
            self.table_changed.notify_all();
        }
    }

    /// A worker panicked over blocks `first..first + count` of `job` (the chunk it held): they
    /// are `Panicked`, the job records it before the chunk counts as done, and layer waiters
    /// wake to see it (`wait_layer` then errors).
    fn contain(&self, job: &Job, first: usize, count: usize, payload: Box<dyn Any + Send>) {
        job.settle_panicked(first, count, panic_message(&*payload));
        let _table = lock(&self.table);
        self.table_changed.notify_all();
    }

    /// [`contain`](Self::contain) for a pipeline task, which then leaves (frees its region).
    fn contain_task(&self, task: Task, payload: Box<dyn Any + Send>) {
        let (first, count) = task.job.chunk_range(task.chunk);
        self.contain(&task.job, first, count, payload);
        self.chunk_left(task);
    }
}

fn next_read(sh: &Shared) -> Option<Task> {
    let mut d = lock(&sh.dispatch);
    loop {
        if d.shutdown {
            return None;
        }
        if !d.free_slots.is_empty() {
            if let Some(job) = d.active.front().cloned() {
                let chunk = job.next_chunk.fetch_add(1, Ordering::AcqRel);
                if chunk + 1 >= job.chunks_total {
                    d.active.pop_front();
                }
                let slot = d.free_slots.pop().expect("a free slot");
                return Some(Task { job, chunk, slot, needs: Needs::default(), owned: [None, None, None] });
            }
        }
        d = sh.dispatch_ready.wait(d).unwrap_or_else(|e| e.into_inner());
    }
}

pub(super) fn read_worker(sh: &Shared) {
    let mut scratch = SliceScratch::with_capacity(sh.config.chunk_blocks);
    while let Some(mut task) = next_read(sh) {
        let _hot = hot_path::enter();
        if task.job.is_cancelled() {
            let (first, count) = task.job.chunk_range(task.chunk);
            stages::settle_chunk(&task.job, first, count, BlockOutcome::Cancelled);
            sh.chunk_left(task);
            continue;
        }
        // See the module docs for why the task is consistent after a panic.
        match catch_unwind(AssertUnwindSafe(|| read(sh, &mut task, &mut scratch))) {
            Ok(next) => sh.push(next, task),
            Err(payload) => sh.contain_task(task, payload),
        }
    }
}

/// Reads the task's chunk into its region; returns the stage it goes to next.
fn read(sh: &Shared, task: &mut Task, scratch: &mut SliceScratch) -> usize {
    sh.faults.hit(PanicSite::Read);
    let job = task.job.clone();
    let (first, count) = job.chunk_range(task.chunk);
    let start = Instant::now();
    sh.fresh(task, 0);
    let buf = sh.buf(task, 0);
    // SAFETY: the region holds chunk_blocks × block_bytes bytes and belongs to this task, as
    // do its forms.
    let (stored, needs) = unsafe {
        let forms = sh.forms(task);
        stages::read_chunk(sh.store.store(), &job, first, count, buf, sh.block_bytes, forms, scratch)
    };
    sh.counters[0].add(start, count * sh.block_bytes);
    sh.counters[0].stored_bytes.fetch_add(stored as u64, Ordering::Relaxed);
    task.needs = needs;
    if needs.decompress && !sh.decoding {
        // Only lower tiers hold codec objects, so this cannot happen; never decode into
        // buffers that were not allocated.
        let forms = unsafe { sh.forms(task) };
        for (i, f) in forms.iter().enumerate().take(count) {
            if f.codec_id != 0 {
                job.settle(first + i, BlockOutcome::DecodeFailed);
            }
        }
        task.needs = Needs::default();
    }
    if task.needs.decompress {
        DECOMPRESS
    } else {
        SCATTER
    }
}

fn next_task(sh: &Shared, stage: usize) -> Option<Task> {
    let q = &sh.queues[stage];
    let mut guard = lock(&q.queue);
    loop {
        if let Some(task) = guard.0.pop_front() {
            return Some(task);
        }
        if guard.1 {
            return None;
        }
        guard = q.ready.wait(guard).unwrap_or_else(|e| e.into_inner());
    }
}

pub(super) fn stage_worker(sh: &Shared, stage: usize) {
    let bb = sh.block_bytes;
    // Allocated once, with the codec's per-thread contexts, before the first chunk arrives.
    let mut scratch = AlignedBuf::prefaulted(if stage == DECOMPRESS { bb } else { 0 });
    if stage == DECOMPRESS {
        crate::codec::warm_up(bb, scratch.as_mut_slice());
    }
    while let Some(mut task) = next_task(sh, stage) {
        let _hot = hot_path::enter();
        if task.job.is_cancelled() && stage != SCATTER {
            let (first, count) = task.job.chunk_range(task.chunk);
            stages::settle_chunk(&task.job, first, count, BlockOutcome::Cancelled);
            sh.chunk_left(task);
            continue;
        }
        // See the module docs for why the task is consistent after a panic.
        let ran = catch_unwind(AssertUnwindSafe(|| match stage {
            DECOMPRESS => Some(decompress(sh, &mut task, scratch.as_mut_slice())),
            DEQUANTIZE => Some(dequantize(sh, &mut task)),
            _ => {
                scatter(sh, &mut task);
                None
            }
        }));
        match ran {
            Ok(Some(next)) => sh.push(next, task),
            Ok(None) => sh.chunk_left(task),
            Err(payload) => sh.contain_task(task, payload),
        }
    }
}

/// Decompresses the task's chunk; returns the stage it goes to next.
fn decompress(sh: &Shared, task: &mut Task, scratch: &mut [u8]) -> usize {
    sh.faults.hit(PanicSite::Decompress);
    let (job, bb, start) = (task.job.clone(), sh.block_bytes, Instant::now());
    let (first, count) = job.chunk_range(task.chunk);
    sh.fresh(task, 1);
    let (src, dst) = (sh.buf(task, 0), sh.buf(task, 1));
    // SAFETY: both regions belong to this task and hold a whole chunk.
    unsafe {
        let forms = sh.forms(task);
        stages::decompress_chunk(&job, first, count, src, dst, bb, forms, scratch)
    };
    sh.counters[1].add(start, count * bb);
    if task.needs.dequantize {
        DEQUANTIZE
    } else {
        SCATTER
    }
}

/// Dequantizes the task's chunk; it goes to the scatter stage next.
fn dequantize(sh: &Shared, task: &mut Task) -> usize {
    sh.faults.hit(PanicSite::Dequantize);
    let (job, bb, start) = (task.job.clone(), sh.block_bytes, Instant::now());
    let (first, count) = job.chunk_range(task.chunk);
    sh.fresh(task, 2);
    let (src, mid, dst) = (sh.buf(task, 0), sh.buf(task, 1), sh.buf(task, 2));
    // SAFETY: as in `decompress`.
    unsafe {
        let forms = sh.forms(task);
        stages::dequantize_chunk(&job, first, count, src, mid, dst, bb, forms)
    };
    sh.counters[2].add(start, count * bb);
    SCATTER
}

/// Scatters the task's chunk into its job's pool (unless the job was cancelled meanwhile).
fn scatter(sh: &Shared, task: &mut Task) {
    let (job, bb, start) = (task.job.clone(), sh.block_bytes, Instant::now());
    let (first, count) = job.chunk_range(task.chunk);
    let n = match task.needs {
        Needs { dequantize: true, .. } => 3,
        Needs { decompress: true, .. } => 2,
        _ => 1,
    };
    let mut bufs = [std::ptr::null::<u8>(); 3];
    for (b, p) in bufs.iter_mut().enumerate().take(n) {
        *p = sh.buf(task, b);
    }
    if job.is_cancelled() {
        stages::settle_chunk(&job, first, count, BlockOutcome::Cancelled);
    } else {
        // SAFETY: the region belongs to this task; the job's pool is live until it is
        // collected and its blocks are written only by this job (caller contract).
        unsafe {
            let forms = sh.forms(task);
            stages::scatter_chunk(&job, &job.shape, first, count, bufs, forms, |layer| {
                sh.notify_layer();
                if layer == 0 {
                    sh.faults.hit(PanicSite::Scatter);
                }
            });
            stages::finish_chunk(sh.store.store(), &job, first, count, bufs, bb, forms);
        };
    }
    sh.counters[3].add(start, count * bb);
}

fn next_store_chunk(sh: &Shared) -> Option<(Arc<Job>, usize)> {
    let mut q = lock(&sh.store_queue);
    loop {
        if q.1 {
            return None;
        }
        if let Some(job) = q.0.front().cloned() {
            let chunk = job.next_chunk.fetch_add(1, Ordering::AcqRel);
            if chunk + 1 >= job.chunks_total {
                q.0.pop_front();
            }
            return Some((job, chunk));
        }
        q = sh.store_ready.wait(q).unwrap_or_else(|e| e.into_inner());
    }
}

pub(super) fn store_worker(sh: &Shared) {
    let mut gathered = vec![0u8; sh.config.chunk_blocks * sh.block_bytes];
    while let Some((job, chunk)) = next_store_chunk(sh) {
        let (first, count) = job.chunk_range(chunk);
        // As for pipeline chunks (module docs); `gathered` is scratch, rewritten before each use.
        let ran = catch_unwind(AssertUnwindSafe(|| {
            if job.is_cancelled() {
                stages::settle_chunk(&job, first, count, BlockOutcome::Cancelled);
            } else if job.kind == JobKind::Load {
                store_calls::paged_load(sh.store.store(), &job, &|| {
                    sh.notify_layer();
                    sh.faults.hit(PanicSite::PagedLoad);
                });
            } else {
                sh.faults.hit(PanicSite::Store);
                store_calls::store_chunk(sh.store.store(), &job, first, count, &mut gathered);
            }
        }));
        if let Err(payload) = ran {
            sh.contain(&job, first, count, payload);
        }
        chunks_done(sh, &job, 1);
    }
}
