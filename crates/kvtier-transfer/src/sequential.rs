//! The sequential baseline of `pipeline_ratio_to_sequential`: the same stage code and worker
//! counts as the pipeline, but each stage runs over the whole request before the next starts.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use kvtier_core::{BlockKey, Geometry};
use kvtier_store::{Store, StoredBlock};

use crate::aligned::AlignedBuf;
use crate::config::TransferConfig;
use crate::error::TransferError;
use crate::job::{BlockOutcome, FinishedJob, Job, JobKind};
use crate::pool::{PoolRef, PoolShape};
use crate::stages::{self, Needs, SliceScratch};

/// A base pointer shared by the threads of one stage, which use disjoint chunks of it.
#[derive(Clone, Copy)]
struct Base(*mut u8);
// SAFETY: each thread touches only its own chunks' bytes.
unsafe impl Send for Base {}
unsafe impl Sync for Base {}

/// The per-block forms of a whole request, shared like [`Base`].
#[derive(Clone, Copy)]
struct Forms(*mut StoredBlock);
// SAFETY: each thread touches only its own chunks' entries.
unsafe impl Send for Forms {}
unsafe impl Sync for Forms {}

impl Forms {
    /// Entries `first..first + count`. Safety: in bounds, and no other live reference to them.
    #[allow(clippy::mut_from_ref)]
    unsafe fn chunk(&self, first: usize, count: usize) -> &mut [StoredBlock] {
        // SAFETY: the caller keeps `first..first + count` in bounds and unaliased.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(first), count) }
    }
}

/// Runs `f(first, count)` for every chunk, spread over `workers` threads (chunk `c` on thread
/// `c % workers`); returns the stage's wall time.
fn stage(job: &Job, workers: usize, f: impl Fn(usize, usize) + Sync) -> f64 {
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..workers.min(job.chunks_total.max(1)) {
            let f = &f;
            s.spawn(move || {
                for chunk in (t..job.chunks_total).step_by(workers) {
                    let (first, count) = job.chunk_range(chunk);
                    f(first, count);
                }
            });
        }
    });
    start.elapsed().as_secs_f64()
}

/// The sequential load of [`TransferEngine::load_sequential`](crate::TransferEngine), over the
/// engine's store, geometry and configuration.
pub(crate) fn run(
    store: &Store,
    geometry: &Geometry,
    config: &TransferConfig,
    keys: &[BlockKey],
    pool: PoolRef,
    block_ids: &[u64],
    per_chunk: bool,
) -> Result<(FinishedJob, [f64; 4]), TransferError> {
    let bb = store.block_bytes();
    let lease = store.lease(store.namespace_hash(), keys)?;
    let shape = PoolShape::new(geometry, pool.num_blocks());
    let job = Job::new(
        0,
        JobKind::Load,
        keys.to_vec(),
        block_ids.to_vec(),
        pool,
        shape,
        Some(lease.id),
        lease.hit_blocks,
        config.chunk_blocks,
        usize::MAX,
        bb as u64,
    );
    job.settle_bad_ids();
    (lease.hit_blocks..keys.len()).for_each(|i| job.settle(i, BlockOutcome::Miss));
    let decoding = store.config().ssd.is_some() || store.config().remote.is_some();
    if per_chunk {
        let times = per_chunk_stages(store, &job, config.chunk_blocks, bb);
        let _ = store.release(lease.id);
        job.finished.store(true, Ordering::Release);
        return Ok((job.finished_job(), times));
    }
    let n = lease.hit_blocks * bb;
    let mut bufs: Vec<AlignedBuf> =
        (0..3).map(|b| AlignedBuf::prefaulted(if b == 0 || decoding { n } else { 0 })).collect();
    let base: Vec<Base> = bufs.iter_mut().map(|b| Base(b.as_mut_ptr())).collect();
    let mut forms = vec![StoredBlock::raw(bb); lease.hit_blocks];
    let forms_base = Forms(forms.as_mut_ptr());
    // SAFETY (all stages): chunk `first..first + count` of each buffer and of `forms` is one
    // thread's alone within a stage; stages run one after another.
    let forms_of = |first: usize, count: usize| unsafe { forms_base.chunk(first, count) };
    let w = config.stage_workers;
    let mut times = [0.0f64; 4];
    let (decompress, dequantize) = (AtomicBool::new(false), AtomicBool::new(false));
    times[0] = stage(&job, w.read, |first, count| {
        let mut scratch = SliceScratch::with_capacity(config.chunk_blocks);
        let (_, needs) = unsafe {
            stages::read_chunk(
                store,
                &job,
                first,
                count,
                base[0].0.add(first * bb),
                bb,
                forms_of(first, count),
                &mut scratch,
            )
        };
        decompress.fetch_or(needs.decompress, Ordering::Relaxed);
        dequantize.fetch_or(needs.dequantize, Ordering::Relaxed);
    });
    let (decompress, dequantize) = (decompress.into_inner() && decoding, dequantize.into_inner() && decoding);
    if decompress {
        times[1] = stage(&job, w.decompress, |first, count| {
            let mut scratch = vec![0u8; bb];
            unsafe {
                stages::decompress_chunk(
                    &job,
                    first,
                    count,
                    base[0].0.add(first * bb),
                    base[1].0.add(first * bb),
                    bb,
                    forms_of(first, count),
                    &mut scratch,
                )
            }
        });
    }
    if dequantize {
        times[2] = stage(&job, w.dequantize, |first, count| unsafe {
            stages::dequantize_chunk(
                &job,
                first,
                count,
                base[0].0.add(first * bb),
                base[1].0.add(first * bb),
                base[2].0.add(first * bb),
                bb,
                forms_of(first, count),
            )
        });
    }
    times[3] = stage(&job, w.scatter, |first, count| unsafe {
        // Distinct pool blocks per chunk (duplicates were settled and are skipped).
        let bufs = [0, 1, 2].map(|b| base[b].0.add(first * bb).cast_const());
        let forms = forms_of(first, count);
        stages::scatter_chunk(&job, &job.shape, first, count, bufs, forms, |_| {});
        stages::finish_chunk(store, &job, first, count, bufs, bb, forms);
    });
    let _ = store.release(lease.id);
    job.finished.store(true, Ordering::Release);
    drop(bufs);
    drop(forms);
    Ok((job.finished_job(), times))
}

