//! The caller's `LayerFirst` pool as the engine sees it, and allocation-free copies between one
//! pool block and one `BlockFirst` object (docs/formats.md §3).
//!
//! Jobs hold a [`PoolRef`] for their whole life; the caller must not free the memory before the
//! job is collected, and must not let two in-flight jobs (or its own code) write the same pool
//! block. An owned [`PoolBuffer`] (Rust callers, tests) is kept alive by the reference itself.

use std::any::Any;
use std::cell::UnsafeCell;
use std::sync::Arc;

use kvtier_core::Geometry;

use crate::cuda::Rows;

/// A pool the engine may read and write from its worker threads.
#[derive(Clone)]
pub struct PoolRef {
    ptr: *mut u8,
    len: usize,
    num_blocks: u64,
    _keep: Option<Arc<dyn Any + Send + Sync>>,
}

// SAFETY: a PoolRef is a pointer plus sizes; the constructors' contracts make the memory valid
// for the reference's life, and the engine writes disjoint blocks from its threads.
unsafe impl Send for PoolRef {}
unsafe impl Sync for PoolRef {}

impl std::fmt::Debug for PoolRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolRef").field("len", &self.len).field("num_blocks", &self.num_blocks).finish()
    }
}

impl PoolRef {
    /// A pool of `num_blocks` blocks at `ptr`, `len` bytes.
    ///
    /// # Safety
    /// `ptr..ptr + len` must stay valid, writable memory until every job given this reference
    /// has been collected, and nothing else may write the blocks those jobs load into.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize, num_blocks: u64) -> Self {
        PoolRef { ptr, len, num_blocks, _keep: None }
    }

    /// No bytes, only a block count: a paged job's reference (its blocks live in its
    /// `PagedPool`; `num_blocks` checks its ids).
    pub(crate) fn blocks_only(num_blocks: u64) -> Self {
        PoolRef { ptr: std::ptr::null_mut(), len: 0, num_blocks, _keep: None }
    }

    /// A pool of `num_blocks` blocks at `ptr` (host or device memory), `len` bytes, kept alive
    /// by `keep`.
    ///
    /// # Safety
    /// As [`Self::from_raw`], for as long as `keep` lives.
    pub(crate) unsafe fn kept(
        ptr: *mut u8,
        len: usize,
        num_blocks: u64,
        keep: Arc<dyn Any + Send + Sync>,
    ) -> Self {
        PoolRef { ptr, len, num_blocks, _keep: Some(keep) }
    }

    /// A reference to an owned pool, kept alive by the reference.
    pub fn owned(pool: &Arc<PoolBuffer>, num_blocks: u64) -> Self {
        let keep: Arc<dyn Any + Send + Sync> = pool.clone();
        PoolRef { ptr: pool.ptr(), len: pool.len(), num_blocks, _keep: Some(keep) }
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn num_blocks(&self) -> u64 {
        self.num_blocks
    }
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }
}

/// An owned, zero-initialised pool buffer for Rust callers and tests.
pub struct PoolBuffer {
    bytes: UnsafeCell<Box<[u8]>>,
}

// SAFETY: access goes through raw pointers under the engine's disjointness rules, or through
// the `unsafe` accessors below whose callers promise no job touches the buffer.
unsafe impl Send for PoolBuffer {}
unsafe impl Sync for PoolBuffer {}

impl PoolBuffer {
    pub fn new(len: usize) -> Arc<Self> {
        Arc::new(PoolBuffer { bytes: UnsafeCell::new(vec![0u8; len].into_boxed_slice()) })
    }

    pub fn len(&self) -> usize {
        // SAFETY: the length never changes.
        unsafe { (&*self.bytes.get()).len() }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Base address, for reading parts of the pool that no job is writing.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr()
    }

    fn ptr(&self) -> *mut u8 {
        // SAFETY: taking the base pointer creates no reference to the bytes.
        unsafe { (&mut *self.bytes.get()).as_mut_ptr() }
    }

    /// # Safety
    /// No job may be writing the bytes read while the slice lives.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr()..ptr() + len()` is this live buffer; the caller rules out writers.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len()) }
    }

    /// # Safety
    /// No job may be reading or writing the buffer while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        // SAFETY: `ptr()..ptr() + len()` is this live buffer; the caller rules out other access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len()) }
    }
}

/// Offsets of one block's pieces, the same for every block of a pool of `num_blocks`.
#[derive(Clone, Debug)]
pub(crate) struct PoolShape {
    pub seg: usize,
    pub layers: usize,
    pub num_blocks: usize,
    pub block_bytes: usize,
    /// Extra groups: (pool region start, bytes per block, offset in the object).
    pub groups: Vec<(usize, usize, usize)>,
}

impl PoolShape {
    pub fn new(geometry: &Geometry, num_blocks: u64) -> Self {
        let seg = geometry.segment_bytes() as usize;
        let layers = geometry.num_layers() as usize;
        let n = num_blocks as usize;
        let mut groups = Vec::new();
        let mut region = 2 * layers * n * seg;
        let mut object_off = 2 * layers * seg;
        for g in 0..geometry.extra_groups().len() {
            let len = geometry.extra_group_block_bytes(g) as usize;
            groups.push((region, len, object_off));
            region += n * len;
            object_off += len;
        }
        PoolShape { seg, layers, num_blocks: n, block_bytes: geometry.block_bytes() as usize, groups }
    }

