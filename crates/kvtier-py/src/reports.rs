//! Rust report snapshots for Python, from their one field list ([`kvtier_core::Fields`]): as
//! dicts (name → value; the JSON-ready metrics), and as the frozen classes `StoreStats` and
//! `TierStats`, whose attributes are the fields (`_core.pyi` declares them; a test checks it).

use pyo3::prelude::*;
use pyo3::types::PyDict;

use kvtier_core::fields::{Fields, Value};

/// `report`'s fields as a new dict.
pub fn fields_dict<'py>(py: Python<'py>, report: &impl Fields) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    add_fields(&d, report)?;
    Ok(d)
}

/// Adds `report`'s fields to `d`.
pub fn add_fields(d: &Bound<'_, PyDict>, report: &impl Fields) -> PyResult<()> {
    for (k, v) in report.fields() {
        match v {
            Value::U64(v) => d.set_item(k, v),
            Value::F64(v) => d.set_item(k, v),
            Value::Bool(v) => d.set_item(k, v),
            Value::Str(v) => d.set_item(k, v),
        }?;
    }
    Ok(())
}

/// A frozen Python class per report: its fields as read-only attributes, `as_dict()` (a new
/// dict, in declaration order), equality and repr.
macro_rules! report_classes {
    ($($class:ident = $name:literal),+ $(,)?) => {$(
        #[pyclass(frozen, name = $name, module = "kvtier._core")]
        pub struct $class {
            values: Py<PyDict>,
        }

        impl $class {
            pub fn new(py: Python<'_>, report: &impl Fields) -> PyResult<Self> {
                Ok($class { values: fields_dict(py, report)?.unbind() })
            }
        }

        #[pymethods]
        impl $class {
            fn __getattr__<'py>(&self, py: Python<'py>, attr: &str) -> PyResult<Bound<'py, PyAny>> {
                self.values.bind(py).get_item(attr)?.ok_or_else(|| {
                    pyo3::exceptions::PyAttributeError::new_err(format!("'{}' object has no attribute '{attr}'", $name))
                })
            }

            fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
                self.values.bind(py).copy()
            }

            fn __eq__(&self, py: Python<'_>, other: &Self) -> PyResult<bool> {
                self.values.bind(py).eq(other.values.bind(py))
            }

            fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
                let fields: Vec<String> = self
                    .values
                    .bind(py)
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect();
                Ok(format!("{}({})", $name, fields.join(", ")))
            }
        }
    )+};
}

report_classes!(StoreStats = "StoreStats", TierStats = "TierStats");
