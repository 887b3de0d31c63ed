//! The `Store` for Python: put/lookup/lease/load/release over caller buffers, GIL released
//! while bytes move. Namespace checks happen here and again in the Rust store.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use kvtier_store::Store as CoreStore;

use crate::args::{BlockIds, Keys, NamespaceHash};
use crate::blocks::{read_blocks, write_blocks};
use crate::config::store_config;
use crate::errors::raise;
use crate::paged::{paged_pool, LayerProgress};
use crate::remote::metrics_dict as remote_metrics_dict;
use crate::reports::{StoreStats, TierStats};
use crate::ssd::metrics_dict;

/// A put's (stored, present, rejected, evicted, written to DRAM, SSD, remote).
type PutTuple = (usize, usize, usize, usize, usize, usize, usize);

fn put_tuple(r: &kvtier_store::PutReport) -> PutTuple {
    (r.stored, r.already_present, r.rejected, r.evicted, r.written.dram, r.written.ssd, r.written.remote)
}

#[pyclass(frozen, name = "Store", module = "kvtier._core")]
pub struct Store {
    pub(crate) inner: CoreStore,
}

#[pymethods]
impl Store {
    /// A store from one `kvtier.StoreConfig` (or a mapping of its keys), read by
    /// `crate::config::store_config`.
    #[new]
    fn new(py: Python<'_>, config: &Bound<'_, PyAny>) -> PyResult<Self> {
        let (namespace, config) = store_config(config)?;
        namespace.hash().map_err(raise)?;
        let inner = py.allow_threads(|| CoreStore::new(namespace, config)).map_err(raise)?;
        Ok(Store { inner })
    }

    #[getter]
    fn namespace_hash(&self) -> [u8; 16] {
        self.inner.namespace_hash().to_le_bytes()
    }

    #[getter]
    fn block_bytes(&self) -> usize {
        self.inner.block_bytes()
    }

    /// Returns (stored, already_present, rejected, evicted).
    fn put(
        &self,
        py: Python<'_>,
        namespace_hash: NamespaceHash,
        keys: Keys,
        objects: &Bound<'_, PyAny>,
    ) -> PyResult<PutTuple> {
        let r = read_blocks(objects, "objects", keys.0.len(), self.inner.block_bytes(), |objects| {
            py.allow_threads(|| self.inner.put(namespace_hash.0, &keys.0, objects))
        })?
        .map_err(raise)?;
        Ok(put_tuple(&r))
    }

    /// Stores blocks `block_ids` of an engine's `PagedPool` under `keys`, one copy into DRAM when
    /// DRAM is the only tier. Returns a put's [`PutTuple`].
    fn put_from_pool(
        &self,
        py: Python<'_>,
        namespace_hash: NamespaceHash,
        keys: Keys,
        pool: &Bound<'_, PyAny>,
        block_ids: BlockIds,
    ) -> PyResult<PutTuple> {
        // `_views` holds the exporters' buffers until the copy is done.
        let (_views, pool) = paged_pool(pool)?;
        let r = py
            .allow_threads(|| self.inner.put_from_pool(namespace_hash.0, &keys.0, &pool, &block_ids.0))
            .map_err(raise)?;
        Ok(put_tuple(&r))
    }

    /// Returns (hit_blocks, tier name per hit block).
    fn lookup(
        &self,
        py: Python<'_>,
        namespace_hash: NamespaceHash,
        keys: Keys,
    ) -> PyResult<(usize, Vec<&'static str>)> {
        let r = py.allow_threads(|| self.inner.lookup(namespace_hash.0, &keys.0)).map_err(raise)?;
        Ok((r.hit_blocks, r.tiers.iter().map(|t| t.name()).collect()))
    }

