//! Rust errors → the Python exceptions of `kvtier.errors` (all under `KvtierError`).
//! The classes live in Python so users and mypy see them as ordinary Python classes.
//!
//! Each Rust error type names its class once, in its [`Raise`] impl here; bindings raise it with
//! `.map_err(raise)`.

use pyo3::prelude::*;
use pyo3::types::PyType;

use kvtier_codec::CodecError;
use kvtier_core::tier::IntegrityError;
use kvtier_core::{GeometryError, KeyError, LayoutError, ObjectError};
use kvtier_pool::PoolError;
use kvtier_store::StoreError;
use kvtier_transfer::TransferError;

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

/// A Rust error raised in Python as one class of `kvtier`.
pub trait Raise: std::fmt::Display {
    /// The class: a name in `kvtier.errors`, or a dotted `module.Class`.
    fn class(&self) -> &'static str;
}

/// `e` as its Python exception ([`Raise`]).
pub fn raise(e: impl Raise) -> PyErr {
    let class = e.class();
    let (module, name) = class.rsplit_once('.').unwrap_or(("kvtier.errors", class));
    error_in(module, name, e.to_string())
}

/// For each error type, the class each of its variants raises as.
macro_rules! raise_as {
    ($($ty:ident { $($pat:pat => $class:literal),+ $(,)? })+) => {$(
        impl Raise for $ty {
            fn class(&self) -> &'static str {
                match self {
                    $($pat => $class),+
                }
            }
        }
    )+};
}

raise_as! {
    GeometryError { _ => "GeometryError" }
    KeyError { _ => "KeyHashError" }
    ObjectError { _ => "ObjectFormatError" }
    IntegrityError { _ => "IntegrityError" }
    LayoutError {
        LayoutError::BufferSize { .. } | LayoutError::ObjectSize { .. } => "BufferError",
        _ => "LayoutError",
    }
    StoreError {
        StoreError::NamespaceMismatch { .. } => "NamespaceError",
        StoreError::ObjectSize { .. } | StoreError::CountMismatch { .. } => "BufferError",
        StoreError::LeaseUnknown { .. }
        | StoreError::LeaseExpired { .. }
        | StoreError::LeaseEnded { .. }
        | StoreError::LeaseLimit { .. }
        | StoreError::LoadTooMany { .. } => "LeaseError",
        StoreError::Config(_) => "ConfigError",
        StoreError::Layout(_) => "LayoutError",
        StoreError::Integrity(_) | StoreError::TierIntegrity(_) => "IntegrityError",
        _ => "StoreError",
    }
    // `kvtier.transfer.TransferError` (a `KvtierError`): bounds reached, unknown jobs, duplex misuse.
    TransferError {
        TransferError::Config(_) => "ConfigError",
        TransferError::PoolSize { .. } | TransferError::CountMismatch { .. } => "BufferError",
        TransferError::Store(_) => "StoreError",
        TransferError::Layout(_) => "LayoutError",
        _ => "kvtier.transfer.TransferError",
    }
    // `kvtier.codec.CodecError`, or its subclass `NonFiniteError` for NaN/inf given to `quant`.
    CodecError {
        CodecError::NonFinite { .. } => "kvtier.codec.NonFiniteError",
        _ => "kvtier.codec.CodecError",
    }
    PoolError { PoolError::SsdConfig(_) => "ConfigError", PoolError::BufferSize { .. } => "BufferError", _ => "StoreError" }
}
