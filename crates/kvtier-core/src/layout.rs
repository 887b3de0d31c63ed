//! Layouts of KV bytes, and the batched copies between them.
//!
//! An engine keeps KV in a paged pool laid out for attention kernels; storage wants one contiguous
//! object per block. This module moves blocks between the two: *gather* (pool → objects, before a
//! store put) and *scatter* (objects → pool, after a load). It is the CPU analogue of Strata §4.1
//! (GPU-assisted I/O / page-first layout): the whole block table of a request is planned at once,
//! segments that are adjacent on both sides are merged into one copy, and the copies are spread
//! over a [`WorkerPool`] in ~1 MiB batches.
//!
//! With `seg = geometry.segment_bytes()`, `N = num_blocks`, `L = num_layers`, `c` = 0 for K and 1
//! for V, and `gbb(g) = geometry.extra_group_block_bytes(g)`:
//!
//! - **`LayerFirst` pool** (vLLM's paged pool): one buffer of [`pool_bytes`] `= N * block_bytes`.
//!   The main region is `[layer][k|v][block][token][head][dim]`: segment `(l, c, b)` starts at
//!   `((l*2 + c) * N + b) * seg`. The extra groups of a hybrid model follow in order, group `g` as
//!   `[block][gbb(g)]`: block `b` starts at `2*L*N*seg + N * sum(gbb(h) for h < g) + b * gbb(g)`.
//! - **`BlockFirst` object**: `block_bytes` contiguous bytes, `[layer][k|v][token][head][dim]`:
//!   segment `(l, c)` at `(l*2 + c) * seg`; then extra group `g` at
//!   `2*L*seg + sum(gbb(h) for h < g)`.
//!
//! Invariants: every buffer and block id is validated before any byte is written, so a failed
//! call leaves every destination untouched. Destinations of one call never overlap (gather
//! objects are distinct `&mut` slices; scatter block ids must be distinct), which is what makes
//! the multi-threaded copy sound. Planning allocates O(segments), never O(bytes).

use std::ops::Range;

use crate::copy;
use crate::error::LayoutError;
use crate::geometry::Geometry;
use crate::parallel::WorkerPool;

/// Merged copies are cut into pieces of at most this many bytes, and consecutive pieces are
/// batched up to about this many bytes per worker item: large enough that scheduling costs
/// nothing next to the copy, small enough to balance across workers.
pub const COPY_CHUNK_BYTES: usize = 1 << 20;

/// What one gather or scatter did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CopyStats {
    /// Bytes copied (`block_ids.len() * block_bytes`).
    pub bytes: u64,
    /// Segments copied before merging (main K/V segments plus extra-group pieces).
    pub segments: u64,
    /// Contiguous copies after merging (before cutting into [`COPY_CHUNK_BYTES`] pieces).
    pub copies: u64,
}

/// Bytes of a `LayerFirst` pool of `num_blocks` blocks: `num_blocks * block_bytes` (saturating,
/// so an absurd `num_blocks` yields a size no buffer has).
pub fn pool_bytes(geometry: &Geometry, num_blocks: u64) -> u64 {
    num_blocks.saturating_mul(geometry.block_bytes())
}

/// Copies pool blocks into objects: `objects[i]` receives pool block `block_ids[i]`.
///
/// Ids may repeat (one block copied into several objects). Errors, checked before any byte is
/// written: [`LayoutError::EmptyPool`], [`LayoutError::BufferSize`] (pool is not
/// [`pool_bytes`]), [`LayoutError::CountMismatch`], [`LayoutError::ObjectSize`] (an object is not
/// `block_bytes`), [`LayoutError::BlockOutOfRange`].
pub fn gather(
    geometry: &Geometry,
    pool: &[u8],
    num_blocks: u64,
    block_ids: &[u64],
    objects: &mut [&mut [u8]],
    workers: &WorkerPool,
) -> Result<CopyStats, LayoutError> {
    let object_lens = objects.iter().map(|o| o.len());
    let checked = validate(geometry, pool.len(), num_blocks, block_ids, object_lens, Distinct::NotRequired)?;
    let plan = plan_gather(geometry, checked.num_blocks, &checked.block_ids);
    let sides = RawSides {
        // Only read through: the copy direction is pool → objects.
        pool: pool.as_ptr().cast_mut(),
        objects: objects.iter_mut().map(|o| o.as_mut_ptr()).collect(),
        direction: Direction::Gather,
    };
    Ok(run_plan(&plan, &sides, workers))
}