/// One thread, one chunk-sized region: each chunk goes read → decompress → dequantize →
/// scatter before the next starts (no overlap at all, the pipeline's buffer locality). Returns
/// each stage's summed seconds.
fn per_chunk_stages(store: &kvtier_store::Store, job: &Job, chunk_blocks: usize, bb: usize) -> [f64; 4] {
    let region = chunk_blocks * bb;
    let mut bufs: Vec<AlignedBuf> = (0..3).map(|_| AlignedBuf::prefaulted(region)).collect();
    let mut forms = vec![StoredBlock::raw(bb); chunk_blocks];
    let mut scratch = vec![0u8; bb];
    let mut slices = SliceScratch::with_capacity(chunk_blocks);
    let mut times = [0.0f64; 4];
    for chunk in 0..job.chunks_total {
        let (first, count) = job.chunk_range(chunk);
        let [b0, b1, b2] = &mut bufs[..] else { unreachable!("three buffers") };
        let (p0, p1, p2) = (b0.as_mut_ptr(), b1.as_mut_ptr(), b2.as_mut_ptr());
        let mut timed = |i: usize, f: &mut dyn FnMut()| {
            let start = Instant::now();
            f();
            times[i] += start.elapsed().as_secs_f64();
        };
        // SAFETY: this thread owns the three region buffers; the pool blocks are distinct.
        unsafe {
            let mut needs = Needs::default();
            timed(0, &mut || {
                needs = stages::read_chunk(store, job, first, count, p0, bb, &mut forms, &mut slices).1
            });
            if needs.decompress {
                timed(1, &mut || {
                    stages::decompress_chunk(job, first, count, p0, p1, bb, &forms, &mut scratch)
                });
            }
            if needs.dequantize {
                timed(2, &mut || stages::dequantize_chunk(job, first, count, p0, p1, p2, bb, &forms));
            }
            let bufs = [p0.cast_const(), p1.cast_const(), p2.cast_const()];
            timed(3, &mut || {
                stages::scatter_chunk(job, &job.shape, first, count, bufs, &forms, |_| {});
                stages::finish_chunk(store, job, first, count, bufs, bb, &forms);
            });
        }
    }
    times
}
