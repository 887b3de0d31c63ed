//! Gather/scatter between a `LayerFirst` pool and `BlockFirst` objects, over caller buffers
//! (zero-copy), with the GIL released while bytes move.

use pyo3::prelude::*;

use kvtier_core::layout;
use kvtier_core::parallel::WorkerPool;

use crate::buffer::{ensure_disjoint, Buffer, Format};
use crate::errors::{buffer_error, layout_err};
use crate::geometry::CoreGeometry;

/// A bounded pool of copy workers; `threads == 0` means one per core.
#[pyclass(frozen, module = "kvtier._core")]
pub struct Copier {
    workers: WorkerPool,
}

/// The block ids of `block_ids`, copied out while the GIL is held. A copy, not a view: the ids
/// may live in the very buffer the copy writes (a view of the pool or of `out`), and reading
/// them while workers write there would be a data race. They are few (8 bytes per block).
pub(crate) fn block_ids_of(block_ids: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let buf = Buffer::get(block_ids, "block_ids", false, Format::U64)?;
    if !buf.len().is_multiple_of(8) || !(buf.ptr() as usize).is_multiple_of(8) {
        return Err(buffer_error(format!(
            "block_ids buffer has {} bytes; expected aligned uint64 ids",
            buf.len()
        )));
    }
    // SAFETY: aligned, a multiple of 8 bytes, alive while `buf` is; read with the GIL held and
    // before any copy starts, so no kvtier thread writes it meanwhile.
    Ok(unsafe { std::slice::from_raw_parts(buf.ptr().cast::<u64>(), buf.len() / 8) }.to_vec())
}

#[pymethods]
impl Copier {
    #[new]
    fn new(threads: usize) -> Self {
        Copier { workers: WorkerPool::new(threads) }
    }

    #[getter]
    fn threads(&self) -> usize {
        self.workers.threads()
    }

    /// Pool blocks → objects. Returns (bytes, segments, copies after merging).
    #[allow(clippy::too_many_arguments)]
    fn gather(
        &self,
        py: Python<'_>,
        geometry: &CoreGeometry,
        pool: &Bound<'_, PyAny>,
        num_blocks: u64,
        block_ids: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        per_segment: bool,
    ) -> PyResult<(u64, u64, u64)> {
        let pool = Buffer::get(pool, "pool", false, Format::Bytes)?;
        let out = Buffer::get(out, "out", true, Format::Bytes)?;
        ensure_disjoint(&pool, &out)?;
        let ids = block_ids_of(block_ids)?;
        let g = &geometry.inner;
        let stats = py.allow_threads(|| {
            // SAFETY: pool and out are live, disjoint buffers; out was acquired writable; the ids
            // are our own copy.
            let (src, dst) = unsafe { (pool.as_slice(), out.as_mut_slice()) };
            if per_segment {
                layout::gather_contiguous_per_segment(g, src, num_blocks, &ids, dst)
            } else {
                layout::gather_contiguous(g, src, num_blocks, &ids, dst, &self.workers)
            }
        });
        let s = stats.map_err(layout_err)?;
        Ok((s.bytes, s.segments, s.copies))
    }

    /// Objects → pool blocks. Returns (bytes, segments, copies after merging).
    #[allow(clippy::too_many_arguments)]
    fn scatter(
        &self,
        py: Python<'_>,
        geometry: &CoreGeometry,
        objects: &Bound<'_, PyAny>,
        num_blocks: u64,
        block_ids: &Bound<'_, PyAny>,
        pool: &Bound<'_, PyAny>,
        per_segment: bool,
    ) -> PyResult<(u64, u64, u64)> {
        let objects = Buffer::get(objects, "objects", false, Format::Bytes)?;
        let pool = Buffer::get(pool, "pool", true, Format::Bytes)?;
        ensure_disjoint(&pool, &objects)?;
        let ids = block_ids_of(block_ids)?;
        let g = &geometry.inner;
        let stats = py.allow_threads(|| {
            // SAFETY: pool and objects are live, disjoint buffers; pool was acquired writable;
            // the ids are our own copy.
            let (src, dst) = unsafe { (objects.as_slice(), pool.as_mut_slice()) };
            if per_segment {
                layout::scatter_contiguous_per_segment(g, src, num_blocks, &ids, dst)
            } else {
                layout::scatter_contiguous(g, src, num_blocks, &ids, dst, &self.workers)
            }
        });
        let s = stats.map_err(layout_err)?;
        Ok((s.bytes, s.segments, s.copies))
    }
}
