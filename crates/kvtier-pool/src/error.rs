//! Errors of kvtier-pool. Messages name the wrong value and the expected one, because they reach
//! users verbatim (through `StoreError` and the Python exceptions).

pub use kvtier_core::tier::IntegrityError;
use thiserror::Error;

/// Failures of building or checking a tier. A miss or a full tier is a value, never one of these.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum PoolError {
    #[error("unknown eviction policy {name:?}; expected one of: {known}")]
    UnknownEviction { name: String, known: String },
    #[error("tier capacity is {bytes} bytes; expected at least one {page}-byte page")]
    CapacityTooSmall { bytes: u64, page: u64 },
    #[error("could not reserve a {bytes}-byte host arena: {reason}")]
    ArenaReserve { bytes: u64, reason: String },
    /// A setting or the state of the SSD pool's files a user must fix (missing directory, a
    /// device too small, not enough free space, a pool directory in use, devices of another pool).
    #[error("ssd pool: {0}")]
    SsdConfig(String),
    /// An I/O failure of the SSD pool the caller must see (opening or recovering it).
    #[error("ssd pool: {what} {path:?} failed: {reason}")]
    SsdIo { what: &'static str, path: String, reason: String },
    /// A read buffer that is not the size of the object it would receive (a caller bug, found
    /// before anything is read).
    #[error(
        "ssd pool: read buffer {index} holds {buffer} bytes; the stored object holds {stored} bytes \
         (expected buffers of the stored objects' size)"
    )]
    BufferSize { index: usize, buffer: u64, stored: u64 },
    #[error(transparent)]
    Integrity(#[from] IntegrityError),
}

pub(crate) use kvtier_core::tier::integrity;