    /// Streaming where large ([`kvtier_core::copy`]): the writer must
    /// [`fence`](kvtier_core::copy::fence) before publishing the bytes.
    ///
    /// # Safety
    /// `src` is readable and `dst` writable for `len` bytes, not overlapping, and nobody else
    /// accesses `dst` meanwhile.
    #[inline]
    unsafe fn copy(&self, src: *const u8, dst: *mut u8, len: usize) {
        // SAFETY: as this function's contract.
        unsafe { kvtier_core::copy::copy_unfenced(dst, src, len) }
    }

    /// Byte offset of segment (layer, k|v) of `block` in the pool.
    fn segment_off(&self, layer: usize, kv: usize, block: usize) -> usize {
        ((2 * layer + kv) * self.num_blocks + block) * self.seg
    }

    /// Copies K and V of `layer` from `object` into pool block `block`.
    ///
    /// # Safety
    /// `pool` is a live pool of this shape, `block < num_blocks`, `object` holds `block_bytes`
    /// readable bytes, and nobody else accesses the destination bytes.
    pub unsafe fn scatter_layer(&self, pool: *mut u8, object: *const u8, block: usize, layer: usize) {
        for kv in 0..2 {
            // SAFETY: `block < num_blocks` and `layer < layers` keep both ranges inside the
            // pool of this shape and the `block_bytes` object; the caller owns the destination.
            unsafe {
                let src = object.add((2 * layer + kv) * self.seg);
                self.copy(src, pool.add(self.segment_off(layer, kv, block)), self.seg);
            }
        }
    }

    /// Copies the extra groups of `object` into pool block `block`. Safety as [`Self::scatter_layer`].
    pub unsafe fn scatter_groups(&self, pool: *mut u8, object: *const u8, block: usize) {
        for &(region, len, object_off) in &self.groups {
            // SAFETY: each group's region holds `num_blocks * len` bytes and its piece of the
            // object `len` bytes at `object_off`; as [`Self::scatter_layer`] otherwise.
            unsafe { self.copy(object.add(object_off), pool.add(region + block * len), len) };
        }
    }

    /// Copies a whole `object` into pool block `block`: its extra groups, then every layer's
    /// K and V. Safety as [`Self::scatter_layer`].
    pub unsafe fn scatter_block(&self, pool: *mut u8, object: *const u8, block: usize) {
        // SAFETY: as this function's contract.
        unsafe {
            self.scatter_groups(pool, object, block);
            for layer in 0..self.layers {
                self.scatter_layer(pool, object, block, layer);
            }
        }
    }

    /// Copies pool block `block` into `object` (`block_bytes` writable bytes).
    ///
    /// # Safety
    /// As [`Self::scatter_layer`], with the directions swapped: nobody writes the pool block
    /// meanwhile, and nobody else accesses `object`.
    pub unsafe fn gather_block(&self, pool: *const u8, block: usize, object: *mut u8) {
        // SAFETY: every offset is inside the pool of this shape (`block < num_blocks`) and the
        // `block_bytes` object, as in [`Self::scatter_layer`]; the caller owns `object`.
        unsafe {
            for layer in 0..self.layers {
                for kv in 0..2 {
                    let dst = object.add((2 * layer + kv) * self.seg);
                    self.copy(pool.add(self.segment_off(layer, kv, block)), dst, self.seg);
                }
            }
            for &(region, len, object_off) in &self.groups {
                self.copy(pool.add(region + block * len), object.add(object_off), len);
            }
        }
    }

    /// Copies K and V of one layer of pool block `block` into a layer-block buffer
    /// (`2 * seg` bytes). Safety as [`Self::gather_block`].
    pub unsafe fn gather_segment(&self, pool: *const u8, block: usize, layer: usize, out: *mut u8) {
        for kv in 0..2 {
            // SAFETY: as [`Self::gather_block`]; `out` holds `2 * seg` writable bytes.
            unsafe {
                self.copy(pool.add(self.segment_off(layer, kv, block)), out.add(kv * self.seg), self.seg)
            };
        }
    }

