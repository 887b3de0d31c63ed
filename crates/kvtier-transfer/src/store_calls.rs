//! The work of jobs that run as store calls on the engine's store workers (docs/transfer.md §5):
//! store jobs over a `LayerFirst` pool (gather → [`Store::put`]), and paged jobs, whose target
//! is a [`PagedPool`](kvtier_core::paged::PagedPool): a paged load is one
//! [`Store::load_into_pool`] (one copy per block from DRAM, layer by layer), a paged store one
//! [`Store::put_from_pool`] per chunk. No staging buffer and no stage in between.

use std::ops::Range;
use std::sync::atomic::Ordering;

use kvtier_core::BlockKey;
use kvtier_store::{PutReport, Store, StoreError};

use crate::job::{BlockOutcome, Job};

/// Runs paged load `job`: its pending hit blocks, as runs of consecutive blocks (ids settled
/// before, bad or repeated, split them), each one `load_into_pool` of the job's lease. Layer `l`
/// of the job is in place once the last run announced it (earlier runs are complete by then):
/// `layer_done` is called after the job's layer counter moved.
pub(crate) fn paged_load(store: &Store, job: &Job, layer_done: &dyn Fn()) {
    let pool = job.paged.as_ref().expect("a paged job");
    let lease = job.lease.expect("a load holds its lease");
    let runs = pending_runs(job, 0..job.work_blocks);
    let last = runs.len().saturating_sub(1);
    for (r, run) in runs.into_iter().enumerate() {
        let mut announce = |layer: usize| {
            if r == last && layer < job.layer_chunks_done.len() {
                // SeqCst pairs with the waiter count (see `Job::layer_ready`).
                job.layer_chunks_done[layer].fetch_add(1, Ordering::SeqCst);
                layer_done();
            }
        };
        let ids = &job.block_ids[run.clone()];
        match store.load_into_pool(lease, run.start, pool, ids, &mut announce) {
            Ok(report) => {
                // A failed position did not verify or was gone: its bytes are not usable.
                report.failed.iter().for_each(|&f| job.settle(run.start + f, BlockOutcome::ReadFailed));
                run.for_each(|i| job.settle(i, BlockOutcome::Done));
            }
            Err(_) => run.for_each(|i| job.settle(i, BlockOutcome::StoreFailed)),
        }
    }
}

/// Maximal runs of consecutive pending blocks in `range`.
fn pending_runs(job: &Job, range: Range<usize>) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    for i in range.filter(|&i| job.is_pending(i)) {
        match runs.last_mut() {
            Some(run) if run.end == i => run.end = i + 1,
            _ => runs.push(i..i + 1),
        }
    }
    runs
}

/// Stores blocks `first..first + count` of store job `job`: straight from its paged pool, or
/// gathered from its `LayerFirst` pool into `gathered` (raw blocks: the store encodes them per
/// tier).
pub(crate) fn store_chunk(store: &Store, job: &Job, first: usize, count: usize, gathered: &mut [u8]) {
    let items: Vec<usize> = (first..first + count).filter(|&i| job.is_pending(i)).collect();
    let keys: Vec<BlockKey> = items.iter().map(|&i| job.keys[i]).collect();
    let ns = store.namespace_hash();
    // From the job's submission: a store cleared since then stores none of it.
    let epoch = job.epoch.expect("a store job records the store's epoch at submission");
    let result = match &job.paged {
        Some(pool) => {
            let ids: Vec<u64> = items.iter().map(|&i| job.block_ids[i]).collect();
            store.put_from_pool_since(epoch, ns, &keys, pool, &ids)
        }
        None => {
            let bb = job.shape.block_bytes;
            for (g, &i) in gathered.chunks_mut(bb).zip(&items) {
                // SAFETY: the id was checked against the pool; the caller does not write blocks
                // it stores while the job runs.
                unsafe { job.shape.gather_block(job.pool.ptr(), job.block_ids[i] as usize, g.as_mut_ptr()) };
            }
            kvtier_core::copy::fence(); // the put's copy workers read what the streaming stores wrote
            let refs: Vec<&[u8]> = gathered.chunks(bb).take(items.len()).collect();
            store.put_since(epoch, ns, &keys, &refs)
        }
    };
    settle_put(store, job, &items, &keys, result);
}

fn settle_put(
    store: &Store,
    job: &Job,
    items: &[usize],
    keys: &[BlockKey],
    result: Result<PutReport, StoreError>,
) {
    let ns = store.namespace_hash();
    match result {
        Ok(report) if report.rejected == 0 => items.iter().for_each(|&i| job.settle(i, BlockOutcome::Done)),
        Ok(_) => {
            for (&i, key) in items.iter().zip(keys) {
                let present = store.lookup(ns, std::slice::from_ref(key)).map(|l| l.hit_blocks == 1);
                job.settle(i, if present == Ok(true) { BlockOutcome::Done } else { BlockOutcome::Rejected });
            }
        }
        Err(_) => items.iter().for_each(|&i| job.settle(i, BlockOutcome::StoreFailed)),
    }
}