/// Copies objects into pool blocks: pool block `block_ids[i]` receives `objects[i]`.
///
/// Errors, checked before any byte is written: those of [`gather`], and
/// [`LayoutError::DuplicateBlock`] when an id repeats (two objects cannot land in one block).
pub fn scatter(
    geometry: &Geometry,
    objects: &[&[u8]],
    num_blocks: u64,
    block_ids: &[u64],
    pool: &mut [u8],
    workers: &WorkerPool,
) -> Result<CopyStats, LayoutError> {
    let object_lens = objects.iter().map(|o| o.len());
    let checked = validate(geometry, pool.len(), num_blocks, block_ids, object_lens, Distinct::Required)?;
    let plan = plan_scatter(geometry, checked.num_blocks, &checked.block_ids);
    let sides = RawSides {
        pool: pool.as_mut_ptr(),
        // Only read through: the copy direction is objects → pool.
        objects: objects.iter().map(|o| o.as_ptr().cast_mut()).collect(),
        direction: Direction::Scatter,
    };
    Ok(run_plan(&plan, &sides, workers))
}

/// [`gather`] into one contiguous buffer of `block_ids.len() * block_bytes` bytes: object `i`
/// is `objects[i * block_bytes..][..block_bytes]`. A wrong buffer length is
/// [`LayoutError::BufferSize`] (`"objects"`).
pub fn gather_contiguous(
    geometry: &Geometry,
    pool: &[u8],
    num_blocks: u64,
    block_ids: &[u64],
    objects: &mut [u8],
    workers: &WorkerPool,
) -> Result<CopyStats, LayoutError> {
    let mut split = split_objects_mut(geometry, objects, block_ids.len())?;
    gather(geometry, pool, num_blocks, block_ids, &mut split, workers)
}

/// [`scatter`] from one contiguous buffer of `block_ids.len() * block_bytes` bytes (see
/// [`gather_contiguous`]).
pub fn scatter_contiguous(
    geometry: &Geometry,
    objects: &[u8],
    num_blocks: u64,
    block_ids: &[u64],
    pool: &mut [u8],
    workers: &WorkerPool,
) -> Result<CopyStats, LayoutError> {
    let split = split_objects(geometry, objects, block_ids.len())?;
    scatter(geometry, &split, num_blocks, block_ids, pool, workers)
}

/// Naive baseline of [`gather`], kept only for benchmarks and tests: one `copy_from_slice` per
/// segment, on the calling thread, no merging. Same validation and results as [`gather`].
pub fn gather_per_segment(
    geometry: &Geometry,
    pool: &[u8],
    num_blocks: u64,
    block_ids: &[u64],
    objects: &mut [&mut [u8]],
) -> Result<CopyStats, LayoutError> {
    let object_lens = objects.iter().map(|o| o.len());
    let checked = validate(geometry, pool.len(), num_blocks, block_ids, object_lens, Distinct::NotRequired)?;
    let slots = slots(geometry, checked.num_blocks);
    for (object, &block_id) in objects.iter_mut().zip(&checked.block_ids) {
        for slot in &slots {
            let pool_off = slot.pool_region + block_id * slot.len;
            object[slot.object_off..][..slot.len].copy_from_slice(&pool[pool_off..][..slot.len]);
        }
    }
    Ok(per_segment_stats(block_ids.len(), slots.len(), geometry.block_bytes()))
}

