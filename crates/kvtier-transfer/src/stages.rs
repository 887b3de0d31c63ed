//! The four load stages and the store job's chunk step, each over one chunk of a job and
//! caller-given buffers (the engine's preallocated regions, or whole-request buffers in
//! [`TransferEngine::load_sequential`](crate::TransferEngine)). Nothing here allocates except
//! inside the store calls (marked foreign, see [`hot_path`](crate::hot_path)).

use std::sync::atomic::Ordering;

use kvtier_codec::{CODEC_LOSSLESS, CODEC_QUANT, CODEC_RAW};
use kvtier_store::{Store, StoredBlock};

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

/// Which decode stages a chunk needs after its read: some block is `lossless` or `quant`
/// (decompress), some block is `quant` (dequantize).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Needs {
    pub decompress: bool,
    pub dequantize: bool,
}

/// Stage buffer holding block `form`'s bytes once decoded: read (raw), decompress (lossless),
/// dequantize (quant).
pub(crate) fn final_buffer(form: &StoredBlock) -> usize {
    match form.codec_id {
        CODEC_RAW => 0,
        CODEC_LOSSLESS => 1,
        _ => 2,
    }
}

/// Read stage: leased blocks `first..first + count` of `job`, each as its tier stores it
/// (verified, not decoded: [`Store::load_range_stored`]), into its `block_bytes` slot of `buf`;
/// `forms[i]` records where block `i`'s payload is and its codec. A block that fails
/// verification or whose read fails is `ReadFailed`; the rest of the chunk is still read.
/// Returns the chunk's total stored payload bytes and which decode stages it needs.
///
/// # Safety
/// `buf` points to `count * block_bytes` bytes nobody else accesses during the call.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn read_chunk(
    store: &Store,
    job: &Job,
    first: usize,
    count: usize,
    buf: *mut u8,
    block_bytes: usize,
    forms: &mut [StoredBlock],
    scratch: &mut SliceScratch,
) -> (usize, Needs) {
    let mut needs = Needs::default();
    let Some(lease) = job.lease else { return (0, needs) };
    // SAFETY: the caller lends `count * block_bytes` bytes nobody else accesses.
    let buf = unsafe { std::slice::from_raw_parts_mut(buf, count * block_bytes) };
    let result = scratch.with(buf, block_bytes, |dst| foreign(|| store.load_range_stored(lease, first, dst)));
    let report = match result {
        Ok(report) => report,
        Err(_) => {
            (first..first + count).for_each(|i| job.settle(i, BlockOutcome::StoreFailed));
            return (0, needs);
        }
    };
    let mut stored = 0;
    for (i, block) in report.blocks.iter().enumerate().take(count) {
        match block {
            Some(form) if job.is_pending(first + i) => {
                forms[i] = *form;
                stored += form.len;
                match form.codec_id {
                    CODEC_RAW => {}
                    CODEC_LOSSLESS => needs.decompress = true,
                    CODEC_QUANT => (needs.decompress, needs.dequantize) = (true, true),
                    _ => job.settle(first + i, BlockOutcome::DecodeFailed),
                }
            }
            Some(_) => {}
            None => job.settle(first + i, BlockOutcome::ReadFailed),
        }
    }
    (stored, needs)
}

/// Decompress stage: each pending `lossless` block of the chunk decoded from `src` (the read
/// buffer) into `dst`, each `quant` block's streams into `dst` (dequantize finishes it); raw
/// blocks pass. A block that does not decode to exactly `block_bytes` is `DecodeFailed`.
///
/// # Safety
/// `src` and `dst` each point to `count * block_bytes` bytes, `dst` accessed by nobody else.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn decompress_chunk(
    job: &Job,
    first: usize,
    count: usize,
    src: *const u8,
    dst: *mut u8,
    block_bytes: usize,
    forms: &[StoredBlock],
    scratch: &mut [u8],
) {
    for (i, form) in forms.iter().enumerate().take(count) {
        if form.codec_id == CODEC_RAW || !job.is_pending(first + i) {
            continue;
        }
        // SAFETY: block `i < count` of each buffer; the read stage put the payload at
        // `offset..offset + len` within its `block_bytes` slot; nobody else accesses `dst`.
        let (payload, out) = unsafe {
            let payload = std::slice::from_raw_parts(src.add(i * block_bytes + form.offset), form.len);
            (payload, std::slice::from_raw_parts_mut(dst.add(i * block_bytes), block_bytes))
        };
        let result = match form.codec_id {
            CODEC_LOSSLESS => codec::decompress_lossless(payload, out, scratch),
            _ => codec::decompress_quant(payload, out),
        };
        if result.is_err() {
            job.settle(first + i, BlockOutcome::DecodeFailed);
        }
    }
}

