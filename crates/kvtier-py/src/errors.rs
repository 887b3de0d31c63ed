//! Rust errors → the Python exceptions of `kvtier.errors` (all under `KvtierError`).
//! The classes live in Python so users and mypy see them as ordinary Python classes.

use pyo3::prelude::*;
use pyo3::types::PyType;

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