/// Naive baseline of [`scatter`], kept only for benchmarks and tests (see [`gather_per_segment`]).
pub fn scatter_per_segment(
    geometry: &Geometry,
    objects: &[&[u8]],
    num_blocks: u64,
    block_ids: &[u64],
    pool: &mut [u8],
) -> Result<CopyStats, LayoutError> {
    let object_lens = objects.iter().map(|o| o.len());
    let checked = validate(geometry, pool.len(), num_blocks, block_ids, object_lens, Distinct::Required)?;
    let slots = slots(geometry, checked.num_blocks);
    for (object, &block_id) in objects.iter().zip(&checked.block_ids) {
        for slot in &slots {
            let pool_off = slot.pool_region + block_id * slot.len;
            pool[pool_off..][..slot.len].copy_from_slice(&object[slot.object_off..][..slot.len]);
        }
    }
    Ok(per_segment_stats(block_ids.len(), slots.len(), geometry.block_bytes()))
}

/// [`gather_per_segment`] into one contiguous objects buffer (see [`gather_contiguous`]).
pub fn gather_contiguous_per_segment(
    geometry: &Geometry,
    pool: &[u8],
    num_blocks: u64,
    block_ids: &[u64],
    objects: &mut [u8],
) -> Result<CopyStats, LayoutError> {
    let mut split = split_objects_mut(geometry, objects, block_ids.len())?;
    gather_per_segment(geometry, pool, num_blocks, block_ids, &mut split)
}

/// [`scatter_per_segment`] from one contiguous objects buffer (see [`gather_contiguous`]).
pub fn scatter_contiguous_per_segment(
    geometry: &Geometry,
    objects: &[u8],
    num_blocks: u64,
    block_ids: &[u64],
    pool: &mut [u8],
) -> Result<CopyStats, LayoutError> {
    let split = split_objects(geometry, objects, block_ids.len())?;
    scatter_per_segment(geometry, &split, num_blocks, block_ids, pool)
}

// ---------------------------------------------------------------------------------------------
// Validation

#[derive(Clone, Copy, PartialEq, Eq)]
enum Distinct {
    Required,
    NotRequired,
}

/// Inputs proven in range: every offset computed from them fits the buffers.
struct Checked {
    num_blocks: usize,
    block_ids: Vec<usize>,
}

fn validate(
    geometry: &Geometry,
    pool_len: usize,
    num_blocks: u64,
    block_ids: &[u64],
    object_lens: impl ExactSizeIterator<Item = usize>,
    distinct: Distinct,
) -> Result<Checked, LayoutError> {
    if num_blocks == 0 {
        return Err(LayoutError::EmptyPool);
    }
    let expected_pool = usize::try_from(pool_bytes(geometry, num_blocks)).unwrap_or(usize::MAX);
    if pool_len != expected_pool {
        return Err(LayoutError::BufferSize { what: "pool", actual: pool_len, expected: expected_pool });
    }
    if block_ids.len() != object_lens.len() {
        return Err(LayoutError::CountMismatch { table: block_ids.len(), objects: object_lens.len() });
    }
    let block_bytes = geometry.block_bytes() as usize;
    for (index, actual) in object_lens.enumerate() {
        if actual != block_bytes {
            return Err(LayoutError::ObjectSize { index, actual, expected: block_bytes });
        }
    }
    if let Some((index, &block_id)) = block_ids.iter().enumerate().find(|(_, &id)| id >= num_blocks) {
        return Err(LayoutError::BlockOutOfRange { index, block_id, num_blocks });
    }
    if distinct == Distinct::Required {
        check_distinct(block_ids)?;
    }
    // The pool fits in memory, so num_blocks and every id below it fit in usize.
    Ok(Checked {
        num_blocks: num_blocks as usize,
        block_ids: block_ids.iter().map(|&id| id as usize).collect(),
    })
}

