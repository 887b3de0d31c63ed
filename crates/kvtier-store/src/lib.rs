//! kvtier-store: the public store API — a hierarchy of tiers (DRAM, then an optional SSD pool,
//! then an optional remote Redis/Valkey tier) behind one namespace, answering "which prefix of
//! these blocks is cached, and where", and
//! moving verified bytes in and out. The Python bindings (`kvtier._core`) call exactly this.
//!
//! ```
//! use kvtier_core::{block_keys, Dtype, Geometry, Namespace};
//! use kvtier_store::{DramStoreConfig, Store, StoreConfig};
//!
//! let geometry = Geometry::new(2, 2, 64, Dtype::F16, 16, vec![]).unwrap();
//! let namespace = Namespace { model_id: "demo".into(), geometry, layout_version: 1, cache_salt: String::new(), rank: 0 };
//! let config = StoreConfig { dram: DramStoreConfig::new(1 << 20), ..StoreConfig::default() };
//! let store = Store::new(namespace, config).unwrap();
//! let ns = store.namespace_hash();
//! let keys = block_keys(ns, &(0..64).collect::<Vec<u32>>(), 16, &[]).unwrap();
//! let block = vec![7u8; store.block_bytes()];
//! store.put(ns, &keys[..2], &[&block, &block]).unwrap();
//!
//! let lease = store.lease(ns, &keys).unwrap();           // hit prefix pinned
//! assert_eq!(lease.hit_blocks, 2);
//! let mut a = vec![0u8; store.block_bytes()];
//! let mut b = vec![0u8; store.block_bytes()];
//! let report = store.load(lease.id, &mut [&mut a, &mut b]).unwrap();
//! assert_eq!(report.loaded_blocks, 2);
//! assert_eq!(a, block);
//! store.release(lease.id).unwrap();
//! ```
//!
//! Invariants:
//! - **No wrong KV**: a block's bytes are returned only after its checksum, key and namespace
//!   verify; a corrupt block is counted, dropped, and ends the loaded prefix. A store serves one
//!   namespace: calls with another namespace hash are errors, and keys of another namespace
//!   never match (they are chained from a different seed).
//! - **Leases**: a leased block is not evicted until the lease is released or its TTL passes,
//!   and never while a load from it is copying. At most `leases_max` leases exist.
//! - **Bounded**: no tier exceeds its capacity; a full tier evicts unpinned blocks or rejects.
//! - **Prefixes**: lookups report the longest *consecutive* prefix present, because a block's KV
//!   is only usable with every block before it.
//! - **Hierarchy** (with [`StoreConfig::ssd`]): blocks DRAM gives up are written to SSD before
//!   they leave DRAM (write-back, after `admission_k` accesses); blocks loaded from SSD are
//!   copied into DRAM; the SSD pool recovers what its index log names when the store opens.
//! - **Remote** (with [`StoreConfig::remote`]): puts are written through to the server (or, in
//!   write-back mode, DRAM's victims are); blocks loaded from it are verified and copied into
//!   DRAM. The server is shared and may drop blocks at any time, so a remote block located by a
//!   lease may be gone at load: that load ends there (a miss, counted in `load_missing`).
//! - **Clear is a barrier** ([`Store::clear`]) within this process: it waits for the writes and
//!   loads in flight, and once it returns no write that began before it lands, no load returns
//!   bytes put before it, and leases granted before it miss. Other processes sharing the remote
//!   tier are not fenced.
//!
//! [`Store::check_integrity`] verifies all of this (allocator accounting, index and extents,
//! object headers, and that pin counts equal what active leases hold).

mod codec_stage;
pub mod config;
pub mod error;
mod hierarchy;
mod hooks;
mod lease;
mod levels;
pub mod stats;
mod store;
mod types;

pub use config::{DramStoreConfig, RemoteStoreConfig, SsdStoreConfig, StoreConfig, TierCodec};
pub use error::StoreError;
#[cfg(feature = "test-hooks")]
pub use hooks::{Hook, HookPoint};
pub use kvtier_core::{BlockKey, Namespace};
pub use kvtier_pool::ssd::{SsdDeviceReport, SsdMetrics};
pub use kvtier_pool::{Durability, IoEngineKind, Placement, PoolError, SsdConfig, TierKind, TierStats};
pub use kvtier_remote::{RemoteConfig, RemoteMetrics};
pub use stats::StoreStats;
pub use store::Store;
pub use types::{
    Lease, LoadReport, Lookup, PoolLoadReport, PutReport, StoredBlock, StoredLoadReport, TierWrites,
};
