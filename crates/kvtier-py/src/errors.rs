//! Rust errors → the Python exceptions of `kvtier.errors` (all under `KvtierError`).
//! The classes live in Python so users and mypy see them as ordinary Python classes.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyType};

use kvtier_core::{GeometryError, KeyError, LayoutError, ObjectError};

/// Builds an instance of `<module>.<class_name>` (a Python class under `KvtierError`) with `msg`.
pub fn error_in(module: &str, class_name: &str, msg: String) -> PyErr {
    Python::with_gil(|py| {
        let cls = py
            .import(module)
            .and_then(|m| m.getattr(class_name))
            .and_then(|c| c.downcast_into::<PyType>().map_err(PyErr::from));
        match cls {
            Ok(cls) => PyErr::from_type(cls, msg),
            Err(e) => e,
        }
    })
}

/// Builds an instance of `kvtier.errors.<class_name>` with `msg`.
pub fn kvtier_error(class_name: &str, msg: String) -> PyErr {
    error_in("kvtier.errors", class_name, msg)
}

pub fn buffer_error(msg: String) -> PyErr {
    kvtier_error("BufferError", msg)
}

pub fn config_error(msg: String) -> PyErr {
    kvtier_error("ConfigError", msg)
}

pub fn geometry_err(e: GeometryError) -> PyErr {
    kvtier_error("GeometryError", e.to_string())
}

pub fn key_err(e: KeyError) -> PyErr {
    kvtier_error("KeyHashError", e.to_string())
}

pub fn layout_err(e: LayoutError) -> PyErr {
    let class = match e {
        LayoutError::BufferSize { .. } | LayoutError::ObjectSize { .. } => "BufferError",
        _ => "LayoutError",
    };
    kvtier_error(class, e.to_string())
}

pub fn object_err(e: ObjectError) -> PyErr {
    kvtier_error("ObjectFormatError", e.to_string())
}

/// The value of `key` in `d` (`None` when absent or None); a value of the wrong type is a
/// ConfigError naming `path` (the key's path in the store config, e.g. `ssd.io_depth`).
pub(crate) fn item<'py, T: FromPyObject<'py>>(
    d: &Bound<'py, PyDict>,
    key: &str,
    path: &str,
) -> PyResult<Option<T>> {
    match d.get_item(key)? {
        Some(v) if !v.is_none() => v.extract().map(Some).map_err(|e| config_error(format!("`{path}`: {e}"))),
        _ => Ok(None),
    }
}

/// For each `key` present in the mapping `d` (and not None), sets `c.key` (or `c.field`, written
/// `key => field`) to its value; a value of the wrong type is a ConfigError naming
/// `<prefix><key>` (`prefix` the section's path, e.g. `"ssd."`).
macro_rules! set_present {
    ($d:expr, $prefix:literal, $c:ident { $($key:ident $(=> $field:ident)?),+ $(,)? }) => {
        $(
            if let Some(v) = $crate::errors::item($d, stringify!($key), concat!($prefix, stringify!($key)))? {
                set_present!(@field $c, $key $(, $field)?) = v;
            }
        )+
    };
    (@field $c:ident, $key:ident) => { $c.$key };
    (@field $c:ident, $key:ident, $field:ident) => { $c.$field };
}
pub(crate) use set_present;
