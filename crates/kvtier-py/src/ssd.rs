//! The SSD pool for Python: its metrics as dicts, the
//! pool-level `SsdPool` (benchmarks and tests; users go through `Store`) and Algorithm 1's
//! counts. The baselines of `kvtier bench ssd` are in `baselines`.

use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use kvtier_pool::ssd::{placement, SsdMetrics};
use kvtier_pool::{ReadOutcome, SsdTier, Tier};

use crate::args::{Keys, NamespaceHash};
use crate::blocks::{read_blocks, write_blocks};
use crate::config::{ssd_pool_config, Section};
use crate::errors::{config_error, kvtier_error, raise};
use crate::reports::{add_fields, fields_dict};

/// The pool's metrics as nested dicts (JSON-ready); each device's dict has its `io` fields too.
pub fn metrics_dict<'py>(py: Python<'py>, m: &SsdMetrics) -> PyResult<Bound<'py, PyDict>> {
    let d = fields_dict(py, m)?;
    add_fields(&d, &m.tier)?;
    d.set_item("recovery", fields_dict(py, &m.recovery)?)?;
    let devices = PyList::empty(py);
    for dev in &m.devices {
        let x = fields_dict(py, dev)?;
        add_fields(&x, &dev.io)?;
        devices.append(x)?;
    }
    d.set_item("devices", devices)?;
    d.set_item("warnings", &m.warnings)?;
    Ok(d)
}

/// The SSD pool on its own (no DRAM tier, no leases): for benchmarks and tests.
#[pyclass(frozen, name = "SsdPool", module = "kvtier._core")]
pub struct SsdPool {
    inner: Mutex<Option<Arc<SsdTier>>>,
}

impl SsdPool {
    fn tier(&self) -> PyResult<Arc<SsdTier>> {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| kvtier_error("StoreError", "the ssd pool is closed".into()))
    }
}

#[pymethods]
impl SsdPool {
    /// Opens (or creates) the pool `config` describes (a `kvtier.SsdConfig` or a mapping of its
    /// keys, `crate::config::ssd_pool_config`).
    #[new]
    fn new(py: Python<'_>, config: &Bound<'_, PyAny>) -> PyResult<Self> {
        let c = Section::root(config, "ssd config", "ssd", "SsdConfig")?.read(ssd_pool_config)?;
        let tier = py.allow_threads(|| SsdTier::open(c)).map_err(raise)?;
        Ok(SsdPool { inner: Mutex::new(Some(Arc::new(tier))) })
    }

    /// Stores `count` objects of `object_bytes` each. Returns (stored, already_present, rejected, evicted).
    fn put(
        &self,
        py: Python<'_>,
        namespace_hash: NamespaceHash,
        keys: Keys,
        objects: &Bound<'_, PyAny>,
        object_bytes: usize,
    ) -> PyResult<(usize, usize, usize, usize)> {
        let tier = self.tier()?;
        let r = read_blocks(objects, "objects", keys.0.len(), object_bytes, |objects| {
            py.allow_threads(|| tier.put(namespace_hash.0, &keys.0, objects))
        })?;
        Ok((r.stored, r.already_present, r.rejected, r.evicted))
    }

    /// Reads `keys` into `out`; one outcome name per key ("loaded", "miss", "corrupt", ...).
    fn get(
        &self,
        py: Python<'_>,
        namespace_hash: NamespaceHash,
        keys: Keys,
        out: &Bound<'_, PyAny>,
        object_bytes: usize,
    ) -> PyResult<Vec<&'static str>> {
        let tier = self.tier()?;
        let outcomes = write_blocks(out, "out", keys.0.len(), object_bytes, |dst| {
            py.allow_threads(|| tier.get(namespace_hash.0, &keys.0, dst))
        })?
        .map_err(raise)?;
        Ok(outcomes.into_iter().map(|o| o.map_or("miss", ReadOutcome::name)).collect())
    }

    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let tier = self.tier()?;
        metrics_dict(py, &py.allow_threads(|| tier.metrics()))
    }

    fn check_integrity(&self, py: Python<'_>) -> PyResult<()> {
        let tier = self.tier()?;
        py.allow_threads(|| tier.check_integrity()).map_err(raise)
    }

    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let tier = self.tier()?;
        py.allow_threads(|| tier.flush())
            .map_err(|e| kvtier_error("StoreError", format!("flushing the ssd pool: {e}")))
    }

    /// Closes the pool (its files and directory lock are released once calls in flight end).
    fn close(&self, py: Python<'_>) {
        let tier = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        py.allow_threads(move || drop(tier));
    }
}

/// Algorithm 1: how many of `n` objects each device of these bandwidths gets.
#[pyfunction]
pub fn ssd_placement_counts(bandwidths: Vec<f64>, n: usize) -> PyResult<Vec<usize>> {
    if bandwidths.is_empty() {
        return Err(config_error("bandwidths is empty; expected one per device".into()));
    }
    Ok(placement::algorithm1_counts(&bandwidths, n))
}