    /// The copies between pool block `block` and `object` as strided rows (one
    /// `cudaMemcpy2DAsync` each): its 2 × layers K/V segments (or one layer's two, with `layer`)
    /// as one copy of `seg`-byte rows, `num_blocks × seg` apart in the pool and packed in the
    /// object, then each extra group as one row. `to_object`: pool → object (a swap-out),
    /// else object → pool.
    ///
    /// # Safety
    /// `pool` is a pool of this shape and `object` holds `block_bytes` bytes; `block < num_blocks`,
    /// `layer < layers`. The rows are only addresses: the caller's copy must respect the rules
    /// of [`Self::gather_block`] / [`Self::scatter_layer`].
    pub unsafe fn block_rows(
        &self,
        pool: *mut u8,
        block: usize,
        object: *mut u8,
        layer: Option<usize>,
        to_object: bool,
    ) -> Vec<Rows> {
        let (first, rows) = layer.map_or((0, 2 * self.layers), |l| (l, 2));
        let pitch = self.num_blocks * self.seg;
        let row = |pool_at: *mut u8, object_at: *mut u8, width: usize, rows: usize, pool_pitch: usize| {
            if to_object {
                Rows { dst: object_at, dst_pitch: width, src: pool_at, src_pitch: pool_pitch, width, rows }
            } else {
                Rows { dst: pool_at, dst_pitch: pool_pitch, src: object_at, src_pitch: width, width, rows }
            }
        };
        // SAFETY: every offset is inside the pool of this shape and the object, as in
        // [`Self::gather_block`].
        unsafe {
            let mut out = vec![row(
                pool.add(self.segment_off(first, 0, block)),
                object.add(2 * first * self.seg),
                self.seg,
                rows,
                pitch,
            )];
            if layer.is_none() {
                for &(region, len, object_off) in &self.groups {
                    out.push(row(pool.add(region + block * len), object.add(object_off), len, 1, len));
                }
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_core::layout::{gather_contiguous, scatter_contiguous};
    use kvtier_core::parallel::WorkerPool;
    use kvtier_core::{Dtype, ExtraGroup};

    #[test]
    fn copies_match_the_layout_module() {
        let extra = vec![ExtraGroup { name: "state".into(), bytes_per_token: 3 }];
        let g = Geometry::new(3, 2, 4, Dtype::F16, 2, extra).unwrap();
        let n = 5u64;
        let shape = PoolShape::new(&g, n);
        let bb = g.block_bytes() as usize;
        let pool: Vec<u8> = (0..n as usize * bb).map(|i| (i * 7 % 251) as u8).collect();
        let mut expected = vec![0u8; bb];
        gather_contiguous(&g, &pool, n, &[3], &mut expected, &WorkerPool::new(1)).unwrap();
        let mut object = vec![0u8; bb];
        unsafe { shape.gather_block(pool.as_ptr(), 3, object.as_mut_ptr()) };
        assert_eq!(object, expected);

        let mut ours = vec![0u8; pool.len()];
        let mut theirs = vec![0u8; pool.len()];
        scatter_contiguous(&g, &object, n, &[1], &mut theirs, &WorkerPool::new(1)).unwrap();
        unsafe { shape.scatter_block(ours.as_mut_ptr(), object.as_ptr(), 1) };
        assert_eq!(ours, theirs);
    }

    /// What `cudaMemcpy2DAsync` does with `r`, on host memory.
    unsafe fn run_rows(r: Rows) {
        for i in 0..r.rows {
            unsafe {
                std::ptr::copy_nonoverlapping(r.src.add(i * r.src_pitch), r.dst.add(i * r.dst_pitch), r.width)
            };
        }
    }

    #[test]
    fn strided_rows_move_what_gather_and_scatter_move() {
        // The CUDA copier issues `block_rows`; on the host they must move exactly the bytes of
        // gather_block / gather_segment (swap-out) and scatter_layer + scatter_groups (swap-in).
        let extra = vec![ExtraGroup { name: "state".into(), bytes_per_token: 3 }];
        let g = Geometry::new(3, 2, 4, Dtype::F16, 2, extra).unwrap();
        let n = 5usize;
        let shape = PoolShape::new(&g, n as u64);
        let bb = g.block_bytes() as usize;
        let mut pool: Vec<u8> = (0..n * bb).map(|i| (i * 7 % 251) as u8).collect();
        for block in 0..n {
            let (mut ours, mut theirs) = (vec![0u8; bb], vec![0u8; bb]);
            unsafe {
                shape.gather_block(pool.as_ptr(), block, theirs.as_mut_ptr());
                for r in shape.block_rows(pool.as_mut_ptr(), block, ours.as_mut_ptr(), None, true) {
                    run_rows(r);
                }
            }
            assert_eq!(ours, theirs, "swap-out of block {block}");
            for layer in 0..3 {
                let (mut ours, mut theirs) = (vec![0u8; bb], vec![0u8; bb]);
                unsafe {
                    shape.gather_segment(
                        pool.as_ptr(),
                        block,
                        layer,
                        theirs.as_mut_ptr().add(2 * layer * shape.seg),
                    );
                    for r in shape.block_rows(pool.as_mut_ptr(), block, ours.as_mut_ptr(), Some(layer), true)
                    {
                        run_rows(r);
                    }
                }
                assert_eq!(ours, theirs, "segment {layer} of block {block}");
            }
        }
        let mut object: Vec<u8> = (0..bb).map(|i| (i * 13 % 241) as u8 + 1).collect();
        let (mut ours, mut theirs) = (pool.clone(), pool.clone());
        unsafe {
            shape.scatter_block(theirs.as_mut_ptr(), object.as_ptr(), 2);
            for r in shape.block_rows(ours.as_mut_ptr(), 2, object.as_mut_ptr(), None, false) {
                run_rows(r);
            }
        }
        assert_eq!(ours, theirs, "swap-in into block 2");
        assert_ne!(ours, pool, "the swap-in wrote something");
    }
}
