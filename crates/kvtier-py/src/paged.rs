//! An engine's paged pool for Python ([`PagedPool`] over caller buffers) and [`LayerProgress`],
//! which a layerwise load advances and an engine thread waits on with the GIL released.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::types::PyBool;

use kvtier_core::paged::PagedPool;
use kvtier_core::progress::LayerProgress as Progress;

use crate::buffer::{ensure_all_disjoint, Buffer, Format};
use crate::errors::{buffer_error, raise};

/// A `kvtier.layout.PagedPool` (its `regions`, `num_blocks` rows each, `layer_regions` and
/// `num_blocks`; see `kvtier_core::paged`), every region checked writable, plain bytes, a whole
/// number of rows and pairwise disjoint. The buffers are returned with the pool: keep them alive
/// (they hold the exporters' views) while the pool is used.
pub(crate) fn paged_pool(pool: &Bound<'_, PyAny>) -> PyResult<(Vec<Buffer>, PagedPool)> {
    let regions: Vec<Bound<'_, PyAny>> = attr(pool, "regions", "a list of arrays")?;
    let layer_regions: Vec<usize> = attr(pool, "layer_regions", "a list of region counts (ints >= 1)")?;
    let num_blocks: usize = attr(pool, "num_blocks", "an int >= 1")?;
    let bufs: Vec<Buffer> = regions
        .iter()
        .map(|r| Buffer::get(r, "pool region", true, Format::Bytes))
        .collect::<PyResult<_>>()?;
    for (i, a) in bufs.iter().enumerate() {
        if num_blocks == 0 || a.len() % num_blocks != 0 {
            return Err(buffer_error(format!(
                "pool region {i} has {} bytes; expected a whole number of bytes for each of {num_blocks} blocks",
                a.len()
            )));
        }
    }
    ensure_all_disjoint(&bufs)?;
    let parts: Vec<(*mut u8, usize)> = bufs.iter().map(|b| (b.ptr(), b.len() / num_blocks)).collect();
    // SAFETY: each region is a live writable buffer of `num_blocks * block_len` bytes (checked),
    // the regions are disjoint (checked), and the returned buffers keep the views alive for as
    // long as the caller keeps them with the pool.
    let pool = unsafe { PagedPool::from_regions(&parts, &layer_regions, num_blocks) }.map_err(raise)?;
    Ok((bufs, pool))
}

/// Attribute `name` of a pool, converted; an error names it and what was `expected`.
fn attr<'py, T: FromPyObject<'py>>(pool: &Bound<'py, PyAny>, name: &str, expected: &str) -> PyResult<T> {
    let value = pool
        .getattr(name)
        .map_err(|_| buffer_error(format!("pool has no `{name}`; expected a kvtier.layout.PagedPool")))?;
    value.extract().map_err(|e| buffer_error(format!("pool `{name}` is not {expected}: {e}")))
}

/// Layers of a layerwise load that are in place ([`kvtier_core::progress::LayerProgress`]): the
/// loading thread advances it, engine threads wait for a layer with the GIL released. One per
/// load ([`LayerProgress::claim`]): it only moves forward, so a second load's waiters would
/// return before that load's layers land.
#[pyclass(frozen, module = "kvtier._core")]
pub struct LayerProgress {
    pub(crate) inner: Arc<Progress>,
    /// Given to a load (that did not fail before copying).
    claimed: AtomicBool,
}

impl LayerProgress {
    /// Takes this progress for one load; errors if a load already has it or it is closed (its
    /// waits would not wait). Give it back with [`Self::unclaim`] if the load fails before
    /// copying anything.
    pub(crate) fn claim(&self) -> PyResult<()> {
        let state = if self.inner.closed() {
            "is closed".to_string()
        } else if self.claimed.swap(true, Ordering::AcqRel) {
            format!("was given to a load ({} layers done)", self.inner.done_layers())
        } else {
            return Ok(());
        };
        Err(buffer_error(format!("progress {state}; expected a fresh LayerProgress for each load")))
    }

    pub(crate) fn unclaim(&self) {
        self.claimed.store(false, Ordering::Release);
    }
}

#[pymethods]
impl LayerProgress {
    #[new]
    fn new() -> Self {
        LayerProgress { inner: Arc::default(), claimed: AtomicBool::new(false) }
    }

    /// Waits until layer `layer` is in place or the load ended (closed); True unless
    /// `timeout_s` passed first (one past what the clock holds, inf included, is none).
    #[pyo3(signature = (layer, timeout_s=None))]
    fn wait(&self, py: Python<'_>, layer: &Bound<'_, PyAny>, timeout_s: Option<f64>) -> PyResult<bool> {
        let index = if layer.is_instance_of::<PyBool>() { None } else { layer.extract::<usize>().ok() };
        let layer = index
            .ok_or_else(|| buffer_error(format!("layer {layer} is not a layer; expected an int >= 0")))?;
        if let Some(t) = timeout_s.filter(|t| t.is_nan() || *t < 0.0) {
            return Err(buffer_error(format!("timeout_s is {t}; expected seconds >= 0 (None: no timeout)")));
        }
        let timeout = timeout_s.and_then(|t| Duration::try_from_secs_f64(t).ok());
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let inner = self.inner.clone();
        Ok(py.allow_threads(move || inner.wait(layer, deadline)))
    }

    /// Layers in place so far.
    #[getter]
    fn done_layers(&self) -> usize {
        self.inner.done_layers()
    }

    /// The load ended (done or failed): every waiter returns now and later waits do not block.
    fn close(&self) {
        self.inner.close();
    }

    #[getter]
    fn closed(&self) -> bool {
        self.inner.closed()
    }
}
