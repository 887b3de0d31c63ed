//! Gather/scatter between a `LayerFirst` pool and `BlockFirst` objects, over caller buffers
//! (zero-copy), with the GIL released while bytes move.

use pyo3::prelude::*;

use kvtier_core::layout;
use kvtier_core::parallel::WorkerPool;

use crate::args::BlockIds;
use crate::buffer::{ensure_disjoint, Buffer, Format};
use crate::errors::{kvtier_error, raise};
use crate::geometry::CoreGeometry;

/// Most copy workers a [`Copier`] runs (`kvtier.layout.Copier` checks the same bound first).
const THREADS_MAX: usize = 256;

/// A bounded pool of copy workers; `threads == 0` means one per core.
#[pyclass(frozen, module = "kvtier._core")]
pub struct Copier {
    workers: WorkerPool,
}

#[pymethods]
impl Copier {
    #[new]
    fn new(threads: usize) -> PyResult<Self> {
        if threads > THREADS_MAX {
            let msg = format!("threads is {threads}; expected an int in [0, {THREADS_MAX}]");
            return Err(kvtier_error("LayoutError", msg));
        }
        Ok(Copier { workers: WorkerPool::new(threads) })
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
        block_ids: BlockIds,
        dst: &Bound<'_, PyAny>,
        per_segment: bool,
    ) -> PyResult<(u64, u64, u64)> {
        let (src_name, dst_name) = if gather { ("pool", "out") } else { ("objects", "pool") };
        let src = Buffer::get(src, src_name, false, Format::Bytes)?;
        let dst = Buffer::get(dst, dst_name, true, Format::Bytes)?;
        ensure_disjoint(&src, &dst)?;
        let (g, workers) = (&geometry.inner, &self.workers);
        let stats = py.allow_threads(|| {
            // SAFETY: src and dst are live, disjoint buffers; dst was acquired writable; the ids
            // are our own copy.
            let (src, dst) = unsafe { (src.as_slice(), dst.as_mut_slice()) };
            match (gather, per_segment) {
                (true, true) => layout::gather_contiguous_per_segment(g, src, num_blocks, &block_ids.0, dst),
                (true, false) => layout::gather_contiguous(g, src, num_blocks, &block_ids.0, dst, workers),
                (false, true) => {
                    layout::scatter_contiguous_per_segment(g, src, num_blocks, &block_ids.0, dst)
                }
                (false, false) => layout::scatter_contiguous(g, src, num_blocks, &block_ids.0, dst, workers),
            }
        });
        let s = stats.map_err(raise)?;
        Ok((s.bytes, s.segments, s.copies))
    }
}