/// Reports the first repeated id (in sorted order). Sorts a copy: O(n log n) in the table
/// length, independent of the pool size.
fn check_distinct(block_ids: &[u64]) -> Result<(), LayoutError> {
    let mut sorted = block_ids.to_vec();
    sorted.sort_unstable();
    match sorted.windows(2).find(|w| w[0] == w[1]) {
        Some(w) => Err(LayoutError::DuplicateBlock { block_id: w[0] }),
        None => Ok(()),
    }
}

fn split_objects_mut<'a>(
    geometry: &Geometry,
    objects: &'a mut [u8],
    count: usize,
) -> Result<Vec<&'a mut [u8]>, LayoutError> {
    let block_bytes = check_objects_len(geometry, objects.len(), count)?;
    Ok(objects.chunks_exact_mut(block_bytes).collect())
}

fn split_objects<'a>(
    geometry: &Geometry,
    objects: &'a [u8],
    count: usize,
) -> Result<Vec<&'a [u8]>, LayoutError> {
    let block_bytes = check_objects_len(geometry, objects.len(), count)?;
    Ok(objects.chunks_exact(block_bytes).collect())
}

/// Checks a contiguous objects buffer holds exactly `count` blocks; returns `block_bytes`.
fn check_objects_len(geometry: &Geometry, actual: usize, count: usize) -> Result<usize, LayoutError> {
    let block_bytes = geometry.block_bytes() as usize;
    let expected = count.saturating_mul(block_bytes);
    if actual != expected {
        return Err(LayoutError::BufferSize { what: "objects", actual, expected });
    }
    Ok(block_bytes)
}

// ---------------------------------------------------------------------------------------------
// Planning

/// One segment position of a block, the same for every block: main `(layer, k|v)` segments in
/// order, then the extra groups. Block `b`'s piece is at `pool_region + b * len` in the pool and
/// at `object_off` in its object.
struct Slot {
    pool_region: usize,
    object_off: usize,
    len: usize,
}

fn slots(geometry: &Geometry, num_blocks: usize) -> Vec<Slot> {
    let seg = geometry.segment_bytes() as usize;
    let kv_segments = 2 * geometry.num_layers() as usize;
    let mut slots: Vec<Slot> = (0..kv_segments)
        .map(|s| Slot { pool_region: s * num_blocks * seg, object_off: s * seg, len: seg })
        .collect();
    let mut pool_region = kv_segments * num_blocks * seg;
    let mut object_off = kv_segments * seg;
    for group in 0..geometry.extra_groups().len() {
        let len = geometry.extra_group_block_bytes(group) as usize;
        slots.push(Slot { pool_region, object_off, len });
        pool_region += num_blocks * len;
        object_off += len;
    }
    slots
}

/// One contiguous copy between object `object` at `object_off` and the pool at `pool_off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Run {
    object: usize,
    object_off: usize,
    pool_off: usize,
    len: usize,
}

/// Merged and chunked copies, with the worker batches over them.
struct Plan {
    runs: Vec<Run>,
    batches: Vec<Range<usize>>,
    stats: CopyStats,
}

/// Runs in destination (object) order, so adjacent destinations are neighbours in the list.
fn plan_gather(geometry: &Geometry, num_blocks: usize, block_ids: &[usize]) -> Plan {
    let slots = slots(geometry, num_blocks);
    let mut runs = Vec::with_capacity(block_ids.len() * slots.len());
    for (object, &block_id) in block_ids.iter().enumerate() {
        for slot in &slots {
            let pool_off = slot.pool_region + block_id * slot.len;
            push_merged(&mut runs, Run { object, object_off: slot.object_off, pool_off, len: slot.len });
        }
    }
    finish_plan(runs, block_ids.len(), slots.len(), geometry.block_bytes())
}