    /// Returns the tier name holding each key, or None, key by key (`Store::lookup_each`).
    fn lookup_each(
        &self,
        py: Python<'_>,
        namespace_hash: NamespaceHash,
        keys: Keys,
    ) -> PyResult<Vec<Option<&'static str>>> {
        let r = py.allow_threads(|| self.inner.lookup_each(namespace_hash.0, &keys.0)).map_err(raise)?;
        Ok(r.iter().map(|t| t.map(|t| t.name())).collect())
    }

    /// Returns (lease id, hit_blocks, tier name per hit block).
    fn lease(
        &self,
        py: Python<'_>,
        namespace_hash: NamespaceHash,
        keys: Keys,
    ) -> PyResult<(u64, usize, Vec<&'static str>)> {
        let r = py.allow_threads(|| self.inner.lease(namespace_hash.0, &keys.0)).map_err(raise)?;
        Ok((r.id, r.hit_blocks, r.tiers.iter().map(|t| t.name()).collect()))
    }

    /// Loads the first `count` leased blocks into `out`. Returns (loaded_blocks, checksum_failures).
    fn load(
        &self,
        py: Python<'_>,
        lease_id: u64,
        out: &Bound<'_, PyAny>,
        count: usize,
    ) -> PyResult<(usize, usize)> {
        let r = write_blocks(out, "out", count, self.inner.block_bytes(), |dst| {
            py.allow_threads(|| self.inner.load(lease_id, dst))
        })?
        .map_err(raise)?;
        Ok((r.loaded_blocks, r.checksum_failures))
    }

    /// Leased blocks `first..` straight into blocks `block_ids` of an engine's `PagedPool` (see
    /// `kvtier_core::paged`), layer by layer, advancing `progress` as each layer lands. Returns
    /// (loaded prefix, failed positions, checksum failures).
    #[pyo3(signature = (lease_id, first, pool, block_ids, progress=None))]
    fn load_into_pool(
        &self,
        py: Python<'_>,
        lease_id: u64,
        first: usize,
        pool: &Bound<'_, PyAny>,
        block_ids: BlockIds,
        progress: Option<Py<LayerProgress>>,
    ) -> PyResult<(usize, Vec<usize>, usize)> {
        // `_views` holds the exporters' buffers until the copy is done.
        let (_views, pool) = paged_pool(pool)?;
        let progress = progress.as_ref().map(|p| p.get());
        progress.map(LayerProgress::claim).transpose()?;
        let report = py.allow_threads(|| {
            self.inner.load_into_pool(lease_id, first, &pool, &block_ids.0, &mut |layer| {
                progress.inspect(|p| p.inner.advance(layer + 1));
            })
        });
        // Refused before any copy: the progress never moved, the next load may have it.
        let r =
            report.inspect_err(|_| progress.into_iter().for_each(LayerProgress::unclaim)).map_err(raise)?;
        Ok((r.loaded_blocks, r.failed, r.checksum_failures))
    }

    fn release(&self, lease_id: u64) -> PyResult<()> {
        self.inner.release(lease_id).map_err(raise)
    }

    fn stats(&self, py: Python<'_>) -> PyResult<StoreStats> {
        StoreStats::new(py, &self.inner.stats())
    }

    /// Per tier (name → stats), fastest first.
    fn tier_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for (kind, t) in self.inner.tier_stats() {
            out.set_item(kind.name(), TierStats::new(py, &t)?)?;
        }
        Ok(out)
    }

    /// The SSD pool's metrics, or None without an SSD tier.
    fn ssd_metrics<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        py.allow_threads(|| self.inner.ssd_metrics()).map(|m| metrics_dict(py, &m)).transpose()
    }

    /// The remote tier's metrics, or None without a remote tier.
    fn remote_metrics<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        py.allow_threads(|| self.inner.remote_metrics()).map(|m| remote_metrics_dict(py, &m)).transpose()
    }

    /// Drops every block of this store's namespace from every tier; returns how many.
    fn clear(&self, py: Python<'_>) -> PyResult<usize> {
        py.allow_threads(|| self.inner.clear()).map_err(raise)
    }

    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        py.allow_threads(|| self.inner.flush()).map_err(raise)
    }

    fn check_integrity(&self, py: Python<'_>) -> PyResult<()> {
        py.allow_threads(|| self.inner.check_integrity()).map_err(raise)
    }

    #[cfg(feature = "test-hooks")]
    fn corrupt_for_test(&self, key: crate::args::Key, payload_byte_offset: usize) -> bool {
        self.inner.corrupt_for_test(key.0, payload_byte_offset)
    }
}