/// Dequantize stage: each pending `quant` block from its streams in `mid` (the decompress
/// buffer) and its params in `src` (the read buffer) into `dst`. Safety as
/// [`decompress_chunk`], `src` and `mid` readable.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn dequantize_chunk(
    job: &Job,
    first: usize,
    count: usize,
    src: *const u8,
    mid: *const u8,
    dst: *mut u8,
    block_bytes: usize,
    forms: &[StoredBlock],
) {
    for (i, form) in forms.iter().enumerate().take(count) {
        if form.codec_id != CODEC_QUANT || !job.is_pending(first + i) {
            continue;
        }
        // SAFETY: as in [`decompress_chunk`], for the three buffers of block `i < count`.
        let (payload, quantized, out) = unsafe {
            (
                std::slice::from_raw_parts(src.add(i * block_bytes + form.offset), form.len),
                std::slice::from_raw_parts(mid.add(i * block_bytes), block_bytes),
                std::slice::from_raw_parts_mut(dst.add(i * block_bytes), block_bytes),
            )
        };
        if codec::dequantize(payload, quantized, out).is_err() {
            job.settle(first + i, BlockOutcome::DecodeFailed);
        }
    }
}

/// Scatter stage: each block from the stage buffer that holds it decoded (`bufs`: read,
/// decompress, dequantize; [`final_buffer`]), layer by layer (extra groups first), so layer `l` of the chunk is published
/// to [`TransferEngine::wait_layer`](crate::TransferEngine) as soon as it is in place; then the
/// chunk's blocks are `Done`. `layer_done(l)` is called after each layer.
///
/// # Safety
/// `src` points to `count * block_bytes` readable bytes; `job.pool` is live and the chunk's
/// pool blocks are written by nobody else.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn scatter_chunk(
    job: &Job,
    shape: &PoolShape,
    first: usize,
    count: usize,
    bufs: [*const u8; 3],
    forms: &[StoredBlock],
    mut layer_done: impl FnMut(usize),
) {
    let bb = shape.block_bytes;
    let pool = job.pool.ptr();
    let ok = |i: usize| job.is_pending(first + i);
    // SAFETY: block `i < count` of a stage buffer of `count * bb` bytes.
    let src = |i: usize| unsafe { bufs[final_buffer(&forms[i])].add(i * bb) };
    for i in (0..count).filter(|&i| ok(i)) {
        // SAFETY: the pool is live, its block id was checked in range when the job was made,
        // and the caller guarantees nobody else writes the chunk's pool blocks.
        unsafe { shape.scatter_groups(pool, src(i), job.block_ids[first + i] as usize) };
    }
    for layer in 0..shape.layers {
        for i in (0..count).filter(|&i| ok(i)) {
            // SAFETY: as for the groups above.
            unsafe { shape.scatter_layer(pool, src(i), job.block_ids[first + i] as usize, layer) };
        }
        kvtier_core::copy::fence(); // streaming stores land before the layer is published
        job.layer_chunks_done[layer].fetch_add(1, Ordering::SeqCst);
        layer_done(layer);
    }
    (first..first + count).for_each(|i| job.settle(i, BlockOutcome::Done));
}

/// After a chunk's scatter: hands what the store cannot see back to it. Blocks the decode
/// stages failed (`DecodeFailed`) are reported ([`Store::report_undecodable`]: counted, their
/// stored copies dropped, so no later load reads them again); with `promote_on_hit`, the
/// blocks loaded are handed back decoded ([`Store::promote_decoded`]: lower-tier blocks go
/// into DRAM, as a store load promotes them). Costs nothing when neither applies.
///
/// # Safety
/// As [`scatter_chunk`]: `bufs` hold the chunk's stage buffers.
pub(crate) unsafe fn finish_chunk(
    store: &Store,
    job: &Job,
    first: usize,
    count: usize,
    bufs: [*const u8; 3],
    block_bytes: usize,
    forms: &[StoredBlock],
) {
    let Some(lease) = job.lease else { return };
    let failed = |i: &usize| job.outcome(first + i) == BlockOutcome::DecodeFailed;
    if (0..count).any(|i| failed(&i)) {
        foreign(|| {
            let leased: Vec<usize> = (0..count).filter(failed).map(|i| first + i).collect();
            let _ = store.report_undecodable(lease, &leased);
        });
    }
    if store.promotes_on_hit() {
        foreign(|| {
            let decoded: Vec<Option<&[u8]>> = (0..count)
                .map(|i| {
                    (job.outcome(first + i) == BlockOutcome::Done).then(|| {
                        // SAFETY: block `i < count` of the stage buffer that holds it decoded.
                        unsafe {
                            let src = bufs[final_buffer(&forms[i])].add(i * block_bytes);
                            std::slice::from_raw_parts(src, block_bytes)
                        }
                    })
                })
                .collect();
            let _ = store.promote_decoded(lease, first, &decoded);
        });
    }
}

/// Marks every still-pending block of a chunk with `outcome` (cancelled chunks), and publishes
/// its layers as final.
pub(crate) fn settle_chunk(job: &Job, first: usize, count: usize, outcome: BlockOutcome) {
    (first..first + count).for_each(|i| job.settle(i, outcome));
    for layer in &job.layer_chunks_done {
        layer.fetch_add(1, Ordering::SeqCst);
    }
}
