//! Gather/scatter between a `LayerFirst` pool and `BlockFirst` objects, over caller buffers
//! (zero-copy), with the GIL released while bytes move.

use pyo3::prelude::*;

use kvtier_core::layout::{self, CopyStats};
use kvtier_core::parallel::WorkerPool;
use kvtier_core::{Geometry, LayoutError};

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
        let (src, dst) =
            (Buffer::get(pool, "pool", false, Format::Bytes)?, Buffer::get(out, "out", true, Format::Bytes)?);
        self.copy(py, geometry, src, dst, block_ids, |g, src, ids, dst| {
            if per_segment {
                layout::gather_contiguous_per_segment(g, src, num_blocks, ids, dst)
            } else {
                layout::gather_contiguous(g, src, num_blocks, ids, dst, &self.workers)
            }
        })
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
        let (src, dst) = (
            Buffer::get(objects, "objects", false, Format::Bytes)?,
            Buffer::get(pool, "pool", true, Format::Bytes)?,
        );
        self.copy(py, geometry, src, dst, block_ids, |g, src, ids, dst| {
            if per_segment {
                layout::scatter_contiguous_per_segment(g, src, num_blocks, ids, dst)
            } else {
                layout::scatter_contiguous(g, src, num_blocks, ids, dst, &self.workers)
            }
        })
    }
}

impl Copier {
    /// Runs one layout copy from `src` into `dst` (acquired writable; checked disjoint here)
    /// with the GIL released. Returns (bytes, segments, copies after merging).
    fn copy(
        &self,
        py: Python<'_>,
        geometry: &CoreGeometry,
        src: Buffer,
        dst: Buffer,
        block_ids: &Bound<'_, PyAny>,
        run: impl FnOnce(&Geometry, &[u8], &[u64], &mut [u8]) -> Result<CopyStats, LayoutError> + Send,
    ) -> PyResult<(u64, u64, u64)> {
        ensure_disjoint(&dst, &src)?;
        let ids = block_ids_of(block_ids)?;
        let g = &geometry.inner;
        // SAFETY: src and dst are live, disjoint buffers; dst was acquired writable; the ids are
        // our own copy.
        let stats =
            py.allow_threads(|| run(g, unsafe { src.as_slice() }, &ids, unsafe { dst.as_mut_slice() }));
        let s = stats.map_err(layout_err)?;
        Ok((s.bytes, s.segments, s.copies))
    }
}