/// Runs in destination (pool) order: slot by slot, blocks ascending within a slot. Sorting the
/// table (O(n log n) in blocks) replaces sorting the runs (O(s log s) in segments).
fn plan_scatter(geometry: &Geometry, num_blocks: usize, block_ids: &[usize]) -> Plan {
    let slots = slots(geometry, num_blocks);
    let mut order: Vec<(usize, usize)> = block_ids.iter().enumerate().map(|(i, &b)| (b, i)).collect();
    order.sort_unstable();
    let mut runs = Vec::with_capacity(block_ids.len() * slots.len());
    for slot in &slots {
        for &(block_id, object) in &order {
            let pool_off = slot.pool_region + block_id * slot.len;
            push_merged(&mut runs, Run { object, object_off: slot.object_off, pool_off, len: slot.len });
        }
    }
    finish_plan(runs, block_ids.len(), slots.len(), geometry.block_bytes())
}

/// Appends `next`, extending the last run instead when both sides continue it. Runs arrive in
/// destination order and destinations are disjoint, so every mergeable pair is consecutive.
fn push_merged(runs: &mut Vec<Run>, next: Run) {
    if let Some(last) = runs.last_mut() {
        if last.object == next.object
            && last.object_off + last.len == next.object_off
            && last.pool_off + last.len == next.pool_off
        {
            last.len += next.len;
            return;
        }
    }
    runs.push(next);
}

/// Cuts runs into [`COPY_CHUNK_BYTES`] pieces and groups consecutive pieces into batches of
/// about that size.
fn finish_plan(merged: Vec<Run>, num_objects: usize, slots: usize, block_bytes: u64) -> Plan {
    let mut stats = per_segment_stats(num_objects, slots, block_bytes);
    stats.copies = merged.len() as u64;
    let runs = if merged.iter().all(|r| r.len <= COPY_CHUNK_BYTES) {
        merged
    } else {
        let mut pieces = Vec::with_capacity(merged.len());
        for run in merged {
            for done in (0..run.len).step_by(COPY_CHUNK_BYTES) {
                let len = COPY_CHUNK_BYTES.min(run.len - done);
                pieces.push(Run {
                    object_off: run.object_off + done,
                    pool_off: run.pool_off + done,
                    len,
                    ..run
                });
            }
        }
        pieces
    };
    let mut batches = Vec::new();
    let (mut start, mut batch_bytes) = (0, 0);
    for (i, run) in runs.iter().enumerate() {
        batch_bytes += run.len;
        if batch_bytes >= COPY_CHUNK_BYTES {
            batches.push(start..i + 1);
            (start, batch_bytes) = (i + 1, 0);
        }
    }
    if start < runs.len() {
        batches.push(start..runs.len());
    }
    Plan { runs, batches, stats }
}

/// Stats of copying `num_objects` blocks of `slots` segments each, one copy per segment.
fn per_segment_stats(num_objects: usize, slots: usize, block_bytes: u64) -> CopyStats {
    let segments = (num_objects * slots) as u64;
    CopyStats { bytes: num_objects as u64 * block_bytes, segments, copies: segments }
}

// ---------------------------------------------------------------------------------------------
// Execution

#[derive(Clone, Copy)]
enum Direction {
    Gather,
    Scatter,
}

/// Base pointers of the pool and of every object, shared by the copy workers. The side being
/// read was borrowed shared (`&[u8]`) and is never written through these pointers.
struct RawSides {
    pool: *mut u8,
    objects: Vec<*mut u8>,
    direction: Direction,
}

// SAFETY: `RawSides` lives only inside `gather`/`scatter`, while the caller's borrows of the pool
// and objects are held, and `WorkerPool::for_each` returns only after every worker is done. The
// workers write disjoint bytes (see `run_plan`), so sharing the pointers across threads is sound.
unsafe impl Sync for RawSides {}

impl RawSides {
    /// # Safety
    /// `run` must lie inside both buffers, and no other thread may access its destination bytes
    /// during the call.
    unsafe fn copy(&self, run: &Run) {
        // SAFETY: in bounds per the caller's contract; source and destination never overlap
        // because one side is borrowed shared and the other mutably.
        unsafe {
            let pool = self.pool.add(run.pool_off);
            let object = self.objects[run.object].add(run.object_off);
            match self.direction {
                Direction::Gather => copy::copy_unfenced(object, pool, run.len),
                Direction::Scatter => copy::copy_unfenced(pool, object, run.len),
            }
        }
    }
}

