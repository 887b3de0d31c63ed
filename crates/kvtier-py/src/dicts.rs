//! Rust counter snapshots as Python dicts (name → int), from their one field list
//! ([`kvtier_core::Counters`]).

use pyo3::prelude::*;
use pyo3::types::PyDict;

use kvtier_core::Counters;

/// `snapshot`'s counters as a new dict.
pub fn counters_dict<'py>(py: Python<'py>, snapshot: &impl Counters) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    add_counters(&d, snapshot)?;
    Ok(d)
}

/// Adds `snapshot`'s counters to `d`.
pub fn add_counters(d: &Bound<'_, PyDict>, snapshot: &impl Counters) -> PyResult<()> {
    for (k, v) in snapshot.counters() {
        d.set_item(k, v)?;
    }
    Ok(())
}
