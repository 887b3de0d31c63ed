//! The four load stages and the store job's chunk step, each over one chunk of a job and
//! caller-given buffers (the engine's preallocated regions, or whole-request buffers in
//! [`TransferEngine::load_sequential`](crate::TransferEngine)). Nothing here allocates except
//! inside the store calls (marked foreign, see [`hot_path`](crate::hot_path)).

use std::sync::atomic::Ordering;

use kvtier_store::Store;

use crate::codec;
use crate::hot_path::foreign;
use crate::job::{BlockOutcome, Job};
use crate::pool::PoolShape;

/// A reusable, empty vector of block slices (one per worker), so building the `&mut [&mut
/// [u8]]` the store takes allocates nothing once its capacity is reached.
pub(crate) struct SliceScratch(Vec<&'static mut [u8]>);

impl SliceScratch {
    pub fn with_capacity(n: usize) -> Self {
        SliceScratch(Vec::with_capacity(n))
    }

    /// Runs `f` over `buf` cut into `block_bytes` slices.
    fn with<R>(&mut self, buf: &mut [u8], block_bytes: usize, f: impl FnOnce(&mut [&mut [u8]]) -> R) -> R {
        let mut v: Vec<&mut [u8]> = std::mem::take(&mut self.0);
        v.extend(buf.chunks_exact_mut(block_bytes));
        let r = f(&mut v);
        v.clear();
        let mut v = std::mem::ManuallyDrop::new(v);
        // SAFETY: the vector is empty, so no element of the shorter lifetime survives in it;
        // only its allocation (same element layout) is reused.
        self.0 = unsafe { Vec::from_raw_parts(v.as_mut_ptr().cast::<&'static mut [u8]>(), 0, v.capacity()) };
        r
    }
}

/// Read stage: leased blocks `first..first + count` of `job` into `buf`. A block that fails its
/// checksum is marked and skipped; the rest of the chunk is still read.
///
/// # Safety
/// `buf` points to `count * block_bytes` bytes nobody else accesses during the call.
pub(crate) unsafe fn read_chunk(
    store: &Store,
    job: &Job,
    first: usize,
    count: usize,
    buf: *mut u8,
    block_bytes: usize,
    scratch: &mut SliceScratch,
) {
    let Some(lease) = job.lease else { return };
    let buf = std::slice::from_raw_parts_mut(buf, count * block_bytes);
    let end = first + count;
    let mut pos = first;
    while pos < end {
        let part = &mut buf[(pos - first) * block_bytes..];
        let result = scratch.with(part, block_bytes, |dst| foreign(|| store.load_range(lease, pos, dst)));
        match result {
            Ok(report) => {
                pos += report.loaded_blocks;
                if pos < end {
                    job.settle(pos, BlockOutcome::ReadFailed);
                    pos += 1;
                }
            }
            Err(_) => {
                (pos..end).for_each(|i| job.settle(i, BlockOutcome::StoreFailed));
                return;
            }
        }
    }
}

/// Decompress stage. Safety: `src` and `dst` each point to `count * block_bytes` bytes, `dst`
/// accessed by nobody else.
pub(crate) unsafe fn decompress_chunk(
    job: &Job,
    first: usize,
    count: usize,
    src: *const u8,
    dst: *mut u8,
    block_bytes: usize,
    scratch: &mut [u8],
) {
    for i in 0..count {
        if !job.is_pending(first + i) {
            continue;
        }
        let object = std::slice::from_raw_parts(src.add(i * block_bytes), block_bytes);
        let out = std::slice::from_raw_parts_mut(dst.add(i * block_bytes), block_bytes);
        if codec::decompress(object, out, scratch).is_err() {
            job.settle(first + i, BlockOutcome::DecodeFailed);
        }
    }
}

/// Dequantize stage. Safety as [`decompress_chunk`].
pub(crate) unsafe fn dequantize_chunk(
    job: &Job,
    first: usize,
    count: usize,
    src: *const u8,
    dst: *mut u8,
    block_bytes: usize,
) {
    for i in 0..count {
        if !job.is_pending(first + i) {
            continue;
        }
        let payload = std::slice::from_raw_parts(src.add(i * block_bytes), block_bytes);
        let out = std::slice::from_raw_parts_mut(dst.add(i * block_bytes), block_bytes);
        if codec::dequantize(payload, out).is_err() {
            job.settle(first + i, BlockOutcome::DecodeFailed);
        }
    }
}

/// Scatter stage: layer by layer (extra groups first), so layer `l` of the chunk is published
/// to [`TransferEngine::wait_layer`](crate::TransferEngine) as soon as it is in place; then the
/// chunk's blocks are `Done`. `layer_done(l)` is called after each layer.
///
/// # Safety
/// `src` points to `count * block_bytes` readable bytes; `job.pool` is live and the chunk's
/// pool blocks are written by nobody else.
pub(crate) unsafe fn scatter_chunk(
    job: &Job,
    shape: &PoolShape,
    first: usize,
    count: usize,
    src: *const u8,
    mut layer_done: impl FnMut(usize),
) {
    let bb = shape.block_bytes;
    let pool = job.pool.ptr();
    let ok = |i: usize| job.is_pending(first + i);
    for i in (0..count).filter(|&i| ok(i)) {
        shape.scatter_groups(pool, src.add(i * bb), job.block_ids[first + i] as usize);
    }
    for layer in 0..shape.layers {
        for i in (0..count).filter(|&i| ok(i)) {
            shape.scatter_layer(pool, src.add(i * bb), job.block_ids[first + i] as usize, layer);
        }
        job.layer_chunks_done[layer].fetch_add(1, Ordering::SeqCst);
        layer_done(layer);
    }
    (first..first + count).for_each(|i| job.settle(i, BlockOutcome::Done));
}

/// Marks every still-pending block of a chunk with `outcome` (cancelled chunks), and publishes
/// its layers as final.
pub(crate) fn settle_chunk(job: &Job, first: usize, count: usize, outcome: BlockOutcome) {
    (first..first + count).for_each(|i| job.settle(i, outcome));
    for layer in &job.layer_chunks_done {
        layer.fetch_add(1, Ordering::SeqCst);
    }
}
