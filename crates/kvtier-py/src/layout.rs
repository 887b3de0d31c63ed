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

    /// Pool blocks → objects (`gather`: `src` the pool, `dst` the objects) or objects → pool
    /// blocks, with the GIL released. Returns (bytes, segments, copies after merging).
    #[allow(clippy::too_many_arguments)]
    fn copy(
        &self,
        py: Python<'_>,
        gather: bool,
        geometry: &CoreGeometry,
        src: &Bound<'_, PyAny>,
        num_blocks: u64,
        block_ids: &Bound<'_, PyAny>,
        dst: &Bound<'_, PyAny>,
        per_segment: bool,
    ) -> PyResult<(u64, u64, u64)> {
        let (src_name, dst_name) = if gather { ("pool", "out") } else { ("objects", "pool") };
        let src = Buffer::get(src, src_name, false, Format::Bytes)?;
        let dst = Buffer::get(dst, dst_name, true, Format::Bytes)?;
        ensure_disjoint(&src, &dst)?;
        let ids = block_ids_of(block_ids)?;
        let (g, workers) = (&geometry.inner, &self.workers);
        let stats = py.allow_threads(|| {
            // SAFETY: src and dst are live, disjoint buffers; dst was acquired writable; the ids
            // are our own copy.
            let (src, dst) = unsafe { (src.as_slice(), dst.as_mut_slice()) };
            match (gather, per_segment) {
                (true, true) => layout::gather_contiguous_per_segment(g, src, num_blocks, &ids, dst),
                (true, false) => layout::gather_contiguous(g, src, num_blocks, &ids, dst, workers),
                (false, true) => layout::scatter_contiguous_per_segment(g, src, num_blocks, &ids, dst),
                (false, false) => layout::scatter_contiguous(g, src, num_blocks, &ids, dst, workers),
            }
        });
        let s = stats.map_err(layout_err)?;
        Ok((s.bytes, s.segments, s.copies))
    }
}
