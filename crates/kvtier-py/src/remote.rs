//! The remote tier for Python: metrics as dicts, and `RemotePool` — the tier on its own (benchmarks, tests, tools), with
//! raw GET/SET of plain values for the raw-client baseline (`bench-baselines` feature). The GIL is released while bytes
//! move.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use kvtier_pool::{ReadOutcome, Tier};
use kvtier_remote::{RemoteMetrics, RemoteTier};

use crate::args::{Key, Keys, NamespaceHash};
use crate::blocks::{read_blocks, write_blocks};
use crate::config::{remote_client_config, Section};
use crate::errors::{config_error, kvtier_error};
use crate::reports::{add_fields, fields_dict};

/// `url` with its password replaced by `***` (what every message shows).
#[pyfunction]
pub fn redact_url(url: &str) -> String {
    kvtier_remote::config::redact_url(url)
}

/// Parses `url` as the client will (scheme, user, host, port, database); a `ConfigError` that
/// shows it redacted if it is not one.
#[pyfunction]
pub fn check_url(url: &str) -> PyResult<()> {
    kvtier_remote::config::parse_url(url).map(|_| ()).map_err(|e| config_error(e.to_string()))
}

/// The remote tier's metrics as nested dicts (JSON-ready).
pub fn metrics_dict<'py>(py: Python<'py>, m: &RemoteMetrics) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (name, op) in [("exists", &m.exists), ("get", &m.get), ("set", &m.set), ("del", &m.del)] {
        d.set_item(name, fields_dict(py, op)?)?;
    }
    add_fields(&d, m)?;
    Ok(d)
}

/// The remote tier alone, for one namespace.
#[pyclass(frozen, name = "RemotePool", module = "kvtier._core")]
pub struct RemotePool {
    tier: RemoteTier,
    namespace: u128,
}

#[pymethods]
impl RemotePool {
    /// The tier `config` describes (a `kvtier.RemoteConfig` or a mapping of its keys,
    /// `crate::config::remote_client_config`), for the namespace `namespace_hash`.
    #[new]
    fn new(py: Python<'_>, config: &Bound<'_, PyAny>, namespace_hash: NamespaceHash) -> PyResult<Self> {
        let config =
            Section::root(config, "remote config", "remote", "RemoteConfig")?.read(remote_client_config)?;
        let tier = py
            .allow_threads(|| RemoteTier::open(config, namespace_hash.0))
            .map_err(|e| kvtier_error("ConfigError", format!("remote: {e}")))?;
        Ok(RemotePool { tier, namespace: namespace_hash.0 })
    }

    /// The server key of block `key` (16 bytes).
    fn key_name<'py>(&self, py: Python<'py>, key: Key) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.tier.key_name(self.namespace, key.0))
    }

    /// Stores objects of `block_bytes` each. Returns (stored, already_present, rejected).
    fn put(
        &self,
        py: Python<'_>,
        keys: Keys,
        objects: &Bound<'_, PyAny>,
        block_bytes: usize,
    ) -> PyResult<(usize, usize, usize)> {
        let r = read_blocks(objects, "objects", keys.0.len(), block_bytes, |objects| {
            py.allow_threads(|| self.tier.put(self.namespace, &keys.0, objects))
        })?;
        Ok((r.stored, r.already_present, r.rejected))
    }

    /// Loads and verifies blocks into `out`; returns one outcome name per key. A value of another
    /// size is "wrong_length", left on the server: `block_bytes` may be the caller's mistake.
    fn get(
        &self,
        py: Python<'_>,
        keys: Keys,
        out: &Bound<'_, PyAny>,
        block_bytes: usize,
    ) -> PyResult<Vec<&'static str>> {
        let outcomes = write_blocks(out, "out", keys.0.len(), block_bytes, |dst| {
            py.allow_threads(|| self.tier.read_blocks_sized(self.namespace, &keys.0, dst))
        })?;
        Ok(outcomes.into_iter().map(|o| o.map_or("wrong_length", ReadOutcome::name)).collect())
    }

    /// Which keys exist: True, False, or None (server down).
    fn exists(&self, py: Python<'_>, keys: Keys) -> Vec<Option<bool>> {
        py.allow_threads(|| self.tier.exists(self.namespace, &keys.0))
    }

    /// Deletes blocks; returns how many existed.
    fn remove(&self, py: Python<'_>, keys: Keys) -> usize {
        py.allow_threads(|| self.tier.remove(self.namespace, &keys.0))
    }

    /// Plain `SET name value` of each value of `value_bytes` (the raw-client baseline; also plants
    /// test values). Returns one result name per name.
    #[cfg(feature = "bench-baselines")]
    fn raw_set(
        &self,
        py: Python<'_>,
        names: Vec<Vec<u8>>,
        values: &Bound<'_, PyAny>,
        value_bytes: usize,
    ) -> PyResult<Vec<&'static str>> {
        crate::baselines::raw_set(py, &self.tier, &names, values, value_bytes)
    }

    /// Plain `GET name` of each name into `out` (values of exactly `value_bytes`), no checks.
    #[cfg(feature = "bench-baselines")]
    fn raw_get(
        &self,
        py: Python<'_>,
        names: Vec<Vec<u8>>,
        out: &Bound<'_, PyAny>,
        value_bytes: usize,
    ) -> PyResult<Vec<&'static str>> {
        crate::baselines::raw_get(py, &self.tier, &names, out, value_bytes)
    }

    /// Plain `DEL name` of each name; returns how many existed.
    #[cfg(feature = "bench-baselines")]
    fn raw_del(&self, py: Python<'_>, names: Vec<Vec<u8>>) -> usize {
        crate::baselines::raw_del(py, &self.tier, &names)
    }

    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        metrics_dict(py, &self.tier.metrics())
    }
}
