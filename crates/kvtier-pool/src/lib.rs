//! kvtier-pool: the tiers of the KV-cache hierarchy — where block objects live, and the space
//! accounting, eviction and pinning around them. `kvtier-store` composes tiers into a
//! hierarchy; this crate knows nothing about leases, namespaces of its callers or Python.
//!
//! - [`tier`]: the batched [`Tier`] trait every tier implements, and [`TierKind`].
//! - [`dram`]: host memory — a page-aligned [`arena`] + an [`extent`] allocator + an
//!   [`eviction`] policy + an index.
//! - [`ssd`]: the unified SSD pool — devices opened with O_DIRECT, an extent allocator per
//!   device, a global lookup table, bandwidth-aware placement, an I/O worker per device
//!   (io_uring or pread/pwrite) and a crash-safe index log.
//! - [`noop`]: stores nothing (tests, overhead measurement).
//! - [`eviction`]: LRU and S3-FIFO behind [`EvictionPolicy`], with a name registry.
//!
//! Invariants every tier keeps (and checks in [`Tier::check_integrity`]):
//! - capacity is a hard bound: when full, a tier evicts unpinned blocks or rejects the put;
//!   used bytes never exceed capacity;
//! - a pinned block is never evicted, freed or overwritten while pinned;
//! - bytes are returned only after their checksum verifies; a corrupt block is doomed (a miss
//!   from then on) and counted, never served;
//! - objects are content-addressed: putting a key that is present (or being written) is a no-op.

pub mod arena;
pub mod dram;
pub mod error;
pub mod eviction;
pub mod extent;
pub mod hash;
pub mod noop;
pub mod ssd;
pub use kvtier_core::tier;

pub use dram::demote::{Demotion, Victim};
pub use dram::pinned::{PinnedPage, PinnedPages};
pub use dram::{object_extent_bytes, DramTier};
pub use error::PoolError;
pub use eviction::{by_name as eviction_by_name, EvictionPolicy, POLICY_NAMES};
pub use extent::{Extent, ExtentAllocator, PAGE_BYTES};
pub use noop::NoopTier;
pub use ssd::{Durability, IoEngineKind, Placement, SsdConfig, SsdTier};
pub use tier::{
    ClearError, EntryRef, IntegrityError, Located, ReadOutcome, Tier, TierKind, TierPutReport, TierStats,
};