fn run_plan(plan: &Plan, sides: &RawSides, workers: &WorkerPool) -> CopyStats {
    let total_bytes = usize::try_from(plan.stats.bytes).unwrap_or(usize::MAX);
    workers.for_each(&plan.batches, total_bytes, |batch| {
        for run in &plan.runs[batch.clone()] {
            // SAFETY: bounds: `validate` proved the pool is `num_blocks * block_bytes`, every
            // object `block_bytes`, every id `< num_blocks`, and slots tile both layouts exactly.
            // Disjoint destinations: gather writes objects, which are distinct `&mut` slices, at
            // disjoint slots; scatter writes pool blocks whose ids were checked distinct.
            // Merging and chunking only join or split ranges, so runs stay disjoint, and each
            // run is in exactly one batch.
            unsafe { sides.copy(run) }
        }
        copy::fence(); // streaming stores, before the pool reports this batch done
    });
    plan.stats
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{Dtype, ExtraGroup};

    /// seg = 2 bytes, 2 layers, one 3-byte extra group: block = 4 * 2 + 3 = 11 bytes.
    fn tiny() -> Geometry {
        let extra = vec![ExtraGroup { name: "state".into(), bytes_per_token: 3 }];
        Geometry::new(2, 1, 1, Dtype::F16, 1, extra).unwrap()
    }

    fn iota(len: usize) -> Vec<u8> {
        (0..len).map(|i| i as u8).collect()
    }

    #[test]
    fn pool_bytes_is_blocks_times_block_bytes() {
        assert_eq!(pool_bytes(&tiny(), 3), 33);
        assert_eq!(pool_bytes(&tiny(), u64::MAX), u64::MAX);
    }

    #[test]
    fn gather_reads_hand_checked_offsets() {
        let g = tiny();
        let pool = iota(33);
        let mut objects = vec![0u8; 22];
        let workers = WorkerPool::new(1);
        let stats = gather_contiguous(&g, &pool, 3, &[1, 2], &mut objects, &workers).unwrap();
        // Block 1: K0 at 2, V0 at (1*3+1)*2 = 8, K1 at 14, V1 at 20; group region at 24, block 1 at 27.
        assert_eq!(&objects[..11], &[2, 3, 8, 9, 14, 15, 20, 21, 27, 28, 29]);
        // Block 2: 4, 10, 16, 22; group at 24 + 2*3 = 30.
        assert_eq!(&objects[11..], &[4, 5, 10, 11, 16, 17, 22, 23, 30, 31, 32]);
        assert_eq!(stats, CopyStats { bytes: 22, segments: 10, copies: 10 });
    }

    #[test]
    fn scatter_writes_hand_checked_offsets() {
        let g = tiny();
        let mut pool = vec![0u8; 33];
        let object: Vec<u8> = (100..111).collect();
        scatter(&g, &[&object], 3, &[2], &mut pool, &WorkerPool::new(1)).unwrap();
        let mut expected = vec![0u8; 33];
        for (off, bytes) in
            [(4, &object[0..2]), (10, &object[2..4]), (16, &object[4..6]), (22, &object[6..8])]
        {
            expected[off..off + 2].copy_from_slice(bytes);
        }
        expected[30..33].copy_from_slice(&object[8..11]);
        assert_eq!(pool, expected);
    }

    #[test]
    fn single_block_pool_merges_into_one_copy() {
        // With one block every slot of the pool is adjacent to the next, as in the object.
        let g = tiny();
        let pool = iota(11);
        let mut object = vec![0u8; 11];
        let stats = gather_contiguous(&g, &pool, 1, &[0], &mut object, &WorkerPool::new(1)).unwrap();
        assert_eq!(object, pool);
        assert_eq!(stats, CopyStats { bytes: 11, segments: 5, copies: 1 });
    }

    #[test]
    fn large_runs_are_cut_into_chunks() {
        let runs = vec![Run { object: 0, object_off: 0, pool_off: 0, len: 2 * COPY_CHUNK_BYTES + 5 }];
        let plan = finish_plan(runs, 1, 1, 2 * COPY_CHUNK_BYTES as u64 + 5);
        let lens: Vec<usize> = plan.runs.iter().map(|r| r.len).collect();
        assert_eq!(lens, [COPY_CHUNK_BYTES, COPY_CHUNK_BYTES, 5]);
        assert_eq!(plan.runs[2].pool_off, 2 * COPY_CHUNK_BYTES);
        assert_eq!(plan.batches, [0..1, 1..2, 2..3]);
        assert_eq!(plan.stats.copies, 1);
    }

    #[test]
    fn empty_table_copies_nothing() {
        let stats = gather(&tiny(), &[0; 33], 3, &[], &mut [], &WorkerPool::new(1)).unwrap();
        assert_eq!(stats, CopyStats::default());
    }

    #[test]
    fn every_validation_error_is_reachable() {
        let g = tiny();
        let w = WorkerPool::new(1);
        let pool = vec![0u8; 33];
        let mut objects = vec![0u8; 22];

        let err = gather_contiguous(&g, &[], 0, &[], &mut [], &w).unwrap_err();
        assert_eq!(err, LayoutError::EmptyPool);

        let err = gather_contiguous(&g, &pool[..32], 3, &[0, 1], &mut objects, &w).unwrap_err();
        assert_eq!(err, LayoutError::BufferSize { what: "pool", actual: 32, expected: 33 });
        assert!(err.to_string().contains("32") && err.to_string().contains("33"), "{err}");

        let err = gather_contiguous(&g, &pool, 3, &[0], &mut objects, &w).unwrap_err();
        assert_eq!(err, LayoutError::BufferSize { what: "objects", actual: 22, expected: 11 });

        let (a, b) = objects.split_at_mut(11);
        let err = gather(&g, &pool, 3, &[0], &mut [a, b], &w).unwrap_err();
        assert_eq!(err, LayoutError::CountMismatch { table: 1, objects: 2 });

        let mut short = vec![0u8; 10];
        let err = gather(&g, &pool, 3, &[0], &mut [&mut short], &w).unwrap_err();
        assert_eq!(err, LayoutError::ObjectSize { index: 0, actual: 10, expected: 11 });

        let err = gather_contiguous(&g, &pool, 3, &[0, 3], &mut objects, &w).unwrap_err();
        assert_eq!(err, LayoutError::BlockOutOfRange { index: 1, block_id: 3, num_blocks: 3 });

        let mut pool_mut = pool.clone();
        let err = scatter_contiguous(&g, &objects, 3, &[2, 2], &mut pool_mut, &w).unwrap_err();
        assert_eq!(err, LayoutError::DuplicateBlock { block_id: 2 });
        let err = scatter_contiguous_per_segment(&g, &objects, 3, &[1, 1], &mut pool_mut).unwrap_err();
        assert_eq!(err, LayoutError::DuplicateBlock { block_id: 1 });
    }

    #[test]
    fn failed_scatter_writes_nothing() {
        let g = tiny();
        let mut pool = vec![7u8; 33];
        let objects = vec![1u8; 22];
        // Block 0 is valid, but block 5 is not: nothing may land in block 0 either.
        let err = scatter_contiguous(&g, &objects, 3, &[0, 5], &mut pool, &WorkerPool::new(1)).unwrap_err();
        assert!(matches!(err, LayoutError::BlockOutOfRange { index: 1, .. }), "{err}");
        assert_eq!(pool, vec![7u8; 33]);
    }

    #[test]
    fn gather_allows_repeated_ids() {
        let g = tiny();
        let pool = iota(33);
        let mut objects = vec![0u8; 22];
        gather_contiguous(&g, &pool, 3, &[1, 1], &mut objects, &WorkerPool::new(1)).unwrap();
        assert_eq!(objects[..11], objects[11..]);
    }
}
