//! Errors of the store API. A miss is a value ([`Lookup`](crate::Lookup) with fewer hits),
//! never an error; errors are misuse, bad config, and failures the caller must see. Messages
//! name the wrong value and the expected one: they reach Python users verbatim.

use kvtier_pool::PoolError;
use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error("namespace hash {found:#034x} is not this store's; expected {expected:#034x}")]
    NamespaceMismatch { found: u128, expected: u128 },
    #[error("block buffer {index} is {actual} bytes; expected exactly {expected} bytes (block_bytes)")]
    ObjectSize { index: usize, actual: usize, expected: usize },
    #[error("{keys} keys but {objects} objects; expected one object per key")]
    CountMismatch { keys: usize, objects: usize },
    #[error("lease {id} was never granted by this store; expected an id that `lease` returned")]
    LeaseUnknown { id: u64 },
    #[error("lease {id} expired (its TTL passed and its blocks were unpinned); expected a live lease")]
    LeaseExpired { id: u64 },
    #[error("lease {id} has ended (released, or expired and reclaimed); expected a live lease")]
    LeaseEnded { id: u64 },
    #[error("{max} leases are active; expected fewer than leases_max = {max} (release leases when done)")]
    LeaseLimit { max: usize },
    #[error("load of {requested} blocks; expected at most the {leased} blocks the lease holds")]
    LoadTooMany { requested: usize, leased: usize },
    /// A write that began at epoch `since` ([`crate::Store::put_since`]) after which the store
    /// was cleared: nothing was stored.
    #[error(
        "the store was cleared after this write began (epoch {since}, now {now}): nothing was stored, \
         so KV from before the clear cannot land after it; expected a write that began after the clear"
    )]
    ClearedSince { since: u64, now: u64 },
    #[error("invalid store config: {0}")]
    Config(String),
    #[error(transparent)]
    Tier(#[from] PoolError),
    /// A tier that could not drop the namespace's blocks ([`crate::Store::clear`]).
    #[error(transparent)]
    Clear(#[from] kvtier_core::tier::ClearError),
    /// A pool or block table that does not fit the store (a load into an engine pool).
    #[error(transparent)]
    Layout(#[from] kvtier_core::LayoutError),
    #[error("store integrity check failed: {0}")]
    Integrity(String),
    /// A tier's own check failed ([`kvtier_core::tier::Tier::check_integrity`]).
    #[error(transparent)]
    TierIntegrity(#[from] kvtier_core::tier::IntegrityError),
}
